"""pycoll's own decisions (the tuner's calibration, each algorithm choice) reach the logs only when
PYCOLL_DEBUG asks for them, as NCCL's only under NCCL_DEBUG=INFO: a job whose application sets the
root logger to INFO (Ray Train's workers do) prints none of them without PYCOLL_DEBUG."""
import os
import subprocess
import sys

import pytest

JOB = """
import logging
import numpy as np
logging.basicConfig(level=logging.INFO, format="%(levelname)s:%(name)s:%(message)s")
import pycoll
with pycoll.init() as comm:
    for n in (1, 1000, 100000):
        comm.allreduce(np.ones(n, np.float32))
    comm.broadcast(np.ones(10))
    comm.allgather(np.ones(10))
    logging.getLogger("pycoll.tuner").warning("rank %d: warnings still pass", comm.rank)
"""


def _run_job(tmp_path, debug):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = {k: v for k, v in os.environ.items() if k != "PYCOLL_DEBUG"}
    if debug:
        env["PYCOLL_DEBUG"] = debug
    proc = subprocess.run([sys.executable, "-m", "pycoll", "run", "-n", "2", "--timeout", "60",
                           sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


@pytest.mark.timeout(120)
def test_root_logger_at_info_prints_no_selection_line_without_pycoll_debug(tmp_path):
    out = _run_job(tmp_path, None)
    assert "predicted" not in out and "pycoll.tuner:allreduce" not in out, out
    assert "tuner calibrated" not in out, out
    assert "(default:" not in out, out  # the registry's NAME=value lines (pycoll.config) too
    assert out.count("warnings still pass") == 2, out  # the root handler works; warnings are not hidden


@pytest.mark.timeout(120)
def test_pycoll_debug_info_prints_each_choice(tmp_path):
    out = _run_job(tmp_path, "INFO")
    lines = [line for line in out.splitlines() if "allreduce of 4 B on 2 ranks / 1 hosts: " in line]
    assert lines and all("predicted" in line for line in lines), out

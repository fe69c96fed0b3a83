"""pycoll under Open MPI's mpirun: ranks from OMPI_COMM_WORLD_*, the store address shared via mpi4py."""
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIRUN = shutil.which("mpirun")

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120),
              pytest.mark.skipif(MPIRUN is None, reason="mpirun not installed (apt-get install openmpi-bin)")]


def mpirun(n, *args, env=None):
    """Run `python args` on n ranks under mpirun, as root and oversubscribed, on loopback only."""
    full_env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "OMPI_MCA_btl_tcp_if_include": "lo", "OMPI_MCA_oob_tcp_if_include": "lo",
                "PYTHONPATH": ROOT, **(env or {})}
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PYCOLL_STORE_HOSTED"):
        full_env.pop(var, None)
    return subprocess.run([MPIRUN, "--oversubscribe", "-np", str(n), sys.executable, *args],
                          capture_output=True, text=True, env=full_env, timeout=100, cwd=ROOT)


def test_hello_allreduce_under_mpirun_np_4():
    pytest.importorskip("mpi4py")
    proc = mpirun(4, "examples/hello_allreduce.py")
    assert proc.returncode == 0, proc.stderr
    # mpirun forwards each rank's stdout as it comes, so lines of different ranks may run together
    found = re.findall(r"rank (\d)/4 \(local \d/4\): allreduce\(sum of ranks\) = \[[^\]]*\] (OK|WRONG)",
                       proc.stdout)
    assert sorted(found) == [("0", "OK"), ("1", "OK"), ("2", "OK"), ("3", "OK")], proc.stdout


FT_REFUSED = """
import numpy as np
import pycoll

comm = pycoll.init()
for name, call in (("revoke", comm.revoke), ("agree", lambda: comm.agree(True)), ("shrink", comm.shrink)):
    try:
        call()
        print(f"ACCEPTED {name} on rank {comm.rank}", flush=True)
    except pycoll.PycollError as e:
        print(f"REFUSED {name}: {e}", flush=True)
x = np.ones(4, np.float32)
comm.allreduce(x)  # refusing changed nothing: the communicator still works
print(f"allreduce after on rank {comm.rank}: {x[0]:g}", flush=True)
comm.close()
"""


def test_mpi_transport_refuses_revoke_agree_shrink_with_the_reason():
    """Open MPI 4.1 cannot survive a dead rank: fault-tolerance calls say so instead of pretending."""
    pytest.importorskip("mpi4py")
    proc = mpirun(2, "-c", FT_REFUSED, env={"PYCOLL_TRANSPORT": "mpi", "PYCOLL_TIMEOUT": "30"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ACCEPTED" not in proc.stdout, proc.stdout
    for call in ("revoke", "agree", "shrink"):
        for rank in (0, 1):
            assert re.search(rf"REFUSED {call}: rank {rank}: {call} on world: the mpi transport cannot survive a "
                             r"dead rank \(MPI never reports a dead rank and Open MPI 4\.1 has no ULFM", proc.stdout), \
                proc.stdout
    assert proc.stdout.count("PYCOLL_TRANSPORT=tcp, shm or auto") == 6, proc.stdout
    assert sorted(re.findall(r"allreduce after on rank (\d): 2", proc.stdout)) == ["0", "1"], proc.stdout

"""PYCOLL_TRANSPORT=mpi and the mpi_native algorithm: tests/mpi_matrix_script.py under mpirun, and the
errors a user gets outside mpirun, without mpi4py, or asking mpi_native of another transport."""
import importlib.util
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from mpi_matrix_script import RESULT_PREFIX
from pycoll.algorithms import mpi_native
from pycoll.algorithms.registry import IMPLEMENTATIONS, Selector
from pycoll.channel import Channel
from pycoll.errors import EnvError
from pycoll.ops import ReduceOp
from pycoll.transports import create_transport
from pycoll.transports.mpi import MPI_LAUNCHER_VARS
from test_mpirun import MPIRUN, ROOT, mpirun

pytestmark = pytest.mark.mpi
under_mpirun = pytest.mark.skipif(MPIRUN is None or importlib.util.find_spec("mpi4py") is None,
                                  reason="needs mpirun (apt-get install openmpi-bin) and mpi4py")


def _matrix(n: int, flags: list, env: dict) -> list:
    """Run the script on n ranks over the mpi transport; every rank's result, in rank order."""
    proc = mpirun(n, "tests/mpi_matrix_script.py", *flags,
                  env={"PYCOLL_TRANSPORT": "mpi", "PYCOLL_TIMEOUT": "60", **env})
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    assert len(lines) == 1, proc.stdout[-4000:]
    return json.loads(lines[0][len(RESULT_PREFIX):])["ranks"]


@under_mpirun
@pytest.mark.timeout(150)
@pytest.mark.parametrize("n, flags, env, level", [
    (4, ["--big"], {}, "multiple"),
    (3, [], {}, "multiple"),
    (3, [], {"MPI4PY_RC_THREAD_LEVEL": "serialized"}, "serialized"),  # every MPI call under one lock
])
def test_every_collective_p2p_and_mpi_native_under_mpirun(n, flags, env, level):
    ranks = _matrix(n, flags, env)
    assert len(ranks) == n
    for r, res in enumerate(ranks):
        assert res["checked"] > 0
        assert not res["failures"], f"rank {r}:\n" + "\n".join(res["failures"][:20])
        assert res["thread_level"] == level
    assert ranks[0]["digests"], "no float32 digests recorded"
    for res in ranks[1:]:
        assert res["digests"] == ranks[0]["digests"], "ranks disagree bit-wise on float32 results"


@under_mpirun
@pytest.mark.timeout(60)
def test_pycoll_ranks_must_be_mpi_world_ranks():
    code = ("from pycoll.transports import create_transport\n"
            "try:\n    create_transport('mpi', 0, 2)\n"
            "except Exception as e:\n    print(f'{type(e).__name__}: {e}')")
    proc = mpirun(1, "-c", code)
    assert "EnvError: PYCOLL_TRANSPORT=mpi: pycoll rank 0 of 2 is MPI rank 0 of 1" in proc.stdout, proc.stderr


@pytest.mark.timeout(60)
def test_outside_mpirun_is_a_clear_error():
    env = {k: v for k, v in os.environ.items()
           if k not in MPI_LAUNCHER_VARS + ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYCOLL_TRANSPORT="mpi", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", "import pycoll; pycoll.init()"], capture_output=True,
                          text=True, env=env, timeout=50)
    assert proc.returncode != 0
    assert "EnvError: PYCOLL_TRANSPORT=mpi needs an MPI launcher" in proc.stderr, proc.stderr
    assert "mpirun -np N" in proc.stderr


@pytest.mark.timeout(30)
def test_without_mpi4py_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "1")
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # import mpi4py now fails
    with pytest.raises(EnvError, match=r"needs mpi4py: `pip install pycoll\[mpi\]`"):
        create_transport("mpi", 0, 1)


@pytest.mark.timeout(30)
def test_mpi_native_needs_the_mpi_transport():
    ch = Channel(SimpleNamespace(name="tcp", offers=lambda kind: None), [0, 1], 0, 1, 1, 10.0, "allreduce (call 1 on world)")
    with pytest.raises(ValueError, match="mpi_native needs PYCOLL_TRANSPORT=mpi"):
        mpi_native.allreduce(ch, np.zeros(4, np.float32), ReduceOp.SUM)


@pytest.mark.timeout(30)
def test_mpi_native_is_chosen_only_when_asked_for():
    default = Selector("")
    for coll in IMPLEMENTATIONS:
        for nbytes in (0, 8, 1 << 20, 1 << 26):
            for size in (1, 2, 3, 4, 8):
                assert default.choose(coll, nbytes, size) != "mpi_native", (coll, nbytes, size)
    assert Selector("ring").choose("reduce", 8, 4) == default.choose("reduce", 8, 4)  # no ring reduce: the default
    assert Selector("mpi_native").choose("gather", 8, 4) == "mpi_native"
    assert Selector("allreduce:mpi_native").choose("allreduce", 1 << 20, 4) == "mpi_native"

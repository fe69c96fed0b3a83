"""Make tests/ importable from spawned rank processes and keep pycoll importable from the checkout;
give the whole session (and the ranks it spawns) a private tuner cache, so no test reads numbers
measured outside it or leaves its own behind; and a private Open MPI session folder, so that mpiruns
started by two pytest-xdist workers at once do not race to create the shared one."""
import atexit
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for path in (HERE, ROOT):
    if path not in sys.path:
        sys.path.insert(0, path)
os.environ["PYTHONPATH"] = os.pathsep.join(
    [HERE, ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])

_TUNER_CACHE = tempfile.mkdtemp(prefix="pycoll-tuner-cache-")
os.environ["PYCOLL_TUNER_CACHE"] = _TUNER_CACHE
atexit.register(shutil.rmtree, _TUNER_CACHE, True)

_OMPI_SESSIONS = tempfile.mkdtemp(prefix="pycoll-test-ompi-")
os.environ["OMPI_MCA_orte_tmpdir_base"] = _OMPI_SESSIONS
atexit.register(shutil.rmtree, _OMPI_SESSIONS, True)

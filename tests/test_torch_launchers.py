"""init_process_group("pycoll") from a script that never imports pycoll, under each way a torch job is
started: torchrun (env://), mpirun and Slurm with MASTER_ADDR set, tcp:// and file:// by hand."""
import os
import shutil
import subprocess
import sys

import pytest

from multiproc import free_port

torch = pytest.importorskip("torch")


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = shutil.which("torchrun")
MPIRUN = shutil.which("mpirun")
pytestmark = pytest.mark.timeout(150)

SCRIPT = r'''
import os, sys, torch, torch.distributed as dist
how = sys.argv[1]
if how == "env":  # torchrun: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    dist.init_process_group("pycoll")
elif how == "mpirun":  # the launcher's own variables; MASTER_ADDR/MASTER_PORT exported by the user
    dist.init_process_group("pycoll", rank=int(os.environ["OMPI_COMM_WORLD_RANK"]),
                            world_size=int(os.environ["OMPI_COMM_WORLD_SIZE"]))
elif how == "slurm":
    dist.init_process_group("pycoll", rank=int(os.environ["SLURM_PROCID"]),
                            world_size=int(os.environ["SLURM_NTASKS"]))
else:  # tcp://HOST:PORT or file://PATH, rank and size on the command line
    dist.init_process_group("pycoll", init_method=how, rank=int(sys.argv[2]), world_size=int(sys.argv[3]))
rank, size = dist.get_rank(), dist.get_world_size()
t = torch.full((5,), float(rank + 1))
dist.all_reduce(t)
objs = [None] * size
dist.all_gather_object(objs, {"rank": rank})
dist.barrier()
ok = t.tolist() == [size * (size + 1) / 2] * 5 and objs == [{"rank": r} for r in range(size)]
name = dist.get_backend()
dist.destroy_process_group()
print(f"rank {rank}/{size} backend {name}: {'OK' if ok else 'WRONG'}", flush=True)
'''


def _env(**extra):
    env = {**os.environ, "PYTHONPATH": ROOT, **extra}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PYCOLL_STORE_HOSTED",
                "PYCOLL_JOB_TOKEN", "TORCH_DEVICE_BACKEND_AUTOLOAD"):
        if var not in extra:
            env.pop(var, None)
    return env


def _script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return str(path)


def _by_hand(n, args_for, env_for):
    """n processes started by hand; every one's (returncode, output)."""
    procs = [subprocess.Popen([sys.executable, *args_for(r)], env=env_for(r), cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(n)]
    try:
        return [(p.wait(timeout=120), p.stdout.read()) for p in procs]
    finally:
        for p in procs:
            p.kill()


def _check(outputs, n):
    for rank, (code, text) in enumerate(outputs):
        assert code == 0 and f"rank {rank}/{n} backend pycoll: OK" in text, text[-3000:]


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun comes with torch")
def test_torchrun_env_init(tmp_path):
    proc = subprocess.run([TORCHRUN, "--nproc-per-node", "2", "--master-port", str(free_port()),
                           _script(tmp_path), "env"], capture_output=True, text=True, env=_env(), cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in range(2):
        assert f"rank {rank}/2 backend pycoll: OK" in proc.stdout, proc.stdout


@pytest.mark.mpi
@pytest.mark.skipif(MPIRUN is None, reason="mpirun not installed (apt-get install openmpi-bin)")
def test_mpirun_with_master_addr(tmp_path):
    port = str(free_port())
    env = _env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_btl_tcp_if_include="lo",
               OMPI_MCA_oob_tcp_if_include="lo")
    proc = subprocess.run([MPIRUN, "--oversubscribe", "-np", "3", "-x", "MASTER_ADDR=127.0.0.1", "-x",
                           f"MASTER_PORT={port}", sys.executable, _script(tmp_path), "mpirun"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in range(3):
        assert f"rank {rank}/3 backend pycoll: OK" in proc.stdout, proc.stdout


def test_slurm_variables_with_master_addr(tmp_path):
    script, port, n = _script(tmp_path), str(free_port()), 2
    out = _by_hand(n, lambda r: [script, "slurm"],
                   lambda r: _env(SLURM_PROCID=str(r), SLURM_NTASKS=str(n), SLURM_LOCALID=str(r),
                                  SLURM_NTASKS_PER_NODE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
    _check(out, n)


@pytest.mark.parametrize("method", ["tcp", "file"])
def test_tcp_and_file_init_methods(tmp_path, method):
    script, n = _script(tmp_path), 3
    url = f"tcp://127.0.0.1:{free_port()}" if method == "tcp" else f"file://{tmp_path / 'rendezvous'}"
    out = _by_hand(n, lambda r: [script, url, str(r), str(n)], lambda r: _env())
    _check(out, n)

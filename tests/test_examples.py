"""Every example runs the way its docstring says, and prints correct results (not just exit code 0)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

REPO = Path(__file__).resolve().parents[1]
MPIRUN = shutil.which("mpirun")
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PYCOLL_STORE_HOSTED", "PYCOLL_JOB_TOKEN")
MPIRUN_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",  # root, loopback only
              "OMPI_MCA_btl_tcp_if_include": "lo", "OMPI_MCA_oob_tcp_if_include": "lo"}


def needs_mpirun(test):
    """Mark `test` as an mpi test, skipped where Open MPI's mpirun is not installed."""
    return pytest.mark.mpi(pytest.mark.skipif(MPIRUN is None, reason="mpirun not installed")(test))


def run(cmd: List[str], timeout: float = 90, **env: str) -> subprocess.CompletedProcess:
    """Run `cmd` in the repository with pycoll importable and no launcher variables inherited;
    a run past `timeout` fails the test with whatever it printed."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **env}
    for var in LAUNCHER_VARS:
        full_env.pop(var, None)
    try:
        return subprocess.run(cmd, capture_output=True, text=True, env=full_env, cwd=REPO, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} ran past {timeout} s; stdout:\n{e.stdout}\nstderr:\n{e.stderr}")


def succeeded(proc: subprocess.CompletedProcess) -> str:
    """stdout of a run that must have exited 0."""
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def pycoll_run(n: int, *args: str) -> str:
    """stdout of `python -m pycoll run -n N python ARGS...`, which must succeed."""
    return succeeded(run([sys.executable, "-m", "pycoll", "run", "-n", str(n), "--timeout", "80",
                          sys.executable, *args]))


def mpirun(n: int, *args: str) -> str:
    """stdout of `mpirun --oversubscribe -np N python ARGS...`, which must succeed."""
    pytest.importorskip("mpi4py")
    return succeeded(run([MPIRUN, "--oversubscribe", "-np", str(n), sys.executable, *args], **MPIRUN_ENV))


def per_rank(pattern: str, out: str, n: int) -> List[re.Match]:
    """The one match of `pattern` (which captures the rank first) for each of ranks 0..n-1."""
    found = sorted(re.finditer(pattern, out), key=lambda m: int(m.group(1)))
    assert [int(m.group(1)) for m in found] == list(range(n)), out
    return found


@pytest.mark.timeout(60)
def test_hello_allreduce():
    out = pycoll_run(2, "examples/hello_allreduce.py")
    per_rank(r"\[rank \d\] rank (\d)/2 \(local \d/2\): allreduce\(sum of ranks\) = \[1\.0, 1\.0, 1\.0, 1\.0\] OK",
             out, 2)


@pytest.mark.timeout(90)
def test_torch_ddp_style_matches_single_process_training():
    pytest.importorskip("torch")
    out = pycoll_run(2, "examples/torch_ddp_style.py")
    losses = [float(v) for v in re.findall(r"\[rank 0\] step \d+/30: loss ([\d.]+)", out)]
    assert len(losses) == 3 and losses[-1] < losses[0], out
    for m in per_rank(r"rank (\d)/2: replicas identical: yes; max \|param - single-process param\| = "
                      r"([\d.e+-]+); OK", out, 2):
        assert float(m.group(2)) < 1e-10


@pytest.mark.timeout(110)
def test_torch_ddp_on_pycoll_matches_gloo():
    """examples/torch_ddp.py under torchrun: it learns, and at two ranks the pycoll and gloo runs end
    with the same parameters bit for bit (the digest) on every rank."""
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    digests = {}
    for backend in ("pycoll", "gloo"):
        out = succeeded(run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                             "2", "examples/torch_ddp.py", "--backend", backend, "--epochs", "2"], timeout=50))
        found = per_rank(rf"\[{backend}\] rank (\d)/2: parameters sha256 ([0-9a-f]+), test accuracy ([\d.]+)",
                         out, 2)
        assert len({m.group(2) for m in found}) == 1, out  # the replicas agree
        assert float(found[0].group(3)) > 0.85, out
        digests[backend] = found[0].group(2)
    assert digests["pycoll"] == digests["gloo"], digests


@pytest.mark.timeout(110)
def test_torch_ddp_under_pycoll_run():
    """examples/torch_ddp.py under `pycoll run` (torch's store on MASTER_PORT, pycoll's on its own
    port): both backends train, and at two ranks end with the same parameters."""
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    digests = {}
    for backend in ("pycoll", "gloo"):
        out = pycoll_run(2, "examples/torch_ddp.py", "--backend", backend, "--epochs", "1")
        found = per_rank(rf"\[{backend}\] rank (\d)/2: parameters sha256 ([0-9a-f]+)", out, 2)
        assert len({m.group(2) for m in found}) == 1, out
        digests[backend] = found[0].group(2)
    assert digests["pycoll"] == digests["gloo"], digests


@pytest.mark.timeout(60)
def test_torch_ddp_style_without_torch_skips_gracefully(tmp_path):
    (tmp_path / "torch.py").write_text("raise ImportError('no torch here')\n")  # shadows the real torch
    out = succeeded(run([sys.executable, "examples/torch_ddp_style.py"], timeout=30,
                        PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}"))
    assert "torch is not installed; skipping" in out


@needs_mpirun
@pytest.mark.timeout(90)
def test_mpirun_allgather_np_3():
    out = mpirun(3, "examples/mpirun_allgather.py")
    # mpirun forwards each rank's stdout as it comes, so lines of different ranks may run together
    found = per_rank(r"rank (\d)/3: allgather ranks \[0, 1, 2\] squares \[0, 1, 4\] pids \[(\d+), (\d+), (\d+)\]; "
                     r"allgatherv \[0, 1, 1, 2, 2, 2\] OK", out, 3)
    assert len({m.groups()[1:] for m in found}) == 1  # every rank saw the same table


def overlap_pattern(kind: str) -> str:
    """One async_overlap.py result line: rank, then allreduce, work, sequential and overlapped ms."""
    ms = r"([\d.]+) ms"
    return (rf"rank (\d)/2 {kind} work: allreduce 32 MiB {ms}, work {ms}, one after the other {ms}, "
            rf"overlapped {ms} \(-?\d+% saved\); result OK")


@pytest.mark.timeout(90)
def test_async_overlap_hides_the_allreduce_behind_off_cpu_work():
    out = pycoll_run(2, "examples/async_overlap.py")
    per_rank(overlap_pattern("numpy"), out, 2)  # on a busy CPU, numpy work may or may not gain
    for m in per_rank(overlap_pattern("off-CPU"), out, 2):
        t_comm, t_work, t_seq, t_overlap = map(float, m.groups()[1:])
        assert t_overlap < t_seq, out

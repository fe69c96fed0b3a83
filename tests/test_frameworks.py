"""Frameworks that run on backend "pycoll" as they are (README "Works with"): Lightning, Ray Train, Hugging
Face Accelerate, and torch's DDP, FSDP2, DTensor tensor parallelism and pipelining. Each test starts real
processes (torchrun, pycoll run, or the framework's own launcher or workers), trains the same seeded model a
few steps on pycoll and on gloo (tests/framework_jobs/), and compares the final weights.

Equal means bit-identical at 2 ranks: every reduction there is a sum of two terms, which has one order, and
pipelining only sends. At 3 ranks pycoll and gloo add three terms in orders of their own, so equal means
within float32 rounding (the slow tests; each prints whether it was bit-identical anyway)."""
import fcntl
import importlib.util
import os
import shutil
import signal
import subprocess
import sys

import pytest

from multiproc import free_port

torch = pytest.importorskip("torch")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
JOBS = os.path.join(HERE, "framework_jobs")
TORCHRUN = shutil.which("torchrun")


def _jobs_common():
    """The jobs' common.py (their model: to tell trained weights from the initial ones), under a name of its
    own: examples/parallel has a common.py too."""
    spec = importlib.util.spec_from_file_location("framework_jobs_common", os.path.join(JOBS, "common.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


common = _jobs_common()

LAUNCH_TIMEOUT = 200  # seconds one launch may take (the machine is shared: a launch takes 5-25 s here)


def _need(module):
    """Skip unless `module` is installed (pip install -e '.[frameworks]'; CI installs it)."""
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed: pip install -e '.[frameworks]'")


def _env():
    """This environment without a launcher's variables, and one thread per rank."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "PYCOLL_STORE_HOSTED", "PYCOLL_STORE_PORT", "PYCOLL_JOB_TOKEN", "TORCHELASTIC_RUN_ID",
                "TORCH_DEVICE_BACKEND_AUTOLOAD"):
        env.pop(var, None)
    return env


def _launch(how, n, script, *args, timeout=LAUNCH_TIMEOUT):
    """Run tests/framework_jobs/`script` on n ranks started by `how` (torchrun, pycoll, or python: the
    script starts its own processes); its whole process group is killed if it outlives `timeout`."""
    path = os.path.join(JOBS, script)
    cmd = {"torchrun": [TORCHRUN, "--nproc-per-node", str(n), "--master-port", str(free_port()), path],
           "pycoll": [sys.executable, "-m", "pycoll", "run", "-n", str(n), "--timeout", str(timeout - 20),
                      sys.executable, path],
           "python": [sys.executable, path]}[how]
    if how == "torchrun" and TORCHRUN is None:
        pytest.skip("torchrun comes with torch")
    proc = subprocess.Popen(cmd + list(args), env=_env(), cwd=ROOT, text=True, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{script} under {how} did not finish in {timeout} s:\n{out[-4000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, f"{script} under {how} exited with {proc.returncode}:\n{out[-6000:]}"


def _weights(out_dir, n, backend):
    """Each rank's final weights, after checking the rank really ran on `backend`."""
    ranks = []
    for rank in range(n):
        saved = torch.load(os.path.join(out_dir, f"rank{rank}.pt"))
        assert saved["backend"] == backend, (out_dir, rank, saved["backend"])
        ranks.append(saved["weights"])
    return ranks


def _compare(name, ours, theirs, exact, replicated=True):
    """pycoll's weights against gloo's, rank by rank: trained (not the initial weights), the same on every
    rank where the framework replicates them, and bit-identical (`exact`) or within float32 rounding."""
    initial = dict(common.model().named_parameters())
    assert len(ours) == len(theirs)
    diff, identical = 0.0, True
    for rank, (mine, ref) in enumerate(zip(ours, theirs)):
        assert sorted(mine) == sorted(ref) and mine, (rank, sorted(mine), sorted(ref))
        for key in mine:
            assert not torch.equal(mine[key], initial[key].detach()), f"{name}: rank {rank} never trained {key}"
            if replicated:
                assert torch.equal(mine[key], ours[0][key]), f"{name} on pycoll: ranks 0 and {rank} differ"
                assert torch.equal(ref[key], theirs[0][key]), f"{name} on gloo: ranks 0 and {rank} differ"
            diff = max(diff, (mine[key] - ref[key]).abs().max().item())
            identical = identical and torch.equal(mine[key], ref[key])
    print(f"{name}, {len(ours)} ranks: max |pycoll - gloo| = {diff:.3g}, bit-identical: {identical}")
    if exact:
        assert identical, f"{name}: pycoll's weights differ from gloo's by up to {diff:.3g}"
    for mine, ref in zip(ours, theirs):
        for key in mine:
            assert torch.allclose(mine[key], ref[key], rtol=1e-5, atol=1e-6), (name, key, diff)


def _both(tmp_path, how, n, script, *args):
    """The job on pycoll and on gloo: each rank's weights of each."""
    runs = {}
    for backend in ("pycoll", "gloo"):
        out = str(tmp_path / backend)
        _launch(how, n, script, "--backend", backend, "--out", out, *args)
        runs[backend] = _weights(out, n, backend)
    return runs["pycoll"], runs["gloo"]


# torch.distributed's own: DDP, FSDP2, DTensor tensor parallelism, pipelining. One launch per backend runs
# them all (starting the ranks costs far more than the training); each job is a test of its own.

@pytest.fixture(scope="module")
def torch_runs(tmp_path_factory):
    """run(how, n, jobs, schedule) -> {job: (pycoll's weights, gloo's)}. Each launch is made once per test
    session: under pytest-xdist the first worker to need it makes it (holding a file lock) and the others
    read the weights it left."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # this session's, all workers'

    def run(how, n, jobs, schedule="gpipe"):
        folder = shared / f"torch-jobs-{how}-{n}-{'-'.join(jobs)}-{schedule}"
        with open(shared / "torch-jobs.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (folder / "done").exists():
                for backend in ("pycoll", "gloo"):
                    _launch(how, n, "torch_job.py", *jobs, "--schedule", schedule, "--backend", backend,
                            "--out", str(folder / backend))
                (folder / "done").touch()
        return {job: tuple(_weights(str(folder / b / job), n, b) for b in ("pycoll", "gloo")) for job in jobs}
    return run


TORCH_JOBS = ("ddp", "fsdp2", "tp", "pp")


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT + 30)
@pytest.mark.parametrize("job", TORCH_JOBS)
def test_torch_parallelism_matches_gloo(torch_runs, job):
    """torchrun, 2 ranks; pipelining with GPipe."""
    ours, theirs = torch_runs("torchrun", 2, TORCH_JOBS)[job]
    _compare(job, ours, theirs, exact=True, replicated=job != "pp")


@pytest.mark.slow
@pytest.mark.timeout(2 * LAUNCH_TIMEOUT + 30)
@pytest.mark.parametrize("job", TORCH_JOBS)
def test_torch_parallelism_matches_gloo_3_ranks(torch_runs, job):
    """pycoll run, 3 ranks: within float32 rounding, but pipelining (it only sends) bit-identical."""
    ours, theirs = torch_runs("pycoll", 3, TORCH_JOBS)[job]
    _compare(job, ours, theirs, exact=job == "pp", replicated=job != "pp")


@pytest.mark.slow
@pytest.mark.timeout(2 * LAUNCH_TIMEOUT + 30)
@pytest.mark.parametrize("n", [2, 3])
def test_pipelining_1f1b_matches_gloo(torch_runs, n):
    ours, theirs = torch_runs("pycoll", n, ("pp",), "1f1b")["pp"]
    _compare("pp 1f1b", ours, theirs, exact=True, replicated=False)


# Lightning: DDPStrategy(process_group_backend="pycoll")

@pytest.mark.timeout(2 * LAUNCH_TIMEOUT + 30)
def test_lightning_matches_gloo(tmp_path):
    _need("lightning")
    ours, theirs = _both(tmp_path, "pycoll", 2, "lightning_job.py")
    _compare("Lightning DDP", ours, theirs, exact=True)


@pytest.mark.slow
@pytest.mark.timeout(2 * LAUNCH_TIMEOUT + 30)
@pytest.mark.parametrize("how,n", [("python", 2), ("torchrun", 3)])
def test_lightning_matches_gloo_slow(tmp_path, how, n):
    """Lightning starting its processes itself (`python job.py`, devices=2), and 3 ranks under torchrun."""
    _need("lightning")
    ours, theirs = _both(tmp_path, how, n, "lightning_job.py", "--devices", str(n))
    _compare(f"Lightning DDP ({how})", ours, theirs, exact=n == 2)


# Accelerate: init_process_group("pycoll") before Accelerator(cpu=True); gloo: Accelerate's own choice

@pytest.mark.timeout(2 * LAUNCH_TIMEOUT + 30)
def test_accelerate_matches_gloo(tmp_path):
    _need("accelerate")
    ours, theirs = _both(tmp_path, "pycoll", 2, "accelerate_job.py")
    _compare("Accelerate", ours, theirs, exact=True)


@pytest.mark.slow
@pytest.mark.timeout(2 * LAUNCH_TIMEOUT + 30)
def test_accelerate_matches_gloo_3_ranks(tmp_path):
    _need("accelerate")
    ours, theirs = _both(tmp_path, "torchrun", 3, "accelerate_job.py")
    _compare("Accelerate", ours, theirs, exact=False)


# Ray Train: TorchConfig(backend="pycoll"); Ray starts the workers (loopback only, shut down by the job)

RAY_TIMEOUT = 330  # seconds of one ray_job.py: Ray's start, a run or two, its shutdown


def _ray(tmp_path, workers, *args):
    _need("ray")
    out = str(tmp_path / "ray")
    _launch("python", workers, "ray_job.py", "--workers", str(workers), "--out", out,
            "--timeout", str(RAY_TIMEOUT - 30), *args, timeout=RAY_TIMEOUT)
    return out


@pytest.mark.timeout(RAY_TIMEOUT + 30)
def test_ray_train_matches_gloo(tmp_path):
    """One Ray Train run on pycoll; its workers train the model again over a gloo group beside it."""
    out = _ray(tmp_path, 2, "--backends", "pycoll", "--gloo-group")
    ours = _weights(os.path.join(out, "pycoll"), 2, "pycoll")
    theirs = _weights(os.path.join(out, "pycoll+gloo-group"), 2, "gloo")
    _compare("Ray Train", ours, theirs, exact=True)


@pytest.mark.slow
@pytest.mark.timeout(RAY_TIMEOUT + 30)
def test_ray_train_matches_gloo_runs_3_workers(tmp_path):
    """Two Ray Train runs, TorchConfig(backend="pycoll") and TorchConfig(backend="gloo"), 3 workers each."""
    out = _ray(tmp_path, 3, "--backends", "pycoll,gloo")
    ours, theirs = (_weights(os.path.join(out, b), 3, b) for b in ("pycoll", "gloo"))
    _compare("Ray Train", ours, theirs, exact=False)

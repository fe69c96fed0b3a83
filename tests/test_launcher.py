"""`pycoll run`: rank variables, the hosted store, output prefixes, exit codes and teardown, and
torch scripts (torch's store on MASTER_PORT beside pycoll's on PYCOLL_STORE_PORT).

Every launch uses a random master port (the default with one node), so tests can run in
parallel under pytest-xdist without clashing.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from multiproc import free_port

REPO = Path(__file__).resolve().parents[1]

# Each rank rendezvouses through the launcher's store and prints its view as one JSON line.
ENV_SCRIPT = """
import json, os
from pycoll.bootstrap.store import TCPStore
keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
        "MASTER_ADDR", "MASTER_PORT", "PYCOLL_JOB_TOKEN", "PYCOLL_STORE_PORT", "PYCOLL_STORE_HOSTED",
        "PYTHONUNBUFFERED"]
env = {k: os.environ.get(k) for k in keys}
token = os.environ.get("PYCOLL_JOB_TOKEN")
store = TCPStore(env["MASTER_ADDR"], int(env["PYCOLL_STORE_PORT"]), timeout=30,
                 token=bytes.fromhex(token) if token else None)
rank, size = int(env["RANK"]), int(env["WORLD_SIZE"])
store.set(f"rank{rank}", str(os.getpid()).encode())
arrival = store.add("arrived", 1)
store.wait([f"rank{r}" for r in range(size)])
seen = sorted(int(store.get(f"rank{r}")) for r in range(size))
print("ENV " + json.dumps({"env": env, "arrival": arrival, "seen": seen, "pid": os.getpid()}))
store.close()
"""

# Writes its pid (and that of a child it starts) to DIR, then sleeps: a rank that must be killed.
SLEEPER = """
import os, subprocess, sys, time
d = sys.argv[1]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
with open(os.path.join(d, f"pid{os.environ['RANK']}.tmp"), "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
os.replace(os.path.join(d, f"pid{os.environ['RANK']}.tmp"), os.path.join(d, f"pid{os.environ['RANK']}"))
time.sleep(60)
"""


def _env(**extra: str) -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("PYCOLL_JOB_TOKEN", None)
    env.update(extra)
    return env


def _cmd(*args: str) -> List[str]:
    return [sys.executable, "-m", "pycoll", "run", *args]


def launch(*args: str, cwd: Path = REPO, env: Optional[Dict[str, str]] = None,
           timeout: float = 50) -> subprocess.CompletedProcess:
    """Run `pycoll run ARGS` to completion and capture its output."""
    return subprocess.run(_cmd(*args), cwd=cwd, env=env or _env(), capture_output=True, text=True,
                          timeout=timeout)


def start(*args: str, cwd: Path = REPO, env: Optional[Dict[str, str]] = None) -> subprocess.Popen:
    """Start `pycoll run ARGS` in the background, capturing its output."""
    return subprocess.Popen(_cmd(*args), cwd=cwd, env=env or _env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def write(tmp_path: Path, name: str, source: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return str(path)


def parse_env(stdout: str) -> Dict[int, dict]:
    """The ENV_SCRIPT reports by rank, checking each sits behind its own `[rank R] ` prefix."""
    out = {}
    for line in stdout.splitlines():
        m = re.fullmatch(r"\[rank (\d+)\] ENV (.*)", line)
        if m:
            report = json.loads(m.group(2))
            assert int(report["env"]["RANK"]) == int(m.group(1))
            out[int(m.group(1))] = report
    return out


def alive(pid: int) -> bool:
    """True if `pid` runs; a zombie (dead, waiting for an absent reaper) counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_for_pids(d: Path, ranks: List[int], limit: float = 30) -> List[int]:
    """The pids of the SLEEPER ranks (and their children) once all of them have written them."""
    deadline = time.monotonic() + limit
    while not all((d / f"pid{r}").exists() for r in ranks):
        assert time.monotonic() < deadline, "sleeping ranks never started"
        time.sleep(0.05)
    return [int(p) for r in ranks for p in (d / f"pid{r}").read_text().split()]


def assert_all_dead(pids: List[int]) -> None:
    deadline = time.monotonic() + 5  # killed children of killed ranks are reaped asynchronously
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in pids if alive(p)] == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [1, 2, 4])
def test_env_and_hosted_store(tmp_path: Path, n: int) -> None:
    script = write(tmp_path, "env.py", ENV_SCRIPT)
    res = launch("-n", str(n), script)
    assert res.returncode == 0, res.stderr
    reports = parse_env(res.stdout)
    assert sorted(reports) == list(range(n))
    envs = [r["env"] for r in reports.values()]
    for rank, report in reports.items():
        e = report["env"]
        assert (e["WORLD_SIZE"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) == (str(n), str(rank), str(n))
        assert (e["GROUP_RANK"], e["NODE_RANK"], e["MASTER_ADDR"]) == ("0", "0", "127.0.0.1")
        assert (e["PYCOLL_STORE_HOSTED"], e["PYTHONUNBUFFERED"]) == (None, "1")
        assert report["seen"] == sorted(r["pid"] for r in reports.values())
    assert len({e["MASTER_PORT"] for e in envs}) == 1 and int(envs[0]["MASTER_PORT"]) > 0
    assert len({e["PYCOLL_STORE_PORT"] for e in envs}) == 1
    assert envs[0]["PYCOLL_STORE_PORT"] != envs[0]["MASTER_PORT"]  # MASTER_PORT is left to torch
    assert len({e["PYCOLL_JOB_TOKEN"] for e in envs}) == 1
    assert re.fullmatch(r"[0-9a-f]{64}", envs[0]["PYCOLL_JOB_TOKEN"])
    assert sorted(r["arrival"] for r in reports.values()) == list(range(1, n + 1))


@pytest.mark.timeout(60)
def test_each_launch_gets_a_fresh_token(tmp_path: Path) -> None:
    script = write(tmp_path, "env.py", ENV_SCRIPT)
    tokens = {parse_env(launch("-n", "1", script).stdout)[0]["env"]["PYCOLL_JOB_TOKEN"]
              for _ in range(2)}
    assert len(tokens) == 2


@pytest.mark.timeout(60)
def test_concurrent_launchers_do_not_clash(tmp_path: Path) -> None:
    script = write(tmp_path, "env.py", ENV_SCRIPT)
    procs = [start("-n", "2", script) for _ in range(3)]
    results = [p.communicate(timeout=50) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err for _, err in results]
    ports = set()
    for out, _ in results:
        reports = parse_env(out)
        assert sorted(r["arrival"] for r in reports.values()) == [1, 2]  # one store per launch
        ports |= {r["env"]["PYCOLL_STORE_PORT"] for r in reports.values()}
    assert len(ports) == 3


@pytest.mark.timeout(60)
def test_two_nodes_share_node0_store(tmp_path: Path) -> None:
    script = write(tmp_path, "env.py", ENV_SCRIPT)
    token = os.urandom(32).hex()
    env = _env(PYCOLL_JOB_TOKEN=token)
    common = ["-n", "2", "--nnodes", "2", "--master-port", str(free_port()), "--store-port", str(free_port())]
    nodes = [start(*common, "--node-rank", str(r), script, env=env) for r in (1, 0)]
    results = [p.communicate(timeout=50) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], [err for _, err in results]
    reports = {**parse_env(results[0][0]), **parse_env(results[1][0])}
    assert sorted(reports) == [0, 1, 2, 3]
    assert sorted(parse_env(results[0][0])) == [2, 3]
    for rank, report in reports.items():
        e = report["env"]
        assert (e["WORLD_SIZE"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) == ("4", str(rank % 2), "2")
        assert e["GROUP_RANK"] == e["NODE_RANK"] == str(rank // 2)
        assert e["PYCOLL_JOB_TOKEN"] == token and e["PYCOLL_STORE_PORT"] == common[-1]
    assert sorted(r["arrival"] for r in reports.values()) == [1, 2, 3, 4]


@pytest.mark.timeout(60)
def test_multinode_node_without_token_refuses_to_start(tmp_path: Path) -> None:
    """Issue 19: a node other than 0 must get node 0's token; it never starts an open job."""
    script = write(tmp_path, "show.py", """
        print("started")
    """)
    res = launch("-n", "2", "--nnodes", "3", "--node-rank", "2", script)
    assert res.returncode == 2 and "started" not in res.stdout
    assert "needs the job token that node 0 printed" in res.stderr and "PYCOLL_JOB_TOKEN" in res.stderr


@pytest.mark.timeout(60)
def test_multinode_node_0_draws_and_prints_the_token(tmp_path: Path) -> None:
    script = write(tmp_path, "show.py", """
        import os
        print(os.environ["RANK"], os.environ["PYCOLL_JOB_TOKEN"])
    """)
    port = free_port()
    res = launch("-n", "1", "--nnodes", "2", "--node-rank", "0", "--master-port", str(port), script)
    assert res.returncode == 0, res.stderr
    printed = re.search(r"PYCOLL_JOB_TOKEN=([0-9a-f]{64}) pycoll run --nnodes 2 --node-rank R", res.stderr)
    assert printed, res.stderr
    assert f"[rank 0] 0 {printed[1]}" in res.stdout, res.stdout


@pytest.mark.timeout(60)
def test_output_is_prefixed_per_line(tmp_path: Path) -> None:
    script = write(tmp_path, "chatty.py", """
        import os, sys
        r = os.environ["RANK"]
        for i in range(300):
            print(f"out {r} {i} " + r * 400)
            print(f"err {r} {i} " + r * 400, file=sys.stderr)
        sys.stdout.write(f"tail {r}")  # no final newline
    """)
    res = launch("-n", "3", script)
    assert res.returncode == 0, res.stderr
    for stream, kind in ((res.stdout, "out"), (res.stderr, "err")):
        lines = stream.splitlines()
        counts = {r: 0 for r in "012"}
        for line in lines:
            m = re.fullmatch(r"\[rank (\d)\] (out|err|tail) (\d)(?: \d+ (\d+))?", line)
            assert m, line[:80]
            assert m.group(1) == m.group(3) and (m.group(2) == "tail" or m.group(2) == kind)
            assert m.group(4) in (None, m.group(1) * 400)
            counts[m.group(1)] += m.group(2) == kind
        assert counts == {r: 300 for r in "012"}
    assert sorted(line for line in res.stdout.splitlines() if " tail " in line) == [
        f"[rank {r}] tail {r}" for r in range(3)]


@pytest.mark.timeout(60)
def test_failing_rank_code_propagates_and_others_are_killed(tmp_path: Path) -> None:
    script = write(tmp_path, "fail.py", f"""
        import os, sys, time
        if os.environ["RANK"] != "2":
            exec({SLEEPER!r})
        while not all(os.path.exists(os.path.join(sys.argv[1], f"pid{{r}}")) for r in (0, 1, 3)):
            time.sleep(0.05)
        print("rank 2 gives up", file=sys.stderr)
        sys.exit(3)
    """)
    t0 = time.monotonic()
    res = launch("-n", "4", script, str(tmp_path))
    elapsed = time.monotonic() - t0
    assert res.returncode == 3, res.stderr
    assert elapsed < 30
    assert re.search(r"pycoll run: rank 2 \(pid \d+\) exited with code 3", res.stderr)
    assert res.stderr.index("[rank 2] rank 2 gives up") < res.stderr.index("pycoll run: rank 2")
    assert_all_dead(wait_for_pids(tmp_path, [0, 1, 3], limit=0))


@pytest.mark.timeout(60)
def test_rank_killed_by_signal(tmp_path: Path) -> None:
    script = write(tmp_path, "die.py", f"""
        import os, signal, sys, time
        if os.environ["RANK"] == "0":
            exec({SLEEPER!r})
        while not os.path.exists(os.path.join(sys.argv[1], "pid0")):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    t0 = time.monotonic()
    res = launch("-n", "2", script, str(tmp_path))
    assert res.returncode == 128 + signal.SIGKILL, res.stderr
    assert time.monotonic() - t0 < 30
    assert re.search(r"pycoll run: rank 1 \(pid \d+\) was killed by signal SIGKILL", res.stderr)
    assert_all_dead(wait_for_pids(tmp_path, [0], limit=0))


@pytest.mark.timeout(60)
def test_timeout_kills_everything(tmp_path: Path) -> None:
    script = write(tmp_path, "sleep.py", SLEEPER)
    t0 = time.monotonic()
    res = launch("-n", "2", "--timeout", "3", script, str(tmp_path))
    assert res.returncode == 124, res.stderr
    assert time.monotonic() - t0 < 30
    assert "--timeout" in res.stderr
    assert_all_dead(wait_for_pids(tmp_path, [0, 1], limit=0))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_launcher_is_forwarded(tmp_path: Path, signum: int) -> None:
    script = write(tmp_path, "sleep.py", SLEEPER)
    proc = start("-n", "2", script, str(tmp_path))
    pids = wait_for_pids(tmp_path, [0, 1])
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signum, err
    assert signal.Signals(signum).name in err
    assert_all_dead(pids)


@pytest.mark.timeout(60)
def test_module_form_and_script_args_are_not_ours(tmp_path: Path) -> None:
    (tmp_path / "rankmod.py").write_text(
        "import os, sys\nprint(os.environ['RANK'], os.environ['WORLD_SIZE'], sys.argv[1:])\n")
    res = launch("-n", "2", "-m", "rankmod", "-n", "7", "--timeout", "x", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    args = ['-n', '7', '--timeout', 'x']
    assert sorted(res.stdout.splitlines()) == [f"[rank {r}] {r} 2 {args}" for r in range(2)]


@pytest.mark.timeout(60)
def test_plain_command(tmp_path: Path) -> None:
    res = launch("--nproc-per-node", "2", sys.executable, "-c",
                 "import os; print('hi', os.environ['LOCAL_RANK'])")
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == ["[rank 0] hi 0", "[rank 1] hi 1"]


@pytest.mark.timeout(60)
def test_all_ranks_succeed_exit_zero_and_code_from_python_script(tmp_path: Path) -> None:
    script = write(tmp_path, "ok.py", """
        import os, sys
        sys.exit(0 if os.environ["RANK"] != "1" else 5)
    """)
    assert launch("-n", "2", script).returncode == 5
    script = write(tmp_path, "ok2.py", "print('fine')\n")
    assert launch("-n", "2", script).returncode == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, message", [
    (["-n", "0", "{script}"], "at least 1"),
    (["-n", "x", "{script}"], "invalid int"),
    (["--nnodes", "2", "--node-rank", "2", "{script}"], "--node-rank"),
    (["--node-rank", "-1", "{script}"], "--node-rank"),
    (["--nnodes", "2", "--master-port", "0", "{script}"], "--master-port"),
    (["--master-port", "70000", "{script}"], "--master-port"),
    (["--store-port", "70000", "{script}"], "--store-port"),
    (["--nnodes", "2", "--store-port", "0", "{script}"], "--store-port"),
    (["--master-port", "29600", "--store-port", "29600", "{script}"], "must differ"),
    (["--nnodes", "2", "--master-port", "65535", "{script}"], "--store-port"),
    (["--timeout", "0", "{script}"], "--timeout"),
    (["-n", "2"], "missing the script"),
    (["-n", "2", "-m"], "missing the script"),
    (["-n", "2", "{missing}"], "script not found"),
    (["-n", "2", "no-such-command-pycoll"], "command not found"),
])
def test_bad_arguments_exit_2(tmp_path: Path, args: List[str], message: str) -> None:
    marker = tmp_path / "ran"
    script = write(tmp_path, "mark.py", f"open({str(marker)!r}, 'w').close()\n")
    argv = [a.format(script=script, missing=str(tmp_path / "missing.py")) for a in args]
    res = launch(*argv)
    assert res.returncode == 2
    assert message in res.stderr
    assert not marker.exists()


@pytest.mark.timeout(60)
def test_help_exits_0() -> None:
    res = launch("--help")
    assert res.returncode == 0 and "--nproc-per-node" in res.stdout


# -- torch scripts ---------------------------------------------------------------------------------
# Before PYCOLL_STORE_PORT, the launcher's store sat on MASTER_PORT and torch's rank 0 store failed
# to bind it (EADDRINUSE). No destroy_process_group beside gloo, and the gloo runs end with os._exit:
# torch 2.13's gloo teardown races ("terminate called without an active exception", SIGABRT at exit).
TORCH_SCRIPT = """
import os, sys
import torch, torch.distributed as dist
backend = sys.argv[1]
if backend == "pycoll":
    import pycoll.torch  # noqa: F401
dist.init_process_group(backend)  # env:// from pycoll run's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
rank, size = dist.get_rank(), dist.get_world_size()
t = torch.full((1000,), float(rank + 1))
dist.all_reduce(t)
dist.barrier()
w = dist.all_reduce(torch.ones(3), async_op=True)
w.wait()
print(f"TORCH {backend} {rank}/{size} {t[0].item():g} {t[-1].item():g} {w.get_future().value()[0].tolist()}")
if backend == "pycoll":
    dist.destroy_process_group()
else:  # torch 2.13's gloo teardown can abort at interpreter exit as well (CI): leave without it
    sys.stdout.flush()
    os._exit(0)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["pycoll", "gloo"])
@pytest.mark.parametrize("n", [2, 3])
def test_torch_script_on_either_backend(tmp_path: Path, backend: str, n: int) -> None:
    pytest.importorskip("torch")
    script = write(tmp_path, "train.py", TORCH_SCRIPT)
    res = launch("-n", str(n), "--timeout", "90", script, backend, timeout=110)
    assert res.returncode == 0, res.stdout + res.stderr
    total = n * (n + 1) // 2
    ones = [float(n)] * 3
    assert sorted(res.stdout.splitlines()) == [
        f"[rank {r}] TORCH {backend} {r}/{n} {total} {total} {ones}" for r in range(n)], res.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["pycoll", "gloo"])
def test_pycoll_init_beside_torch(tmp_path: Path, backend: str) -> None:
    """pycoll.init() rendezvouses at the launcher's store (with its token) while torch's store
    binds MASTER_PORT; both worlds run collectives in one script."""
    pytest.importorskip("torch")
    script = write(tmp_path, "both.py", """
        import os, sys
        import numpy as np
        import torch, torch.distributed as dist
        import pycoll
        backend = sys.argv[1]
        if backend == "pycoll":
            import pycoll.torch  # noqa: F401
        comm = pycoll.init()
        dist.init_process_group(backend)
        x = np.full(4, comm.rank + 1.0, np.float32)
        comm.allreduce(x)
        t = torch.full((4,), dist.get_rank() + 1.0)
        dist.all_reduce(t)
        comm.barrier()
        dist.barrier()
        print(f"BOTH {comm.rank}/{comm.size} {x.tolist()} {t.tolist()}")
        comm.close()
        if backend == "pycoll":
            dist.destroy_process_group()
        else:  # torch 2.13's gloo teardown can abort at interpreter exit as well (CI): leave without it
            sys.stdout.flush()
            os._exit(0)
    """)
    res = launch("-n", "2", "--timeout", "90", script, backend, timeout=110)
    assert res.returncode == 0, res.stdout + res.stderr
    assert sorted(res.stdout.splitlines()) == [
        f"[rank {r}] BOTH {r}/2 {[3.0] * 4} {[3.0] * 4}" for r in range(2)], res.stderr


@pytest.mark.timeout(60)
def test_store_demands_the_job_token(tmp_path: Path) -> None:
    """The launcher's store on PYCOLL_STORE_PORT refuses a client without the job token."""
    script = write(tmp_path, "probe.py", """
        import os
        from pycoll.bootstrap.store import TCPStore
        from pycoll.errors import PycollError
        try:
            s = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["PYCOLL_STORE_PORT"]), timeout=3,
                         token=b"wrong token")
            s.set("k", b"v")
            print("ADMITTED")
        except (PycollError, OSError) as e:
            print("REFUSED", type(e).__name__)
    """)
    res = launch("-n", "1", script)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("[rank 0] REFUSED"), res.stdout + res.stderr

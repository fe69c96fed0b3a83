"""The flight recorder and `pycoll trace`: real jobs (tests/trace_job.py) in which the last rank
misbehaves once, under `pycoll run` and under mpirun, over tcp and shm; the verdict must name the
right rank, call and kind. Plus the recorder's own contract: bounded ring, off switch, call sites,
async and p2p states, dumps, Chrome trace, live view."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Optional

import numpy as np
import pytest

from multiproc import run_ranks
from pycoll.trace import analysis

REPO = Path(__file__).resolve().parent.parent
JOB = str(REPO / "tests" / "trace_job.py")
MPIRUN = shutil.which("mpirun")
BAD = 2  # trace_job.py's misbehaving rank: the last of 3


def _env(transport: str, **extra: str) -> Dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYCOLL_TUNER": "static", "PYCOLL_TRANSPORT": transport,
           **extra}
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PYCOLL_STORE_HOSTED", "PYCOLL_TRACE_DIR",
                "PYCOLL_STORE_PORT", "PYCOLL_JOB_TOKEN"):
        env.pop(var, None)
    env.update(extra)
    return env


def under_pycoll_run(mode: str, transport: str, folder: Path) -> subprocess.CompletedProcess:
    """trace_job.py MODE on 3 ranks under `pycoll run --trace-dir --hang-timeout`."""
    return subprocess.run([sys.executable, "-m", "pycoll", "run", "-n", "3", "--trace-dir", str(folder),
                           "--hang-timeout", "4", JOB, mode], cwd=REPO, capture_output=True, text=True,
                          env=_env(transport, PYCOLL_TIMEOUT="60"), timeout=100)


def under_mpirun(mode: str, transport: str, folder: Path) -> None:
    """trace_job.py MODE on 3 ranks under mpirun with PYCOLL_TRACE_DIR and a 10 s PYCOLL_TIMEOUT; once a
    rank has dumped, SIGUSR1 to mpirun (which forwards it) has the others dump too; then end the job."""
    env = _env(transport, PYCOLL_TIMEOUT="10", PYCOLL_TRACE_DIR=str(folder), OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_btl_tcp_if_include="lo",
               OMPI_MCA_oob_tcp_if_include="lo")
    proc = subprocess.Popen([MPIRUN, "--oversubscribe", "-np", "3", sys.executable, JOB, mode], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    expected = {0, 1} if mode == "kill" else {0, 1, 2}
    try:
        _wait(lambda: analysis.dump_ranks(str(folder)) or proc.poll() is not None, 60)
        try:
            proc.send_signal(signal.SIGUSR1)
        except ProcessLookupError:
            pass
        _wait(lambda: expected <= set(analysis.dump_ranks(str(folder))), 30)
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait(done, limit: float) -> None:
    deadline = time.monotonic() + limit
    while not done() and time.monotonic() < deadline:
        time.sleep(0.2)


def verdict_of(folder: Path) -> dict:
    return analysis.analyse(*analysis.load(str(folder)))


def check(mode: str, folder: Path) -> dict:
    """The verdict on `folder` names trace_job.py's culprit, call and kind for `mode`."""
    v = verdict_of(folder)
    story = analysis.render(v)
    if mode == "deadlock":
        assert analysis.culprit_ranks(v) == [0, 1], story
        assert "recv from 1" in v["deadlocks"][0]["text"] and "recv from 0" in v["deadlocks"][0]["text"], story
        return v
    first = v["disagreements"][0]
    kinds = {c["rank"]: c["kind"] for c in first["culprits"]}
    if mode == "kill":
        assert v["no_dump"] == [BAD] and kinds.get(BAD) == "no_dump" and first["seq"] in (5, 6), story
        return v
    assert analysis.culprit_ranks(v) == [BAD], story
    if mode == "skip":  # 7 allreduces where the others made 8: its call 8 is the barrier after the loop
        assert first["seq"] == 8 and kinds[BAD] == "mismatch", story
        assert any("skipped 1" in h and f"rank {BAD}" in h for h in first["hints"]), story
    elif mode in ("bcast", "dtype"):
        culprit = first["culprits"][0]
        assert first["seq"] == 6 and kinds[BAD] == "mismatch", story
        assert culprit["entered"]["call" if mode == "bcast" else "dtype"] == ("broadcast" if mode == "bcast"
                                                                               else "float64"), story
        assert culprit["expected"]["call"] == "allreduce" and culprit["expected"]["dtype"] == "float32", story
    elif mode == "sleep":
        culprit = first["culprits"][0]
        assert first["seq"] == 6 and kinds[BAD] == "never_entered", story
        assert culprit["last_completed"]["seq"] == 5 and "compute_forever" in culprit["where"], story
    return v


MODES = ["skip", "bcast", "dtype", "sleep", "kill", "deadlock"]
FAST = {("skip", "tcp"), ("sleep", "shm"), ("kill", "tcp"), ("deadlock", "shm")}  # in the default suite


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode,transport", [
    pytest.param(m, t, marks=() if (m, t) in FAST else pytest.mark.slow) for m in MODES for t in ("tcp", "shm")])
def test_pycoll_run_names_the_culprit(tmp_path: Path, mode: str, transport: str) -> None:
    res = under_pycoll_run(mode, transport, tmp_path / "trace")
    assert res.returncode != 0, res.stderr
    check(mode, tmp_path / "trace")
    # the launcher printed the same verdict before it ended the job
    assert "pycoll run: pycoll trace" in res.stderr and f"flight-recorder dumps are in {tmp_path}" in res.stderr, \
        res.stderr
    if mode in ("sleep", "deadlock"):  # hangs: --hang-timeout printed the live view first
        assert "no rank entered or completed a pycoll call for --hang-timeout 4 s" in res.stderr, res.stderr
        assert "pycoll run:   rank 0 (pid" in res.stderr, res.stderr


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.skipif(MPIRUN is None, reason="mpirun not installed")
@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("mode", MODES)
def test_mpirun_names_the_culprit(tmp_path: Path, mode: str, transport: str) -> None:
    pytest.importorskip("mpi4py")
    under_mpirun(mode, transport, tmp_path / "trace")
    check(mode, tmp_path / "trace")


def test_cli_verdict_and_chrome_trace(tmp_path: Path) -> None:
    """`pycoll trace DIR` exits 1 naming the rank, --json gives the same verdict, --chrome a trace with
    one track per rank and communicator."""
    folder = tmp_path / "trace"
    res = under_pycoll_run("dtype", "tcp", folder)
    assert res.returncode != 0
    out = subprocess.run([sys.executable, "-m", "pycoll", "trace", str(folder), "--chrome", str(tmp_path / "t.json")],
                         cwd=REPO, capture_output=True, text=True, env=_env("tcp"), timeout=60)
    assert out.returncode == 1, out.stderr
    assert "FIRST DISAGREEMENT: world call 6" in out.stdout, out.stdout
    assert "rank 2: entered a different call: allreduce (count 4, float64, op sum) at tests/trace_job.py" in out.stdout
    js = subprocess.run([sys.executable, "-m", "pycoll", "trace", str(folder), "--json"], cwd=REPO,
                        capture_output=True, text=True, env=_env("tcp"), timeout=60)
    assert js.returncode == 1 and json.loads(js.stdout)["disagreements"][0]["culprits"][0]["rank"] == 2
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    tracks = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert tracks == {(0, "world"), (1, "world"), (2, "world")}
    calls = [e for e in events if e["ph"] == "X" and e["pid"] == 2]
    assert [e["name"] for e in calls][:6] == [f"allreduce #{i}" for i in range(1, 7)]
    assert all(e["dur"] >= 0 and e["ts"] > 0 for e in calls)


def _healthy(comm, folder: str) -> Optional[str]:
    from pycoll.trace import recorder
    x = np.ones(8, np.float32)
    for _ in range(12):
        comm.allreduce(x)
    works = [comm.allreduce(x, async_op=True) for _ in range(3)]
    for w in works:
        w.wait()
    if comm.rank == 0:
        comm.send(x, 1, tag=3)
    elif comm.rank == 1:
        comm.recv(x, 0, tag=3)
    comm.barrier()
    return recorder.dump(os.path.join(folder, f"rank{comm.rank}.json"))


@pytest.mark.timeout(90)
def test_no_disagreement_and_bounded_ring(tmp_path: Path) -> None:
    """A healthy job's dumps: exit 0 'no disagreement'; the ring keeps the last PYCOLL_TRACE_BUFFER
    calls with states, algorithms and the user's line; p2p calls numbered on their own."""
    folder = tmp_path / "trace"
    run_ranks(_healthy, 2, str(folder), env={"PYCOLL_TRACE_DIR": str(folder), "PYCOLL_TRACE_BUFFER": "6",
                                             "PYCOLL_TUNER": "static"})
    out = subprocess.run([sys.executable, "-m", "pycoll", "trace", str(folder)], cwd=REPO, capture_output=True,
                         text=True, env=_env("tcp"), timeout=60)
    assert out.returncode == 0 and "no disagreement" in out.stdout, out.stdout + out.stderr
    dump = json.loads((folder / "rank1.json").read_text())
    (world,) = dump["comms"]
    calls = world["calls"]
    assert world["recorded"] == 17 and len(calls) == 6  # 12 + 3 async + 1 barrier + 1 recv; the ring keeps 6
    assert [c["seq"] for c in calls if not c["p2p"]] == [12, 13, 14, 15, 16]
    recv = next(c for c in calls if c["p2p"])
    assert (recv["call"], recv["seq"], recv["peer"], recv["tag"], recv["state"]) == ("recv", 1, 0, 3, "completed")
    assert all(c["state"] == "completed" for c in calls)
    assert all(c["site"].startswith(__file__) for c in calls), calls
    assert all(c["algo"] for c in calls if not c["p2p"])
    live = analysis.live_view(str(folder))
    assert live[-1] == "world: 2 rank(s) up to call 16 (0-1)", live


@pytest.mark.timeout(60)
def test_buffer_zero_turns_recording_off(tmp_path: Path) -> None:
    folder = tmp_path / "trace"
    paths = run_ranks(_healthy, 2, str(folder), env={"PYCOLL_TRACE_DIR": str(folder), "PYCOLL_TRACE_BUFFER": "0",
                                                     "PYCOLL_TUNER": "static"})
    assert paths == [None, None] and not folder.exists()


def _dump_while_blocked(comm, folder: str) -> tuple:
    """Rank 0 blocks in an allreduce that rank 1 enters only after rank 0 has dumped from a thread: the
    running call is in that dump (started, with its line), and once (completed) after it."""
    import threading
    from pycoll.trace import recorder
    x = np.ones(4, np.float32)
    comm.allreduce(x)
    first = os.path.join(folder, "during0.json")  # rank 0's dump while it is blocked
    if comm.rank == 0:
        main = threading.main_thread().ident

        def dump_when_inside() -> None:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # until the main thread is inside the recorder's call()
                f = sys._current_frames().get(main)
                while f is not None and f.f_code is not recorder._CALL_CODE:
                    f = f.f_back
                if f is not None:
                    break
                time.sleep(0.01)
            recorder.dump(first)
        thread = threading.Thread(target=dump_when_inside)
        thread.start()
        comm.allreduce(x)  # the blocked call
        thread.join()
    else:
        _wait(lambda: os.path.exists(first), 30)
        comm.allreduce(x)
    after = recorder.dump(os.path.join(folder, f"after{comm.rank}.json"))
    return (json.loads(Path(first).read_text()) if comm.rank == 0 else None), json.loads(Path(after).read_text())


@pytest.mark.timeout(90)
def test_a_running_call_is_in_the_dump(tmp_path: Path) -> None:
    """A blocking call is recorded when it ends; a dump made while it runs finds it on its thread's stack."""
    folder = tmp_path / "trace"
    folder.mkdir()
    (during, after), _ = run_ranks(_dump_while_blocked, 2, str(folder), env={"PYCOLL_TUNER": "static"})
    (world,) = during["comms"]
    assert [(c["call"], c["seq"], c["state"]) for c in world["calls"]] == [("allreduce", 1, "completed"),
                                                                          ("allreduce", 2, "started")], world
    running = world["calls"][-1]
    assert running["site"].startswith(__file__) and running["end"] is None and running["enter"] > 0, running
    (world,) = after["comms"]
    assert [(c["seq"], c["state"]) for c in world["calls"]] == [(1, "completed"), (2, "completed")]


SLOW_LOOP = """
import os, sys, time, numpy as np, pycoll
comm = pycoll.init()
x = np.ones(4, np.float32)
for _ in range(5):
    comm.allreduce(x)
while not os.path.exists(sys.argv[1]):  # the test's go-ahead
    time.sleep(0.05)
comm.allreduce(x)
"""


@pytest.mark.timeout(90)
def test_sigquit_prints_live_view_without_stopping(tmp_path: Path) -> None:
    script, go, folder = tmp_path / "job.py", tmp_path / "go", tmp_path / "trace"
    script.write_text(SLOW_LOOP)
    proc = subprocess.Popen([sys.executable, "-m", "pycoll", "run", "-n", "2", "--trace-dir", str(folder),
                             str(script), str(go)], cwd=REPO, env=_env("tcp"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _wait(lambda: len(analysis.live_view(str(folder))) == 3 and "up to call 5" in analysis.live_view(str(folder))[-1],
              60)
        proc.send_signal(signal.SIGQUIT)
        _wait(lambda: False, 1.0)  # the launcher polls its signals every 50 ms
        go.touch()
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "SIGQUIT: each rank's last pycoll calls" in err, err
    assert "rank 0 (pid" in err and "world: entered 5, completed 5 (idle)" in err, err
    assert "world: 2 rank(s) up to call 5 (0-1)" in err, err


UNCAUGHT = """
import numpy as np, pycoll
comm = pycoll.init()
comm.allreduce(np.ones(4, np.float32))
if comm.rank == 1:
    raise ValueError("boom")
comm.barrier()
"""


@pytest.mark.timeout(90)
def test_uncaught_exception_dumps(tmp_path: Path) -> None:
    script, folder = tmp_path / "job.py", tmp_path / "trace"
    script.write_text(UNCAUGHT)
    res = subprocess.run([sys.executable, "-m", "pycoll", "run", "-n", "2", "--trace-dir", str(folder), str(script)],
                         cwd=REPO, env=_env("tcp"), capture_output=True, text=True, timeout=80)
    assert res.returncode == 1
    dump = json.loads((folder / "rank1.json").read_text())
    assert dump["reason"] == "uncaught ValueError" and dump["where"].endswith("job.py:6 in <module>"), dump
    v = verdict_of(folder)
    culprit = v["disagreements"][0]["culprits"][0]
    assert (culprit["rank"], culprit["kind"], v["disagreements"][0]["seq"]) == (1, "never_entered", 2), v


def _torch_job(rank: int, size: int, store_path: str, folder: str) -> dict:
    import torch
    import torch.distributed as dist
    import pycoll.torch  # noqa: F401  (registers "pycoll")
    from pycoll.trace import recorder
    dist.init_process_group("pycoll", store=dist.FileStore(store_path, size), rank=rank, world_size=size)
    t = torch.ones(4)
    dist.all_reduce(t)
    dist.broadcast(t, src=0)
    if rank == 0:
        dist.send(t, 1, tag=5)
    else:
        dist.recv(t, 0, tag=5)
    dist.barrier()
    path = recorder.dump(os.path.join(folder, f"rank{rank}.json"))
    dist.destroy_process_group()
    return json.loads(Path(path).read_text())


@pytest.mark.timeout(120)
def test_torch_backend_calls_are_recorded(tmp_path: Path) -> None:
    """Calls through torch.distributed's "pycoll" backend land in the recorder with the user's line
    (past torch's own frames)."""
    pytest.importorskip("torch")
    dumps = run_ranks(_torch_job, 2, 2, str(tmp_path / "store"), str(tmp_path), init=False,
                      env={"PYCOLL_TUNER": "static"})
    for rank, dump in enumerate(dumps):
        calls = [c for comm in dump["comms"] for c in comm["calls"]]
        names = [c["call"] for c in calls]
        assert "allreduce" in names and "broadcast" in names and "barrier" in names, names
        assert ("isend" if rank == 0 else "irecv") in names, names
        for c in calls:
            if c["call"] in ("allreduce", "broadcast", "isend", "irecv"):
                assert c["site"].startswith(__file__) and c["state"] == "completed", c



def _collector_view(comm):
    """(objects the collector tracks, added per call while 3,000 allreduces fill the ring; the share
    of the ring's entries still tracked after the young generations' collections)."""
    import gc
    x = np.ones(16, np.float32)
    comm.allreduce(x)  # the call shape's first selection is allowed its caches
    gc.collect()
    gc.disable()
    try:
        before = len(gc.get_objects())
        for _ in range(3000):
            comm.allreduce(x, op="max")
        grown = (len(gc.get_objects()) - before) / 3000
        gc.collect(0)  # an entry goes through both young generations' collections before the old one:
        gc.collect(1)  # a tuple whose fingerprint is untracked by the first is untracked by the second
        ring = comm._recorder._ring
        return grown, sum(gc.is_tracked(e) for e in ring) / len(ring)
    finally:
        gc.enable()


@pytest.mark.timeout(120)
def test_recording_leaves_nothing_for_the_garbage_collector():
    """Ring entries the collector counted would set off collections, and promoted to the old generation
    a full one (with torch loaded 130-170 ms, in the middle of a step, where gloo's calls set off none)."""
    for rank, (grown, tracked) in enumerate(run_ranks(_collector_view, 2, timeout=100)):
        assert abs(grown) < 0.01, f"rank {rank}: each call added {grown:.2f} objects the collector tracks"
        assert tracked == 0, f"rank {rank}: {tracked:.0%} of the ring's entries would reach the old generation"

"""`pycoll run --elastic --max-restarts K` and `--nnodes MIN:MAX` (pycoll/cli/run.py) with the grow of
pycoll/grow.py: a killed rank is started again in its slot and rejoins the running job; the restart
after the K-th ends the job with the reason; a node started later joins; the elastic trainer heals a
restarted rank and finishes on all ranks, bit-identical, as accurate as an undisturbed run."""
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from multiproc import free_port
from test_launcher import REPO, _env, launch, write

# argv: kill slot, kill step (after this life's first step), kill in every life (1) or the first only
# (0), steps, the size to wait for before finishing
SCRIPT = """
import os, signal, sys, time
import numpy as np
import pycoll
from pycoll import ft, grow

kill_slot, kill_step, every_life, steps, min_size = (int(a) for a in sys.argv[1:6])
comm = pycoll.init()
life = int(os.environ["PYCOLL_RESTART_COUNT"])
slot = int(os.environ["RANK"])
joined = grow.growth(comm)
step = np.zeros(1, np.int64)
if joined is not None and comm.rank >= joined.members:  # a newcomer: where the others are
    comm.broadcast(step, root=0)
    print(f"slot {slot} life {life} joined as rank {comm.rank} of {comm.size} at step {step[0]}", flush=True)
started = int(step[0])
while step[0] < steps or (comm.size < min_size and step[0] < 20000):  # the same on every rank
    if slot == kill_slot and step[0] == started + kill_step and (every_life or life == 0):
        os.kill(os.getpid(), signal.SIGKILL)
    x = np.ones(64, np.float32)
    try:
        comm.allreduce(x); ok = True
    except (pycoll.PeerError, pycoll.RevokedError):
        comm.revoke(); ok = False
    ok, dead, arrived = ft.agree_max(comm, ok, grow.arrivals(comm))
    if dead:
        comm = comm.shrink()
    step += ok
    if not dead and arrived > grow.admitted(comm):
        comm = comm.grow(arrivals=arrived)
        comm.broadcast(step, root=0)
    time.sleep(0.005)
x = np.ones(64, np.float32)
comm.allreduce(x)  # once more, on the communicator the run ends on
print(f"done on {comm.size} ranks at step {step[0]}, sum {x[0]:g}", flush=True)
comm.close()
"""


@pytest.mark.timeout(180)
def test_a_killed_rank_is_restarted_in_its_slot_and_rejoins(tmp_path: Path) -> None:
    script = write(tmp_path, "grow.py", SCRIPT)
    res = launch("--elastic", "--max-restarts", "1", "-n", "4", script, "2", "10", "0", "30", "4", timeout=150)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "rank 2 (pid" in res.stderr and "was killed by signal SIGKILL" in res.stderr
    assert "restarted it as a newcomer" in res.stderr and "restart 1 of --max-restarts 1" in res.stderr, res.stderr
    assert re.search(r"\[rank 2\] slot 2 life 1 joined as rank 3 of 4 at step \d+", res.stdout), res.stdout
    done = re.findall(r"\[rank (\d)\] done on 4 ranks at step (\d+), sum 4", res.stdout)
    assert sorted(r for r, _ in done) == ["0", "1", "2", "3"] and len({s for _, s in done}) == 1, res.stdout


@pytest.mark.timeout(180)
def test_max_restarts_exhausted_ends_the_job_with_the_reason(tmp_path: Path) -> None:
    script = write(tmp_path, "grow.py", SCRIPT)
    res = launch("--elastic", "--max-restarts", "1", "-n", "3", script, "1", "5", "1", "100000", "3", timeout=150)
    assert res.returncode == 128 + signal.SIGKILL, res.stdout + res.stderr
    assert "restart 1 of --max-restarts 1" in res.stderr
    assert re.search(r"rank 1 \(pid \d+\) was killed by signal SIGKILL \[at [\d.]+ s\]: --max-restarts 1 exhausted "
                     r"\(rank 1 was killed by signal SIGKILL at [\d.]+ s\); ending the job", res.stderr), res.stderr
    assert "slot 1 life 1 joined as rank 2 of 3" in res.stdout, res.stdout  # it did come back once


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, message", [
    (["--nnodes", "2:1", "{script}"], "1 <= MIN <= MAX"),
    (["--nnodes", "0:2", "{script}"], "1 <= MIN <= MAX"),
    (["--nnodes", "one", "{script}"], "a node count K or a range MIN:MAX"),
    (["--nnodes", "1:2", "{script}"], "needs --elastic"),
    (["--elastic", "--nnodes", "1:2", "--node-rank", "2", "{script}"], "--node-rank must be in 0..1"),
    (["--max-restarts", "1", "{script}"], "--max-restarts needs --elastic"),
    (["--elastic", "--max-restarts", "-1", "{script}"], "--max-restarts must be at least 0"),
])
def test_bad_elastic_arguments_exit_2(tmp_path: Path, args, message) -> None:
    marker = tmp_path / "ran"
    script = write(tmp_path, "mark.py", f"open({str(marker)!r}, 'w').close()\n")
    res = launch(*[a.format(script=script) for a in args])
    assert res.returncode == 2 and message in res.stderr, res.stderr
    assert not marker.exists()


@pytest.mark.timeout(180)
def test_a_node_started_later_joins_the_running_job(tmp_path: Path) -> None:
    """--nnodes 1:2: node 0 starts the job alone (2 ranks); node 1, started later, joins it (its 2 ranks are
    newcomers), and the job finishes on 4 ranks. Both nodes are this host, on loopback."""
    script = write(tmp_path, "grow.py", SCRIPT)
    env = _env(PYCOLL_JOB_TOKEN=os.urandom(32).hex())
    common = ["--elastic", "--nnodes", "1:2", "-n", "2", "--master-port", str(free_port()),
              "--store-port", str(free_port())]
    argv = [script, "-1", "0", "0", "30", "4"]
    first = subprocess.Popen([sys.executable, "-m", "pycoll", "run", *common, "--node-rank", "0", *argv], cwd=REPO,
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.0)  # the job runs on node 0 alone by now, or soon: node 1 joins it either way
        second = launch(*common, "--node-rank", "1", *argv, env=env, timeout=150)
        out, err = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    assert second.returncode == 0 and first.returncode == 0, out + err + second.stdout + second.stderr
    # together (ranks 2 and 3 of 4), or one grow each in arrival order when they arrive steps apart (the first
    # rank 2 of 3, the second rank 3 of 4): either slot may arrive first
    joined = re.findall(r"\[rank ([23])\] slot ([23]) life 0 joined as rank (\d) of ([34])", second.stdout)
    assert all(label == slot for label, slot, _, _ in joined), second.stdout
    assert sorted({s for _, s, _, _ in joined}) == ["2", "3"], second.stdout
    assert sorted((r, n) for _, _, r, n in joined) in ([("2", "4"), ("3", "4")], [("2", "3"), ("3", "4")]), \
        second.stdout
    assert out.count("done on 4 ranks") == 2 and second.stdout.count("done on 4 ranks") == 2, out + second.stdout


# -- the elastic trainer ----------------------------------------------------------------------------------
def _trainer(tmp_path: Path, epochs: int, kill_at=None):
    """`pycoll run --elastic --max-restarts 1 -n 4 -m pycoll.trainer --elastic`; with kill_at, SIGKILL rank 2
    when rank 0 has logged that step (rank 0 logs every step). Rank 0 sleeps 60 ms a step (--straggler: the
    same in both runs, no change to the numbers), so the run outlasts a restart however quiet the machine
    (else 550 steps of ~5 ms end before a restarted Python has imported numpy). The output, and when the
    kill landed."""
    out = tmp_path / f"trainer{kill_at}.out"
    with open(out, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "pycoll", "run", "--elastic", "--max-restarts", "1", "-n", "4",
                                 "-m", "pycoll.trainer", "--elastic", "--epochs", str(epochs), "--log-every", "1",
                                 "--straggler", "0:60"],
                                cwd=REPO, env=_env(), stdout=f, stderr=subprocess.STDOUT, text=True)
    killed = None
    try:
        if kill_at is not None:
            deadline = time.monotonic() + 120
            while f"step {kill_at}/" not in out.read_text() and time.monotonic() < deadline:
                time.sleep(0.01)
            for pid in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split():
                with open(f"/proc/{pid}/environ", "rb") as env:
                    if b"RANK=2" in env.read().split(b"\0"):
                        killed = time.monotonic()
                        os.kill(int(pid), signal.SIGKILL)
        assert proc.wait(400) == 0, out.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    return out.read_text(), killed


def _final_test_accuracy(text: str) -> float:
    return float(re.search(r"final: .*\| test loss [\d.]+ acc ([\d.]+)%", text).group(1))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_elastic_trainer_heals_a_restarted_rank(tmp_path: Path) -> None:
    """4 ranks, rank 2 SIGKILLed at a random step and restarted by `pycoll run --elastic --max-restarts 1`:
    the run finishes on 4 ranks, bit-identical, within 0.5 points of an undisturbed run's test accuracy;
    reports the time from the kill to the first step on 4 ranks again, and the restart's own start-up."""
    epochs = 25  # 550 steps of 60 ms or more: a restarted rank (seconds to start, loaded) is back well before the end
    kill_at = random.Random().randint(10, 30)
    clean, _ = _trainer(tmp_path, epochs)
    hit, killed = _trainer(tmp_path, epochs, kill_at)
    assert killed is not None, hit
    died = re.search(r"\[t=([\d.]+)\] rank 2 died at step \d+; continued on 3 ranks after ([\d.]+) s", hit)
    came = re.search(r"\[rank 2\] pycoll.trainer: \[t=([\d.]+)\] joined the run as rank 3 of 4 at step (\d+) "
                     r"\(slot 2, restart 1, announced at t=([\d.]+)\)", hit)
    grew = re.search(r"\[t=([\d.]+)\] rank 3 joined at step \d+; continued on 4 ranks after ([\d.]+) s", hit)
    first = re.search(r"\[t=([\d.]+)\] first step on 4 ranks done", hit)
    assert died and came and grew and first, hit
    assert "replicas bit-identical across 4 rank(s): yes" in hit, hit
    announced, back = float(came.group(3)), float(first.group(1))
    a, b = _final_test_accuracy(clean), _final_test_accuracy(hit)
    load = os.getloadavg()[0]
    print(f"\nrank 2 killed at step {kill_at}: shrunk after {float(died.group(2)):.2f} s; restarted process announced "
          f"itself {announced - killed:.2f} s after the kill (its own start-up); first step on 4 ranks "
          f"{back - killed:.2f} s after the kill, {back - announced:.2f} s after it announced itself (grow and heal "
          f"{float(grew.group(2)):.2f} s); load average {load:.1f}")
    print(f"held-out accuracy: {a:.1f}% undisturbed, {b:.1f}% with rank 2 killed and restarted")
    assert abs(a - b) <= 0.5, (a, b)
    assert back - announced < 5.0 + 10.0 * (load > 8), (back - announced, load)  # goal 5 s (a loaded host: more)

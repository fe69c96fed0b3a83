"""Fault tolerance (pycoll/ft.py): revoke, agree and shrink with real processes that really die
(SIGKILL), on tcp, shm and auto; mpi refuses with a clear error."""
import os
import random
import signal
import statistics
import threading
import time

import numpy as np
import pytest

from multiproc import run_ranks

pytestmark = pytest.mark.timeout(180)
TRANSPORTS = ["tcp", "shm", "auto"]


def _env(transport, **extra):
    env = {"PYCOLL_TRANSPORT": transport, "PYCOLL_TIMEOUT": "30"}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _mark(tmp, name):
    """Record now (CLOCK_MONOTONIC, the same in every process of the host) in file `name`, atomically."""
    with open(os.path.join(tmp, name + ".tmp"), "w") as f:
        f.write(repr(time.monotonic()))
    os.replace(os.path.join(tmp, name + ".tmp"), os.path.join(tmp, name))


def _die(tmp, name):
    """Record when, then SIGKILL myself."""
    _mark(tmp, name)
    os.kill(os.getpid(), signal.SIGKILL)


def _marked_at(tmp, name):
    """The time recorded in file `name`, waiting for it to appear (up to 30 s)."""
    path = os.path.join(tmp, name)
    deadline = time.monotonic() + 30
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    with open(path) as f:
        return float(f.read())


def _step(comm, x):
    """The issue's loop, once: True if the step completed everywhere; `comm` may come back shrunk
    (a rank that died after the step completed still counted in it: check against `ran_on`)."""
    import pycoll
    _step.ran_on = list(comm.group)
    try:
        comm.allreduce(x)
        ok = True
    except (pycoll.PeerError, pycoll.RevokedError):
        comm.revoke()
        ok = False
    ok, dead = comm.agree(ok)
    if dead:
        comm = comm.shrink()
    return comm, ok, dead


# -- revoke ------------------------------------------------------------------------------------------
def _revoke_while_blocked(comm):
    """Two rounds: a small allreduce (on shm, the board's wait) and a large one (the rings' wait)."""
    import pycoll
    rounds = []
    for count in (8, 1 << 18):
        x = np.ones(count, np.float32)
        comm.allreduce(x)  # a first call's one-time work (imports, set-up) is not revocation latency
        comm.barrier()  # every rank is up (a slow start must not count as revocation latency)
        if comm.rank == 0:  # the others block in an allreduce rank 0 never joins
            time.sleep(0.5)
            when = time.monotonic()  # CLOCK_MONOTONIC: comparable between processes of one host
            comm.revoke()
            comm.revoke()  # idempotent
        else:
            entered = time.monotonic()
            with pytest.raises(pycoll.RevokedError) as info:
                comm.allreduce(x)
            when = (time.monotonic(), entered)
            assert not isinstance(info.value, pycoll.PeerError)
            assert "revoked by rank 0" in str(info.value), info.value
        with pytest.raises(pycoll.RevokedError):  # later calls too, until the agreement
            comm.barrier()
        ok, dead = comm.agree(comm.rank != 0)
        y = np.full(8, comm.rank + 1, np.float32)
        comm.allreduce(y)  # restored: the step can simply run again
        rounds.append((when, ok, dead, float(y[0])))
    return rounds


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_revoke_reaches_every_member_within_1s_then_agree_restores(transport):
    results = run_ranks(_revoke_while_blocked, 4, env=_env(transport))
    n = len(results)
    for i, what in enumerate(("8 floats", "1 MiB")):
        revoked_at = results[0][i][0]
        for rank, rounds in enumerate(results):
            when, ok, dead, total = rounds[i]
            assert ok is False and dead == [] and total == n * (n + 1) / 2
            if not rank:
                continue
            raised_at, entered = when
            took = raised_at - max(revoked_at, entered)  # a rank late into the call raises at its start
            print(f"{transport}, {what}: rank {rank} raised RevokedError {took:.3f} s after the revoke")
            assert took < 1.0


def _revoke_from_another_thread(comm):
    import pycoll
    caught = []
    if comm.rank == 0:
        def blocked():
            t0 = time.monotonic()
            try:
                comm.allreduce(np.ones(1 << 16, np.float32))  # the others never call it
            except pycoll.RevokedError as e:
                caught.append((time.monotonic() - t0, str(e)))
        thread = threading.Thread(target=blocked)
        thread.start()
        time.sleep(0.5)
        t1 = time.monotonic()
        comm.revoke()
        thread.join(5)
        assert caught and not thread.is_alive(), "the blocked thread never raised"
        caught[0] = (time.monotonic() - t1, caught[0][1])
    ok, dead = comm.agree(comm.rank != 0)
    y = np.ones(4, np.float64)
    comm.allreduce(y)
    return caught, ok, dead, float(y[0])


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_revoke_from_one_thread_while_another_is_blocked(transport):
    results = run_ranks(_revoke_from_another_thread, 3, env=_env(transport))
    (caught, ok, dead, total) = results[0]
    assert caught[0][0] < 1.0, caught
    assert all(r[1:] == (False, [], 3.0) for r in results), results


def _revoke_races_death(comm, tmp):
    """Step 1: rank 3 dies at about the moment rank 1 revokes (the others may see either first)."""
    import pycoll
    errors, step = set(), 0
    while step < 2:
        if step == 1 and comm.group[comm.rank] == 3:
            _die(tmp, "victim")
        if step == 1 and comm.group[comm.rank] == 1 and not errors:
            errors.add("revoked it")
            comm.revoke()
        x = np.full(1 << 14, comm.group[comm.rank] + 1, np.float64)
        try:
            comm.allreduce(x)
            ok = True
        except (pycoll.PeerError, pycoll.RevokedError) as e:
            errors.add(type(e).__name__)
            comm.revoke()
            ok = False
        ok, dead = comm.agree(ok)
        if dead:
            comm = comm.shrink()
        step += ok
    return sorted(errors), comm.size, list(comm.group), float(x[0])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_revoke_racing_a_death(transport, tmp_path):
    results = run_ranks(_revoke_races_death, 4, str(tmp_path), env=_env(transport), expect_fail=True)
    assert not results[3][0] and "code -9" in results[3][1]
    for ok, value in results[:3]:
        assert ok, value
        errors, size, group, total = value
        assert errors and size == 3 and group == [0, 1, 2] and total == 6.0, value


# -- the ULFM-style kill-recover loop ----------------------------------------------------------------
def _kill_recover_loop(comm, victims, every, tmp, nbytes):
    """Allreduce in a loop; every `every` completed steps the next victim SIGKILLs itself; survivors
    shrink and go on until two remain. Each result is checked against the sum over the ranks alive."""
    me = comm.rank
    kills, step, recoveries = 0, 0, []
    pending = None  # the kill whose recovery is being timed
    count = max(1, nbytes // 8)
    while step < every * (len(victims) + 1):
        if pending is None and kills < len(victims) and step == every * (kills + 1):
            if me == victims[kills]:
                _die(tmp, f"kill{kills}")
            pending, kills = kills, kills + 1
        x = np.full(count, (me + 1) * (step + 1), np.float64)
        comm, ok, _ = _step(comm, x)
        if not ok:
            continue  # redo the step that failed
        expect = sum(g + 1 for g in _step.ran_on) * (step + 1)
        assert np.all(x == expect), (step, x[0], expect, _step.ran_on, comm.group)
        if pending is not None:
            recoveries.append((pending, comm.size, time.monotonic() - _marked_at(tmp, f"kill{pending}")))
            pending = None
        step += 1
    return list(comm.group), recoveries


def _distribution(label, samples):
    q = statistics.quantiles(samples, n=4) if len(samples) > 1 else samples * 3
    return (f"| {label} | {len(samples)} | {min(samples):.3f} | {q[0]:.3f} | {statistics.median(samples):.3f} | "
            f"{q[2]:.3f} | {max(samples):.3f} |")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_kill_recover_loop_6_ranks_down_to_2(transport, tmp_path):
    """6 ranks; every 4 steps a random rank (rank 0 included: the store is not on it) is SIGKILLed;
    kill-to-next-completed-call within 5 s on every survivor."""
    victims = random.Random(22).sample(range(6), 4)
    results = run_ranks(_kill_recover_loop, 6, victims, 4, str(tmp_path), 1 << 15, env=_env(transport),
                        expect_fail=True, timeout=150)
    survivors = sorted(set(range(6)) - set(victims))
    samples = []
    for rank, (ok, value) in enumerate(results):
        if rank in victims:
            assert not ok and "code -9" in value, value
            continue
        assert ok, value
        group, recoveries = value
        assert group == survivors and len(recoveries) == 4, value
        samples += [took for _, _, took in recoveries]
    print(f"\nkill -> next completed allreduce, {transport}, victims {victims}:")
    print(_distribution(transport, samples))
    assert max(samples) <= 5.0, samples


# -- a rank killed during each collective and algorithm family ---------------------------------------
CASES = [("allreduce", "ring"), ("allreduce", "recursive_doubling"), ("allreduce", "halving_doubling"),
         ("allreduce", "tree"), ("allreduce", "oneshot"), ("allreduce", "twoshot"), ("allreduce", "cma"),
         ("broadcast", "tree"), ("allgather", "ring"), ("allgather", "cma"), ("reduce_scatter", "ring"),
         ("reduce_scatter", "cma"), ("alltoall", "pairwise"), ("barrier", None)]


def _killed_during(comm, collective, algo, tmp):
    import pycoll
    n = 1 << 12 if algo in ("oneshot",) else 1 << 18
    if comm.rank == 1:  # dies from a timer, inside one of its calls
        threading.Timer(0.3, _die, (tmp, "victim")).start()
    deadline = time.monotonic() + 20
    failures = 0
    while time.monotonic() < deadline:
        x = np.full(n * comm.size, comm.group[comm.rank] + 1, np.float32)
        ran_on = list(comm.group)
        try:
            call = getattr(comm, collective)
            kwargs = {} if algo is None or collective not in ("allreduce", "broadcast") else {"algo": algo}
            result = call() if collective == "barrier" else call(x, **kwargs)
            ok = True
        except (pycoll.PeerError, pycoll.RevokedError):
            comm.revoke()
            ok = False
        ok, dead = comm.agree(ok)
        if dead:
            comm = comm.shrink()
        failures += (not ok) or bool(dead)  # a broadcast can complete without a dead leaf
        if ok and failures:
            if collective == "allreduce":
                assert np.all(x == sum(g + 1 for g in ran_on)), (x[0], ran_on)
            elif collective == "allgather":
                assert [int(v) for v in np.asarray(result)[:, 0]] == [g + 1 for g in ran_on]
            return comm.size, failures
    raise AssertionError("rank 1's death was never noticed")


@pytest.mark.parametrize("collective,algo", CASES, ids=[f"{c}-{a}" for c, a in CASES])
def test_rank_killed_during_each_collective_and_algorithm(collective, algo, tmp_path):
    transport = "shm" if algo in ("oneshot", "twoshot", "cma") else "tcp"  # the board is shared memory
    env = _env(transport, **({"PYCOLL_ALGO": algo} if algo and collective not in ("allreduce", "broadcast") else {}))
    results = run_ranks(_killed_during, 4, collective, algo, str(tmp_path), env=env, expect_fail=True, timeout=90)
    assert not results[1][0]
    for ok, value in results[:1] + results[2:]:
        assert ok, value
        assert value[0] == 3 and value[1] >= 1, value


# -- split / dup children, leaks ----------------------------------------------------------------------
def _split_then_die(comm, tmp):
    """Halves {0,1} and {2,3}; rank 3 dies: {2} shrinks to one rank, {0,1} is only restored by agree.
    Rank 3 dies only once every rank has made its children (a death during split, a collective of
    the world, would fail it on a slower rank: not what this test is about)."""
    half = comm.split(comm.rank // 2)
    dup = half.dup()
    x = np.ones(4, np.float64)
    dup.allreduce(x)
    _mark(tmp, f"made{comm.rank}")
    if comm.rank == 3:
        for r in range(comm.size):
            _marked_at(tmp, f"made{r}")
        _die(tmp, "victim")
    sizes = []
    for _ in range(3):
        while True:
            x = np.ones(4, np.float64)
            dup, ok, dead = _step(dup, x)
            if ok:
                break
        assert x[0] == dup.size
        sizes.append(dup.size)
    return sizes


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_split_and_dup_children_shrink_or_recover(transport, tmp_path):
    results = run_ranks(_split_then_die, 4, str(tmp_path), env=_env(transport), expect_fail=True)
    assert results[0] == (True, [2, 2, 2]) and results[1] == (True, [2, 2, 2]), results
    assert results[2] == (True, [1, 1, 1]), results


def _resources():
    return len(os.listdir("/proc/self/fd")), threading.active_count()


def _shrink_leaks_nothing(comm, tmp):
    x = np.ones(1 << 10, np.float32)
    comm.allreduce(x, async_op=True).wait()  # the collectives' worker thread exists
    comm.barrier()
    before = _resources()
    if comm.rank == 2:  # only once every rank is past the barrier: a message of its last round may still
        for r in (0, 1, 3):  # be in flight when it dies, and a survivor would then fail the barrier itself
            _marked_at(tmp, f"passed{r}")
        _die(tmp, "victim")
    _mark(tmp, f"passed{comm.rank}")
    while True:
        x = np.ones(1 << 10, np.float32)
        comm, ok, _ = _step(comm, x)
        if ok:
            break
    for _ in range(3):
        comm.allreduce(x, async_op=True).wait()
    after = _resources()
    shm = comm.transport if comm.transport.name == "shm" else getattr(comm.transport, "_shm", None)
    return before, after, list(comm.group), _kept_for(comm.transport, 2), sorted((shm.segments if shm else {}).values())


def _kept_for(transport, peer):
    """What a transport's tcp part still holds for `peer`: its zmq connection and monitor, raw
    streams, flow-control counts (empty when no part is tcp)."""
    tcp = transport if transport.name == "tcp" else getattr(transport, "_tcp", None)
    if tcp is None:
        return []
    kept = {"zmq connection": tcp._dealers[peer] is not None, "monitor": peer in tcp._peer_monitors.values(),
            "raw streams": peer in tcp._bulk.socks,
            "credit": tcp._flow is not None and peer in tcp._flow.stats()["in_flight"]}
    return [what for what, held in kept.items() if held]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_shrink_leaks_no_fds_threads_or_segments(transport, tmp_path):
    results = run_ranks(_shrink_leaks_nothing, 4, str(tmp_path), env=_env(transport), expect_fail=True)
    for rank, (ok, value) in enumerate(results):
        if rank == 2:
            continue
        assert ok, value
        (fds0, threads0), (fds1, threads1), group, kept, segments = value
        assert group == [0, 1, 3]
        assert threads1 <= threads0, (threads0, threads1)  # the old communicator's worker is gone
        assert fds1 < fds0, (fds0, fds1)  # a dead peer's pidfd / connections are closed
        assert kept == [], f"rank {rank} still holds for dead rank 2: {kept}"
        assert len(segments) == (0 if transport == "tcp" else 4), segments
        # this job's segments (the dead rank's included), not whatever other tests run meanwhile
        leftover = [name for name in segments if os.path.exists(os.path.join("/dev/shm", name))]
        assert not leftover, leftover


# -- partitions ----------------------------------------------------------------------------------------
def _comm(rank, hosts):
    from types import SimpleNamespace
    return SimpleNamespace(rank=rank, size=len(hosts), group=list(range(len(hosts))), name="world",
                           membership=SimpleNamespace(hosts=hosts))


@pytest.mark.parametrize("hosts,survivors,goes_on", [
    (["a", "a", "b"], [0, 1], True),            # host b cut off: 2 of 3 go on
    (["a", "a", "b"], [2], False),              # ... and its rank refuses to go on alone
    (["a", "a", "b", "b"], [0, 1], True),       # a tie: the half holding rank 0
    (["a", "a", "b", "b"], [2, 3], False),
    (["a", "a", "a", "a"], [3], True),          # one host: no partition, deaths only
])
def test_only_a_majority_goes_on_after_a_partition(hosts, survivors, goes_on):
    import pycoll
    from pycoll import ft
    comm = _comm(survivors[0], hosts)
    if goes_on:
        ft._check_quorum(comm, survivors)
    else:
        with pytest.raises(pycoll.PartitionError, match="minority"):
            ft._check_quorum(comm, survivors)


# -- pycoll run --elastic and the elastic trainer -------------------------------------------------------
ELASTIC_SCRIPT = """
import os, signal, sys
import numpy as np
import pycoll

comm = pycoll.init()
step = 0
while step < 6:
    if step == 3 and comm.group[comm.rank] == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    x = np.ones(64, np.float32)
    try:
        comm.allreduce(x); ok = True
    except (pycoll.PeerError, pycoll.RevokedError):
        comm.revoke(); ok = False
    ok, dead = comm.agree(ok)
    if dead:
        comm = comm.shrink()
    step += ok
print(f"done on {comm.size} ranks, sum {x[0]:g}")
comm.close()
"""


def _launch(*args, timeout=120):
    import subprocess
    import sys
    from test_launcher import _env
    return subprocess.run([sys.executable, "-m", "pycoll", "run", *args], env=_env(), capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("elastic", [True, False])
def test_pycoll_run_elastic_survives_a_killed_rank(tmp_path, elastic):
    script = tmp_path / "elastic.py"
    script.write_text(ELASTIC_SCRIPT)
    proc = _launch(*(["--elastic"] if elastic else []), "-n", "4", str(script))
    if elastic:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert proc.stdout.count("done on 3 ranks, sum 3") == 3, proc.stdout
        assert "killed by signal SIGKILL; the others go on (--elastic)" in proc.stderr
    else:
        # the job ends with the killed rank's code (survivors that recover on their own while the
        # launcher collects flight-recorder dumps may print before they are stopped)
        assert proc.returncode == 128 + signal.SIGKILL, proc.stdout + proc.stderr
        assert "the others go on" not in proc.stderr


def _trainer(tmp_path, kill_rank=None, after="step 30/"):
    """`pycoll run --elastic -n 4 -m pycoll.trainer --elastic`; SIGKILL rank `kill_rank` once rank 0
    has logged `after` (mid-epoch 2). The run's output."""
    import subprocess
    import sys
    from test_launcher import _env
    out = tmp_path / f"trainer{kill_rank}.out"
    with open(out, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "pycoll", "run", "--elastic", "-n", "4", "-m", "pycoll.trainer",
                                 "--elastic", "--epochs", "5", "--log-every", "10"], env=_env(), stdout=f,
                                stderr=subprocess.STDOUT, text=True)
    try:
        if kill_rank is not None:
            deadline = time.monotonic() + 90
            while after not in out.read_text() and time.monotonic() < deadline:
                time.sleep(0.05)
            # every rank stopped first, so that none gets further while the test finds the one to kill
            # (a step takes ~4 ms here: a loaded run once finished its training before the kill landed)
            ranks = [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                                    text=True).stdout.split()]
            for pid in ranks:
                os.kill(pid, signal.SIGSTOP)
            for pid in ranks:
                with open(f"/proc/{pid}/environ", "rb") as env:
                    doomed = f"RANK={kill_rank}".encode() in env.read().split(b"\0")
                os.kill(pid, signal.SIGKILL if doomed else signal.SIGCONT)
        assert proc.wait(150) == 0, out.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    return out.read_text()


def _final_test_accuracy(text):
    import re
    return float(re.search(r"final: .*\| test loss [\d.]+ acc ([\d.]+)%", text).group(1))


@pytest.mark.timeout(400)
def test_elastic_trainer_loses_a_rank_mid_epoch(tmp_path):
    import re
    clean = _trainer(tmp_path)
    hit = _trainer(tmp_path, kill_rank=2)
    event = re.search(r"rank 2 died at step \d+; continued on 3 ranks after [\d.]+ s", hit)
    print(f"\n{event.group(0) if event else hit}")
    assert event, hit
    assert "replicas bit-identical across 3 rank(s): yes" in hit, hit
    a, b = _final_test_accuracy(clean), _final_test_accuracy(hit)
    print(f"held-out accuracy: {a:.1f}% without a failure, {b:.1f}% with rank 2 killed")
    assert abs(a - b) <= 1.0, (a, b)

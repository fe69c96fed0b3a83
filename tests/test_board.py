"""The shared-memory board (transports/shm_board.py) and the one-shot and two-shot algorithms on it:
results equal a sequential numpy reduction in rank order on every rank (two-shot: bit-identical
everywhere, in each share's own order), the board is really used where all ranks share a host over
shm (and not over tcp or across hosts, where message-based algorithms run),
communicators get lanes of their own (concurrent async calls included), lanes run out gracefully,
and a rank that dies or never comes is named."""
import os
import signal
import time

import numpy as np
import pytest

from multiproc import run_ranks

pytestmark = pytest.mark.timeout(120)
SHM = {"PYCOLL_TRANSPORT": "shm"}
CASES = [(np.float32, "sum"), (np.float64, "prod"), (np.int32, "max"), (np.int64, "min"), (np.uint8, "bxor"),
         (np.float16, "sum"), ("bfloat16", "sum"), (np.int16, "band"), (np.int8, "bor"), (np.float32, "avg")]


def _inputs(rank: int, count: int, dtype) -> np.ndarray:
    rng = np.random.default_rng(1000 + rank)
    if np.dtype(dtype).kind == "f" or str(dtype) == "bfloat16":
        return rng.uniform(-2, 2, count).astype(dtype)
    return rng.integers(1, 50, count).astype(dtype)


def _expected(n: int, count: int, dtype, op: str) -> np.ndarray:
    """((x0 op x1) op x2) ... in the input dtype: the order the one-shot algorithm reduces in."""
    fn = {"sum": np.add, "avg": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum,
          "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}[op]
    acc = _inputs(0, count, dtype)
    for r in range(1, n):
        acc = fn(acc, _inputs(r, count, dtype)).astype(acc.dtype)
    if op == "avg":
        acc = (acc / n).astype(acc.dtype)
    return acc


def _oneshot_matrix(comm):
    """Every case at several counts (the last one above a slot: recursive doubling instead, which adds
    in another order), with the board's call counter telling whether the board ran."""
    import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)
    from pycoll.transports.shm_board import SLOT_BYTES
    bad, used = [], []
    for dtype, op in CASES:
        dt = np.dtype(dtype)
        for count in (0, 1, comm.size + 1, 1000, SLOT_BYTES // dt.itemsize, SLOT_BYTES // dt.itemsize + 1):
            x = _inputs(comm.rank, count, dtype)
            before = max(_board_calls(comm), 0)
            with np.errstate(all="ignore"):
                comm.allreduce(x, op=op, algo="oneshot")
                want = _expected(comm.size, count, dtype, op)
            used.append(_board_calls(comm) - before)
            exact = x.tobytes() == want.tobytes()
            floats = np.issubdtype(dt, np.inexact) or str(dt) == "bfloat16"
            close = floats and count * dt.itemsize > SLOT_BYTES and \
                np.allclose(x.astype(np.float64), want.astype(np.float64), rtol=2e-2, atol=0.1)
            if not (exact or close):
                bad.append(f"{dt} {op} count={count}")
    return bad, used


def _board_calls(comm) -> int:
    """How many calls the communicator's board has run (-1: it has none)."""
    return comm.board.calls if comm.board is not None else -1


@pytest.mark.parametrize("n", [2, 3, 4])
def test_oneshot_allreduce_equals_rank_order_numpy_on_every_rank(n):
    for rank, (bad, used) in enumerate(run_ranks(_oneshot_matrix, n, env=SHM, timeout=110)):
        assert not bad, f"rank {rank}: {bad}"
        # per case: five counts fit a slot (one board call each), the last one does not
        assert used == [1, 1, 1, 1, 1, 0] * len(CASES), (rank, used)


def _where_the_board_runs(comm):
    x = np.full(10, comm.rank + 1.0)
    comm.allreduce(x, algo="oneshot")
    comm.barrier()
    return float(x[0]), _board_calls(comm)


@pytest.mark.parametrize("env,calls", [({"PYCOLL_TRANSPORT": "shm"}, 2), ({"PYCOLL_TRANSPORT": "tcp"}, -1)])
def test_board_only_over_shm_and_recursive_doubling_elsewhere(env, calls):
    for total, used in run_ranks(_where_the_board_runs, 3, env=env):
        assert total == 6.0 and used == calls


def _two_fake_hosts(rank):
    os.environ["PYCOLL_HOSTID"] = f"fake-host-{rank % 2}"
    import pycoll
    with pycoll.init() as comm:
        world = _where_the_board_runs(comm)
        local = comm.split(rank % 2)  # one host each: these get a board
        return world, _where_the_board_runs(local), comm.transport.name


def test_no_board_across_hosts_but_on_a_host_of_a_split():
    for rank, (world, local, name) in enumerate(run_ranks(_two_fake_hosts, 4, init=False,
                                                           env={"PYCOLL_TRANSPORT": "auto"})):
        assert name == "auto(shm+tcp)"
        assert world == (10.0, -1)
        assert local == (3.0, 2)  # sub-ranks 0 and 1


def _concurrent(comm):
    """Async one-shot calls on three communicators in flight at once, from their worker threads."""
    dup, half = comm.dup(), comm.split(comm.rank % 2)
    works, arrays = [], []
    for k in range(30):
        for c, scale in ((comm, 1), (dup, 10), (half, 100)):
            x = np.full(7, (comm.rank + 1) * scale * (k + 1), np.int64)
            arrays.append((x, c, scale, k))
            works.append(c.allreduce(x, algo="oneshot", async_op=True))
    for w in works:
        assert w.wait(timeout=60)
    n = comm.size
    for x, c, scale, k in arrays:
        ranks = range(n) if c is not half else range(comm.rank % 2, n, 2)
        assert x[0] == sum(r + 1 for r in ranks) * scale * (k + 1), (scale, k, x[0])
    return [_board_calls(c) for c in (comm, dup, half)]


@pytest.mark.parametrize("n", [2, 4])
def test_concurrent_communicators_use_lanes_of_their_own(n):
    for calls in run_ranks(_concurrent, n, env=SHM):
        assert calls[0] >= 30 and calls[1] == 30 and calls[2] == 30  # world also ran dup's/split's set-up


def _many_communicators(comm):
    from pycoll.transports.shm_board import LANES
    comms = [comm.dup() for _ in range(LANES + 4)]
    out = []
    for c in comms:
        x = np.full(3, comm.rank + 1.0)
        c.allreduce(x, algo="oneshot")
        out.append((float(x[0]), _board_calls(c) > 0))
    return out


def test_lanes_run_out_gracefully():
    from pycoll.transports.shm_board import LANES
    for out in run_ranks(_many_communicators, 3, env=SHM):
        assert all(total == 6.0 for total, _ in out)
        # world took lane 0 (its barriers in dup), so LANES - 1 dups get a board and the rest do not
        assert [board for _, board in out] == [True] * (LANES - 1) + [False] * 5


def _killed_while_posting(comm, victim, algo, count):
    import pycoll
    x = np.ones(count, np.float32)
    comm.allreduce(x, algo=algo)
    if comm.rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        for _ in range(100_000):
            comm.allreduce(x, algo=algo)
    except pycoll.PeerError as e:
        return e.peer, str(e), time.monotonic() - t0
    return None, "no error", time.monotonic() - t0


@pytest.mark.parametrize("algo,count", [("oneshot", 4), ("twoshot", 300_000)])  # twoshot: 3 stage blocks
def test_a_rank_killed_during_board_calls_is_named_within_5s(algo, count):
    results = run_ranks(_killed_while_posting, 4, 1, algo, count, expect_fail=True, timeout=90,
                        env={**SHM, "PYCOLL_TIMEOUT": "30"})
    for rank, (ok, value) in enumerate(results):
        if rank == 1:
            assert not ok and "code -9" in value
            continue
        assert ok, value
        peer, msg, took = value
        assert peer == 1 and took < 5.0 and "rank 1 died" in msg and "allreduce (call" in msg, value


def _absent(comm, registered: bool = False):
    """Rank 2 skips an allreduce (one-shot, or on a registered buffer): the others time out naming it."""
    import pycoll
    x, algo = (comm.empty(100_000, np.float32), None) if registered else (np.ones(2), "oneshot")
    comm.allreduce(x, algo=algo)
    if comm.rank == 2:  # alive, but it leaves only once both others are done waiting on it
        for caller in (0, 1):
            comm.recv(np.empty(1), caller, tag=5, timeout=60)
        return None
    t0 = time.monotonic()
    try:
        comm.allreduce(x, algo=algo, timeout=1.0)
    except pycoll.TimeoutError as e:
        comm.send(np.ones(1), 2, tag=5)
        return e.peers, str(e), time.monotonic() - t0
    return None, "no error", 0.0


def test_a_rank_that_never_posts_is_named_in_the_timeout():
    for rank, got in enumerate(run_ranks(_absent, 3, env=SHM)):
        if rank == 2:
            continue
        peers, msg, took = got
        assert peers == [2] and "board post from rank 2" in msg and "allreduce (call 2" in msg, got
        assert took < 4.0, got


def _other_collectives(comm):
    """broadcast, reduce and allgather through the board (each one board call), and allgatherv with
    unequal counts through recursive doubling / Bruck (no board call)."""
    n, r = comm.size, comm.rank
    out = {}
    before = max(_board_calls(comm), 0)
    x = np.arange(5, dtype=np.float64) if r == n - 1 else np.zeros(5)
    comm.broadcast(x, root=n - 1, algo="oneshot")
    out["broadcast"] = (x.tolist(), _board_calls(comm) - before)
    before = _board_calls(comm)
    y = np.full(3, r + 1, np.int32)
    comm.reduce(y, root=1, algo="oneshot")
    out["reduce"] = (y.tolist(), _board_calls(comm) - before)
    before = _board_calls(comm)
    g = comm.allgather(np.array([r, 10 * r], np.int16), algo="oneshot")
    out["allgather"] = (g.tolist(), _board_calls(comm) - before)
    before = _board_calls(comm)
    v = comm.allgatherv(np.full(r + 1, r, np.int64), [k + 1 for k in range(n)], algo="oneshot")
    out["allgatherv"] = (v.tolist(), _board_calls(comm) - before)
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_broadcast_reduce_allgather_on_the_board(n):
    for r, out in enumerate(run_ranks(_other_collectives, n, env=SHM)):
        assert out["broadcast"] == ([0.0, 1.0, 2.0, 3.0, 4.0], 1)
        want = [n * (n + 1) // 2] * 3 if r == 1 else [r + 1] * 3  # only the root's buffer changes
        assert out["reduce"] == (want, 1)
        assert out["allgather"] == ([[k, 10 * k] for k in range(n)], 1)
        assert out["allgatherv"] == ([k for k in range(n) for _ in range(k + 1)], 0)


def _twoshot_matrix(comm):
    """Every case in place and out of place at counts from 0 to several stage blocks (ragged last
    block, shares smaller than a rank count); returns failures, the board calls per call, digests."""
    import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)
    from pycoll.transports.shm_board import STAGE_BYTES
    bad, used, digests = [], [], []
    for dtype, op in CASES:
        dt = np.dtype(dtype)
        per = STAGE_BYTES // dt.itemsize
        for count in (0, 1, comm.size - 1, 1000, per, per + 1, 2 * per + per // 3):
            x = _inputs(comm.rank, count, dtype)
            out = np.empty_like(x)
            before = max(_board_calls(comm), 0)
            with np.errstate(all="ignore"):
                comm.allreduce(x, out=out, op=op, algo="twoshot")
                comm.allreduce(x, op=op, algo="twoshot")
                want = _expected(comm.size, count, dtype, op)
            used.append(_board_calls(comm) - before)
            exact = np.issubdtype(dt, np.integer)
            for got in (out, x):
                if not (got.tobytes() == want.tobytes() if exact else
                        np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=2e-2, atol=0.1)):
                    bad.append(f"{dt} {op} count={count}")
            digests.append(hash(out.tobytes()) ^ hash(x.tobytes()))
    return bad, used, digests


@pytest.mark.parametrize("n", [2, 3, 4])
def test_twoshot_allreduce_across_stage_blocks_is_right_and_the_same_bits_everywhere(n):
    results = run_ranks(_twoshot_matrix, n, env=SHM, timeout=110)
    for rank, (bad, used, digests) in enumerate(results):
        assert not bad, f"rank {rank}: {bad}"
        # one board call per block and one after the last, for each of the two calls per count (count 0:
        # no block)
        assert used == [0, 4, 4, 4, 4, 6, 8] * len(CASES), (rank, used)
        assert digests == results[0][2], f"rank {rank} got other bits than rank 0"


def _twoshot_without_a_stage(comm):
    """Over tcp there is no board; on a communicator whose lane has no stage there is a board but
    no stage: either way two-shot runs halving-doubling (no board call) and gets the sum."""
    from pycoll.transports.shm_board import STAGE_LANES
    got = []
    comms = [comm] + [comm.dup() for _ in range(STAGE_LANES + 1)]
    for c in comms:
        x = np.arange(300_000, dtype=np.float64) * (comm.rank + 1)
        before = max(_board_calls(c), 0)
        c.allreduce(x, algo="twoshot")
        got.append((bool(np.array_equal(x, np.arange(300_000) * sum(range(1, comm.size + 1)))),
                    _board_calls(c) - before))
    return got


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_twoshot_falls_back_to_halving_doubling_without_a_stage(transport):
    from pycoll.transports.shm_board import STAGE_LANES
    for got in run_ranks(_twoshot_without_a_stage, 3, env={"PYCOLL_TRANSPORT": transport}):
        assert all(ok for ok, _ in got), got
        calls = [used for _, used in got]
        if transport == "tcp":
            assert calls == [-1] * len(got)
        else:  # world took lane 0, its dups lanes 1, 2, ...: 2.4 MB is two blocks (three board calls) where there is a stage
            assert calls[:STAGE_LANES] == [3] * STAGE_LANES and calls[STAGE_LANES:] == [0, 0], calls


def _count_mismatch(comm, count, other, algo="twoshot"):
    """Rank 0 allreduces `count` floats with `algo`, the others `other`."""
    import pycoll
    x = np.ones(count if comm.rank == 0 else other, np.float32)
    try:
        comm.allreduce(x, algo=algo, timeout=20)
    except pycoll.ProtocolError as e:
        return str(e), bool(np.all(x == 1))
    return "no error", bool(np.all(x == 1))


@pytest.mark.parametrize("extra", [1000, 5])  # a first block of another size; the same first block
def test_twoshot_with_different_counts_fails_at_the_first_block(extra):
    from pycoll.transports.shm_board import STAGE_BYTES
    count = 2 * STAGE_BYTES // 4
    for rank, (msg, untouched) in enumerate(run_ranks(_count_mismatch, 3, count, count + extra, env=SHM)):
        assert "board post carries" in msg and "did the ranks call" in msg, (rank, msg)
        assert untouched, f"rank {rank}: its buffer changed before the mismatch was found"

"""Allreduce by cross-memory attach (algorithms/cma.py, transports/shm_cma.py): every case in place
and out of place, from 0 elements to several scratch blocks per share, equals numpy's reduction (exact
for integers) with the same bits on every rank, reads peers through the kernel (counted), works at
any buffer offset; a rank whose kernel refuses makes every rank run two-shot instead; ranks that pass
different counts all raise; a rank killed inside the call is named (tests/test_ft.py)."""
import hashlib

import numpy as np
import pytest

from multiproc import run_ranks
from test_board import CASES, SHM, _board_calls, _count_mismatch, _expected, _inputs

pytestmark = pytest.mark.timeout(180)


def _counting(comm):
    """Count this rank's cross-memory reads and writes: [reads, writes]."""
    from pycoll.transports.capabilities import PeerMemory
    memory = comm.transport.offers(PeerMemory)
    counts = [0, 0]
    read, write = memory.read, memory.write

    def counted_read(peer, address, into):
        counts[0] += 1
        read(peer, address, into)

    def counted_write(peer, address, data):
        counts[1] += 1
        write(peer, address, data)
    memory.read, memory.write = counted_read, counted_write
    return counts


def _cma_matrix(comm):
    import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)
    from pycoll.algorithms.cma import BLOCK_BYTES
    counts = _counting(comm)
    bad, used, digests = [], [], []
    for dtype, op in CASES:
        dt = np.dtype(dtype)
        block = BLOCK_BYTES // dt.itemsize
        for count in (0, 1, comm.size - 1, 1000, block * comm.size + 1, 2 * block * comm.size + 7):
            x = _inputs(comm.rank, count, dtype)
            out = np.empty_like(x)
            with np.errstate(all="ignore"):
                before, reads = max(_board_calls(comm), 0), counts[0]
                comm.allreduce(x, out=out, op=op, algo="cma")
                comm.allreduce(x, op=op, algo="cma")
                used.append((_board_calls(comm) - before, counts[0] > reads))
                want = _expected(comm.size, count, dtype, op)
            for kind, got in (("out of place", out), ("in place", x)):
                exact = np.issubdtype(dt, np.integer)
                if not (got.tobytes() == want.tobytes() if exact else
                        np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=2e-2, atol=0.1)):
                    bad.append(f"{dt} {op} count={count} {kind}: wrong")
            digests.append(hashlib.sha1(x.tobytes()).hexdigest())
    return bad, used, digests, counts


@pytest.mark.parametrize("n", [2, 3, 4])
def test_cma_allreduce_is_right_and_the_same_bits_on_every_rank(n):
    results = run_ranks(_cma_matrix, n, env=SHM, timeout=170)
    for rank, (bad, used, digests, counts) in enumerate(results):
        assert not bad, f"rank {rank}: {bad}"
        # two board posts per call, two calls per count; peers are read once a share has elements
        assert [posts for posts, _ in used] == [4] * len(used), (rank, used)
        assert all(read for i, (_, read) in enumerate(used) if i % 6 >= 3), (rank, used)  # 1000 elements up
        # each block read from every peer is written to every peer (the peers were probed when the
        # communicator was made, before the counting began)
        assert counts[0] == counts[1] and counts[1] > 0, counts
        assert digests == results[0][2], f"rank {rank} got other bits than rank 0"


def _offsets(comm):
    """Plain arrays at another offset within their page on every rank, in and out of place."""
    offsets = (0, 8, 16, 64, 2048 + 16)
    count = (3 << 20) // 4 + 5
    raw, out_raw = np.empty(4 * count + 8192, np.uint8), np.empty(4 * count + 8192, np.uint8)
    bad = []
    for i in range(len(offsets)):
        mine = offsets[(i + comm.rank) % len(offsets)]
        base = -raw.ctypes.data % 4096 + mine
        x = raw[base:base + 4 * count].view(np.float32)
        x[:] = np.arange(count, dtype=np.float32) % 97 + comm.rank
        want = sum(np.arange(count, dtype=np.float32) % 97 + k for k in range(comm.size))
        obase = -out_raw.ctypes.data % 4096 + offsets[(i + 2) % len(offsets)]
        out = out_raw[obase:obase + 4 * count].view(np.float32)
        comm.allreduce(x, out=out, algo="cma")
        comm.allreduce(x, algo="cma")
        if not (np.array_equal(out, want) and np.array_equal(x, want)):
            bad.append(mine)
    return bad


def test_cma_allreduce_is_right_at_every_buffer_offset():
    for rank, bad in enumerate(run_ranks(_offsets, 3, env=SHM, timeout=120)):
        assert not bad, f"rank {rank}: wrong at offsets {bad}"


def _refused_on_rank_1(comm):
    """Rank 1's kernel refuses cross-memory attach (as under seccomp or Yama): every rank runs
    two-shot, which gets the sum, and nobody copies a block through the kernel."""
    import pycoll.algorithms.twoshot as twoshot
    from pycoll.transports.capabilities import PeerMemory
    if comm.rank == 1:
        memory = comm.transport.offers(PeerMemory)
        memory._ok = {memory.rank: True}
        memory._probe = lambda peer: False
    counts = _counting(comm)
    ran = []
    real = twoshot.allreduce

    def counted(*args, **kwargs):
        ran.append(1)
        return real(*args, **kwargs)
    twoshot.allreduce = counted
    x = np.arange(3 << 20, dtype=np.float64) * (comm.rank + 1)
    comm.allreduce(x, algo="cma")
    return bool(np.array_equal(x, np.arange(3 << 20) * sum(range(1, comm.size + 1)))), len(ran), counts


def test_a_rank_that_cannot_reach_its_peers_makes_every_rank_run_two_shot():
    for rank, (right, twoshots, counts) in enumerate(run_ranks(_refused_on_rank_1, 3, env=SHM)):
        # (no block copied; the peers were probed when the communicator was made, before the counting)
        assert right and twoshots == 1 and counts == [0, 0], (rank, right, twoshots, counts)


def test_cma_with_different_counts_fails_before_touching_a_buffer():
    count = 1 << 20
    for rank, (msg, untouched) in enumerate(run_ranks(_count_mismatch, 3, count, count + 5, "cma", env=SHM)):
        assert "board post carries" in msg and "did the ranks call" in msg, (rank, msg)
        assert untouched, f"rank {rank}: its buffer changed before the mismatch was found"


def _disabled(comm):
    from pycoll.transports.capabilities import PeerMemory
    return comm.transport.offers(PeerMemory).reaches(comm.group)


def test_pycoll_cma_0_turns_it_off_and_the_probe_passes_here():
    assert run_ranks(_disabled, 2, env=SHM) == [True, True]
    assert run_ranks(_disabled, 2, env={**SHM, "PYCOLL_CMA": "0"}) == [False, False]


def _async_on_two_communicators(comm):
    """Async calls on the world and a duplicate at once: two worker threads run cma side by side, each
    with its own scratch block."""
    dup = comm.dup()
    n, r = comm.size, comm.rank
    xs = [np.arange(3 << 18, dtype=np.float32) % 101 * (r + 1 + k) for k in range(4)]
    works = [(comm if k % 2 == 0 else dup).allreduce(x, algo="cma", async_op=True) for k, x in enumerate(xs)]
    for w in works:
        w.wait()
    dup.close()
    return [bool(np.array_equal(x, np.arange(3 << 18, dtype=np.float32) % 101 * sum(q + 1 + k for q in range(n))))
            for k, x in enumerate(xs)]


def test_async_cma_calls_on_two_communicators_at_once():
    for rank, ok in enumerate(run_ranks(_async_on_two_communicators, 3, env=SHM)):
        assert all(ok), (rank, ok)


def _data_movement(comm):
    """reduce_scatter (equal and uneven blocks), allgather and broadcast (every root) by cma, at counts
    from 0 to several scratch blocks, against numpy; reads counted; allgatherv (counts) falls back."""
    from pycoll.algorithms.cma import BLOCK_BYTES
    counts = _counting(comm)
    n, r = comm.size, comm.rank
    bad = []
    for dt in (np.float32, np.int64, np.float16):
        for count in (0, 1, 1000, 2 * BLOCK_BYTES // np.dtype(dt).itemsize + 3):
            before = counts[0]
            x = (np.arange(count) % 13 + r).astype(dt)
            if not np.array_equal(comm.allgather(x, algo="cma"), np.stack([(np.arange(count) % 13 + k).astype(dt)
                                                                           for k in range(n)])):
                bad.append(f"allgather {dt.__name__} {count}")
            for root in range(n):
                y = (np.arange(count) % 11 * (r + 1)).astype(dt)
                comm.broadcast(y, root=root, algo="cma")
                if not np.array_equal(y, (np.arange(count) % 11 * (root + 1)).astype(dt)):
                    bad.append(f"broadcast {dt.__name__} {count} root {root}")
            for blocks in ([count] * n, [count + k for k in range(n)]):
                z = (np.arange(sum(blocks)) % 5 * (r + 1)).astype(dt)
                got = comm.reduce_scatter(z, counts=blocks, algo="cma").reshape(-1)
                full = (np.arange(sum(blocks)) % 5 * sum(range(1, n + 1))).astype(dt)
                if not np.array_equal(got, full[sum(blocks[:r]):sum(blocks[:r + 1])]):
                    bad.append(f"reduce_scatter {dt.__name__} {blocks}")
            if count and counts[0] == before:
                bad.append(f"{dt.__name__} {count}: no cross-memory read")
    v = comm.allgatherv(np.full(r + 1, r, np.int32), [k + 1 for k in range(n)], algo="cma")
    if not np.array_equal(v, np.concatenate([np.full(k + 1, k, np.int32) for k in range(n)])):
        bad.append("allgatherv")
    return bad, counts[1]


@pytest.mark.parametrize("n", [2, 3])
def test_cma_reduce_scatter_allgather_and_broadcast(n):
    for rank, (bad, writes) in enumerate(run_ranks(_data_movement, n, env=SHM, timeout=170)):
        assert not bad and writes == 0, (rank, bad, writes)  # (these only read their peers)


def _mixed_calls(comm):
    """Rank 0 calls allgather where the others call broadcast, both by cma: every rank raises."""
    import pycoll
    x = np.ones(1 << 16, np.float32)
    try:
        if comm.rank == 0:
            comm.allgather(x, algo="cma", timeout=20)
        else:
            comm.broadcast(x, algo="cma", timeout=20)
    except pycoll.ProtocolError as e:
        return str(e)
    return "no error"


def test_cma_calls_of_different_collectives_raise_on_every_rank():
    for rank, msg in enumerate(run_ranks(_mixed_calls, 3, env=SHM)):
        assert "board post carries" in msg, (rank, msg)


def _dtype_mismatch(comm, collective):
    """Rank 0 passes float32, the others float64, the same count: the board's signature cannot see the
    difference (it checks the posted row), so cma compares dtypes before any copy."""
    import pycoll
    x = np.ones(1 << 18, np.float32 if comm.rank == 0 else np.float64)
    try:
        if collective == "allreduce":
            comm.allreduce(x, algo="cma", timeout=20)
        else:
            comm.allgather(x, algo="cma", timeout=20)
    except pycoll.ProtocolError as e:
        return str(e), bool(np.all(x == 1))
    return "no error", bool(np.all(x == 1))


@pytest.mark.parametrize("collective", ["allreduce", "allgather"])
def test_cma_with_different_dtypes_fails_before_touching_a_buffer(collective):
    for rank, (msg, untouched) in enumerate(run_ranks(_dtype_mismatch, 3, collective, env=SHM)):
        assert "different dtypes" in msg, (rank, msg)
        assert untouched, f"rank {rank}: its buffer changed before the mismatch was found"


def _counts_mismatch(comm):
    """reduce_scatter with the same total but other counts on rank 0: every rank would read its peers'
    arrays where its own counts say, so cma compares the counts before any copy."""
    import pycoll
    n = comm.size
    counts = [1000 * (k + 1) for k in range(n)]
    if comm.rank == 0:
        counts = counts[::-1]
    x = np.ones(sum(counts), np.float32)
    out = np.full(counts[comm.rank], 7, np.float32)
    try:
        comm.reduce_scatter(x, out, counts=counts, algo="cma", timeout=20)
    except pycoll.ProtocolError as e:
        return str(e), bool(np.all(out == 7))
    return "no error", bool(np.all(out == 7))


def test_cma_reduce_scatter_with_other_counts_of_the_same_total_raises_on_every_rank():
    for rank, (msg, untouched) in enumerate(run_ranks(_counts_mismatch, 3, env=SHM)):
        assert "board post carries" in msg and "counts" in msg, (rank, msg)
        assert untouched, f"rank {rank}: its output changed before the mismatch was found"


def _late_rank(comm):
    """Rank 2 enters a cma allreduce after the others gave up on it (timeout). Their arrays' addresses
    were posted, and rank 2 still writes its share into them: the arrays must stay alive, so those
    writes land there and not in memory the process has freed (and perhaps reused)."""
    import gc
    import weakref
    import pycoll
    n = 1 << 18
    x = np.full(n, comm.rank + 1, np.float32)
    if comm.rank == 2:
        for peer in (0, 1):
            comm.recv(np.empty(1), peer, tag=7, timeout=60)  # both have timed out
        try:
            comm.allreduce(x, algo="cma", timeout=3)  # it writes share 2, then waits on their done posts
        except pycoll.TimeoutError:
            pass
        for peer in (0, 1):
            comm.send(np.ones(1), peer, tag=8)
        return None
    try:
        comm.allreduce(x, algo="cma", timeout=0.5)
        return "no error"
    except pycoll.TimeoutError:
        pass
    alive = weakref.ref(x)
    del x
    gc.collect()
    comm.send(np.ones(1), 2, tag=7)
    comm.recv(np.empty(1), 2, tag=8, timeout=60)
    held = alive()
    if held is None:
        return "freed"
    lo = -(-n * 2 // 3)  # share 2 of 3 (chunk_bounds: the first shares take the remainder)
    return bool(np.all(held[lo:] == 6)), bool(np.all(held[:lo] == comm.rank + 1))


def test_a_rank_that_gave_up_keeps_the_arrays_a_late_peer_still_writes():
    for rank, got in enumerate(run_ranks(_late_rank, 3, env=SHM, timeout=120)):
        if rank != 2:
            assert got == (True, True), (rank, got)



def _candidates(rank, cma_off_on):
    """Whether the ranks agreed that they reach each other's memory (on the world and on a dup), whether
    the tuner picks cma for any allreduce from 1 to 256 MiB, and whether it prices cma at all.
    PYCOLL_CMA=0 on rank `cma_off_on` (-1: nowhere)."""
    import os
    import pycoll
    if rank == cma_off_on:
        os.environ["PYCOLL_CMA"] = "0"
    comm = pycoll.init()
    dup = comm.dup()
    picks = {c.selector.choose("allreduce", 1 << shift, c.size, None, c.topology)
             for c in (comm, dup) for shift in range(20, 29)}
    priced = comm.selector.tuner.predict("allreduce", "cma", 64 << 20, comm.topology) < float("inf")
    x = np.ones(3 << 20, np.float32)
    comm.allreduce(x, algo="cma")  # named, it still runs (two-shot where a rank cannot reach)
    return comm.peer_memory, dup.peer_memory, "cma" in picks, priced, bool(np.all(x == comm.size))


def test_the_tuner_leaves_cma_out_where_a_rank_cannot_reach_its_peers():
    """PYCOLL_CMA=0 on one rank: every rank agrees, when the lanes are exchanged, that cma is out, and the
    tuner never picks it (it picked cma and then ran two-shot after an extra post); with cma allowed
    everywhere it is priced."""
    env = {**SHM, "PYCOLL_TUNER": "probe"}
    for rank, got in enumerate(run_ranks(_candidates, 3, 1, env=env, init=False, timeout=120)):
        assert got == (False, False, False, False, True), (rank, got)
    for rank, got in enumerate(run_ranks(_candidates, 3, -1, env=env, init=False, timeout=120)):
        assert got[:2] == (True, True) and got[3] and got[4], (rank, got)

"""Registered (symmetric) buffers (Communicator.empty, pycoll/windows.py, algorithms/symmetric.py):
allreduce / reduce_scatter / allgather / broadcast on them equal numpy's answer with the same bits on
every rank and really read peers in place; a rank without a registered buffer makes every rank fall
back; mismatches raise on every rank; torch tensors made from them work; a death is named within
seconds and leaves nothing in /dev/shm; buffers outlive free() and close()."""
import hashlib
import os
import signal
import time

import numpy as np
import pytest

from collective_cases import COMBOS, dtype_of, make_input, reduce_ref
from multiproc import run_ranks
from test_board import _absent

pytestmark = pytest.mark.timeout(180)
SHM = {"PYCOLL_TRANSPORT": "shm"}


def _record_paths(log: list) -> None:
    """Make Channel.symmetric append whether each call took the registered path to `log`."""
    from pycoll.channel import Channel
    plain = Channel.symmetric

    def recorded(self, arrays, sig):
        views = plain(self, arrays, sig)
        log.append(views is not None)
        return views
    Channel.symmetric = recorded


def _registered_matrix(comm):
    """Every collective x dtype/op x count on registered buffers (in place and out of place), at
    offsets inside the buffer that differ between ranks; every result exact (small integers), the
    float32 ones hashed so the parent can compare ranks' bits."""
    import ml_dtypes  # noqa: F401  (bfloat16)
    from pycoll.transports.shm_board import SLOT_BYTES
    n, r = comm.size, comm.rank
    taken, bad, digests = [], [], []
    _record_paths(taken)
    salt = 0
    for dtype, op in COMBOS:
        dt = dtype_of(dtype)
        for count in (SLOT_BYTES // dt.itemsize + 1, 100_003) + ((1_000_003,) if dtype == "float32" else ()):
            salt += 1
            ins = [make_input(i, count * n, dtype, op, salt) for i in range(n)]
            want = reduce_ref(ins, op)
            lead = (16 * r) // dt.itemsize  # each rank's buffer starts elsewhere in its window
            win = comm.empty(count * n + (16 * n) // dt.itemsize + 64, dt)
            x = win[lead:lead + count * n]
            x[:] = ins[r]
            out = comm.empty(count * n, dt)
            with np.errstate(all="ignore"):
                comm.allreduce(x, out=out, op=op)
                if out.tobytes() != want.tobytes():
                    bad.append(f"allreduce out of place {dtype} {op} {count}")
                comm.allreduce(x, op=op)
                if x.tobytes() != want.tobytes():
                    bad.append(f"allreduce in place {dtype} {op} {count}")
                x[:] = ins[r]
                mine = comm.reduce_scatter(x, op=op)
                if mine.tobytes() != want[r * count:(r + 1) * count].tobytes():
                    bad.append(f"reduce_scatter {dtype} {op} {count}")
                counts = [count * n - (n - 1) * (count // 2)] + [count // 2] * (n - 1)
                mine = comm.reduce_scatter(x, op=op, counts=counts)
                lo = sum(counts[:r])
                if mine.tobytes() != want[lo:lo + counts[r]].tobytes():
                    bad.append(f"reduce_scatter counts {dtype} {op} {count}")
            block = x[:count]
            got = comm.allgather(block)
            if got.tobytes() != np.concatenate([v[:count] for v in ins]).tobytes():
                bad.append(f"allgather {dtype} {count}")
            comm.broadcast(x, root=n - 1)
            if x.tobytes() != ins[n - 1].tobytes():
                bad.append(f"broadcast {dtype} {count}")
            if dtype == "float32" and op == "sum":
                f = np.random.default_rng([r, salt]).standard_normal(count * n).astype(np.float32)
                x[:] = f
                comm.allreduce(x)
                digests.append(hashlib.sha1(x.tobytes()).hexdigest())
            comm.free(win)
            comm.free(out)
    return bad, taken, digests


@pytest.mark.parametrize("n", [2, 3, 4])
def test_collectives_on_registered_buffers_read_peers_in_place_and_agree(n):
    results = run_ranks(_registered_matrix, n, env=SHM, timeout=170)
    for rank, (bad, taken, digests) in enumerate(results):
        assert not bad, f"rank {rank}: {bad}"
        assert taken and all(taken), f"rank {rank}: some calls did not take the registered path: {taken}"
        assert digests == results[0][2], f"rank {rank} got other bits than rank 0"


def _one_rank_unregistered(comm, plain_rank):
    """Rank `plain_rank` passes ordinary arrays, the others registered ones: every rank falls back."""
    taken = []
    _record_paths(taken)
    n, count = comm.size, 300_001
    reg = comm.empty(count, np.float32)
    x = np.empty(count, np.float32) if comm.rank == plain_rank else reg
    x[:] = comm.rank + 1
    comm.allreduce(x)
    ok = bool((x == n * (n + 1) // 2).all())
    comm.broadcast(x, root=plain_rank)
    g = comm.allgather(x[:10_000])
    ok = ok and bool((g == n * (n + 1) // 2).all())
    x[:] = 1
    ok = ok and bool((comm.reduce_scatter(x[:count - count % n]) == n).all())
    return ok, taken


@pytest.mark.parametrize("plain_rank", [0, 2])
def test_one_rank_without_a_registered_buffer_makes_every_rank_fall_back(plain_rank):
    for rank, (ok, taken) in enumerate(run_ranks(_one_rank_unregistered, 3, plain_rank, env=SHM)):
        assert ok, rank
        assert taken == [False] * 4, (rank, taken)


def _size_mismatch(comm):
    import pycoll
    out = []
    try:
        comm.empty(1000 + comm.rank, np.float32)
    except ValueError as e:
        out.append("registered-buffer allocation" in str(e) and "does not match" in str(e))
    x = comm.empty(200_000, np.float32)
    view = x[:100_000 + 4 * (comm.rank == 1)]
    view[:] = 1
    try:
        comm.allreduce(view, timeout=20)
        out.append("no error")
    except pycoll.ProtocolError as e:
        out.append("same sizes and dtypes" in str(e))
    counts = [1000 * (k + 1) for k in range(comm.size)][::1 if comm.rank else -1]  # rank 0 splits it otherwise
    got = np.full(counts[comm.rank], 7, np.float32)
    try:
        comm.reduce_scatter(x[:sum(counts)], got, counts=counts, timeout=20)
        out.append("no error")
    except pycoll.ProtocolError as e:
        out.append("board post carries" in str(e) and bool((got == 7).all()))
    x[:] = 1
    comm.allreduce(x)  # still works
    out.append(bool((x == comm.size).all()))
    return out


def test_mismatched_sizes_and_counts_raise_on_every_rank_and_the_communicator_goes_on():
    for rank, out in enumerate(run_ranks(_size_mismatch, 3, env=SHM)):
        assert out == [True, True, True, True], (rank, out)


def _torch_tensors(comm):
    import torch
    taken = []
    _record_paths(taken)
    n = comm.size
    t = torch.from_numpy(comm.empty((256, 1024), np.float32))
    t.fill_(comm.rank + 1.0)
    comm.allreduce(t)
    ok = bool((t == n * (n + 1) / 2).all())
    g = comm.allgather(torch.from_numpy(comm.empty(50_000, np.float64)).fill_(comm.rank))
    ok = ok and [float(v) for v in g[:, 0]] == list(map(float, range(n)))
    return ok, taken


def test_torch_tensors_made_from_registered_buffers_take_the_registered_path():
    pytest.importorskip("torch")
    for rank, (ok, taken) in enumerate(run_ranks(_torch_tensors, 3, env=SHM)):
        assert ok and taken == [True, True], (rank, taken)


def _lifetime(comm):
    """free() unregisters (calls fall back, the array stays usable, a second free raises); arrays
    outlive close(); the peers' calls on freed buffers are the usual algorithms."""
    taken = []
    _record_paths(taken)
    x = comm.zeros(100_000, np.float32)
    x += 1
    comm.allreduce(x)
    comm.free(x)
    comm.allreduce(x)
    try:
        comm.free(x)
        again = "no error"
    except ValueError as e:
        again = "free() takes a registered buffer" in str(e)
    y = comm.empty(100_000, np.float32)
    comm.close()
    y[:] = 7  # the memory is this process's until the array goes
    return float(x[0]), again, float(y.sum()), taken


def test_free_unregisters_and_buffers_outlive_close():
    for rank, (first, again, total, taken) in enumerate(run_ranks(_lifetime, 2, env=SHM)):
        assert (first, again, total, taken) == (4.0, True, 700_000.0, [True, False]), rank


def _killed(comm, victim):
    import pycoll
    x = comm.empty(4 << 20, np.float32)
    y = comm.empty(1 << 20, np.float32)
    x[:] = 1
    comm.allreduce(x)
    seen = sorted(os.listdir("/dev/shm"))
    if comm.rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        for _ in range(10_000):
            comm.allreduce(x)
            comm.allgather(y[:y.size // comm.size])
    except pycoll.PeerError as e:
        return e.peer, str(e), time.monotonic() - t0, dict(comm.transport.segments), seen
    return None, "no error", 0.0, {}, seen


def test_a_rank_killed_during_registered_calls_is_named_and_nothing_is_left_in_dev_shm():
    results = run_ranks(_killed, 4, 2, expect_fail=True, timeout=90, env={**SHM, "PYCOLL_TIMEOUT": "30"})
    names = set()
    for rank, (ok, value) in enumerate(results):
        if rank == 2:
            assert not ok and "code -9" in value
            continue
        assert ok, value
        peer, msg, took, segments, seen = value
        assert peer == 2 and took < 5.0 and "rank 2 died" in msg, value
        names.update(segments.values())
        assert not [f for f in seen if "window" in f], seen  # registered memory has no name at all
    assert names, "the survivors reported no segment names"
    left = sorted(set(os.listdir("/dev/shm")) & names)
    assert not left, f"left in /dev/shm after the job: {left}"


def test_a_rank_that_never_calls_is_named_in_the_timeout():
    for rank, got in enumerate(run_ranks(_absent, 3, True, env=SHM)):
        if rank == 2:
            continue
        peers, msg, took = got
        assert peers == [2] and "board post from rank 2" in msg and took < 10, got


def _over_tcp(comm):
    x = comm.empty((3, 1000), np.float32)
    x[:] = 1
    comm.allreduce(x)
    return comm.windows is None, x.ctypes.data % 4096, x.shape, float(x[0, 0])


def test_without_shared_memory_empty_is_an_ordinary_page_aligned_array():
    for got in run_ranks(_over_tcp, 2, env={"PYCOLL_TRANSPORT": "tcp"}):
        assert got == (True, 0, (3, 1000), 2.0)

"""Pairwise alltoall(v) posts its steps in batches of at most BATCH_BYTES of sends and waits once per
batch: small calls wait once, large blocks one step at a time, and any mix of batch sizes across
ranks (each rank batches by its own send counts) delivers every block where it belongs."""
import numpy as np
import pytest

from multiproc import run_ranks


def _counts(src, dst, scale, floor):
    """Elements rank `src` sends rank `dst`: uneven, some zero unless `floor`."""
    return ((3 * src + 5 * dst + 1) % 7 + floor) * scale


def _block(src, dst, scale, floor):
    return np.full(_counts(src, dst, scale, floor), 1000 * src + dst, np.int32)


def _batches(comm, batch_bytes, scale, floor=0):
    """alltoallv through pairwise with BATCH_BYTES set; (its output is right, waits per call)."""
    from pycoll.algorithms import pairwise
    from pycoll.channel import Channel
    n, r = comm.size, comm.rank
    waits = []
    real_wait = Channel.wait

    def counted(self, *reqs):
        waits.append(len(reqs))
        return real_wait(self, *reqs)
    Channel.wait = counted
    saved, pairwise.BATCH_BYTES = pairwise.BATCH_BYTES, batch_bytes
    try:
        sc = [_counts(r, j, scale, floor) for j in range(n)]
        rc = [_counts(i, r, scale, floor) for i in range(n)]
        send = np.concatenate([_block(r, j, scale, floor) for j in range(n)])
        out = comm.alltoallv(send, sc, rc, algo="pairwise")
    finally:
        Channel.wait, pairwise.BATCH_BYTES = real_wait, saved
    want = np.concatenate([_block(i, r, scale, floor) for i in range(n)])
    return bool(np.array_equal(out, want)), len(waits)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 4, 5])
def test_small_calls_wait_once_large_blocks_per_step_mixed_batches_deliver(n):
    # the default batch holds a small call whole: one wait
    for ok, waits in run_ranks(_batches, n, 1 << 20, 4):
        assert ok and waits == 1, (ok, waits)
    # blocks larger than a batch: one step per wait
    for ok, waits in run_ranks(_batches, n, 4, 4, 1):
        assert ok and waits == n - 1, (ok, waits)
    # batches of a few blocks, different on every rank (uneven counts)
    got = run_ranks(_batches, n, 4 * 4 * 6, 4)
    assert all(ok for ok, _ in got), got
    if n == 5:
        assert len({waits for _, waits in got}) > 1, got  # the ranks really batched differently

"""Ring allreduce: reduce-scatter then allgather around the ring, 2(n-1) steps, 2(n-1)/n * S bytes.

Each chunk is reduced by the ranks in one fixed order, then the final chunk is copied around,
so every rank ends with bit-identical results.
"""
from __future__ import annotations

import numpy as np

from ..channel import Channel
from ..ops import ReduceOp, reduce_into


def chunk_bounds(count: int, parts: int) -> list:
    """Split `count` elements into `parts` nearly equal [start, end) ranges (the first ones larger)."""
    base, extra = divmod(count, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def allreduce(ch: Channel, buf: np.ndarray, op: ReduceOp) -> None:
    """In-place ring allreduce of the flat array `buf`."""
    n, r = ch.size, ch.rank
    if n == 1:
        return
    bounds = chunk_bounds(buf.size, n)
    right, left = (r + 1) % n, (r - 1) % n
    tmp = np.empty(bounds[0][1] - bounds[0][0], dtype=buf.dtype)
    for step in range(n - 1):  # reduce-scatter: after it, rank r owns the full sum of chunk r+1
        s0, s1 = bounds[(r - step) % n]
        d0, d1 = bounds[(r - step - 1) % n]
        incoming = tmp[: d1 - d0]
        ch.sendrecv(buf[s0:s1], right, incoming, left, tag=step)
        reduce_into(op, buf[d0:d1], incoming)
    for step in range(n - 1):  # allgather of the reduced chunks
        s0, s1 = bounds[(r + 1 - step) % n]
        d0, d1 = bounds[(r - step) % n]
        ch.sendrecv(buf[s0:s1], right, buf[d0:d1], left, tag=n + step)

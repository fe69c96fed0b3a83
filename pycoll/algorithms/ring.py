"""Ring collectives: reduce-scatter and allgather pass blocks to the right neighbour, n-1 steps and
(n-1)/n * S bytes sent per rank each; allreduce is both, 2(n-1) steps and 2(n-1)/n * S bytes.

Every step is cut into segments of at most segment_bytes() (PYCOLL_RING_SEGMENT), at least two per block (Gloo's
numSegments = roundUp(max(ceil(S / segment), 2n), n), with Gloo's 1 MiB raised to 4 MiB since each
message costs ~100 us of CPU here, which dominates once ranks share cores), and pipelined: the next
segment is on the wire while numpy reduces the current one. Each block is reduced by the ranks in one fixed order
and then copied around, so every rank ends with bit-identical results.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from .. import config
from ..channel import Channel
from ..ops import ReduceOp

# one pipelined iteration: (send this, receive into `out`, other, scratch): with `other`, out ends as
# op(incoming, other), reduced straight from the wire buffer where the transport allows, else via scratch
Transfer = Tuple[np.ndarray, np.ndarray, Optional[np.ndarray], Optional[np.ndarray]]


def chunk_bounds(count: int, parts: int) -> list:
    """Split `count` elements into `parts` nearly equal [start, end) ranges (the first ones larger)."""
    base, extra = divmod(count, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def displacements(counts: Sequence[int]) -> List[int]:
    """Block edges of consecutive blocks of `counts` elements: [0, c0, c0+c1, ..., sum(counts)]."""
    edges = [0]
    for c in counts:
        edges.append(edges[-1] + int(c))
    return edges


def chunk_edges(count: int, parts: int) -> List[int]:
    """The `parts + 1` edges of chunk_bounds(count, parts)."""
    return [0] + [end for _, end in chunk_bounds(count, parts)]


def segment_bytes() -> int:
    """PYCOLL_RING_SEGMENT, read per call: the largest ring (and halving-doubling) message."""
    return config.get("PYCOLL_RING_SEGMENT")


def segments_per_block(block_bytes: int) -> int:
    """Segments per ring block: at most segment_bytes() each, at least two (so the pipeline has depth)."""
    return max(2, -(-block_bytes // segment_bytes()))


class Segments:
    """The blocks between `edges` (one per rank), each cut into `spr` nearly equal segments."""

    def __init__(self, edges: Sequence[int], itemsize: int) -> None:
        self.n = len(edges) - 1
        self.edges = list(edges)
        counts = [b - a for a, b in zip(edges, edges[1:])]
        self.spr = segments_per_block(max(counts) * itemsize)
        self.rel = [chunk_bounds(c, self.spr) for c in counts]  # relative to each block's start
        self.width = max((b - a for block in self.rel for a, b in block), default=0)

    def at(self, block: int, k: int) -> slice:
        """Segment k of block `block` (mod n), as a slice of the whole buffer."""
        block %= self.n
        a, b = self.rel[block][k]
        return slice(self.edges[block] + a, self.edges[block] + b)

    def within(self, block: int, k: int) -> slice:
        """Segment k of block `block` (mod n), as a slice of that block alone."""
        a, b = self.rel[block % self.n][k]
        return slice(a, b)

    def length(self, block: int, k: int) -> int:
        """Elements in segment k of block `block` (mod n)."""
        a, b = self.rel[block % self.n][k]
        return b - a


def _pipeline(ch: Channel, iterations: int, transfer: Callable[[int], Transfer],
              op: Optional[ReduceOp]) -> None:
    """Run ring iterations 0..iterations-1: iteration j sends to the right and receives from the left
    on tag j, reducing on arrival. Iteration j+1 is posted before iteration j is waited on, so two
    are in flight; callers forward a segment only spr >= 2 iterations after receiving it.
    Empty segments are skipped (both ends compute the same sizes)."""
    right, left = (ch.rank + 1) % ch.size, (ch.rank - 1) % ch.size

    def post(j: int) -> tuple:
        send, out, other, scratch = transfer(j)
        if not out.size:
            rreq = None
        elif other is None:
            rreq = ch.irecv(out, left, j)
        else:
            rreq = ch.irecv_reduce(out, other, left, j, op, scratch)
        return rreq, ch.isend(send, right, j) if send.size else None

    nxt = post(0) if iterations else None
    for j in range(iterations):
        rreq, sreq = nxt
        nxt = post(j + 1) if j + 1 < iterations else None
        if rreq is not None:
            ch.wait(rreq)
        if sreq is not None:
            ch.wait(sreq)


def _forward(seg: Segments, buf: np.ndarray, first: int, j: int) -> Transfer:
    """Allgather iteration j: pass on segment k of block first-s, receive block first-s-1 in place."""
    s, k = divmod(j, seg.spr)
    return buf[seg.at(first - s, k)], buf[seg.at(first - s - 1, k)], None, None


def allreduce(ch: Channel, buf: np.ndarray, op: ReduceOp, src: Optional[np.ndarray] = None) -> None:
    """Pipelined ring allreduce into the flat array `buf`, of `src` (out of place, no extra copy) or of
    `buf` itself. Every element of `buf` is written: n-1 blocks by the reduce-scatter, the rest by the
    allgather."""
    n, r = ch.size, ch.rank
    src = buf if src is None else src
    if n == 1 or buf.size == 0:
        if src is not buf:
            np.copyto(buf, src)
        return
    seg = Segments(chunk_edges(buf.size, n), buf.itemsize)
    half = (n - 1) * seg.spr
    with ch.scratch((2, seg.width), buf.dtype) as tmp:  # double buffer, for transports that cannot reduce on arrival

        def transfer(j: int) -> Transfer:
            if j >= half:  # allgather of the reduced blocks
                return _forward(seg, buf, r + 1, j - half)
            s, k = divmod(j, seg.spr)  # reduce-scatter: afterwards rank r owns the reduced block r+1
            mine = seg.at(r - s - 1, k)
            return ((src if s == 0 else buf)[seg.at(r - s, k)], buf[mine], src[mine],
                    tmp[j % 2, :mine.stop - mine.start])

        _pipeline(ch, 2 * half, transfer, op)


allreduce.accepts_src = True  # type: ignore[attr-defined]  # the Communicator skips its copy


def reduce_scatter(ch: Channel, send: np.ndarray, recv: np.ndarray, op: ReduceOp,
                   counts: Optional[Sequence[int]] = None) -> None:
    """Ring reduce-scatter(v): rank r gets block r (counts[r] elements) of the reduction of `send`."""
    n, r = ch.size, ch.rank
    edges = displacements([recv.size] * n if counts is None else counts)
    if n == 1:
        np.copyto(recv, send[:edges[1]])
        return
    seg = Segments(edges, send.itemsize)
    # partial sums in flight, double-buffered by step; one slot per segment index, so a receive never
    # overlaps a send still in flight when blocks (and so their segments) differ in size
    with ch.scratch((min(n - 2, 2), seg.spr, seg.width), send.dtype) as partial:

        def transfer(j: int) -> Transfer:
            s, k = divmod(j, seg.spr)  # step s: pass block r-s-1 on, receive block r-s-2 (r at the end)
            own = send[seg.at(r - s - 2, k)]
            incoming = recv[seg.within(r, k)] if s == n - 2 else partial[s % 2, k, :own.size]
            out = send[seg.at(r - 1, k)] if s == 0 else partial[(s - 1) % 2, k, :seg.length(r - s - 1, k)]
            return out, incoming, own, incoming

        _pipeline(ch, (n - 1) * seg.spr, transfer, op)


def allgather(ch: Channel, send: np.ndarray, recv: np.ndarray,
              counts: Optional[Sequence[int]] = None) -> None:
    """Ring allgather(v): block i of `recv` (counts[i] elements, default send.size) comes from rank i."""
    n, r = ch.size, ch.rank
    edges = displacements([send.size] * n if counts is None else counts)
    np.copyto(recv[edges[r]:edges[r + 1]], send)
    if n == 1:
        return
    seg = Segments(edges, recv.itemsize)
    _pipeline(ch, (n - 1) * seg.spr, lambda j: _forward(seg, recv, r, j), None)

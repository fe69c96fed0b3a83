"""Rabenseifner: recursive-halving reduce-scatter then recursive-doubling allgather, 2 lg p' steps and
2(p'-1)/p' * S bytes per rank (reduce-scatter alone: lg p' steps, (p'-1)/p' * S); for a
non-power-of-two n, MPI's fold adds one step each way, of S bytes, between the first 2(n-p') ranks.

Each block's final value is computed once, by the rank that owns it, then copied: bit-identical.
Allreduce exchanges move in segments of at most ring.segment_bytes(), all posted at once, and the
halving steps reduce each segment on arrival (no huge messages, no extra copy).
"""
from __future__ import annotations

from typing import Iterator, Optional, Sequence, Tuple

import numpy as np

from ..channel import Channel
from ..ops import ReduceOp, reduce_into
from . import recursive_doubling
from .recursive_doubling import FIRST_STEP_TAG, Fold, doubling_steps, exchange, fold_in, fold_out
from . import ring
from .ring import chunk_bounds, chunk_edges, displacements


def _segments(count: int, itemsize: int) -> list:
    """[start, end) pieces of at most ring.segment_bytes(); both ends of an exchange compute the same."""
    return chunk_bounds(count, max(1, -(-count * itemsize // ring.segment_bytes())))


def _segmented_exchange(ch: Channel, tag: int, peer: int, send: np.ndarray, recv: np.ndarray,
                        op: Optional[ReduceOp], scratch: Optional[np.ndarray] = None,
                        other: Optional[np.ndarray] = None) -> None:
    """Swap `send` for `recv` with `peer`, segment by segment on tags (tag << 20) + i; with `op`,
    recv ends as op(incoming, other) (other: recv itself by default), reduced as each segment lands."""
    other = recv if other is None else other
    reqs = []
    for i, (a, b) in enumerate(_segments(recv.size, recv.itemsize)):
        if op is None:
            reqs.append(ch.irecv(recv[a:b], peer, (tag << 20) + i))
        else:
            reqs.append(ch.irecv_reduce(recv[a:b], other[a:b], peer, (tag << 20) + i, op, scratch[a:b]))
    reqs += [ch.isend(send[a:b], peer, (tag << 20) + i)
             for i, (a, b) in enumerate(_segments(send.size, send.itemsize))]
    ch.wait(*reqs)


def halving_steps(me: int, p2: int, edges: Sequence[int]) -> Iterator[Tuple[int, slice, slice]]:
    """Recursive-halving schedule over p2 blocks between `edges`: per step the partner, the slice
    `me` keeps (the half of its current range that holds block `me`) and the slice it gives away."""
    lo, hi, mask = 0, p2, p2 // 2
    while mask:
        mid = lo + mask
        keep, give = ((mid, hi), (lo, mid)) if me & mask else ((lo, mid), (mid, hi))
        yield me ^ mask, slice(edges[keep[0]], edges[keep[1]]), slice(edges[give[0]], edges[give[1]])
        (lo, hi), mask = keep, mask // 2


def allreduce(ch: Channel, buf: np.ndarray, op: ReduceOp, src: Optional[np.ndarray] = None) -> None:
    """Rabenseifner allreduce of `src` into `buf` (in place without `src`); recursive doubling when
    there are fewer elements than p'. Out of place with a power of two ranks, the first halving step
    reads `src` and every element of `buf` is written once: no copy of the input first."""
    fold = Fold.of(ch.size)
    if src is not None and (fold.rem or buf.size < fold.p2 or ch.size == 1):
        np.copyto(buf, src)  # the fold and recursive doubling work in place
        src = None
    if ch.size == 1 or buf.size == 0:
        return
    if buf.size < fold.p2:
        recursive_doubling.allreduce(ch, buf, op)
        return
    me, _ = fold_in(ch, fold, buf, op)
    if me is not None:
        edges = chunk_edges(buf.size, fold.p2)
        steps = list(halving_steps(me, fold.p2, edges))
        data = buf if src is None else src  # what the first step sends and reduces with
        with ch.scratch(edges[fold.p2 // 2], buf.dtype) as incoming:  # the first half is the largest kept part
            for tag, (peer, keep, give) in enumerate(steps, FIRST_STEP_TAG):
                _segmented_exchange(ch, tag, fold.real(peer), data[give], buf[keep], op,
                                    incoming[:keep.stop - keep.start], data[keep])
                data = buf
        for tag, (peer, mine, theirs) in enumerate(doubling_steps(me, fold.p2, edges),
                                                   FIRST_STEP_TAG + len(steps)):
            _segmented_exchange(ch, tag, fold.real(peer), buf[mine], buf[theirs], None)
    fold_out(ch, fold, buf, buf)


allreduce.accepts_src = True  # type: ignore[attr-defined]  # the Communicator skips its copy


def reduce_scatter(ch: Channel, send: np.ndarray, recv: np.ndarray, op: ReduceOp,
                   counts: Optional[Sequence[int]] = None) -> None:
    """Recursive-halving reduce-scatter(v): rank r gets block r (counts[r] elements); `send` is kept.

    Any n: with the fold, survivor i owns the blocks of the ranks it stands for (its own and the
    absorbed rank's, adjacent so still one range) and hands the absorbed rank its block at the end.
    """
    n, r = ch.size, ch.rank
    counts = [recv.size] * n if counts is None else list(counts)
    full = displacements(counts)
    if n == 1:
        np.copyto(recv, send[:full[1]])
        return
    if full[n] == 0:
        return
    fold = Fold.of(n)
    me = fold.newrank(r)
    if me is None:  # hands its data to rank r+1, gets its block back at the end
        fold_in(ch, fold, send, op)
        fold_out(ch, fold, recv, recv)
        return
    absorbs = me < fold.rem  # this survivor took in rank r-1's data and reduces blocks r-1 and r
    edges = [full[fold.first(i)] for i in range(fold.p2 + 1)]
    steps = list(halving_steps(me, fold.p2, edges))
    widest = steps[0][1].stop - steps[0][1].start  # kept ranges only shrink
    with ch.scratch(send.size if absorbs else 0, send.dtype) as folded, \
            ch.scratch(edges[me + 1] - edges[me] if absorbs else 0, send.dtype) as both, \
            ch.scratch((min(len(steps) - 1, 2), widest), send.dtype) as partial:
        _, data = fold_in(ch, fold, send, op, folded if absorbs else None)
        out = both if absorbs else recv
        cur, base = data, 0  # cur[i - base] holds the partial reduction of element i
        for i, (peer, keep, give) in enumerate(steps):
            peer = fold.real(peer)
            acc = out if i == len(steps) - 1 else partial[i % 2, :keep.stop - keep.start]
            exchange(ch, FIRST_STEP_TAG + i, peer, [cur[give.start - base:give.stop - base]],
                     peer, [acc])
            reduce_into(op, acc, cur[keep.start - base:keep.stop - base])
            cur, base = acc, keep.start
        result = recv
        if absorbs:
            result = out[:counts[r - 1]]
            np.copyto(recv, out[counts[r - 1]:])
        fold_out(ch, fold, result, recv)

"""Recursive doubling: allreduce in lg p' steps of full-buffer exchanges (S * lg p' bytes per rank,
+2 steps of S for the non-power-of-two fold); allgather in ceil(lg n) steps, (n-1)/n * S bytes in.

Also home of what halving_doubling shares: MPI's non-power-of-two fold and the doubling schedule.
"""
from __future__ import annotations

from typing import Iterator, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from ..channel import Channel
from ..ops import ReduceOp, reduce_into
from .ring import displacements

FOLD_TAG, UNFOLD_TAG, FIRST_STEP_TAG = 0, 1, 2


def exchange(ch: Channel, tag: int, dst: int = -1, send: Sequence[np.ndarray] = (),
             src: int = -1, recv: Sequence[np.ndarray] = ()) -> None:
    """Send pieces to `dst` while receiving pieces from `src`, piece i on tag 2*tag+i.

    Empty pieces are skipped; the peer computes the same sizes and skips them too.
    """
    reqs = [ch.irecv(a, src, 2 * tag + i) for i, a in enumerate(recv) if a.size]
    reqs += [ch.isend(a, dst, 2 * tag + i) for i, a in enumerate(send) if a.size]
    ch.wait(*reqs)


class Fold(NamedTuple):
    """MPI's fold of n ranks onto p2 = 2**floor(lg n) survivors: among the first 2*rem ranks
    (rem = n - p2) the even ones hand their data to rank+1 and sit out; survivors are renumbered."""

    p2: int
    rem: int

    @classmethod
    def of(cls, n: int) -> "Fold":
        p2 = 1 << (n.bit_length() - 1)
        return cls(p2, n - p2)

    def newrank(self, rank: int) -> Optional[int]:
        """The survivor number of `rank`, None if it sits out."""
        if rank >= 2 * self.rem:
            return rank - self.rem
        return rank // 2 if rank % 2 else None

    def real(self, newrank: int) -> int:
        """The channel rank of survivor `newrank`."""
        return 2 * newrank + 1 if newrank < self.rem else newrank + self.rem

    def first(self, newrank: int) -> int:
        """The lowest channel rank survivor `newrank` stands for (itself, or the even rank it absorbed)."""
        return 2 * newrank if newrank < self.rem else newrank + self.rem


def fold_in(ch: Channel, fold: Fold, data: np.ndarray, op: ReduceOp,
            into: Optional[np.ndarray] = None) -> Tuple[Optional[int], np.ndarray]:
    """Fold the extra ranks in; returns (survivor number or None, array holding the folded data).

    The absorbing rank computes op(data, incoming) into `data`, or with `into` (an array like
    `data`) op(incoming, data) into `into`, leaving `data` untouched.
    """
    r = ch.rank
    newrank = fold.newrank(r)
    if r >= 2 * fold.rem:
        return newrank, data
    if newrank is None:
        exchange(ch, FOLD_TAG, r + 1, [data])
        return None, data
    if into is not None:
        exchange(ch, FOLD_TAG, src=r - 1, recv=[into])
        reduce_into(op, into, data)
        return newrank, into
    with ch.scratch(data.shape, data.dtype) as incoming:
        exchange(ch, FOLD_TAG, src=r - 1, recv=[incoming])
        reduce_into(op, data, incoming)
    return newrank, data


def fold_out(ch: Channel, fold: Fold, result: np.ndarray, into: np.ndarray) -> None:
    """Undo the fold: absorbing ranks send `result` to the rank they absorbed, which receives `into`."""
    r = ch.rank
    if r < 2 * fold.rem:
        if r % 2:
            exchange(ch, UNFOLD_TAG, r - 1, [result])
        else:
            exchange(ch, UNFOLD_TAG, src=r + 1, recv=[into])


def doubling_steps(me: int, p2: int, edges: Sequence[int]) -> Iterator[Tuple[int, slice, slice]]:
    """Recursive-doubling allgather schedule over p2 blocks between `edges`: per step the partner,
    the slice `me` already holds (its aligned group of 1, 2, 4, ... blocks) and the partner's slice."""
    mask = 1
    while mask < p2:
        mine, theirs = me & ~(mask - 1), (me ^ mask) & ~(mask - 1)
        yield (me ^ mask, slice(edges[mine], edges[mine + mask]),
               slice(edges[theirs], edges[theirs + mask]))
        mask <<= 1


def allreduce(ch: Channel, buf: np.ndarray, op: ReduceOp) -> None:
    """In-place recursive-doubling allreduce (symmetric combine: a op b == b op a bit for bit)."""
    if ch.size == 1 or buf.size == 0:
        return
    fold = Fold.of(ch.size)
    me, _ = fold_in(ch, fold, buf, op)
    if me is not None:
        with ch.scratch(buf.shape, buf.dtype) as incoming:
            mask, step = 1, FIRST_STEP_TAG
            while mask < fold.p2:
                peer = fold.real(me ^ mask)
                exchange(ch, step, peer, [buf], peer, [incoming])
                reduce_into(op, buf, incoming)
                mask, step = mask << 1, step + 1
    fold_out(ch, fold, buf, buf)


def _wrapped(edges: Sequence[int], first: int, count: int) -> List[slice]:
    """Blocks first..first+count-1 (mod n) as slices of the buffer: one, or two when they wrap."""
    n = len(edges) - 1
    first %= n
    if first + count <= n:
        return [slice(edges[first], edges[first + count])]
    return [slice(edges[first], edges[n]), slice(edges[0], edges[first + count - n])]


def allgather(ch: Channel, send: np.ndarray, recv: np.ndarray,
              counts: Optional[Sequence[int]] = None) -> None:
    """Allgather(v) into `recv` (block i from rank i): recursive doubling when n is a power of two,
    else Bruck, which handles v-counts directly: blocks go straight into their place in `recv`,
    a window that wraps past rank n-1 is sent as two pieces, so there is no padding or rotation."""
    n, r = ch.size, ch.rank
    edges = displacements([send.size] * n if counts is None else counts)
    np.copyto(recv[edges[r]:edges[r + 1]], send)
    if n & (n - 1) == 0:
        for step, (peer, mine, theirs) in enumerate(doubling_steps(r, n, edges), FIRST_STEP_TAG):
            exchange(ch, step, peer, [recv[mine]], peer, [recv[theirs]])
        return
    dist, step = 1, FIRST_STEP_TAG
    while dist < n:  # rank r holds blocks r..r+dist-1; send a prefix left, get the next ones from the right
        count = min(dist, n - dist)
        exchange(ch, step, (r - dist) % n, [recv[s] for s in _wrapped(edges, r, count)],
                 (r + dist) % n, [recv[s] for s in _wrapped(edges, r + dist, count)])
        dist, step = dist * 2, step + 1

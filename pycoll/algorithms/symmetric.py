"""Collectives on registered buffers (Communicator.empty; pycoll/windows.py): every rank reads its
peers' buffers where they are, so nothing is copied into a stage (NCCL's symmetric-memory kernels,
torch's SymmetricMemory one-/two-shot). Each call starts with one board post of where every rank's
buffers lie (Channel.symmetric); if any rank's are not registered, every rank runs `fallback`, the
algorithm the communicator would have run anyway. It ends with a synchronisation after the last
read of a peer's buffer, so when a call returns no peer reads the caller's buffer any more.

allreduce: reduce-scatter and allgather in one pass. Rank r alone reads and writes share r of every
rank's buffer: block by block it reduces the share (its own input first, then the others' in rank
order) into its own buffer and, while that block is in cache, writes it into every peer's buffer.
No other rank touches share r anywhere, so no synchronisation is needed between the two halves:
per rank the whole input is read once (S) and S written, with two posts per call, where two-shot
copies everything in and out again and posts once per 2 MiB block. Each share is reduced once, so every
rank ends with the same bits.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import numpy as np

from ..channel import Channel
from ..ops import ReduceOp, ufunc
from .board_signature import (SYM_ALLGATHER, SYM_ALLREDUCE, SYM_BROADCAST, SYM_REDUCE_SCATTER, SYM_SYNC,
                              board_signature)
from .ring import chunk_bounds

BLOCK_BYTES = 256 << 10  # a block's running result stays in L2 while inputs are added and it is pushed out
_NOTHING = np.empty(0, np.uint8)


def _sync(ch: Channel) -> None:
    """Every rank has got here (an empty board post)."""
    ch.board_exchange(_NOTHING, board_signature(SYM_SYNC))


def _reduce_share(fn: Callable, ins: List[np.ndarray], out: np.ndarray, lo: int, hi: int, me: int,
                  push: Sequence[np.ndarray] = ()) -> None:
    """out[lo:hi] = ins[me] op the others in rank order, block by block (`out` may be ins[me]), each
    block then copied into the same place of every array of `push` while it is still in cache."""
    others = [p for p in range(len(ins)) if p != me]
    step = max(1, BLOCK_BYTES // max(1, out.itemsize))
    for a in range(lo, hi, step):
        b = min(hi, a + step)
        acc = out[a:b]
        if others:
            fn(ins[me][a:b], ins[others[0]][a:b], out=acc)
            for p in others[1:]:
                fn(acc, ins[p][a:b], out=acc)
        else:  # one rank (in place this copies the block onto itself)
            np.copyto(acc, ins[me][a:b])
        for dst in push:
            dst[a:b] = acc


def allreduce(ch: Channel, buf: np.ndarray, op: ReduceOp, src: Optional[np.ndarray] = None, *,
              fallback: Callable) -> None:
    """buf = op over every rank's `src` (or `buf` in place), read in place where every rank's
    buffers are registered (in place: `buf`; out of place: `src` and `buf`), else `fallback`."""
    views = ch.symmetric([buf] if src is None else [src, buf], board_signature(SYM_ALLREDUCE, op))
    if views is None:
        if src is None:
            fallback(ch, buf, op)
        elif getattr(fallback, "accepts_src", False):
            fallback(ch, buf, op, src=src)
        else:
            np.copyto(buf, src)
            fallback(ch, buf, op)
        return
    ins, outs, me = views[0], views[-1], ch.rank
    lo, hi = chunk_bounds(buf.size, ch.size)[me]
    _reduce_share(ufunc(op, buf.dtype), ins, outs[me], lo, hi, me, [o for p, o in enumerate(outs) if p != me])
    _sync(ch)  # every share is in every rank's buffer, and nobody reads this rank's buffers any more


allreduce.accepts_src = True  # type: ignore[attr-defined]


def reduce_scatter(ch: Channel, src: np.ndarray, dst: np.ndarray, op: ReduceOp, counts: Sequence[int], *,
                   fallback: Callable) -> None:
    """dst = this rank's block (of `counts`) of op over every rank's `src`, read in place where every
    rank's `src` is registered, else `fallback`."""
    views = ch.symmetric([src], board_signature(SYM_REDUCE_SCATTER, op, counts=counts))
    if views is None:
        fallback(ch, src, dst, op, counts)
        return
    me = ch.rank
    lo = int(sum(counts[:me]))
    ins = [v[lo:lo + counts[me]] for v in views[0]]
    _reduce_share(ufunc(op, src.dtype), ins, dst, 0, counts[me], me)
    _sync(ch)


def allgather(ch: Channel, send: np.ndarray, recv: np.ndarray, counts: Optional[Sequence[int]] = None, *,
              fallback: Callable) -> None:
    """recv = every rank's `send` in rank order, copied from where it is if every rank's `send` is
    registered (equal blocks only: allgatherv runs `fallback`)."""
    views = ch.symmetric([send], board_signature(SYM_ALLGATHER)) if counts is None else None
    if views is None:
        fallback(ch, send, recv, counts)
        return
    n = send.size
    for k, block in enumerate(views[0]):  # (in place, this rank's block is copied onto itself)
        recv[k * n:(k + 1) * n] = block
    _sync(ch)


def broadcast(ch: Channel, buf: np.ndarray, root: int, *, fallback: Callable) -> None:
    """Every rank copies `root`'s buffer from where it is, if every rank's `buf` is registered."""
    views = ch.symmetric([buf], board_signature(SYM_BROADCAST, root=root))
    if views is None:
        fallback(ch, buf, root)
        return
    if ch.rank != root:
        np.copyto(buf, views[0][root])
    _sync(ch)

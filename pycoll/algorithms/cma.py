"""Allreduce by cross-memory attach: every rank reads its peers' ordinary arrays where they lie, as
symmetric.py does for registered buffers, but through the kernel (process_vm_readv/writev, Open
MPI's single-copy path) instead of a shared mapping. Rank r alone reads and writes share r of every
rank's buffer: block by block it copies each peer's share into a scratch block that stays in cache,
reduces it into its own buffer (its own input first, then the others in rank order), and writes the
reduced block into every peer's buffer. No other rank touches share r anywhere, so the two halves need
no synchronisation between them: one board post says where every rank's buffers are (and that it
entered the call), one after the last write says nobody touches anyone's buffers any more.

Per rank that is (n-1)/n of the data read from peers and as much written to them, one kernel copy
each, with the scratch block in cache: where two-shot copies (2n-1)/n of it through the stage in
shared memory and reads the peers' slots again. Measured on 2 cores against two-shot in one job:
1.26x its speed at 16 MiB and 1.46x at 64 MiB on 4 ranks, 1.15x and 1.24x on 2; below about 4 MiB the
kernel's work per page costs more than the copies save (docs/algorithms.md has the table). If any
rank cannot reach its peers' memory this way (PYCOLL_CMA=0, the kernel refuses), every rank runs
two-shot instead, decided from the first post. Each share is reduced once (its owner's input first,
then the others in rank order, as two-shot does with its own shares), so every rank ends with the
same bits.
"""
from __future__ import annotations

import threading
from typing import Optional

import numpy as np

from ..channel import Channel
from ..ops import ReduceOp, ufunc
from . import twoshot
from .board_signature import CMA_DONE, CMA_WHERE, board_signature
from .ring import chunk_bounds

BLOCK_BYTES = 1 << 20  # a scratch block and the block it is reduced into stay in L2; fewer system calls than 256 KiB
_COUNT_BITS = 36  # the posts also carry the call's element count (mod 2**36) in their signature
_NOTHING = np.empty(0, np.uint8)
_scratch = threading.local()  # each thread's scratch block (a worker thread may run another call)


def _block(nbytes: int) -> np.ndarray:
    """This thread's scratch block of at least `nbytes` bytes."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.nbytes < nbytes:
        buf = _scratch.buf = np.empty(max(nbytes, BLOCK_BYTES), np.uint8)
    return buf


def allreduce(ch: Channel, buf: np.ndarray, op: ReduceOp, src: Optional[np.ndarray] = None) -> None:
    """buf = op over every rank's `src` (or `buf` in place), each share read from and written to the
    peers' own arrays; two-shot where any rank cannot reach the others' memory."""
    flat = buf.reshape(-1)
    source = flat if src is None else src.reshape(-1)
    count = (flat.size & ((1 << _COUNT_BITS) - 1)) << 8
    where = np.array([ch.reaches_peer_memory(), source.ctypes.data, flat.ctypes.data], np.int64)
    posts = ch.board_exchange(where, board_signature(CMA_WHERE, op) | count)
    if posts is None or not all(p[0] for p in posts):
        twoshot.allreduce(ch, buf, op, src)
        return
    fn, me, isz = ufunc(op, flat.dtype), ch.rank, flat.itemsize
    sources, dests = [int(p[1]) for p in posts], [int(p[2]) for p in posts]
    others = [p for p in range(ch.size) if p != me]
    lo, hi = chunk_bounds(flat.size, ch.size)[me]
    step = max(1, BLOCK_BYTES // isz)
    scratch = _block(step * isz).view(flat.dtype)
    for a in range(lo, hi, step):
        b = min(hi, a + step)
        acc, theirs = flat[a:b], scratch[:b - a]
        mine = source[a:b]
        for p in others:
            ch.peer_read(p, sources[p] + a * isz, theirs)
            fn(mine, theirs, out=acc)
            mine = acc
        if mine is not acc:  # one rank, out of place
            acc[...] = mine
        for p in others:
            ch.peer_write(p, dests[p] + a * isz, acc)
    ch.board_exchange(_NOTHING, board_signature(CMA_DONE, op) | count)  # all written; nobody reads any more


allreduce.accepts_src = True  # type: ignore[attr-defined]

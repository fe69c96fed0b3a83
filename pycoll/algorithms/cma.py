"""Collectives by cross-memory attach: every rank reads its peers' ordinary arrays where they lie, as
symmetric.py does for registered buffers, but through the kernel (process_vm_readv/writev, Open
MPI's single-copy path) instead of a shared mapping. Allreduce: rank r alone reads and writes share r
of every rank's buffer: block by block it copies each peer's share into a scratch block that stays in
cache, reduces it into its own buffer (its own input first, then the others in rank order), and
writes the reduced block into every peer's buffer. No other rank touches share r anywhere, so the two halves need
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

The same mechanism serves three more collectives, each with the same two posts: reduce_scatter (rank r
reduces block r of every peer's input through the scratch block into its output), allgather (every rank
copies each peer's block straight into its output) and broadcast (every rank copies the root's buffer).
allgatherv (counts given) runs recursive doubling: ranks that disagree on the counts would read past a
peer's buffer.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, List, Optional, Sequence

import numpy as np

from ..channel import Channel
from ..errors import ProtocolError
from ..ops import ReduceOp, dtype_code, ufunc
from . import halving_doubling, recursive_doubling, tree, twoshot
from .board_signature import CMA_DONE, CMA_WHERE, board_signature, counts_digest
from .ring import chunk_bounds, displacements

BLOCK_BYTES = 1 << 20  # a scratch block and the block it is reduced into stay in L2; fewer system calls than 256 KiB
_ALLREDUCE, _REDUCE_SCATTER, _ALLGATHER, _BROADCAST = range(4)  # in the posts' signatures, beside the count
_NOTHING = np.empty(0, np.uint8)
_HELD: List[np.ndarray] = []  # the arrays of calls that failed once their addresses were posted (_exposed)


def _signature(kind: int, collective: int, count: int, op: Optional[ReduceOp] = None, root: int = -1) -> int:
    """A post's signature: kind, op and root (bits 0-19), the collective (20-21) and the call's element
    count mod 2**25 (22-46), so that ranks in different calls raise ProtocolError at the first post."""
    return board_signature(kind, op, root) | collective << 20 | (count & ((1 << 25) - 1)) << 22


@contextmanager
def _exposed(*arrays: np.ndarray) -> Iterator[None]:
    """While `arrays`' addresses are posted: if the call fails (a timeout, a dead peer), keep them alive
    for good. A late peer may still read and write them after this rank has given up on the call, and
    that must land in these arrays (whose contents are then undefined), never in memory the process
    has freed and handed to other objects."""
    try:
        yield
    except BaseException:
        _HELD.extend(arrays)
        raise


def _where(ch: Channel, sig: int, *arrays: np.ndarray) -> Optional[List[List[int]]]:
    """Post whether this rank reaches every peer's memory, its arrays' dtype and where `arrays` are;
    every rank's addresses, or None (on every rank alike) if any rank cannot reach its peers or there
    is no board. The board checks the signature (collective, op, root, count) but sees only this row's
    dtype, so the arrays' dtype is compared here: every rank raises ProtocolError before any copy
    (a peer with a wider dtype would read and write past the end of this rank's array)."""
    code = dtype_code(arrays[0].dtype)
    row = np.array([ch.reaches_peer_memory(), code] + [a.ctypes.data for a in arrays], np.int64)
    posts = ch.board_exchange(row, sig)
    if posts is None:
        return None
    for p, post in enumerate(posts):
        if post[1] != code:
            raise ProtocolError(f"{ch.what}: rank {ch.rank}: rank {p} passed dtype code {int(post[1])}, this rank "
                                f"{code} ({arrays[0].dtype}); did the ranks call with different dtypes?", ch.group[p])
    if not all(p[0] for p in posts):
        return None
    return [[int(v) for v in p[2:]] for p in posts]


def _done(ch: Channel, sig: int) -> None:
    """Every rank has finished touching its peers' buffers (an empty post): now each may return."""
    ch.board_exchange(_NOTHING, sig)


def _reduce_block(ch: Channel, fn: Callable, mine: np.ndarray, acc: np.ndarray, addresses: Sequence[int], offset: int,
                  scratch: np.ndarray) -> None:
    """acc = mine op each peer's elements at byte `offset` of its array (at `addresses`), in rank
    order, each read into `scratch` first (acc may be mine)."""
    for p, address in enumerate(addresses):
        if p != ch.rank:
            ch.peer_read(p, address + offset, scratch)
            fn(mine, scratch, out=acc)
            mine = acc
    if mine is not acc:  # one rank, out of place
        acc[...] = mine


def allreduce(ch: Channel, buf: np.ndarray, op: ReduceOp, src: Optional[np.ndarray] = None) -> None:
    """buf = op over every rank's `src` (or `buf` in place), each share read from and written to the
    peers' own arrays; two-shot where any rank cannot reach the others' memory."""
    flat = buf.reshape(-1)
    source = flat if src is None else src.reshape(-1)
    with _exposed(source, flat):
        where = _where(ch, _signature(CMA_WHERE, _ALLREDUCE, flat.size, op), source, flat)
        if where is not None:
            _allreduce(ch, flat, source, op, where)
    if where is None:
        twoshot.allreduce(ch, buf, op, src)


def _allreduce(ch: Channel, flat: np.ndarray, source: np.ndarray, op: ReduceOp, where: List[List[int]]) -> None:
    """Allreduce's copies, once every rank's (source, output) addresses are known."""
    fn, me, isz = ufunc(op, flat.dtype), ch.rank, flat.itemsize
    sources, dests = [w[0] for w in where], [w[1] for w in where]
    lo, hi = chunk_bounds(flat.size, ch.size)[me]
    step = max(1, BLOCK_BYTES // isz)
    with ch.scratch(min(step, hi - lo), flat.dtype) as scratch:
        for a in range(lo, hi, step):
            b = min(hi, a + step)
            acc = flat[a:b]
            _reduce_block(ch, fn, source[a:b], acc, sources, a * isz, scratch[:b - a])
            for p in range(ch.size):
                if p != me:
                    ch.peer_write(p, dests[p] + a * isz, acc)
    _done(ch, _signature(CMA_DONE, _ALLREDUCE, flat.size, op))


allreduce.accepts_src = True  # type: ignore[attr-defined]


def reduce_scatter(ch: Channel, send: np.ndarray, recv: np.ndarray, op: ReduceOp,
                   counts: Optional[Sequence[int]] = None) -> None:
    """recv = block `rank` (counts[rank] elements) of op over every rank's `send`, read from the peers'
    own arrays through the scratch block; halving-doubling where any rank cannot reach the others."""
    counts = [recv.size] * ch.size if counts is None else list(counts)
    shape = counts_digest(counts)  # in place of the count: ranks that split the total differently raise
    with _exposed(send):
        where = _where(ch, _signature(CMA_WHERE, _REDUCE_SCATTER, shape, op), send)
        if where is not None:
            fn, me, isz = ufunc(op, send.dtype), ch.rank, send.itemsize
            sources = [w[0] for w in where]
            lo = displacements(counts)[me]
            step = max(1, BLOCK_BYTES // isz)
            with ch.scratch(min(step, counts[me]), send.dtype) as scratch:
                for a in range(0, counts[me], step):
                    b = min(counts[me], a + step)
                    _reduce_block(ch, fn, send[lo + a:lo + b], recv[a:b], sources, (lo + a) * isz,
                                  scratch[:b - a])
            _done(ch, _signature(CMA_DONE, _REDUCE_SCATTER, shape, op))
    if where is None:
        halving_doubling.reduce_scatter(ch, send, recv, op, counts)


def allgather(ch: Channel, send: np.ndarray, recv: np.ndarray, counts: Optional[Sequence[int]] = None) -> None:
    """recv = every rank's `send` in rank order, each copied straight out of its owner's array;
    recursive doubling for allgatherv (counts given) or where any rank cannot reach the others."""
    where = None
    if counts is None:
        with _exposed(send):
            where = _where(ch, _signature(CMA_WHERE, _ALLGATHER, send.size), send)
            if where is not None:
                n = send.size
                for p in range(ch.size):
                    block = recv[p * n:(p + 1) * n]
                    if p == ch.rank:
                        np.copyto(block, send)
                    elif n:
                        ch.peer_read(p, where[p][0], block)
                _done(ch, _signature(CMA_DONE, _ALLGATHER, n))
    if where is None:
        recursive_doubling.allgather(ch, send, recv, counts)


def broadcast(ch: Channel, buf: np.ndarray, root: int) -> None:
    """Every rank copies `root`'s buffer straight out of its array; a binomial tree where any rank
    cannot reach the others."""
    flat = buf.reshape(-1)
    with _exposed(flat):
        where = _where(ch, _signature(CMA_WHERE, _BROADCAST, flat.size, root=root), flat)
        if where is not None:
            if ch.rank != root and flat.size:
                ch.peer_read(root, where[root][0], flat)
            _done(ch, _signature(CMA_DONE, _BROADCAST, flat.size, root=root))
    if where is None:
        tree.broadcast(ch, buf, root)

"""Scratch memory kept across calls: the receive, staging and partial-sum buffers an algorithm (or a
transport) needs for the length of one call come from a pool per transport instead of being made
fresh each time, as NCCL and Gloo keep theirs.

Why: a buffer of a few MiB made and freed per call is, with glibc's default allocator, served
from the heap once any large block has been freed (glibc raises its mmap threshold to the largest
freed block, up to 32 MiB), and what the heap frees it mostly keeps: 4 ranks doing 6,000 mixed
allreduces (8 B..4 MiB) grew by 12-44 MiB per rank between calls 1,000 and 6,000. Fresh pages also
cost page faults on every call that gets its buffer from mmap.

How: take(nbytes) lends a buffer of the power-of-two size class at or above `nbytes` (a free one
of that class, else a new one), give() takes it back. Free buffers are kept up to `cap` bytes
(PYCOLL_SCRATCH_POOL), least recently returned dropped first, so a job whose sizes change lets go
of the old ones; a buffer larger than the cap is never kept. Each buffer is an anonymous mmap of
its own: what the pool drops goes back to the kernel at once and never fragments the heap the
program's own arrays come from. Requests under MIN_POOLED bytes get a plain np.empty (glibc's bins
serve those well, and the lock would cost more than the allocation).

A lent buffer is its borrower's alone until given back: two calls in flight (async work, another
communicator's worker) never share one. A call that fails does not give back what it took (a late
message may still land in it); the buffer is freed once nothing refers to it. Nothing the pool
lends may be handed to the user: results are always arrays of their own.
"""
from __future__ import annotations

import collections
import mmap
import math
import threading
from typing import Any, Dict, Optional, Sequence, Union

import numpy as np

MIN_POOLED = 64 << 10  # bytes; smaller requests are plain np.empty
Shape = Union[int, Sequence[int]]


class ScratchPool:
    """Buffers lent for one call and kept for the next, up to `cap` bytes of free ones (0: none kept)."""

    def __init__(self, cap: float) -> None:
        self.cap = cap
        self._lock = threading.Lock()
        self._free: Dict[int, list] = {}  # size class (bytes, a power of two) -> free buffers, last returned last
        self._returned: "collections.OrderedDict[int, np.ndarray]" = collections.OrderedDict()  # id -> buffer, LRU first
        self.held = 0      # bytes of the free buffers kept
        self.lent = 0      # bytes lent and not given back (nor dropped)
        self.hits = 0      # takes served by a kept buffer
        self.misses = 0    # takes that mapped a new one
        self.evicted = 0   # free buffers dropped to stay within the cap

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer of at least `nbytes` bytes (a power of two, MIN_POOLED or more), the caller's
        until give() (or drop())."""
        size = max(MIN_POOLED, 1 << (int(nbytes) - 1).bit_length())
        with self._lock:
            free = self._free.get(size)
            buf = free.pop() if free else None
            if buf is not None:
                del self._returned[id(buf)]
                self.held -= size
                self.hits += 1
            else:
                self.misses += 1
            self.lent += size
        if buf is None:
            buf = np.frombuffer(mmap.mmap(-1, size), np.uint8)
        return buf

    def give(self, buf: np.ndarray) -> None:
        """Take back a buffer from take(); kept for the next taker if the cap allows."""
        size = buf.nbytes
        with self._lock:
            self.lent -= size
            if size > self.cap:
                return
            while self.held + size > self.cap:  # the least recently returned go first
                _, old = self._returned.popitem(last=False)
                kept = self._free[old.nbytes]
                del kept[next(i for i, b in enumerate(kept) if b is old)]  # (== on arrays compares elements)
                self.held -= old.nbytes
                self.evicted += 1
            self._free.setdefault(size, []).append(buf)
            self._returned[id(buf)] = buf
            self.held += size

    def drop(self, buf: np.ndarray) -> None:
        """Forget a buffer from take() without keeping it (its borrower failed; memory a late message
        may still write stays valid while anything refers to it)."""
        with self._lock:
            self.lent -= buf.nbytes

    def clear(self) -> None:
        """Drop every free buffer (the transport closes)."""
        with self._lock:
            self._free.clear()
            self._returned.clear()
            self.held = 0

    def stats(self) -> Dict[str, int]:
        """What the pool holds now (held: free bytes kept, lent: bytes out) and how it was used."""
        with self._lock:
            return {"held": self.held, "buffers": len(self._returned), "lent": self.lent, "hits": self.hits,
                    "misses": self.misses, "evicted": self.evicted}


class Lent:
    """`with pool_or_none ... as arr`: an array lent for the block (see borrow)."""

    __slots__ = ("_pool", "_raw", "array")

    def __init__(self, pool: Optional[ScratchPool], shape: Shape, dtype: Any) -> None:
        dt = np.dtype(dtype)
        count = shape if isinstance(shape, int) else math.prod(shape)  # (np.prod costs microseconds)
        nbytes = count * dt.itemsize
        if pool is None or nbytes < MIN_POOLED:
            self._pool, self._raw, self.array = None, None, np.empty(shape, dt)
        else:
            self._pool, self._raw = pool, pool.take(nbytes)
            self.array = self._raw[:nbytes].view(dt).reshape(shape)

    def __enter__(self) -> np.ndarray:
        return self.array

    def __exit__(self, kind: Any, error: Any, tb: Any) -> None:
        raw, self._raw, self.array = self._raw, None, None
        if raw is not None:
            if kind is None:
                self._pool.give(raw)
            else:
                self._pool.drop(raw)


def borrow(pool: Optional[ScratchPool], shape: Shape, dtype: Any) -> Lent:
    """An array of `shape` and `dtype` from `pool` (None: a fresh one) for the length of a `with`
    block: given back when the block ends, dropped if it raises."""
    return Lent(pool, shape, dtype)

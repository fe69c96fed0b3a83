"""Registered (symmetric) buffers: memory every rank of a single-host communicator maps, so that
collectives read their peers' inputs in place instead of copying them through a stage (NCCL's
window registration, torch's SymmetricMemory).

`Communicator.empty(shape, dtype)` is collective: every rank allocates the same number of bytes
(the transport's SharedMemory: a memfd, nameless, so nothing outlives the job, kill -9 included),
the ranks allgather their handles, map each other's, and agree that all of them did. The result is
an ordinary numpy array over this rank's memory (torch.from_numpy makes a tensor of it without a
copy); any contiguous slice of it is registered too.

Lifetime. Each rank's mapping of its own memory lives as long as anything references it (the
array, a tensor made from it, a view), as for any numpy array. The registry holds the peers'
mappings until `Communicator.free(buf)` (local: this rank stops taking the registered path for
that buffer; nothing is unmapped under a running call, since unmapping happens only when the last
reference, a running call's included, is dropped) or close(). A peer reads a rank's buffer only
inside a collective call that every rank entered with registered buffers, and that call ends with
a synchronisation after the last read, so after any call returns the buffer is the caller's alone.

Whether a call takes the registered path is decided collectively (algorithms/symmetric.py): each
rank posts where its buffers lie (window id, offset, size, dtype) on the board, and the registered
path runs only if every rank's are registered; otherwise every rank runs the usual algorithm. That
post happens only on communicators that have allocated a registered buffer (`used`, the same on
every rank since allocation is collective), so others pay nothing; on those, a call on ordinary
arrays above a board slot pays that one post before its usual algorithm (keep registered buffers on
a communicator of their own, e.g. comm.dup(), where that matters).
"""
from __future__ import annotations

import itertools
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .errors import PeerError
from .transports.capabilities import SharedMemory

_PAGE = 4096


class _Window:
    """One registered allocation: every member's memory (uint8, in communicator rank order)."""

    __slots__ = ("wid", "nbytes", "start", "maps")

    def __init__(self, wid: int, nbytes: int, maps: List[np.ndarray], me: int) -> None:
        self.wid, self.nbytes, self.maps = wid, nbytes, maps
        self.start = maps[me].ctypes.data


class Registry:
    """A communicator's registered buffers, numbered in allocation order (the same on every rank)."""

    def __init__(self, memory: SharedMemory, group: Sequence[int], rank: int, name: str) -> None:
        self._memory, self._group, self.rank, self._name = memory, list(group), rank, name
        self._windows: Dict[int, _Window] = {}
        self._ids = itertools.count(1)
        self.used = False  # a registered buffer was ever allocated here (collective, so every rank agrees)

    def allocate(self, nbytes: int, allgather: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """This rank's `nbytes` of registered memory (uint8): every rank calls it with the same size;
        `allgather` is the communicator's (int64 row -> one row per rank)."""
        wid = next(self._ids)
        length = max(_PAGE, -(-nbytes // _PAGE) * _PAGE)
        local, handle = self._memory.allocate(length)
        try:
            table = allgather(np.array([wid, nbytes], np.int64))
            if (table[:, 0] != wid).any() or (table[:, 1] != nbytes).any():
                raise ValueError(f"rank {self.rank}: registered-buffer allocation on {self._name} does not match "
                                 f"across ranks: (allocation, bytes) per rank {table.tolist()}; every rank must "
                                 "call empty()/zeros() in the same order with the same shape and dtype")
            handles = allgather(np.array([handle], np.int64))[:, 0]
            maps: List[Optional[np.ndarray]] = [None] * len(self._group)
            failure: Optional[BaseException] = None
            for m, owner in enumerate(self._group):
                if m == self.rank:
                    maps[m] = np.frombuffer(local, np.uint8)
                    continue
                try:
                    maps[m] = np.frombuffer(self._memory.attach(owner, int(handles[m]), length), np.uint8)
                except (OSError, PeerError) as e:
                    failure = e
                    break
            ok = allgather(np.array([failure is None], np.int64))[:, 0]
        finally:
            self._memory.seal(handle)
        if failure is not None:
            raise failure
        if not ok.all():
            bad = [m for m in range(len(ok)) if not ok[m]]
            raise PeerError(f"rank {self.rank}: ranks {bad} of {self._name} could not map the registered buffers "
                            "(their errors name the cause)", self._group[bad[0]])
        self._windows[wid] = _Window(wid, length, maps, self.rank)  # type: ignore[arg-type]
        self.used = True
        return maps[self.rank][:nbytes]  # type: ignore[index]

    def find(self, arr: np.ndarray) -> Optional[Tuple[int, int]]:
        """(window id, byte offset) of `arr` if it lies wholly in one of this rank's registered buffers."""
        if not self._windows:
            return None
        start = arr.ctypes.data
        for w in tuple(self._windows.values()):  # a snapshot: another thread may be allocating
            if w.start <= start and start + arr.nbytes <= w.start + w.nbytes:
                return w.wid, start - w.start
        return None

    def view(self, member: int, wid: int, offset: int, like: np.ndarray) -> np.ndarray:
        """Communicator rank `member`'s bytes of window `wid` from `offset`, typed and sized as `like`."""
        return self._windows[wid].maps[member][offset:offset + like.nbytes].view(like.dtype)

    def free(self, arr: np.ndarray) -> None:
        """Stop treating the registered buffer that `arr` lies in as registered (ValueError if it is none)."""
        got = self.find(arr)
        if got is None:
            raise ValueError(f"rank {self.rank}: free() takes a registered buffer of {self._name} (from its "
                             "empty()/zeros()), still registered; this one is not")
        del self._windows[got[0]]

    def close(self) -> None:
        """Drop every registration (the memory lives on while arrays reference it)."""
        self._windows.clear()

"""Cross-memory attach between same-host ranks (the shm transport's PeerMemory capability).

process_vm_readv/writev copy between this process and a peer's address space in one kernel copy,
with no shared mapping and no stage: how Open MPI's vader/smsc moves large messages. The kernel
allows it where this process may ptrace the peer: the same user, and under Yama's ptrace_scope 1
(Ubuntu's default) only if the peer declared any process its tracer, which every rank does here
(PR_SET_PTRACER_ANY, as Open MPI). seccomp may forbid the calls outright. So each peer is probed
once: a read of the token proof that the peer keeps at a known address in its own memory (its
segment header, whose address the header holds), compared with the same bytes seen through the
shared mapping.
"""
from __future__ import annotations

import ctypes
import errno
import os
import threading
from typing import Callable, Dict, Optional, Sequence, Tuple

import numpy as np

from .. import config
from ..errors import PeerError, ProtocolError
from .capabilities import PeerMemory

_PR_SET_PTRACER, _PR_SET_PTRACER_ANY = 0x59616D61, ctypes.c_ulong(-1).value


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _libc() -> Optional[ctypes.CDLL]:
    """libc with process_vm_readv/writev typed, or None where it has none (not Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fns = (libc.process_vm_readv, libc.process_vm_writev)
    except (OSError, AttributeError):
        return None
    for fn in fns:
        fn.restype = ctypes.c_ssize_t
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.POINTER(_Iovec),
                       ctypes.c_ulong, ctypes.c_ulong]
    return libc


_LIBC = _libc()


class ShmPeerMemory(PeerMemory):
    """PeerMemory by process_vm_readv/writev. `probe_of(rank)` gives a local peer's (pid, address
    in the peer, the bytes expected there), None when the peer is not on this host."""

    def __init__(self, rank: int, probe_of: Callable[[int], Optional[Tuple[int, int, bytes]]]) -> None:
        self.rank, self._probe_of = rank, probe_of
        self._ok: Dict[int, bool] = {self.rank: True}
        self._pids: Dict[int, int] = {}
        self._local = threading.local()  # each thread's two iovecs, filled per copy
        self.enabled = _LIBC is not None and config.get("PYCOLL_CMA")
        if self.enabled:  # let peers attach under Yama's ptrace_scope 1 (a no-op elsewhere)
            _LIBC.prctl(_PR_SET_PTRACER, ctypes.c_ulong(_PR_SET_PTRACER_ANY), 0, 0, 0)

    def reaches(self, members: Sequence[int]) -> bool:
        if not self.enabled:
            return False
        for m in members:
            ok = self._ok.get(m)
            if ok is None:
                ok = self._ok[m] = self._probe(m)
            if not ok:
                return False
        return True

    def _probe(self, peer: int) -> bool:
        """Whether a read of the peer's probe bytes through the kernel returns what the mapping shows."""
        where = self._probe_of(peer)
        if where is None:
            return False
        pid, address, expected = where
        got = np.zeros(len(expected), np.uint8)
        self._pids[peer] = pid
        try:
            self.read(peer, address, got)
        except (OSError, PeerError):
            return False
        return got.tobytes() == expected

    def read(self, peer: int, address: int, into: np.ndarray) -> None:
        self._copy(_LIBC.process_vm_readv, "read from", peer, address, into)

    def write(self, peer: int, address: int, data: np.ndarray) -> None:
        self._copy(_LIBC.process_vm_writev, "write to", peer, address, data)

    def _copy(self, fn: Callable, what: str, peer: int, address: int, local: np.ndarray) -> None:
        iovs = getattr(self._local, "iovs", None)
        if iovs is None:
            iovs = self._local.iovs = (_Iovec(), _Iovec())
        mine, theirs = iovs
        nbytes = local.nbytes
        mine.base, mine.len = local.ctypes.data, nbytes
        theirs.base, theirs.len = address, nbytes
        done = fn(self._pids[peer], ctypes.byref(mine), 1, ctypes.byref(theirs), 1, 0)
        if done == nbytes:
            return
        err = ctypes.get_errno() if done < 0 else 0
        if err == errno.ESRCH:
            raise PeerError(f"rank {self.rank}: rank {peer} (pid {self._pids[peer]}) is gone: cannot {what} "
                            "its memory", peer)
        raise ProtocolError(f"rank {self.rank}: cross-memory {what} rank {peer} failed at {address:#x}, "
                            f"{nbytes} bytes: " + (os.strerror(err) if err else f"{done} bytes copied"), peer)

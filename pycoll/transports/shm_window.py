"""Shared memory that same-host peers map (the shm transport's SharedMemory capability).

A rank's allocation is a memfd: anonymous shared memory with no name in /dev/shm, freed by the
kernel once the last process mapping it is gone, so no crash or kill -9 leaves anything behind (the
transport's own segments are named until every peer has mapped them). Its handle is the memfd's
descriptor number; a peer opens /proc/<owner pid>/fd/<handle> (the owner's pid comes from its
token-authenticated segment), maps it and closes the descriptor, and the owner closes its own once
every peer has (seal). That open needs the same uid and pid namespace as the owner, as the
transport's pidfds already do.
"""
from __future__ import annotations

import mmap
import os
from typing import Callable, Optional, Sequence, Tuple

from ..errors import PeerError
from .capabilities import SharedMemory

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


class ShmWindows(SharedMemory):
    """SharedMemory over memfds. `pid_of(rank)` is a local peer's pid (None: not on this host)."""

    def __init__(self, rank: int, pid_of: Callable[[int], Optional[int]]) -> None:
        self.rank, self._pid_of = rank, pid_of

    def reaches(self, members: Sequence[int]) -> bool:
        return all(self._pid_of(m) is not None for m in members)

    def allocate(self, nbytes: int) -> Tuple[mmap.mmap, int]:
        fd = os.memfd_create(f"pycoll-window-{self.rank}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            os.posix_fallocate(fd, 0, nbytes)
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | _POPULATE)
        except OSError as e:
            os.close(fd)
            raise OSError(f"rank {self.rank}: cannot allocate {nbytes} bytes of shared memory for a registered "
                          f"buffer ({e.strerror})") from None
        return mm, fd

    def attach(self, owner: int, handle: int, nbytes: int) -> mmap.mmap:
        pid = self._pid_of(owner)
        path = f"/proc/{pid}/fd/{handle}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            raise PeerError(f"rank {self.rank}: cannot open rank {owner}'s registered buffer at {path} "
                            f"({e.strerror}); registered buffers need every rank of the host under one user "
                            "and pid namespace", owner) from None
        try:
            size = os.fstat(fd).st_size
            if size != nbytes:
                raise PeerError(f"rank {self.rank}: rank {owner}'s registered buffer at {path} holds {size} "
                                f"bytes, expected {nbytes}", owner)
            return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | _POPULATE)
        finally:
            os.close(fd)

    def seal(self, handle: int) -> None:
        os.close(handle)

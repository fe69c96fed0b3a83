"""Liveness of same-host peers: a pidfd per peer process, readable once that process has exited.

A transport that cannot learn of a death from its wire (shm rings, MPI) watches its local peers'
pids this way. Without pidfds (Linux < 5.3, or a peer in another pid namespace) nothing is watched
and the transport falls back on its own checks.
"""
from __future__ import annotations

import os
import select
from typing import Dict, List, Optional

from ..errors import PeerError


class PidWatch:
    """pidfds of peer processes, registered in `poller` (the transport's own, so one poll() waits on
    its wake-ups and on deaths), or in a private one."""

    def __init__(self, rank: int, poller: Optional["select.poll"] = None) -> None:
        self.rank = rank
        self.fds: Dict[int, int] = {}  # pidfd -> peer rank
        self._poll = poller if poller is not None else select.poll()

    def watch(self, peer: int, pid: int, who: str) -> None:
        """Watch peer `peer`'s process `pid`; PeerError if it has already exited (`who`, e.g.
        'MPI rank 3', names it in the error)."""
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            raise PeerError(f"rank {self.rank}: {who} died while the transport connected", peer) from None
        except (AttributeError, OSError):  # no pidfds here: the transport's other checks remain
            return
        self.fds[fd] = peer
        self._poll.register(fd, select.POLLIN)

    def forget(self, fd: int) -> int:
        """Stop watching pidfd `fd` (its process exited); the peer it belonged to."""
        peer = self.fds.pop(fd)
        self._poll.unregister(fd)
        os.close(fd)
        return peer

    def wait_exit(self, peer: int, timeout: float) -> bool:
        """Whether peer `peer`'s process exits within `timeout` s (False if it is not watched): a
        killed process's files (its sockets) close before its exit shows on the pidfd."""
        fd = next((f for f, p in self.fds.items() if p == peer), None)
        return fd is not None and bool(select.select([fd], [], [], timeout)[0])

    def exited(self) -> List[int]:
        """The watched peers whose processes have exited since the last look (each reported once)."""
        ready = [fd for fd in self.fds if select.select([fd], [], [], 0)[0]]
        return sorted(self.forget(fd) for fd in ready)

    def close(self) -> None:
        for fd in list(self.fds):
            self.forget(fd)

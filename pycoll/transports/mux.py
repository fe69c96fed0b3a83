"""The default transport: shared memory to ranks on this host, tcp to the others, chosen per peer.

A single-host job is pure shm and never opens a socket; a rank alone on its host is pure tcp.
"""
from __future__ import annotations

import time
from typing import Any, ContextManager, Iterable, List, Optional, Sequence, Tuple

from ..bootstrap.store import Store
from .base import ANY, MsgKey, Request, Sink, Transport
from .capabilities import PeerMemory, SharedBoard, SharedMemory, SinkReceive, Striping
from .matching import Match, Matcher
from .shm import ShmTransport
from .tcp import TcpTransport

_SLICE = 1e-3  # seconds given to one sub-transport before the other gets a turn
_TCP_TURN = 5e-3  # while only shm is awaited, tcp still gets a non-blocking turn this often


class AutoTransport(Transport):
    """Routes each peer to shm (same host) or tcp (other hosts); waits on both when a call mixes them."""

    name = "auto"
    resilient = True

    def __init__(self, rank: int, size: int, address: Optional[str] = None,
                 hosts: Optional[List[str]] = None) -> None:
        super().__init__(rank, size)
        hosts = hosts or [""] * size
        remote = [r for r in range(size) if hosts[r] != hosts[rank]]
        self._tcp = TcpTransport(rank, size, address, hosts, peers=remote) if remote else None
        self._shm = ShmTransport(rank, size, address, hosts, local_only=True) \
            if len(remote) < size - 1 or self._tcp is None else None
        self._route = [self._shm if self._shm is not None and hosts[r] == hosts[rank] else self._tcp
                       for r in range(size)]
        self.name = "auto(" + "+".join(t.name for t in (self._shm, self._tcp) if t is not None) + ")"
        parts = [t for t in (self._shm, self._tcp) if t is not None]
        if all(t.offers(SinkReceive) for t in parts):
            self.capabilities[SinkReceive] = SinkReceive()
        if self._shm is not None:  # shm's boards and memory reach exactly the ranks routed to shm
            for kind in (SharedBoard, SharedMemory, PeerMemory):
                self.capabilities[kind] = self._shm.capabilities[kind]

    def connect(self, store: Store, token: bytes, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in (self._shm, self._tcp):
            if t is not None:
                t.connect(store, token, max(0.0, deadline - time.monotonic()))
        striping = self._tcp.offers(Striping) if self._tcp is not None else None
        if striping is not None:  # the tcp part's streams to other hosts (known once connected)
            self.capabilities[Striping] = striping

    def isend(self, view: memoryview, peer: int, key: MsgKey, dtype: int = 0) -> Request:
        """The peer's own transport makes, admits and starts the request."""
        return self._route[peer].isend(view, peer, key, dtype)

    def irecv(self, view: memoryview, peer: int, key: MsgKey, dtype: int = 0,
              sink: Optional[Sink] = None) -> Request:
        if peer == ANY:  # from any source: only where one transport reaches every peer
            if self._shm is not None and self._tcp is not None:
                raise ValueError(f"rank {self.rank}: PYCOLL_TRANSPORT=auto cannot receive from any source in a "
                                 "job spanning hosts (shm and tcp match messages apart); name the source, or "
                                 "use PYCOLL_TRANSPORT=tcp")
            return (self._shm or self._tcp).irecv(view, peer, key, dtype, sink)
        return self._route[peer].irecv(view, peer, key, dtype, sink)

    def wait_for(self, reqs: Sequence[Request], timeout: float) -> bool:
        """One owner: delegate. Otherwise alternate short blocking slices between tcp and shm. Each
        part also gets a non-blocking turn while only the other is awaited: shm so its peers' rings
        keep draining, tcp so bulk sends to other hosts keep flowing (a rank waiting on its host
        would otherwise stall a remote rank that the host waits on)."""
        shm, tcp = self._shm, self._tcp
        if shm is None or tcp is None:
            return (shm or tcp).wait_for(reqs, timeout)
        on_tcp = [r for r in reqs if self._route[r.peer] is tcp]
        on_shm = [r for r in reqs if self._route[r.peer] is shm]
        deadline = time.monotonic() + timeout
        while True:
            left = max(0.0, deadline - time.monotonic())
            if not on_tcp:
                tcp.progress()
            elif tcp.wait_for(on_tcp, min(_SLICE, left)):
                on_tcp = []
            if not on_shm:
                shm.progress()
            elif shm.wait_for(on_shm, min(_SLICE if on_tcp else _TCP_TURN, left)):
                on_shm = []
            if not on_tcp and not on_shm:
                return True
            if len(shm.matcher.revoked) != len(tcp.matcher.revoked):
                self._share_revocations()
            if time.monotonic() >= deadline:
                return False

    def _fault_domains(self) -> List[Tuple[ContextManager, Matcher]]:
        """Both parts' matchers: a revocation or an agreed death applies to every peer."""
        return [d for t in (self._shm, self._tcp) if t is not None for d in t._fault_domains()]

    def settle(self, dead: Iterable[int]) -> None:
        """Each part settles every agreed death (both matchers refuse them) and lets go of what it
        held for them (tcp: their connections)."""
        dead = list(dead)
        for t in (self._shm, self._tcp):
            if t is not None:
                t.settle(dead)

    def _share_revocations(self) -> None:
        """A notice reaches one part (the revoker's route to us): revoke in the other part too, so
        requests waiting there fail as well."""
        for src, dst, lock in ((self._shm, self._tcp, self._tcp._match), (self._tcp, self._shm, self._shm._lock)):
            for root, error in list(src.matcher.revoked.items()):
                if root not in dst.matcher.revoked:
                    with lock:
                        dst.matcher.revoke(root, error)

    def _release(self, arrivals: List[Tuple[Match, Any]]) -> None:
        if self._tcp is not None:  # (shm holds no credit)
            self._tcp._release([(m, a) for m, a in arrivals if self._route[m[0]] is self._tcp])

    def _shutdown(self) -> None:
        for t in (self._shm, self._tcp):
            if t is not None:
                t.close()

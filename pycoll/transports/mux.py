"""The default transport: shared memory to ranks on this host, and to ranks on other hosts verbs
(RDMA) where both ends have an active port on a network they share, tcp otherwise; chosen per peer.

A single-host job is pure shm and never opens a socket or looks for RDMA. In a job that spans hosts,
every rank advertises its RDMA port (or none) through the store at connect and every rank decides
every pair the same way (routes.py). Where no RDMA device exists (sysfs says so, in microseconds)
pyverbs is never imported and the job runs as shm + tcp.
"""
from __future__ import annotations

import logging
import time
from typing import Any, ContextManager, Dict, Iterable, List, Optional, Sequence, Tuple

from .. import config
from ..bootstrap.store import Store
from ..errors import EnvError, PycollError
from .base import ANY, MsgKey, Request, Sink, Transport
from .capabilities import PeerMemory, Routes, SharedBoard, SharedMemory, SinkReceive, Striping
from .matching import Match, Matcher
from .routes import TCP, VERBS, Advert, PairRoutes, none
from .shm import ShmTransport
from .tcp import TcpTransport
from .verbs_device import SYS_IB, rdma_present

log = logging.getLogger("pycoll.auto")
_SLICE = 1e-3  # seconds given to one sub-transport before another gets a turn
_NET_TURN = 5e-3  # while only shm is awaited, the network parts still get a non-blocking turn this often


class AutoTransport(Transport):
    """Routes each peer to shm (same host), verbs or tcp (other hosts); waits on all of them when a
    call mixes them."""

    name = "auto"
    resilient = True

    def __init__(self, rank: int, size: int, address: Optional[str] = None,
                 hosts: Optional[List[str]] = None) -> None:
        super().__init__(rank, size)
        self._hosts = list(hosts or [""] * size)
        self._address = address
        self._remote = [r for r in range(size) if self._hosts[r] != self._hosts[rank]]
        self._shm = ShmTransport(rank, size, address, self._hosts, local_only=True) \
            if len(self._remote) < size - 1 or not self._remote else None
        self._verbs: Any = None  # a VerbsTransport, where some peer is reached over verbs
        self._tcp: Optional[TcpTransport] = None
        self._route: List[Optional[Transport]] = [self._shm if r not in self._remote else None for r in range(size)]
        if self._shm is not None:  # shm's boards and memory reach exactly the ranks routed to shm
            for kind in (SharedBoard, SharedMemory, PeerMemory):
                self.capabilities[kind] = self._shm.capabilities[kind]
        if not self._remote:
            self.name = "auto(shm)"

    @property
    def _parts(self) -> List[Transport]:
        """The sub-transports in use: the network ones first, shm last (the order wait_for serves them)."""
        return [t for t in (self._verbs, self._tcp, self._shm) if t is not None]

    # -- connection set-up -------------------------------------------------------------------
    def connect(self, store: Store, token: bytes, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        if self._remote:
            routes = self._decide(store, deadline)
        else:
            routes = PairRoutes(self._hosts, [none("the job runs on one host")] * self.size)
        self.capabilities[Routes] = routes
        if self._shm is not None:
            self._shm.connect(store, token, max(0.0, deadline - time.monotonic()))
        if self._verbs is not None:
            try:
                self._verbs.connect(store, token, max(0.0, deadline - time.monotonic()))
            except PycollError as e:
                peers = [r for r in self._remote if self._route[r] is self._verbs]
                raise type(e)(f"rank {self.rank}: auto chose verbs to ranks {peers} (their RDMA ports share the "
                              f"network of {routes.port(self.rank)}), but could not connect: {e}; set "
                              "PYCOLL_IB_DISABLE=1 to route them over tcp") from e
        if self._tcp is not None:
            self._tcp.connect(store, token, max(0.0, deadline - time.monotonic()))
        parts = [t for t in (self._shm, self._verbs, self._tcp) if t is not None]
        self.name = "auto(" + "+".join(t.name for t in parts) + ")"
        if all(t.offers(SinkReceive) for t in parts):
            self.capabilities[SinkReceive] = SinkReceive()
        striping = self._tcp.offers(Striping) if self._tcp is not None else None
        if striping is not None:  # the tcp part's streams to other hosts (known once connected)
            self.capabilities[Striping] = striping
        if self._verbs is not None:
            self.resilient = False
            self.fragile_because = ("it reaches ranks on other hosts over verbs, and " + self._verbs.fragile_because
                                    + "; PYCOLL_IB_DISABLE=1 routes them over tcp")

    def _decide(self, store: Store, deadline: float) -> PairRoutes:
        """Advertise this rank's RDMA port, read every rank's, and make the parts that reach the peers
        on other hosts: verbs to those whose port shares this one's network, tcp to the others."""
        advert, verbs = self._offer_verbs()
        store.set(f"auto/{self.rank}", advert.to_json())
        adverts = [advert if r == self.rank else
                   Advert.from_json(store.get(f"auto/{r}", max(0.0, deadline - time.monotonic())))
                   for r in range(self.size)]
        routes = PairRoutes(self._hosts, adverts)
        over_verbs = [r for r in self._remote if routes.wire(self.rank, r) == VERBS]
        over_tcp = [r for r in self._remote if routes.wire(self.rank, r) == TCP]
        if over_verbs:
            verbs.limit_to(over_verbs)
            self._verbs = verbs
        elif verbs is not None:
            verbs.close()
        if over_tcp:
            self._tcp = TcpTransport(self.rank, self.size, self._address, self._hosts, peers=over_tcp)
        for part in (self._shm, self._verbs, self._tcp):  # one scratch pool for the process, under one cap
            if part is not None:
                part.scratch = self.scratch
        for r in over_verbs:
            self._route[r] = self._verbs
        for r in over_tcp:
            self._route[r] = self._tcp
        if self._shm is None:  # a rank alone on its host: its sends to itself take a network part
            self._route[self.rank] = self._verbs or self._tcp
        return routes

    def _offer_verbs(self) -> Tuple[Advert, Any]:
        """(this rank's advert, a VerbsTransport ready to connect or None). Verbs is offered only
        where an RDMA device exists, pyverbs imports, a port is active and its resources can be set
        up; anything short of that advertises no port, saying why (the first rank of each host warns
        when a device exists but cannot be used)."""
        if config.get("PYCOLL_IB_DISABLE"):
            return none("PYCOLL_IB_DISABLE=1"), None
        if not rdma_present():
            return none(f"no RDMA device: {SYS_IB} is empty"), None
        try:
            from .verbs import VerbsTransport
            verbs = VerbsTransport(self.rank, self.size, self._address, self._hosts, peers=self._remote)
        except EnvError as e:
            self._warn_unused(str(e))
            return none(str(e)), None
        advert = verbs.port.advert()
        if not advert.usable:
            verbs.close()
            self._warn_unused(f"its port {advert.describe()}")
            return advert, None
        return advert, verbs

    def _warn_unused(self, why: str) -> None:
        if self.rank == min(r for r in range(self.size) if self._hosts[r] == self._hosts[self.rank]):
            log.warning("rank %d: this host has an RDMA device, but auto cannot use it (%s); ranks on other "
                        "hosts are reached over tcp (PYCOLL_IB_DISABLE=1 says that is meant)", self.rank, why)

    # -- data path -----------------------------------------------------------------------------
    def isend(self, view: memoryview, peer: int, key: MsgKey, dtype: int = 0) -> Request:
        """The peer's own transport makes, admits and starts the request."""
        return self._part(peer).isend(view, peer, key, dtype)

    def irecv(self, view: memoryview, peer: int, key: MsgKey, dtype: int = 0,
              sink: Optional[Sink] = None) -> Request:
        if peer == ANY:  # from any source: only where one transport reaches every peer
            parts = self._parts
            if len(parts) > 1 or (self._shm is not None and self._remote):
                raise ValueError(f"rank {self.rank}: PYCOLL_TRANSPORT=auto cannot receive from any source in a "
                                 f"job spanning hosts ({' and '.join(t.name for t in parts)} match messages "
                                 "apart); name the source, or use PYCOLL_TRANSPORT=tcp")
            return parts[0].irecv(view, peer, key, dtype, sink)
        return self._part(peer).irecv(view, peer, key, dtype, sink)

    def _part(self, peer: int) -> Transport:
        part = self._route[peer]
        if part is None:
            raise RuntimeError(f"rank {self.rank}: the auto transport is not connected to rank {peer} yet")
        return part

    def wait_for(self, reqs: Sequence[Request], timeout: float) -> bool:
        """One owner: delegate. Otherwise alternate short blocking slices between the parts awaited.
        Each part also gets a non-blocking turn while only others are awaited: shm so its peers' rings
        keep draining, tcp and verbs so transfers to other hosts keep flowing (a rank waiting on its
        host would otherwise stall a remote rank that the host waits on)."""
        parts = self._parts
        if len(parts) == 1:
            return parts[0].wait_for(reqs, timeout)
        pending: Dict[Transport, List[Request]] = {t: [] for t in parts}
        for r in reqs:
            pending[self._route[r.peer]].append(r)  # type: ignore[index]
        deadline = time.monotonic() + timeout
        while True:
            for t in parts:
                if not pending[t]:
                    t.progress()  # type: ignore[attr-defined]
                    continue
                alone = not any(pending[o] for o in parts if o is not t)
                turn = _NET_TURN if alone and t is self._shm else _SLICE
                if t.wait_for(pending[t], min(turn, max(0.0, deadline - time.monotonic()))):
                    pending[t] = []
            if not any(pending.values()):
                return True
            if len({len(t.matcher.revoked) for t in self._resilient_parts()}) > 1:
                self._share_revocations()
            if time.monotonic() >= deadline:
                return False

    # -- fault tolerance -------------------------------------------------------------------------
    def _resilient_parts(self) -> List[Transport]:
        return [t for t in (self._shm, self._tcp) if t is not None]

    def _fault_domains(self) -> List[Tuple[ContextManager, Matcher]]:
        """Every part's matchers: a revocation or an agreed death applies to every peer."""
        return [d for t in self._parts for d in t._fault_domains()]

    def settle(self, dead: Iterable[int]) -> None:
        """Each part settles every agreed death (every matcher refuses them) and lets go of what it
        held for them (tcp: their connections)."""
        dead = list(dead)
        for t in self._parts:
            t.settle(dead)

    def _share_revocations(self) -> None:
        """A notice reaches one part (the revoker's route to us): revoke in the others too, so requests
        waiting there fail as well."""
        parts = self._resilient_parts()
        for src in parts:
            for root, error in list(src.matcher.revoked.items()):
                for dst in parts:
                    if dst is not src and root not in dst.matcher.revoked:
                        with dst._lock if dst is self._shm else dst._match:  # type: ignore[attr-defined]
                            dst.matcher.revoke(root, error)

    def _release(self, arrivals: List[Tuple[Match, Any]]) -> None:
        if self._tcp is not None:  # (shm and verbs hold no credit)
            self._tcp._release([(m, a) for m, a in arrivals if self._route[m[0]] is self._tcp])

    def _shutdown(self) -> None:
        for t in (self._shm, self._verbs, self._tcp):
            if t is not None:
                t.close()

"""The Transport interface: tagged, nonblocking point-to-point of contiguous buffers.

A transport knows ranks, bytes and keys; it knows nothing about collectives. Messages are
matched by (peer, comm_id, seq, tag) in FIFO order (matching.py, one engine for every transport),
so a peer running ahead is buffered, and a message whose size or dtype differs from the posted
receive is a ProtocolError. What a transport offers beyond that is declared in `capabilities`.
"""
from __future__ import annotations

import contextlib
import threading
import time
from abc import ABC, abstractmethod
from typing import Any, ContextManager, Dict, Iterable, List, Optional, Sequence, Set, Tuple, Type, TypeVar

from .. import config
from ..bootstrap.store import Store
from ..errors import PeerError, RevokedError, TimeoutError
from ..ids import notice_id
from ..scratch import ScratchPool
from .capabilities import Capability
from .matching import Match, Matcher
from .request import ANY, MsgKey, Request, Sink, as_bytes

C = TypeVar("C", bound=Capability)
_CLOSING = threading.Lock()  # makes close() run its work once, whichever thread calls it
__all__ = ["ANY", "C", "MsgKey", "Request", "Sink", "Transport", "deadline_after"]


class Transport(ABC):
    """Full-mesh point-to-point between the ranks of one job.

    isend/irecv make the Request and let the matcher turn away requests of a gone peer; a transport
    implements _start_send (an admitted send) and _start_recv (match with matcher.post under its
    lock, then start), and _shutdown for close()."""

    name = "base"
    resilient = False  # survives a dead peer (revoke, settle, restore: pycoll/ft.py); tcp, shm and auto do
    fragile_because = "it implements no revocation or agreement"  # why not, for ft.py's error
    _matchers: Optional[Tuple[Matcher, ...]] = None  # those of _fault_domains(), once asked for

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.capabilities: Dict[type, Capability] = {}  # what it offers beyond point-to-point, by kind
        self.matcher: Matcher = Matcher(rank)          # posted receives, unexpected arrivals, failed peers
        self.closed = False
        self.scratch = ScratchPool(config.get("PYCOLL_SCRATCH_POOL"))  # calls' temporaries, kept (scratch.py)

    def offers(self, kind: Type[C]) -> Optional[C]:
        """This transport's capability of class `kind` (capabilities.py), or None."""
        return self.capabilities.get(kind)  # type: ignore[return-value]

    @abstractmethod
    def connect(self, store: Store, token: bytes, timeout: float) -> None:
        """Publish this rank's address in the store, connect to every peer, authenticate with `token`."""

    def isend(self, view: memoryview, peer: int, key: MsgKey, dtype: int = 0) -> Request:
        """Start sending a contiguous byte view; the view must stay untouched until the request is done."""
        req = Request(peer, key, as_bytes(view), dtype, is_recv=False)
        if self.matcher.admit(req, "send to"):
            self._start_send(req)
        return req

    def irecv(self, view: memoryview, peer: int, key: MsgKey, dtype: int = 0,
              sink: Optional[Sink] = None) -> Request:
        """Post a receive of exactly `view.nbytes` bytes from `peer` into `view`.

        `peer` ANY receives from whichever rank sends a message with `key` first (matching.py); the
        request's `peer` is the sender once it matched. A transport that cannot raises ValueError here.

        With `sink` (only where the transport offers SinkReceive), the payload is passed to
        sink(piece, offset) instead, in the progressing thread, e.g. to reduce straight from the
        wire buffer while it is in cache.
        """
        req = Request(peer, key, as_bytes(view), dtype, is_recv=True, sink=sink)
        self._start_recv(req)
        return req

    def _start_send(self, req: Request) -> None:
        """Start an admitted send (its peer is not known to be gone)."""
        raise NotImplementedError(f"{self.name} sends through isend")

    def _start_recv(self, req: Request) -> None:
        """Match a new receive with what arrived (matcher.post, under the transport's lock) and start it."""
        raise NotImplementedError(f"{self.name} receives through irecv")

    @abstractmethod
    def wait_for(self, reqs: Sequence[Request], timeout: float) -> bool:
        """Make progress until every request is done (True) or `timeout` s pass (False); never spins."""

    def wait(self, reqs: Sequence[Request], timeout: float, what: object) -> None:
        """Block until every request is done; raise its error, or TimeoutError naming the peers."""
        if not self.wait_for(reqs, timeout):
            raise self._timeout_error(reqs, timeout, what)
        self._raise_errors(reqs, what)

    def close(self) -> None:
        """Flush pending sends (bounded) and release sockets and memory; later calls do nothing."""
        with _CLOSING:
            if self.closed:
                return
            self.closed = True
        self._shutdown()
        self.scratch.clear()

    @abstractmethod
    def _shutdown(self) -> None:
        """close()'s work, run once."""

    # -- fault tolerance (pycoll/ft.py): the matcher does the work, under the transport's lock -------
    def _fault_domains(self) -> List[Tuple[ContextManager, Matcher]]:
        """(lock, matcher) pairs whose matcher holds this transport's requests, each with the lock
        that guards it (AutoTransport: both parts'). Only a `resilient` transport is revoked,
        settled or restored (ft.py checks); for the others this answers that nothing was."""
        return [(contextlib.nullcontext(), self.matcher)]

    def revoke(self, root: int, peers: Iterable[int]) -> None:
        """Revoke communicator `root` here (its pending and later requests fail with RevokedError)
        and send a revocation notice to each of `peers` (transport ranks) that is not known gone."""
        error = RevokedError(f"rank {self.rank}: communicator {root:#x} was revoked here (comm.revoke()); "
                             "agree() and shrink() to go on", self.rank)
        for lock, matcher in self._fault_domains():
            with lock:
                matcher.revoke(root, error)
        key = MsgKey(notice_id(root), 0, 0)
        for peer in peers:
            if peer != self.rank:
                self.isend(memoryview(b""), peer, key)  # fails at once for a gone peer; nobody waits on it

    def revoked_error(self, root: int) -> Optional[RevokedError]:
        """The error of communicator `root`'s requests if it was revoked (here or by a notice), else None.
        (Every call asks: the matchers are looked up once.)"""
        matchers = self._matchers
        if matchers is None:
            matchers = self._matchers = tuple(m for _, m in self._fault_domains())
        for matcher in matchers:
            if matcher.revoked:
                error = matcher.revoked.get(root)
                if error is not None:
                    return error
        return None

    def dead_peers(self) -> Set[int]:
        """The peers known dead here (seen by this transport, or settled)."""
        return set().union(*(matcher.dead for _, matcher in self._fault_domains()))

    def settle(self, dead: Iterable[int]) -> None:
        """The survivors agreed that `dead` (transport ranks) died: refuse them for good; their
        deaths, seen here later, change nothing."""
        dead = list(dead)
        for lock, matcher in self._fault_domains():
            with lock:
                matcher.settle(dead)

    def restore(self, root: int) -> None:
        """Communicator `root` is sound again (Matcher.restore): not revoked, not stopped by a death."""
        for lock, matcher in self._fault_domains():
            with lock:
                matcher.restore(root)

    def restored(self, root: int) -> bool:
        """Whether communicator `root` was restored (every part agrees)."""
        return all(root in matcher.restored for _, matcher in self._fault_domains())

    def purge(self, root: int, below: int, control: bool = False) -> None:
        """Drop what is stashed or posted for communicator `root` below call `below` (Matcher.purge)."""
        for lock, matcher in self._fault_domains():
            with lock:
                arrivals = matcher.purge(root, below, control)
            self._release(arrivals)

    def _release(self, arrivals: List[Tuple[Match, Any]]) -> None:
        """Purged unexpected arrivals are gone: give back what they held (tcp: the sender's credit)."""

    def _timeout_error(self, reqs: Sequence[Request], timeout: float, what: object) -> TimeoutError:
        pending = [r for r in reqs if not r.done]
        return TimeoutError(
            f"rank {self.rank}: {what} timed out after {timeout:g} s over {self.name}; still waiting "
            f"on: {', '.join(r.describe() for r in pending)} (is that rank alive and in the same call?)",
            peers=[r.peer for r in pending if r.peer != ANY])

    @staticmethod
    def _raise_errors(reqs: Sequence[Request], what: object) -> None:
        for r in reqs:
            if isinstance(r.error, PeerError):  # say which call was hit, keep the error type
                error = type(r.error)(f"{what}: {r.error}", r.error.peer)
                error.ranks = r.error.ranks
                raise error from r.error
            if isinstance(r.error, RevokedError):
                raise RevokedError(f"{what}: {r.error}", r.error.by) from r.error
            if r.error is not None:
                raise r.error


def deadline_after(timeout: float) -> float:
    """Monotonic deadline `timeout` seconds from now."""
    return time.monotonic() + timeout

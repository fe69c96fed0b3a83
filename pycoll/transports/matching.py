"""Message matching shared by every transport: posted receives, unexpected arrivals, failed peers.

A receive and an arrival meet on (peer, comm_id, seq, tag), oldest first on both sides (MPI's
non-overtaking rule). An arrival nobody has asked for yet is kept as unexpected, in whatever form
the transport holds it (a zmq frame, a message still in a ring, an RTS); the transport claims it
when the receive is posted. Once a peer closed or died, its posted receives fail, and so does every
later request to or from it, except receives of what it sent before (those are still unexpected
here). A death breaks the whole job (`broken`): a collective waiting on any rank would otherwise
hang on the dead one, as NCCL aborts a communicator.

A receive from any source (peer ANY, MPI_ANY_SOURCE) is queued under (ANY, comm_id, seq, tag).
Posted, it takes the unexpected arrival with its key that came first, from whichever peer; an
arrival goes to whichever of its peer's oldest receive and the oldest any-source receive was posted
first (MPI's rule: the earliest posted receive that matches). Either way the receive's `peer` then
becomes the sender, before the transport sees it, so everything after matching (a bulk stream, a
ring, an RDMA rendezvous with that peer) runs as for a receive from that peer. Messages from one
peer with one key still match in the order sent (non-overtaking). A closed peer does not fail an
any-source receive (another may still send); a death fails it, as it fails everything.

The tables are plain dicts of deques and the caller holds its transport's lock around every call:
the hot path pays one dict lookup per message, as it did when each transport had its own copy
(plus a counter and a tuple per unexpected arrival, which an any-source receive orders by).
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Deque, Dict, Generic, Iterable, List, Optional, Sequence, Tuple, TypeVar

from ..errors import PeerError
from .request import ANY, MsgKey, Request

Match = Tuple[int, int, int, int]  # (peer, comm_id, seq, tag)
A = TypeVar("A")  # what a transport keeps of an unexpected arrival


def match_of(peer: int, key: MsgKey) -> Match:
    """The matching key of a message from (or to) `peer`."""
    return (peer, key.comm_id, key.seq, key.tag)


class Matcher(Generic[A]):
    """Posted receives and unexpected arrivals of one transport, and which peers have failed."""

    __slots__ = ("rank", "posted", "unexpected", "gone", "broken", "wild", "_posts", "_arrivals")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.posted: Dict[Match, Deque[Request]] = {}
        self.unexpected: Dict[Match, Deque[Tuple[int, A]]] = {}  # (arrival number, what the transport keeps)
        self.gone: Dict[int, str] = {}              # peer -> why requests to or from it fail
        self.broken: Optional[PeerError] = None     # a peer died: every request fails with this
        self.wild = 0                               # any-source receives posted, not yet matched
        self._posts = 0                             # receives numbered while any-source ones wait
        self._arrivals = 0

    # -- receives and arrivals ---------------------------------------------------------------
    def post(self, req: Request) -> Optional[A]:
        """The oldest unexpected arrival for receive `req` (the caller hands it over), else None:
        `req` is then queued, or failed at once if its peer is gone. A receive from ANY takes the
        arrival with its key that came first from any peer, and its `peer` becomes the sender."""
        if req.peer == ANY:
            return self._post_any(req)
        match = (req.peer, *req.key)
        queue = self.unexpected.get(match)
        if queue:
            arrival = queue.popleft()
            if not queue:
                del self.unexpected[match]
            return arrival[1]
        if self.admit(req, "receive from"):
            if self.wild:  # its place among the any-source receives decides which an arrival takes
                self._posts += 1
                req.order = self._posts
            self.posted.setdefault(match, deque()).append(req)  # type: ignore[arg-type]
        return None

    def _post_any(self, req: Request) -> Optional[A]:
        key = tuple(req.key)
        first: Optional[Match] = None
        for match, queue in self.unexpected.items():  # any-source receives are rare: a scan is fine
            if match[1:] == key and (first is None or queue[0][0] < self.unexpected[first][0][0]):
                first = match
        if first is not None:
            queue = self.unexpected[first]
            arrival = queue.popleft()
            if not queue:
                del self.unexpected[first]
            req.peer = first[0]
            return arrival[1]
        if self.broken is not None:
            fail(req, self.broken)
            return None
        self._posts += 1
        req.order = self._posts
        self.wild += 1
        self.posted.setdefault((ANY, *key), deque()).append(req)  # type: ignore[arg-type]
        return None

    def _any_first(self, match: Match) -> Optional[Deque[Request]]:
        """The any-source queue whose head an arrival with `match` goes to before its peer's own
        queue (posted earlier), else None."""
        wild = self.posted.get((ANY, match[1], match[2], match[3]))
        if not wild:
            return None
        own = self.posted.get(match)
        return wild if not own or wild[0].order < own[0].order else None

    def waiting(self, match: Match) -> Optional[Request]:
        """The oldest posted receive for `match`, left in place (None if there is none); it may be
        an any-source receive (its peer still ANY until `take`)."""
        if self.wild:
            wild = self._any_first(match)
            if wild:
                return wild[0]
        queue = self.posted.get(match)
        return queue[0] if queue else None

    def take(self, match: Match) -> Optional[Request]:
        """Remove and return the oldest posted receive for `match` (None if there is none); an
        any-source receive's `peer` becomes the sender, match[0]."""
        queue = self.posted.get(match)
        if self.wild:
            wild = self._any_first(match)
            if wild:
                req = wild.popleft()
                if not wild:
                    del self.posted[(ANY, match[1], match[2], match[3])]
                self.wild -= 1
                req.peer = match[0]
                return req
        if not queue:
            return None
        req = queue.popleft()
        if not queue:
            del self.posted[match]
        return req

    def stash(self, match: Match, arrival: A) -> None:
        """Keep an arrival nobody has asked for yet, behind any earlier one with the same key."""
        self._arrivals += 1
        self.unexpected.setdefault(match, deque()).append((self._arrivals, arrival))

    # -- failures ----------------------------------------------------------------------------
    def admit(self, req: Request, what: str) -> bool:
        """False (and `req` failed) if its peer is gone or the job is broken; `what` is 'send to' or
        'receive from', for the error."""
        if self.broken is None and req.peer not in self.gone:
            return True
        fail(req, self.broken or PeerError(
            f"rank {self.rank}: cannot {what} rank {req.peer}: {self.gone[req.peer]}", req.peer))
        return False

    def refuse(self, peer: int, why: str) -> None:
        """From now on every new request to or from `peer` fails (`why` says why); posted ones stay."""
        self.gone.setdefault(peer, why)

    def peer_gone(self, peer: int, why: str) -> List[Request]:
        """Peer `peer` closed (`why`, e.g. 'it closed its communicator'): fail its posted receives,
        and from now on every request to or from it; the failed receives are returned."""
        self.refuse(peer, why)
        failed = self._pop_posted(lambda p: p == peer)
        for req in failed:
            fail(req, PeerError(f"rank {self.rank}: cannot receive from rank {peer} (comm {req.key.comm_id:#x}, "
                                f"call {req.key.seq}, tag {req.key.tag}): {self.gone[peer]}", peer))
        return failed

    def break_job(self, error: PeerError) -> List[Request]:
        """A peer died: fail every posted receive, and from now on every request, with `error` (the
        first death is the one reported); the failed receives are returned."""
        if self.broken is None:
            self.broken = error
        failed = self._pop_posted(lambda p: True)
        for req in failed:
            fail(req, self.broken)
        return failed

    def fail_pending(self, reqs: Iterable[Request]) -> bool:
        """Fail the requests of `reqs` still pending whose peer is gone or whose job is broken (a
        waiter's check, for sends and for requests outside the table); True if any was failed."""
        failed = False
        for req in reqs:
            if not req.done and not self.admit(req, "receive from" if req.is_recv else "send to"):
                failed = True
        return failed

    def _pop_posted(self, hit: Callable[[int], bool]) -> List[Request]:
        """Remove and return the posted receives from the peers that `hit` (ANY for any-source ones)."""
        popped = [req for match in [m for m in self.posted if hit(m[0])] for req in self.posted.pop(match)]
        self.wild = sum(len(q) for m, q in self.posted.items() if m[0] == ANY)
        return popped


def fail(req: Request, error: Optional[BaseException]) -> None:
    """Complete `req`, keeping the first error it got (None completes it cleanly)."""
    if error is not None and req.error is None:
        req.error = error
    req.done = True


def fail_all(reqs: Sequence[Request], error: BaseException) -> None:
    """Complete every pending request of `reqs` with `error`."""
    for req in reqs:
        if not req.done:
            fail(req, error)

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
from typing import Callable, Deque, Dict, Generic, Iterable, List, Optional, Sequence, Set, Tuple, TypeVar

from ..errors import PeerError, PycollError, RevokedError
from ..ids import LOW, NOTICE, ROOT, is_notice
from .request import ANY, MsgKey, Request

Match = Tuple[int, int, int, int]  # (peer, comm_id, seq, tag)
A = TypeVar("A")  # what a transport keeps of an unexpected arrival


def match_of(peer: int, key: MsgKey) -> Match:
    """The matching key of a message from (or to) `peer`."""
    return (peer, key.comm_id, key.seq, key.tag)


class Matcher(Generic[A]):
    """Posted receives and unexpected arrivals of one transport, and which peers have failed."""

    __slots__ = ("rank", "posted", "unexpected", "gone", "broken", "wild", "_posts", "_arrivals", "dead", "settled",
                 "revoked", "restored", "faults")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.posted: Dict[Match, Deque[Request]] = {}
        self.unexpected: Dict[Match, Deque[Tuple[int, A]]] = {}  # (arrival number, what the transport keeps)
        self.gone: Dict[int, str] = {}              # peer -> why requests to or from it fail
        self.broken: Optional[PeerError] = None     # a peer died: every request fails with this
        self.wild = 0                               # any-source receives posted, not yet matched
        self._posts = 0                             # receives numbered while any-source ones wait
        self._arrivals = 0
        self.dead: Dict[int, PeerError] = {}        # peers whose death was seen here or agreed on -> its error
        self.settled: Set[int] = set()              # ... and those the survivors agreed on (settle)
        self.revoked: Dict[int, RevokedError] = {}  # root communicator id -> the error its requests get
        self.restored: Set[int] = set()             # root ids that `broken` does not stop
        self.faults = 0                             # deaths and revocations so far: waiters re-check on change

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
        error = self.refusal(req, "receive from")
        if error is not None:
            fail(req, error)
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

    def stash(self, match: Match, arrival: A) -> bool:
        """Keep an arrival nobody has asked for yet, behind any earlier one with the same key; False
        if it was a revocation notice, acted on and not kept (the transport counts it consumed)."""
        if is_notice(match[1]):
            root = match[1] & ROOT
            self.revoke(root, RevokedError(f"rank {self.rank}: communicator {root:#x} was revoked by rank "
                                           f"{match[0]} (comm.revoke()); agree() and shrink() to go on", match[0]))
            return False
        self._arrivals += 1
        self.unexpected.setdefault(match, deque()).append((self._arrivals, arrival))
        return True

    # -- failures ----------------------------------------------------------------------------
    def admit(self, req: Request, what: str) -> bool:
        """False (and `req` failed) if its peer is gone, its communicator revoked or the job broken;
        `what` is 'send to' or 'receive from', for the error."""
        if self.broken is None and not self.revoked and req.peer not in self.gone and req.peer not in self.dead:
            return True
        error = self.refusal(req, what)
        if error is None:
            return True
        fail(req, error)
        return False

    def refusal(self, req: Request, what: str) -> Optional[PycollError]:
        """Why `req` may not start (None: it may): its peer is gone; its communicator is revoked or
        the job broken, unless it is agreement or notice traffic (only a gone peer stops those)."""
        peer = req.peer
        if peer in self.dead:
            return self.dead[peer]
        if peer in self.gone:
            return PeerError(f"rank {self.rank}: cannot {what} rank {peer}: {self.gone[peer]}", peer, self.dead)
        comm_id = req.key.comm_id
        if comm_id & LOW >= NOTICE:
            return None
        if self.revoked:
            error = self.revoked.get(comm_id & ROOT)
            if error is not None:
                return error
        if self.broken is not None and comm_id & ROOT in self.restored:
            return None
        return self.broken

    def refuse(self, peer: int, why: str) -> None:
        """From now on every new request to or from `peer` fails (`why` says why); posted ones stay."""
        self.gone.setdefault(peer, why)

    def peer_gone(self, peer: int, why: str) -> List[Request]:
        """Peer `peer` closed (`why`, e.g. 'it closed its communicator'): fail its posted receives,
        and from now on every request to or from it; the failed receives are returned."""
        self.refuse(peer, why)
        failed = self._pop_posted(lambda m: m[0] == peer)
        for req in failed:
            fail(req, PeerError(f"rank {self.rank}: cannot receive from rank {peer} (comm {req.key.comm_id:#x}, "
                                f"call {req.key.seq}, tag {req.key.tag}): {self.gone[peer]}", peer))
        return failed

    def break_job(self, error: PeerError) -> List[Request]:
        """A peer died: fail every posted receive, and from now on every request, with `error` (the
        first death is the one reported), except agreement and notice traffic with other peers; the
        failed receives are returned. A peer already known dead (seen before, or settled by the
        survivors' agreement) changes nothing."""
        peer = error.peer
        if peer in self.dead:
            return []
        if peer is not None:
            self.dead[peer] = error
        error.ranks = sorted(self.dead)
        if self.broken is None or self.broken.peer in self.settled:  # the first death not yet dealt with
            self.broken = error
        self.faults += 1
        failed = self._pop_posted(lambda m: m[1] & LOW < NOTICE or m[0] == peer)
        for req in failed:
            fail(req, self.broken if req.key.comm_id & LOW < NOTICE else error)
        return failed

    def settle(self, peers: Iterable[int]) -> List[Request]:
        """The survivors agreed that `peers` are dead: refuse them for good and fail what waits on
        them; their deaths, seen here later, change nothing. The failed receives are returned."""
        new = {p for p in peers if p not in self.settled}
        if not new:
            return []
        self.settled |= new
        for p in new:
            self.dead.setdefault(p, PeerError(f"rank {self.rank}: the survivors agreed that rank {p} died", p,
                                              set(self.dead) | new))
        error = PeerError(f"rank {self.rank}: the survivors agreed that ranks {sorted(new)} died", min(new), self.dead)
        failed = self._pop_posted(lambda m: m[0] in new)
        for req in failed:
            fail(req, error)
        return failed

    def restore(self, root: int) -> None:
        """Communicator `root` is sound again (agreed on by its live members, none of them dead):
        lift its revocation, and let its requests through although the job is broken."""
        self.revoked.pop(root, None)
        self.restored.add(root)

    def revoke(self, root: int, error: RevokedError) -> List[Request]:
        """Communicator `root` (and every stream derived from it but its agreement) is revoked: its
        posted receives fail with `error`, and so will every later request on it; the failed receives
        are returned (none if it was revoked already)."""
        if root in self.revoked:
            return []
        self.revoked[root] = error
        self.faults += 1
        failed = self._pop_posted(lambda m: m[1] & ROOT == root and m[1] & LOW < NOTICE)
        for req in failed:
            fail(req, error)
        return failed

    def purge(self, root: int, below: int, control: bool = False) -> List[Tuple[Match, A]]:
        """Forget the unexpected arrivals and posted receives (failed) of communicator `root` with a
        call number (seq) below `below`: of its calls and side channels, or with `control` of its
        agreement (seq: the agreement's number). Stale messages of calls that failed, or of a
        communicator that was released, would otherwise stay forever. What was stashed is returned,
        for the transport to release (tcp: credit)."""
        ctl = root | LOW

        def hit(m: Match) -> bool:
            return (m[1] == ctl if control else m[1] & ROOT == root and m[1] & LOW < NOTICE) and 0 < m[2] < below
        gone = [m for m in self.unexpected if hit(m)]
        arrivals = [(m, a) for m in gone for _, a in self.unexpected.pop(m)]
        for req in self._pop_posted(hit):
            fail(req, PycollError(f"rank {self.rank}: call {req.key.seq} of communicator {root:#x} was abandoned"))
        return arrivals

    def fail_pending(self, reqs: Iterable[Request]) -> bool:
        """Fail the requests of `reqs` still pending whose peer is gone or whose job is broken (a
        waiter's check, for sends and for requests outside the table); True if any was failed."""
        failed = False
        for req in reqs:
            if not req.done and not self.admit(req, "receive from" if req.is_recv else "send to"):
                failed = True
        return failed

    def _pop_posted(self, hit: Callable[[Match], bool]) -> List[Request]:
        """Remove and return the posted receives whose matching key `hit`s (peer ANY for any-source ones)."""
        popped = [req for match in [m for m in self.posted if hit(m)] for req in self.posted.pop(match)]
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

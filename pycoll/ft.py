"""Fault tolerance: survivors of a dead rank revoke, agree and shrink, then go on (ULFM's
MPI_Comm_revoke / MPIX_Comm_agree / MPIX_Comm_shrink, NCCL's ncclCommRevoke / ncclCommShrink).

    try:
        comm.allreduce(grad); ok = True
    except (pycoll.PeerError, pycoll.RevokedError):
        comm.revoke(); ok = False
    ok, dead = comm.agree(ok)          # every survivor learns the same answer
    if dead: comm = comm.shrink()      # survivors only, renumbered
    if not ok: ...redo this step...

What each piece rests on:

* Detection. Every rank watches every peer (tcp: the peer's connection drops when its process dies,
  or, with PYCOLL_TCP_HEARTBEAT, when it falls silent; shm: a pidfd per peer). A death *breaks* the
  transport (transports/matching.py): every pending request fails with PeerError and so does every
  later one, except on communicators restored since (below) and agreement traffic.
* revoke() marks the communicator revoked here and sends a zero-byte notice to each member; a
  member's transport acts on it when it arrives, whatever the member is doing (its progress loop
  reads it), so its pending and later calls on that communicator, and on every side channel derived
  from it (ids.py), raise RevokedError. Nothing needs the dead rank, the store or rank 0.
* agree(flag) is a consensus among the live members over the transport, peer to peer, on the
  communicator's CONTROL stream, which neither revocation nor a death stops: Flooding Consensus with
  a perfect failure detector (Cachin, Guerraoui, Rodrigues, "Introduction to Reliable and Secure
  Distributed Programming", alg. 5.1). In each round every member sends what it knows (which
  members contributed, the AND of their flags, the union of the deaths they had seen, one number
  each) to the members it believes alive and waits for each of them: a message, or the failure of
  its receive because that member died. When a round brings messages from exactly the members the
  previous one did (no death during it) the member decides, and sends the decision on the next
  round's tag (those still behind adopt it). Members that never contributed count as dead. So every
  survivor returns the same (ok, dead) even when ranks die before or during the agreement; a member
  that dies after contributing is caught by the next call. Cost without new deaths: two rounds of
  n - 1 small messages each when a rank died before (the first round sees fewer members than it
  started with), one otherwise, plus the decision.
  Afterwards the dead are *settled* on the transport (refused for good); a communicator without dead
  members is *restored*: not revoked any more, not stopped by the broken state, its call numbers
  realigned (to the agreed highest) and its shared-memory board dropped (the members' board
  counters may differ after a failed call), so the failed step can simply run again.
* shrink() is one more agreement, whose numbers are the board lanes each member claimed, so the
  new communicator (the agreed survivors, renumbered in order, id from the old name and the
  agreement's number) needs no fallible collective to be built: every survivor makes the same one
  from the decision alone, restored on the transport. The old one is revoked and released (its
  workers stopped, its stale messages dropped), the transport passes to the new one.
* agree_max(flag, value) is agree() carrying one number per member as well, returning the largest:
  the elastic trainer's per-step agreement carries the newcomers each member has seen arrive, so all
  decide in the same step to grow (pycoll/grow.py: comm.grow(), the way back after a shrink).
* Partitions. Across hosts a silent peer may be alive on the other side of a cut link. Only a
  strict majority of the communicator's ranks (or exactly half, holding its lowest rank) shrinks
  and goes on; the others raise PartitionError. Within one host there are no partitions, so a
  single-host communicator may shrink down to one rank.

Transports: tcp, shm and auto (both parts); mpi and verbs raise PycollError saying why not (Open MPI
4.1 aborts the job on a dead rank; verbs does not recover a failed queue pair).
"""
from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING, Dict, List, NamedTuple, Optional, Set, Tuple

import numpy as np

from .channel import byte_view
from .errors import PartitionError, PycollError, TimeoutError
from .ids import control_id
from .ops import dtype_code
from .transports.base import MsgKey, Request, Transport
from .transports.capabilities import SharedBoard

if TYPE_CHECKING:  # comm.py imports this module
    from .comm import Communicator

_DECIDED, _OK, _SEQ, _HEAD = 0, 1, 2, 3  # message header words; then known[n], dead[n], numbers[n]
_CODE = dtype_code(np.dtype(np.int64))


class Decision(NamedTuple):
    """What an agreement settled: the AND of the flags, the dead members (communicator ranks, the
    members that never contributed included), each contributor's number, and the highest call
    number any member had reached."""

    ok: bool
    dead: List[int]
    numbers: Dict[int, int]
    seq: int


def _require(comm: "Communicator", call: str) -> Transport:
    transport = comm.transport
    if not transport.resilient:
        raise PycollError(f"rank {comm.rank}: {call} on {comm.name}: the {transport.name} transport cannot survive a "
                          f"dead rank ({transport.fragile_because}); use PYCOLL_TRANSPORT=tcp, shm or auto for "
                          "revoke/agree/shrink")
    if comm.closed:
        raise RuntimeError(f"rank {comm.rank}: {call} on {comm.name} after close()")
    return transport


def revoke(comm: "Communicator") -> None:
    """Revoke `comm` on every live member (local, returns at once, idempotent): their pending and
    later calls on it raise RevokedError until they agree (and shrink, if a member died)."""
    transport = _require(comm, "revoke")
    transport.revoke(comm.comm_id, comm.group)


def agree(comm: "Communicator", flag: bool, timeout: Optional[float] = None) -> Tuple[bool, List[int]]:
    """Fault-tolerant AND of `flag` over the live members, and the members all survivors agree are
    dead (communicator ranks); see the module docstring for what it repairs."""
    ok, dead, _ = agree_max(comm, flag, 0, timeout)
    return ok, dead


def agree_max(comm: "Communicator", flag: bool, value: int, timeout: Optional[float] = None
              ) -> Tuple[bool, List[int], int]:
    """agree() that also carries one non-negative integer per member and returns the largest the
    survivors contributed: e.g. the newcomers any member has seen arrive (pycoll/grow.py), agreed
    on in the same messages as a step's outcome, so that checking for them costs no extra round."""
    transport = _require(comm, "agree")
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"rank {comm.rank}: agree value={value!r} must be a non-negative integer")
    with comm._seq_lock:
        mine = next(comm._seq)  # the next call number here: the agreed highest realigns the members
    decision = _agree(comm, transport, bool(flag), int(value), mine, comm._deadline(timeout, "agree"))
    dead = [comm.group[r] for r in decision.dead]
    transport.settle(dead)
    if decision.dead:  # it cannot be used again: calls raise RevokedError until shrink()
        transport.revoke(comm.comm_id, ())
    else:
        _restore(comm, transport, decision)
    return decision.ok, decision.dead, max(decision.numbers.values())


def _restore(comm: "Communicator", transport: Transport, decision: Decision) -> None:
    """Make a communicator whose members all live usable again after a failure."""
    with comm._seq_lock:
        comm._seq = itertools.count(decision.seq + 1)
    transport.restore(comm.comm_id)
    transport.purge(comm.comm_id, decision.seq + 1)  # what failed calls left behind
    if not decision.ok and comm.board is not None:  # members may be a board call apart
        comm.board = None
        comm.selector = comm.selector.for_board(0, 0)


def shrink(comm: "Communicator", timeout: Optional[float] = None) -> "Communicator":
    """A communicator of `comm`'s live members, renumbered in order, agreed on by all of them; the
    old one is revoked and released. PartitionError on a minority cut off from the rest."""
    transport = _require(comm, "shrink")
    limit = comm._deadline(timeout, "shrink")
    known_dead = transport.dead_peers()
    alive = [g for g in comm.group if g not in known_dead]
    boards = transport.offers(SharedBoard)
    lane = boards.claim_lane(comm.comm_id) if boards is not None and boards.reaches(alive) else -1
    decision = _agree(comm, transport, True, lane, 0, limit)
    survivors = [r for r in range(comm.size) if r not in decision.dead]
    _check_quorum(comm, survivors)
    transport.settle(comm.group[r] for r in decision.dead)
    transport.revoke(comm.comm_id, ())  # here only: every survivor is in this shrink
    group = [comm.group[r] for r in survivors]
    lanes = {comm.group[r]: decision.numbers[r] for r in survivors}
    name = f"{comm.name}.shrink{comm._agreements}"
    new = comm._shrunk(name, group, lanes)
    transport.restore(new.comm_id)
    comm._hand_over(new)
    transport.purge(comm.comm_id, 2 ** 62)
    transport.purge(comm.comm_id, comm._agreements + 1, control=True)
    return new


def _check_quorum(comm: "Communicator", survivors: List[int]) -> None:
    """Across hosts a 'dead' member may be alive behind a cut link: only a strict majority, or
    exactly half holding the lowest rank, may go on. One host cannot be partitioned."""
    hosts = comm.membership.hosts
    if comm.rank not in survivors:
        raise PartitionError(f"rank {comm.rank}: the other members of {comm.name} agreed that this rank is dead "
                             "(it was cut off from them); it must not continue", [])
    if len({hosts[g] for g in comm.group}) <= 1:
        return
    n, k = comm.size, len(survivors)
    if 2 * k > n or (2 * k == n and 0 in survivors):
        return
    raise PartitionError(
        f"rank {comm.rank}: only ranks {survivors} of the {n} of {comm.name} are reachable: a minority (a strict "
        f"majority, or half holding rank 0, goes on), so this side was cut off by a network partition and must not "
        f"continue alone", survivors)


def _agree(comm: "Communicator", transport: Transport, flag: bool, number: int, seq: int,
           timeout: float) -> Decision:
    """One Flooding Consensus among `comm`'s live members (module docstring)."""
    n, me, group = comm.size, comm.rank, comm.group
    comm._agreements += 1
    instance = comm._agreements
    ctl = control_id(comm.comm_id)
    if instance > 2:  # no member can still send for instances before the last one (each needed all)
        transport.purge(comm.comm_id, instance - 1, control=True)
    deadline = time.monotonic() + timeout
    known, dead, numbers = (slice(_HEAD + i * n, _HEAD + (i + 1) * n) for i in range(3))
    state = np.zeros(_HEAD + 3 * n, np.int64)
    state[_OK], state[_SEQ] = flag, seq
    state[known][me], state[numbers][me] = 1, number
    gone = transport.dead_peers()
    state[dead] = [g in gone and r != me for r, g in enumerate(group)]
    alive: Set[int] = {r for r in range(n) if r != me and not state[dead][r]}
    before: Set[int] = set(range(n))  # who the previous round heard from (round 0: everyone)
    decided = False
    for rnd in itertools.count(1):
        state[_DECIDED] = decided
        key = MsgKey(ctl, instance, rnd)
        sent = state.copy()  # a send may go out later (a full ring, flow control) while `state` changes
        sends = [transport.isend(byte_view(sent), group[p], key, _CODE) for p in sorted(alive)]
        if decided:
            transport.wait_for(sends, max(0.0, min(1.0, deadline - time.monotonic())))
            return _decision(state, n, known, dead, numbers)
        inbox = {p: np.empty_like(state) for p in sorted(alive)}
        recvs: Dict[int, Request] = {p: transport.irecv(byte_view(buf), group[p], key, _CODE)
                                     for p, buf in inbox.items()}
        if not transport.wait_for(list(recvs.values()) + sends, max(0.0, deadline - time.monotonic())):
            late = sorted(p for p, r in recvs.items() if not r.done)
            raise TimeoutError(f"rank {me}: agreement {instance} on {comm.name} (round {rnd}) timed out after "
                               f"{timeout:g} s waiting for ranks {late}: are they alive and calling agree/shrink "
                               "on this communicator?", peers=[group[p] for p in late])
        heard = {me}
        adopt: Optional[np.ndarray] = None
        for p, req in recvs.items():
            if req.error is not None:  # its receive failed: that member died (only that stops CONTROL)
                alive.discard(p)
                continue
            heard.add(p)
            got = inbox[p]
            if got[_DECIDED]:
                adopt = got
            else:
                _merge(state, got, known, dead, numbers)
        if adopt is not None:
            state[:] = adopt
            decided = True
        elif heard == before:
            decided = True
        before = heard
    raise AssertionError("unreachable")


def _merge(state: np.ndarray, other: np.ndarray, known: slice, dead: slice, numbers: slice) -> None:
    """Join another member's knowledge into `state` (each member contributes once: idempotent)."""
    state[_OK] &= other[_OK]
    state[_SEQ] = max(state[_SEQ], other[_SEQ])
    new = (other[known] == 1) & (state[known] == 0)
    state[numbers][new] = other[numbers][new]
    state[known] |= other[known]
    state[dead] |= other[dead]


def _decision(state: np.ndarray, n: int, known: slice, dead: slice, numbers: slice) -> Decision:
    died = [r for r in range(n) if state[dead][r] or not state[known][r]]
    return Decision(bool(state[_OK]), died, {r: int(state[numbers][r]) for r in range(n) if r not in died},
                    int(state[_SEQ]))


def inherit(parent: "Communicator", child: "Communicator") -> None:
    """A communicator made from a restored one after a failure (split, dup, subgroup) is restored too:
    its members were alive when its parent was agreed on."""
    transport = parent.transport
    if getattr(transport, "resilient", False) and transport.restored(parent.comm_id):
        transport.restore(child.comm_id)


def replace_default(old: "Communicator", new: "Communicator") -> None:
    """The module-level calls (pycoll.allreduce, ...) follow a shrunk default communicator."""
    from . import world  # world imports comm, which imports this module
    if world._default is old:
        world._default = new

"""Elastic training (--elastic): a rank's death costs the time of the step it happened in, not the run,
and a rank that comes back (restarted by `pycoll run --elastic --max-restarts K`, or a new node's) rejoins.

A step whose gradient averaging fails anywhere (PeerError, RevokedError) is revoked, the survivors
agree on it (pycoll/ft.py) and, if a rank died, shrink the communicator; no survivor applies it (so
their parameters stay bit-identical), and they run the same global batch again, sharded over the
new size, each shard's gradient weighted by its size (model.backward), so that the update is the
global batch's mean gradient as on the full size: the run takes the same steps as an undisturbed one.

The same agreement carries, from each member, the newcomers it has seen arrive (pycoll/grow.py:
a thread waits on the store, so watching costs nothing per step), so all members learn in the same
step that one is waiting. At the end of that step they grow the communicator with it (members keep
their ranks, the newcomer follows) and heal it from rank 0, a live member: the counters (step, epoch,
position in the epoch), the parameters and the optimizer state are broadcast, and the next step's
data is sharded over the grown size. Each event is reported with its CLOCK_MONOTONIC time (a death
also with when rank 0 met it: its call failed, or the agreement told it):
"[t=812.345] rank 2 died at step 41; continued on 3 ranks after 0.80 s (shrunk; met at t=811.903)",
"[t=815.012] rank 3 joined at step 57; continued on 4 ranks after 0.45 s (grown and healed)".
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, TypeVar

import numpy as np

from .. import ft, grow
from ..comm import Communicator
from ..errors import GrowError, PeerError, PycollError, RevokedError

T = TypeVar("T")


@dataclass(frozen=True)
class Event:
    """Ranks that died in `step` (world numbering), or that joined after it (ranks of the grown
    communicator), what the run went on with, how long the recovery took, when it ended and, for a
    death, when this rank met the failure (time.monotonic(): comparable between the processes of a host)."""
    step: int
    dead: List[int]
    ranks: int
    seconds: float
    joined: List[int] = field(default_factory=list)
    at: float = 0.0
    met: float = 0.0

    def __str__(self) -> str:
        if self.joined:
            who = f"rank {self.joined[0]} joined" if len(self.joined) == 1 else f"ranks {self.joined} joined"
            what = "grown and healed"
        else:
            who = f"rank {self.dead[0]} died" if len(self.dead) == 1 else f"ranks {self.dead} died"
            what = f"shrunk; met at t={self.met:.3f}"
        return f"[t={self.at:.3f}] {who} at step {self.step}; continued on {self.ranks} ranks after " \
               f"{self.seconds:.2f} s ({what})"


class Elastic:
    """The communicator a run is on now, how it recovers from a failure, and how it takes newcomers in."""

    def __init__(self, comm: Communicator, on_event: Callable[[Event], None]) -> None:
        self.comm = comm
        self.events: List[Event] = []
        self._on_event = on_event
        self.arrived = 0  # the newcomers' highest ticket, as the members last agreed
        self._met = 0.0  # when this rank's current call failed (time.monotonic()), 0.0 if it did not
        try:
            grow.arrivals(comm)  # start watching the store
            self.grows = True
        except PycollError:  # a job without a store every rank reaches: shrink only
            self.grows = False

    def settle(self, ok: bool, step: int, since: float) -> bool:
        """Agree on `ok` (this rank's step went through) and on the newcomers seen, and shrink out the
        dead; whether the step completed on every survivor. `since`: when the failure was met."""
        seen = grow.arrivals(self.comm) if self.grows else 0
        ok, dead, self.arrived = ft.agree_max(self.comm, ok, seen)
        if dead:
            self._shrink(dead, step, since, self._met or time.monotonic())
        self._met = 0.0
        return ok

    def _shrink(self, dead: List[int], step: int, since: float, met: float) -> None:
        old = self.comm
        self.comm = old.shrink()
        self._event(Event(step, [old.group[r] for r in dead], self.comm.size, time.perf_counter() - since,
                          at=time.monotonic(), met=met))

    def _event(self, event: Event) -> None:
        self.events.append(event)
        self._on_event(event)

    def call(self, fn: Callable[[Communicator], T], step: int, abandon: Optional[Callable[[], None]] = None) -> \
            Optional[T]:
        """fn(comm) once, agreed on by the survivors; None if it failed (on any of them), after the
        recovery (`abandon` runs first: it lets the failed call's queued work end)."""
        since = time.perf_counter()
        try:
            result: Optional[T] = fn(self.comm)
            ok = True
        except (PeerError, RevokedError):
            self._met = time.monotonic()
            self.comm.revoke()
            if abandon is not None:
                abandon()
            result, ok = None, False
        return result if self.settle(ok, step, since) else None

    def retry(self, fn: Callable[[Communicator], T], step: int) -> T:
        """fn(comm) until it completes on every survivor (reductions over whoever is left)."""
        while True:
            result = self.call(fn, step)
            if result is not None:
                return result

    @property
    def newcomers_waiting(self) -> bool:
        """Whether the members agreed, in their last agreement, that newcomers wait to be admitted."""
        return self.grows and self.arrived > grow.admitted(self.comm)

    def grow(self, step: int, heal: Callable[[Communicator], bool]) -> bool:
        """At a step boundary, once newcomers_waiting: grow the communicator with them and heal them
        (heal(comm) broadcasts the training state from rank 0; retried over the survivors if a rank
        dies in it). False if no newcomer came in (the grow failed: the run goes on as it was)."""
        since = time.perf_counter()
        try:
            grown = self.comm.grow(arrivals=self.arrived)
        except GrowError as e:
            if self.comm.rank == 0:
                print(f"pycoll.trainer: [t={time.monotonic():.3f}] newcomers were not admitted at step {step}: {e}",
                      flush=True)
            if e.dead:
                self._shrink(e.dead, step, since, time.monotonic())
            return False
        if grown is self.comm:
            return False
        self.comm = grown
        joined = grow.growth(grown)
        self.retry(heal, step)
        self._event(Event(step, [], self.comm.size, time.perf_counter() - since,
                          joined=joined.newcomers if joined is not None else [], at=time.monotonic()))
        return True


def is_newcomer(comm: Communicator) -> bool:
    """Whether this process joined the run as a newcomer (pycoll.join()) and must be healed."""
    joined = grow.growth(comm)
    return joined is not None and comm.rank >= joined.members


def heal(comm: Communicator, counters: np.ndarray, floats: np.ndarray, arrays: Sequence[np.ndarray]) -> bool:
    """Broadcast rank 0's training state to every rank: `counters` (int64), `floats` (float64) and
    `arrays` (the parameters and the optimizer state), in place. Members hold the same state already,
    so for them it changes nothing; a newcomer comes out bit-identical to them. True (for retry)."""
    comm.broadcast(counters, root=0)
    comm.broadcast(floats, root=0)
    for a in arrays:
        comm.broadcast(a, root=0)
    return True

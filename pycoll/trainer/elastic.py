"""Elastic training (--elastic): a rank's death costs the step it happened in, not the run.

A step whose gradient averaging fails anywhere (PeerError, RevokedError) is revoked, the survivors
agree on it (pycoll/ft.py) and, if a rank died, shrink the communicator; every survivor then drops
that step (no update anywhere, so their parameters stay bit-identical), the data is re-sharded over
the new size, and training goes on. Each such event is reported: "rank 2 died at step 41;
continued on 3 ranks after 0.8 s".
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, List, Optional, TypeVar

from ..comm import Communicator
from ..errors import PeerError, RevokedError

T = TypeVar("T")


@dataclass(frozen=True)
class Event:
    """Ranks (world numbering) that died in `step` and what the run went on with."""
    step: int
    dead: List[int]
    ranks: int
    seconds: float

    def __str__(self) -> str:
        who = f"rank {self.dead[0]} died" if len(self.dead) == 1 else f"ranks {self.dead} died"
        return f"{who} at step {self.step}; continued on {self.ranks} ranks after {self.seconds:.2f} s"


class Elastic:
    """The communicator a run is on now, and how it recovers from a failure."""

    def __init__(self, comm: Communicator, on_event: Callable[[Event], None]) -> None:
        self.comm = comm
        self.events: List[Event] = []
        self._on_event = on_event

    def settle(self, ok: bool, step: int, since: float) -> bool:
        """Agree on `ok` (this rank's step went through) and shrink out the dead; whether the step
        completed on every survivor. `since`: when the failure was met, for the report."""
        ok, dead = self.comm.agree(ok)
        if dead:
            old = self.comm
            self.comm = old.shrink()
            event = Event(step, [old.group[r] for r in dead], self.comm.size, time.perf_counter() - since)
            self.events.append(event)
            self._on_event(event)
        return ok

    def call(self, fn: Callable[[Communicator], T], step: int, abandon: Optional[Callable[[], None]] = None) -> \
            Optional[T]:
        """fn(comm) once, agreed on by the survivors; None if it failed (on any of them), after the
        recovery (`abandon` runs first: it lets the failed call's queued work end)."""
        since = time.perf_counter()
        try:
            result: Optional[T] = fn(self.comm)
            ok = True
        except (PeerError, RevokedError):
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

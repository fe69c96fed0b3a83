"""Exceptions a user can act on: each names the rank, the peer and the call involved."""
from __future__ import annotations

import builtins
from typing import Iterable, Optional, Tuple


class PycollError(RuntimeError):
    """Base class of every error pycoll raises on purpose."""


class TimeoutError(PycollError, builtins.TimeoutError):
    """A wait passed its deadline; `peers` lists the ranks not heard from."""

    def __init__(self, message: str, peers: Iterable[int] = ()) -> None:
        super().__init__(message)
        self.peers = sorted(set(peers))


class PeerError(PycollError):
    """A peer broke the protocol, disconnected or died; `peer` is its rank (or None), `ranks` the
    ranks known dead when the error was raised (transport ranks: the world's numbering)."""

    def __init__(self, message: str, peer: Optional[int] = None, ranks: Iterable[int] = ()) -> None:
        super().__init__(message)
        self.peer = peer
        self.ranks = sorted(set(ranks) | ({peer} if peer is not None and not ranks else set()))


class ProtocolError(PeerError):
    """A message arrived that does not match what this rank expected. `codes`, where known: (the dtype
    code the peer's message or board post carried, the one this rank expected); their bits 8-15 are a
    persistent handle's mark (pycoll/persistent.py), 0 for a plain call."""

    def __init__(self, message: str, peer: Optional[int] = None, ranks: Iterable[int] = (),
                 codes: Optional[Tuple[int, int]] = None) -> None:
        super().__init__(message, peer, ranks)
        self.codes = codes


class RevokedError(PycollError):
    """The communicator was revoked (comm.revoke(), here or on any member): every pending and later
    call on it raises this until the members agree() and shrink() (pycoll/ft.py). `by` is the
    rank that revoked it, where known."""

    def __init__(self, message: str, by: Optional[int] = None) -> None:
        super().__init__(message)
        self.by = by


class PartitionError(PycollError):
    """After a failure this rank can reach only a minority of its communicator (a network partition
    cut it off): it must not continue alone. `survivors` are the ranks it still reaches."""

    def __init__(self, message: str, survivors: Iterable[int] = ()) -> None:
        super().__init__(message)
        self.survivors = sorted(survivors)


class StoreError(PycollError):
    """The rendezvous store could not be reached or answered badly."""


class EnvError(PycollError, ValueError):
    """The launcher environment is incomplete or contradicts itself."""


class GrowError(PycollError):
    """comm.grow() or pycoll.join() did not complete (pycoll/grow.py): a newcomer never connected, a
    member failed to, or one died meanwhile. On the members the old communicator is usable again,
    unless `dead` (its members all survivors agree died during the grow) is non-empty: then shrink() it."""

    def __init__(self, message: str, dead: Iterable[int] = ()) -> None:
        super().__init__(message)
        self.dead = sorted(dead)


class JobEnded(SystemExit):
    """A newcomer (pycoll.join(), or pycoll.init() under PYCOLL_NEWCOMER=1) found that the job it was
    to join has ended before admitting it: there is nothing left to do, so, uncaught, the process
    exits with status 0 (as torchrun's agent does on a closed rendezvous). `reason` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(0)
        self.reason = reason

    def __str__(self) -> str:
        return self.reason

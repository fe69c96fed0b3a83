"""Exceptions a user can act on: each names the rank, the peer and the call involved."""
from __future__ import annotations

import builtins
from typing import Iterable, Optional


class PycollError(RuntimeError):
    """Base class of every error pycoll raises on purpose."""


class TimeoutError(PycollError, builtins.TimeoutError):
    """A wait passed its deadline; `peers` lists the ranks not heard from."""

    def __init__(self, message: str, peers: Iterable[int] = ()) -> None:
        super().__init__(message)
        self.peers = sorted(set(peers))


class PeerError(PycollError):
    """A peer broke the protocol, disconnected or died; `peer` is its rank (or None)."""

    def __init__(self, message: str, peer: Optional[int] = None) -> None:
        super().__init__(message)
        self.peer = peer


class ProtocolError(PeerError):
    """A message arrived that does not match what this rank expected."""


class StoreError(PycollError):
    """The rendezvous store could not be reached or answered badly."""


class EnvError(PycollError, ValueError):
    """The launcher environment is incomplete or contradicts itself."""

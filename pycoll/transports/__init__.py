"""Transports: the byte-moving layer under the algorithms (tcp now; shm, mpi, verbs plug in here)."""
from __future__ import annotations

from typing import Optional

from .base import MsgKey, Request, Transport

NAMES = ("auto", "tcp")


def create_transport(name: str, rank: int, size: int, address: Optional[str] = None) -> Transport:
    """Build the transport called `name` (PYCOLL_TRANSPORT); ValueError for unknown names."""
    name = (name or "auto").lower()
    if name in ("auto", "tcp"):
        from .tcp import TcpTransport
        return TcpTransport(rank, size, address)
    raise ValueError(f"PYCOLL_TRANSPORT={name!r} is not available; choose one of {list(NAMES)}")


__all__ = ["MsgKey", "Request", "Transport", "create_transport", "NAMES"]

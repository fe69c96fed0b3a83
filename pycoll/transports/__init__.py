"""Transports: the byte-moving layer under the algorithms. Each is `Class(rank, size, address, hosts)`
followed by `connect(store, token, timeout)`; `auto` mixes them per peer pair."""
from __future__ import annotations

import importlib
from typing import List, Optional

from .base import MsgKey, Request, Transport

# name -> "module:Class" (imported on first use, so optional dependencies stay optional)
REGISTRY = {
    "tcp": "tcp:TcpTransport",
    "shm": "shm:ShmTransport",
    "mpi": "mpi:MpiTransport",
    "verbs": "verbs:VerbsTransport",
    "auto": "mux:AutoTransport",
}
NAMES = tuple(REGISTRY)


def create_transport(name: str, rank: int, size: int, address: Optional[str] = None,
                     hosts: Optional[List[str]] = None) -> Transport:
    """Build the transport called `name` (PYCOLL_TRANSPORT); ValueError for unknown names.

    `hosts[r]` is rank r's host id, so a transport can tell same-host peers from remote ones.
    """
    name = (name or "auto").lower()
    if name not in REGISTRY:
        raise ValueError(f"PYCOLL_TRANSPORT={name!r} is not a transport; choose one of {list(NAMES)}")
    module, _, cls = REGISTRY[name].partition(":")
    mod = importlib.import_module(f"{__name__}.{module}")
    return getattr(mod, cls)(rank, size, address, hosts)


__all__ = ["MsgKey", "Request", "Transport", "create_transport", "NAMES", "REGISTRY"]

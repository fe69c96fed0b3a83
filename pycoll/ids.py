"""Communicator ids: the 64-bit number that keys a communicator's messages, derived from its name."""
from __future__ import annotations

import hashlib


def comm_hash(name: str) -> int:
    """A 64-bit communicator id every rank derives from the same name."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")

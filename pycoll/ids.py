"""Communicator ids: the 64-bit number that keys a communicator's messages, derived from its name.

An id has two parts: its upper 48 bits name the communicator (its *root*), its low 16 bits say which
of its message streams a message belongs to: 0 for its calls, 1..0xFFFD for the side channels derived
from it (board set-up, tuner, an algorithm's sub-channels, the DETAIL check), and two reserved values
that the fault-tolerance layer (pycoll/ft.py) uses: CONTROL, its agreement traffic, which must flow on
a revoked communicator and after a death, and NOTICE, revocation notices. So a transport can revoke a
communicator with everything derived from it by one mask (transports/matching.py).
"""
from __future__ import annotations

import hashlib

LOW = 0xFFFF              # the stream bits of an id
ROOT = ~LOW & (2 ** 64 - 1)
NOTICE = 0xFFFE           # a revocation notice of the root communicator (zero bytes, never received)
CONTROL = 0xFFFF          # the root communicator's fault-tolerant agreement (survives revocation and deaths)


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def comm_hash(name: str) -> int:
    """A 64-bit communicator id (a root: stream bits 0) every rank derives from the same name."""
    return _hash(name) & ROOT


def derived_id(comm_id: int, label: str) -> int:
    """The id of side channel `label` of communicator `comm_id` (itself maybe derived): same root,
    stream bits 1..0xFFFD from the label, so revoking the root revokes it too."""
    return (comm_id & ROOT) | (1 + _hash(f"{comm_id}/{label}") % (NOTICE - 1))


def root_of(comm_id: int) -> int:
    """The communicator an id belongs to (its stream bits cleared)."""
    return comm_id & ROOT


def control_id(comm_id: int) -> int:
    """The id of communicator `comm_id`'s fault-tolerant agreement traffic."""
    return (comm_id & ROOT) | CONTROL


def notice_id(comm_id: int) -> int:
    """The id a revocation notice of communicator `comm_id` travels with."""
    return (comm_id & ROOT) | NOTICE


def is_notice(comm_id: int) -> bool:
    """Whether a message with id `comm_id` is a revocation notice (acted on as it arrives)."""
    return comm_id & LOW == NOTICE

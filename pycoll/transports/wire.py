"""The message header every transport puts in front of a payload (DESIGN.md wire rules)."""
from __future__ import annotations

import hashlib
import hmac
import struct
from typing import NamedTuple, Optional, Set, Tuple, Union

MAGIC = b"PYCL"
VERSION = 1
KIND_DATA, KIND_HELLO, KIND_BYE = 0, 1, 2  # BYE: the sender closes normally, after its last data
KIND_BULK = 3  # announces a payload of `nbytes` that follows on the pair's raw stream (bulk.py)
KIND_CREDIT, KIND_ASK = 4, 5  # flow control (flow.py): `nbytes` of credit returned; a sender waits on credit
LAYOUT = struct.Struct("<HHH")  # after a KIND_BULK header on a tcp stream: the payload's cut (parts, first, width)
_KINDS = (KIND_DATA, KIND_HELLO, KIND_BYE, KIND_BULK, KIND_CREDIT, KIND_ASK)
HEADER = struct.Struct("<4sBBHQQqQ")  # magic, version, kind, dtype, comm_id, seq, tag, nbytes
HELLO = struct.Struct("<II16s32s")   # src rank, dst rank, nonce, hmac


class Header(NamedTuple):
    kind: int
    dtype: int
    comm_id: int
    seq: int
    tag: int
    nbytes: int


def pack_header(kind: int, dtype: int, comm_id: int, seq: int, tag: int, nbytes: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, kind, dtype, comm_id, seq, tag, nbytes)


def unpack_header(data: bytes) -> Header:
    """Parse a header; ValueError for anything that is not a pycoll header of this version."""
    if len(data) != HEADER.size:
        raise ValueError(f"header of {len(data)} bytes, expected {HEADER.size}")
    return unpack_header_from(data, 0)


def unpack_header_from(buffer: Union[bytes, memoryview], offset: int) -> Header:
    """Parse the header at `offset` of `buffer` (at least HEADER.size bytes from there); ValueError as
    unpack_header."""
    magic, version, kind, dtype, comm_id, seq, tag, nbytes = HEADER.unpack_from(buffer, offset)
    if magic != MAGIC or version != VERSION or kind not in _KINDS:
        raise ValueError("not a pycoll header (bad magic, version or kind)")
    return Header(kind, dtype, comm_id, seq, tag, nbytes)


HELLO_PURPOSE = b"pycoll-hello"  # each channel its own: a hello captured on one is no good on another
BULK_PURPOSE = b"pycoll-bulk-hello"
MAX_STREAMS = 16  # raw streams a pair of ranks may open (bulk.py); each proves the token with its own index


def bulk_purpose(index: int) -> bytes:
    """The channel of a pair's bulk stream `index`: its hello is good for that stream only."""
    return BULK_PURPOSE if index == 0 else BULK_PURPOSE + b"#%d" % index


def hello_mac(token: bytes, src: int, dst: int, nonce: bytes, purpose: bytes = HELLO_PURPOSE) -> bytes:
    """Proof that the sender holds the job token, bound to this sender, receiver, nonce and channel."""
    return hmac.new(token, purpose + struct.pack("<II", src, dst) + nonce, hashlib.sha256).digest()


def make_hello(token: bytes, src: int, dst: int, nonce: bytes, purpose: bytes = HELLO_PURPOSE) -> bytes:
    return HELLO.pack(src, dst, nonce, hello_mac(token, src, dst, nonce, purpose))


def check_hello(token: bytes, dst: int, payload: bytes, *, src: Optional[int] = None, size: Optional[int] = None,
                seen: Optional[Set[bytes]] = None, purpose: bytes = HELLO_PURPOSE) -> int:
    """The sender of a valid hello addressed to `dst`; ValueError otherwise: a wrong token, a sender
    other than `src` (when given) or outside 0..size-1, or a nonce already in `seen` (a replay;
    a valid nonce is added to it)."""
    if len(payload) != HELLO.size:
        raise ValueError("hello of the wrong size")
    sender, to, nonce, mac = HELLO.unpack(payload)
    if to != dst:
        raise ValueError(f"hello addressed to rank {to}, not {dst}")
    if not hmac.compare_digest(mac, hello_mac(token, sender, dst, nonce, purpose)):
        raise ValueError("hello with a wrong job token")
    if src is not None and sender != src:
        raise ValueError(f"hello from rank {sender}, expected rank {src}")
    if size is not None and not 0 <= sender < size:
        raise ValueError(f"hello from rank {sender} outside 0..{size - 1}")
    if seen is not None:
        if nonce in seen:
            raise ValueError("replayed hello")
        seen.add(nonce)
    return sender


def check_bulk_hello(token: bytes, dst: int, payload: bytes, seen: Set[bytes]) -> Tuple[int, int]:
    """(sender, stream index) of a valid bulk-stream hello addressed to `dst` (check_hello's rules,
    replay guard included); the index is bound into the MAC, so a hello for one stream opens no other."""
    if len(payload) != HELLO.size:
        raise ValueError("hello of the wrong size")
    sender, to, nonce, mac = HELLO.unpack(payload)
    if to != dst:
        raise ValueError(f"hello addressed to rank {to}, not {dst}")
    for index in range(MAX_STREAMS):
        if hmac.compare_digest(mac, hello_mac(token, sender, dst, nonce, bulk_purpose(index))):
            return check_hello(token, dst, payload, seen=seen, purpose=bulk_purpose(index)), index
    raise ValueError("hello with a wrong job token")

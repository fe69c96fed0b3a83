"""What transports move and match: a message key, and a posted send or receive (Request)."""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

from ..errors import ProtocolError

ANY = -1
"""The `peer` of a receive from any source (MPI_ANY_SOURCE) until it matched; then the sender's rank."""

Sink = Callable[[memoryview, int], None]
"""Consumes a received payload in place: sink(piece, offset) once or several times, each byte once (in
order, except where tcp cuts a payload over several streams: their pieces interleave); each piece
starts at byte `offset` of the message, a multiple of 16 (so of every dtype's itemsize)."""

class MsgKey(NamedTuple):
    """What a message belongs to: communicator, collective call number, and step tag."""

    comm_id: int
    seq: int
    tag: int


class Request:
    """One posted send or receive; `done` flips when the buffer may be reused or read."""

    __slots__ = ("peer", "key", "view", "nbytes", "dtype", "is_recv", "done", "error", "handle", "sink",
                 "order")

    def __init__(self, peer: int, key: MsgKey, view: memoryview, dtype: int, is_recv: bool,
                 sink: Optional[Sink] = None) -> None:
        self.peer, self.key, self.view, self.dtype, self.is_recv = peer, key, view, dtype, is_recv
        self.nbytes = view.nbytes
        self.done = False
        self.error: Optional[BaseException] = None
        self.handle: Any = None  # transport-private: a send tracker, an MPI request, ...
        self.sink = sink         # consumes the payload instead of a copy into `view` (see irecv)
        self.order = 0           # when it was posted, among receives (matching.Matcher, any-source only)

    def deliver(self, payload: memoryview, offset: int = 0) -> None:
        """Hand received bytes (size-checked) to the sink, or copy them into the view at `offset`."""
        if self.sink is None:
            self.view[offset:offset + payload.nbytes] = payload
            return
        try:
            self.sink(payload, offset)
        except Exception as e:  # the waiter gets it, naming the peer
            self.error = e

    def check_incoming(self, rank: int, nbytes: int, dtype: int) -> None:
        """Fail this receive (without touching its buffer) if the message does not fit it."""
        if nbytes != self.nbytes or (dtype and self.dtype and dtype != self.dtype):
            self.error = ProtocolError(
                f"rank {rank}: message from rank {self.peer} (comm {self.key.comm_id:#x}, call "
                f"{self.key.seq}, tag {self.key.tag}) carries {nbytes} bytes of dtype code {dtype}, "
                f"but the receive expects {self.nbytes} bytes of dtype code {self.dtype}; "
                "did the ranks call the collective with different sizes or dtypes?", self.peer,
                codes=(dtype, self.dtype))

    def describe(self) -> str:
        if self.peer == ANY:
            return "recv from any rank"
        return f"{'recv from' if self.is_recv else 'send to'} rank {self.peer}"


def as_bytes(view: memoryview) -> memoryview:
    """A flat unsigned-byte view, so slicing counts bytes whatever the caller's format."""
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")

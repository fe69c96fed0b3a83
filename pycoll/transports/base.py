"""The Transport interface: tagged, nonblocking point-to-point of contiguous buffers.

A transport knows ranks, bytes and keys; it knows nothing about collectives. Messages are
matched by (peer, comm_id, seq, tag) in FIFO order, so a peer running ahead is buffered,
and a message whose size or dtype differs from the posted receive is a ProtocolError.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any, Callable, Dict, NamedTuple, Optional, Sequence, Type, TypeVar

Sink = Callable[[memoryview, int], None]
"""Consumes a received payload in place: sink(piece, offset) once or several times, in order; each
piece starts at byte `offset` of the message, a multiple of 16 (so of every dtype's itemsize)."""

from ..bootstrap.store import Store
from ..errors import PeerError, ProtocolError, TimeoutError
from .capabilities import Capability

C = TypeVar("C", bound=Capability)


class MsgKey(NamedTuple):
    """What a message belongs to: communicator, collective call number, and step tag."""

    comm_id: int
    seq: int
    tag: int


class Request:
    """One posted send or receive; `done` flips when the buffer may be reused or read."""

    __slots__ = ("peer", "key", "view", "nbytes", "dtype", "is_recv", "done", "error", "handle", "sink")

    def __init__(self, peer: int, key: MsgKey, view: memoryview, dtype: int, is_recv: bool,
                 sink: Optional[Sink] = None) -> None:
        self.peer, self.key, self.view, self.dtype, self.is_recv = peer, key, view, dtype, is_recv
        self.nbytes = view.nbytes
        self.done = False
        self.error: Optional[BaseException] = None
        self.handle: Any = None  # transport-private: a send tracker, an MPI request, ...
        self.sink = sink         # consumes the payload instead of a copy into `view` (see irecv)

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
                "did the ranks call the collective with different sizes or dtypes?", self.peer)

    def describe(self) -> str:
        return f"{'recv from' if self.is_recv else 'send to'} rank {self.peer}"


class Transport(ABC):
    """Full-mesh point-to-point between the ranks of one job."""

    name = "base"

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.capabilities: Dict[type, Capability] = {}  # what it offers beyond point-to-point, by kind

    def offers(self, kind: Type[C]) -> Optional[C]:
        """This transport's capability of class `kind` (capabilities.py), or None."""
        return self.capabilities.get(kind)  # type: ignore[return-value]

    @abstractmethod
    def connect(self, store: Store, token: bytes, timeout: float) -> None:
        """Publish this rank's address in the store, connect to every peer, authenticate with `token`."""

    @abstractmethod
    def isend(self, view: memoryview, peer: int, key: MsgKey, dtype: int = 0) -> Request:
        """Start sending a contiguous byte view; the view must stay untouched until the request is done."""

    @abstractmethod
    def irecv(self, view: memoryview, peer: int, key: MsgKey, dtype: int = 0,
              sink: Optional[Sink] = None) -> Request:
        """Post a receive of exactly `view.nbytes` bytes from `peer` into `view`.

        With `sink` (only where the transport offers SinkReceive), the payload is passed to sink(piece, offset) instead,
        in the progressing thread, e.g. to reduce straight from the wire buffer while it is in cache.
        """

    @abstractmethod
    def wait_for(self, reqs: Sequence[Request], timeout: float) -> bool:
        """Make progress until every request is done (True) or `timeout` s pass (False); never spins."""

    def wait(self, reqs: Sequence[Request], timeout: float, what: object) -> None:
        """Block until every request is done; raise its error, or TimeoutError naming the peers."""
        if not self.wait_for(reqs, timeout):
            raise self._timeout_error(reqs, timeout, what)
        self._raise_errors(reqs, what)

    @abstractmethod
    def close(self) -> None:
        """Flush pending sends (bounded) and release sockets and memory."""

    def _timeout_error(self, reqs: Sequence[Request], timeout: float, what: object) -> TimeoutError:
        pending = [r for r in reqs if not r.done]
        return TimeoutError(
            f"rank {self.rank}: {what} timed out after {timeout:g} s over {self.name}; still waiting "
            f"on: {', '.join(r.describe() for r in pending)} (is that rank alive and in the same call?)",
            peers=[r.peer for r in pending])

    @staticmethod
    def _raise_errors(reqs: Sequence[Request], what: object) -> None:
        for r in reqs:
            if isinstance(r.error, PeerError):  # say which call was hit, keep the error type
                raise type(r.error)(f"{what}: {r.error}", r.error.peer) from r.error
            if r.error is not None:
                raise r.error


def deadline_after(timeout: float) -> float:
    """Monotonic deadline `timeout` seconds from now."""
    return time.monotonic() + timeout

"""The view of the world an algorithm gets: its communicator's ranks and tagged p2p on numpy arrays.

Algorithms call only this, so they never see sockets, transports or global rank numbers.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from .ops import ReduceOp, combine, dtype_code
from .transports.base import MsgKey, Request, Transport
from .transports.capabilities import Board, SinkReceive


def byte_view(arr: np.ndarray) -> memoryview:
    """A flat writable-if-possible byte view of a C-contiguous array of any dtype (bfloat16 too)."""
    return memoryview(arr.reshape(-1).view(np.uint8))


class CallName:
    """'allreduce (call 7 on world, rank 1 of 4)': what a call is called in errors, formatted only when
    one is raised (a small collective should not pay for an f-string)."""

    __slots__ = ("collective", "seq", "comm", "rank", "size")

    def __init__(self, collective: str, seq: int, comm: str, rank: int, size: int) -> None:
        self.collective, self.seq, self.comm, self.rank, self.size = collective, seq, comm, rank, size

    def __str__(self) -> str:
        return f"{self.collective} (call {self.seq} on {self.comm}, rank {self.rank} of {self.size})"


class Channel:
    """One collective call on one communicator: rank numbering, message keys, deadline."""

    def __init__(self, transport: Transport, group: Sequence[int], rank: int, comm_id: int,
                 seq: int, timeout: float, what: object, board: Optional[Board] = None) -> None:
        self.transport, self.group, self.rank, self.size = transport, group, rank, len(group)
        self.comm_id, self.seq, self.timeout, self.what = comm_id, seq, timeout, what
        self.board = board  # the communicator's shared-memory board, where it has one
        self._after: Dict[int, Callable[[], None]] = {}  # work to run once a request completes

    def isend(self, arr: np.ndarray, peer: int, tag: int = 0) -> Request:
        """Start sending `arr` to communicator rank `peer`."""
        return self.transport.isend(byte_view(arr), self.group[peer], MsgKey(self.comm_id, self.seq, tag),
                                    dtype_code(arr.dtype))

    def irecv(self, arr: np.ndarray, peer: int, tag: int = 0) -> Request:
        """Post a receive of exactly `arr`'s bytes from communicator rank `peer`."""
        return self.transport.irecv(byte_view(arr), self.group[peer], MsgKey(self.comm_id, self.seq, tag),
                                    dtype_code(arr.dtype))

    def irecv_reduce(self, out: np.ndarray, other: np.ndarray, peer: int, tag: int, op: ReduceOp,
                     scratch: np.ndarray) -> Request:
        """Receive out.size elements from `peer` and leave op(incoming, other) in `out`.

        Where the transport can hand over its wire buffer, the reduction reads it directly (no copy
        into scratch); otherwise the message lands in `scratch` and is reduced in wait().
        """
        key = MsgKey(self.comm_id, self.seq, tag)
        code = dtype_code(out.dtype)
        if self.transport.offers(SinkReceive) is not None:
            size = out.dtype.itemsize

            def sink(piece: memoryview, offset: int) -> None:
                lo, hi = offset // size, (offset + piece.nbytes) // size
                combine(op, np.frombuffer(piece, out.dtype), other[lo:hi], out[lo:hi])
            return self.transport.irecv(byte_view(out), self.group[peer], key, code, sink=sink)
        req = self.transport.irecv(byte_view(scratch), self.group[peer], key, code)
        self._after[id(req)] = lambda: combine(op, scratch, other, out)
        return req

    def wait(self, *reqs: Request) -> None:
        """Wait for the requests within this call's deadline (and finish deferred reductions)."""
        self.transport.wait(reqs, self.timeout, self.what)
        if self._after:
            for r in reqs:
                then = self._after.pop(id(r), None)
                if then is not None:
                    then()

    def board_exchange(self, arr: np.ndarray, sig: int = 0, stage: bool = False) -> Optional[List[np.ndarray]]:
        """Every rank's `arr` (same size and dtype everywhere), in rank order, through the transport's
        shared-memory board (with `stage`, its large stage slots); None where there is none or `arr`
        does not fit its slots (the same on every rank). `sig` says what the call is (collective, op,
        root): a rank whose peers posted another size, dtype or signature raises ProtocolError. The
        arrays view shared memory: read them before this communicator's next call but one."""
        board = self.board
        if board is None or arr.nbytes > (board.stage_bytes if stage else board.slot_bytes):
            return None
        return board.exchange(arr.reshape(-1), sig << 16 | dtype_code(arr.dtype), self.group, self.timeout,
                              self.what, stage)

    def stage_bytes(self) -> int:
        """What one stage slot of this communicator's board holds (0: no board, or no stage)."""
        return self.board.stage_bytes if self.board is not None else 0

    def sendrecv(self, send: np.ndarray, dst: int, recv: np.ndarray, src: int, tag: int = 0) -> None:
        """Exchange in one step: post the receive first so the peer's send lands directly."""
        reqs: List[Request] = [self.irecv(recv, src, tag), self.isend(send, dst, tag)]
        self.wait(*reqs)

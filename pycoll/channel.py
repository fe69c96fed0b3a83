"""The view of the world an algorithm gets: its communicator's ranks and tagged p2p on numpy arrays.

Algorithms call only this, so they never see sockets, transports or global rank numbers.
"""
from __future__ import annotations

from typing import List, Sequence

import numpy as np

from .ops import dtype_code
from .transports.base import MsgKey, Request, Transport


def byte_view(arr: np.ndarray) -> memoryview:
    """A flat writable-if-possible byte view of a C-contiguous array of any dtype (bfloat16 too)."""
    return memoryview(arr.reshape(-1).view(np.uint8))


class Channel:
    """One collective call on one communicator: rank numbering, message keys, deadline."""

    def __init__(self, transport: Transport, group: Sequence[int], rank: int, comm_id: int,
                 seq: int, timeout: float, what: str) -> None:
        self.transport, self.group, self.rank, self.size = transport, group, rank, len(group)
        self.comm_id, self.seq, self.timeout, self.what = comm_id, seq, timeout, what

    def isend(self, arr: np.ndarray, peer: int, tag: int = 0) -> Request:
        """Start sending `arr` to communicator rank `peer`."""
        return self.transport.isend(byte_view(arr), self.group[peer], MsgKey(self.comm_id, self.seq, tag),
                                    dtype_code(arr.dtype))

    def irecv(self, arr: np.ndarray, peer: int, tag: int = 0) -> Request:
        """Post a receive of exactly `arr`'s bytes from communicator rank `peer`."""
        return self.transport.irecv(byte_view(arr), self.group[peer], MsgKey(self.comm_id, self.seq, tag),
                                    dtype_code(arr.dtype))

    def wait(self, *reqs: Request) -> None:
        """Wait for the requests within this call's deadline."""
        self.transport.wait(reqs, self.timeout, self.what)

    def sendrecv(self, send: np.ndarray, dst: int, recv: np.ndarray, src: int, tag: int = 0) -> None:
        """Exchange in one step: post the receive first so the peer's send lands directly."""
        reqs: List[Request] = [self.irecv(recv, src, tag), self.isend(send, dst, tag)]
        self.wait(*reqs)

"""The view of the world an algorithm gets: its communicator's ranks and tagged p2p on numpy arrays.

Algorithms call only this, so they never see sockets, transports or global rank numbers.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .errors import ProtocolError
from .ops import DTYPE_CODES, ReduceOp, combine, dtype_code
from .scratch import Lent, Shape
from .transports.base import MsgKey, Request, Transport
from .transports.capabilities import Board, PeerMemory, SinkReceive

if TYPE_CHECKING:
    from .windows import Registry


def byte_view(arr: np.ndarray) -> memoryview:
    """A flat writable-if-possible byte view of a C-contiguous array of any dtype (bfloat16 too)."""
    return memoryview(arr.reshape(-1).view(np.uint8))


class Channel:
    """One collective call on one communicator: rank numbering, message keys, deadline."""

    __slots__ = ("transport", "group", "rank", "size", "comm_id", "seq", "timeout", "_what", "board", "windows",
                 "_after", "_call", "_comm", "mark", "prepared")

    def __init__(self, transport: Transport, group: Sequence[int], rank: int, comm_id: int,
                 seq: int, timeout: float, what: object, board: Optional[Board] = None,
                 windows: Optional["Registry"] = None, call: str = "", comm: str = "", mark: int = 0) -> None:
        # (positional or keyword: Communicator.channel() makes one per call and passes them by position,
        # which costs half what keywords do)
        self.transport, self.group, self.rank, self.size = transport, group, rank, len(group)
        self.comm_id, self.seq, self.timeout, self._what = comm_id, seq, timeout, what
        # bits 8-15 of the dtype code of every message and board post of the call: a persistent handle's
        # mark (persistent.py), 0 for a plain call; a receiver whose own differs fails with ProtocolError
        self.mark = mark
        # a persistent handle's channel runs the same call again and again: its board posts prepared
        # once (board_exchange), by array id: (array, sig, stage, hole, prepared exchange or None, seen
        # once); None for a plain call's
        self.prepared: Optional[Dict[int, tuple]] = None
        self.board = board  # the communicator's shared-memory board, where it has one
        self.windows = windows  # the communicator's registered buffers, where it can have them
        self._after: Optional[Dict[int, Callable[[], None]]] = None  # work to run once a request completes
        self._call, self._comm = call, comm  # what None: the collective and communicator names the call

    @property
    def what(self) -> object:
        """What the call is called in errors (its str()): the text it was made with, or, for a
        communicator's call, the channel itself, 'allreduce (call 7 on world, rank 1 of 4)',
        formatted only when an error is raised (a small collective should not pay for an f-string)."""
        return self if self._what is None else self._what

    def __str__(self) -> str:
        if self._what is not None:
            return str(self._what)
        return f"{self._call} (call {self.seq} on {self._comm}, rank {self.rank} of {self.size})"

    def derive(self, *, group: Optional[Sequence[int]] = None, rank: Optional[int] = None,
               comm_id: Optional[int] = None, seq: Optional[int] = None, what: Optional[object] = None
               ) -> "Channel":
        """A new Channel on the same transport and deadline with the given fields replaced (a
        sub-group, another communicator id): how algorithms and checks open side channels. It has
        no board: a board serves only its own communicator's calls. It keeps the call's mark."""
        return Channel(transport=self.transport, group=self.group if group is None else group,
                       rank=self.rank if rank is None else rank,
                       comm_id=self.comm_id if comm_id is None else comm_id,
                       seq=self.seq if seq is None else seq, timeout=self.timeout,
                       what=self.what if what is None else what, mark=self.mark)

    def isend(self, arr: np.ndarray, peer: int, tag: int = 0) -> Request:
        """Start sending `arr` to communicator rank `peer`."""
        return self.transport.isend(byte_view(arr), self.group[peer], MsgKey(self.comm_id, self.seq, tag),
                                    dtype_code(arr.dtype) | self.mark)

    def irecv(self, arr: np.ndarray, peer: int, tag: int = 0) -> Request:
        """Post a receive of exactly `arr`'s bytes from communicator rank `peer`."""
        return self.transport.irecv(byte_view(arr), self.group[peer], MsgKey(self.comm_id, self.seq, tag),
                                    dtype_code(arr.dtype) | self.mark)

    def irecv_reduce(self, out: np.ndarray, other: np.ndarray, peer: int, tag: int, op: ReduceOp,
                     scratch: np.ndarray) -> Request:
        """Receive out.size elements from `peer` and leave op(incoming, other) in `out`.

        Where the transport can hand over its wire buffer, the reduction reads it directly (no copy
        into scratch); otherwise the message lands in `scratch` and is reduced in wait().
        """
        key = MsgKey(self.comm_id, self.seq, tag)
        code = dtype_code(out.dtype) | self.mark
        if self.transport.offers(SinkReceive) is not None:
            size = out.dtype.itemsize

            def sink(piece: memoryview, offset: int) -> None:
                lo, hi = offset // size, (offset + piece.nbytes) // size
                combine(op, np.frombuffer(piece, out.dtype), other[lo:hi], out[lo:hi])
            return self.transport.irecv(byte_view(out), self.group[peer], key, code, sink=sink)
        req = self.transport.irecv(byte_view(scratch), self.group[peer], key, code)
        if self._after is None:
            self._after = {}
        self._after[id(req)] = lambda: combine(op, scratch, other, out)
        return req

    def scratch(self, shape: Shape, dtype: object) -> Lent:
        """`with ch.scratch(shape, dtype) as tmp:` an uninitialised array for the algorithm's own use
        within the block, from the transport's pool of scratch buffers (pycoll/scratch.py): kept for
        later calls when the block ends, never shared with another call while lent. Never a result."""
        return Lent(getattr(self.transport, "scratch", None), shape, dtype)

    def wait(self, *reqs: Request) -> None:
        """Wait for the requests within this call's deadline (and finish deferred reductions)."""
        self.transport.wait(reqs, self.timeout, self.what)
        if self._after:
            for r in reqs:
                then = self._after.pop(id(r), None)
                if then is not None:
                    then()

    def board_exchange(self, arr: np.ndarray, sig: int = 0, stage: bool = False,
                       hole: Tuple[int, int] = (0, 0)) -> Optional[List[np.ndarray]]:
        """Every rank's `arr` (same size and dtype everywhere), in rank order, through the transport's
        shared-memory board (with `stage`, its large stage slots); None where there is none or `arr`
        does not fit its slots (the same on every rank). `sig` says what the call is (collective, op,
        root): a rank whose peers posted another size, dtype or signature raises ProtocolError. The
        arrays view shared memory: read them before this communicator's next call but one. Elements
        [hole[0], hole[1]) of `arr` are not posted: this rank writes them into its own view itself."""
        prepared = self.prepared
        if prepared is not None:  # a persistent handle's: its arrays' exchanges prepared
            e = prepared.get(id(arr))
            if e is not None and e[4] is not None and e[0] is arr and e[1] == sig and e[2] == stage and e[3] == hole:
                return e[4](self.timeout, self if self._what is None else self._what)
        board = self.board
        if board is None or arr.nbytes > (board.stage_bytes if stage else board.slot_bytes):
            return None
        if prepared is not None:
            return self._prepared_exchange(board, arr, sig, stage, hole)
        return board.exchange(arr if arr.ndim == 1 else arr.reshape(-1),  # flat(arr) and dtype_code() inlined
                              sig << 16 | (DTYPE_CODES.get(arr.dtype) or dtype_code(arr.dtype)) | self.mark,
                              self.group, self.timeout, self.what, stage, hole)

    def _prepared_exchange(self, board: Board, arr: np.ndarray, sig: int, stage: bool, hole: Tuple[int, int]
                           ) -> List[np.ndarray]:
        """board_exchange on a persistent handle's channel: an array posted the second time with the
        same signature gets its exchange prepared (Board.prepare) and reused from then on (an array
        posted once, as a barrier's, is not worth preparing). The memo holds each array it keys, so
        no other array can take its id."""
        memo = self.prepared
        e = memo.get(id(arr))  # type: ignore[union-attr]
        if e is not None and e[0] is arr and e[1] == sig and e[2] == stage and e[3] == hole:
            if e[5]:  # seen once: prepare it now (None where the board cannot: exchange() each time)
                go = board.prepare(arr if arr.ndim == 1 else arr.reshape(-1),
                                   sig << 16 | dtype_code(arr.dtype) | self.mark, self.group, stage, hole)
                memo[id(arr)] = (arr, sig, stage, hole, go, False)  # type: ignore[index]
                if go is not None:
                    return go(self.timeout, self.what)
        else:
            if len(memo) >= 8:  # type: ignore[arg-type]
                memo.clear()  # type: ignore[union-attr]
            memo[id(arr)] = (arr, sig, stage, hole, None, True)  # type: ignore[index]
        return board.exchange(arr if arr.ndim == 1 else arr.reshape(-1),
                              sig << 16 | dtype_code(arr.dtype) | self.mark, self.group, self.timeout, self.what,
                              stage, hole)

    def symmetric(self, arrays: Sequence[np.ndarray], sig: int) -> Optional[List[List[np.ndarray]]]:
        """Every rank's copy of each of `arrays`, read in place in its registered buffer: [array][rank].
        None (on every rank alike: the ranks agree over the board, one synchronisation) unless every
        rank's `arrays` all lie in registered buffers of this communicator. `sig` says what the call
        is, as for board_exchange; ProtocolError if the ranks' arrays differ in size or dtype."""
        windows = self.windows
        if windows is None or not windows.used or self.board is None:
            return None
        post = np.empty((len(arrays), 4), np.int64)
        for i, arr in enumerate(arrays):
            where = windows.find(arr)
            post[i] = (-1, 0, arr.nbytes, dtype_code(arr.dtype)) if where is None else \
                (where[0], where[1], arr.nbytes, dtype_code(arr.dtype))
        posts = self.board_exchange(post, sig)
        assert posts is not None  # a few words always fit a board slot
        table = np.stack(posts).reshape(self.size, len(arrays), 4)
        bad = np.nonzero((table[:, :, 2:] != post[None, :, 2:]).any(axis=(1, 2)))[0]
        if bad.size:
            p = int(bad[0])
            raise ProtocolError(f"{self.what}: rank {self.rank}: rank {p} passed {table[p, :, 2].tolist()} bytes "
                                f"of dtype codes {table[p, :, 3].tolist()}, this rank {post[:, 2].tolist()} of "
                                f"{post[:, 3].tolist()}; every rank must pass the same sizes and dtypes",
                                self.group[p])
        if (table[:, :, 0] < 0).any():
            return None
        return [[windows.view(m, int(table[m, i, 0]), int(table[m, i, 1]), arr) for m in range(self.size)]
                for i, arr in enumerate(arrays)]

    def reaches_peer_memory(self) -> bool:
        """Whether this rank can copy straight to and from every member's own memory (cross-memory
        attach, on one host with a board): peer_read and peer_write work."""
        memory = self.transport.offers(PeerMemory)
        return memory is not None and self.board is not None and memory.reaches(self.group)

    def peer_read(self, peer: int, address: int, into: np.ndarray) -> None:
        """Copy into.nbytes bytes at `address` in communicator rank `peer`'s memory into `into`."""
        self.transport.offers(PeerMemory).read(self.group[peer], address, into)

    def peer_write(self, peer: int, address: int, data: np.ndarray) -> None:
        """Copy `data` to `address` in communicator rank `peer`'s memory."""
        self.transport.offers(PeerMemory).write(self.group[peer], address, data)

    def stage_bytes(self) -> int:
        """What one stage slot of this communicator's board holds (0: no board, or no stage)."""
        return self.board.stage_bytes if self.board is not None else 0

    def sendrecv(self, send: np.ndarray, dst: int, recv: np.ndarray, src: int, tag: int = 0) -> None:
        """Exchange in one step: post the receive first so the peer's send lands directly."""
        reqs: List[Request] = [self.irecv(recv, src, tag), self.isend(send, dst, tag)]
        self.wait(*reqs)

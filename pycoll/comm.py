"""Communicator: validates arguments, numbers each call, and runs an algorithm on a Channel."""
from __future__ import annotations

import hashlib
import itertools
import threading
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np

from .algorithms import barrier as barrier_algo
from .algorithms import ring
from .bootstrap.rendezvous import Membership
from .bootstrap.store import Store
from .buffers import as_array, flat
from .channel import Channel, byte_view
from .ops import AVG, ReduceOp, as_op, check_op, dtype_code, finish_avg
from .transports.base import MsgKey, Transport
from .work import Work, Worker

P2P_SEQ = 0  # point-to-point messages use call number 0; collectives count from 1


def comm_hash(name: str) -> int:
    """A 64-bit communicator id every rank derives from the same name."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


class Communicator:
    """A group of ranks that run collectives together (MPI communicator / torch process group)."""

    def __init__(self, transport: Transport, group: Sequence[int], rank: int, name: str,
                 membership: Membership, timeout: float, store: Optional[Store] = None,
                 owns_transport: bool = False) -> None:
        self.transport, self.group, self.name = transport, list(group), name
        self._rank, self.timeout, self.store = rank, timeout, store
        self.comm_id = comm_hash(name)
        self.membership = membership
        self._owns_transport = owns_transport
        self._seq = itertools.count(1)
        self._seq_lock = threading.Lock()
        self._worker: Optional[Worker] = None
        self._inflight = 0
        self._closed = False

    # -- identity ---------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's rank in the communicator."""
        return self._rank

    @property
    def size(self) -> int:
        """Number of ranks in the communicator."""
        return len(self.group)

    @property
    def local_rank(self) -> int:
        """Rank among the communicator's ranks on this host."""
        return self.membership.local_rank

    @property
    def local_size(self) -> int:
        """How many of the communicator's ranks share this host."""
        return self.membership.local_size

    def __repr__(self) -> str:
        return f"<pycoll.Communicator {self.name} rank {self.rank}/{self.size} over {self.transport.name}>"

    # -- running calls ----------------------------------------------------------------------------
    def _run(self, collective: str, body: Callable[[Channel], Any], async_op: bool,
             timeout: Optional[float]) -> Any:
        self._check_open(collective)
        with self._seq_lock:
            ch = self.channel(collective, timeout)
            busy = self._inflight > 0
            if async_op or busy:  # behind queued async work, blocking calls queue too: call order holds
                self._inflight += 1
        if not (async_op or busy):
            return body(ch)
        work = self._submit(ch.what, lambda: body(ch))
        return work if async_op else work.result()

    def channel(self, collective: str, timeout: Optional[float] = None) -> Channel:
        """A Channel for the next call number: what an algorithm runs on (all ranks must call in order)."""
        seq = next(self._seq)
        what = f"{collective} (call {seq} on {self.name}, rank {self.rank} of {self.size})"
        return Channel(self.transport, self.group, self.rank, self.comm_id, seq,
                       self.timeout if timeout is None else timeout, what)

    def _submit(self, what: str, fn: Callable[[], Any]) -> Work:
        if self._worker is None:
            self._worker = Worker(f"pycoll-{self.name}")

        def tracked() -> Any:
            try:
                return fn()
            finally:
                with self._seq_lock:
                    self._inflight -= 1
        return self._worker.submit(what, tracked)

    def _check_open(self, call: str) -> None:
        if self._closed:
            raise RuntimeError(f"rank {self.rank}: {call} on {self.name} after close()")

    def _peer(self, peer: int, role: str, call: str) -> int:
        if not isinstance(peer, (int, np.integer)) or not 0 <= peer < self.size:
            raise ValueError(f"rank {self.rank}: {call} {role}={peer!r} is not a rank of {self.name} "
                             f"(0..{self.size - 1})")
        return int(peer)

    # -- collectives ------------------------------------------------------------------------------
    def allreduce(self, x: Any, out: Any = None, op: Union[ReduceOp, str] = ReduceOp.SUM, *,
                  async_op: bool = False, timeout: Optional[float] = None) -> Any:
        """Reduce `x` across all ranks; the result lands in `out` (or in `x` itself) on every rank."""
        op = as_op(op)
        src = as_array(x, "x", writable=out is None)
        check_op(op, src.dtype)
        dst = src
        if out is not None:
            dst = as_array(out, "out")
            if dst.dtype != src.dtype or dst.size != src.size:
                raise ValueError(f"rank {self.rank}: allreduce out= has {dst.size} x {dst.dtype}, "
                                 f"x has {src.size} x {src.dtype}; they must match")

        def body(ch: Channel) -> Any:
            if dst is not src:
                np.copyto(dst.reshape(-1), src.reshape(-1))
            ring.allreduce(ch, flat(dst), op)
            if op is AVG:
                finish_avg(dst, ch.size)
            return x if out is None else out
        return self._run("allreduce", body, async_op, timeout)

    def barrier(self, *, async_op: bool = False, timeout: Optional[float] = None) -> Any:
        """Return once every rank has called barrier."""
        return self._run("barrier", barrier_algo.barrier, async_op, timeout)

    # -- point to point ---------------------------------------------------------------------------
    def send(self, x: Any, dst: int, tag: int = 0, *, timeout: Optional[float] = None) -> None:
        """Send `x` to rank `dst`; matched by (source, tag) in order, like MPI_Send."""
        self._check_open("send")
        arr = as_array(x, "x", writable=False)
        dtype_code(arr.dtype)
        peer = self._peer(dst, "dst", "send")
        req = self.transport.isend(byte_view(arr), self.group[peer],
                                   self._p2p_key(tag, "send"), dtype_code(arr.dtype))
        self.transport.wait([req], self.timeout if timeout is None else timeout,
                            f"send to rank {peer} tag {tag} on {self.name}")

    def recv(self, x: Any, src: int, tag: int = 0, *, timeout: Optional[float] = None) -> Any:
        """Receive exactly `x`'s size and dtype from rank `src` into `x`; returns `x`."""
        self._check_open("recv")
        arr = as_array(x, "x")
        peer = self._peer(src, "src", "recv")
        req = self.transport.irecv(byte_view(arr), self.group[peer],
                                   self._p2p_key(tag, "recv"), dtype_code(arr.dtype))
        self.transport.wait([req], self.timeout if timeout is None else timeout,
                            f"recv from rank {peer} tag {tag} on {self.name}")
        return x

    def _p2p_key(self, tag: int, call: str) -> MsgKey:
        if not isinstance(tag, (int, np.integer)) or not 0 <= tag < 2 ** 62:
            raise ValueError(f"rank {self.rank}: {call} tag={tag!r} must be an integer in 0..2**62-1")
        return MsgKey(self.comm_id, P2P_SEQ, int(tag))

    # -- lifetime ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Finish queued work and release the transport (if this communicator owns it)."""
        if self._closed:
            return
        self._closed = True
        if self._worker is not None:
            self._worker.close()
        if self._owns_transport:
            self.transport.close()
            if self.store is not None:
                self.store.close()

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

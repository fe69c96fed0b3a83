"""Raw TCP streams beside zmq for large payloads, read straight into the posted buffer.

zmq hands every received message over in a freshly allocated frame, so a large message costs a
page-faulting allocation plus a copy into the user's buffer. Here each pair of ranks shares one
authenticated, nonblocking TCP stream (as Gloo's pairs do): payloads are written from the
user's buffer and read with recv_into into the user's buffer (or a reused scratch buffer), with
only the kernel's copy each way. The stream carries payload bytes only; what they belong to is
announced, in order, on the zmq channel, so matching stays in one place (tcp.py).
"""
from __future__ import annotations

import ipaddress
import logging
import secrets
import select
import socket
import threading
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional

from ..errors import PeerError, TimeoutError
from ..logutil import RateLimitedLog
from . import wire

log = logging.getLogger("pycoll.tcp")

_CHUNK = 1 << 22  # bytes per send/recv call: keeps one peer from starving the others
STREAM_CHUNK = 1 << 19  # a consumed payload is handed over in pieces this big, while still in cache
_ALIGN = 16  # pieces start at multiples of every dtype's itemsize


def same_host(sock: socket.socket) -> bool:
    """Both ends of a connected stream on this machine: a loopback peer, or our own address."""
    local, peer = sock.getsockname()[0], sock.getpeername()[0]
    return local == peer or ipaddress.ip_address(peer).is_loopback


class Outgoing:
    """A payload queued on a stream; `on_done(error)` runs once the kernel has all of it."""

    __slots__ = ("view", "sent", "on_done")

    def __init__(self, view: memoryview, on_done: Callable[[Optional[BaseException]], None]) -> None:
        self.view, self.sent, self.on_done = view, 0, on_done


Consume = Callable[[memoryview, int], None]  # (piece, byte offset of the piece in the payload)


class Incoming:
    """An announced payload of `nbytes`: it lands in `target`, or, with `consume`, passes through a
    small per-stream buffer piece by piece; `on_done(error)` runs once all of it is in. Until one
    of the two is set (the payload is claimed) the stream is not read past it."""

    __slots__ = ("nbytes", "target", "consume", "got", "fill", "on_done", "since", "owner")

    def __init__(self, nbytes: int, on_done: Callable[[Optional[BaseException]], None]) -> None:
        self.nbytes, self.on_done = nbytes, on_done
        self.target: Optional[memoryview] = None
        self.consume: Optional[Consume] = None
        self.got = 0   # bytes placed in target, or handed to consume
        self.fill = 0  # bytes waiting in the stream buffer (consume only)
        self.since = time.monotonic()  # announced at
        self.owner: Any = None  # the transport's bookkeeping

    @property
    def claimed(self) -> bool:
        return self.target is not None or self.consume is not None


class BulkLinks:
    """One raw stream per peer: connect/authenticate, then nonblocking writes and reads in FIFO order."""

    def __init__(self, rank: int, size: int, address: str, buffer_bytes: int = 0, local_sndbuf: int = 0,
                 on_broken: Callable[[int, str], None] = lambda peer, why: None) -> None:
        """`buffer_bytes`: SO_SNDBUF and SO_RCVBUF of every stream (0: autotuning); `local_sndbuf`:
        SO_SNDBUF of the streams to ranks on this host, when `buffer_bytes` is 0 (0: autotuning);
        `on_broken(peer, why)` runs when a peer's stream breaks (nothing new may use it)."""
        self.rank, self.size, self._buffer_bytes, self._local_sndbuf = rank, size, buffer_bytes, local_sndbuf
        self._on_broken = on_broken
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind((address, 0))
        self._listener.listen(max(8, size))
        self.endpoint = f"{address}:{self._listener.getsockname()[1]}"
        self.socks: Dict[int, socket.socket] = {}
        self._out: Dict[int, Deque[Outgoing]] = {}
        self._in: Dict[int, Deque[Incoming]] = {}
        self._out_locks: Dict[int, threading.RLock] = {}
        self._pieces: Dict[int, memoryview] = {}  # per stream: where consumed payloads pass through
        self.closed_by: Dict[int, str] = {}  # peers whose stream ended -> why
        self.local: List[int] = []  # peers on this host, whose streams got `local_sndbuf`
        self.rejected = 0
        self._seen: set = set()  # nonces of hellos accepted: a captured hello replayed is turned away
        self.rejects = RateLimitedLog(log, f"rank {rank}: tcp bulk streams: rejected connections")

    # -- set-up --------------------------------------------------------------------------------
    def establish(self, endpoints: Dict[int, str], token: bytes, deadline: float) -> None:
        """Connect to every lower rank, accept every higher one; each side proves the job token."""
        for peer in sorted(p for p in endpoints if p < self.rank):
            host, port = endpoints[peer].rsplit(":", 1)
            sock = socket.create_connection((host, int(port)), timeout=max(0.1, deadline - time.monotonic()))
            self._send_hello(sock, token, peer)
            self._expect_hello(sock, token, peer, deadline)
            self._adopt(peer, sock)
        waiting = {p for p in endpoints if p > self.rank}
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"rank {self.rank}: tcp bulk streams from ranks {sorted(waiting)} did "
                                   "not connect in time", peers=sorted(waiting))
            self._listener.settimeout(min(left, 1.0))
            try:
                sock, _ = self._listener.accept()
            except socket.timeout:
                continue
            try:
                peer = self._expect_hello(sock, token, None, min(deadline, time.monotonic() + 5.0))
            except (ValueError, OSError, TimeoutError) as e:
                self.rejected += 1  # a stranger or garbage on the listening port
                self.rejects.warning("rank %d: tcp bulk stream: rejected a connection: %s", self.rank, e)
                sock.close()
                continue
            if peer not in waiting:
                self.rejected += 1
                self.rejects.warning("rank %d: tcp bulk stream: rejected a second hello from rank %d",
                                     self.rank, peer)
                sock.close()
                continue
            self._send_hello(sock, token, peer)
            waiting.discard(peer)
            self._adopt(peer, sock)
        self._listener.close()  # nothing listens once the job is wired up

    def _send_hello(self, sock: socket.socket, token: bytes, peer: int) -> None:
        sock.sendall(wire.make_hello(token, self.rank, peer, secrets.token_bytes(16), wire.BULK_PURPOSE))

    def _expect_hello(self, sock: socket.socket, token: bytes, peer: Optional[int], deadline: float) -> int:
        data = bytearray()
        while len(data) < wire.HELLO.size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"rank {self.rank}: no bulk-stream hello within the deadline")
            sock.settimeout(left)
            chunk = sock.recv(wire.HELLO.size - len(data))
            if not chunk:
                raise ValueError("connection closed during the hello")
            data += chunk
        src = wire.check_hello(token, self.rank, bytes(data), seen=self._seen, purpose=wire.BULK_PURPOSE)
        if peer is not None and src != peer:
            raise PeerError(f"rank {self.rank}: bulk stream to rank {peer} answered as rank {src}", peer)
        if not 0 <= src < self.size or src == self.rank:
            raise ValueError(f"bulk hello from rank {src}")
        return src

    def _adopt(self, peer: int, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._buffer_bytes:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._buffer_bytes)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self._buffer_bytes)
        elif self._local_sndbuf and same_host(sock):
            # A software path (loopback) delivers a packet on the CPU that sent it. Data left queued
            # by a full window goes out when the ACK comes, from the peer's CPU, and can overtake
            # what still waits on ours: reordering, spurious retransmits. A send buffer no bigger than
            # the window keeps every write on the writer's CPU (64 MiB allreduce, 2 / 4 ranks: 42 / 117 ms
            # against 49 / 148 ms with autotuning).
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._local_sndbuf)
            self.local.append(peer)
        sock.setblocking(False)
        self.socks[peer] = sock
        self._out[peer], self._in[peer] = deque(), deque()
        self._out_locks[peer] = threading.RLock()

    # -- sending ---------------------------------------------------------------------------------
    def send(self, peer: int, item: Outgoing) -> bool:
        """Queue a payload and write what the kernel takes now; True if some of it is still queued."""
        with self._out_locks[peer]:
            queue = self._out[peer]
            queue.append(item)
            if len(queue) == 1:
                self._write(peer, queue)
            return bool(queue)

    def flush(self, peer: int) -> None:
        """Write what the kernel takes of the peer's queue (the stream polled writable)."""
        with self._out_locks[peer]:
            self._write(peer, self._out[peer])

    def wants_write(self, peer: int) -> bool:
        return bool(self._out[peer])

    def _write(self, peer: int, queue: Deque[Outgoing]) -> None:
        sock = self.socks[peer]
        while queue:
            item = queue[0]
            try:
                n = sock.send(item.view[item.sent:item.sent + _CHUNK])
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # any thread may write: fail the sends only, the reader fails the rest
                self._broke(peer, f"its bulk stream broke while sending ({e})")
                self._fail_out(peer, PeerError(f"rank {self.rank}: rank {peer} {self.closed_by[peer]}", peer))
                return
            item.sent += n
            if item.sent == item.view.nbytes:
                queue.popleft()
                item.on_done(None)

    # -- receiving -------------------------------------------------------------------------------
    def expect(self, peer: int, item: Incoming) -> None:
        """The next `item.nbytes` bytes on the peer's stream belong to `item` (io lock held)."""
        self._in[peer].append(item)

    def wants_read(self, peer: int) -> bool:
        queue = self._in[peer]
        return bool(queue) and queue[0].claimed

    def unclaimed_heads(self) -> List[Incoming]:
        """Payloads at the head of their stream that nobody has claimed yet (io lock held)."""
        return [q[0] for q in self._in.values() if q and not q[0].claimed]

    def read(self, peer: int) -> None:
        """Read what has arrived into the announced payloads, completing them in order (io lock held)."""
        sock, queue = self.socks[peer], self._in[peer]
        while queue and queue[0].claimed:
            item = queue[0]
            try:
                n = self._read_into(peer, sock, item)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self.fail(peer, f"its bulk stream broke while receiving ({e})")
                return
            if n == 0 and item.got < item.nbytes:
                self.fail(peer, "its bulk stream closed in the middle of a message")
                return
            if item.got == item.nbytes:
                queue.popleft()
                item.on_done(None)

    def _read_into(self, peer: int, sock: socket.socket, item: Incoming) -> int:
        """One recv for `item`; a consumed payload is handed over in aligned pieces as they fill."""
        if item.consume is None:
            want = min(item.nbytes - item.got, _CHUNK)
            n = sock.recv_into(item.target[item.got:item.got + want], want) if want else 0
            item.got += n
            return n
        buf = self._pieces.get(peer)
        if buf is None:
            buf = self._pieces[peer] = memoryview(bytearray(STREAM_CHUNK + _ALIGN))
        room = min(STREAM_CHUNK + _ALIGN - item.fill, item.nbytes - item.got - item.fill)
        n = sock.recv_into(buf[item.fill:item.fill + room], room) if room else 0
        item.fill += n
        last = item.got + item.fill == item.nbytes
        if last or item.fill >= STREAM_CHUNK:
            usable = item.fill if last else item.fill - item.fill % _ALIGN
            item.consume(buf[:usable], item.got)
            item.got += usable
            item.fill -= usable
            buf[:item.fill] = buf[usable:usable + item.fill]
        return n

    def fail(self, peer: int, why: str) -> None:
        """The peer's stream is unusable: fail everything queued on it, both ways (io lock held)."""
        self._broke(peer, why)
        err = PeerError(f"rank {self.rank}: rank {peer} {why}", peer)
        pending = list(self._in[peer])
        self._in[peer].clear()
        for item in pending:
            item.on_done(err)
        self._fail_out(peer, err)

    def _broke(self, peer: int, why: str) -> None:
        self.closed_by.setdefault(peer, why)
        self._on_broken(peer, self.closed_by[peer])

    def _fail_out(self, peer: int, err: PeerError) -> None:
        with self._out_locks[peer]:
            pending = list(self._out[peer])
            self._out[peer].clear()
        for item in pending:
            item.on_done(err)

    # -- teardown --------------------------------------------------------------------------------
    def drain_sends(self, deadline: float) -> None:
        """Write out queued payloads before closing, until `deadline`."""
        for peer, sock in self.socks.items():
            while self._out[peer] and peer not in self.closed_by and time.monotonic() < deadline:
                select.select([], [sock], [], max(0.0, min(0.1, deadline - time.monotonic())))
                self.flush(peer)

    def close(self) -> None:
        try:
            self._listener.close()
        except OSError:
            pass
        for sock in self.socks.values():
            sock.close()
        self.socks.clear()


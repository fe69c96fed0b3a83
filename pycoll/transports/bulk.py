"""Raw TCP streams per pair of ranks: the frames of their messages, and large payloads read in place.

zmq hands every received message over in a freshly allocated frame, after two thread hand-offs
(its I/O threads), so a small message costs wake-ups and a large one a page-faulting allocation
plus a copy. Here each pair of ranks shares one or more authenticated, nonblocking TCP streams
(one, as Gloo's pairs; several, as NCCL's NCCL_NSOCKS_PERTHREAD, where the network caps each flow
below the link). With frames on (the transport's on_frame), stream 0 carries every message between
the two in order: a frame is a wire header, then a data payload, or (KIND_BULK) the cut of a
payload that follows in parts, each on one stream of the pair (its Layout): a part starts at a
known offset of the payload, so the receiver reads it straight to its place, and each stream stays
FIFO: the parts on it come in the order of the announcements. Stream 0 is read whenever frames come
(read ahead into a small buffer, several frames per recv; a frame cut by a read waits for the rest),
up to a payload nobody has claimed yet, which holds the stream until it is claimed (read into the
posted buffer, with only the kernel's copy) or read aside. Writes go straight into the socket from
the sending thread when nothing waits before them, else queue and are flushed by whichever thread
drives. Matching stays in one place (tcp.py).
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
from typing import Any, Callable, Deque, Dict, List, NamedTuple, Optional, Set, Tuple

from ..errors import EnvError, PeerError, TimeoutError
from ..logutil import RateLimitedLog
from . import wire

log = logging.getLogger("pycoll.tcp")

_CHUNK = 1 << 22  # bytes per send/recv call: keeps one peer from starving the others
STREAM_CHUNK = 1 << 19  # a consumed payload is handed over in pieces this big, while still in cache
_ALIGN = 16  # pieces start at multiples of every dtype's itemsize
_PART_ALIGN = 1 << 12  # parts of a striped payload start at multiples of this (so of _ALIGN)
_FRAME_BUF = 1 << 16  # bytes stream 0 reads ahead per recv while frames are next (several small ones at once)
_LAYOUT_SIZE = wire.HEADER.size + wire.LAYOUT.size  # a bulk announcement: header, then its cut


def same_host(sock: socket.socket) -> bool:
    """Both ends of a connected stream on this machine: a loopback peer, or our own address."""
    local, peer = sock.getsockname()[0], sock.getpeername()[0]
    return local == peer or ipaddress.ip_address(peer).is_loopback


def congestion_of(sock: socket.socket) -> str:
    """The TCP congestion control a stream uses now (Linux)."""
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).split(b"\0")[0].decode()


def apply_congestion(sock: socket.socket, wanted: str) -> str:
    """Give a stream to another host the congestion control PYCOLL_TCP_CC asks for; returns the one
    in use. `auto` replaces only bbr, whose first version ignores loss: a collective's several flows
    at once into a shallow-buffered link keep overrunning it (emulated 4 hosts x 2 ranks, 100 Mbit/s,
    8 MiB allreduce: 3,000-12,000 retransmitted segments and RTO stalls per 10 calls, 1.14-1.39x
    the link-rate bound; with cubic 1.01-1.02x). An explicit name the kernel refuses is an error."""
    if not hasattr(socket, "TCP_CONGESTION"):  # a kernel with no per-socket choice (not Linux)
        if wanted in ("auto", "system"):
            return ""
        raise EnvError(f"PYCOLL_TCP_CC={wanted}: this platform cannot set a stream's congestion control")
    current = congestion_of(sock)
    if wanted == "system" or (wanted == "auto" and current != "bbr"):
        return current
    choices = ("cubic", "reno") if wanted == "auto" else (wanted,)
    for name in choices:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
            return name
        except OSError as e:
            refused = e
    if wanted == "auto":
        return current
    raise EnvError(f"PYCOLL_TCP_CC={wanted}: the kernel refused it for a stream to {sock.getpeername()[0]} "
                   f"({refused.strerror}); see /proc/sys/net/ipv4/tcp_available_congestion_control (and "
                   f"tcp_allowed_congestion_control, for a user without CAP_NET_ADMIN), or set auto / system")


class Layout(NamedTuple):
    """How a payload is cut: `parts` parts, part i on stream (first + i) % width of the pair."""

    parts: int
    first: int
    width: int

    def streams(self) -> List[int]:
        return [(self.first + i) % self.width for i in range(self.parts)]


ONE_STREAM = Layout(1, 0, 1)
OnFrame = Callable[[int, wire.Header, Optional[Layout], Optional[memoryview]], None]
"""on_frame(peer, header, layout, payload): a frame came on the peer's stream 0. A bulk announcement
has its `layout`; a data frame whose payload was read with it has `payload` (valid during the call
only), else the payload is next on the stream and on_frame must expect() it, claimed."""


def split(nbytes: int, parts: int) -> List[Tuple[int, int]]:
    """(offset, length) of the parts of a payload cut in `parts`: equal, rounded up to _PART_ALIGN
    bytes, the last one taking the rest; a small payload gets fewer parts (never an empty one,
    except the one part of an empty payload). Both ends compute the same."""
    if parts <= 1 or nbytes <= _PART_ALIGN:
        return [(0, nbytes)]
    step = -(-(-(-nbytes // parts)) // _PART_ALIGN) * _PART_ALIGN
    return [(offset, min(step, nbytes - offset)) for offset in range(0, nbytes, step)]


class Outgoing:
    """A payload queued on a pair's streams; `on_done(error)` runs once the kernel has all of it, or
    at the first error."""

    __slots__ = ("view", "on_done", "left")

    def __init__(self, view: memoryview, on_done: Callable[[Optional[BaseException]], None]) -> None:
        self.view, self.on_done = view, on_done
        self.left = 0  # parts not yet written; -1 once finished

    def _finish(self, error: Optional[BaseException]) -> None:
        if self.left >= 0:
            self.left = -1
            self.on_done(error)


_FRAME = Outgoing(memoryview(b""), lambda error: None)  # what a queued frame (or header) belongs to: nothing to finish


class _OutPart:
    __slots__ = ("payload", "view", "sent")

    def __init__(self, payload: Outgoing, view: memoryview) -> None:
        self.payload, self.view, self.sent = payload, view, 0


class _Frames:
    """Read state of a pair's stream 0 where frames travel: bytes read ahead, `start`..`end` of `view`
    not yet used (a frame's start, or the first bytes of the payload being read)."""

    __slots__ = ("view", "start", "end", "drained")

    def __init__(self) -> None:
        self.view = memoryview(bytearray(_FRAME_BUF))
        self.start = self.end = 0
        self.drained = False  # the last recv got less than it asked for: the kernel had no more then
        # (so a frame's end waits for the poll rather than a recv that would most likely raise)


Consume = Callable[[memoryview, int], None]  # (piece, byte offset of the piece in the payload)


class Incoming:
    """An announced payload of `nbytes`: it lands in `target`, or, with `consume`, passes through a
    small per-stream buffer piece by piece (parts on different streams interleave: pieces come in
    no particular order, each once); `on_done(error)` runs once all of it is in, or at the first
    error. Until one of the two is set (the payload is claimed) its streams are not read past it."""

    __slots__ = ("nbytes", "target", "consume", "on_done", "since", "owner", "left")

    def __init__(self, nbytes: int, on_done: Callable[[Optional[BaseException]], None]) -> None:
        self.nbytes, self.on_done = nbytes, on_done
        self.target: Optional[memoryview] = None
        self.consume: Optional[Consume] = None
        self.since = time.monotonic()  # announced at
        self.owner: Any = None  # the transport's bookkeeping
        self.left = 0  # parts not yet in; -1 once finished

    @property
    def claimed(self) -> bool:
        return self.target is not None or self.consume is not None

    def _finish(self, error: Optional[BaseException]) -> None:
        if self.left >= 0:
            self.left = -1
            done, self.on_done, self.owner = self.on_done, _ignore, None
            # (the owner, tcp's _Parked, refers back to this payload, as on_done may: left in place, that
            # cycle would keep the receive and its buffer, the user's array, alive until the garbage
            # collector ran, hundreds of calls later, and glibc's heap would fragment around them)
            done(error)


def _ignore(error: Optional[BaseException]) -> None:
    """on_done of a finished payload."""


class _InPart:
    __slots__ = ("payload", "offset", "nbytes", "got", "fill")

    def __init__(self, payload: Incoming, offset: int, nbytes: int) -> None:
        self.payload, self.offset, self.nbytes = payload, offset, nbytes
        self.got = 0   # bytes placed in the target, or handed to consume
        self.fill = 0  # bytes waiting in the stream buffer (consume only)


def _part_done(queue: Deque[Any]) -> None:
    """The part at the head of a stream's queue is through: its message is done with its last part."""
    payload = queue.popleft().payload
    if payload.left > 0:
        payload.left -= 1
        if payload.left == 0:
            payload._finish(None)


def _recv(sock: socket.socket, frames: Optional[_Frames], into: memoryview, want: int) -> int:
    """recv_into, taking the bytes stream 0 read ahead (`frames`) first."""
    if frames is not None and frames.end > frames.start:
        n = min(want, frames.end - frames.start)
        into[:n] = frames.view[frames.start:frames.start + n]
        frames.start += n
        return n
    return sock.recv_into(into, want)


def _take_queued(queues: List[Any]) -> List[Any]:
    """Empty a peer's stream queues; the messages their parts belonged to, each once."""
    pending: Dict[int, Any] = {}
    for queue in queues:
        for part in queue:
            if part.payload is not _FRAME:
                pending[id(part.payload)] = part.payload
        queue.clear()
    return list(pending.values())


class BulkLinks:
    """Raw streams per peer: connect/authenticate, then nonblocking writes and reads, FIFO per stream."""

    def __init__(self, rank: int, size: int, address: str, buffer_bytes: int = 0, local_sndbuf: int = 0,
                 on_broken: Callable[[int, str], None] = lambda peer, why: None, stripe_min: int = 1 << 19,
                 congestion: str = "system", on_frame: Optional[OnFrame] = None,
                 on_end: Callable[[int], None] = lambda peer: None) -> None:
        """`buffer_bytes`: SO_SNDBUF and SO_RCVBUF of every stream (0: autotuning); `local_sndbuf`:
        SO_SNDBUF of the streams to ranks on this host, when `buffer_bytes` is 0 (0: autotuning);
        `on_broken(peer, why)` runs when a peer's stream breaks (nothing new may use it);
        `stripe_min`: the smallest part a payload is cut into over several streams; `congestion`:
        PYCOLL_TCP_CC for the streams to other hosts (apply_congestion). With `on_frame`, stream 0
        of every pair carries frames (send_frame, and send's `head`), read whenever they come and
        handed to on_frame(peer, header, layout, payload) (see read); `on_end(peer)` runs when a
        peer's stream 0 ends (closed at a frame's end, or broken)."""
        self.rank, self.size, self._buffer_bytes, self._local_sndbuf = rank, size, buffer_bytes, local_sndbuf
        self._congestion = congestion
        self._on_broken = on_broken
        self._on_frame, self._on_end = on_frame, on_end
        self._frames: Dict[int, _Frames] = {}  # peer -> its stream 0's read state (with on_frame)
        self.ended: Set[int] = set()  # peers whose stream 0 ended: not read any more
        self.buffered: Set[int] = set()  # peers whose stream 0 stopped at an unclaimed payload with bytes read ahead
        self._parts_in = 0  # announced parts not yet read, on all streams (none: no payload can be unclaimed)
        self._stripe_min = max(1, stripe_min)
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind((address, 0))
        self._listener.listen(max(8, size))
        self.endpoint = f"{address}:{self._listener.getsockname()[1]}"
        self.socks: Dict[int, List[socket.socket]] = {}  # peer -> its streams, by index
        self.stripes: Dict[int, int] = {}  # peer -> streams its payloads are cut over now (<= len(socks[peer]))
        self._next: Dict[int, int] = {}    # peer -> the stream the next payload starts on
        self._out: Dict[int, List[Deque[_OutPart]]] = {}
        self._in: Dict[int, List[Deque[_InPart]]] = {}
        self._out_locks: Dict[int, threading.RLock] = {}
        self._pieces: Dict[Tuple[int, int], memoryview] = {}  # per stream: where consumed payloads pass through
        self.closed_by: Dict[int, str] = {}  # peers whose streams ended -> why
        self.local: List[int] = []  # peers on this host, whose streams got `local_sndbuf`
        self.rejected = 0
        self._seen: Set[bytes] = set()  # nonces of hellos accepted: a captured hello replayed is turned away
        self.rejects = RateLimitedLog(log, f"rank {rank}: tcp bulk streams: rejected connections")

    # -- set-up --------------------------------------------------------------------------------
    def establish(self, endpoints: Dict[int, str], token: bytes, deadline: float,
                  streams: Optional[Dict[int, int]] = None) -> None:
        """Open `streams[peer]` streams (default 1) to every peer in `endpoints`: connect to every
        lower rank, accept every higher one; each stream's hello proves the job token for its index."""
        counts = {p: max(1, min(wire.MAX_STREAMS, (streams or {}).get(p, 1))) for p in endpoints}
        for peer in sorted(p for p in endpoints if p < self.rank):
            host, port = endpoints[peer].rsplit(":", 1)
            for index in range(counts[peer]):
                sock = socket.create_connection((host, int(port)), timeout=max(0.1, deadline - time.monotonic()))
                self._send_hello(sock, token, peer, index)
                src, got = self._expect_hello(sock, token, deadline)
                if (src, got) != (peer, index):
                    raise PeerError(f"rank {self.rank}: bulk stream {index} to rank {peer} answered as stream "
                                    f"{got} of rank {src}", peer)
                self._adopt(peer, index, sock)
        waiting = {(p, i) for p in endpoints if p > self.rank for i in range(counts[p])}
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"rank {self.rank}: tcp bulk streams from ranks "
                                   f"{sorted({p for p, _ in waiting})} did not connect in time",
                                   peers=sorted({p for p, _ in waiting}))
            self._listener.settimeout(min(left, 1.0))
            try:
                sock, _ = self._listener.accept()
            except socket.timeout:
                continue
            try:
                peer, index = self._expect_hello(sock, token, min(deadline, time.monotonic() + 5.0))
            except (ValueError, OSError, TimeoutError) as e:
                self.rejected += 1  # a stranger or garbage on the listening port
                self.rejects.warning("rank %d: tcp bulk stream: rejected a connection: %s", self.rank, e)
                sock.close()
                continue
            if (peer, index) not in waiting:
                self.rejected += 1
                self.rejects.warning("rank %d: tcp bulk stream: rejected a second or unwanted hello from rank "
                                     "%d (stream %d)", self.rank, peer, index)
                sock.close()
                continue
            self._send_hello(sock, token, peer, index)
            waiting.discard((peer, index))
            self._adopt(peer, index, sock)
        self._listener.close()  # nothing listens once the job is wired up
        for peer in self.socks:
            self.stripes[peer] = len(self.socks[peer])
            self._next[peer] = 0

    def _send_hello(self, sock: socket.socket, token: bytes, peer: int, index: int) -> None:
        sock.sendall(wire.make_hello(token, self.rank, peer, secrets.token_bytes(16), wire.bulk_purpose(index)))

    def _expect_hello(self, sock: socket.socket, token: bytes, deadline: float) -> Tuple[int, int]:
        """(sender, stream index) of the hello the connection opens with."""
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
        src, index = wire.check_bulk_hello(token, self.rank, bytes(data), self._seen)
        if not 0 <= src < self.size or src == self.rank:
            raise ValueError(f"bulk hello from rank {src}")
        return src, index

    def _adopt(self, peer: int, index: int, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        local = same_host(sock)
        if not local:
            apply_congestion(sock, self._congestion)
        if self._buffer_bytes:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._buffer_bytes)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self._buffer_bytes)
        elif self._local_sndbuf and local:
            # A software path (loopback) delivers a packet on the CPU that sent it. Data left queued
            # by a full window goes out when the ACK comes, from the peer's CPU, and can overtake
            # what still waits on ours: reordering, spurious retransmits. A send buffer no bigger than
            # the window keeps every write on the writer's CPU (64 MiB allreduce, 2 / 4 ranks: 42 / 117 ms
            # against 49 / 148 ms with autotuning).
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._local_sndbuf)
            if peer not in self.local:
                self.local.append(peer)
        sock.setblocking(False)
        socks = self.socks.setdefault(peer, [])
        assert index == len(socks), "streams are adopted in index order"
        socks.append(sock)
        if index == 0 and self._on_frame is not None:
            self._frames[peer] = _Frames()
        self._out.setdefault(peer, []).append(deque())
        self._in.setdefault(peer, []).append(deque())
        self._out_locks.setdefault(peer, threading.RLock())

    def streams(self) -> List[Tuple[int, int, socket.socket]]:
        """(peer, index, socket) of every stream."""
        return [(peer, i, sock) for peer, socks in self.socks.items() for i, sock in enumerate(socks)]

    def stripe(self, streams: int) -> None:
        """Cut payloads to every peer over `streams` of its streams from now on (at most as many as
        it has); the receiver follows each payload's announced Layout."""
        for peer, socks in self.socks.items():
            with self._out_locks[peer]:
                self.stripes[peer] = max(1, min(streams, len(socks)))
                self._next[peer] %= self.stripes[peer]

    # -- sending ---------------------------------------------------------------------------------
    def layout(self, peer: int, nbytes: int) -> Layout:
        """How to cut the next payload of `nbytes` to `peer`: over up to `stripes[peer]` streams in
        parts of at least stripe_min; smaller ones go whole, each on the next stream in turn (the
        peer's send lock held: layouts and send() calls must keep one order)."""
        width = self.stripes.get(peer, 1)
        if width == 1:
            return ONE_STREAM
        parts = max(1, min(width, nbytes // self._stripe_min))
        first = self._next[peer]
        self._next[peer] = (first + parts) % width
        return Layout(parts, first, width)

    def send(self, peer: int, item: Outgoing, layout: Layout = ONE_STREAM, head: bytes = b"") -> bool:
        """Queue a payload in the parts of `layout`, behind `head` (its frame header) on stream 0, and
        write what the kernel takes now; True if some of it is still queued."""
        with self._out_locks[peer]:
            queues = self._out[peer]
            if peer in self.closed_by:  # a stream of this peer broke: fail at once, whatever is queued
                item._finish(PeerError(f"rank {self.rank}: rank {peer} {self.closed_by[peer]}", peer))
                return False
            idle = [not q for q in queues]
            if head:
                queues[0].append(_OutPart(_FRAME, memoryview(head)))
            cuts = split(item.view.nbytes, layout.parts)
            item.left = len(cuts)
            for stream, (offset, length) in zip(layout.streams(), cuts):
                queues[stream].append(_OutPart(item, item.view[offset:offset + length]))
            for stream, was_idle in enumerate(idle):
                if was_idle and queues[stream]:  # (a busy stream waits on the poller: writing would not help)
                    self._write(peer, stream)
            return any(queues)

    def send_frame(self, peer: int, frame: bytes) -> bool:
        """Write a whole frame (header and copied payload) on the peer's stream 0, queued behind what
        waits there, or straight into the socket if nothing does; True if some of it is still queued.
        A broken stream takes nothing (the caller checks closed_by first)."""
        with self._out_locks[peer]:
            queue = self._out[peer][0]
            if not queue:
                try:
                    n = self.socks[peer][0].send(frame)
                except (BlockingIOError, InterruptedError):
                    n = 0
                except OSError as e:
                    self._broke(peer, f"its bulk stream broke while sending ({e})")
                    self._fail_out(peer, PeerError(f"rank {self.rank}: rank {peer} {self.closed_by[peer]}", peer))
                    return False
                if n == len(frame):
                    return False
                frame = memoryview(frame)[n:]
            queue.append(_OutPart(_FRAME, memoryview(frame)))
            return True

    def flush(self, peer: int, stream: int) -> None:
        """Write what the kernel takes of one stream's queue (it polled writable)."""
        with self._out_locks[peer]:
            self._write(peer, stream)

    def wants_write(self, peer: int, stream: int) -> bool:
        return bool(self._out[peer][stream])

    def _write(self, peer: int, stream: int) -> None:
        queue, sock = self._out[peer][stream], self.socks[peer][stream]
        while queue:
            part = queue[0]
            try:
                n = sock.send(part.view[part.sent:part.sent + _CHUNK]) if part.view.nbytes else 0
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # any thread may write: fail the sends only, the reader fails the rest
                self._broke(peer, f"its bulk stream broke while sending ({e})")
                self._fail_out(peer, PeerError(f"rank {self.rank}: rank {peer} {self.closed_by[peer]}", peer))
                return
            part.sent += n
            if part.sent == part.view.nbytes:
                _part_done(queue)

    # -- receiving -------------------------------------------------------------------------------
    def expect(self, peer: int, item: Incoming, layout: Layout = ONE_STREAM) -> None:
        """The next bytes of the streams of `layout` belong to `item`, a part on each (io lock held).
        ValueError if the layout does not fit the peer's streams."""
        queues = self._in[peer]
        if not (1 <= layout.parts <= layout.width <= len(queues) and 0 <= layout.first < layout.width):
            raise ValueError(f"a payload cut as {tuple(layout)} (parts, first, width) over {len(queues)} streams")
        cuts = split(item.nbytes, layout.parts)
        item.left = len(cuts)
        for stream, (offset, length) in zip(layout.streams(), cuts):
            queues[stream].append(_InPart(item, offset, length))
        self._parts_in += len(cuts)

    def wants_read(self, peer: int, stream: int) -> bool:
        """Whether the stream has something to read now: a claimed payload's part, or (stream 0 with
        frames) the next frame."""
        queue = self._in[peer][stream]
        if queue:
            return queue[0].payload.claimed
        return stream == 0 and peer in self._frames and peer not in self.closed_by and peer not in self.ended

    def blocked(self, peer: int) -> bool:
        """Whether the peer's frames wait behind an unclaimed payload at the head of its stream 0."""
        queue = self._in[peer][0] if peer in self._frames and peer in self.socks else None
        return bool(queue) and not queue[0].payload.claimed

    def blocks_frames(self, peer: int, item: Incoming) -> bool:
        """Whether `item` has the head of the peer's stream 0, where frames wait behind it."""
        queue = self._in[peer][0] if peer in self._frames and peer in self.socks else None
        return bool(queue) and queue[0].payload is item

    def unclaimed_heads(self) -> List[Incoming]:
        """Payloads with a part at the head of its stream that nobody has claimed yet (io lock held)."""
        if not self._parts_in:  # (every wait asks: most find nothing announced at all)
            return []
        heads: Dict[int, Incoming] = {}
        for queues in self._in.values():
            for q in queues:
                if q and not q[0].payload.claimed:
                    heads[id(q[0].payload)] = q[0].payload
        return list(heads.values())

    def read(self, peer: int, stream: int) -> None:
        """Read what has arrived on one stream, in order, into the announced payloads' parts and, on
        stream 0 with frames, frame after frame between them, until the kernel has no more, a
        payload nobody has claimed is next, or the stream ends (io lock held)."""
        sock, queue = self.socks[peer][stream], self._in[peer][stream]
        frames = self._frames.get(peer) if stream == 0 else None
        if frames is not None:
            frames.drained = False
        while True:
            if not queue:
                if frames is None or not self._frame(peer, sock, frames, queue):
                    return
                continue
            part = queue[0]
            if not part.payload.claimed:
                if frames is not None and frames.end > frames.start:
                    self.buffered.add(peer)  # its claim must read on without a poll saying so
                return
            try:
                n = self._read_into(peer, stream, sock, part, frames)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self.fail(peer, f"its bulk stream broke while receiving ({e})")
                self._ended(peer, stream)
                return
            if n == 0 and part.got < part.nbytes:
                self.fail(peer, "its bulk stream closed in the middle of a message")
                self._ended(peer, stream)
                return
            if part.got == part.nbytes:
                self._parts_in -= 1
                _part_done(queue)

    def _frame(self, peer: int, sock: socket.socket, frames: _Frames, queue: Deque[_InPart]) -> bool:
        """Take frames off stream 0 and hand them to on_frame, reading more when one is not all here,
        until a payload's part is next (True) or that must wait (nothing more in the kernel) or the
        stream is done for (False)."""
        view, size = frames.view, wire.HEADER.size
        while True:
            start, have = frames.start, frames.end - frames.start
            try:
                if have < size:
                    if frames.drained or not self._fill(peer, sock, frames):
                        return False
                    continue
                header = wire.unpack_header_from(view, start)
                kind, nbytes = header.kind, header.nbytes
                layout: Optional[Layout] = None
                payload: Optional[memoryview] = None
                if kind == wire.KIND_DATA:
                    if have - size >= nbytes:  # the payload came with it: straight to the receive
                        frames.start = start + size + nbytes
                        payload = view[start + size:frames.start]
                    else:
                        frames.start = start + size
                elif kind == wire.KIND_BULK:
                    if have < _LAYOUT_SIZE:
                        if not self._fill(peer, sock, frames):
                            return False
                        continue
                    layout = Layout(*wire.LAYOUT.unpack_from(view, start + size))
                    frames.start = start + _LAYOUT_SIZE
                elif kind == wire.KIND_BYE:
                    frames.start = start + size
                else:
                    raise ValueError(f"a frame of kind {kind} has no place on a stream")
            except ValueError as e:  # out of step (or a stranger's bytes): nothing after it can be placed
                self.rejected += 1
                self.fail(peer, f"sent what is not a frame on its stream ({e})")
                self._ended(peer, 0)
                return False
            self._on_frame(peer, header, layout, payload)
            if peer in self.closed_by:
                return False
            if queue:
                return True

    def _fill(self, peer: int, sock: socket.socket, frames: _Frames) -> bool:
        """Read more of stream 0 behind the bytes kept (moved to the front first); False if nothing
        came (the stream ended or broke, or nothing is there yet)."""
        start, end, view = frames.start, frames.end, frames.view
        if start:
            view[:end - start] = view[start:end]
            frames.start, frames.end = 0, end - start
        try:
            n = sock.recv_into(view[frames.end:], _FRAME_BUF - frames.end)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as e:
            self.fail(peer, f"its bulk stream broke while receiving ({e})")
            self._ended(peer, 0)
            return False
        if n == 0:
            if frames.end:  # a partial frame: the sender died, or its stream was cut, in the middle
                self.fail(peer, "its bulk stream closed in the middle of a message")
            self._ended(peer, 0)
            return False
        frames.end += n
        frames.drained = frames.end < _FRAME_BUF
        return True

    def _ended(self, peer: int, stream: int) -> None:
        """The peer's stream 0 ended (or broke): it is not polled any more, and on_end hears of it."""
        if stream == 0 and peer in self._frames and peer not in self.ended:
            self.ended.add(peer)
            self._on_end(peer)

    def read_buffered(self) -> bool:
        """Read on where a stream 0 stopped at an unclaimed payload with bytes already read ahead that
        has since been claimed (no poll would report it); True if any was (io lock held)."""
        went = False
        for peer in list(self.buffered):
            if not self.blocked(peer):
                self.buffered.discard(peer)
                if peer in self.socks:
                    self.read(peer, 0)
                    went = True
        return went

    def _read_into(self, peer: int, stream: int, sock: socket.socket, part: _InPart,
                   frames: Optional[_Frames] = None) -> int:
        """One recv for `part` (from the bytes stream 0 read ahead first); a consumed payload is handed
        over in aligned pieces as they fill."""
        item = part.payload
        if item.consume is None:
            want = min(part.nbytes - part.got, _CHUNK)
            at = part.offset + part.got
            n = _recv(sock, frames, item.target[at:at + want], want) if want else 0
            part.got += n
            return n
        buf = self._pieces.get((peer, stream))
        if buf is None:
            buf = self._pieces[(peer, stream)] = memoryview(bytearray(STREAM_CHUNK + _ALIGN))
        room = min(STREAM_CHUNK + _ALIGN - part.fill, part.nbytes - part.got - part.fill)
        n = _recv(sock, frames, buf[part.fill:part.fill + room], room) if room else 0
        part.fill += n
        last = part.got + part.fill == part.nbytes
        if last or part.fill >= STREAM_CHUNK:
            usable = part.fill if last else part.fill - part.fill % _ALIGN
            item.consume(buf[:usable], part.offset + part.got)
            part.got += usable
            part.fill -= usable
            buf[:part.fill] = buf[usable:usable + part.fill]
        return n

    def fail(self, peer: int, why: str) -> None:
        """The peer's streams are unusable: fail everything queued on them, both ways (io lock held)."""
        self._broke(peer, why)
        err = PeerError(f"rank {self.rank}: rank {peer} {why}", peer)
        pending = _take_queued(self._in[peer])
        self._parts_in = sum(len(q) for queues in self._in.values() for q in queues)
        for item in pending:
            item._finish(err)
        self._fail_out(peer, err)

    def forget(self, peer: int, why: str) -> None:
        """The peer is gone for good (agreed dead): fail what is queued to and from it and close its
        streams; a later send to it fails at once (io lock held, its streams unregistered from polls)."""
        if peer not in self.socks:
            return
        self.fail(peer, why)
        for index, sock in enumerate(self.socks.pop(peer)):
            sock.close()
            self._pieces.pop((peer, index), None)
        self._frames.pop(peer, None)
        self.buffered.discard(peer)
        self.ended.add(peer)
        with self._out_locks[peer]:
            self._out[peer], self._in[peer] = [], []
        self.stripes.pop(peer, None)
        self._next.pop(peer, None)

    def _broke(self, peer: int, why: str) -> None:
        self.closed_by.setdefault(peer, why)
        self._on_broken(peer, self.closed_by[peer])

    def _fail_out(self, peer: int, err: PeerError) -> None:
        with self._out_locks[peer]:
            pending = _take_queued(self._out[peer])
        for item in pending:
            item._finish(err)

    # -- teardown --------------------------------------------------------------------------------
    def drain_sends(self, deadline: float) -> None:
        """Write out queued payloads before closing, until `deadline`."""
        for peer, stream, sock in self.streams():
            while self._out[peer][stream] and peer not in self.closed_by and time.monotonic() < deadline:
                select.select([], [sock], [], max(0.0, min(0.1, deadline - time.monotonic())))
                self.flush(peer, stream)

    def close(self) -> None:
        try:
            self._listener.close()
        except OSError:
            pass
        for _, _, sock in self.streams():
            sock.close()
        self.socks.clear()


"""TCP transport: one raw stream per pair of ranks carries their messages; pyzmq the rest.

Every message to another rank rides the pair's stream 0 (bulk.py) in one ordered byte stream, so
MPI's non-overtaking rule holds across sizes: a data frame [wire header][payload] below
PYCOLL_TCP_BULK_THRESHOLD, written by the sending thread straight into the socket (copied into one
write if small) and read by whichever thread waits, straight into the posted receive when there is
one; a bulk announcement [header][cut] whose payload follows on the pair's streams as the cut says
(between hosts a pair may hold several streams, PYCOLL_NSOCKS, for networks that cap each flow) and
is read straight into the posted buffer, or parked unread until its receive is posted (read aside
after PARK_AFTER s, or at once where it holds up frames a posted receive may wait on). The goodbye
(BYE) is the last frame. zmq (one ROUTER per rank in, one DEALER per peer out) carries the hellos,
credit, and messages to oneself; with PYCOLL_TCP_BULK_THRESHOLD=inf it carries every message.
Frames cost the sender one syscall and the receiver one read, with no thread hand-off: through zmq
each message crossed its I/O threads (8 B ping-pong between two processes on this 2-core VM:
50-93 us round trip through zmq against 19-23 us on a raw socket, load 3). Whichever thread waits
drives all sockets (leader/follower), polling them for PYCOLL_TCP_SPIN_US before it blocks. While
bulk payloads pass between hosts and no thread waits, a background thread reads what ranks on other
hosts sent, every PYCOLL_TCP_PROGRESS_MS:
a receiver that leaves data unread delays its acknowledgements (the kernel acks at once only while the
application reads), the sender runs out of window, and a transfer started during the receiver's compute
stalls until its receive is posted (2 MiB sent 24 ms before its receive: 8-13 ms left to wait, against
0.05 ms once read as it came; two emulated hosts at 1 Gbit/s). What a
peer may have sent us unconsumed is bounded: data frames by credit flow control (flow.py,
PYCOLL_TCP_EAGER_WINDOW per peer), bulk payloads by their streams (they wait on them, unread,
until claimed or parked).
"""
from __future__ import annotations

import fcntl
import logging
import math
import os
import secrets
import select
import socket
import sys
import termios
import threading
import time
from typing import Any, Callable, ContextManager, Dict, Iterable, List, Optional, Sequence, Set, Tuple, Union

import numpy as np
import zmq

from .. import config
from ..bootstrap.netif import select_address
from ..bootstrap.store import Store
from ..errors import PeerError, TimeoutError
from ..logutil import RateLimitedLog
from . import wire
from .base import MsgKey, Request, Transport
from .capabilities import SinkReceive, Striping
from .flow import Credits
from .matching import Match, Matcher, fail
from .bulk import ONE_STREAM, BulkLinks, Incoming, Layout, Outgoing
from .request import ANY

log = logging.getLogger("pycoll.tcp")

PARK_AFTER = 0.2  # s an unclaimed bulk payload may hold up its stream before it is read aside
# (at once where it holds up frames that a posted receive may wait on: see _park_stalled)
PARK_AFTER_REMOTE = 0.001  # the same from a rank on another host: unread, it stalls the sender (_background)
_BIG_UNREAD = 64 << 10  # bytes from other hosts the background reader takes at once (fewer wait a look more)
_ARMED_FOR = 1.0  # s the background reader looks after the last bulk payload to or from another host
_SLICE = 0.1  # seconds a waiter blocks before re-checking deadlines and leadership
_SEND_SLICE = 0.05  # a waiter on sends alone looks for dropped peers this often
_WATCH_EVERY = 0.05  # s between looks at the connection monitors while traffic flows (each poll costs)
_ROUTER_EVERY = 0.0005  # s a waiter that finds frames on its streams may go without polling zmq's sockets
_GRACE = 1.0  # seconds between a dropped connection and declaring the peer dead
_LINGER_MS = 5000

AUTO_STREAMS = 4  # streams PYCOLL_NSOCKS=auto opens to each rank on another host (the tuner picks how many to use)
_BYE = wire.pack_header(wire.KIND_BYE, 0, 0, 0, 0, 0)

# zmq's flags as plain ints: the hot path pays for every IntFlag | and & (an enum object each)
POLLIN, POLLOUT, POLLERR = int(zmq.POLLIN), int(zmq.POLLOUT), int(zmq.POLLERR)
SNDMORE, NOBLOCK, RCVMORE, EVENTS = int(zmq.SNDMORE), int(zmq.NOBLOCK), int(zmq.RCVMORE), int(zmq.EVENTS)


class _Parked:
    """A payload on a stream that came before its receive was posted. A bulk payload waits on its
    stream, unread, so the receive can claim it and have it land in place; only if that takes
    PARK_AFTER s (the program waits on a later message first; PARK_AFTER_REMOTE from another host) is it
    read into a buffer of its own and copied later. A data frame's payload still on its way is read aside at once."""

    __slots__ = ("peer", "incoming", "buffer", "raw", "complete", "error", "req")

    def __init__(self, peer: int, incoming: Incoming) -> None:
        self.peer, self.incoming = peer, incoming
        self.buffer: Optional[memoryview] = None  # set once it is read ahead of its receive
        self.raw: Optional[np.ndarray] = None  # the scratch buffer `buffer` views (the transport's pool)
        self.complete = False
        self.error: Optional[BaseException] = None  # the stream broke before all of it came
        self.req: Optional[Request] = None


def _completes(req: Request) -> Callable[[Optional[BaseException]], None]:
    """The on_done of a payload written from `req`'s buffer: the send is done (failed with the error)."""
    def done(error: Optional[BaseException]) -> None:
        req.error, req.done = error, True
    return done


def streams_offered(setting: Union[str, int], same_host: bool) -> int:
    """Streams a rank with PYCOLL_NSOCKS=`setting` opens to a peer: a number is that many to every
    peer; auto is AUTO_STREAMS to other hosts and 1 on this host (loopback has no per-flow cap,
    and more streams there only cost polls and copies on shared cores)."""
    if setting == "auto":
        return 1 if same_host else AUTO_STREAMS
    return int(setting)


class _Striping(Striping):
    """The Striping a TcpTransport offers (over its BulkLinks)."""

    def __init__(self, bulk: BulkLinks, automatic: bool) -> None:
        self._bulk, self.automatic = bulk, automatic
        self._width = 1

    def streams(self, peer: int) -> int:
        return len(self._bulk.socks.get(peer, ())) or 1

    def widest(self) -> int:
        """The most streams open to any peer."""
        return max((len(s) for s in self._bulk.socks.values()), default=1)

    def width(self) -> int:
        return self._width

    def use(self, streams: int) -> None:
        self._width = max(1, min(int(streams), self.widest()))
        self._bulk.stripe(self._width)


class TcpTransport(Transport):
    """Tagged point-to-point over TCP with zero-copy sends and receives into the user's buffer."""

    name = "tcp"
    resilient = True

    def __init__(self, rank: int, size: int, address: Optional[str] = None,
                 hosts: Optional[List[str]] = None, *, peers: Optional[Sequence[int]] = None) -> None:
        """`peers`: the ranks to connect to (default all; AutoTransport passes those on other hosts)."""
        super().__init__(rank, size)
        self.capabilities[SinkReceive] = SinkReceive()
        self.peers = sorted(set(range(size) if peers is None else peers) | {rank})
        self._hosts = list(hosts) if hosts else [""] * size  # host ids: who shares this host
        self._nsocks = config.get("PYCOLL_NSOCKS")
        self._copy_threshold = config.get("PYCOLL_TCP_COPY_THRESHOLD")
        self._bulk_threshold = config.get("PYCOLL_TCP_BULK_THRESHOLD")  # inf: zmq only
        self._framed = not math.isinf(self._bulk_threshold)  # data to other ranks rides their stream 0
        self._socket_buffer = config.get("PYCOLL_TCP_SOCKET_BUFFER")  # SO_SNDBUF/SO_RCVBUF; 0: autotuning
        self._spin_s = config.get("PYCOLL_TCP_SPIN_US") * 1e-6  # polling before a blocking poll
        self._ctx = zmq.Context(io_threads=config.get("PYCOLL_TCP_IO_THREADS"))
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.RCVHWM, 0)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, -1)
        self._router.setsockopt(zmq.HANDSHAKE_IVL, 5000)  # a silent stranger is dropped after 5 s
        if self._socket_buffer:
            self._router.setsockopt(zmq.RCVBUF, self._socket_buffer)
        addr = address or select_address()[1]
        port = self._router.bind_to_random_port(f"tcp://{addr}")
        self.endpoint = f"tcp://{addr}:{port}"
        self._monitor = self._router.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        self._watch = zmq.Poller()  # connection monitors: looked at every _WATCH_EVERY s, not every poll
        self._watch.register(self._monitor, zmq.POLLIN)
        self._next_watch = 0.0
        self._next_router = 0.0
        self._dealers: List[Optional[zmq.Socket]] = [None] * size
        self._send_locks = [threading.Lock() for _ in range(size)]
        self._io = threading.Lock()            # held by the one thread reading the router
        self._match = threading.Lock()         # guards self.matcher
        self._cond = threading.Condition()     # followers sleep here until the leader completes work
        self._bulk = BulkLinks(rank, size, addr, self._socket_buffer, config.get("PYCOLL_TCP_LOCAL_SNDBUF"),
                               on_broken=self.matcher.refuse, stripe_min=config.get("PYCOLL_TCP_STRIPE_MIN"),
                               congestion=config.get("PYCOLL_TCP_CC"),
                               on_frame=self._on_frame if self._framed else None, on_end=self._stream_ended)
        self._striping = _Striping(self._bulk, self._nsocks == "auto")
        self._bulk_polled: Dict[Tuple[int, int], int] = {}  # (peer, stream) -> poll flags it is registered with
        self._wake_r, self._wake_w = socket.socketpair()  # an isend from another thread wakes the poller
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._spin_poll = select.poll()  # what a spinning waiter looks at: the streams, wake-ups (cheaper than zmq's)
        self._spin_poll.register(self._wake_r, select.POLLIN)
        self._ident_rank: Dict[bytes, int] = {}
        self._seen_nonces: set = set()
        self._token = b""
        self.rejected = 0  # messages and connections turned away (strangers, bad tokens, garbage)
        self.rejects = RateLimitedLog(log, f"rank {rank}: tcp transport: rejected messages and connections")
        self._peer_monitors: Dict[zmq.Socket, int] = {}  # a DEALER's monitor -> the peer it reaches
        self.dead: Dict[int, str] = {}                    # peers whose connection dropped -> why
        window = config.get("PYCOLL_TCP_EAGER_WINDOW")
        self._flow = Credits([p for p in self.peers if p != rank], size, window) if window > 0 else None
        self._lost_at: Dict[int, float] = {}              # dropped, within the grace period
        self._said_bye: set = set()                       # peers that closed normally
        self._forgotten: Set[int] = set()                 # agreed dead: connections closed, messages dropped
        self._remote = {p for p in self.peers if self._hosts[p] != self._hosts[rank]}  # ranks on other hosts
        self._progress_s = config.get("PYCOLL_TCP_PROGRESS_MS") * 1e-3
        self._stop = threading.Event()  # ends the background reader
        self._arm = threading.Event()  # wakes it: a bulk payload to or from another host (it sleeps without one)
        self._armed_until = 0.0
        self._waits = 0  # wait_for calls so far (a hint for the background reader: not exact across threads)
        self._reader: Optional[threading.Thread] = None

    # -- connection set-up -------------------------------------------------------------------
    def connect(self, store: Store, token: bytes, timeout: float) -> None:
        self._token = token
        store.set(f"tcp/{self.rank}", f"{self.endpoint} {self._bulk.endpoint} {self._nsocks}".encode())
        bulk_endpoints: Dict[int, str] = {}
        heartbeat = config.get("PYCOLL_TCP_HEARTBEAT")
        streams: Dict[int, int] = {}
        for peer in self.peers:
            endpoint, bulk_endpoint, nsocks = store.get(f"tcp/{peer}", timeout).decode().split()
            if peer != self.rank:
                bulk_endpoints[peer] = bulk_endpoint
                same = self._hosts[peer] == self._hosts[self.rank]
                streams[peer] = min(streams_offered(self._nsocks, same), streams_offered(nsocks, same))
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, _LINGER_MS)
            sock.setsockopt(zmq.ROUTING_ID, secrets.token_bytes(8))
            if self._socket_buffer:
                sock.setsockopt(zmq.SNDBUF, self._socket_buffer)
            if heartbeat and peer != self.rank:  # a silent peer (cut off, frozen) drops the connection
                sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(heartbeat * 250)))
                sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, int(heartbeat * 1000)))
            if peer != self.rank:  # a dropped connection means the peer died or closed: fail fast
                monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
                self._peer_monitors[monitor] = peer
                self._watch.register(monitor, zmq.POLLIN)
            sock.connect(endpoint)
            nonce = secrets.token_bytes(16)
            hello = wire.make_hello(token, self.rank, peer, nonce)
            sock.send_multipart([wire.pack_header(wire.KIND_HELLO, 0, 0, 0, 0, len(hello)), hello])
            self._dealers[peer] = sock
        deadline = time.monotonic() + timeout
        while not set(self.peers) <= set(self._ident_rank.values()):
            if time.monotonic() > deadline:
                missing = sorted(set(self.peers) - set(self._ident_rank.values()))
                raise TimeoutError(f"rank {self.rank}: tcp transport heard no authenticated hello from "
                                   f"ranks {missing} within {timeout:g} s", peers=missing)
            with self._io:
                self._drain(_SLICE)
        self._bulk.establish(bulk_endpoints, token, deadline, streams)
        # a fixed PYCOLL_NSOCKS cuts over every stream; auto over one until the tuner picks (calibration.py)
        self._striping.use(1 if self._nsocks == "auto" else self._striping.widest())
        if self._striping.widest() > 1:
            self.capabilities[Striping] = self._striping
        if self._progress_s > 0 and self._framed and self._remote:
            self._reader = threading.Thread(target=self._background, name=f"pycoll-tcp-reader-{self.rank}",
                                            daemon=True)
            self._reader.start()

    def _background(self) -> None:
        """While bulk payloads pass to or from other hosts (until _ARMED_FOR s after the last; asleep
        otherwise), every PYCOLL_TCP_PROGRESS_MS: if no thread waited on this transport since the last
        look (the process computes) and a stream from another host holds a payload's worth
        (_BIG_UNREAD) or bytes left unread since the last look, one non-blocking pass of the io loop:
        frames are read, and announced payloads whose receive is not posted are read aside
        (PARK_AFTER_REMOTE), so the peer's transfer goes on. Small messages are left to the process's
        own calls: where ranks outnumber the cores a thread that wakes for them costs more than it
        saves (pp, 8 ranks on 2 cores, 48 KiB microbatches: steps 22-35% longer with it looking)."""
        poller = select.poll()
        with self._io:
            watched = self._watch_remote(poller, set())
        waits, unread = -1, 0
        count = bytearray(4)
        while watched and not self._stop.wait(self._progress_s):  # (until every stream from another host ends)
            if time.monotonic() >= self._armed_until:
                self._arm.clear()  # (then what armed or stopped it before the clear is looked at again)
                if time.monotonic() >= self._armed_until and not self._stop.is_set():
                    self._arm.wait()
                waits, unread = -1, 0
                continue
            if waits != self._waits:
                waits, unread = self._waits, 0
                continue  # the process calls in: it reads what comes
            ready = poller.poll(0)
            if not ready:
                unread = 0
                continue  # nothing came from another host
            seen = 0
            for fd, _ in ready:
                try:
                    fcntl.ioctl(fd, termios.FIONREAD, count)
                except OSError:  # (closed meanwhile: the pass below drops it)
                    seen = _BIG_UNREAD
                    break
                seen += int.from_bytes(count, sys.byteorder)
            if seen < _BIG_UNREAD and not (unread and seen >= unread):
                unread = seen  # a little: the process may read it yet
                continue
            unread = 0
            if not self._io.acquire(blocking=False):
                continue  # a waiter drives: it reads what came
            try:
                if self.closed:
                    return
                self._drain(0.0)
                watched = self._watch_remote(poller, watched)
            finally:
                self._io.release()
            with self._cond:
                self._cond.notify_all()

    def _armed(self, peer: int) -> None:
        """A bulk payload goes to or comes from `peer`: if it is on another host, the background reader looks."""
        if peer in self._remote and self._reader is not None:
            self._armed_until = time.monotonic() + _ARMED_FOR
            if not self._arm.is_set():
                self._arm.set()

    def _watch_remote(self, poller: "select.poll", watched: Set[int]) -> Set[int]:
        """Make `poller` watch the open streams from ranks on other hosts (io lock held); their fds."""
        bulk = self._bulk
        fds = {sock.fileno() for peer, _, sock in bulk.streams()
               if peer in self._remote and peer not in bulk.closed_by and peer not in bulk.ended}
        for fd in watched - fds:
            poller.unregister(fd)
        for fd in fds - watched:
            poller.register(fd, select.POLLIN)
        return fds

    # -- data path -----------------------------------------------------------------------------
    def _start_send(self, req: Request) -> None:
        peer, key, dtype, view = req.peer, req.key, req.dtype, req.view
        header = wire.pack_header(wire.KIND_DATA, dtype, key.comm_id, key.seq, key.tag, req.nbytes)
        sock = self._dealers[peer]
        if sock is None:
            raise ValueError(f"rank {self.rank}: this tcp transport does not connect to rank {peer} "
                             f"(it serves ranks {self.peers})")
        if peer == self.rank or not self._framed:
            with self._send_locks[peer]:
                if self._flow is not None and peer != self.rank and not self._flow.admit(peer, req.nbytes):
                    self._hold(peer, req.nbytes, req, lambda: self._send_data(sock, header, req, view))
                    return
                self._send_data(sock, header, req, view)
            return
        if req.nbytes >= self._bulk_threshold:
            self._bulk_send(req, peer, key, dtype)
            return
        with self._send_locks[peer]:
            if self._flow is not None and not self._flow.admit(peer, req.nbytes):
                self._hold(peer, req.nbytes, req, lambda: self._send_frame(peer, header, req))
                return
            self._send_frame(peer, header, req)

    def _send_frame(self, peer: int, header: bytes, req: Request) -> None:
        """Put a data frame on the peer's stream 0 (its send lock held): copied with its header into
        one write if small, else written from the user's buffer and tracked."""
        bulk = self._bulk
        if peer in bulk.closed_by:
            fail(req, PeerError(f"rank {self.rank}: cannot send to rank {peer}: {bulk.closed_by[peer]}", peer))
            return
        if req.nbytes < self._copy_threshold:
            queued = bulk.send_frame(peer, header + req.view)
            req.done = True
        else:
            queued = bulk.send(peer, Outgoing(req.view, _completes(req)), ONE_STREAM, header)
        if queued:
            self._wake()  # whoever drives must now poll that stream for writing

    def _send_data(self, sock: zmq.Socket, header: bytes, req: Request, view: memoryview) -> None:
        """Put a message on zmq (the peer's send lock held; to ourselves, or to anyone with
        PYCOLL_TCP_BULK_THRESHOLD=inf): copied if small, else zero-copy and tracked."""
        sock.send(header, SNDMORE)
        if req.nbytes >= self._copy_threshold:
            req.handle = sock.send(view, copy=False, track=True)
        else:
            sock.send(view)
            req.done = True

    def _bulk_send(self, req: Request, peer: int, key: MsgKey, dtype: int) -> None:
        """Announce on stream 0 (header and cut), then queue the payload on the streams of its cut, in
        one order per peer."""
        def start() -> None:
            layout = self._bulk.layout(peer, req.nbytes)
            if self._bulk.send(peer, Outgoing(req.view, _completes(req)), layout,
                               announce + wire.LAYOUT.pack(*layout)):
                self._wake()  # whoever drives must now poll its streams for writing

        announce = wire.pack_header(wire.KIND_BULK, dtype, key.comm_id, key.seq, key.tag, req.nbytes)
        self._armed(peer)
        with self._send_locks[peer]:  # the announcement costs credit: it keeps its place among the messages
            if self._flow is not None and not self._flow.admit(peer, 0):
                self._hold(peer, 0, req, start)
            else:
                start()

    # -- flow control (flow.py) ------------------------------------------------------------------
    def _hold(self, peer: int, nbytes: int, req: Request, start: Callable[[], None]) -> None:
        """A send past the peer's credit waits, its request not done (send lock held)."""
        self._flow.hold(peer, nbytes, start, req, time.monotonic())  # a driver asks for credit (_drain)

    def _ask_stalled(self) -> float:
        """ASK the peers whose held sends have waited ASK_AFTER s for credit; seconds until the next."""
        asks, wait = self._flow.asks_due(time.monotonic())
        for peer in asks:
            with self._send_locks[peer]:
                if peer not in self.dead:
                    self._dealers[peer].send_multipart([wire.pack_header(wire.KIND_ASK, 0, 0, 0, 0, 0), b""])
        return wait

    def _consumed(self, peer: int, nbytes: int) -> None:
        """A message of `nbytes` on zmq from `peer` left our buffers: return credit when a batch is due
        or the peer waits on it."""
        if self._flow is not None and peer != self.rank:
            self._give_credit(peer, self._flow.consumed(peer, nbytes))

    def _give_credit(self, peer: int, amount: int) -> None:
        if amount and peer not in self.dead and not self._dealers[peer].closed:
            with self._send_locks[peer]:
                self._dealers[peer].send_multipart([wire.pack_header(wire.KIND_CREDIT, 0, 0, 0, 0, amount), b""])

    def _credit_back(self, peer: int, amount: int) -> None:
        """The peer returned credit: start the held sends it now covers, in order."""
        if self._flow is None:
            return
        with self._send_locks[peer]:
            for start in self._flow.credit(peer, amount, time.monotonic()):
                start()

    def _credit_asked(self, peer: int) -> None:
        """The peer waits on credit: return what we consumed (a rank without flow control returns plenty)."""
        if self._flow is None:
            self._give_credit(peer, 1 << 62)
        elif peer != self.rank:
            self._give_credit(peer, self._flow.asked(peer))

    def _start_recv(self, req: Request) -> None:
        with self._match:
            arrival = self.matcher.post(req)  # what a peer sent before dying still counts
        if arrival is None:
            if req.peer == ANY or self._bulk.blocked(req.peer):
                self._wake()  # the driver may have to read aside a payload that holds up its frames
            return
        header, frame = arrival
        self._consumed(req.peer, header.nbytes if header.kind == wire.KIND_DATA else 0)
        req.check_incoming(self.rank, header.nbytes, header.dtype)
        if isinstance(frame, _Parked):
            with self._match:
                if frame.buffer is None and frame.error is None:  # still unread: it lands in place
                    self._aim(req, frame.incoming)
                    self._wake()  # whoever drives must now read that stream
                    return
                if not frame.complete:  # being read aside: its completion delivers
                    frame.req = req
                    return
            if frame.error is not None:
                fail(req, frame.error)
                return
            data = frame.buffer
        else:
            data = frame  # the payload, a memoryview
        self._check_length(req, len(data))
        if req.error is None:
            req.deliver(data)
        if isinstance(frame, _Parked):  # copied out: its buffer serves the next parked payload
            self.scratch.give(frame.raw)
        req.done = True

    def wait_for(self, reqs: Sequence[Request], timeout: float) -> bool:
        self._waits += 1
        deadline = time.monotonic() + timeout
        faults = self.matcher.faults
        while True:
            pending = [r for r in reqs if not r.done and not self._send_finished(r)]
            if not pending:
                return True
            if self.matcher.faults != faults:  # a death or revocation: fail what it stops (sends too)
                faults = self.matcher.faults
                if self.matcher.fail_pending(pending):
                    continue
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            step = min(left, _SLICE)
            if any(r.is_recv or r.handle is None for r in pending):  # receives or bulk sends
                self._progress(pending, step)
            else:
                try:
                    pending[0].handle.wait(min(step, _SEND_SLICE))
                except zmq.NotDone:
                    self._progress(pending, 0.0)  # notice a peer that died with our data unsent
                    self.matcher.fail_pending(pending)

    def progress(self) -> None:
        """One non-blocking turn of the io loop (flush queued bulk writes, read what arrived, answer
        credit), unless another thread drives it: lets a caller blocked elsewhere keep this wire moving."""
        self._progress([], 0.0)

    @staticmethod
    def _send_finished(req: Request) -> bool:
        if not req.is_recv and req.handle is not None and req.handle.done:
            req.done = True
        return req.done

    def _progress(self, pending: List[Request], step: float) -> None:
        if self._io.acquire(blocking=False):
            try:
                self._drain(step)
            finally:
                self._io.release()
            with self._cond:
                self._cond.notify_all()
        else:
            with self._cond:  # (a leader releases the io lock, then notifies: under the lock, not missed)
                if self._io.locked() and any(not r.done for r in pending):
                    self._cond.wait(step)

    def _drain(self, step: float) -> None:
        """Wait up to `step` s for traffic, then handle every message already queued (io lock held)."""
        step = min(step, self._park_stalled())
        if self._flow is not None and self._flow.held:
            step = min(step, self._ask_stalled())
        if self._bulk.buffered and self._bulk.read_buffered():
            step = 0.0  # a payload claimed with its first bytes read ahead: read on, then look again
        self._poll_streams()
        spin = self._spin_poll.poll
        hits = spin(0)
        if not hits and step > 0 and self._spin_s:  # a reply due within microseconds is seen without a wake-up
            spin_until = time.monotonic() + self._spin_s  # (a wake-up is costly on a VM)
            while time.monotonic() < spin_until:
                os.sched_yield()  # (other ranks on this core produce what we wait for)
                hits = spin(0)
                if hits:
                    break
        now = time.monotonic()
        if hits and now < self._next_router:  # the streams have work: zmq's poll (costly) at most every _ROUTER_EVERY
            events = dict(hits)
        else:
            self._next_router = now + _ROUTER_EVERY
            events = dict(self._poller.poll(0 if hits or step <= 0 else math.ceil(step * 1000)))  # zmq's too
        if self._wake_r.fileno() in events:  # zmq's poller reports plain sockets by fd
            self._drain_wakeups()
        for lane in self._bulk_polled:
            ev = events.get(self._bulk.socks[lane[0]][lane[1]].fileno(), 0)
            if ev & POLLOUT:
                self._bulk.flush(*lane)
            if ev & (POLLIN | POLLERR):
                self._bulk.read(*lane)
        if self._router in events:
            self._read_router()
        now = time.monotonic()
        if not events or now >= self._next_watch:
            self._next_watch = now + _WATCH_EVERY
            watched = dict(self._watch.poll(0))
            if self._monitor in watched:
                self._log_monitor_events()
            for monitor in self._peer_monitors:
                if monitor in watched:
                    self._peer_lost(monitor)
        if self._lost_at:
            self._expire_lost()

    def _poll_streams(self) -> None:
        """Poll each raw stream for reading while payloads are announced, for writing while queued."""
        bulk = self._bulk
        for peer, stream, sock in bulk.streams():
            lane = (peer, stream)
            flags = (POLLIN if bulk.wants_read(peer, stream) else 0) | \
                (POLLOUT if bulk.wants_write(peer, stream) else 0)
            if flags != self._bulk_polled.get(lane, 0):
                if not flags:
                    self._poller.unregister(sock)
                    self._spin_poll.unregister(sock)
                    del self._bulk_polled[lane]
                else:
                    self._poller.register(sock, flags)  # registering again modifies
                    self._spin_poll.register(sock, (select.POLLIN if flags & POLLIN else 0) |
                                             (select.POLLOUT if flags & POLLOUT else 0))
                    self._bulk_polled[lane] = flags

    def _wake(self) -> None:
        """Interrupt the driver's poll; a full socket means a wake-up is pending already (a burst of
        bulk sends, e.g. held ones that credit released, writes one byte each)."""
        try:
            self._wake_w.send(b"w")
        except BlockingIOError:
            pass

    def _drain_wakeups(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    def _read_router(self) -> None:
        router = self._router
        while router.getsockopt(EVENTS) & POLLIN:  # cheaper than recv raising zmq.Again at the end
            ident = router.recv(NOBLOCK)
            frames_left = router.getsockopt(RCVMORE)
            try:
                header = wire.unpack_header(router.recv()) if frames_left else None
            except ValueError as e:
                header, reason = None, str(e)
            else:
                reason = "truncated message (no header or no payload frame)"
            if header is None or not router.getsockopt(RCVMORE):
                self._reject(ident, reason)
                continue
            if header.kind == wire.KIND_HELLO:
                self._accept_hello(ident, router.recv())
                self._skip_rest()  # extra frames after a hello are never a message of their own
                continue
            peer = self._ident_rank.get(ident)
            if peer is None:
                self._reject(ident, "data from a connection that never authenticated")
            elif peer in self._forgotten:  # agreed dead, maybe alive behind a partition: not listened to
                self._skip_rest()
            elif header.kind == wire.KIND_BYE:
                self._skip_rest()
                self._said_bye.add(peer)
            elif header.kind == wire.KIND_BULK:  # announcements travel on the pair's stream 0
                self._reject(ident, f"rank {peer} announced a bulk payload on zmq")
            elif header.kind == wire.KIND_CREDIT:
                self._skip_rest()
                self._credit_back(peer, header.nbytes)
            elif header.kind == wire.KIND_ASK:
                self._skip_rest()
                self._credit_asked(peer)
            else:
                self._deliver(peer, header)

    def _deliver(self, peer: int, header: wire.Header) -> None:
        """A data message on zmq (to ourselves, or every message with frames off): its payload frame,
        handled as a stream's data frame is (kept as it is if unexpected: zmq's frame is ours)."""
        payload = self._router.recv(copy=False).buffer
        self._skip_rest()
        self._deliver_frame(peer, header, payload, owned=True)

    def _on_frame(self, peer: int, header: wire.Header, layout: Optional[Layout],
                  payload: Optional[memoryview]) -> None:
        """A frame came on the peer's stream 0 (bulk.py reads them, io lock held)."""
        kind = header.kind
        if kind == wire.KIND_DATA:
            if payload is not None:
                self._deliver_frame(peer, header, payload)
            else:
                self._expect_frame(peer, header)
        elif kind == wire.KIND_BULK:
            self._announce(peer, header, layout)
        else:  # KIND_BYE: after its last data
            self._said_bye.add(peer)

    def _deliver_frame(self, peer: int, header: wire.Header, payload: memoryview, owned: bool = False) -> None:
        """A data message whose payload came whole with it: into its receive, or kept as unexpected,
        copied unless `owned` (a stream's frame lies in its read-ahead buffer, reused after this call)."""
        match = (peer, header.comm_id, header.seq, header.tag)
        with self._match:
            req = self.matcher.take(match)
            if req is None:
                kept = self.matcher.stash(match, (header, payload if owned else memoryview(bytes(payload))))
        if req is None:
            if not kept:  # a revocation notice, acted on
                self._consumed(peer, header.nbytes)
            return
        req.check_incoming(self.rank, header.nbytes, header.dtype)
        self._check_length(req, len(payload))  # (zmq's frame may not be the size its header says)
        if req.error is None:
            req.deliver(payload)
        req.done = True
        self._consumed(peer, header.nbytes)

    def _expect_frame(self, peer: int, header: wire.Header) -> None:
        """A data frame whose payload is still on its way: it lands in its receive (or its sink), or,
        before the receive is posted, in a scratch buffer at once (frames behind it must not wait)."""
        match = (peer, header.comm_id, header.seq, header.tag)
        nbytes = header.nbytes
        with self._match:
            req = self.matcher.take(match)
            incoming = Incoming(nbytes, lambda error: None)
            if req is None:
                parked = incoming.owner = _Parked(peer, incoming)
                parked.raw = self.scratch.take(nbytes)
                incoming.target = parked.buffer = memoryview(parked.raw[:nbytes])
                incoming.on_done = lambda error: self._unparked(parked, error)
                self.matcher.stash(match, (header, parked))  # (a revocation notice has no payload: never here)
            self._bulk.expect(peer, incoming, ONE_STREAM)
        if req is not None:
            self._consumed(peer, nbytes)
            req.check_incoming(self.rank, nbytes, header.dtype)
            self._aim(req, incoming)

    def _stream_ended(self, peer: int) -> None:
        """The peer's stream 0 ended or broke: without a goodbye before it, the peer is lost (declared
        dead after the grace period, as when its zmq connection drops)."""
        if peer not in self._said_bye and peer not in self.dead and not self.closed:
            self._lost_at.setdefault(peer, time.monotonic())

    def _announce(self, peer: int, header: wire.Header, layout: Layout) -> None:
        """A bulk payload is next on the peer's streams, cut as `layout` says: aim it at its receive,
        or park it."""
        if not 1 <= layout.parts <= layout.width <= len(self._bulk.socks[peer]) or layout.first >= layout.width:
            why = f"cut as {tuple(layout)} (parts, first, width) over {len(self._bulk.socks[peer])} streams"
            self._reject(b"", f"rank {peer} announced a bulk payload we cannot place: {why}")
            self._bulk.fail(peer, f"announced a bulk payload we cannot place ({why})")  # its streams are out of step
            return
        self._armed(peer)
        match = (peer, header.comm_id, header.seq, header.tag)
        with self._match:
            req = self.matcher.take(match)
            incoming = Incoming(header.nbytes, lambda error: None)
            if req is None:
                parked = incoming.owner = _Parked(peer, incoming)
                incoming.on_done = lambda error: self._unparked(parked, error)
                if not self.matcher.stash(match, (header, parked)):  # a revocation notice, acted on:
                    incoming.target = memoryview(bytearray(header.nbytes))  # its bytes are read and dropped
                    self._consumed(peer, 0)
            self._bulk.expect(peer, incoming, layout)
        if req is not None:
            self._consumed(peer, 0)
            req.check_incoming(self.rank, header.nbytes, header.dtype)
            self._aim(req, incoming)

    def _aim(self, req: Request, incoming: Incoming) -> None:
        """Claim a bulk payload for `req`: read into its buffer, or through its sink piece by piece
        (reducing while in cache); a payload that does not fit it is read and dropped."""
        incoming.on_done = lambda error: fail(req, error)
        if req.error is None and req.sink is None:
            incoming.target = req.view
            return

        def consume(piece: memoryview, offset: int) -> None:
            if req.error is None:
                req.deliver(piece, offset)
        incoming.consume = consume

    def _park_stalled(self) -> float:
        """Read aside the unclaimed payloads that have held up their stream for PARK_AFTER s, and at
        once those of a peer that we lost (its goodbye may be behind them) or that hold up its frames
        while we have a receive posted from it (it may wait on one of them); the seconds until the
        next one is due (inf if none waits)."""
        now, due = time.monotonic(), math.inf
        for incoming in self._bulk.unclaimed_heads():
            with self._match:
                if incoming.claimed:
                    continue
                parked = incoming.owner
                peer = parked.peer
                after = PARK_AFTER_REMOTE if peer in self._remote else PARK_AFTER
                if now - incoming.since < after and peer not in self._lost_at and not (
                        self._bulk.blocks_frames(peer, incoming)
                        and any(m[0] == peer or m[0] == ANY for m in self.matcher.posted)):
                    due = min(due, incoming.since + after - now)
                    continue
                parked.raw = self.scratch.take(incoming.nbytes)  # read into it until its receive comes
                incoming.target = parked.buffer = memoryview(parked.raw[:incoming.nbytes])
        return due

    def _unparked(self, parked: _Parked, error: Optional[BaseException]) -> None:
        """A parked payload is complete; hand it to the receive that claimed it meanwhile, if any."""
        with self._match:
            parked.complete, parked.error = True, error
            req = parked.req
        if req is None:
            return
        if error is None and req.error is None:
            req.deliver(parked.buffer)
        if error is None:
            self.scratch.give(parked.raw)
        fail(req, error)

    def _peer_lost(self, monitor: zmq.Socket) -> None:
        """A peer's connection dropped: keep what it sent, fail every receive still waiting on it."""
        try:
            while True:
                monitor.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            pass
        peer = self._peer_monitors[monitor]
        if peer not in self.dead and not self.closed:
            self._lost_at.setdefault(peer, time.monotonic())

    def _expire_lost(self) -> None:
        """Declare dead the peers dropped more than _GRACE s ago; a peer that closes normally
        drops one connection while its last messages still flush on the other."""
        now = time.monotonic()
        for peer, since in list(self._lost_at.items()):
            if now - since >= _GRACE:
                self._declare_dead(peer)  # (still counted lost meanwhile: what holds up its stream is read aside)
                del self._lost_at[peer]

    def _declare_dead(self, peer: int) -> None:
        """A peer that said bye only fails what waits on it; one that vanished breaks the whole job
        (like NCCL's abort): a collective waiting on any rank would otherwise hang on it."""
        self._read_router()  # messages that arrived before the drop are still good
        if self._framed and peer in self._bulk.socks:  # frames that came before the drop, its goodbye among them
            self._park_stalled()  # (what holds up its stream 0 is read aside: the peer is lost)
            if self._bulk.wants_read(peer, 0):
                self._bulk.read(peer, 0)
        died = peer not in self._said_bye
        fresh = peer not in self.matcher.dead  # not settled by the survivors' agreement already
        self.dead[peer] = ("its connection dropped without a goodbye: the process died" if died else
                           "it closed its communicator")
        log.warning("rank %d: lost the tcp connection to rank %d (%s)", self.rank, peer, self.dead[peer])
        with self._match:
            if died:
                self.matcher.break_job(PeerError(
                    f"rank {self.rank}: rank {peer} died (its tcp connection dropped without a goodbye); this "
                    "communicator cannot complete collectives any more: recreate it", peer))
            else:
                self.matcher.peer_gone(peer, self.dead[peer])
        if peer in self._bulk.socks:  # payloads half-way on its stream, either direction
            self._bulk.fail(peer, self.dead[peer])
        if self._flow is not None:  # sends held back for credit that will not come
            for p in (self.peers if died and fresh else [peer]):
                with self._send_locks[p]:
                    for req in self._flow.drop(p):
                        fail(req, self.matcher.broken or PeerError(
                            f"rank {self.rank}: send to rank {p} could not finish: {self.dead[peer]}", p))

    def _fault_domains(self) -> List[Tuple[ContextManager, Matcher]]:
        return [(self._match, self.matcher)]

    def settle(self, dead: Iterable[int]) -> None:
        """Also close the agreed-dead peers' connections (zmq, its monitor, raw streams) and drop their
        flow-control state: nothing of theirs is kept, retried (zmq reconnects) or listened to."""
        dead = list(dead)
        super().settle(dead)
        fresh = [p for p in dead if p != self.rank and p in self.peers and p not in self._forgotten]
        if not fresh:
            return
        with self._io:  # the poller and the zmq sockets are the driver's: not while it polls them
            for peer in fresh:
                self._forget(peer)

    def _forget(self, peer: int) -> None:
        """Let go of agreed-dead `peer` for good (io lock held)."""
        why = "the survivors agreed that it died"
        self._forgotten.add(peer)
        self._lost_at.pop(peer, None)
        self.dead.setdefault(peer, why)
        with self._send_locks[peer]:
            sock, self._dealers[peer] = self._dealers[peer], None
            if sock is not None:  # its monitor is stopped before it is closed (as in _shutdown)
                sock.disable_monitor()
                sock.close(linger=0)
            held = self._flow.forget(peer) if self._flow is not None else []
        for monitor in [m for m, p in self._peer_monitors.items() if p == peer]:
            self._watch.unregister(monitor)
            del self._peer_monitors[monitor]
            monitor.close(linger=0)
        for req in held:
            fail(req, PeerError(f"rank {self.rank}: send to rank {peer} could not finish: {why}", peer))
        for lane in [lane for lane in self._bulk_polled if lane[0] == peer]:
            self._poller.unregister(self._bulk.socks[peer][lane[1]])
            self._spin_poll.unregister(self._bulk.socks[peer][lane[1]])
            del self._bulk_polled[lane]
        self._bulk.forget(peer, why)

    def _release(self, arrivals: List[Tuple[Match, Any]]) -> None:
        """Purged arrivals were never consumed: return their credit to their senders."""
        for match, (header, _) in arrivals:
            self._consumed(match[0], header.nbytes if header.kind == wire.KIND_DATA else 0)

    def _check_length(self, req: Request, got: int) -> None:
        if got != req.nbytes and req.error is None:
            req.error = PeerError(f"rank {self.rank}: rank {req.peer} announced {req.nbytes} bytes but "
                                  f"sent {got}", req.peer)

    def _accept_hello(self, ident: bytes, payload: bytes) -> None:
        try:
            self._ident_rank[ident] = wire.check_hello(self._token, self.rank, payload, size=self.size,
                                                       seen=self._seen_nonces)
        except ValueError as e:
            self._reject(ident, str(e))

    def _skip_rest(self) -> None:
        while self._router.getsockopt(RCVMORE):
            self._router.recv(copy=False)

    def _reject(self, ident: bytes, reason: str) -> None:
        self._skip_rest()
        self.rejected += 1
        self.rejects.warning("rank %d: tcp transport dropped a message from connection %s: %s",
                             self.rank, ident.hex(), reason)

    def _log_monitor_events(self) -> None:
        while True:
            try:
                frames = self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            endpoint = frames[1].decode(errors="replace") if len(frames) > 1 else "?"
            self.rejected += 1
            self.rejects.warning("rank %d: tcp transport rejected a connection on %s that does not speak "
                                 "the protocol (handshake failed)", self.rank, endpoint)

    def _shutdown(self) -> None:
        if self._reader is not None:
            self._stop.set()
            self._arm.set()
            self._reader.join()
        deadline = time.monotonic() + _LINGER_MS / 1000
        while self._flow is not None and self._flow.held and self.matcher.broken is None \
                and time.monotonic() < deadline:  # sends still waiting on credit go before our goodbye
            with self._io:
                self._drain(_SLICE)
        for peer, sock in enumerate(self._dealers):  # stop each monitor before closing its socket
            if sock is not None and peer != self.rank:
                sock.disable_monitor()
        for monitor in self._peer_monitors:
            monitor.close(linger=0)
        framed = [p for p in self._bulk.socks if self._framed and p not in self.dead]
        for peer in framed:  # after our last data, in order, on the stream that carried it
            with self._send_locks[peer]:
                if peer not in self._bulk.closed_by:
                    self._bulk.send_frame(peer, _BYE)
        self._bulk.drain_sends(time.monotonic() + _LINGER_MS / 1000)
        for peer, sock in enumerate(self._dealers):
            if sock is not None:
                if peer != self.rank and peer not in self.dead and peer not in framed:  # after our last data
                    sock.send_multipart([_BYE, b""])
                sock.close()
        self._router.disable_monitor()
        self._monitor.close(linger=0)
        self._router.close(linger=0)
        self._bulk.close()
        self.rejects.flush()
        self._bulk.rejects.flush()
        self._wake_r.close()
        self._wake_w.close()
        self._ctx.term()

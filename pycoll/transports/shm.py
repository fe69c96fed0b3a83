"""Shared-memory transport: ranks on one host pass messages through ring buffers in /dev/shm.

Each rank owns one segment holding a ring per local sender (src -> me), its memory allocated and
its mappings' page tables filled at connect (a full /dev/shm is an error then, not a SIGBUS later,
and no page faults while data flows). A sender copies a framed message [wire header | payload]
into the receiver's ring; the receiver copies the payload straight into the posted buffer, or
hands it in place to the receive's sink (the ring algorithms reduce straight out of shared
memory), so a message costs at most one copy each way. A message nobody has asked for yet waits
in the ring, and is copied out as unexpected only when it is in the way or the receiver is about
to sleep. Messages larger than the ring stream through it under flow control. A waiter sweeps the
rings, yielding the CPU between sweeps, and after _SPIN_SWEEPS fruitless sweeps or _SPIN seconds of
them, whichever comes first (on a crowded machine each yield can give the CPU away for
milliseconds), sleeps on a unix datagram socket (its doorbell) that peers poke after publishing
data or freeing space it waits for. Every sweep acts on a revocation notice at the head of a ring,
so a revoke reaches a spinning rank at once, and a sleeping one when its doorbell rings. Segment
names are random per job, travel through the authenticated store and carry token HMACs; each
segment is unlinked as soon as every peer has mapped it, so nothing is left in /dev/shm after
close() or kill -9. Between the header and the rings each segment has a board (shm_board.py): lanes
where single-host communicators run small collectives without messages, and stages where they run
large allreduces two-shot. A sleeper also polls a pidfd per local peer: a peer that exits without
marking its segment closed died, and every pending request then fails naming it (as tcp).

Memory ordering: the rings and the board rely on x86-64's total store order (TSO), with no fence of
their own. A writer copies the payload, then stores the head counter (an aligned int64, one store);
a reader loads the head, then reads the payload, then stores the tail; a board post writes its slot,
byte count and signature, then its call counter. TSO keeps stores in order with stores and loads
with loads (and loads before later stores), so whoever sees a counter sees the bytes it publishes.
The only fence is _fence() (its two lines inlined in _wake_sleepers, which runs on every board post),
for the store->load order of the doorbell handshake (the one reordering x86 does). On ARM or POWER a reader could see a new head or counter before the bytes behind it
(stale or garbage payload, a wrong signature), and a writer could reuse space the reader is still
reading; a port needs release stores and acquire loads of the counters (a tiny C helper, or the
`atomics` package; a lock round trip is no full fence there either), or shm refused there. Nothing
checks the architecture today: shm and the board run wherever they are asked to (see
docs/architecture.md).
"""
from __future__ import annotations

import ctypes
import functools
import math
import mmap
import os
import re
import secrets
import select
import socket
import threading
import time
from collections import deque

from typing import ContextManager, Deque, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .. import config
from ..bootstrap.store import Store
from ..errors import PeerError, ProtocolError, TimeoutError
from ..ids import is_notice
from ..scratch import MIN_POOLED
from . import wire
from .base import Request, Transport
from .request import ANY
from .liveness import PidWatch
from .matching import Match, Matcher
from .capabilities import PeerMemory, SharedBoard, SharedMemory, SinkReceive
from .shm_board import BOARD_BYTES, BOARD_CTRL, SLOT_BYTES, STAGE_BYTES, ShmBoard, claim_lane
from .shm_cma import ShmPeerMemory
from .shm_window import ShmWindows

SHM_DIR = "/dev/shm"
_MIN_RING, _MAX_RING = 64 << 10, 16 << 20
_BUDGET = 256 << 20   # what all local segments together may take by default
_PAGE = 4096          # the segment header, and each ring's control block
_SLOT = 64            # frames start on a cache line, so a header never wraps around the ring end
_PIECE = 1 << 20      # bytes copied between counter updates, so a polling peer can start early
_EXIT_GRACE = 0.2    # seconds a peer whose doorbell is gone gets to show its exit (a death, not a close)
_SPIN = 1e-3          # seconds of fruitless sweeps, each followed by a yield of the CPU, before sleeping ...
_SPIN_SWEEPS = 64     # ... or this many sweeps, if sooner (a time alone spins longer on an idle core, taking
                      # CPU from peers that share it)
_SLICE = 0.1          # longest sleep before re-checking deadlines and whether peers are alive
_LINGER = 5.0         # close(): how long queued sends may take to drain
_HELLO_AT = 256       # byte offset of the token proof in the segment header and in each control block
# int64 indices. Segment header: its ring size, "the owner closed its transport", "the owner sleeps
# on its doorbell", the owner's pid, and where the owner has the header mapped (its address: peers
# probe cross-memory attach by reading the token proof there, shm_cma.py). Ring control block: the
# writer's head, the reader's tail and the writer's "sends wait for room", on own lines.
_RING, _CLOSED, _ASLEEP, _PID, _ADDR = 0, 8, 16, 24, 48
_CLOSED_AFTER = 2     # _CLOSED: 1 closed normally, _CLOSED_AFTER + r closed because rank r died
_HEAD, _TAIL, _BLOCKED = 0, 8, 16
_NAME = re.compile(r"pycoll-[0-9a-f]{16}-[0-9]+\Z")
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_FENCE = threading.Lock()



def _fence() -> None:
    """Full memory barrier (the lock's atomic read-modify-write): orders a counter store before the
    doorbell-flag load after it, on both sides, so a sleeper never misses a wake-up. (A locked RMW is a
    full fence on x86; on ARM/POWER a lock's acquire and release are not: see the module docstring.)"""
    _FENCE.acquire()
    _FENCE.release()


def _padded(nbytes: int) -> int:
    return (nbytes + _SLOT - 1) & ~(_SLOT - 1)


def _layout(off: int, nbytes: int, ring: int) -> Tuple[int, int]:
    """(skip, body) of a frame whose header slot is at ring offset `off`: the payload (padded to
    `body`) follows the header, or, when it would wrap around the ring end but fits before the
    header, skips to the ring start so it lies in one piece (both ends compute the same)."""
    body = _padded(nbytes)
    if off + _SLOT + body > ring and body <= off:
        return ring - off - _SLOT, body
    return 0, body


def _ring_at(ring: int, slot: int) -> int:
    """Byte offset of ring `slot`'s control block in a segment of rings of `ring` bytes."""
    return _PAGE + BOARD_BYTES + slot * (_PAGE + ring)


def _ring_bytes(local: int) -> int:
    """The ring size of this rank's segment: PYCOLL_SHM_RING, or the largest power of two up to
    16 MiB (two 4 MiB ring-algorithm segments in flight) keeping all local segments within _BUDGET;
    then halved while they would take more than half of SHM_DIR's free space."""
    want = config.get("PYCOLL_SHM_RING") or min(_MAX_RING, _BUDGET // (local * local))
    ring = 1 << (max(want, _MIN_RING).bit_length() - 1)
    st = os.statvfs(SHM_DIR)
    while ring > _MIN_RING and local * _ring_at(ring, local) > st.f_bavail * st.f_frsize // 2:
        ring //= 2
    return ring


class _Inbound:
    """A message read out of a ring: its payload goes to `dest` (None: dropped), then `req` completes."""

    __slots__ = ("nbytes", "dtype", "got", "skip", "left", "dest", "req", "raw")

    def __init__(self, nbytes: int, dtype: int, skip: int, body: int) -> None:
        self.nbytes, self.dtype, self.got, self.skip, self.left = nbytes, dtype, 0, skip, body
        self.dest: Optional[memoryview] = None
        self.req: Optional[Request] = None
        self.raw: Optional[np.ndarray] = None  # the scratch buffer `dest` views, while it holds the payload


class _Outbound:
    """A send being written into a ring: its header first, then the payload as space frees."""

    __slots__ = ("req", "header", "sent", "skip", "left")

    def __init__(self, req: Request, header: bytes) -> None:
        self.req, self.header, self.sent, self.skip, self.left = req, header, 0, 0, 0


class _Peer:
    """This rank's two rings with one local rank: me -> it (in its segment), it -> me (in mine)."""

    __slots__ = ("rank", "bell", "flags", "board", "board_ctrl", "out_ctrl", "out_data", "out_size", "in_ctrl", "in_data",
                 "in_size", "wpos", "rpos", "queue", "cur", "held", "expecting", "blocked")

    def __init__(self, rank: int, bell: str, flags: memoryview, board: memoryview, out_ctrl: memoryview,
                 out_data: memoryview, in_ctrl: memoryview, in_data: memoryview) -> None:
        self.rank, self.bell, self.flags, self.board = rank, bell, flags, board  # board: its segment's
        self.board_ctrl = board[:BOARD_CTRL].cast("q")  # released before unmapping: see ShmTransport._keep
        self.out_ctrl, self.out_data, self.out_size = out_ctrl, out_data, out_data.nbytes
        self.in_ctrl, self.in_data, self.in_size = in_ctrl, in_data, in_data.nbytes
        self.wpos = self.rpos = 0
        self.queue: Deque[_Outbound] = deque()
        self.cur: Optional[_Inbound] = None
        self.held: Optional[Tuple[Match, int, int]] = None  # header at the read end, not yet taken
        self.expecting = 0  # posted receives from this rank not yet matched
        self.blocked = False  # sends to this rank wait for room (mirrors out_ctrl[_BLOCKED])


class ShmTransport(Transport):
    """Tagged point-to-point between the ranks of one host through shared-memory rings."""

    name = "shm"
    resilient = True

    def __init__(self, rank: int, size: int, address: Optional[str] = None,
                 hosts: Optional[List[str]] = None, *, local_only: bool = False) -> None:
        """`hosts[r]` is rank r's host id; with local_only (AutoTransport) only same-host ranks are
        served, otherwise every rank must share this host."""
        super().__init__(rank, size)
        hosts = hosts or [""] * size
        self.local = [r for r in range(size) if hosts[r] == hosts[rank]]
        if not local_only and len(self.local) < size:
            away = [r for r in range(size) if hosts[r] != hosts[rank]]
            raise ValueError(f"rank {rank}: PYCOLL_TRANSPORT=shm needs every rank on one host, but ranks "
                             f"{away} are on other hosts than rank {rank} (host id {hosts[rank]!r}); "
                             "use PYCOLL_TRANSPORT=auto or tcp")
        self.segments: Dict[int, str] = {}  # rank -> segment name (unlinked once connected)
        self.ring_bytes = 0                 # the size of the rings in my segment, once connected
        self._peers: List[Optional[_Peer]] = [None] * size
        self._active: List[_Peer] = []
        self._lock = threading.Lock()       # guards rings, queues and the matching tables
        self._cond = threading.Condition(self._lock)  # followers wait here while another thread drives
        self._driving = False
        self._followers = 0
        self._maps: List[mmap.mmap] = []
        self._views: List[memoryview] = []  # every view into the maps, released before unmapping
        self._path: Optional[str] = None    # my segment's file, until unlinked
        self._bell: Optional[socket.socket] = None
        self._poll = select.poll()
        self._pids = PidWatch(rank, self._poll)  # local peers' processes, polled beside the doorbell
        self.capabilities.update({SinkReceive: SinkReceive(), SharedBoard: _Boards(self),
                                  SharedMemory: ShmWindows(rank, self._pid_of),
                                  PeerMemory: ShmPeerMemory(rank, self._probe_of)})

    # -- connection set-up -------------------------------------------------------------------
    def connect(self, store: Store, token: bytes, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        me, slot = self.rank, {r: i for i, r in enumerate(self.local)}
        name = f"pycoll-{secrets.token_hex(8)}-{me}"
        self.ring_bytes = ring = _ring_bytes(len(self.local))
        mine = self._create(os.path.join(SHM_DIR, name), ring)
        mine[_HELLO_AT:_HELLO_AT + wire.HELLO.size] = wire.make_hello(token, me, me, secrets.token_bytes(16))
        self._bell = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._bell.bind("\0" + name)  # abstract namespace: vanishes with the process
        self._bell.setblocking(False)
        self._poll.register(self._bell, select.POLLIN)
        store.set(f"shm/{me}", name.encode())
        self._await(store, "shm/{}", deadline, "published a shared-memory segment")
        for p in self.local:
            peer_name = store.get(f"shm/{p}", 1.0).decode()
            if not _NAME.match(peer_name) or not peer_name.endswith(f"-{p}"):
                raise PeerError(f"rank {me}: rank {p} published a bad segment name {peer_name!r}", p)
            self.segments[p] = peer_name
            if p == me:
                head = self._keep(mine[:_PAGE + BOARD_BYTES])
                out = self._keep(mine[_ring_at(ring, slot[me]):_ring_at(ring, slot[me] + 1)])
            else:
                head, out = self._attach(os.path.join(SHM_DIR, peer_name), p, slot[me])
            head, board = self._keep(head[:_PAGE]), self._keep(head[_PAGE:])
            self._verify(token, bytes(head[_HELLO_AT:_HELLO_AT + wire.HELLO.size]), p, p, "the segment")
            out[_HELLO_AT:_HELLO_AT + wire.HELLO.size] = wire.make_hello(token, me, p, secrets.token_bytes(16))
            at = _ring_at(ring, slot[p])  # p's ring inside mine
            peer = _Peer(p, "\0" + peer_name, self._keep(head.cast("q")), board, self._keep(out[:_PAGE].cast("q")),
                         self._keep(out[_PAGE:]), self._keep(mine[at:at + _PAGE].cast("q")),
                         self._keep(mine[at + _PAGE:at + _PAGE + ring]))
            self._keep(peer.board_ctrl)
            self._peers[p] = peer
            self._active.append(peer)
        store.set(f"shm/{me}/attached", b"1")
        self._await(store, "shm/{}/attached", deadline, "mapped the shared-memory segments")
        os.unlink(self._path)  # every peer has it mapped: from now on the memory dies with the job
        self._path = None
        for p in self.local:
            at = _ring_at(ring, slot[p]) + _HELLO_AT
            self._verify(token, bytes(mine[at:at + wire.HELLO.size]), p, me, "the ring writer")
            if p != me:  # a sleeper learns at once that it died (without a pidfd, _fail_if_gone remains)
                self._pids.watch(p, self._peers[p].flags[_PID], f"rank {p}")

    def _create(self, path: str, ring: int) -> memoryview:
        """My segment, with all its memory allocated now: a full /dev/shm is an error here, not a
        SIGBUS later, and no ring page faults in the middle of a collective."""
        nbytes = _ring_at(ring, len(self.local))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._path = path
        try:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                raise OSError(f"rank {self.rank}: cannot allocate {nbytes} bytes of shared memory in {SHM_DIR} "
                              f"({e.strerror}); in a container raise --shm-size, or set PYCOLL_TRANSPORT=tcp "
                              "(or a smaller PYCOLL_SHM_RING)") from None
            seg = self._mmap(fd, nbytes, 0)
        finally:
            os.close(fd)
        head = seg[:_PAGE].cast("q")
        head[_RING], head[_PID] = ring, os.getpid()
        head[_ADDR] = ctypes.addressof(ctypes.c_char.from_buffer(seg))
        head.release()
        return seg

    def _attach(self, path: str, owner: int, slot: int) -> Tuple[memoryview, memoryview]:
        """Map the header page and board of rank `owner`'s segment, and my ring in it (control block + data)."""
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise PeerError(f"rank {self.rank}: the shared-memory segment {path} of rank {owner} is gone "
                            "(that rank gave up or died while connecting)", owner) from None
        try:
            nbytes = os.fstat(fd).st_size  # too short for a header: read as ring size 0, rejected below
            head = self._mmap(fd, _PAGE + BOARD_BYTES, 0) if nbytes >= _PAGE + BOARD_BYTES else \
                memoryview(bytes(_PAGE))
            ring = head.cast("q")[_RING]
            if ring < _MIN_RING or ring & (ring - 1) or nbytes != _ring_at(ring, len(self.local)):
                raise PeerError(f"rank {self.rank}: segment {path} of rank {owner} ({nbytes} bytes, ring "
                                f"size {ring}) fits no layout for {len(self.local)} ranks (another pycoll?)", owner)
            return head, self._mmap(fd, _PAGE + ring, _ring_at(ring, slot))
        finally:
            os.close(fd)

    def _mmap(self, fd: int, length: int, offset: int) -> memoryview:
        """A shared mapping with its page tables filled in up front (no faults on the data path)."""
        mm = mmap.mmap(fd, length, flags=mmap.MAP_SHARED | _POPULATE, offset=offset)
        self._maps.append(mm)
        return self._keep(memoryview(mm))

    def _keep(self, view: memoryview) -> memoryview:
        self._views.append(view)
        return view

    def _await(self, store: Store, key: str, deadline: float, what: str) -> None:
        """Wait until every local rank has set `key.format(rank)`; TimeoutError names the others."""
        keys = [key.format(p) for p in self.local]
        try:
            store.wait(keys, max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            missing = [p for p, k in zip(self.local, keys) if not store.check([k])]
            raise TimeoutError(f"rank {self.rank}: shm transport: ranks {missing} never {what}",
                               peers=missing) from None

    def _verify(self, token: bytes, proof: bytes, src: int, dst: int, what: str) -> None:
        """Trust `what` of rank `src` only if it carries a hello from `src` to `dst` made with the token."""
        try:
            wire.check_hello(token, dst, proof, src=src)
        except ValueError as e:
            raise PeerError(f"rank {self.rank}: {what} of rank {src} failed authentication ({e}); "
                            "not trusting it", src) from None

    # -- posting -------------------------------------------------------------------------------
    def _start_send(self, req: Request) -> None:
        p, key = self._peer(req.peer), req.key
        header = wire.pack_header(wire.KIND_DATA, req.dtype, key.comm_id, key.seq, key.tag, req.nbytes)
        with self._lock:
            if p.queue or not self._put(p, header, req):
                p.queue.append(_Outbound(req, header))
                self._push(p)

    def _start_recv(self, req: Request) -> None:
        p = None if req.peer == ANY else self._peer(req.peer)  # any source: the matcher counts it (wild)
        with self._lock:
            inb = self.matcher.post(req)
            if inb is not None:
                self._claim(inb, req)
            elif not req.done and p is not None:
                p.expecting += 1

    def _pid_of(self, rank: int) -> Optional[int]:
        """The pid of local rank `rank` (from its segment), None if it is not connected here."""
        p = self._peers[rank]
        return None if p is None else int(p.flags[_PID])

    def _probe_of(self, rank: int) -> Optional[Tuple[int, int, bytes]]:
        """(pid, address in its own memory, bytes) of local rank `rank`'s token proof, as its segment
        header shows them (PeerMemory's probe); None if it is not connected here."""
        p = self._peers[rank]
        if p is None:
            return None
        proof = bytes(p.flags.cast("B")[_HELLO_AT:_HELLO_AT + wire.HELLO.size])
        return int(p.flags[_PID]), int(p.flags[_ADDR]) + _HELLO_AT, proof

    def _peer(self, rank: int) -> _Peer:
        p = self._peers[rank]
        if p is None:
            raise ValueError(f"rank {self.rank}: rank {rank} is not on this host; shm cannot reach it")
        return p

    # -- waiting -------------------------------------------------------------------------------
    def wait_for(self, reqs: Sequence[Request], timeout: float) -> bool:
        for r in reqs:  # usually all done already (sends went straight into the ring)
            if not r.done:
                break
        else:
            return True
        deadline = time.monotonic() + timeout
        faults = -1  # look once on entry (board posts are never admitted), then after each death or revocation
        with self._lock:
            while not all(r.done for r in reqs):
                if self.matcher.faults != faults:
                    faults = self.matcher.faults
                    if self.matcher.fail_pending(reqs):
                        continue
                if not self._driving:
                    self._driving = True
                    try:
                        return self._drive(reqs, deadline)
                    finally:
                        self._driving = False
                        if self._followers:
                            self._cond.notify_all()
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._followers += 1
                self._cond.wait(min(left, _SLICE))
                self._followers -= 1
            return True

    def progress(self) -> None:
        """One non-blocking sweep (drain incoming rings, push queued sends), unless another thread drives."""
        with self._lock:
            if not self._driving and self._sweep(drain=True) and self._followers:
                self._cond.notify_all()

    def _drive(self, reqs: Sequence[Request], deadline: float) -> bool:
        """Sweep the rings until `reqs` are done: after _SPIN_SWEEPS fruitless sweeps or _SPIN s of
        them, each followed by a yield of the CPU, sleep on the doorbell (lock held, released while
        yielding or sleeping)."""
        faults = self.matcher.faults
        look_at = time.monotonic() + _SLICE
        spin_until, idle = 0.0, 0  # when a fruitless spin phase ends (set on its first fruitless sweep), its sweeps
        moved = self._sweep()
        while True:
            if moved:
                if self._followers:
                    self._cond.notify_all()
                spin_until, idle = 0.0, 0
            if all(r.done for r in reqs):
                return True
            if self.matcher.faults != faults:  # a death or revocation: fail what it stops
                faults = self.matcher.faults
                if self.matcher.fail_pending(reqs):
                    moved = False
                    continue
            now = time.monotonic()
            if now >= deadline:
                return False
            if now >= look_at:  # spinning can last long on a crowded machine: look for deaths too
                look_at = now + _SLICE
                for peer in self._pids.exited():
                    self._exited(peer)
            if not spin_until:
                spin_until = now + _SPIN
            if now < spin_until and idle < _SPIN_SWEEPS:
                idle += 1
                self._lock.release()  # let other threads' isend/irecv, and other processes, run
                os.sched_yield()
                self._lock.acquire()
                moved = self._sweep()
            else:
                moved = self._sleep(deadline - now, reqs) or self._fail_if_gone(reqs)
                if self._followers:  # the doorbell may have rung for a follower's board wait
                    self._cond.notify_all()

    def _sleep(self, timeout: float, reqs: Sequence[Request]) -> bool:
        """Raise my doorbell flag, look once more (draining everything), then block on the doorbell;
        True if a sweep moved data or `reqs` are done."""
        flags = self._peers[self.rank].flags
        flags[_ASLEEP] = 1
        _fence()
        if self._sweep(drain=True) or all(r.done for r in reqs):  # (board posts flip done without data)
            flags[_ASLEEP] = 0
            return True
        self._lock.release()
        try:
            events = self._poll.poll(math.ceil(min(timeout, _SLICE) * 1000))
        finally:
            self._lock.acquire()
        for fd, _ in events:
            if fd in self._pids.fds:
                self._exited(self._pids.forget(fd))
            else:
                try:
                    while True:
                        self._bell.recv(64)
                except BlockingIOError:
                    pass
        flags[_ASLEEP] = 0
        return self._sweep()

    def _exited(self, peer: int) -> None:
        """Local peer `peer`'s process exited: if it never closed its transport it died, which breaks
        every collective of this job; a peer that closed fails only what waits on it (_fail_if_gone)."""
        if not self._peers[peer].flags[_CLOSED]:
            self.matcher.break_job(PeerError(
                f"rank {self.rank}: rank {peer} died (its process exited without closing its shm transport); "
                "this communicator cannot complete collectives any more", peer))

    def _learn_failure(self, gone: int) -> None:
        """Local peer `gone` has no doorbell any more: before blaming it, look whether a death is the
        root cause: one of our pidfds already fired (waiting a moment for `gone`'s: a killed process's
        doorbell closes before its exit shows), or `gone` closed because a rank had died."""
        self._pids.wait_exit(gone, _EXIT_GRACE)
        for peer in self._pids.exited():
            self._exited(peer)
        closed = self._peers[gone].flags[_CLOSED]
        if closed >= _CLOSED_AFTER:
            dead = closed - _CLOSED_AFTER
            self.matcher.break_job(PeerError(
                f"rank {self.rank}: rank {dead} died (rank {gone} saw it and closed its shm transport); this "
                "communicator cannot complete collectives any more", dead))

    def _fail_if_gone(self, reqs: Sequence[Request]) -> bool:
        """After a quiet slice: fail the pending requests whose peer no longer has a doorbell (it died
        or closed), instead of letting them wait for the deadline; True if any was failed."""
        peers = set()
        for r in reqs:
            if not r.done:  # an any-source receive waits on every local peer
                peers.update(self.local if r.peer == ANY else (r.peer,))
        peers.discard(self.rank)
        for peer in peers:
            try:
                self._bell.sendto(b"", self._peers[peer].bell)
            except BlockingIOError:
                continue
            except ConnectionRefusedError:
                self._learn_failure(peer)
                self.matcher.peer_gone(peer, "it died or closed its shm transport")
        return self.matcher.fail_pending(reqs)

    def _poke(self, p: _Peer) -> None:
        try:
            self._bell.sendto(b"\1", p.bell)
        except (BlockingIOError, ConnectionRefusedError):
            pass  # a full doorbell rings anyway; a closed one has nobody left to wake

    def _wake(self, p: _Peer, why: int) -> None:
        """After publishing a counter: poke `p` if it sleeps on its doorbell (and, for freed space,
        only if its sends to us are blocked)."""
        _fence()
        if p.flags[_ASLEEP] and (why == _HEAD or p.in_ctrl[_BLOCKED]):
            self._poke(p)

    def _wake_sleepers(self, peers: Sequence[_Peer]) -> None:
        """After publishing a board post: poke those of `peers` that sleep on their doorbells."""
        _FENCE.acquire()  # _fence(), inlined: this runs on every board post
        _FENCE.release()
        for p in peers:
            if p.flags[_ASLEEP]:
                self._poke(p)

    def _sweep(self, drain: bool = False) -> bool:
        """Push queued sends and pull published data on every ring once; True if anything moved.

        A message nobody has asked for yet stays in its ring (so it can later be read straight into
        its receive) unless `drain`, or a receive from that rank waits behind it: a waiter about to
        sleep drains everything into unexpected buffers, so no sender is ever stuck on a full ring."""
        moved = False
        for p in self._active:
            if p.queue and self._push(p):
                moved = True
            if p.in_ctrl[_HEAD] != p.rpos and self._pull(p, drain):
                moved = True
        return moved

    # -- writing -------------------------------------------------------------------------------
    def _put(self, p: _Peer, header: bytes, req: Request) -> bool:
        """The common case in one go: a whole small frame with room for it; else False."""
        nbytes, wpos, ring = req.nbytes, p.wpos, p.out_size
        off = wpos & (ring - 1)
        skip, body = _layout(off, nbytes, ring)
        end = wpos + _SLOT + skip + body
        if body > _PIECE or end - p.out_ctrl[_TAIL] > ring or (off + _SLOT + skip) % ring + body > ring:
            return False
        data = p.out_data
        data[off:off + wire.HEADER.size] = header
        if nbytes:
            at = (off + _SLOT + skip) % ring
            data[at:at + nbytes] = req.view
        # publish: header and payload stores above become visible before this head store (x86-TSO;
        # ARM/POWER would need a release store here)
        p.out_ctrl[_HEAD] = p.wpos = end
        self._wake(p, _HEAD)
        req.done = True
        return True

    def _push(self, p: _Peer) -> bool:
        """Write queued sends to `p` while its ring has room; True if anything was written.

        While sends wait for room the ring says so (BLOCKED), so the reader pokes us as it frees space;
        after raising it we look at the space once more, or a poke sent just before could be missed."""
        start = p.wpos
        self._write(p)
        if p.queue and not p.blocked:
            p.blocked = True
            p.out_ctrl[_BLOCKED] = 1
            _fence()
            self._write(p)
        if p.blocked and not p.queue:
            p.blocked = False
            p.out_ctrl[_BLOCKED] = 0
        return p.wpos != start

    def _write(self, p: _Peer) -> None:
        """Copy queued frames (header slot, skip to the ring start, payload pieces) into free space,
        publishing each piece; the reader is woken once, at the end (a reader waiting for a whole
        frame gains nothing from a wake-up per piece)."""
        queue, data, ctrl, ring = p.queue, p.out_data, p.out_ctrl, p.out_size
        mask = ring - 1
        wpos = start = p.wpos
        free = ring - (wpos - ctrl[_TAIL])  # the reader loaded that space before freeing it (its tail store)
        while queue:
            ob = queue[0]
            if ob.header is not None:
                if free < _SLOT:
                    break
                off = wpos & mask
                data[off:off + wire.HEADER.size] = ob.header
                ob.header = None
                ob.skip, ob.left = _layout(off, ob.req.nbytes, ring)
                wpos += _SLOT
                free -= _SLOT
            if ob.skip:
                n = min(free, ob.skip)
                ob.skip -= n
            else:
                n = min(free, ob.left, _PIECE, ring - (wpos & mask))
                k = min(n, ob.req.nbytes - ob.sent)  # payload; the rest of n is padding
                if k > 0:
                    off = wpos & mask
                    data[off:off + k] = ob.req.view[ob.sent:ob.sent + k]
                    ob.sent += k
                ob.left -= n
            wpos += n
            free -= n
            if not (ob.skip or ob.left):
                queue.popleft()
                ob.req.done = True
            elif not n:
                break
            ctrl[_HEAD] = wpos  # after the piece's bytes: store->store order (x86-TSO; elsewhere a release store)
        if wpos != start:
            ctrl[_HEAD] = wpos  # also when a header went in but no room for the rest yet
            self._wake(p, _HEAD)
        p.wpos = wpos

    # -- reading -------------------------------------------------------------------------------
    def _pull(self, p: _Peer, drain: bool) -> bool:
        """Read what `p` has published: take each header, copy payloads to their targets, free the
        space; True if anything was read."""
        data, ctrl, ring = p.in_data, p.in_ctrl, p.in_size
        mask = ring - 1
        # the head is loaded before the header and payload bytes it covers (load->load order, x86-TSO;
        # ARM/POWER would need an acquire load, or they could read bytes older than the head)
        head, rpos = ctrl[_HEAD], p.rpos
        start = rpos
        while rpos != head:
            cur = p.cur
            if cur is None:
                cur = p.cur = self._arrive(p, rpos, head, drain)
                if cur is None:
                    break
                rpos += _SLOT
            if cur.skip:
                n = min(head - rpos, cur.skip)
                cur.skip -= n
            else:
                n = min(head - rpos, cur.left, _PIECE, ring - (rpos & mask))
                k = min(n, cur.nbytes - cur.got)
                if k > 0:
                    if cur.dest is not None:
                        off = rpos & mask
                        cur.dest[cur.got:cur.got + k] = data[off:off + k]
                    cur.got += k
                cur.left -= n
            rpos += n
            if not (cur.skip or cur.left):
                p.cur = None
                req = cur.req
                if req is not None:
                    if req.sink is not None:
                        req.deliver(cur.dest)
                        self._let_go(cur)
                    req.done = True
            ctrl[_TAIL] = rpos  # after the payload loads above (x86 keeps loads before later stores)
            self._wake(p, _TAIL)
        p.rpos = rpos
        return rpos != start

    def _arrive(self, p: _Peer, rpos: int, head: int, drain: bool) -> Optional[_Inbound]:
        """The header at `rpos`, the read end of `p`'s ring: give its message to the oldest matching
        receive, else buffer it as unexpected, or (None) leave it in the ring for now."""
        ring = p.in_size
        off = rpos & (ring - 1)
        match, nbytes, dtype = p.held or self._header(p, off)  # read only below a head loaded first (_pull)
        first = self.matcher.waiting(match)
        if first is None and not (drain or p.expecting or self.matcher.wild or is_notice(match[1])):
            p.held = match, nbytes, dtype
            return None
        skip, body = _layout(off, nbytes, ring)
        at = (off + _SLOT + skip) % ring
        whole = at + nbytes <= ring  # the payload lies in one piece in the ring
        if first is not None and first.sink is not None and whole and head - rpos < _SLOT + skip + nbytes:
            p.held = match, nbytes, dtype  # for the sink: wait until all of it is there
            return None
        p.held = None
        inb = _Inbound(nbytes, dtype, skip, body)
        if first is None:
            inb.dest = self._aside(inb)
            self.matcher.stash(match, inb)
            return inb
        if first.peer != ANY:  # (an any-source receive was never counted on a peer)
            p.expecting -= 1
        req = self.matcher.take(match)
        req.check_incoming(self.rank, nbytes, dtype)
        if req.error is not None:  # rejected: the payload is read and dropped
            req.done = True
        elif req.sink is None:
            inb.dest, inb.req = req.view, req
        elif whole:  # reduce (or whatever the sink does) straight out of shared memory
            req.deliver(p.in_data[at:at + nbytes])
            req.done = True
            inb.got = nbytes
        else:  # longer than the ring: gather it first
            inb.dest, inb.req = self._aside(inb), req
        return inb

    def _aside(self, inb: _Inbound) -> memoryview:
        """A buffer for a payload read before its receive takes it (or gathered for a sink): from the
        scratch pool if large (given back once the payload is handed over), else a bytearray."""
        if inb.nbytes < MIN_POOLED:
            return memoryview(bytearray(inb.nbytes))
        inb.raw = self.scratch.take(inb.nbytes)
        return memoryview(inb.raw[:inb.nbytes])

    def _let_go(self, inb: _Inbound) -> None:
        """The payload read aside has been handed over: its scratch buffer goes back to the pool."""
        if inb.raw is not None:
            self.scratch.give(inb.raw)
            inb.raw = None

    def _header(self, p: _Peer, off: int) -> Tuple[Match, int, int]:
        """(match key, nbytes, dtype) of the header at `off` in `p`'s ring: wire.unpack_header's checks,
        unpacked in place; ProtocolError for anything else (the stream cannot be trusted after it)."""
        magic, version, kind, dtype, comm_id, seq, tag, nbytes = wire.HEADER.unpack_from(p.in_data, off)
        if magic == wire.MAGIC and version == wire.VERSION and kind == wire.KIND_DATA:
            return (p.rank, comm_id, seq, tag), nbytes, dtype
        try:
            wire.unpack_header(bytes(p.in_data[off:off + wire.HEADER.size]))
            reason = f"message kind {kind} on a data ring"
        except ValueError as e:
            reason = str(e)
        raise ProtocolError(f"rank {self.rank}: the shm ring from rank {p.rank} holds garbage ({reason}); "
                            "does that rank run the same pycoll version?", p.rank)

    def _claim(self, inb: _Inbound, req: Request) -> None:
        """Give unexpected message `inb` to receive `req`: reject it if it does not fit; else hand over
        what is complete, or copy what arrived so far and stream the rest into `req`'s buffer."""
        req.check_incoming(self.rank, inb.nbytes, inb.dtype)
        if req.error is not None:
            inb.dest = None  # the rest of the message is read and dropped
            self._let_go(inb)
            req.done = True
        elif inb.got == inb.nbytes:
            req.deliver(inb.dest)
            self._let_go(inb)
            req.done = True
        elif req.sink is not None:
            inb.req = req  # keeps gathering into its buffer; the sink gets it at the end
        else:
            req.view[:inb.got] = inb.dest[:inb.got]
            inb.dest, inb.req = req.view, req
            self._let_go(inb)

    def _fault_domains(self) -> List[Tuple[ContextManager, Matcher]]:
        return [(self._lock, self.matcher)]

    # -- shutdown ------------------------------------------------------------------------------
    def _shutdown(self) -> None:
        with self._lock:
            queued = [ob.req for p in self._active for ob in p.queue]
        if queued:
            self.wait_for(queued, _LINGER)
        with self._lock:
            if self._peers[self.rank] is not None:  # peers now tell my exit from a death, and learn its cause
                broken = self.matcher.broken
                dead = broken.peer if broken is not None else None
                self._peers[self.rank].flags[_CLOSED] = 1 if dead is None else _CLOSED_AFTER + dead
            self._pids.close()
            self._active.clear()
            self._peers = [None] * self.size
            for view in reversed(self._views):
                view.release()
            for mm in self._maps:
                try:
                    mm.close()
                except BufferError:  # a view into it lives on in a traceback: it unmaps with that
                    pass
            if self._bell is not None:
                self._bell.close()
            if self._path is not None:  # connect() failed before every peer mapped it
                os.unlink(self._path)
                self._path = None


class _Boards(SharedBoard):
    """The boards of an shm transport's segments: a lane in each member's own segment."""

    slot_bytes = SLOT_BYTES
    stage_bytes = STAGE_BYTES

    def __init__(self, transport: ShmTransport) -> None:
        self._t = transport

    def reaches(self, members: Sequence[int]) -> bool:
        return all(self._t._peers[m] is not None for m in members)

    def claim_lane(self, comm_id: int) -> int:
        return claim_lane(self._t._peer(self._t.rank).board_ctrl, comm_id)

    def open(self, comm_id: int, members: Sequence[int], lanes: Dict[int, int]) -> ShmBoard:
        t = self._t
        peers = {m: t._peer(m) for m in members}
        others = [p for m, p in peers.items() if m != t.rank]
        return ShmBoard(t.rank, comm_id, members, lanes, {m: p.board_ctrl for m, p in peers.items()},
                        {m: p.board for m, p in peers.items()}, functools.partial(t._wake_sleepers, others),
                        t.wait)

"""MPI transport (PYCOLL_TRANSPORT=mpi): pycoll's own algorithms over mpi4py nonblocking point-to-point.

pycoll ranks are MPI world ranks; all traffic runs on a private Dup of MPI.COMM_WORLD, as buffers
(never pickled). Wire, keeping the pycoll header and (peer, comm_id, seq, tag) FIFO matching:

* The key is hashed (blake2b) to an MPI tag in [0, tag_space). A message of at most EAGER_BYTES
  travels as one MPI message, header + payload (one copy on each side); a larger one as a header
  message and then the payload with the same MPI tag, posted together under the transport lock so
  the pair stays in order, and received straight into the posted buffer.
* A receiver keeps one header Irecv per (peer, MPI tag), and only while a receive for that pair
  waits, so messages nobody asked for yet stay inside MPI (large ones unsent, MPI's rendezvous).
  When a header arrives it is checked (size or dtype mismatch: ProtocolError, the payload is
  drained into scratch, never into the user's buffer), its payload Irecv is posted before the next
  header Irecv (MPI's non-overtaking rule pairs them), and a header with another key (a hashed-tag
  collision) is kept with its payload as unexpected, as tcp does.

Progress: whoever waits runs Testsome over every MPI request the transport owns. When nothing moves
it keeps polling for 0.5 ms, yielding the CPU after each pass (on an oversubscribed host the peer it
waits for gets to run), then sleeps 20 us growing by 1.25x to 1 ms. Sleeping sooner made every
latency-bound step wait out a peer's sleep: 8 B ring allreduce on 4 ranks / 2 cores went 1 -> 7 ms.
One lock guards the matching tables and every MPI call made here (all MPI_THREAD_SERIALIZED needs);
mpi_native's collectives take it too unless MPI provides MPI_THREAD_MULTIPLE (see _MpiComms).

Dead peers: MPI itself never says that a rank died (Open MPI 4.1 has no ULFM; by default mpirun
SIGTERMs the whole job ~0.5 s after a rank dies, and with `--mca orte_abort_on_non_zero_status 0`
it leaves the survivors waiting forever). So ranks swap pids at connect and every waiter checks,
every _LIVENESS_S, a pidfd per same-host peer: a peer that exited fails every wait with a PeerError
naming it, and the transport is broken from then on (as tcp's). Such a job cannot finalize
(MPI_Finalize waits for the dead rank), so the rank calls MPI_Abort when the interpreter exits,
after the user's traceback is printed. Ranks on other hosts have no pid to watch: their death is
left to mpirun.
"""
from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import os
import struct
import threading
import time
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence, Set, Tuple

from ..bootstrap.store import Store
from ..errors import EnvError, PeerError, ProtocolError, TimeoutError
from . import wire
from .base import ANY, MsgKey, Request, Transport
from .capabilities import MpiCommunicators
from .liveness import PidWatch

log = logging.getLogger("pycoll.mpi")

EAGER_BYTES = 1 << 15       # payloads up to this ride in the header's MPI message (same on every rank)
MPI_LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")  # Open MPI, MPICH/Hydra, PMIx
_KEY = struct.Struct("<QQq")
_SPIN = 5e-4                # seconds of polling (yielding the CPU each pass) before the first sleep
_MIN_PAUSE, _MAX_PAUSE, _GROWTH = 20e-6, 1e-3, 1.25
_LINGER = 5.0               # seconds close() waits for sends still in flight
_HELLO_NONCE = b"pycoll-mpi-transport"
_PID = struct.Struct("<q")
_LIVENESS_S = 0.05          # how often a waiter checks that its same-host peers still run
_ABORT_CODE = 1             # MPI_Abort's error code when a rank exits after a peer died

_Slot = Tuple[int, int]              # (peer, MPI tag)
_Then = Optional[Callable[[Any], None]]  # what to do with an MPI request's Status once it completes


def load_mpi() -> Any:
    """mpi4py's MPI module, or an EnvError saying how to get one (importing it initializes MPI)."""
    if not any(var in os.environ for var in MPI_LAUNCHER_VARS):
        raise EnvError("PYCOLL_TRANSPORT=mpi needs an MPI launcher: start the job with "
                       "`mpirun -np N python your_script.py` (mpi4py installed), or choose another "
                       "transport, e.g. PYCOLL_TRANSPORT=tcp")
    try:
        from mpi4py import MPI
    except ImportError:
        raise EnvError("PYCOLL_TRANSPORT=mpi needs mpi4py: `pip install pycoll[mpi]` (or mpi4py), or "
                       "choose another transport, e.g. PYCOLL_TRANSPORT=tcp") from None
    return MPI


class _Arrival:
    """A message pulled out of MPI for a key nobody was waiting on (it shared an MPI tag with one)."""

    __slots__ = ("header", "data", "ready", "claimed")

    def __init__(self, header: wire.Header, data: Any, ready: bool) -> None:
        self.header, self.data, self.ready = header, data, ready
        self.claimed: Optional[Request] = None  # a receive posted while the payload was still coming


class MpiTransport(Transport):
    """Tagged point-to-point over MPI Isend/Irecv on a Dup of MPI.COMM_WORLD (ranks are world ranks)."""

    name = "mpi"
    fragile_because = ("MPI never reports a dead rank and Open MPI 4.1 has no ULFM: mpirun aborts the whole job "
                       "when a rank dies, or with orte_abort_on_non_zero_status 0 leaves the survivors waiting "
                       "forever")

    def __init__(self, rank: int, size: int, address: Optional[str] = None,
                 hosts: Optional[List[str]] = None) -> None:
        super().__init__(rank, size)  # address is unused: MPI picks its own paths
        self._mpi = MPI = load_mpi()
        world = MPI.COMM_WORLD
        if (world.Get_rank(), world.Get_size()) != (rank, size):
            raise EnvError(f"PYCOLL_TRANSPORT=mpi: pycoll rank {rank} of {size} is MPI rank "
                           f"{world.Get_rank()} of {world.Get_size()}; the mpi transport needs both equal: "
                           "launch all ranks with one `mpirun -np N` and do not set RANK/WORLD_SIZE by hand")
        self.tag_space = int(world.Get_attr(MPI.TAG_UB)) + 1  # tests shrink it to force collisions
        level = MPI.Query_thread()
        if level < MPI.THREAD_SERIALIZED:
            log.warning("rank %d: MPI provides thread level %d (< MPI_THREAD_SERIALIZED); pycoll serializes "
                        "its MPI calls, but async_op=True makes them from worker threads", rank, level)
        self._lock = threading.Lock()
        self._outside: ContextManager[Any] = (contextlib.nullcontext() if level >= MPI.THREAD_MULTIPLE
                                              else self._lock)
        self._comm: Any = None     # pycoll's p2p traffic
        self._parent: Any = None   # mpi_native's communicators are carved out of this one
        self._native: Dict[Tuple[int, Tuple[int, ...]], Any] = {}
        self.capabilities[MpiCommunicators] = _MpiComms(self)
        self._ops: List[Tuple[Any, _Then, bool]] = []  # (MPI request, on completion, is a send)
        self._waiting: Dict[_Slot, int] = {}  # posted receives per slot
        self._listening: Set[_Slot] = set()   # slots with a header Irecv outstanding
        self._local = [p for p in range(size) if p != rank and hosts and hosts[p] == hosts[rank]]
        self._pids = PidWatch(rank)           # same-host peers' processes
        self._next_check = 0.0

    # -- set-up ----------------------------------------------------------------------------------
    def connect(self, store: Store, token: bytes, timeout: float) -> None:
        """Dup the world communicator, check that every rank holds this job's token (no store needed),
        and start watching the same-host peers' pids (each bound into its token proof)."""
        MPI = self._mpi
        self._comm = MPI.COMM_WORLD.Dup()
        self._parent = MPI.COMM_WORLD.Dup()
        pid = _PID.pack(os.getpid())
        mine = pid + wire.hello_mac(token, self.rank, self.rank, _HELLO_NONCE + pid)
        n = len(mine)
        table = bytearray(n * self.size)
        finished: List[bool] = []
        with self._lock:
            req = self._comm.Iallgather([mine, MPI.BYTE], [table, MPI.BYTE])
            self._ops.append((req, lambda status: finished.append(True), False))
        if not self._poll(lambda: bool(finished), timeout):
            raise TimeoutError(f"rank {self.rank}: not every MPI rank reached the mpi transport's set-up "
                               f"within {timeout:g} s")
        entries = [bytes(table[p * n:(p + 1) * n]) for p in range(self.size)]
        strangers = [p for p, e in enumerate(entries)
                     if e[_PID.size:] != wire.hello_mac(token, p, p, _HELLO_NONCE + e[:_PID.size])]
        if strangers:
            raise PeerError(f"rank {self.rank}: MPI ranks {strangers} hold another job token; are they "
                            "part of another pycoll job?", strangers[0])
        for p in self._local:
            self._pids.watch(p, _PID.unpack(entries[p][:_PID.size])[0], f"MPI rank {p}")

    # -- data path -------------------------------------------------------------------------------
    def _start_send(self, req: Request) -> None:
        peer, key, view = req.peer, req.key, req.view
        header = wire.pack_header(wire.KIND_DATA, req.dtype, key.comm_id, key.seq, key.tag, req.nbytes)
        tag, BYTE = self._mpi_tag(key), self._mpi.BYTE
        with self._lock:
            if req.nbytes <= EAGER_BYTES:
                self._ops.append((self._comm.Isend([b"".join((header, view)), BYTE], peer, tag), None, True))
                req.done = True  # the payload was copied into the message
            else:
                self._ops.append((self._comm.Isend([header, BYTE], peer, tag), None, True))
                self._ops.append((self._comm.Isend([view, BYTE], peer, tag),
                                  lambda status: self._finish(req), True))

    def _start_recv(self, req: Request) -> None:
        if req.peer == ANY:
            raise ValueError(f"rank {self.rank}: PYCOLL_TRANSPORT=mpi cannot receive from any source: its "
                             "large messages are a header then a payload on one hashed MPI tag, which an "
                             "MPI_ANY_SOURCE listener beside a per-peer one could split; name the source, "
                             "or use PYCOLL_TRANSPORT=tcp, shm or auto")
        with self._lock:
            arrival = self.matcher.post(req)
            if arrival is None:
                if not req.done:  # posted: listen for its header
                    slot = (req.peer, self._mpi_tag(req.key))
                    self._waiting[slot] = self._waiting.get(slot, 0) + 1
                    if slot not in self._listening:
                        self._listen(slot)
            elif arrival.ready:
                self._deliver(req, arrival.header, arrival.data)
            else:
                arrival.claimed = req

    def wait_for(self, reqs: Sequence[Request], timeout: float) -> bool:
        """As Transport.wait_for; once a same-host peer died, every pending request fails naming it."""
        done = self._poll(lambda: self.matcher.broken is not None or all(r.done for r in reqs), timeout)
        self.matcher.fail_pending(reqs)
        return done

    def _poll(self, finished: Callable[[], bool], timeout: float) -> bool:
        """Drive MPI until `finished()` (True) or `timeout` s pass (False); yields, then sleeps, when idle.
        Checks that the same-host peers still run every _LIVENESS_S."""
        now = time.monotonic()
        deadline, spin_until, pause = now + timeout, now + _SPIN, _MIN_PAUSE
        while True:
            with self._lock:
                moved = self._progress()
            if finished():
                return True
            now = time.monotonic()
            if now >= self._next_check and self._pids.fds:
                self._next_check = now + _LIVENESS_S
                self._check_peers()
                if finished():
                    return True
            if moved:
                spin_until, pause = now + _SPIN, _MIN_PAUSE
            elif now >= deadline:
                return False
            elif now < spin_until:
                os.sched_yield()
            else:
                time.sleep(min(deadline - now, pause))
                pause = min(pause * _GROWTH, _MAX_PAUSE)

    # -- dead peers ------------------------------------------------------------------------------
    def _check_peers(self) -> None:
        """Declare the job broken if a same-host peer's process has exited (its pidfd is readable)."""
        gone = self._pids.exited()
        if not gone or self.matcher.broken is not None:
            return
        log.warning("rank %d: MPI rank(s) %s died; failing every pending operation", self.rank, gone)
        with self._lock:
            self.matcher.break_job(PeerError(
                f"rank {self.rank}: MPI rank {gone[0]} died (its process exited); this communicator cannot "
                "complete collectives any more, and MPI cannot finalize: this rank calls MPI_Abort when it "
                "exits", gone[0]))
        atexit.register(self._abort)

    def _abort(self) -> None:
        """At exit after a peer died: MPI_Finalize would wait for it forever, so end the MPI job."""
        if not self._mpi.Is_finalized():
            self._mpi.COMM_WORLD.Abort(_ABORT_CODE)

    # -- matching (all with the lock held) -------------------------------------------------------
    def _mpi_tag(self, key: MsgKey) -> int:
        digest = hashlib.blake2b(_KEY.pack(*key), digest_size=8).digest()
        return int.from_bytes(digest, "little") % self.tag_space

    def _progress(self) -> bool:
        """Run the completion step of every MPI request that finished; True if any did."""
        ops = self._ops
        if not ops:
            return False
        statuses: List[Any] = []
        done = self._mpi.Request.Testsome([op[0] for op in ops], statuses)
        if not done:
            return False
        finished = set(done)
        self._ops = [op for i, op in enumerate(ops) if i not in finished]
        for i, status in zip(done, statuses):  # statuses come in the order of `done`
            then = ops[i][1]
            if then is not None:
                then(status)
        return True

    def _listen(self, slot: _Slot) -> None:
        """Post the Irecv for the next header (or eager message) from slot's peer on slot's MPI tag."""
        buf = bytearray(wire.HEADER.size + EAGER_BYTES)
        req = self._comm.Irecv([buf, self._mpi.BYTE], slot[0], slot[1])
        self._listening.add(slot)
        self._ops.append((req, lambda status: self._on_header(slot, buf, status), False))

    def _on_header(self, slot: _Slot, buf: bytearray, status: Any) -> None:
        self._listening.discard(slot)
        peer, tag = slot
        header = self._parse(peer, buf, status.Get_count(self._mpi.BYTE))
        match = (peer, header.comm_id, header.seq, header.tag)
        eager = header.nbytes <= EAGER_BYTES
        data = memoryview(buf)[wire.HEADER.size:wire.HEADER.size + header.nbytes] if eager else None
        req = self.matcher.take(match)
        if req is not None:
            self._waiting[slot] -= 1
            if eager:
                self._deliver(req, header, data)
            else:
                req.check_incoming(self.rank, header.nbytes, header.dtype)
                if req.error is None:
                    self._receive(req.view, peer, tag, lambda status: self._finish(req))
                else:  # drain the payload so the next header lines up; the user's buffer stays untouched
                    self._receive(bytearray(header.nbytes), peer, tag, None)
                    req.done = True
        else:
            arrival = _Arrival(header, data, eager)
            self.matcher.stash(match, arrival)
            if not eager:
                arrival.data = bytearray(header.nbytes)
                self._receive(arrival.data, peer, tag, lambda status: self._arrived(arrival))
        if self._waiting.get(slot):
            self._listen(slot)
        else:
            self._waiting.pop(slot, None)

    def _parse(self, peer: int, buf: bytearray, count: int) -> wire.Header:
        try:
            header = wire.unpack_header(bytes(buf[:wire.HEADER.size]))
        except ValueError as e:
            raise ProtocolError(f"rank {self.rank}: rank {peer} sent a message on pycoll's MPI communicator "
                                f"that is not a pycoll header ({e})", peer) from None
        expected = wire.HEADER.size + (header.nbytes if header.nbytes <= EAGER_BYTES else 0)
        if count != expected:
            raise ProtocolError(f"rank {self.rank}: rank {peer} sent {count} bytes for a header announcing "
                                f"{header.nbytes} payload bytes (expected {expected}); do both run the same "
                                "pycoll version?", peer)
        return header

    def _receive(self, target: Any, peer: int, tag: int, then: _Then) -> None:
        self._ops.append((self._comm.Irecv([target, self._mpi.BYTE], peer, tag), then, False))

    def _arrived(self, arrival: _Arrival) -> None:
        arrival.ready = True
        if arrival.claimed is not None:
            self._deliver(arrival.claimed, arrival.header, arrival.data)

    def _deliver(self, req: Request, header: wire.Header, data: Any) -> None:
        """Copy a message already in hand into a receive if it fits; else the receive gets a ProtocolError."""
        req.check_incoming(self.rank, header.nbytes, header.dtype)
        if req.error is None:
            req.view[:] = data
        req.done = True

    @staticmethod
    def _finish(req: Request) -> None:
        req.done = True

    # -- lifetime --------------------------------------------------------------------------------
    def _shutdown(self) -> None:
        """Let sends in flight finish (bounded), cancel receives nobody got, free the communicators."""
        self._pids.close()
        if self._mpi.Is_finalized():
            return
        broken = self.matcher.broken is not None
        linger = 0.0 if broken else _LINGER  # sends to a dead rank never finish
        self._poll(lambda: not any(is_send for _, _, is_send in self._ops), linger)
        with self._lock:
            for req, _, is_send in self._ops:
                if not is_send:
                    req.Cancel()
            self._ops = [(req, None, is_send) for req, _, is_send in self._ops]
        if not self._poll(lambda: not self._ops, linger) and not broken:
            log.warning("rank %d: mpi transport closed with %d MPI requests unfinished", self.rank,
                        len(self._ops))
        for comm in (*self._native.values(), self._parent, self._comm):
            if comm is not None:
                comm.Free()
        self._native.clear()


class _MpiComms(MpiCommunicators):
    """One MPI communicator per pycoll communicator, carved out of the transport's parent Dup."""

    def __init__(self, transport: MpiTransport) -> None:
        self._t = transport

    def serialized(self) -> ContextManager[Any]:
        return self._t._outside

    def comm_for(self, group: Sequence[int], comm_id: int) -> Any:
        """Made on first use with Create_group, which only the group's ranks call: they all reach it at
        the same collective call of that communicator, so the collective creation is safe."""
        t = self._t
        key = (comm_id, tuple(group))
        comm = t._native.get(key)
        if comm is None:
            ranks = t._parent.Get_group().Incl(list(group))
            with t._outside:
                comm = t._parent.Create_group(ranks, tag=comm_id % t.tag_space)
            ranks.Free()
            comm = t._native.setdefault(key, comm)
        return comm

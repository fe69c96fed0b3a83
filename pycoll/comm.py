"""Communicator: validates arguments, numbers each call, picks an algorithm and runs it on a Channel."""
from __future__ import annotations

import functools
import itertools
import threading
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np

from . import calibration, debug, ft, grow
from .algorithms import symmetric
from .bootstrap.rendezvous import Membership
from .bootstrap.store import Store
from .buffers import as_array, flat
from .channel import Channel, byte_view
from .errors import RevokedError
from .ids import comm_hash, derived_id
from .ops import AVG, DTYPE_CODES, ReduceOp, dtype_code, finish_avg, reduction
from .persistent import PLAN, Persistent, PersistentP2P, collective as _persistent, point_to_point
from .selection import Selector, resolve
from .topology import Topology
from .trace import recorder
from .transports.base import ANY, MsgKey, Transport
from .transports.capabilities import Board, PeerMemory, SharedBoard, SharedMemory
from .windows import Registry
from .work import Work, Worker

P2P_SEQ = 0  # point-to-point messages use call number 0; collectives count from 1
ANY_SOURCE = -1  # recv/irecv src: the first message with the tag from any rank (MPI_ANY_SOURCE)
OpLike = Union[ReduceOp, str]
_OP_NAMES = {op: op.value for op in ReduceOp}  # a fingerprint names its op: the flight recorder stores names
_REGISTERED = frozenset({"allreduce", "allgather", "reduce_scatter", "broadcast"})  # read in place (symmetric)


class Status:
    """What a completed receive got (mpi4py's Status): `source` (the sender's rank in the
    communicator), `tag`, `nbytes`. Pass one to recv(..., status=)."""

    __slots__ = ("source", "tag", "nbytes")

    def __init__(self) -> None:
        self.source: Optional[int] = None
        self.tag: Optional[int] = None
        self.nbytes = 0

    def _fill(self, source: Optional[int], tag: int, nbytes: int) -> None:
        self.source, self.tag, self.nbytes = source, tag, nbytes

    def __repr__(self) -> str:
        return f"Status(source={self.source}, tag={self.tag}, nbytes={self.nbytes})"


class P2POp(NamedTuple):
    """One operation of Communicator.batch_isend_irecv: `op` "isend" or "irecv" (or comm.isend /
    comm.irecv), the buffer, the peer (communicator rank; for irecv None or ANY_SOURCE: any rank),
    and the tag."""

    op: Any
    buf: Any
    peer: Optional[int]
    tag: int = 0


class P2PWork(Work):
    """A point-to-point Work; `source` is the peer's communicator rank (for an any-source irecv: the
    sender, None until it matched), `tag` and `nbytes` those of the message; `entry`: the call's
    flight-recorder entry, where the caller's wait is stamped."""

    def __init__(self, what: object, future: Any, source: Callable[[], Optional[int]], tag: int,
                 nbytes: int, worker: Optional[Worker] = None, entry: Optional[list] = None) -> None:
        super().__init__(what, future, worker, entry)
        self._source_of, self.tag, self.nbytes = source, tag, nbytes

    @property
    def source(self) -> Optional[int]:
        return self._source_of()


class Communicator:
    """A group of ranks that run collectives together (MPI communicator / torch process group).
    Algorithms are picked by `selector`: the size rules until calibrate() fits the tuner's model."""

    def __init__(self, transport: Transport, group: Sequence[int], rank: int, name: str,
                 membership: Membership, timeout: float, store: Optional[Store] = None,
                 owns_transport: bool = False, selector: Optional[Selector] = None,
                 topology: Optional[Topology] = None, lanes: Optional[Dict[int, int]] = None,
                 peer_memory: bool = False) -> None:
        """`lanes`: the members' board lanes, already agreed (shrink), instead of exchanging them, and
        with them `peer_memory`, whether the members reach each other's memory."""
        self.transport, self.group, self.name = transport, list(group), name
        self._rank, self.timeout, self.store = rank, timeout, store
        self.comm_id = comm_hash(name)
        self.membership = membership
        self.topology = topology or (Topology(membership.ranks) if membership.ranks
                                     else Topology.from_hosts(membership.hosts))
        # the board, and whether every member can copy from and to every other's memory (cma): both
        # agreed by all members when they exchange their lanes
        self.board, self.peer_memory = self._open_board(lanes, peer_memory)
        memory = self.transport.offers(SharedMemory)
        self.windows = Registry(memory, self.group, rank, name) if self.board is not None and memory is not None \
            and memory.reaches(self.group) else None  # registered buffers (empty()), where every rank maps them
        self._owns_transport = owns_transport
        self._seq = itertools.count(1)
        self._children = itertools.count()
        self._seq_lock = threading.Lock()
        self._worker: Optional[Worker] = None
        self._p2p_worker: Optional[Worker] = None
        self._inflight = 0
        self._closed = False
        self._ranks: Optional[dict] = None  # transport rank -> communicator rank, made on first need
        self._subgroups: set = set()  # (name, ranks) of the subgroups made here
        self._agreements = 0  # agreements run on it (ft.py numbers them)
        self._detail = debug.enabled()  # PYCOLL_DEBUG=DETAIL, read once: every rank must agree on it
        self._recorder = recorder.for_communicator(name, self.comm_id, rank, self.group,  # flight recorder
                                                   self.topology, self._board_capacity() + (self.peer_memory,))
        self._chosen: Optional[Callable] = None  # the algorithm picked for the call about to _run
        self.selector = selector or Selector(board_bytes=self._board_capacity()[0])

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

    @property
    def closed(self) -> bool:
        """Whether close() has been called."""
        return self._closed

    def __repr__(self) -> str:
        return f"<pycoll.Communicator {self.name} rank {self.rank}/{self.size} over {self.transport.name}>"

    # -- algorithm selection ----------------------------------------------------------------------
    def calibrate(self) -> None:
        """Fit the tuner's model to this communicator's links as PYCOLL_TUNER says (a probe, the model's
        constants, or static size rules) and select with it from now on; split/dup children inherit
        it. Collective: every rank calls it, between calls (pycoll.init() does, for the world)."""
        board, stage = self._board_capacity()
        fitted = calibration.for_communicator(self._tuner_channel, self.rank, self.topology,
                                              self.transport.name, board, stage, self.peer_memory)
        self.selector = Selector(self.selector.spec, fitted, board)

    # -- running calls ----------------------------------------------------------------------------
    def _run(self, collective: str, body: Callable[[Channel], Any], async_op: bool,
             timeout: Optional[float], fingerprint: debug.Fingerprint) -> Any:
        """Run `body` on this call's Channel; `fingerprint` (dtype, count, op, root) is checked under DETAIL."""
        self._check_open(collective)
        timeout = self.timeout if timeout is None else self._deadline(timeout, collective)
        if async_op is PLAN:  # making a persistent handle (persistent.py): the call, checked, not run
            algo, self._chosen = self._chosen, None
            return collective, body, timeout, fingerprint, algo
        if self._detail:
            body = debug.checked(collective, fingerprint[:4], body)  # (alltoallv's 5th: the recorder's)
        rec, algo, self._chosen = self._recorder, self._chosen, None
        if not async_op and self._inflight == 0:  # runs now, on this thread (no lock: only queued calls
            ch = self.channel(collective, timeout)  # change _inflight, and a stale count just queues)
            return body(ch) if rec is None else rec.call(ch.seq, collective, fingerprint, algo, body, ch)
        with self._seq_lock:  # behind queued async work, blocking calls queue too
            ch = self.channel(collective, timeout)
            self._inflight += 1
            entry = rec.enter(ch.seq, collective, fingerprint, algo) if rec is not None else None
        if entry is not None:
            body = rec.traced(entry, body)
        work = self._submit(ch.what, lambda: body(ch), entry if async_op else None)
        return work if async_op else work.result()

    def channel(self, collective: str, timeout: Optional[float] = None) -> Channel:
        """A Channel for the next call number: what an algorithm runs on (all ranks must call in order)."""
        seq, rank, group = next(self._seq), self._rank, self.group
        return Channel(self.transport, group, rank, self.comm_id, seq,
                       self.timeout if timeout is None else timeout,
                       None, self.board, self.windows, collective, self.name)

    def _submit(self, what: object, fn: Callable[[], Any], entry: Optional[list] = None) -> Work:
        """Queue `fn` on this communicator's worker (`entry`: the flight-recorder entry its Work stamps waits in)."""
        if self._worker is None:
            self._worker = Worker(f"pycoll-{self.name}")

        def tracked() -> Any:
            try:
                return fn()
            finally:
                with self._seq_lock:
                    self._inflight -= 1
        return self._worker.submit(what, tracked, entry)

    def _tuner_channel(self, seq: int) -> Channel:
        """A Channel on the tuner's own communicator id (calibration at init), off the call numbering."""
        return Channel(transport=self.transport, group=self.group, rank=self.rank,
                       comm_id=derived_id(self.comm_id, "tuner"), seq=seq, timeout=self.timeout,
                       what=f"tuner calibration (step {seq} on {self.name}, rank {self.rank})")

    def _open_board(self, lanes: Optional[Dict[int, int]] = None, peer_memory: bool = False
                    ) -> Tuple[Optional[Board], bool]:
        """This communicator's shared-memory board, where the transport offers one reaching every
        member: each member claims a lane of its own board and all exchange their lane numbers (the
        same answer on every member: a board, or None when any member has no lane left), unless the
        `lanes` (and `peer_memory`) are known already. With the lanes each member says whether it
        reaches the others' memory (PeerMemory): cma is a candidate only if all do."""
        boards = self.transport.offers(SharedBoard)
        if boards is None or not boards.reaches(self.group):
            return None, False
        if lanes is not None:
            return (boards.open(self.comm_id, self.group, lanes), peer_memory) if min(lanes.values()) >= 0 \
                else (None, False)
        ch = Channel(transport=self.transport, group=self.group, rank=self.rank,
                     comm_id=derived_id(self.comm_id, "board"), seq=1, timeout=self.timeout,
                     what=f"board set-up of {self.name} (rank {self.rank})")
        memory = self.transport.offers(PeerMemory)
        mine = np.array([boards.claim_lane(self.comm_id), memory is not None and memory.reaches(self.group)],
                        np.int64)
        theirs = {m: np.empty(2, np.int64) for m in range(self.size) if m != self.rank}
        reqs = [ch.irecv(buf, m) for m, buf in theirs.items()] + [ch.isend(mine, m) for m in theirs]
        ch.wait(*reqs)
        rows = {self.group[m]: buf for m, buf in theirs.items()}
        rows[self.group[self.rank]] = mine
        lanes = {g: int(row[0]) for g, row in rows.items()}
        if min(lanes.values()) < 0:
            return None, False
        return boards.open(self.comm_id, self.group, lanes), all(bool(row[1]) for row in rows.values())

    def _board_capacity(self) -> Tuple[int, int]:
        """(slot bytes, stage bytes) of this communicator's board; (0, 0) without one."""
        return (self.board.slot_bytes, self.board.stage_bytes) if self.board is not None else (0, 0)

    def _algorithm(self, collective: str, nbytes: int, algo: Optional[str]) -> Callable:
        fn = self.selector.function(collective, nbytes, self.topology, algo)
        if algo is None and self.windows is not None and self.windows.used and collective in _REGISTERED \
                and nbytes > self.board.slot_bytes:
            # this communicator has registered buffers (every rank alike: allocation is collective): the
            # call asks every rank where its buffers are and reads them in place if all are registered
            fn = functools.partial(getattr(symmetric, collective), fallback=fn)
            fn.accepts_src = True  # type: ignore[attr-defined]
        self._chosen = fn  # for the recorder
        return fn

    # -- registered buffers -----------------------------------------------------------------------
    def empty(self, shape: Union[int, Sequence[int]], dtype: Any = np.float32) -> np.ndarray:
        """A registered buffer (collective: every rank, same shape and dtype, same order): an array
        in memory that every rank of this host maps, so that allreduce, allgather, reduce_scatter and
        broadcast larger than a board slot read the peers' buffers in place when every rank passes
        one (pycoll/windows.py). torch.from_numpy(buf) is a tensor on the same memory. It lives while
        referenced; free(buf) unregisters it earlier. On a communicator whose ranks do not all share
        this host's memory: an ordinary page-aligned array, with no communication."""
        self._check_open("empty")
        dt = np.dtype(dtype)
        dtype_code(dt)
        shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"rank {self.rank}: empty shape={shape} has a negative dimension")
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        if self.windows is None:
            raw = np.empty(nbytes + 4096, np.uint8)
            at = -raw.ctypes.data % 4096
            return raw[at:at + nbytes].view(dt).reshape(shape)
        return self.windows.allocate(nbytes, self.allgather).view(dt).reshape(shape)

    def zeros(self, shape: Union[int, Sequence[int]], dtype: Any = np.float32) -> np.ndarray:
        """empty(), filled with zeros (collective as empty())."""
        buf = self.empty(shape, dtype)
        buf.view(np.uint8)[...] = 0
        return buf

    def free(self, buf: Any) -> None:
        """Unregister the registered buffer `buf` lies in (local: from now on calls on it run the
        usual algorithms; its memory lives while referenced). ValueError if it is not one."""
        if self.windows is None:
            raise ValueError(f"rank {self.rank}: {self.name} has no registered buffers to free")
        self.windows.free(as_array(buf, "free buf", writable=False))

    # -- validation -------------------------------------------------------------------------------
    def _check_open(self, call: str) -> None:
        if self._closed:
            raise RuntimeError(f"rank {self.rank}: {call} on {self.name} after close()")
        revoked = self.transport.revoked_error(self.comm_id)
        if revoked is not None:
            raise RevokedError(f"rank {self.rank}: {call} on {self.name}: {revoked}", revoked.by)

    def _deadline(self, timeout: Optional[float], call: str) -> float:
        """The seconds a call may wait: its own `timeout=` (a positive number, inf allowed) or the default."""
        if timeout is None:
            return self.timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.integer, np.floating)) \
                or not timeout > 0:
            raise ValueError(f"rank {self.rank}: {call} timeout={timeout!r} must be a positive number of "
                             "seconds (or None for PYCOLL_TIMEOUT)")
        return float(timeout)

    def _peer(self, peer: int, role: str, call: str) -> int:
        if isinstance(peer, bool) or not isinstance(peer, (int, np.integer)) or not 0 <= peer < self.size:
            raise ValueError(f"rank {self.rank}: {call} {role}={peer!r} is not a rank of {self.name} "
                             f"(0..{self.size - 1})")
        return int(peer)

    def _input(self, x: Any, call: str, writable: bool) -> np.ndarray:
        """`x` as a C-contiguous numpy array of a supported dtype, writable where the result goes."""
        if type(x) is np.ndarray and x.dtype in DTYPE_CODES and x.flags.c_contiguous \
                and (not writable or x.flags.writeable):
            return x  # the usual argument, accepted without the two calls below
        arr = as_array(x, call, writable, "x")
        dtype_code(arr.dtype)
        return arr

    def _output(self, out: Any, call: str, dtype: np.dtype, count: int) -> np.ndarray:
        arr = as_array(out, f"{call} out")
        if arr.dtype != dtype or arr.size != count:
            raise ValueError(f"rank {self.rank}: {call} out= holds {arr.size} x {arr.dtype}, "
                             f"expected {count} x {dtype}")
        return arr

    def _counts(self, counts: Sequence[int], call: str, what: str = "counts") -> List[int]:
        counts = [int(c) for c in counts]
        if len(counts) != self.size or any(c < 0 for c in counts):
            raise ValueError(f"rank {self.rank}: {call} {what} must be {self.size} non-negative integers, "
                             f"got {counts}")
        return counts

    # -- reductions -------------------------------------------------------------------------------
    def allreduce(self, x: Any, out: Any = None, op: OpLike = ReduceOp.SUM, *, async_op: bool = False,
                  timeout: Optional[float] = None, algo: Optional[str] = None) -> Any:
        """Reduce `x` across all ranks; every rank gets the result in `out` (or in `x` itself)."""
        src = self._input(x, "allreduce", out is None)
        op = reduction(op, src.dtype)
        dst = src if out is None else self._output(out, "allreduce", src.dtype, src.size)
        fn = self._algorithm("allreduce", src.nbytes, algo)
        fd, fs = flat(dst), flat(src)  # (made here: a persistent handle's runs then post the same arrays)
        in_place = dst is src
        takes_src = not in_place and getattr(fn, "accepts_src", False)

        def body(ch: Channel) -> Any:
            if in_place:
                fn(ch, fd, op)
            elif takes_src:
                fn(ch, fd, op, src=fs)
            else:
                np.copyto(fd, fs)
                fn(ch, fd, op)
            if op is AVG:
                finish_avg(dst, ch.size)
            return x if out is None else out
        return self._run("allreduce", body, async_op, timeout, (src.dtype, src.size, _OP_NAMES[op], None))

    def reduce(self, x: Any, root: int = 0, op: OpLike = ReduceOp.SUM, out: Any = None, *,
               async_op: bool = False, timeout: Optional[float] = None, algo: Optional[str] = None) -> Any:
        """Reduce `x` onto `root` (into `out`, or `x` in place there); other ranks' buffers stay as they were."""
        root = self._peer(root, "root", "reduce")
        src = self._input(x, "reduce", out is None and self.rank == root)
        op = reduction(op, src.dtype)
        dst = src if out is None or self.rank != root else self._output(out, "reduce", src.dtype, src.size)
        fn = self._algorithm("reduce", src.nbytes, algo)
        fd, fs, copy = flat(dst), flat(src), dst is not src

        def body(ch: Channel) -> Any:
            if copy:
                np.copyto(fd, fs)
            fn(ch, fd, op, root)
            if op is AVG and ch.rank == root:
                finish_avg(dst, ch.size)
            return out if out is not None and ch.rank == root else x
        return self._run("reduce", body, async_op, timeout, (src.dtype, src.size, _OP_NAMES[op], root))

    def reduce_scatter(self, x: Any, out: Any = None, op: OpLike = ReduceOp.SUM, *,
                       counts: Optional[Sequence[int]] = None, async_op: bool = False,
                       timeout: Optional[float] = None, algo: Optional[str] = None) -> Any:
        """Reduce `x` across ranks and leave block `rank` of the result here (equal blocks, or `counts`)."""
        src = self._input(x, "reduce_scatter", False)
        op = reduction(op, src.dtype)
        if counts is None:
            if src.size % self.size:
                raise ValueError(f"rank {self.rank}: reduce_scatter x has {src.size} elements, not divisible "
                                 f"by {self.size} ranks (pass counts= for uneven blocks)")
            counts_l = [src.size // self.size] * self.size
        else:
            counts_l = self._counts(counts, "reduce_scatter")
            if sum(counts_l) != src.size:
                raise ValueError(f"rank {self.rank}: reduce_scatter counts sum to {sum(counts_l)}, "
                                 f"x has {src.size} elements")
        mine = counts_l[self.rank]
        if out is None:
            shape = (src.shape[0] // self.size,) + src.shape[1:] if (
                counts is None and src.ndim and src.shape[0] % self.size == 0) else (mine,)
            result = np.empty(shape, src.dtype)
        else:
            result = out
        dst = self._output(result, "reduce_scatter", src.dtype, mine)
        fn = self._algorithm("reduce_scatter", src.nbytes, algo)
        fs, fd = flat(src), flat(dst)

        def body(ch: Channel) -> Any:
            fn(ch, fs, fd, op, counts_l)
            if op is AVG:
                finish_avg(dst, ch.size)
            return result
        return self._run("reduce_scatter", body, async_op, timeout, (src.dtype, counts_l, _OP_NAMES[op], None))

    # -- data movement ----------------------------------------------------------------------------
    def broadcast(self, x: Any, root: int = 0, *, async_op: bool = False,
                  timeout: Optional[float] = None, algo: Optional[str] = None) -> Any:
        """Copy root's `x` into `x` on every rank."""
        root = self._peer(root, "root", "broadcast")
        buf = self._input(x, "broadcast", self.rank != root)
        fn = self._algorithm("broadcast", buf.nbytes, algo)
        fb = flat(buf)

        def body(ch: Channel) -> Any:
            fn(ch, fb, root)
            return x
        return self._run("broadcast", body, async_op, timeout, (buf.dtype, buf.size, None, root))

    def allgather(self, x: Any, out: Any = None, *, async_op: bool = False,
                  timeout: Optional[float] = None, algo: Optional[str] = None) -> Any:
        """Every rank's `x`, stacked: an array of shape (size, *x.shape) on every rank."""
        src = self._input(x, "allgather", False)
        result = np.empty((self.size,) + src.shape, src.dtype) if out is None else out
        dst = self._output(result, "allgather", src.dtype, src.size * self.size)
        return self._gather_all("allgather", src, dst, None, result, async_op, timeout, algo)

    def allgatherv(self, x: Any, counts: Sequence[int], out: Any = None, *, async_op: bool = False,
                   timeout: Optional[float] = None, algo: Optional[str] = None) -> Any:
        """Concatenate rank i's counts[i] elements, in rank order, on every rank (a flat array)."""
        src = self._input(x, "allgatherv", False)
        counts_l = self._counts(counts, "allgatherv")
        if counts_l[self.rank] != src.size:
            raise ValueError(f"rank {self.rank}: allgatherv counts[{self.rank}]={counts_l[self.rank]} but x "
                             f"has {src.size} elements")
        result = np.empty(sum(counts_l), src.dtype) if out is None else out
        dst = self._output(result, "allgatherv", src.dtype, sum(counts_l))
        return self._gather_all("allgatherv", src, dst, counts_l, result, async_op, timeout, algo)

    def allgather_ragged(self, x: Any, *, async_op: bool = False, timeout: Optional[float] = None
                         ) -> Any:
        """Every rank's `x` (of any length; one dtype on every rank) concatenated in rank order, and
        each rank's element count: (flat array, counts). For blocks whose sizes only their owners
        know (sparse gradients): one call that gathers the counts, then the data (MPI_Allgather of
        the counts, then MPI_Allgatherv)."""
        src = self._input(x, "allgather_ragged", False)
        sizes_id = derived_id(self.comm_id, "allgather_ragged counts")

        def body(ch: Channel) -> Any:
            counts = np.empty(ch.size, np.int64)
            mine = np.array([src.size], np.int64)
            # the counts on a side channel of this call (its own messages; no board), then the data on
            # the call's own channel, by the algorithm its total calls for (the same total on every rank)
            self.selector.function("allgather", counts.nbytes, self.topology, None)(
                ch.derive(comm_id=sizes_id), mine, counts, None)
            counts_l = [int(c) for c in counts]
            out = np.empty(sum(counts_l), src.dtype)
            self.selector.function("allgather", out.nbytes, self.topology, None)(ch, flat(src), out, counts_l)
            return out, counts_l
        return self._run("allgather_ragged", body, async_op, timeout, (src.dtype, None, None, None))

    def _gather_all(self, call: str, src: np.ndarray, dst: np.ndarray, counts: Optional[List[int]],
                    result: Any, async_op: bool, timeout: Optional[float], algo: Optional[str]) -> Any:
        fn = self._algorithm("allgather", dst.nbytes, algo)
        fs, fd = flat(src), flat(dst)

        def body(ch: Channel) -> Any:
            fn(ch, fs, fd, counts)
            return result
        return self._run(call, body, async_op, timeout,
                         (src.dtype, src.size if counts is None else counts, None, None))

    def alltoall(self, x: Any, out: Any = None, *, async_op: bool = False,
                 timeout: Optional[float] = None, algo: Optional[str] = None) -> Any:
        """Block j of `x` goes to rank j; block i of the result came from rank i (x.size divisible by size)."""
        src = self._input(x, "alltoall", False)
        if src.size % self.size:
            raise ValueError(f"rank {self.rank}: alltoall x has {src.size} elements, not divisible by "
                             f"{self.size} ranks")
        result = np.empty_like(src) if out is None else out
        dst = self._output(result, "alltoall", src.dtype, src.size)
        fn = self._algorithm("alltoall", src.nbytes, algo)
        fs, fd = flat(src), flat(dst)

        def body(ch: Channel) -> Any:
            fn(ch, fs, fd)
            return result
        return self._run("alltoall", body, async_op, timeout, (src.dtype, src.size, None, None))

    def alltoallv(self, x: Any, send_counts: Sequence[int], recv_counts: Sequence[int], out: Any = None, *,
                  async_op: bool = False, timeout: Optional[float] = None, algo: Optional[str] = None) -> Any:
        """send_counts[j] elements of `x` (packed in rank order) go to rank j; the result packs what each sent."""
        src = self._input(x, "alltoallv", False)
        sc = self._counts(send_counts, "alltoallv", "send_counts")
        rc = self._counts(recv_counts, "alltoallv", "recv_counts")
        if sum(sc) != src.size:
            raise ValueError(f"rank {self.rank}: alltoallv send_counts sum to {sum(sc)}, x has {src.size}")
        result = np.empty(sum(rc), src.dtype) if out is None else out
        dst = self._output(result, "alltoallv", src.dtype, sum(rc))
        fn = self._algorithm("alltoallv", src.nbytes, algo)
        sd, rd = _displacements(sc), _displacements(rc)

        def body(ch: Channel) -> Any:
            fn(ch, flat(src), sc, sd, flat(dst), rc, rd)
            return result
        return self._run("alltoallv", body, async_op, timeout, (src.dtype, None, None, None, sc))

    def gather(self, x: Any, root: int = 0, out: Any = None, *, async_op: bool = False,
               timeout: Optional[float] = None) -> Any:
        """At `root`: every rank's `x` stacked as (size, *x.shape); elsewhere None."""
        root = self._peer(root, "root", "gather")
        src = self._input(x, "gather", False)
        result = None
        if self.rank == root:
            result = np.empty((self.size,) + src.shape, src.dtype) if out is None else out
        dst = None if result is None else self._output(result, "gather", src.dtype, src.size * self.size)
        fn = self._algorithm("gather", src.nbytes, None)

        def body(ch: Channel) -> Any:
            fn(ch, flat(src), None if dst is None else flat(dst), root)
            return result
        return self._run("gather", body, async_op, timeout, (src.dtype, src.size, None, root))

    def scatter(self, x: Any, root: int = 0, out: Any = None, *, async_op: bool = False,
                timeout: Optional[float] = None) -> Any:
        """Block `rank` of root's `x` (shape (size, ...) or size*k elements) lands in `out` on each rank.

        Non-root ranks pass `out` (or an `x` of the full shape, whose contents are ignored).
        """
        root = self._peer(root, "root", "scatter")
        src = self._input(x, "scatter", False) if x is not None else None
        if out is None:
            if src is None or src.ndim == 0 or src.shape[0] != self.size:
                raise ValueError(f"rank {self.rank}: scatter needs out= or an x of shape ({self.size}, ...)")
            out = np.empty(src.shape[1:], src.dtype)
        dst = as_array(out, "scatter out")
        dtype_code(dst.dtype)
        if self.rank == root:
            if src is None:
                raise ValueError(f"rank {self.rank}: scatter root must pass x")
            self._output(src, "scatter x", dst.dtype, dst.size * self.size)
        fn = self._algorithm("scatter", dst.nbytes, None)

        def body(ch: Channel) -> Any:
            fn(ch, flat(src) if ch.rank == root else None, flat(dst), root)
            return out
        return self._run("scatter", body, async_op, timeout, (dst.dtype, dst.size, None, root))

    def gatherv(self, x: Any, counts: Sequence[int], root: int = 0, out: Any = None, *, async_op: bool = False,
                timeout: Optional[float] = None) -> Any:
        """At `root`: rank i's counts[i] elements, concatenated in rank order (a flat array of
        sum(counts), or `out`); elsewhere None (MPI_Gatherv with packed displacements). Every rank's
        `x` holds counts[rank] elements; every rank passes the same counts and root."""
        root = self._peer(root, "root", "gatherv")
        src = self._input(x, "gatherv", False)
        counts_l = self._counts(counts, "gatherv")
        if counts_l[self.rank] != src.size:
            raise ValueError(f"rank {self.rank}: gatherv counts[{self.rank}]={counts_l[self.rank]} but x "
                             f"has {src.size} elements")
        result = dst = None
        if self.rank == root:
            result = np.empty(sum(counts_l), src.dtype) if out is None else out
            dst = self._output(result, "gatherv", src.dtype, sum(counts_l))
        fn = resolve("gather", "linear")  # the root posts every receive at once, whatever the counts

        def body(ch: Channel) -> Any:
            fn(ch, flat(src), None if dst is None else flat(dst), root, counts_l)
            return result
        return self._run("gatherv", body, async_op, timeout, (src.dtype, counts_l, None, root))

    def scatterv(self, x: Any, counts: Sequence[int], root: int = 0, out: Any = None, *, async_op: bool = False,
                 timeout: Optional[float] = None) -> Any:
        """Rank i gets the counts[i] elements of root's flat `x` that follow those of ranks 0..i-1
        (MPI_Scatterv with packed displacements), in `out` or a new flat array. Off the root `x` may
        be None (then `out` is needed) and only gives the dtype of a new result."""
        root = self._peer(root, "root", "scatterv")
        counts_l = self._counts(counts, "scatterv")
        src = self._input(x, "scatterv", False) if x is not None else None
        mine = counts_l[self.rank]
        if out is None:
            if src is None:
                raise ValueError(f"rank {self.rank}: scatterv needs out= or an x (for the dtype) off the root")
            out = np.empty(mine, src.dtype)
        dst = as_array(out, "scatterv out")
        dtype_code(dst.dtype)
        self._output(dst, "scatterv out", dst.dtype, mine)
        if self.rank == root:
            if src is None:
                raise ValueError(f"rank {self.rank}: scatterv root must pass x")
            self._output(src, "scatterv x", dst.dtype, sum(counts_l))
        fn = resolve("scatter", "linear")

        def body(ch: Channel) -> Any:
            fn(ch, flat(src) if ch.rank == root else None, flat(dst), root, counts_l)
            return out
        return self._run("scatterv", body, async_op, timeout, (dst.dtype, counts_l, None, root))

    def barrier(self, *, async_op: bool = False, timeout: Optional[float] = None) -> Any:
        """Return once every rank has called barrier."""
        return self._run("barrier", self._algorithm("barrier", 0, None), async_op, timeout,
                         (None, None, None, None))

    # -- point to point ---------------------------------------------------------------------------
    def send(self, x: Any, dst: int, tag: int = 0, *, timeout: Optional[float] = None) -> None:
        """Send `x` to rank `dst`; matched by (source, tag) in order, like MPI_Send."""
        self._wait_p2p(*self._post_p2p("send", x, dst, tag, timeout))

    def recv(self, x: Any, src: Optional[int] = ANY_SOURCE, tag: int = 0, *, timeout: Optional[float] = None,
             status: Optional[Status] = None) -> Any:
        """Receive exactly `x`'s size and dtype from rank `src` into `x`; returns `x`.

        `src` None or ANY_SOURCE takes the first message with `tag` from any rank (MPI_ANY_SOURCE);
        pass a `Status` to learn who sent it (status.source, as mpi4py does)."""
        req, limit, what, entry = self._post_p2p("recv", x, src, tag, timeout)
        self._wait_p2p(req, limit, what, entry)
        if status is not None:
            status._fill(self._source(req), int(tag), req.nbytes)
        return x

    def isend(self, x: Any, dst: int, tag: int = 0, *, timeout: Optional[float] = None) -> "P2PWork":
        """Start sending `x` to rank `dst` (posted now, so sends keep their call order); the Work
        completes when the send has. `x` must stay untouched until then."""
        return self._p2p_work(*self._post_p2p("isend", x, dst, tag, timeout), None)

    def irecv(self, x: Any, src: Optional[int] = ANY_SOURCE, tag: int = 0, *,
              timeout: Optional[float] = None) -> "P2PWork":
        """Post a receive of exactly `x`'s size and dtype from rank `src` into `x`; the Work's
        result is `x` once it has arrived. `src` None or ANY_SOURCE: from any rank; the Work's
        `source` then says which (once complete)."""
        return self._p2p_work(*self._post_p2p("irecv", x, src, tag, timeout), x)

    def batch_isend_irecv(self, ops: Sequence["P2POp"], *, timeout: Optional[float] = None) -> List["P2PWork"]:
        """Post every point-to-point operation of `ops` (P2POp: "isend"/"irecv", buffer, peer, tag),
        then return their Works in the same order (torch.distributed.batch_isend_irecv, MPI_Startall).
        Every op is checked before any is posted, and all are posted before any is waited for, so
        the order of sends and receives in a batch cannot deadlock a pairwise exchange; ops between
        one pair in one direction still match in list order."""
        ops = list(ops)
        if not ops:
            raise ValueError(f"rank {self.rank}: batch_isend_irecv needs at least one P2POp")
        checked = [self._check_p2p(*self._p2p_op(op, i), timeout) for i, op in enumerate(ops)]
        return [self._p2p_work(*self._start_p2p(*c), c[1] if c[0] == "irecv" else None) for c in checked]

    def _p2p_op(self, op: Any, i: int) -> Tuple[str, Any, Any, int]:
        """(call, buffer, peer, tag) of the i-th P2POp of a batch."""
        if not isinstance(op, P2POp):
            raise TypeError(f"rank {self.rank}: batch_isend_irecv ops[{i}] is a {type(op).__name__}, not a P2POp")
        kind = op.op
        if callable(kind):  # comm.isend / comm.irecv, as torch's P2POp takes dist.isend / dist.irecv
            kind = getattr(kind, "__name__", kind)
        if kind not in ("isend", "irecv"):
            raise ValueError(f"rank {self.rank}: batch_isend_irecv ops[{i}].op={op.op!r} must be 'isend' or "
                             "'irecv'")
        return kind, op.buf, op.peer, op.tag

    def _post_p2p(self, call: str, x: Any, peer: Any, tag: int, timeout: Optional[float]
                  ) -> Tuple[Any, float, str, Optional[list]]:
        """Validate a point-to-point call and post it: (request, its deadline in s, what it is called,
        its flight-recorder entry)."""
        return self._start_p2p(*self._check_p2p(call, x, peer, tag, timeout))

    def _check_p2p(self, call: str, x: Any, peer: Any, tag: int, timeout: Optional[float]
                   ) -> Tuple[str, Any, np.ndarray, int, MsgKey, float, str]:
        """Everything a point-to-point call needs, checked, nothing posted."""
        self._check_open(call)
        sending = call.endswith("send")
        arr = self._input(x, call, not sending)
        if not sending and (peer is None or (not isinstance(peer, bool) and isinstance(peer, (int, np.integer))
                                             and peer == ANY_SOURCE)):
            peer, whom = ANY_SOURCE, "any rank"
        else:
            peer = self._peer(peer, "dst" if sending else "src", call)
            whom = f"rank {peer}"
        key, limit = self._p2p_key(tag, call), self._deadline(timeout, call)
        what = f"{call} {'to' if sending else 'from'} {whom} tag {tag} on {self.name}"
        return call, x, arr, peer, key, limit, what

    def _start_p2p(self, call: str, x: Any, arr: np.ndarray, peer: int, key: MsgKey, limit: float,
                   what: str) -> Tuple[Any, float, str, Optional[list]]:
        rec = self._recorder
        entry = None if rec is None else rec.enter_p2p(call, (arr.dtype, arr.size, peer, key.tag))
        if call.endswith("send"):
            req = self.transport.isend(byte_view(arr), self.group[peer], key, dtype_code(arr.dtype))
        else:
            target = ANY if peer == ANY_SOURCE else self.group[peer]
            req = self.transport.irecv(byte_view(arr), target, key, dtype_code(arr.dtype))
        return req, limit, what, entry

    def _wait_p2p(self, req: Any, limit: float, what: str, entry: Optional[list]) -> None:
        """Wait for a posted point-to-point request, telling the flight recorder how it ended."""
        if entry is None:
            return self.transport.wait([req], limit, what)
        try:
            self.transport.wait([req], limit, what)
        except BaseException as e:
            self._recorder.fail(entry, e)
            raise
        self._recorder.complete_p2p(entry)

    def _source(self, req: Any) -> Optional[int]:
        """The communicator rank a completed request went to or came from (None while an any-source
        receive has not matched)."""
        if req.peer == ANY:
            return None
        if self._ranks is None:
            self._ranks = {g: r for r, g in enumerate(self.group)}
        return self._ranks[req.peer]

    def _p2p_work(self, req: Any, limit: float, what: str, entry: Optional[list], result: Any) -> "P2PWork":
        """A Work finishing when the posted request `req` does, waited for on the p2p worker (in
        posting order, off the collectives' worker so neither stalls the other)."""
        if self._p2p_worker is None:
            self._p2p_worker = Worker(f"pycoll-{self.name}-p2p")

        def finish() -> Any:
            self._wait_p2p(req, limit, what, entry)
            return result
        work = self._p2p_worker.submit(what, finish)
        return P2PWork(what, work.get_future(), lambda: self._source(req), req.key.tag, req.nbytes,
                       self._p2p_worker, entry)

    def _p2p_key(self, tag: int, call: str) -> MsgKey:
        if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)) or not 0 <= tag < 2 ** 62:
            raise ValueError(f"rank {self.rank}: {call} tag={tag!r} must be an integer in 0..2**62-1")
        return MsgKey(self.comm_id, P2P_SEQ, int(tag))

    # -- persistent calls (persistent.py) --------------------------------------------------------
    # Each is checked as the plain call is and its algorithm chosen now; nothing is sent. h() runs it
    # once (h.start() + h.wait() to overlap), any number of times, on the same buffers.
    def allreduce_init(self, x: Any, out: Any = None, op: OpLike = ReduceOp.SUM, *,
                       timeout: Optional[float] = None, algo: Optional[str] = None) -> Persistent:
        """allreduce(x, out, op) as a persistent handle (MPI_Allreduce_init)."""
        return _persistent(self, self.allreduce, (x, out, op), {"algo": algo}, timeout,
                           [("x", x, out is None), ("out", out, True)])

    def reduce_init(self, x: Any, root: int = 0, op: OpLike = ReduceOp.SUM, out: Any = None, *,
                    timeout: Optional[float] = None, algo: Optional[str] = None) -> Persistent:
        """reduce(x, root, op, out) as a persistent handle (MPI_Reduce_init)."""
        return _persistent(self, self.reduce, (x, root, op, out), {"algo": algo}, timeout,
                           [("x", x, out is None and self.rank == root), ("out", out, True)])

    def broadcast_init(self, x: Any, root: int = 0, *, timeout: Optional[float] = None,
                       algo: Optional[str] = None) -> Persistent:
        """broadcast(x, root) as a persistent handle (MPI_Bcast_init)."""
        return _persistent(self, self.broadcast, (x, root), {"algo": algo}, timeout,
                           [("x", x, self.rank != root)])

    def allgather_init(self, x: Any, out: Any = None, *, timeout: Optional[float] = None,
                       algo: Optional[str] = None) -> Persistent:
        """allgather(x, out) as a persistent handle (MPI_Allgather_init); without `out` every run
        writes into the one array the handle made."""
        return _persistent(self, self.allgather, (x, out), {"algo": algo}, timeout,
                           [("x", x, False), ("out", out, True)])

    def reduce_scatter_init(self, x: Any, out: Any = None, op: OpLike = ReduceOp.SUM, *,
                            counts: Optional[Sequence[int]] = None, timeout: Optional[float] = None,
                            algo: Optional[str] = None) -> Persistent:
        """reduce_scatter(x, out, op, counts) as a persistent handle (MPI_Reduce_scatter_init)."""
        return _persistent(self, self.reduce_scatter, (x, out, op), {"counts": counts, "algo": algo}, timeout,
                           [("x", x, False), ("out", out, True)])

    def alltoall_init(self, x: Any, out: Any = None, *, timeout: Optional[float] = None,
                      algo: Optional[str] = None) -> Persistent:
        """alltoall(x, out) as a persistent handle (MPI_Alltoall_init)."""
        return _persistent(self, self.alltoall, (x, out), {"algo": algo}, timeout,
                           [("x", x, False), ("out", out, True)])

    def barrier_init(self, *, timeout: Optional[float] = None) -> Persistent:
        """barrier() as a persistent handle (MPI_Barrier_init)."""
        return _persistent(self, self.barrier, (), {}, timeout, [])

    def send_init(self, x: Any, dst: int, tag: int = 0, *, timeout: Optional[float] = None) -> PersistentP2P:
        """send(x, dst, tag) as a persistent handle (MPI_Send_init): each start posts it."""
        return point_to_point(self, "send", x, dst, tag, timeout)

    def recv_init(self, x: Any, src: Optional[int] = ANY_SOURCE, tag: int = 0, *,
                  timeout: Optional[float] = None) -> PersistentP2P:
        """recv(x, src, tag) as a persistent handle (MPI_Recv_init): each start posts it."""
        return point_to_point(self, "recv", x, src, tag, timeout)

    # -- sub-communicators ------------------------------------------------------------------------
    def split(self, color: Optional[int], key: int = 0) -> Optional["Communicator"]:
        """Ranks with the same color form a new communicator, ordered by (key, rank); color None/<0 opts out."""
        self._check_open("split")
        mine = np.array([-1 if color is None or color < 0 else int(color), int(key)], np.int64)
        table = self.allgather(mine)
        child = next(self._children)
        if mine[0] < 0:
            return None
        members = sorted((r for r in range(self.size) if table[r, 0] == mine[0]),
                         key=lambda r: (table[r, 1], r))
        return self._child(f"{self.name}.split{child}.{mine[0]}", members)

    def dup(self) -> "Communicator":
        """Same ranks, separate traffic: collectives on the copy never match the original's."""
        self._check_open("dup")
        self.barrier()  # every rank must dup in the same order; this also fixes the child counter
        return self._child(f"{self.name}.dup{next(self._children)}", list(range(self.size)))

    def subgroup(self, ranks: Sequence[int], name: str) -> Optional["Communicator"]:
        """A communicator over `ranks` (ranks of this one; the new rank i is ranks[i]) that only its
        members create, each with the same `ranks` and `name` (torch's new_group): nothing is sent on
        this communicator, and the other ranks need not call it (if they do, they get None). Its
        traffic is keyed by an id of its own (from this communicator's name, `name` and `ranks`),
        apart from this communicator's, its dups', splits' and other subgroups'. A (name, ranks)
        pair makes one subgroup per communicator: a second call raises ValueError."""
        self._check_open("subgroup")
        if not isinstance(name, str) or not name:
            raise ValueError(f"rank {self.rank}: subgroup name={name!r} must be a non-empty string")
        members = [self._peer(r, "ranks[]", "subgroup") for r in ranks]
        if not members or len(set(members)) != len(members):
            raise ValueError(f"rank {self.rank}: subgroup ranks={list(ranks)!r} must be distinct ranks of "
                             f"{self.name}, at least one")
        if self.rank not in members:
            return None
        made = (name, tuple(members))
        if made in self._subgroups:
            raise ValueError(f"rank {self.rank}: subgroup {name!r} over ranks {members} of {self.name} exists "
                             "already; give each subgroup its own name")
        self._subgroups.add(made)
        return self._child(f"{self.name}/subgroup[{name}]({','.join(map(str, members))})", members)

    def _child(self, name: str, members: List[int], lanes: Optional[Dict[int, int]] = None) -> "Communicator":
        """A communicator of `members` (ranks of this one) on the same transport, with the selector's
        model; a child of a communicator restored after a failure is restored too (ft.py)."""
        group = [self.group[r] for r in members]
        hosts = self.membership.hosts
        me = self.group[self.rank]
        same = [g for g in group if hosts[g] == hosts[me]]
        membership = Membership(hosts=hosts, local_rank=same.index(me), local_size=len(same))
        child = Communicator(self.transport, group, group.index(me), name, membership, self.timeout,
                             topology=self.topology.subset(members), lanes=lanes,
                             peer_memory=self.peer_memory)  # (with lanes: shrink's survivors reach as before)
        # the parent's model, its own board
        child.selector = self.selector.for_board(*child._board_capacity(), child.peer_memory)
        ft.inherit(self, child)
        return child

    # -- fault tolerance (ft.py) ------------------------------------------------------------------
    def revoke(self) -> None:
        """Make every live member's pending and later calls on this communicator raise RevokedError
        (within a second, whatever they are doing); local, returns at once, idempotent. Then agree()."""
        ft.revoke(self)

    def agree(self, flag: bool = True, *, timeout: Optional[float] = None) -> Tuple[bool, List[int]]:
        """(AND of every live member's `flag`, the members all survivors agree are dead): completes
        although members die before or during it, and on a revoked communicator. Without dead members
        the communicator works again afterwards; with some, shrink() it. Collective over the live members."""
        return ft.agree(self, flag, timeout)

    def shrink(self, *, timeout: Optional[float] = None) -> "Communicator":
        """A new communicator of the live members, renumbered in order (collective over them); this
        one is released. PartitionError on a side cut off from the majority of a multi-host one."""
        return ft.shrink(self, timeout)

    def grow(self, *, timeout: Optional[float] = None, arrivals: Optional[int] = None) -> "Communicator":
        """This communicator's members and the newcomers waiting in the job's store (restarted ranks, a
        new node's: pycoll.join()) as one new communicator, members keeping their ranks, newcomers after
        them (pycoll/grow.py); this one is released. Collective over the members, between calls (calls
        in flight: RuntimeError). Returns self when nobody waits; GrowError when a newcomer does not
        connect within `timeout` (PYCOLL_GROW_TIMEOUT), and the members go on here. `arrivals`: the
        ticket the members already agreed on (ft.agree_max over grow.arrivals), saving an agreement."""
        return grow.grow(self, timeout, arrivals)

    def _shrunk(self, name: str, group: List[int], lanes: Optional[Dict[int, int]]) -> "Communicator":
        """shrink()'s communicator over `group` (transport ranks) with the agreed board `lanes`."""
        return self._child(name, [self.group.index(g) for g in group], lanes)

    def _hand_over(self, successor: "Communicator") -> None:
        """shrink(): `successor` takes over the transport and store; this one is closed, waiting on nobody."""
        successor._owns_transport, successor.store = self._owns_transport, self.store
        self._owns_transport, self.store = False, None
        ft.replace_default(self, successor)
        self.close()

    # -- lifetime ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Finish queued work and release the transport (if this communicator owns it)."""
        if self._closed:
            return
        self._closed = True
        if self._worker is not None:
            self._worker.close()
        if self._recorder is not None:  # the flight recorder's dump at the job's end
            recorder.closing(self._recorder, self._owns_transport)
        if self.windows is not None:
            self.windows.close()
        if self._p2p_worker is not None:
            self._p2p_worker.close()
        if self._owns_transport:
            self.transport.close()
            if self.store is not None:
                self.store.close()

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _displacements(counts: Sequence[int]) -> List[int]:
    return [int(v) for v in np.concatenate([[0], np.cumsum(counts)[:-1]])] if counts else []

"""The flight recorder: every communicator's last calls, kept in a fixed ring and dumped as JSON.

Recording is on the hot path of every call, so it does no formatting. A blocking call is stored
once, when it ends: one tuple (call number, collective, the fingerprint tuple the communicator
built anyway, the algorithm function, times, the user's code and instruction) in a preallocated
ring; while it runs, a dump finds it on its thread's stack. Queued (async) and point-to-point
calls get a list that changes state as they go; the Work of an async call (pycoll/work.py) stamps in
it when the caller's first wait that found the call done began and returned (two floats: the ring
still holds nothing else for the garbage collector to scan).
Everything is turned into text only when a dump is written: when a pycoll error ends a call, on
SIGUSR1 (the job goes on), on SIGTERM (then the process ends as it would have), after an
uncaught exception, and when the job ends normally (its world communicator closes, or the process
exits), each to PYCOLL_TRACE_DIR/rank<R>.json (written whole, then renamed). An ending dump never
replaces one that a failure wrote. A dump also holds what `pycoll trace DIR --traffic` needs
(trace/traffic.py): the job's identity, each communicator's hosts, each call's algorithm, and
the step marks (mark_step()).

With PYCOLL_TRACE_DIR set, each process also keeps a small memory-mapped file,
PYCOLL_TRACE_DIR/rank<R>.live, holding per communicator the last call entered and completed.
A launcher reads it at any time without disturbing the rank (and it outlives a killed rank):
that is how `pycoll run` detects a job that makes no progress and prints its live view.
"""
from __future__ import annotations

import atexit
import collections
import functools
import hashlib
import itertools
import json
import mmap
import os
import signal
import socket
import struct
import sys
import threading
import time
import traceback
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .. import config
from ..errors import PeerError, TimeoutError
from ..ops import ReduceOp

QUEUED, STARTED, COMPLETED, FAILED = 0, 1, 2, 3
STATES = ("queued", "started", "completed", "failed")
P2P_CALLS = ("send", "recv", "isend", "irecv")
FORMAT = 1  # the dump's "pycoll_trace" version

# one ring entry: a list indexed by these (a list, not an object: cheapest to build and to update).
# WAIT_BEGIN and WAIT_END: None for a call with no Work (blocking); for an async one 0.0 until a wait
# on its Work returns with it done, then when that wait began and returned (pycoll/work.py stamps them)
SEQ, CALL, FP, ALGO, STATE, T_ENTER, T_START, T_END, FILE, LINE, PEERS, ERROR, WAIT_BEGIN, WAIT_END = range(14)

# the live file: a header, then SLOTS slots of SLOT_BYTES (8 int64 columns, then the name)
LIVE_MAGIC = b"PYCLIVE1"
LIVE_HEADER = struct.Struct("<8sqqq")  # magic, rank, pid, slots
LIVE_SLOTS = 64
LIVE_SLOT_BYTES = 128
LIVE_NAME_BYTES = 64
LIVE_COLUMNS = ("comm_id", "size", "entered", "completed", "p2p_entered", "p2p_completed", "failed", "used")
_C_ENTERED, _C_COMPLETED, _C_P2P_ENTERED, _C_P2P_COMPLETED, _C_FAILED = 2, 3, 4, 5, 6
LIVE_BYTES = LIVE_HEADER.size + LIVE_SLOTS * LIVE_SLOT_BYTES

MAX_DUMP_COMMS = 64  # a dump holds at most this many communicators (the most recently used)
MAX_TEXT = 600  # error messages are cut to this many characters in a dump
MAX_FRAMES = 24  # stack frames kept per thread in a dump
MAX_MARKS = 4096  # step marks kept (a dump holds the newest this many)

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# pycoll's own applications (the trainer, the bench's loops) count as user code: their lines are the call sites
_OUTSIDE = (os.path.join(_PACKAGE_DIR, "trainer") + os.sep, os.path.join(_PACKAGE_DIR, "cli") + os.sep)
_internal: Dict[str, bool] = {}  # code file name -> inside pycoll (or torch.distributed)?
_time = time.time
_getframe = sys._getframe
_user_code: Any = None  # the code of the last call site found: checked first
_marks: List[float] = [0.0] * MAX_MARKS  # when step k ended, at [(k - 1) % MAX_MARKS]
_steps = 0  # steps marked so far in this process


def mark_step() -> int:
    """Mark the end of a training step (or of one generated token) in every flight recorder of this
    process and return its number (1, 2, ...). Dumps keep the newest MAX_MARKS marks, so a trace's
    calls can be told apart by step (`pycoll trace DIR --traffic`). One list store: cheap enough for
    every step. Call it from one thread (the training loop)."""
    global _steps
    n = _steps
    _marks[n % MAX_MARKS] = _time()
    _steps = n + 1
    return n + 1


def marks() -> List[Tuple[int, float]]:
    """The kept step marks, oldest first: (step number, time it ended)."""
    n = _steps
    return [(k + 1, _marks[k % MAX_MARKS]) for k in range(max(0, n - MAX_MARKS), n)]


def _is_internal(filename: str) -> bool:
    """Whether a frame of `filename` is library code that a call site should look past."""
    path = os.path.abspath(filename) if not filename.startswith("<") else filename
    if path.startswith(_PACKAGE_DIR) and not path.startswith(_OUTSIDE):
        return True
    torch = sys.modules.get("torch")
    torch_dir = os.path.dirname(getattr(torch, "__file__", None) or "") if torch is not None else ""
    return bool(torch_dir) and path.startswith(torch_dir + os.sep)


def _first_outside(f: Any) -> Any:
    """The first frame from `f` outwards that is outside pycoll (and torch), or None; its code is
    remembered as the likely next one (`_user_code`)."""
    global _user_code
    known = _internal
    while f is not None:
        code = f.f_code
        inside = known.get(code.co_filename)
        if inside is None:
            inside = known[code.co_filename] = _is_internal(code.co_filename)
        if not inside:
            _user_code = code
            return f
        f = f.f_back
    return None


def _site(entry: List[Any], depth: int) -> None:
    """Store the code object and instruction offset of the first frame outside pycoll (and torch)
    in `entry`: the line number is worked out from them only when a dump is written (f_lineno
    decodes the line table, which costs more than the rest of recording together)."""
    try:
        f: Any = _first_outside(_getframe(depth))
    except ValueError:
        return
    if f is not None:
        entry[FILE], entry[LINE] = f.f_code, f.f_lasti


def _line(code: Any, lasti: int) -> Optional[int]:
    """The source line of instruction offset `lasti` in `code`."""
    for start, end, line in code.co_lines():
        if start <= lasti < end:
            return line
    return code.co_firstlineno


class Recorder:
    """One communicator's ring of its last `capacity` calls (collectives and point-to-point)."""

    __slots__ = ("name", "comm_id", "rank", "group", "capacity", "topology", "board", "_ring", "_n", "_p2p",
                 "_live", "_base", "__weakref__")

    def __init__(self, name: str, comm_id: int, rank: int, group: Sequence[int], capacity: int,
                 topology: Any = None, board: Optional[Tuple[int, int, bool]] = None) -> None:
        self.name, self.comm_id, self.rank, self.group = name, comm_id, rank, list(group)
        self.topology = topology  # the communicator's pycoll.topology.Topology (its members' hosts)
        self.board = board  # (slot bytes, stage bytes, peers' memory reachable): when board algorithms fall back
        self.capacity = capacity
        # Entries outlive their calls by 2,000 others, which the garbage collector must not notice: with
        # torch loaded a full collection takes 130-170 ms, in the middle of a step (gloo's calls set off
        # none). So each slot starts as a placeholder of two objects the collector counts, as an entry
        # is (its tuple or list and the call's fingerprint), and storing an entry frees one: filling the
        # ring adds nothing to the collector's count. Blocking calls' tuples hold nothing it tracks, so
        # a young collection untracks them and none is ever promoted (call()). Slots past `_n` are never read.
        self._ring: List[Any] = [([],) for _ in range(capacity)]
        self._n = 0  # entries ever recorded
        self._p2p = 0  # point-to-point calls ever entered (their call numbers)
        self._live: Optional[memoryview] = None  # int64 view of the live file, where there is one
        self._base = 0  # this communicator's first column in it

    # -- the hot path -----------------------------------------------------------------------------
    def enter(self, seq: int, call: str, fingerprint: Tuple, algo: Any) -> list:
        """Record that call number `seq` was queued (async, or behind async work); traced() runs it."""
        t = _time()
        e = [seq, call, fingerprint, algo, QUEUED, t, t, 0.0, None, 0, None, None, None, None]
        _site(e, 3)  # this, Communicator._run, the collective's method, then the user's frame
        self._store(e)
        if self._live is not None:
            self._live[self._base + _C_ENTERED] = seq
        return e

    def call(self, seq: int, call: str, fingerprint: Tuple, algo: Any, body: Callable[[Any], Any], ch: Any) -> Any:
        """Run the blocking call number `seq`, `body(ch)`, and record it once it has ended: one tuple
        stored in the ring (enter() and complete() inlined: this is the hot path of every blocking
        call). While it runs, only this frame knows of it; a dump finds it there (_running())."""
        live = self._live
        if live is not None:
            live[self._base + _C_ENTERED] = seq
        t = _time()
        try:
            result = body(ch)
        except BaseException as error:
            e = [seq, call, fingerprint, algo, STARTED, t, t, 0.0, None, 0, None, None, None, None]
            _site(e, 3)
            self._store(e)
            self.fail(e, error)
            raise
        try:  # _site() inlined (the hot path): the user's frame is 3 up: this, Communicator._run, the collective
            f: Any = _getframe(3)
        except ValueError:  # a thread that C++ started (torch's autograd engine running DDP's hook)
            f = None
        if f is not None and f.f_code is not _user_code:
            f = _first_outside(f)
        # only objects the collector need not track (the algorithm and the call site's code by number,
        # the op by its name): the tuple is then untracked at the next young collection, never promoted
        op = fingerprint[2]
        if op is not None and op.__class__ is not str:  # (a persistent handle passes the name: made once)
            fingerprint = (fingerprint[0], fingerprint[1], _OP_NAMES[op], *fingerprint[3:])
        aid = _ALGO_IDS.get(algo)
        code = None
        if f is not None:
            code = id(f.f_code)
            if code not in _CODES:
                _CODES[code] = f.f_code
        n = self._n
        self._ring[n % self.capacity] = (seq, call, fingerprint, _algo_id(algo) if aid is None else aid, COMPLETED,
                                         t, t, _time(), code, 0 if f is None else f.f_lasti, None, None, None, None)
        self._n = n + 1
        if live is not None:
            live[self._base + _C_COMPLETED] = seq
        return result

    def _store(self, e: list) -> None:
        """Put entry `e` in the ring, over the oldest once it is full."""
        n = self._n
        self._ring[n % self.capacity] = e
        self._n = n + 1

    def enter_p2p(self, call: str, fingerprint: Tuple) -> list:
        """Record a point-to-point call (`fingerprint`: dtype, count, peer, tag); numbered on its own."""
        self._p2p += 1
        t = _time()
        e = [self._p2p, call, fingerprint, None, STARTED, t, t, 0.0, None, 0, None, None, None, None]
        _site(e, 2)
        self._store(e)
        if self._live is not None:
            self._live[self._base + _C_P2P_ENTERED] = self._p2p
        return e

    def start(self, e: list) -> None:
        """A queued call began running."""
        e[STATE], e[T_START] = STARTED, _time()

    def complete(self, e: list) -> None:
        """The collective finished without an error."""
        e[STATE], e[T_END] = COMPLETED, _time()
        if self._live is not None:
            self._live[self._base + _C_COMPLETED] = e[SEQ]

    def complete_p2p(self, e: list) -> None:
        """The point-to-point call finished without an error."""
        e[STATE], e[T_END] = COMPLETED, _time()
        if self._live is not None:
            self._live[self._base + _C_P2P_COMPLETED] += 1

    def fail(self, e: list, error: BaseException) -> None:
        """The call ended with `error`: keep whom it still waited for, and dump if it is pycoll's."""
        e[STATE], e[T_END] = FAILED, _time()
        if isinstance(error, TimeoutError):
            e[PEERS] = list(error.peers)
        elif isinstance(error, PeerError) and error.peer is not None:
            e[PEERS] = [error.peer]
        e[ERROR] = f"{type(error).__name__}: {error}"[:MAX_TEXT]
        if self._live is not None and e[CALL] not in P2P_CALLS:
            self._live[self._base + _C_FAILED] = e[SEQ]
        if isinstance(error, (TimeoutError, PeerError)):
            where = None if e[FILE] is None else f"{e[FILE].co_filename}:{_line(e[FILE], e[LINE])} in {e[FILE].co_name}"
            PROCESS.dump(f"{type(error).__name__} in {e[CALL]} (call {e[SEQ]} on {self.name})",
                         where=where, error=e[ERROR], failure=True)

    def traced(self, e: list, body: Any) -> Any:
        """`body(ch)` of a queued call, recording when it starts and how it ends."""
        def run(ch: Any) -> Any:
            self.start(e)
            try:
                result = body(ch)
            except BaseException as error:
                self.fail(e, error)
                raise
            self.complete(e)
            return result
        return run

    # -- reading it -------------------------------------------------------------------------------
    def entries(self) -> List[list]:
        """Copies of the recorded entries and of the blocking calls running now, oldest first."""
        n, cap, ring = self._n, self.capacity, list(self._ring)
        order = range(n) if n <= cap else range(n - cap, n)
        out = [list(e) for e in (ring[i % cap] for i in order) if e is not None]
        for e in out:
            if type(e[ALGO]) is int:  # a blocking call's algorithm and site, stored by number (call())
                e[ALGO] = _ALGOS[e[ALGO]]
            if type(e[FILE]) is int:
                e[FILE] = _CODES[e[FILE]]
        ended = {(e[CALL], e[SEQ]) for e in out}
        out += [e for e in self._running() if (e[CALL], e[SEQ]) not in ended]
        out.sort(key=lambda e: e[T_ENTER])
        return out

    def _running(self) -> List[list]:
        """The blocking calls of this communicator that are running now, on any thread, as entries:
        call() records a call only when it ends, so its frame is where a running one is found."""
        running = []
        for top in list(sys._current_frames().values()):
            f = top
            while f is not None:
                v = f.f_locals if f.f_code is _CALL_CODE else None  # (f_locals builds a dict: once)
                if v is not None and v.get("self") is self and "t" in v:
                    e = [v["seq"], v["call"], v["fingerprint"], v["algo"], STARTED, v["t"], v["t"], 0.0, None, 0,
                         None, None, None, None]
                    user = _first_outside(f.f_back)
                    if user is not None:
                        e[FILE], e[LINE] = user.f_code, user.f_lasti
                    running.append(e)
                f = f.f_back
        return running

    def last_time(self) -> float:
        """When the newest entry was entered (0 if none)."""
        e = self._ring[(self._n - 1) % self.capacity] if self._n else None
        return e[T_ENTER] if e is not None else 0.0

    def describe(self) -> Dict[str, Any]:
        """This communicator and its calls as JSON-ready data; `hosts` (and `racks`, where declared):
        each member's host id as the communicator's topology has it."""
        out = {"name": self.name, "id": f"{self.comm_id:#018x}", "rank": self.rank, "size": len(self.group),
               "group": self.group, "capacity": self.capacity, "recorded": self._n}
        if self.board is not None:
            out["board"] = list(self.board)
        topo = self.topology
        if topo is not None and topo.size == len(self.group):
            out["hosts"] = [topo.hosts[h] for h in topo.host_of]
            if topo.racks:
                out["racks"] = [info.rack for info in topo.ranks]
        out["calls"] = [_entry_json(e) for e in self.entries()]
        return out

    def host(self) -> Optional[str]:
        """This rank's host id as the topology has it (PYCOLL_HOSTID, PYCOLL_TOPO_FILE honoured)."""
        topo = self.topology
        return topo.hosts[topo.host_of[self.rank]] if topo is not None and topo.size == len(self.group) else None


_CALL_CODE = Recorder.call.__code__
_OP_NAMES = {op: op.value for op in ReduceOp}
_ALGO_IDS: Dict[Any, int] = {}  # algorithm function -> its number in _ALGOS (a ring entry stores the number)
_ALGOS: List[Any] = []
_CODES: Dict[int, Any] = {}  # id -> a call site's code object, kept alive so that the id stays its own
_algo_lock = threading.Lock()


def _algo_id(fn: Any) -> Any:
    """`fn`'s number in _ALGOS, registered on first sight (the selector's few cached functions; past
    4,096 distinct ones the function itself is stored)."""
    with _algo_lock:
        if fn not in _ALGO_IDS:
            if len(_ALGOS) >= 4096:
                return fn
            _ALGO_IDS[fn] = len(_ALGOS)
            _ALGOS.append(fn)
        return _ALGO_IDS[fn]


def _entry_json(e: list) -> Dict[str, Any]:
    p2p = e[CALL] in P2P_CALLS
    dtype, count, third, fourth, fifth = (tuple(e[FP]) + (None,) * 5)[:5] if e[FP] else (None,) * 5
    out: Dict[str, Any] = {"seq": e[SEQ], "call": e[CALL], "p2p": p2p,
                           "dtype": None if dtype is None else str(dtype), "count": _count(count),
                           "itemsize": getattr(dtype, "itemsize", None)}
    if p2p:
        out.update(peer=third, tag=fourth)
    else:
        out.update(op=None if third is None else getattr(third, "value", str(third)), root=fourth,
                   algo=_algo_name(e[ALGO]))
        if e[ALGO] is not None:
            out.update(_algorithm(e[CALL], e[ALGO], dtype, count, fourth))
        if fifth is not None:  # alltoallv: what this rank sends each peer
            out["send_counts"] = [int(c) for c in fifth]
    out.update(state=STATES[e[STATE]], enter=e[T_ENTER], start=e[T_START], end=e[T_END] or None,
               site=None if e[FILE] is None else f"{e[FILE].co_filename}:{_line(e[FILE], e[LINE])}")
    if e[WAIT_BEGIN] is not None:  # an async call: when the caller waited on it (null: it never did)
        out.update(wait_begin=e[WAIT_BEGIN] or None, wait_end=e[WAIT_END] or None)
    if e[PEERS] is not None:
        out["waiting_for"] = e[PEERS]
    if e[ERROR] is not None:
        out["error"] = e[ERROR]
    return out


def _count(count: Any) -> Any:
    """An element count, or per-rank counts (cut to 16 and summed past that)."""
    if count is None or isinstance(count, int):
        return count
    try:
        counts = [int(c) for c in count]
    except TypeError:
        return int(count)
    return counts if len(counts) <= 16 else {"total": sum(counts), "first": counts[:16]}


_traffic: Any = None  # trace/traffic.py, imported by the first dump


def _algorithm(call: str, fn: Any, dtype: Any, count: Any, root: Any) -> Dict[str, Any]:
    """{"algorithm": its name in pycoll.selection (ring, flat_ring, tree, binomial, ...)}, with
    "registered": true for a call that reads registered buffers in place where it can, and for a
    hierarchical one "phase": the algorithm its cross-host phase ran (trace/traffic.py)."""
    global _traffic
    if _traffic is None:  # (at dump time only: it imports the selection layer)
        from . import traffic as _traffic
    try:
        return _traffic.describe_algorithm(call, fn, dtype, count, root)
    except Exception as e:  # a dump must not fail on an algorithm it cannot name
        return {"algorithm": None, "algorithm_error": f"{type(e).__name__}: {e}"[:MAX_TEXT]}


def _algo_name(fn: Any) -> Optional[str]:
    if fn is None:
        return None
    fn = getattr(fn, "func", fn)  # functools.partial of the topology-aware ones
    module = getattr(fn, "__module__", None) or ""
    return module.rsplit(".", 1)[-1] or getattr(fn, "__name__", repr(fn))


def _frames(frame: Any) -> List[str]:
    """A stack, innermost last, as 'file:line in function' lines (the last MAX_FRAMES)."""
    return [f"{fs.filename}:{fs.lineno} in {fs.name}" for fs in traceback.extract_stack(frame)[-MAX_FRAMES:]]


def _user_frame(frame: Any) -> Optional[str]:
    """Where a stack is in the user's code, as 'file:line in function': the caller of its outermost
    pycoll frame (a rank blocked in a call), else its innermost frame (a rank in its own code)."""
    stack = []
    while frame is not None:
        stack.append(frame)
        frame = frame.f_back
    flags = []
    for f in stack:
        name = f.f_code.co_filename
        inside = _internal.get(name)
        if inside is None:
            inside = _internal[name] = _is_internal(name)
        flags.append(inside)
    outermost = max((i for i, inside in enumerate(flags) if inside), default=-1)
    for f, inside in zip(stack[outermost + 1:], flags[outermost + 1:]):
        name = f.f_code.co_filename
        if not inside and not name.startswith("<") and not name.endswith("threading.py"):
            return f"{name}:{f.f_lineno} in {f.f_code.co_name}"
    return None


class _Process:
    """What one process records: its communicators' rings, the trace folder, the live file, hooks."""

    def __init__(self) -> None:
        self.recorders: "weakref.WeakSet[Recorder]" = weakref.WeakSet()
        # closed communicators' recorders, kept for the dump at the job's end (the newest ones)
        self.closed: "collections.deque[Recorder]" = collections.deque(maxlen=MAX_DUMP_COMMS)
        self.rank: Optional[int] = None
        self.started = 0.0  # when the first communicator was made
        self.failed = False  # a dump for a failure was written: an ending dump must not replace it
        self.dumped_at: Optional[Tuple[int, int]] = None  # (calls, marks) when the last dump was written
        self.folder: Optional[str] = None
        self.live: Optional[memoryview] = None
        self.live_map: Optional[mmap.mmap] = None
        self.slots = 0
        self.hooked = False
        self.lock = threading.RLock()  # guards set-up and dump writing, never the hot path
        self.dumps = itertools.count()

    def recorder(self, name: str, comm_id: int, rank: int, group: Sequence[int], topology: Any = None,
                 board: Optional[Tuple[int, int, bool]] = None) -> Optional[Recorder]:
        """A Recorder for a new communicator (None with PYCOLL_TRACE_BUFFER=0); the first one fixes
        this process's rank and, with PYCOLL_TRACE_DIR, opens the live file and installs the hooks."""
        capacity = config.get("PYCOLL_TRACE_BUFFER")
        if capacity == 0:
            return None
        rec = Recorder(name, comm_id, rank, group, capacity, topology, board)
        with self.lock:
            if self.rank is None:
                self.rank, self.started = group[rank], _time()
            folder = config.get("PYCOLL_TRACE_DIR")
            if folder and self.folder is None:
                self._open(folder)
            self.recorders.add(rec)
            if self.live is not None and self.slots < LIVE_SLOTS:
                self._claim(rec)
        if self.folder and not self.hooked:
            self._hook()
        return rec

    def _open(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        self.folder = folder
        old = os.path.join(folder, f"rank{self.rank}.json")
        try:  # this rank's dump of an earlier job in the same folder would be taken for this job's (one of
            with open(old) as f:  # this job, a rank that died and was replaced, stays until this one dumps)
                stale = json.load(f).get("job") != job_identity() or job_identity() is None
            if stale:
                os.unlink(old)
        except (OSError, ValueError, AttributeError):
            pass
        path = os.path.join(folder, f"rank{self.rank}.live")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, LIVE_BYTES)
            self.live_map = mmap.mmap(fd, LIVE_BYTES)
        finally:
            os.close(fd)
        LIVE_HEADER.pack_into(self.live_map, 0, LIVE_MAGIC, self.rank, os.getpid(), LIVE_SLOTS)
        self.live = memoryview(self.live_map)[LIVE_HEADER.size:].cast("q")

    def _claim(self, rec: Recorder) -> None:
        """Give `rec` the next slot of the live file."""
        base = self.slots * (LIVE_SLOT_BYTES // 8)
        name = rec.name.encode()[:LIVE_NAME_BYTES]
        offset = LIVE_HEADER.size + self.slots * LIVE_SLOT_BYTES
        assert self.live is not None and self.live_map is not None
        self.live_map[offset + 64:offset + 64 + LIVE_NAME_BYTES] = name.ljust(LIVE_NAME_BYTES, b"\0")
        self.live[base:base + 8] = memoryview(struct.pack("<8q", rec.comm_id - (1 << 64) * (rec.comm_id >= 1 << 63),
                                                          len(rec.group), 0, 0, 0, 0, 0, 1)).cast("q")
        self.slots += 1
        rec._live, rec._base = self.live, base

    def _hook(self) -> None:
        """Dump on SIGUSR1 (and go on), on SIGTERM (then end as SIGTERM would), after an uncaught
        exception, and at exit. Signals only where nobody else handles them, and only from the main thread."""
        self.hooked = True
        atexit.register(self.ended, "process exit")
        if threading.current_thread() is threading.main_thread():
            for signum, handler in ((signal.SIGUSR1, self._on_usr1), (signal.SIGTERM, self._on_term)):
                if signal.getsignal(signum) is signal.SIG_DFL:
                    signal.signal(signum, handler)
        previous = sys.excepthook

        def hook(kind: Any, value: BaseException, tb: Any) -> None:
            if not isinstance(value, KeyboardInterrupt):
                inner = traceback.extract_tb(tb)
                where = next((f"{fs.filename}:{fs.lineno} in {fs.name}" for fs in reversed(inner)
                              if not _is_internal(fs.filename)), None)
                self.dump(f"uncaught {kind.__name__}", stack=[f"{fs.filename}:{fs.lineno} in {fs.name}"
                                                             for fs in inner[-MAX_FRAMES:]],
                          where=where, error=f"{kind.__name__}: {value}"[:MAX_TEXT], failure=True)
            previous(kind, value, tb)
        sys.excepthook = hook

    def _on_usr1(self, signum: int, frame: Any) -> None:
        self.dump("SIGUSR1", frame=frame)

    def _on_term(self, signum: int, frame: Any) -> None:
        self.dump("SIGTERM", frame=frame, failure=True)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    def closing(self, rec: Recorder, final: bool) -> None:
        """Communicator `rec` closes: keep its calls for the ending dump, which is written now if
        `final` (the communicator that owned the transport: the job's communication is over) or
        if no other communicator of this process is open."""
        with self.lock:
            if rec not in self.closed:
                self.closed.append(rec)
            still_open = [r for r in list(self.recorders) if r not in self.closed]
        if self.folder and (final or not still_open):
            self.ended("communicators closed")

    def ended(self, reason: str) -> Optional[str]:
        """The dump at a normal end (at exit, or when the communicators close), unless a failure's
        dump is there or nothing was recorded since the last dump."""
        if self.failed or not self.folder or self.dumped_at == self._activity():
            return None
        return self.dump(f"job ended ({reason})", stack=[])

    def _activity(self) -> Tuple[int, int]:
        """(calls recorded, steps marked): what an ending dump would add to the last one."""
        return sum(r._n + r._p2p for r in list(self.recorders)), _steps

    def dump(self, reason: str, *, frame: Any = None, stack: Optional[List[str]] = None, where: Optional[str] = None,
             error: Optional[str] = None, path: Optional[str] = None, failure: bool = False) -> Optional[str]:
        """Write every communicator's ring to `path` (default PYCOLL_TRACE_DIR/rank<R>.json); return
        the path, or None without a folder. `frame`: where the main thread is (a signal's frame);
        `failure`: the dump of a failure (an error ended a call, an uncaught exception, SIGTERM)."""
        path = path or (os.path.join(self.folder, f"rank{self.rank}.json") if self.folder else None)
        if path is None or self.rank is None:  # no folder, or nothing recorded (PYCOLL_TRACE_BUFFER=0)
            return None
        if frame is None and stack is None:
            frame = sys._getframe(1)
        threads = {t.ident: t.name for t in threading.enumerate()}
        activity = self._activity()
        live = list(self.recorders)
        recs = sorted(set(live) | set(self.closed), key=lambda r: r.last_time(), reverse=True)[:MAX_DUMP_COMMS]
        host = next((h for h in (r.host() for r in sorted(live, key=lambda r: -len(r.group))) if h), None)
        data = {"pycoll_trace": FORMAT, "rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(),
                "host_id": host, "job": job_identity(), "started": self.started,
                "time": _time(), "reason": reason, "error": error,
                "where": where or (_user_frame(frame) if frame is not None else None),
                "stack": stack if stack is not None else _frames(frame),
                "threads": {threads.get(ident, str(ident)): at for ident, at in
                            ((i, _user_frame(f)) for i, f in sys._current_frames().items()) if at},
                "steps": _steps, "marks": [[k, t] for k, t in marks()],
                "comms": [r.describe() for r in recs]}
        tmp = f"{path}.{os.getpid()}.{next(self.dumps)}.tmp"  # unique: a signal may dump inside a dump
        try:
            with self.lock:
                with open(tmp, "w") as out:  # (dumps, not dump: the C encoder, several times faster)
                    out.write(json.dumps(data, separators=(",", ":"), default=str))
                os.replace(tmp, path)
        except OSError as e:  # a full disk must not hide the error that asked for the dump
            print(f"pycoll: rank {self.rank}: cannot write the flight recorder's dump {path}: {e}", file=sys.stderr)
            return None
        self.failed = self.failed or failure
        self.dumped_at = activity
        return path


PROCESS = _Process()


def for_communicator(name: str, comm_id: int, rank: int, group: Sequence[int], topology: Any = None,
                     board: Optional[Tuple[int, int, bool]] = None) -> Optional[Recorder]:
    """The Recorder of a new communicator (`topology`: its pycoll.topology.Topology, for the
    members' hosts; `board`: its board's slot and stage bytes and whether its ranks reach each
    other's memory), or None when PYCOLL_TRACE_BUFFER=0 turns recording off."""
    return PROCESS.recorder(name, comm_id, rank, group, topology, board)


def closing(rec: Recorder, final: bool) -> None:
    """Communicator of `rec` closes (`final`: it owned the transport); see _Process.closing."""
    PROCESS.closing(rec, final)


# where a job's identity comes from when no token is set: launchers' ids every rank of a job shares
JOB_ID_VARIABLES = ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid")


_agreed_job: Optional[str] = None  # set from the token the ranks agreed on at rendezvous (agreed_token)


def _token_identity(token: bytes) -> str:
    return "token-" + hashlib.sha256(b"pycoll-trace-job" + token).hexdigest()[:16]


def agreed_token(token: bytes) -> None:
    """The job token every rank proved at rendezvous (world.connect): the job's identity from now on,
    also where no launcher passed one in the environment (plain torchrun, mpirun)."""
    global _agreed_job
    _agreed_job = _token_identity(token)
    job_identity.cache_clear()


@functools.lru_cache(maxsize=1)
def job_identity() -> Optional[str]:
    """What every rank of one job shares and another job does not, never a secret: a hash of the job
    token (agreed at rendezvous, or PYCOLL_JOB_TOKEN or _FILE as `pycoll run` and the tests give it),
    else a launcher's job id (torchrun --rdzv-id or --standalone, Slurm, Open MPI / PMIx); None when
    none is known."""
    if _agreed_job is not None:
        return _agreed_job
    from ..bootstrap.token import env_token
    try:
        token = env_token()
    except Exception:  # an unreadable token file: the job would not have started; no identity then
        token = None
    if token:
        return _token_identity(token)
    for var in JOB_ID_VARIABLES:
        value = os.environ.get(var)
        if value and value != "none":
            step = os.environ.get("SLURM_STEP_ID", "") if var == "SLURM_JOB_ID" else ""
            return f"{var}={value}" + (f".{step}" if step else "")
    return None


def dump(path: Optional[str] = None, reason: str = "requested") -> Optional[str]:
    """Write this process's flight recorder now (to `path`, or PYCOLL_TRACE_DIR/rank<R>.json); the
    path, or None when there is nowhere to write or recording is off."""
    return PROCESS.dump(reason, frame=sys._getframe(1), path=path)


def read_live(path: str) -> Dict[str, Any]:
    """A live file's contents: {"rank", "pid", "comms": [{"name", "size", "entered", "completed", ...}]}."""
    with open(path, "rb") as f:
        raw = f.read(LIVE_BYTES)
    if len(raw) < LIVE_BYTES or raw[:8] != LIVE_MAGIC:
        raise ValueError(f"{path} is not a pycoll live file")
    _, rank, pid, slots = LIVE_HEADER.unpack_from(raw, 0)
    comms = []
    for s in range(slots):
        offset = LIVE_HEADER.size + s * LIVE_SLOT_BYTES
        cols = dict(zip(LIVE_COLUMNS, struct.unpack_from("<8q", raw, offset)))
        if not cols.pop("used"):
            continue
        cols["name"] = raw[offset + 64:offset + 64 + LIVE_NAME_BYTES].rstrip(b"\0").decode(errors="replace")
        cols["comm_id"] = f"{cols['comm_id'] & ((1 << 64) - 1):#018x}"
        comms.append(cols)
    return {"rank": rank, "pid": pid, "comms": comms}

"""Persistent calls (MPI 4's MPI_Allreduce_init, MPI_Send_init): a call's arguments checked, its
algorithm chosen and its buffers bound once, then run any number of times on the same buffers.

    h = comm.allreduce_init(x, op="sum")   # checks x and the op, picks the algorithm; sends nothing
    for step in range(steps):
        x[:] = ...                         # new contents, same memory
        h()                                # h.start() + h.wait(): x reduced in place, as comm.allreduce(x)
    h.start(); compute(); h.wait()         # overlapped: the run progresses on the communicator's worker

What every start still does, as a plain call does: take the communicator's next call number (handles
and plain calls keep one order on every rank), raise if the communicator is closed (shrink() closes
the one it replaces) or revoked, check that the bound buffers are still what they were (`_watch`: a
buffer resized, retyped or, for a torch tensor, moved to other memory is a ValueError, never a write
into freed memory; the handle holds every buffer, so none is freed under it), record the run in the
flight recorder, and bound every wait by the timeout. What it no longer does: convert and validate
the buffers, resolve the op, ask the selector, build the call's closure and its Channel (one per
handle, renumbered per start).

Matching. Making a handle sends nothing (so the torch backend can make them lazily, rank by rank).
A handle has a mark, 8 bits hashed from its collective, dtype, count, op and root, carried in bits
8-15 of the dtype code of every message and board post of its runs; a plain call's is 0. So a run
whose peer started a handle of another call (or made a plain call: MPI 4 too matches persistent
collectives only with persistent ones) fails with MismatchError naming both, where the two meet on a
message or a board post; runs that never meet (one rank on the board, the other sending messages)
end by the timeout, as mismatched plain calls do, and PYCOLL_DEBUG=DETAIL compares every start's
fingerprint first. Handles made with `marked=False` (the torch backend's) run exactly as plain calls
on the wire, so one rank's handle meets another rank's plain call.
"""
from __future__ import annotations

import sys
import zlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import debug
from .channel import Channel, byte_view
from .errors import ProtocolError, TimeoutError
from .ops import dtype_code
from .transports.base import ANY

PLAN = object()
"""Passed as a collective's `async_op`, it makes the Communicator return the call it checked, as
(collective, body, timeout, fingerprint, algorithm), instead of running it (Communicator._run)."""

MARK_SHIFT = 8  # a mark's place in a dtype code (the codes themselves stay below 1 << MARK_SHIFT)
_MARKS: Dict[int, str] = {}  # mark -> the handle made with it last in this process, described


def mark_of(collective: str, fingerprint: Tuple[Any, ...]) -> int:
    """The mark of a handle of `collective` with `fingerprint` (dtype, count, op, root), already shifted:
    the same on every rank for the same call, 1..255 << MARK_SHIFT."""
    code = debug.encode(collective, *fingerprint[:4])
    return (1 + zlib.crc32(code.tobytes()) % 255) << MARK_SHIFT


def describe(collective: str, fingerprint: Tuple[Any, ...]) -> str:
    """A handle's call in words, e.g. 'allreduce (count 2, float32, op sum)'."""
    return debug.describe(debug.encode(collective, *fingerprint[:4]))


def _theirs(mark: int) -> str:
    """What a peer ran, from the mark in its message or post."""
    if not mark:
        return "a plain call (no persistent handle)"
    known = _MARKS.get(mark)
    return f"a persistent handle of {known}" if known else f"a persistent handle of another call (mark {mark >> MARK_SHIFT})"


def _codes(e: BaseException) -> Optional[Tuple[int, int]]:
    """The dtype codes (theirs, ours) of a ProtocolError or of the one it wraps (a transport's wait
    names the call in a new error of the same type, raised from the request's)."""
    while e is not None:
        codes = getattr(e, "codes", None)
        if codes is not None:
            return codes
        e = e.__cause__  # type: ignore[assignment]
    return None


Check = Callable[[], Optional[str]]


def _watch(name: str, obj: Any, written: bool) -> Optional[Check]:
    """A check that `obj` is still the memory the handle views (None if fine, else what changed);
    None where nothing can move it while the handle holds it. numpy: shape and dtype (numpy refuses to
    resize an array others reference, the handle included, unless told refcheck=False, which changes
    the shape), and writability where results are written; torch: the data address too (set_, and
    resize_ where torch allows it: not once numpy shares the storage, move or free a tensor's memory
    whoever references the tensor). Anything else
    (bytes, bytearray, memoryview, DLPack capsules) is pinned by the view the handle holds: a
    bytearray cannot be resized while exported."""
    if isinstance(obj, np.ndarray):
        shape, dtype = obj.shape, obj.dtype

        def check_array() -> Optional[str]:
            if obj.shape != shape or obj.dtype != dtype:
                return f"{name} is now {obj.shape} {obj.dtype}, it was {shape} {dtype} when the handle was made"
            if written and not obj.flags.writeable:
                return f"{name} became read-only, and the handle writes its results there"
            return None
        return check_array
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        ptr, tshape, tdtype = obj.data_ptr(), obj.shape, obj.dtype

        def check_tensor() -> Optional[str]:
            if obj.data_ptr() != ptr or obj.shape != tshape or obj.dtype != tdtype:
                return (f"{name} is now {tuple(obj.shape)} {obj.dtype} at {obj.data_ptr():#x}, it was "
                        f"{tuple(tshape)} {tdtype} at {ptr:#x} when the handle was made (resized or moved)")
            return None
        return check_tensor
    return None


class _Handle:
    """What collective and point-to-point handles share: the communicator, the buffer checks, the
    state (started or not) and free()."""

    def __init__(self, comm: Any, name: str, watches: Sequence[Check]) -> None:
        self.comm, self.name = comm, name
        self._watches = tuple(watches)
        self._freed = False

    def _ready(self) -> None:
        """Raise unless a run may start: the handle live, its communicator open and not revoked, its
        buffers what they were."""
        comm = self.comm
        if comm._closed or self._freed:
            why = "was freed" if self._freed else (
                f"belongs to {comm.name}, which is closed (close(), or shrink() replaced it)")
            raise RuntimeError(f"rank {comm.rank}: {self.name} {why}; make the handle again on the "
                               "communicator in use")
        for watch in self._watches:
            changed = watch()
            if changed is not None:
                raise ValueError(f"rank {comm.rank}: {self.name}: {changed}; a persistent handle is bound to "
                                 "its buffers' memory: make a new handle for the new buffer")
        comm._check_open(self.name)

    def free(self) -> None:
        """Let go of the buffers (MPI_Request_free); later starts raise. A started run is waited for first."""
        if not self._freed and self.active:  # (active, wait: the subclass's)
            self.wait()  # type: ignore[attr-defined]
        self._freed = True
        self._watches = ()
        self._release()  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return f"<pycoll {self.name}{' (started)' if self.active else ''}>"  # type: ignore[attr-defined]


class Persistent(_Handle):
    """A persistent collective (comm.allreduce_init(...) and friends). h() runs it once and returns
    what the plain call returns; h.start() queues a run on the communicator's worker (in call order
    with the other calls) and h.wait() waits for it. One run at a time: start() before the previous
    start's wait(), or wait() without a start(), raise RuntimeError."""

    def __init__(self, comm: Any, plan: Tuple[str, Callable[[Channel], Any], float, Tuple[Any, ...], Any],
                 watches: Sequence[Check], marked: bool = True) -> None:
        collective, body, timeout, fingerprint, algo = plan
        described = describe(collective, fingerprint)
        super().__init__(comm, f"persistent {described} of {comm.name}", watches)
        self.collective, self._fp, self._algo = collective, fingerprint, algo
        self.mark = mark_of(collective, fingerprint) if marked else 0
        if comm._detail:  # PYCOLL_DEBUG=DETAIL: every run compares its fingerprint first, as plain calls do
            body = debug.checked(collective, fingerprint[:4], body)
        if self.mark:  # (around the DETAIL check too: its exchange carries the mark)
            _MARKS[self.mark] = described
            body = self._matched(body)
        self._body = body
        self._ch = Channel(comm.transport, comm.group, comm.rank, comm.comm_id, 0, timeout, None, comm.board,
                           comm.windows, collective, comm.name, self.mark)
        self._ch.prepared = {}  # its board posts prepared once (Channel.board_exchange)
        self._work: Any = None  # the started run's Work, until waited for
        self.runs = 0  # runs started

    def _matched(self, body: Callable[[Channel], Any]) -> Callable[[Channel], Any]:
        """`body`, its ProtocolError turned into a MismatchError naming both calls where the peer's mark
        differs from this handle's."""
        def run(ch: Channel) -> Any:
            try:
                return body(ch)
            except ProtocolError as e:
                codes = _codes(e)
                if codes is None or (codes[0] ^ codes[1]) >> MARK_SHIFT == 0:
                    raise
                comm = self.comm
                peer = comm.group.index(e.peer) if e.peer in comm.group else e.peer
                raise debug.MismatchError(
                    f"{ch}: rank {comm.rank}: rank {peer} started {_theirs(codes[0] & 0xFF00)} where this rank "
                    f"started a persistent handle of {describe(self.collective, self._fp)}; every rank must start "
                    "its handles, and make its plain calls, in the same order", e.peer) from e
        return run

    @property
    def active(self) -> bool:
        return self._work is not None

    def __call__(self) -> Any:
        """Run it once on this thread (behind queued async calls, if any) and return the result."""
        if self._work is not None:
            raise RuntimeError(f"rank {self.comm.rank}: {self.name} was called while started; wait() first")
        self._ready()
        if self.comm._inflight:  # behind queued work: queue too (as a blocking plain call does)
            return self._queue(None).result()
        return self._now()

    def _now(self) -> Any:
        """The run on this thread (the flight recorder finds the user's frame 3 up: call, this, __call__)."""
        comm, ch, rec = self.comm, self._ch, self.comm._recorder
        ch.seq, ch._after = next(comm._seq), None
        self.runs += 1
        if rec is None:
            return self._body(ch)
        return rec.call(ch.seq, self.collective, self._fp, self._algo, self._body, ch)

    def start(self) -> None:
        """Queue one run on the communicator's worker (in call order) and return at once."""
        if self._work is not None:
            raise RuntimeError(f"rank {self.comm.rank}: {self.name} started twice; wait() for the first start "
                               "before the next")
        self._ready()
        self._work = self._queue(True)

    def _queue(self, entry_for_work: Optional[bool]) -> Any:
        """Number the run under the communicator's lock, record it as queued and hand it to the worker;
        its Work (which stamps the caller's wait in the recorder entry if `entry_for_work`)."""
        comm, ch, rec, body = self.comm, self._ch, self.comm._recorder, self._body
        with comm._seq_lock:
            ch.seq, ch._after = next(comm._seq), None
            comm._inflight += 1
            entry = rec.enter(ch.seq, self.collective, self._fp, self._algo) if rec is not None else None
        self.runs += 1
        if entry is not None:
            body = rec.traced(entry, body)
        seq = ch.seq

        def run() -> Any:  # numbered when it runs: _enqueue may queue several runs of one handle
            ch.seq, ch._after = seq, None
            return body(ch)
        return comm._submit(ch.what, run, entry if entry_for_work else None)

    def _enqueue(self) -> Any:
        """A run queued with no state kept (the torch backend: its Work is waited on by torch; runs of
        one handle still never overlap, the worker runs them in order). Checks as start() does."""
        self._ready()
        return self._queue(True)

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Wait for the started run and return its result (what the plain call returns); raise its
        error. TimeoutError if `timeout` passes first (the run goes on: wait again)."""
        work = self._work
        if work is None:
            raise RuntimeError(f"rank {self.comm.rank}: wait() on {self.name}, which is not started (start() it "
                               "first; each start is waited for once)")
        try:
            if timeout is not None:
                work.wait(timeout)
            result = work.result()
        except BaseException:
            if work.is_completed():
                self._work = None
            raise
        self._work = None
        return result

    def is_completed(self) -> bool:
        """Whether the started run has finished (wait() then returns at once); False if not started."""
        return self._work is not None and self._work.is_completed()

    def _release(self) -> None:
        self._body = self._ch = None  # type: ignore[assignment]


class PersistentP2P(_Handle):
    """A persistent send or receive (comm.send_init / comm.recv_init): start() posts it on the transport
    at once (matched by source and tag in order with plain sends and receives, as MPI's persistent
    point-to-point is), wait() waits for it; h() does both. One post at a time."""

    def __init__(self, comm: Any, checked: Tuple[str, Any, np.ndarray, int, Any, float, str],
                 watches: Sequence[Check]) -> None:
        call, x, arr, peer, key, limit, what = checked
        super().__init__(comm, f"persistent {what}", watches)
        self._sending = call == "send"
        self._call = call
        self._x, self._view, self._code = x, byte_view(arr), dtype_code(arr.dtype)
        self._to = ANY if peer == -1 else comm.group[peer]
        self._key, self._limit, self._what = key, limit, what
        self._fp = (arr.dtype, arr.size, peer, key.tag)
        self._req: Any = None
        self._entry: Optional[list] = None
        self._last: Any = None  # the last completed request (source, for an any-source receive)

    @property
    def active(self) -> bool:
        return self._req is not None

    def start(self) -> None:
        """Post the send or receive (returns at once)."""
        if self._req is not None:
            raise RuntimeError(f"rank {self.comm.rank}: {self.name} started twice; wait() for the first start "
                               "before the next")
        self._ready()
        comm = self.comm
        rec = comm._recorder
        self._entry = None if rec is None else rec.enter_p2p("i" + self._call, self._fp)
        if self._sending:
            self._req = comm.transport.isend(self._view, self._to, self._key, self._code)
        else:
            self._req = comm.transport.irecv(self._view, self._to, self._key, self._code)

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Wait for the posted send or receive; a receive returns its buffer. TimeoutError if `timeout`
        passes first (the post stays: wait again); the communicator's timeout fails it."""
        req = self._req
        if req is None:
            raise RuntimeError(f"rank {self.comm.rank}: wait() on {self.name}, which is not started (start() it "
                               "first; each start is waited for once)")
        comm = self.comm
        if timeout is not None and not req.done and not comm.transport.wait_for([req], timeout):
            raise TimeoutError(f"rank {comm.rank}: {self.name} was not complete after wait(timeout={timeout})",
                               [] if self._to == ANY else [self._to])
        try:
            comm._wait_p2p(req, self._limit, self._what, self._entry)
        finally:
            self._req, self._last = None, req
        return None if self._sending else self._x

    def __call__(self) -> Any:
        """start() and wait()."""
        self.start()
        return self.wait()

    @property
    def source(self) -> Optional[int]:
        """The communicator rank the last completed receive came from (any-source receives)."""
        return None if self._last is None else self.comm._source(self._last)

    def _release(self) -> None:
        self._x = self._view = None


def collective(comm: Any, method: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any],
               timeout: Optional[float], buffers: Sequence[Tuple[str, Any, bool]], marked: bool = True
               ) -> Persistent:
    """A handle of `method(*args, **kwargs)` (a Communicator collective), checked by the method itself:
    `buffers` are the user's (name, object, written) to watch at each start (None objects skipped)."""
    plan = method(*args, async_op=PLAN, timeout=timeout, **kwargs)
    return Persistent(comm, plan, _watches(buffers), marked)


def point_to_point(comm: Any, call: str, x: Any, peer: Any, tag: int, timeout: Optional[float]
                   ) -> PersistentP2P:
    """A persistent `call` ("send" or "recv") of `x` to or from `peer`, checked as comm.send/recv check."""
    checked = comm._check_p2p(call, x, peer, tag, timeout)
    return PersistentP2P(comm, checked, _watches([("x", x, call == "recv")]))


def _watches(buffers: Sequence[Tuple[str, Any, bool]]) -> List[Check]:
    """One check per distinct buffer object (written if any of its roles is)."""
    roles: Dict[int, Tuple[str, Any, bool]] = {}
    for name, obj, written in buffers:
        if obj is not None:
            had = roles.get(id(obj))
            roles[id(obj)] = (name, obj, written) if had is None else (had[0], obj, had[2] or written)
    return [w for w in (_watch(*role) for role in roles.values()) if w is not None]

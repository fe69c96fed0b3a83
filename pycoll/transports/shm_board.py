"""Shared-memory boards: small collectives with no messages at all (Open MPI's coll/sm, NCCL's one-shot).

Every rank's shm segment carries LANES lanes. A communicator whose ranks all share this host takes
one lane on each of its ranks: each claims one of its own (claim_lane), and the communicator layer
exchanges the lane numbers when it creates the communicator (comm.py). A lane holds a counter
and DEPTH slots of SLOT_BYTES: at its b-th board call a rank copies its input into slot b % DEPTH and
publishes b; once every member has published b, each reads every member's slot b % DEPTH. A rank
publishes b + 1 only after it has finished reading call b, so a slot is overwritten (at call
b + DEPTH) only after every member is done with it, even by an algorithm that reads call b's slots
after call b + 1 (two-shot: post, reduce, signal, copy out): no other flag is needed. The first
STAGE_LANES lanes also have DEPTH stage slots of STAGE_BYTES, which a call may post into instead (the
same counter): large allreduces move through them block by block. Each post also carries its byte
count and an opaque 64-bit signature, which the layers above fill with what the post is for (the
dtype, and the algorithm's collective, op and root) and the board only compares: a rank whose
peers posted something else raises ProtocolError, as a mismatched message would over any transport.
Lanes are never handed back (a peer may still read the last call's slot), so a process that creates
more than LANES single-host communicators runs the later ones without a board (and more than
STAGE_LANES without a stage).

A post lands in its slot at the same offset within a 4 KiB page as the posted array (and says where,
beside its byte count): copies between a user buffer and a slot, and between slots, then keep
(dst - src) % 4096 == 0 wherever the ranks' buffers share their offset. memcpy (rep movsb on AMD Zen)
runs 1.6-6x slower when that distance is not a multiple of 32 bytes (8: 6x, 16: 2x, 2064: 1.7x;
benchmarks/shm_offsets.py), and numpy's large arrays start 16 bytes into a page. Each slot therefore
has PAGE spare bytes beyond what it holds.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import ProtocolError
from .request import MsgKey, Request
from .capabilities import Board

LANES = 16
DEPTH = 3
SLOT_BYTES = 16 << 10
STAGE_LANES = 2
STAGE_BYTES = 2 << 20  # fewer, larger blocks: with ranks sharing cores each synchronisation costs switches
BOARD_CTRL = 4096
PAGE = 4096         # a post starts at its data's offset within a page of this size ...
PAGE_FROM = SLOT_BYTES + 1  # ... from this many bytes on: below (every post that fits a slot) it starts at 0,
                    # as the copy is short and reading the address costs 1 us; and a persistent handle's posts
                    # are then prepared once (prepare()): 16 KiB allreduce on 2 ranks, handle 18.0 -> 12.0 us
SLOT_STRIDE = SLOT_BYTES + PAGE
STAGE_STRIDE = STAGE_BYTES + PAGE
STAGE_AT = BOARD_CTRL + LANES * DEPTH * SLOT_STRIDE
BOARD_BYTES = STAGE_AT + STAGE_LANES * DEPTH * STAGE_STRIDE
POST_TAG = -2       # the message tag that board waits are described with (algorithms use tags >= 0)
SPIN_YIELDS = 256   # yields of the CPU spent looking for late posts before the transport's wait ...
SPIN = 1e-3         # ... or this many seconds, if sooner: on a crowded machine one yield can last milliseconds,
                    # and the wait is where revocations and deaths are noticed. (A time alone spins longer than
                    # 256 yields on an idle core: with ranks sharing cores that CPU is taken from late peers;
                    # N=4 on 2 cores, 8 B allreduce 4x slower, measured)
# int64 indices of a lane's control block (two 64-byte lines per lane)
_LINE = 16
# ... and per slot the byte count, signature and offset in the slot of its post: a peer may already be
# a call ahead, so the words of the call being checked must not be those it overwrites
_CLAIMED, _OWNER, _POSTED, _NBYTES, _SIG = 0, 1, 2, 3, 4  # _NBYTES/_SIG + 2 * slot
_AT = 3 + 2 * DEPTH                                       # _AT + slot


def claim_lane(ctrl: memoryview, comm_id: int) -> int:
    """Take the first lane never taken in this rank's own board (`ctrl`: its int64 control view); -1 if none."""
    for lane in range(LANES):
        at = lane * _LINE
        if not ctrl[at + _CLAIMED]:
            ctrl[at + _OWNER] = comm_id & 0x7FFF_FFFF_FFFF_FFFF
            ctrl[at + _POSTED] = 0
            ctrl[at + _CLAIMED] = 1
            return lane
    return -1


def slot(board: memoryview, lane: int, k: int, stage: bool = False) -> memoryview:
    """Slot `k` of `lane` in a board region (bytes, with its PAGE spare bytes): a small one, or with
    `stage` a stage slot."""
    if stage:
        at = STAGE_AT + (DEPTH * lane + k) * STAGE_STRIDE
        return board[at:at + STAGE_STRIDE]
    at = BOARD_CTRL + (DEPTH * lane + k) * SLOT_STRIDE
    return board[at:at + SLOT_STRIDE]


class _Posted(Request):
    """Waits for one member's post of board call `want`: done once its lane counter reaches it."""

    __slots__ = ("_ctrl", "_at", "_want", "_forced")

    def __init__(self, peer: int, key: MsgKey, ctrl: memoryview, lane: int, want: int) -> None:
        super().__init__(peer, key, memoryview(b""), 0, is_recv=True)
        self._ctrl, self._at, self._want, self._forced = ctrl, lane * _LINE + _POSTED, want, False

    @property  # type: ignore[override]
    def done(self) -> bool:
        return self._forced or self._ctrl[self._at] >= self._want

    @done.setter
    def done(self, value: bool) -> None:  # the transport fails a wait by setting done (and error)
        self._forced = value

    def describe(self) -> str:
        return f"board post from rank {self.peer}"


class ShmBoard(Board):
    """One communicator's lane on each of its ranks (global rank numbers), and its call counter."""

    slot_bytes = SLOT_BYTES

    def __init__(self, rank: int, comm_id: int, members: Sequence[int], lanes: Dict[int, int],
                 ctrls: Dict[int, memoryview], boards: Dict[int, memoryview],
                 wake: Callable[[], None],
                 wait: Callable[[Sequence[Request], float, object], None]) -> None:
        self.rank, self.comm_id, self.members = rank, comm_id, list(members)
        self._lanes, self._ctrls = lanes, ctrls
        self._counter = {m: lanes[m] * _LINE + _POSTED for m in members}  # index into ctrls[m]
        # (rank, its control view, its counter's index) of every other member: what a call watches
        self._watch = [(m, ctrls[m], self._counter[m]) for m in self.members if m != rank]
        self._mine = (ctrls[rank], self._counter[rank])  # this rank's control view and its counter's index
        # every member's lane has a stage, or the communicator has none (the same answer on every member)
        self.stage_bytes = STAGE_BYTES if max(lanes.values()) < STAGE_LANES else 0
        kinds = (False, True) if self.stage_bytes else (False,)
        self._bytes = {(k, stage): {m: np.frombuffer(slot(boards[m], lanes[m], k, stage), np.uint8) for m in members}
                       for k in range(DEPTH) for stage in kinds}
        self._typed: Dict[Tuple[Any, ...], List[np.ndarray]] = {}  # typed views of the posts, per layout
        # the last `order` exchange() was given, it as a tuple, and this rank's place in it
        self._order: Sequence[int] = ()
        self._order_key: Tuple[int, ...] = ()
        self._me = -1
        self._wake, self._wait = wake, wait
        self.calls = 0

    def exchange(self, data: np.ndarray, sig: int, order: Sequence[int], timeout: float,
                 what: object, stage: bool = False, hole: Tuple[int, int] = (0, 0)) -> List[np.ndarray]:
        """Post `data` (flat, at most slot_bytes, or stage_bytes into a stage slot) with signature
        `sig`, wait until every member has posted this call, and return the members' arrays in `order`
        (global ranks): writable views into their slots that stay valid until this rank's call
        b + DEPTH - 1 (the list is cached and returned again: read it, do not change it).
        ProtocolError if a member posted another byte count or signature. The elements
        [hole[0], hole[1]) of `data` are not copied into this rank's slot (its owner fills them)."""
        self.calls = b = self.calls + 1
        k, nbytes = b % DEPTH, data.nbytes
        if order is not self._order:
            self._order, self._order_key, self._me = order, tuple(order), list(order).index(self.rank)
        h0, h1 = hole
        small = nbytes < PAGE_FROM
        mine_at = 0 if small else data.ctypes.data % PAGE
        if small:  # every post starts at 0: the views are known before the post, and this rank's is one
            layout = (k, stage, data.dtype, data.size, self._order_key, None)
            views = self._typed.get(layout) or self._views(layout, self._bytes[k, stage], order, None)
        if small and h1 <= h0:
            views[self._me][...] = data  # (np.copyto's dispatch wrapper costs more on a call this small)
        else:
            raw, slot = data.view(np.uint8), self._bytes[k, stage][self.rank][mine_at:mine_at + nbytes]
            if h1 > h0:  # in bytes from here
                h0, h1 = h0 * data.itemsize, h1 * data.itemsize
                slot[:h0] = raw[:h0]
                slot[h1:] = raw[h1:]
            else:
                slot[:] = raw
        words = 2 * k - _POSTED  # from a lane's counter to this slot's byte count and signature
        where = _AT + k - _POSTED  # ... and to its offset in the slot
        mine, i = self._mine
        mine[i + _NBYTES + words], mine[i + _SIG + words], mine[i + where] = nbytes, sig, mine_at
        # slot, count, signature and offset, then the counter: a peer that sees b sees them, and this
        # rank's reads of earlier calls' slots are done (x86-TSO: stores stay in order, loads before
        # later stores)
        mine[i] = b
        self._wake()  # the other members that sleep on their doorbells
        for w in self._watch:  # counters before slots: load order (x86-TSO)
            if w[1][w[2]] < b:
                self._await(b, timeout, what)
                break
        # every counter was seen at b before these loads (ARM/POWER: acquire loads)
        for p, ctrl, i in self._watch:
            i += words
            if ctrl[i + _NBYTES] != nbytes or ctrl[i + _SIG] != sig:
                self._mismatch(p, ctrl[i + _NBYTES], ctrl[i + _SIG], nbytes, sig, what)
        if small:  # (the same byte count on every member, checked above)
            return views
        ctrls, at = self._ctrls, self._counter
        offsets = tuple([ctrls[m][at[m] + where] for m in order])
        layout = (k, stage, data.dtype, data.size, self._order_key, offsets)
        return self._typed.get(layout) or self._views(layout, self._bytes[k, stage], order, offsets)

    def prepare(self, data: np.ndarray, sig: int, order: Sequence[int], stage: bool = False,
                hole: Tuple[int, int] = (0, 0)) -> Optional[Callable[[float, object], List[np.ndarray]]]:
        """exchange(data, sig, order, timeout, what, stage, hole) made ready to be called again and
        again on this same `data` (a persistent handle's): `go(timeout, what)` does what exchange does,
        with each slot's views, this rank's slot and the words it writes worked out here, once. None
        where posts do not start at a slot's offset 0 (PAGE_FROM bytes and more: exchange() then)."""
        nbytes = data.nbytes
        if nbytes >= PAGE_FROM or nbytes > (self.stage_bytes if stage else self.slot_bytes):
            return None
        order_key = tuple(order)
        me = order_key.index(self.rank)
        ready = []  # per slot k: (the members' views, this rank's, its count/signature and offset words)
        for k in range(DEPTH):
            layout = (k, stage, data.dtype, data.size, order_key, None)
            views = self._typed.get(layout) or self._views(layout, self._bytes[k, stage], order, None)
            ready.append((views, views[me], 2 * k - _POSTED, _AT + k - _POSTED))
        h0, h1 = hole
        mine, i = self._mine
        watch, wake = self._watch, self._wake

        def go(timeout: float, what: object) -> List[np.ndarray]:
            self.calls = b = self.calls + 1
            views, own, words, where = ready[b % DEPTH]
            if h1 > h0:
                own[:h0] = data[:h0]
                own[h1:] = data[h1:]
            else:
                own[...] = data
            mine[i + _NBYTES + words], mine[i + _SIG + words], mine[i + where] = nbytes, sig, 0
            mine[i] = b  # (after the slot and its words, as exchange() publishes)
            wake()
            for w in watch:
                if w[1][w[2]] < b:
                    self._await(b, timeout, what)
                    break
            for p, ctrl, j in watch:
                j += words
                if ctrl[j + _NBYTES] != nbytes or ctrl[j + _SIG] != sig:
                    self._mismatch(p, ctrl[j + _NBYTES], ctrl[j + _SIG], nbytes, sig, what)
            return views
        return go

    def _await(self, b: int, timeout: float, what: object) -> None:
        """Wait until every member has posted board call `b`: a yield-spin (most posts come within a
        few time slices), then the transport's wait, which sleeps on the doorbell and watches deaths,
        revocations and the deadline."""
        late = [w for w in self._watch if w[1][w[2]] < b]
        spin_until, spins = time.monotonic() + SPIN, SPIN_YIELDS
        while late and spins and time.monotonic() < spin_until:
            os.sched_yield()
            spins -= 1
            while late and late[-1][1][late[-1][2]] >= b:
                late.pop()
        if late:
            key = MsgKey(self.comm_id, b, POST_TAG)
            self._wait([_Posted(p, key, ctrl, self._lanes[p], b) for p, ctrl, _ in late], timeout, what)

    def _mismatch(self, peer: int, their_nbytes: int, their_sig: int, nbytes: int, sig: int, what: object) -> None:
        """Raise the ProtocolError of a member that posted another byte count or signature."""
        raise ProtocolError(
            f"{what}: rank {self.rank}: rank {peer}'s board post carries {their_nbytes} bytes with signature "
            f"{their_sig:#x}, but this rank posted {nbytes} bytes with signature {sig:#x}; did the "
            "ranks call different collectives, or the same one with different sizes, counts, dtypes, "
            "ops or roots?", peer, codes=(int(their_sig) & 0xFFFF, sig & 0xFFFF))

    def _views(self, layout: Tuple[Any, ...], slots: Dict[int, np.ndarray], order: Sequence[int],
               offsets: Any) -> List[np.ndarray]:
        """The members' posts as typed arrays, in `order`, for one `layout` (slot, stage, dtype, size,
        order, offsets: None where every post starts at 0), made once per layout (the callers look in
        the cache first)."""
        _, _, dtype, size, _, _ = layout
        if len(self._typed) > 1024:
            self._typed.clear()
        views = self._typed[layout] = [_typed_from(slots[m], off, dtype)[:size] for m, off in
                                       zip(order, offsets or [0] * len(order))]
        return views


def _typed_from(slot_bytes: np.ndarray, offset: int, dtype: np.dtype) -> np.ndarray:
    """A slot's bytes from `offset` on, as whole elements of `dtype`."""
    whole = slot_bytes[offset:]
    return whole[:whole.size - whole.size % dtype.itemsize].view(dtype)

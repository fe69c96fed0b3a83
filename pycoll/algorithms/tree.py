"""Binomial broadcast/reduce (ceil(log2 n) steps, (n-1)*S bytes; allreduce = both), chain broadcast
(n-2+S/seg steps, (n-1)*S) and NCCL's double binary tree allreduce (~2*log2(n)+S/seg steps, 2(n-1)*S)."""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np

from ..channel import Channel
from ..ops import ReduceOp, reduce_into
from ..transports.base import Request

SEGMENT_BYTES = 1 << 20  # pipeline unit of broadcast_chain and allreduce_double_tree

Tree = Tuple[Optional[int], List[int]]  # this rank's (parent or None at the root, children), comm ranks


def _segments(count: int, itemsize: int) -> List[Tuple[int, int]]:
    """[start, end) ranges of at most SEGMENT_BYTES covering `count` elements."""
    step = max(1, SEGMENT_BYTES // itemsize)
    return [(a, min(a + step, count)) for a in range(0, count, step)]


def _vrank(ch: Channel, root: int) -> int:
    """This rank's position when ranks are rotated so that `root` is virtual rank 0."""
    return (ch.rank - root) % ch.size


def _binomial(ch: Channel, root: int) -> Tree:
    """Binomial tree rooted at `root` on virtual ranks: v's parent clears its lowest set bit, its
    children are v + 2^k below that bit; children come smallest subtree first."""
    n, v = ch.size, _vrank(ch, root)
    low = v & -v if v else 1 << (n - 1).bit_length()
    parent = None if v == 0 else ((v & (v - 1)) + root) % n
    children, mask = [], 1
    while mask < low and v + mask < n:
        children.append((v + mask + root) % n)
        mask <<= 1
    return parent, children


def _btree_parent(r: int, n: int) -> Optional[int]:
    """Parent of r in NCCL's in-order binary tree over 0..n-1 (ncclGetBtree): root 0, whose single
    child is the largest power of two below n; r's lowest set bit is its height."""
    if r == 0:
        return None
    bit = r & -r
    up = (r ^ bit) | (bit << 1)
    return up if up < n else r ^ bit


def btree(r: int, n: int) -> Tree:
    """r's parent and (at most two) children in NCCL's binary tree; children are r +- 2^k."""
    near = {r + sign * (1 << k) for k in range(n.bit_length()) for sign in (-1, 1)}
    return _btree_parent(r, n), sorted(c for c in near if 0 < c < n and _btree_parent(c, n) == r)


def _double_tree(ch: Channel) -> Tuple[Tree, Tree]:
    """NCCL's double binary tree (ncclGetDtree): tree 1 is the binary tree; tree 2 mirrors it
    (r -> n-1-r) when n is even or shifts it by one rank when n is odd, so that the ranks interior
    in one tree are (mostly) leaves in the other."""
    n, r = ch.size, ch.rank
    if n % 2 == 0:
        to = back = lambda x: n - 1 - x
    else:
        to, back = (lambda x: (x - 1) % n), (lambda x: (x + 1) % n)
    parent, children = btree(to(r), n)
    return btree(r, n), (None if parent is None else back(parent), sorted(back(c) for c in children))


def _bcast(ch: Channel, buf: np.ndarray, tree: Tree, tag: int) -> None:
    """Receive `buf` from the parent (unless root), then send it to every child, largest subtree first."""
    parent, children = tree
    if parent is not None:
        ch.wait(ch.irecv(buf, parent, tag))
    ch.wait(*[ch.isend(buf, c, tag) for c in reversed(children)])


def _reduce(ch: Channel, acc: np.ndarray, op: ReduceOp, tree: Tree, tag: int) -> None:
    """acc = op(acc, children's subtree results) in a fixed order, then send acc to the parent."""
    parent, children = tree
    with ch.scratch((len(children), acc.size), acc.dtype) as rows:
        reqs = [ch.irecv(row, c, tag) for row, c in zip(rows, children)]
        for req, row in zip(reqs, rows):
            ch.wait(req)
            reduce_into(op, acc, row)
    if parent is not None:
        ch.wait(ch.isend(acc, parent, tag))


def broadcast(ch: Channel, buf: np.ndarray, root: int) -> None:
    """Binomial tree broadcast of `buf` from `root`, in place."""
    if buf.size:
        _bcast(ch, buf, _binomial(ch, root), tag=0)


def broadcast_chain(ch: Channel, buf: np.ndarray, root: int) -> None:
    """Pipelined chain root -> root+1 -> ...: each rank forwards segment i while segment i+1 arrives."""
    n, r = ch.size, ch.rank
    if n == 1 or not buf.size:
        return
    v = _vrank(ch, root)
    segs = [buf[a:b] for a, b in _segments(buf.size, buf.itemsize)]
    recvs = [ch.irecv(seg, (r - 1) % n, tag=i) for i, seg in enumerate(segs)] if v else []
    sends: List[Request] = []
    for i, seg in enumerate(segs):
        if recvs:
            ch.wait(recvs[i])
        if v < n - 1:
            sends.append(ch.isend(seg, (r + 1) % n, tag=i))
    ch.wait(*sends)


def reduce(ch: Channel, buf: np.ndarray, op: ReduceOp, root: int) -> None:
    """Binomial tree reduce into `buf` at `root`; other ranks' `buf` is left unchanged."""
    if not buf.size:
        return
    tree = _binomial(ch, root)
    parent, children = tree
    if parent is None or not children:
        _reduce(ch, buf, op, tree, tag=0)
        return
    with ch.scratch(buf.shape, buf.dtype) as acc:  # an inner rank's partial sum: its own buf stays as it was
        np.copyto(acc, buf)
        _reduce(ch, acc, op, tree, tag=0)


def allreduce(ch: Channel, buf: np.ndarray, op: ReduceOp) -> None:
    """Binomial reduce to rank 0, then binomial broadcast of rank 0's result, in place."""
    if not buf.size:
        return
    tree = _binomial(ch, 0)
    _reduce(ch, buf, op, tree, tag=0)
    _bcast(ch, buf, tree, tag=1)


class _Lane:
    """One tree of the double tree working on its part of the buffer, segment by segment:
    up(k) reduces segment k from the children and sends it to the parent (the root starts its
    broadcast instead), down(k) receives the final segment k from the parent and forwards it."""

    def __init__(self, ch: Channel, part: np.ndarray, op: ReduceOp, tree: Tree, lane: int,
                 scratch: np.ndarray) -> None:
        """`scratch`: an array of scratch_shape(part, tree), the lane's double-buffered receives."""
        self.ch, self.part, self.op, self.lane = ch, part, op, lane
        self.parent, self.children = tree
        self.segs = _segments(part.size, part.itemsize)
        self.scratch = scratch
        self.incoming: Dict[int, List[Request]] = {}
        self.up_sends: Dict[int, Request] = {}
        self.down_sends: List[Request] = []
        self._post(0)

    @staticmethod
    def scratch_shape(part: np.ndarray, tree: Tree) -> Tuple[int, int, int]:
        """Two segments' receives from each child of `tree`."""
        return 2, len(tree[1]), min(part.size, max(1, SEGMENT_BYTES // part.itemsize))

    def _tag(self, k: int, down: int) -> int:
        return (k * 2 + self.lane) * 2 + down

    def _slot(self, k: int, i: int) -> np.ndarray:
        a, b = self.segs[k]
        return self.scratch[k % 2, i, : b - a]

    def _post(self, k: int) -> None:
        """Post the receives of the children's contributions to segment k."""
        if k < len(self.segs):
            self.incoming[k] = [self.ch.irecv(self._slot(k, i), c, self._tag(k, 0))
                                for i, c in enumerate(self.children)]

    def _send_down(self, k: int) -> None:
        a, b = self.segs[k]
        self.down_sends += [self.ch.isend(self.part[a:b], c, self._tag(k, 1)) for c in self.children]

    def up(self, k: int) -> None:
        if k >= len(self.segs):
            return
        self._post(k + 1)
        a, b = self.segs[k]
        acc = self.part[a:b]
        for i, req in enumerate(self.incoming.pop(k)):
            self.ch.wait(req)
            reduce_into(self.op, acc, self._slot(k, i))
        if self.parent is None:
            self._send_down(k)
        else:
            self.up_sends[k] = self.ch.isend(acc, self.parent, self._tag(k, 0))

    def down(self, k: int) -> None:
        if self.parent is None or not 0 <= k < len(self.segs):
            return
        a, b = self.segs[k]
        self.ch.wait(self.up_sends.pop(k))  # the segment's buffer is about to be overwritten
        self.ch.wait(self.ch.irecv(self.part[a:b], self.parent, self._tag(k, 1)))
        self._send_down(k)


def allreduce_double_tree(ch: Channel, buf: np.ndarray, op: ReduceOp) -> None:
    """NCCL-style double binary tree allreduce, in place: tree 1 reduces and broadcasts the first
    half, tree 2 the second, both pipelined in segments so every link carries traffic both ways."""
    n = ch.size
    if n == 1 or not buf.size:
        return
    half = (buf.size + 1) // 2
    trees = _double_tree(ch)
    parts = buf[:half], buf[half:]
    with ch.scratch(_Lane.scratch_shape(parts[0], trees[0]), buf.dtype) as first, \
            ch.scratch(_Lane.scratch_shape(parts[1], trees[1]), buf.dtype) as second:
        lanes = [_Lane(ch, parts[0], op, trees[0], 0, first), _Lane(ch, parts[1], op, trees[1], 1, second)]
        # All ranks run the same step order and every wait is for a message its peer posts at the same
        # or an earlier step, so there is no deadlock; broadcasts trail reductions by `lag` segments
        # (about twice the tree depth) so that a segment's final value has usually arrived when needed.
        lag = 2 * n.bit_length()
        for k in range(len(lanes[0].segs) + lag):
            for lane in lanes:
                lane.up(k)
            for lane in lanes:
                lane.down(k - lag)
        ch.wait(*lanes[0].down_sends, *lanes[1].down_sends)

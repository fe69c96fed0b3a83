"""Topology-aware algorithms: rings in host order, and hierarchical allreduce/broadcast/allgather.

`ring` (host-ordered): the ring algorithms on the ranks grouped by host, as NCCL orders its rings,
so the ring leaves each host once and one stream per host crosses the network; `flat_ring` is
ring.allreduce in plain rank order, for comparison. With every host's ranks consecutive (or one
host) the order is the rank order and nothing is permuted.

`hierarchical`, when every host has the same number L of ranks (Horovod's hierarchical allreduce):
  allreduce: ring reduce-scatter within the host into L shards; local rank j of every host
             allreduces shard j across hosts, the L shards in parallel; ring allgather within the host.
  broadcast: the root scatters L shards within its host; local rank j of every host broadcasts
             shard j across hosts; ring allgather within each host.
  allgather: local rank j of every host allgathers the blocks of the local ranks j across hosts;
             ring allgather of those bundles within the host; blocks put into rank order.
Each host's NIC then carries 2(H-1)/H * S (allreduce) bytes, the link-rate bound, in L streams.
With uneven ranks per host it falls back to one leader per host (the root on its host for
broadcast): reduce (or gather) to the leader, leaders only across hosts, broadcast within the host.

Phases run on sub-channels with their own communicator ids, so their messages never meet; the
inter-host phases use whatever the tuner picks for their size (`selector.phase`). Every rank
computes the same layout from the same Topology, so they all agree on the plan.
"""
from __future__ import annotations

import contextlib
from typing import Callable, List, Optional, Protocol, Sequence, Tuple

import numpy as np

from ..channel import Channel
from ..ids import derived_id
from ..ops import ReduceOp
from ..topology import Topology
from . import linear, ring, tree
from .ring import chunk_edges, displacements


class PhasePicker(Protocol):
    """What the hierarchical algorithms need from the selection layer (its Selector passes itself in)."""

    def phase(self, collective: str, nbytes: int, topo: Topology, streams: int) -> Callable:
        """A flat algorithm for one phase, with `streams` copies of it sharing each NIC."""


def sub_channel(ch: Channel, members: Sequence[int], label: str) -> Channel:
    """A Channel over the comm ranks `members` (this rank must be one), on its own communicator id."""
    return ch.derive(group=[ch.group[m] for m in members], rank=list(members).index(ch.rank),
                     comm_id=derived_id(ch.comm_id, label), what=f"{ch.what} [{label}]")


def host_ordered(ch: Channel, topo: Topology) -> Tuple[Channel, List[int]]:
    """`ch` with its ranks renumbered in topo.ring_order() (same messages keys), and that order."""
    order = topo.ring_order()
    if order == list(range(ch.size)):
        return ch, order
    return ch.derive(group=[ch.group[o] for o in order], rank=order.index(ch.rank)), order


def move_blocks(src: np.ndarray, src_edges: Sequence[int], dst: np.ndarray, dst_edges: Sequence[int],
                moves: Sequence[Tuple[int, int]]) -> None:
    """Copy block a of `src` to block b of `dst` for every (a, b) in `moves`."""
    for a, b in moves:
        dst[dst_edges[b]:dst_edges[b + 1]] = src[src_edges[a]:src_edges[a + 1]]


# -- rings in host order -----------------------------------------------------------------------------
def ring_allreduce(ch: Channel, buf: np.ndarray, op: ReduceOp, src: Optional[np.ndarray] = None, *,
                   topo: Topology, selector: PhasePicker) -> None:
    """ring.allreduce on the host-ordered ring (block order does not matter to an allreduce)."""
    ring.allreduce(host_ordered(ch, topo)[0], buf, op, src)


ring_allreduce.accepts_src = True  # type: ignore[attr-defined]


def ring_reduce_scatter(ch: Channel, send: np.ndarray, recv: np.ndarray, op: ReduceOp,
                        counts: Optional[Sequence[int]] = None, *, topo: Topology, selector: PhasePicker) -> None:
    """ring.reduce_scatter on the host-ordered ring; the input's blocks are put in ring order first."""
    pch, order = host_ordered(ch, topo)
    if pch is ch:
        ring.reduce_scatter(ch, send, recv, op, counts)
        return
    counts_l = [recv.size] * ch.size if counts is None else list(counts)
    ring_counts = [counts_l[o] for o in order]
    with ch.scratch(send.size, send.dtype) as staged:
        move_blocks(send, displacements(counts_l), staged, displacements(ring_counts),
                    [(o, i) for i, o in enumerate(order)])
        ring.reduce_scatter(pch, staged, recv, op, ring_counts)


def ring_allgather(ch: Channel, send: np.ndarray, recv: np.ndarray, counts: Optional[Sequence[int]] = None,
                   *, topo: Topology, selector: PhasePicker) -> None:
    """ring.allgather on the host-ordered ring; the blocks are put back in rank order after."""
    pch, order = host_ordered(ch, topo)
    if pch is ch:
        ring.allgather(ch, send, recv, counts)
        return
    counts_l = [send.size] * ch.size if counts is None else list(counts)
    ring_counts = [counts_l[o] for o in order]
    with ch.scratch(recv.size, recv.dtype) as staged:
        ring.allgather(pch, send, staged, ring_counts)
        move_blocks(staged, displacements(ring_counts), recv, displacements(counts_l), list(enumerate(order)))


def ring_broadcast(ch: Channel, buf: np.ndarray, root: int, *, topo: Topology, selector: PhasePicker) -> None:
    """Pipelined chain broadcast along the host-ordered ring, starting at the root."""
    pch, order = host_ordered(ch, topo)
    tree.broadcast_chain(pch, buf, order.index(root))


# -- hierarchical ------------------------------------------------------------------------------------
class _Place:
    """This rank's host, its host's ranks and its index there."""

    def __init__(self, ch: Channel, topo: Topology) -> None:
        if topo.size != ch.size:
            raise ValueError(f"{ch.what}: topology of {topo.size} ranks for a channel of {ch.size}")
        self.topo = topo
        self.host = topo.host_of[ch.rank]
        self.local = topo.members[self.host]
        self.j = self.local.index(ch.rank)
        self.L, self.H = len(self.local), topo.nhosts

    def peers(self) -> List[int]:
        """The ranks with this rank's local index on every host (uniform layouts only)."""
        return [m[self.j] for m in self.topo.members]


def _leaders(topo: Topology, root_host: int = -1, root: int = -1) -> List[int]:
    """One rank per host: the first, or `root` on its own host."""
    return [root if h == root_host else m[0] for h, m in enumerate(topo.members)]


def _shard(buf: np.ndarray, p: "_Place") -> Tuple[List[int], np.ndarray]:
    """The element counts of the L shards of `buf` (one per local rank), and this rank's shard."""
    edges = chunk_edges(buf.size, p.L)
    return [b - a for a, b in zip(edges, edges[1:])], buf[edges[p.j]:edges[p.j + 1]]


def _across_hosts(collective: str, ch: Channel, p: "_Place", shard: np.ndarray, *args: object,
                  topo: Topology, selector: PhasePicker) -> None:
    """Run `collective` on this rank's shard with its peers on the other hosts (the same local index),
    the L local ranks' copies in parallel sharing each NIC."""
    if p.H > 1 and shard.size:
        cross = p.peers()
        selector.phase(collective, shard.nbytes, topo.subset(cross), p.L)(
            sub_channel(ch, cross, "hier/cross"), shard, *args)


def allreduce(ch: Channel, buf: np.ndarray, op: ReduceOp, *, topo: Topology, selector: PhasePicker) -> None:
    """Hierarchical allreduce, in place (see the module docstring)."""
    if ch.size == 1 or buf.size == 0:
        return
    p = _Place(ch, topo)
    if not topo.uniform:
        lead = _leaders(topo)
        if p.L > 1:
            tree.reduce(sub_channel(ch, p.local, "hier/reduce"), buf, op, 0)
        if p.j == 0:
            selector.phase("allreduce", buf.nbytes, topo.subset(lead), 1)(
                sub_channel(ch, lead, "hier/cross"), buf, op)
        if p.L > 1:
            tree.broadcast(sub_channel(ch, p.local, "hier/bcast"), buf, 0)
        return
    counts, shard = _shard(buf, p)
    if p.L == 1:
        _across_hosts("allreduce", ch, p, shard, op, topo=topo, selector=selector)
        return
    with ch.scratch(counts[p.j], buf.dtype) as shard:
        ring.reduce_scatter(sub_channel(ch, p.local, "hier/rs"), buf, shard, op, counts)
        _across_hosts("allreduce", ch, p, shard, op, topo=topo, selector=selector)
        ring.allgather(sub_channel(ch, p.local, "hier/ag"), shard, buf, counts)


def broadcast(ch: Channel, buf: np.ndarray, root: int, *, topo: Topology, selector: PhasePicker) -> None:
    """Hierarchical broadcast of root's `buf`, in place (see the module docstring)."""
    if ch.size == 1 or buf.size == 0:
        return
    p = _Place(ch, topo)
    root_host = topo.host_of[root]
    if not topo.uniform:
        lead = _leaders(topo, root_host, root)
        if ch.rank in lead:
            selector.phase("broadcast", buf.nbytes, topo.subset(lead), 1)(
                sub_channel(ch, lead, "hier/cross"), buf, root_host)
        if p.L > 1:
            tree.broadcast(sub_channel(ch, p.local, "hier/bcast"), buf, p.local.index(lead[p.host]))
        return
    counts, shard = _shard(buf, p)
    if p.host == root_host and p.L > 1:
        linear.scatter(sub_channel(ch, p.local, "hier/scatter"), buf, shard, topo.local_index(root), counts)
    _across_hosts("broadcast", ch, p, shard, root_host, topo=topo, selector=selector)
    if p.L > 1:
        ring.allgather(sub_channel(ch, p.local, "hier/ag"), shard, buf, counts)


def allgather(ch: Channel, send: np.ndarray, recv: np.ndarray, counts: Optional[Sequence[int]] = None, *,
              topo: Topology, selector: PhasePicker) -> None:
    """Hierarchical allgather(v): block i of `recv` (counts[i] elements) comes from rank i."""
    n = ch.size
    counts_l = [send.size] * n if counts is None else list(counts)
    if n == 1 or sum(counts_l) == 0:
        np.copyto(recv[:send.size], send)
        return
    p = _Place(ch, topo)
    with contextlib.ExitStack() as held:  # the staging buffers, scratch until the blocks are in place

        def scratch(count: int) -> np.ndarray:
            return held.enter_context(ch.scratch(count, send.dtype))

        def across(members: List[int], mine: np.ndarray, sizes: List[int], streams: int) -> np.ndarray:
            """The pieces of `members` (one rank per host), gathered across hosts in host order."""
            out = scratch(sum(sizes))
            if len(members) == 1:
                np.copyto(out, mine)
            elif out.size:
                selector.phase("allgather", out.nbytes, topo.subset(members), streams)(
                    sub_channel(ch, members, "hier/cross"), mine, out, sizes)
            return out

        if topo.uniform:  # across hosts first: bundle k holds the blocks of local rank k of every host
            order = [m[k] for k in range(p.L) for m in topo.members]
            cross = p.peers()
            staged = across(cross, send, [counts_l[c] for c in cross], p.L)
            if p.L > 1:
                sizes = [sum(counts_l[m[k]] for m in topo.members) for k in range(p.L)]
                bundle, staged = staged, scratch(sum(sizes))
                ring.allgather(sub_channel(ch, p.local, "hier/ag"), bundle, staged, sizes)
        else:  # leaders: gather on the host, allgather host bundles across hosts, broadcast on the host
            order = topo.ring_order()
            lead = _leaders(topo)
            bundle: Optional[np.ndarray] = send
            if p.L > 1:
                local_counts = [counts_l[r] for r in p.local]
                bundle = scratch(sum(local_counts)) if p.j == 0 else None
                linear.gather(sub_channel(ch, p.local, "hier/gather"), send, bundle, 0, local_counts)
            if bundle is not None:
                staged = across(lead, bundle, [sum(counts_l[r] for r in m) for m in topo.members], 1)
            else:
                staged = scratch(sum(counts_l))
            if p.L > 1:
                tree.broadcast(sub_channel(ch, p.local, "hier/bcast"), staged, 0)
        move_blocks(staged, displacements([counts_l[o] for o in order]), recv, displacements(counts_l),
                    list(enumerate(order)))

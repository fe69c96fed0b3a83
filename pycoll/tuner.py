"""The tuner: an alpha-beta cost model per (collective, algorithm, link class), NCCL tuning.cc style,
fed by the calibration at init (pycoll.calibration); the Selector asks it for the cheapest algorithm per call.

Each algorithm is described by its communication pattern on the communicator's topology: a list of
rounds, each with a count of back-to-back messages and the (src, dst, bytes) transfers it makes.

    round time = messages * alpha(link) + max(NIC time, uplink time, flow time, shm time * crowd)
                 + reduced bytes * gamma * crowd
    NIC time   = max over hosts of max(bytes out, bytes in) across hosts * beta(net) * streams
                 (bytes to hosts reached over verbs at beta(rdma), the rest at beta(net))
    uplink time = max over racks of max(bytes out, bytes in) across racks * beta(its uplink) * streams
    flow time  = max over pairs across hosts of their bytes * beta(flow) / nsocks
    shm time   = max over ranks of max(bytes out, bytes in) within a host * beta(shm)
    crowd      = max over hosts of (ranks busy in the round / the host's cores), at least 1

Where the ranks of a host touch more data in a call than stays in its last-level cache, their copies
and reductions run at memory speed: shm beta and gamma are priced up by Params.spill_factor.

Copies and reductions are CPU work, so ranks that share a core do them in turn: 4 ranks on 2 cores
pay twice the bytes of a round where all of them move data (measured over tcp at 1 MiB: recursive
doubling 5.8 ms, halving-doubling, which moves and reduces fewer bytes in more rounds, 3.7 ms).

Networks that cap each TCP flow below the link (cloud NICs) are the flow term: beta(flow) is what
one stream between two hosts gets, beta(net) what the link gets, and a pair's transfer is cut over
nsocks streams (PYCOLL_NSOCKS; pick_streams chooses it from the two, calibration.py measures them).
A round uses the net alpha when any of its transfers crosses hosts; `streams` is how many copies of
the pattern share each NIC (the parallel inter-host phase of the hierarchical algorithms). So a ring
in plain rank order over interleaved hosts pays for every rank's stream on the NIC, a host-ordered
ring for one, and the hierarchical allreduce for 2(H-1)/H * S bytes per host.

Pairs of hosts that the transport reaches over verbs (auto, where their RDMA ports share a network:
Params.rdma_hosts) are a link class of their own, `rdma`: its alpha where a round's transfers across
hosts all go over verbs, its beta for their bytes, and no flow cap (a queue pair is not a TCP flow).

The model's parameters (Params) come from pycoll.calibration: defaults, PYCOLL_TOPO_FILE, a cache
or a probe at init.

Racks (PYCOLL_TOPO_FILE "racks", Topology.uplinks) share one uplink among their hosts: an
oversubscribed uplink carries every flow that leaves (or enters) the rack, so a ring that crosses
it twice per direction (racks interleaved in host order) takes twice as long on it as the
rack-ordered ring (Topology.ring_order), which crosses it once.
"""
from __future__ import annotations

import logging
import math
import sys
from collections import Counter
from dataclasses import dataclass, replace
from typing import AbstractSet, Callable, Dict, FrozenSet, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from . import config
from .algorithms.recursive_doubling import Fold
from .algorithms.ring import segment_bytes, segments_per_block
from .algorithms.tree import SEGMENT_BYTES as TREE_SEGMENT, btree
from .topology import SHM, Topology, Uplinks

RDMA = "rdma"  # the link class of host pairs the transport reaches over verbs

log = logging.getLogger("pycoll.tuner")
_log_ready = False  # the PYCOLL_DEBUG=INFO handler is attached


@dataclass(frozen=True)
class Link:
    """One link class: alpha seconds per message, beta seconds per byte."""

    alpha: float
    beta: float

    def describe(self) -> str:
        """'12.0 us + 10 Gbit/s'."""
        return f"{self.alpha * 1e6:.1f} us + {8e-9 / self.beta:.3g} Gbit/s"


@dataclass(frozen=True)
class Params:
    """The model's inputs: shm and net links, gamma (seconds per reduced byte), where they came from;
    `flow`: one TCP stream between hosts where that is slower than the link (None: as fast), and
    `nsocks`: the streams a pair's payload is cut over; `cache`: a host's last-level cache in bytes
    (0: unknown), and `spill`: how many times slower a copy runs whose data fill twice that (1: no
    measurement), for calls whose working set outgrows the cache (spill_factor); `rdma`: the link
    between the hosts of `rdma_hosts` (pairs of host ids, sorted), which the transport reaches over
    verbs (None, or no pairs: every pair of hosts is priced as net)."""

    shm: Link
    net: Link
    gamma: float
    source: str = "default"
    flow: Optional[Link] = None
    nsocks: int = 1
    cache: float = 0.0
    spill: float = 1.0
    rdma: Optional[Link] = None
    rdma_hosts: FrozenSet[Tuple[str, str]] = frozenset()

    def link(self, cls: str) -> Link:
        """The Link of class `cls` (shm, net or rdma)."""
        return self.shm if cls == SHM else self.rdma or self.net if cls == RDMA else self.net

    def rdma_pairs(self, topo: Topology) -> FrozenSet[Tuple[int, int]]:
        """The (host index, host index) pairs of `topo`, both ways, priced as rdma."""
        if self.rdma is None or not self.rdma_hosts:
            return frozenset()
        ids = topo.hosts
        return frozenset((i, j) for i in range(len(ids)) for j in range(len(ids))
                         if i != j and tuple(sorted((ids[i], ids[j]))) in self.rdma_hosts)

    def flow_link(self) -> Link:
        """One stream between hosts (the net link where no slower flow was measured)."""
        return self.flow or self.net

    def row(self) -> np.ndarray:
        """alpha/beta of shm and net, gamma, alpha/beta of one flow, cache and spill: what the
        calibration allgathers."""
        flow = self.flow_link()
        return np.array([self.shm.alpha, self.shm.beta, self.net.alpha, self.net.beta, self.gamma,
                         flow.alpha, flow.beta, self.cache, self.spill])

    @classmethod
    def from_row(cls, row: Sequence[float], source: str, nsocks: int = 1) -> "Params":
        """The inverse of row() (a row of 7, from before the cache and spill, has neither)."""
        a, b, c, d, e, f, g, cache, spill = (float(v) for v in list(row) + [0.0, 1.0][len(row) - 7:])
        return cls(Link(a, b), Link(c, d), e, source, None if (f, g) == (c, d) else Link(f, g), nsocks,
                   cache, spill)

    def spill_factor(self, working_set: float) -> float:
        """How many times a byte copied or reduced costs beyond shm beta and gamma when the ranks of a
        host touch `working_set` bytes in a call: 1 up to half the cache (what stays there beside
        everything else), `spill` at twice the cache (where the probe measures it), and on towards
        1 + (spill - 1) / SPILL_AT as the data outgrow it (the part of each pass the cache still holds shrinks)."""
        if self.spill <= 1.0 or self.cache <= 0.0 or working_set <= self.cache / 2:
            return 1.0
        return 1.0 + (self.spill - 1.0) * (1.0 - self.cache / (2 * working_set)) / SPILL_AT

    def spilled(self, working_set: float) -> "Params":
        """These parameters with shm beta and gamma priced for `working_set` (spill_factor)."""
        f = self.spill_factor(working_set)
        return self if f == 1.0 else replace(self, shm=Link(self.shm.alpha, self.shm.beta * f), gamma=self.gamma * f)


def pick_streams(params: Params, limit: int) -> int:
    """How many streams (at most `limit`) a pair's payload should be cut over: as many as it takes
    for flows of beta(flow) to fill a link of beta(net), once the link carries 1.5 flows' worth (a
    cap worth cutting for; loopback on a busy machine measures up to ~1.4 from noise and spare
    cores); 1 where no slower flow was measured (an uncapped NIC, no probe)."""
    ratio = params.flow_link().beta / params.net.beta  # how many flows' worth the link carries
    if ratio < 1.5 or limit <= 1:
        return 1
    return max(1, min(limit, math.ceil(ratio * 0.95)))


SPILL_AT = 0.75  # 1 - cache / (2 * working set) where the probe measures spill (working set = 2 x cache)

# Python-level constants measured on loopback/shm here; net defaults to 10 Gbit/s or the NIC speed
DEFAULT = Params(shm=Link(40e-6, 1 / 1.5e9), net=Link(120e-6, 8 / 10e9), gamma=1 / 4e9)
# verbs between hosts where nothing measured it (PYCOLL_TUNER=model): a message costs the Python of a
# post and a completion (~20 us), and the rate is a 100 Gbit/s port's; the probe replaces both
DEFAULT_RDMA = Link(20e-6, 8 / 100e9)


class Round(NamedTuple):
    """`msgs` message latencies back to back (a board post counts BOARD_POST), moving `pairs` (src,
    dst, bytes), reducing `reduce` bytes per rank, and `cpu` seconds of other work per rank (crowded
    like copies); `duplex=False` when a host's sends and receives do not overlap (they add up on its NIC)."""

    msgs: float
    pairs: List[Tuple[int, int, float]]
    reduce: float = 0.0
    duplex: bool = True
    cpu: float = 0.0


# -- communication patterns, one per (collective, algorithm) ----------------------------------------
def _ring(order: Sequence[int], steps: int, per_edge: float, block: float, reduce: float) -> List[Round]:
    """A pipelined ring over `order`: `steps` steps of `block` bytes, `per_edge` bytes per edge in all."""
    n = len(order)
    msgs = steps * segments_per_block(int(math.ceil(block)))
    return [Round(msgs, [(order[i], order[(i + 1) % n], per_edge) for i in range(n)], reduce)]


def ring_pattern(collective: str, nbytes: float, order: Sequence[int], root: int = 0) -> List[Round]:
    """The ring algorithms over `order` (nbytes is what the Communicator passes for the collective)."""
    n = len(order)
    block = nbytes / n
    if collective == "allreduce":
        return _ring(order, 2 * (n - 1), 2 * (n - 1) * block, block, (n - 1) * block)
    if collective == "reduce_scatter":
        return _ring(order, n - 1, (n - 1) * block, block, (n - 1) * block)
    if collective == "allgather":
        return _ring(order, n - 1, (n - 1) * block, block, 0.0)
    start = list(order).index(root)  # broadcast: a chain from the root along the ring
    chain = [order[(start + i) % n] for i in range(n)]
    segs = max(1, math.ceil(nbytes / TREE_SEGMENT))
    return [Round(n - 2 + segs, [(a, b, nbytes) for a, b in zip(chain, chain[1:])])]


def _fold(n: int, nbytes: float, back: bool, reduce: bool) -> List[Round]:
    rem = Fold.of(n).rem
    if not rem:
        return []
    pairs = [(2 * i + 1, 2 * i, nbytes) if back else (2 * i, 2 * i + 1, nbytes) for i in range(rem)]
    return [Round(1, pairs, nbytes if reduce else 0.0)]


def _exchange(fold: Fold, mask: int, nbytes: float, msgs: int = 1, reduce: float = 0.0) -> Round:
    """Every survivor swaps `nbytes` with the survivor `mask` away."""
    return Round(msgs, [(fold.real(me), fold.real(me ^ mask), nbytes) for me in range(fold.p2)], reduce)


def _masks(p2: int) -> List[int]:
    """1, 2, 4, ... below p2."""
    return [1 << k for k in range(p2.bit_length() - 1)]


def doubling_pattern(collective: str, nbytes: float, n: int, halving: bool) -> List[Round]:
    """Recursive doubling (halving=False) or Rabenseifner (halving=True), MPI's fold included."""
    fold = Fold.of(n)
    if collective == "allgather":  # recursive doubling for powers of two, else Bruck
        block = nbytes / n
        if fold.rem == 0:
            return [_exchange(fold, m, m * block) for m in _masks(n)]
        out, dist = [], 1
        while dist < n:  # a window that wraps past rank n-1 (rank n-1's, from 2 blocks on) goes as 2 messages
            count = min(dist, n - dist)
            out.append(Round(min(count, 2), [(r, (r - dist) % n, count * block) for r in range(n)]))
            dist *= 2
        return out
    if not halving:  # one message per step, but past a ring segment it costs a latency per segment
        # like halving-doubling's: measured over tcp, 2 ranks, 64 MiB: 62-68 ms against 42-46 ms
        rounds = [_exchange(fold, m, nbytes, max(1, math.ceil(nbytes / segment_bytes())), nbytes)
                  for m in _masks(fold.p2)]
    else:  # halving: step m moves m/p2 of the data, in segments of at most segment_bytes() (reduce_scatter:
        # one message per step, charged the same; a survivor that absorbed a rank holds 2 of its n blocks)
        share = [(2 if i < fold.rem else 1) / n if collective == "reduce_scatter" else 1 / fold.p2
                 for i in range(fold.p2)]

        def step(m: int, reduce: bool) -> Round:  # each survivor sends the blocks of its partner's half
            pairs = [(fold.real(me), fold.real(me ^ m), nbytes * sum(share[(me ^ m) & -m:((me ^ m) & -m) + m]))
                     for me in range(fold.p2)]
            part = max(x for _, _, x in pairs)
            return Round(max(1, math.ceil(part / segment_bytes())), pairs, part if reduce else 0.0)
        rounds = [step(m, True) for m in reversed(_masks(fold.p2))]
        if collective != "reduce_scatter":
            rounds += [step(m, False) for m in _masks(fold.p2)]
    tail = nbytes / n if collective == "reduce_scatter" else nbytes
    return _fold(n, nbytes, False, True) + rounds + _fold(n, tail, True, False)


def binomial_pattern(collective: str, nbytes: float, n: int, root: int = 0) -> List[Round]:
    """Binomial broadcast (one round per tree level), reduce (the levels reversed), or both."""
    def parent(v: int) -> int:
        return v & (v - 1)
    levels: Dict[int, List[Tuple[int, int, float]]] = {}
    for v in range(1, n):
        levels.setdefault(bin(v).count("1"), []).append(((parent(v) + root) % n, (v + root) % n, nbytes))
    down = [Round(1, levels[d]) for d in sorted(levels)]
    # a parent's children are all one level down: it reduces all of theirs in that round
    up = [Round(1, [(b, a, x) for a, b, x in r.pairs], nbytes * max(Counter(a for a, _, _ in r.pairs).values()))
          for r in reversed(down)]
    return {"broadcast": down, "reduce": up}.get(collective, up + down)


def double_tree_pattern(nbytes: float, n: int) -> List[Round]:
    """NCCL's double binary tree, pipelined: each tree moves half the data up and back down
    (tree 2 mirrors tree 1 for even n and shifts it by one for odd n, as tree.allreduce_double_tree builds them).
    Each rank waits on one lane's messages before posting the other lane's, so a host's traffic in
    and out does not overlap: not duplex (measured: within 15% of that on the emulated cluster)."""
    to = (lambda x: n - 1 - x) if n % 2 == 0 else (lambda x: (x - 1) % n)
    back = (lambda x: n - 1 - x) if n % 2 == 0 else (lambda x: (x + 1) % n)
    up: List[Tuple[int, int, float]] = []
    for r in range(n):
        second = btree(to(r), n)[0]
        for parent in (btree(r, n)[0], None if second is None else back(second)):
            if parent is not None:
                up.append((r, parent, nbytes / 2))
    depth = max(1, (n - 1).bit_length())
    fan_in = max(Counter(p for _, p, _ in up).values())  # most children of a rank in both trees (1 for n = 2)
    return [Round(2 * depth + 2 * max(1, math.ceil(nbytes / 2 / TREE_SEGMENT)),
                  up + [(p, c, b) for c, p, b in up], fan_in * nbytes / 2, duplex=False)]


# -- the model -------------------------------------------------------------------------------------
MODELED: Dict[str, Tuple[str, ...]] = {
    "allreduce": ("oneshot", "twoshot", "cma", "ring", "flat_ring", "recursive_doubling", "halving_doubling", "tree",
                  "binomial", "hierarchical"),
    "broadcast": ("oneshot", "tree", "ring", "hierarchical"),  # (cma only when named: see cma_pattern)
    "allgather": ("oneshot", "cma", "ring", "recursive_doubling", "hierarchical"),
    "reduce_scatter": ("cma", "ring", "halving_doubling"),
    "reduce": ("oneshot", "tree"),
}
# never chosen for a phase of a hierarchical algorithm
FLAT = ("flat_ring", "hierarchical", "oneshot", "twoshot", "cma")


def crowding(rnd: Round, host_of: Sequence[int], cores: Sequence[int]) -> float:
    """How many of a round's busy ranks share each core, at worst (at least 1): ranks on one core
    copy and reduce in turn, so their bytes cost that many times more (cores[h] = 0: unknown)."""
    busy: Dict[int, set] = {}
    for src, dst, _ in rnd.pairs:
        busy.setdefault(host_of[src], set()).add(src)
        busy.setdefault(host_of[dst], set()).add(dst)
    return max([1.0] + [len(ranks) / cores[h] for h, ranks in busy.items() if h < len(cores) and cores[h]])


def uplink_time(rnd: Round, host_of: Sequence[int], uplinks: Uplinks) -> float:
    """Seconds per stream the round's traffic between racks takes on the busiest rack uplink."""
    out: Dict[int, float] = {}
    inn: Dict[int, float] = {}
    for src, dst, nbytes in rnd.pairs:
        a, b = uplinks.rack_of[host_of[src]], uplinks.rack_of[host_of[dst]]
        if a == b:
            continue
        if a >= 0:
            out[a] = out.get(a, 0.0) + nbytes
        if b >= 0:
            inn[b] = inn.get(b, 0.0) + nbytes
    racks = set(out) | set(inn)
    if rnd.duplex:
        return max((max(out.get(k, 0.0), inn.get(k, 0.0)) * uplinks.beta[k] for k in racks), default=0.0)
    return max(((out.get(k, 0.0) + inn.get(k, 0.0)) * uplinks.beta[k] for k in racks), default=0.0)


def round_time(rnd: Round, host_of: Sequence[int], params: Params, streams: int = 1,
               cores: Sequence[int] = (), uplinks: Optional[Uplinks] = None,
               rdma: AbstractSet[Tuple[int, int]] = frozenset()) -> float:
    """Seconds one round takes on ranks placed on hosts `host_of`, with cores[h] cores on host h,
    the hosts in racks with shared `uplinks` (None: one switch, no uplink between them), and the
    host pairs `rdma` (Params.rdma_pairs) reached over verbs."""
    nic_out: Dict[int, float] = {}
    nic_in: Dict[int, float] = {}
    mem_out: Dict[int, float] = {}
    mem_in: Dict[int, float] = {}
    widest = 0.0  # the largest transfer between two hosts: its own streams carry it
    rdma_out: Dict[int, float] = {}  # bytes between hosts that go over verbs (the rest: nic_*)
    rdma_in: Dict[int, float] = {}
    for src, dst, nbytes in rnd.pairs:
        hs, hd = host_of[src], host_of[dst]
        if hs == hd:
            mem_out[src] = mem_out.get(src, 0.0) + nbytes
            mem_in[dst] = mem_in.get(dst, 0.0) + nbytes
        elif rdma and (hs, hd) in rdma:
            rdma_out[hs] = rdma_out.get(hs, 0.0) + nbytes
            rdma_in[hd] = rdma_in.get(hd, 0.0) + nbytes
        else:
            nic_out[hs] = nic_out.get(hs, 0.0) + nbytes
            nic_in[hd] = nic_in.get(hd, 0.0) + nbytes
            widest = max(widest, nbytes)
    link = params.net if nic_out else params.rdma if rdma_out else params.shm  # type: ignore[assignment]
    if rnd.duplex:
        nic_bytes = max(max(nic_out.values(), default=0.0), max(nic_in.values(), default=0.0))
    else:
        nic_bytes = max((nic_out.get(h, 0.0) + nic_in.get(h, 0.0) for h in set(nic_out) | set(nic_in)), default=0.0)
    nic = nic_bytes * params.net.beta
    if rdma_out:  # a host's verbs and tcp bytes share its NIC
        nic = _nic_time(rnd.duplex, nic_out, nic_in, params.net.beta, rdma_out, rdma_in, params.rdma.beta)  # type: ignore[union-attr]
    if uplinks is not None and (nic_out or rdma_out):
        nic = max(nic, uplink_time(rnd, host_of, uplinks))
    flow = widest * params.flow_link().beta / params.nsocks if params.flow is not None else 0.0
    mem = max(max(mem_out.values(), default=0.0), max(mem_in.values(), default=0.0)) * params.shm.beta
    crowd = crowding(rnd, host_of, cores)
    return rnd.msgs * link.alpha + max(nic * streams, flow, mem * crowd) + (rnd.reduce * params.gamma + rnd.cpu) * crowd


def _nic_time(duplex: bool, net_out: Dict[int, float], net_in: Dict[int, float], net_beta: float,
              rdma_out: Dict[int, float], rdma_in: Dict[int, float], rdma_beta: float) -> float:
    """Seconds on the busiest NIC of a round whose bytes between hosts go partly over verbs."""
    def load(h: int, out: bool) -> float:
        return ((net_out if out else net_in).get(h, 0.0) * net_beta
                + (rdma_out if out else rdma_in).get(h, 0.0) * rdma_beta)
    hosts = set(net_out) | set(net_in) | set(rdma_out) | set(rdma_in)
    if duplex:
        return max(max(load(h, True), load(h, False)) for h in hosts)
    return max(load(h, True) + load(h, False) for h in hosts)


def excess(host_of: Sequence[int], cores: Sequence[int]) -> float:
    """Ranks beyond the cores of the most crowded host (0 when each rank has a core of its own)."""
    counts = Counter(host_of)
    return max([0.0] + [k - cores[h] for h, k in counts.items() if h < len(cores) and 0 < cores[h] < k])


# A board post is a counter store that spinning peers see; a message adds a header, a ring, matching
# and maybe a doorbell. Measured here (shm, 8 B allreduce): 4 ranks, a post 55-65 us, a message round
# (recursive doubling) 105 us; 2 ranks, 9-14 us and 24-33 us. So a post costs half a message latency.
BOARD_POST = 0.5
# What a call costs as its caller sees it, beyond predict() (used for absolute figures, call_time(), not
# for ranking): fitted on allreduce of 8 B - 4 MiB, 2-8 ranks on this 2-core machine
# (tests/test_predict_cores.py), where predict() alone was 3-12x optimistic:
# - CALL_OVERHEAD: the Python of a call (checks, selection, the Work, for async calls the hand-off to
#   the worker) and the wait for the last rank to arrive, charged x crowd**2 (crowd = ranks per core):
#   the ranks of a core run their calls in turn, and each of them waits through the others' turns.
#   Measured beyond predict() and the wake-ups (8 B, one-shot): 12 us at 1 rank per core, 40 at 2,
#   183 at 4. (Charged x crowd at 40 us, a call on ranks with a core each was priced 2-3x too slow;
#   refitted on three runs, session 13: the tuner's picks within 2x in 11, 10, 11 of 12, from 10, 9, 10.)
#   Refitted in session 18, after sessions 17-18 halved the Python of a small call, on the picks of six
#   runs (8 B and 64 KiB on 2 ranks, where it weighs most, and 4 and 8 ranks): at 12 us the 2-rank 8 B
#   pick came out 0.51-0.62x the model in some runs, at 3 us 2.15x in another (the probe's latency swings
#   10-30 us between runs, the call 10-17 us); 8 us keeps every pick of the six within 0.62-1.8x.
# - WAKE: with more ranks than cores a rank waiting for a message spins a while, then sleeps on its
#   doorbell, and the sender must first get a core: every message waits about a scheduling turn per
#   rank beyond the cores. (Ranking with it picked recursive doubling for 4 MiB on 3-8 ranks, measured
#   2-3x slower than the two-shot the model picks without it, so it stays out of predict().)
CALL_OVERHEAD = 8e-6
WAKE = 0.1e-3


def oneshot_pattern(collective: str, nbytes: float, n: int, root: int = 0) -> List[Round]:
    """One board post per rank, then reads of the slots that matter: all of them (allreduce,
    allgather), the root's (broadcast), or all of them at the root (reduce)."""
    others = [(a, b) for a in range(n) for b in range(n) if a != b]
    if collective == "allreduce":
        return [Round(BOARD_POST, [(a, b, nbytes) for a, b in others], (n - 1) * nbytes)]
    if collective == "allgather":
        return [Round(BOARD_POST, [(a, b, nbytes / n) for a, b in others])]
    if collective == "broadcast":
        return [Round(BOARD_POST, [(root, b, nbytes) for b in range(n) if b != root])]
    return [Round(BOARD_POST, [(a, root, nbytes) for a in range(n) if a != root], (n - 1) * nbytes)]  # reduce


def twoshot_pattern(nbytes: float, n: int, stage_bytes: int) -> List[Round]:
    """One post per stage-sized block and one after the last. A rank copies the others' shares of its
    input in, its own reduced share in, and the others' reduced shares out: (2n-1)/n copies of nbytes,
    what a message of (2n-1)/2n of nbytes costs end to end (the sender's copy and the receiver's);
    it reduces (n-1)/n of nbytes, its own share, out of the others' slots."""
    blocks = max(1, math.ceil(nbytes / stage_bytes))
    per_pair = nbytes * (2 * n - 1) / (2 * n) / (n - 1)
    pairs = [(a, b, per_pair) for a in range(n) for b in range(n) if a != b]
    return [Round((blocks + 1) * BOARD_POST, pairs, (n - 1) * nbytes / n)]


# Cross-memory attach (process_vm_readv/writev) pins and maps every 4 KiB page it copies: CPU work that
# does not grow when the data outgrow the cache, counted as CMA_PAGE copies of the page at shm beta.
# Fitted on two-shot / cma time ratios measured interleaved here (2 ranks 0.56, 0.75, 1.15, 1.24 and 4 ranks
# 0.50, 0.88, 1.26, 1.46 at 1, 4, 16, 64 MiB; 3 ranks 1.42, 1.73 and 8 ranks 0.95, 1.49 at 4, 16 MiB), priced
# with eight calibrations of this machine (its spill 2.0-3.2): 0.6 makes no wrong pick from 16 MiB up and
# the fewest costly ones (at 4 MiB only, where the two are 0.75-1.42x apart); 0.9 left 16 MiB on 4 ranks
# to the probe's noise.
CMA_PAGE = 0.6


def cma_pattern(collective: str, nbytes: float, n: int, page_seconds: float, root: int = 0) -> List[Round]:
    """Two posts around single kernel copies out of (and, for allreduce, into) the peers' own arrays.
    A message is two copies through memory, so a single copy counts as half a message of its bytes,
    and as a quarter where its other end is the scratch block in cache; every page copied costs
    `page_seconds` beside. allreduce: a rank reads its share of every peer's buffer and writes it back
    reduced (2(n-1)/n of nbytes through the scratch block) and reduces (n-1)/n of nbytes;
    reduce_scatter: the reads alone; allgather: (n-1) blocks of nbytes/n straight into its output;
    broadcast: nbytes out of the root's buffer into each other rank's. Broadcast is not among the
    tuner's candidates: measured on 4 ranks, cma took 2.3-2.7x the ring's time at 1-4 MiB and 1.7x at
    16 MiB, then 0.44x at 64 MiB, where the ring falls out of cache; the model sees neither side."""
    others = [(a, b) for a in range(n) for b in range(n) if a != b]
    if collective == "broadcast":
        pages = math.ceil(nbytes / 4096)
        return [Round(2 * BOARD_POST, [(root, b, nbytes / 2) for b in range(n) if b != root], cpu=pages * page_seconds)]
    if collective == "allgather":
        pages = (n - 1) * math.ceil(nbytes / n / 4096)
        return [Round(2 * BOARD_POST, [(a, b, nbytes / (2 * n)) for a, b in others], cpu=pages * page_seconds)]
    copies = 2 if collective == "allreduce" else 1  # (reduce_scatter: reads only)
    pages = copies * (n - 1) * math.ceil(nbytes / n / 4096)
    return [Round(2 * BOARD_POST, [(a, b, copies * nbytes / (4 * n)) for a, b in others], (n - 1) * nbytes / n,
                  cpu=pages * page_seconds)]


class Tuner:
    """Predicts the time of every modeled algorithm and picks the cheapest; `board_bytes` is what a
    shared-memory board slot holds on this transport (0: no board, so no one-shot algorithm),
    `stage_bytes` what a stage slot holds (0: no stage, so no two-shot algorithm), and `peer_memory`
    whether every rank can copy from and to every other's memory (else no cma)."""

    def __init__(self, params: Params, board_bytes: int = 0, stage_bytes: int = 0, peer_memory: bool = True) -> None:
        self.params, self.board_bytes, self.stage_bytes = params, board_bytes, stage_bytes
        self.peer_memory = peer_memory

    def pattern(self, collective: str, algorithm: str, nbytes: float, topo: Topology) -> List[Round]:
        """The rounds of one flat (non-hierarchical) algorithm."""
        n = topo.size
        if algorithm in ("ring", "flat_ring"):
            order = topo.ring_order() if algorithm == "ring" else list(range(n))
            return ring_pattern(collective, nbytes, order)
        if algorithm in ("recursive_doubling", "halving_doubling"):
            return doubling_pattern(collective, nbytes, n, algorithm == "halving_doubling")
        if algorithm == "tree" and collective == "allreduce":
            return double_tree_pattern(nbytes, n)
        if algorithm in ("tree", "binomial"):
            return binomial_pattern(collective, nbytes, n)
        if algorithm == "oneshot":
            return oneshot_pattern(collective, nbytes, n)
        if algorithm == "twoshot":
            return twoshot_pattern(nbytes, n, self.stage_bytes)
        if algorithm == "cma":
            return cma_pattern(collective, nbytes, n, CMA_PAGE * 4096 * self.params.shm.beta)
        raise ValueError(f"the tuner has no model of {collective}/{algorithm}")

    def predict(self, collective: str, algorithm: str, nbytes: float, topo: Topology,
                streams: int = 1) -> float:
        """Predicted seconds for one call moving `nbytes` (as the Communicator counts them)."""
        if topo.size == 1:
            return 0.0
        per_rank = nbytes / topo.size if collective == "allgather" else nbytes
        if algorithm == "oneshot" and (topo.nhosts > 1 or per_rank > self.board_bytes):
            return math.inf  # no board: it would run the message-based fallback
        if algorithm == "twoshot" and (topo.nhosts > 1 or not self.stage_bytes):
            return math.inf
        if algorithm == "cma" and (topo.nhosts > 1 or not self.board_bytes or not self.peer_memory):
            return math.inf  # no board to post where the buffers are, or a kernel that refuses: its fallback
        if algorithm == "hierarchical":
            return self._hierarchical(collective, nbytes, topo)
        params = self._priced(nbytes, topo)
        rdma = params.rdma_pairs(topo)
        return sum(round_time(r, topo.host_of, params, streams, topo.cores, topo.uplinks, rdma)
                   for r in self.pattern(collective, algorithm, nbytes, topo))

    def _priced(self, nbytes: float, topo: Topology) -> Params:
        """The parameters for a call of `nbytes` on `topo`: each rank of the fullest host touches its
        buffer and about as many bytes of slots or receive buffers (Params.spill_factor)."""
        return self.params.spilled(2.0 * nbytes * max(len(m) for m in topo.members))

    def call_time(self, collective: str, algorithm: str, nbytes: float, topo: Topology) -> float:
        """Predicted seconds of one call as its caller sees it: predict() plus what every call costs
        beyond its messages (CALL_OVERHEAD, paid in turn by ranks that share a core, x crowd**2)."""
        if topo.size == 1:
            return 0.0
        crowd = max([1.0] + [len(m) / c for m, c in zip(topo.members, topo.cores) if c])
        extra = excess(topo.host_of, topo.cores)
        wakes = WAKE * extra * self.messages(collective, algorithm, nbytes, topo) if extra else 0.0
        return self.predict(collective, algorithm, nbytes, topo) + CALL_OVERHEAD * crowd * crowd + wakes

    def messages(self, collective: str, algorithm: str, nbytes: float, topo: Topology) -> float:
        """Message latencies one call pays back to back (board posts count BOARD_POST), phase by phase."""
        if algorithm != "hierarchical":
            return sum(r.msgs for r in self.pattern(collective, algorithm, nbytes, topo))
        local = Topology.from_hosts([0] * topo.per_host, min(topo.cores))
        cross = topo.subset([m[0] for m in topo.members])
        inner = self.best_phase(collective, nbytes / topo.per_host, cross, topo.per_host)[0] if topo.nhosts > 1 else ""
        return (self.messages("allgather", "ring", nbytes, local) * (2 if collective == "allreduce" else 1)
                + (self.messages(collective, inner, nbytes / topo.per_host, cross) if inner else 0.0))

    def rank(self, collective: str, nbytes: float, topo: Topology, candidates: Iterable[str],
             streams: int = 1) -> List[Tuple[float, str]]:
        """(predicted seconds, algorithm), cheapest first; ties go to the earlier candidate."""
        cands = list(candidates)
        timed = [(self.predict(collective, a, nbytes, topo, streams), i, a) for i, a in enumerate(cands)]
        return [(t, a) for t, _, a in sorted(timed)]

    def best_phase(self, collective: str, nbytes: float, topo: Topology, streams: int) -> Tuple[str, float]:
        """The cheapest flat algorithm for one phase of a hierarchical algorithm."""
        t, name = self.rank(collective, nbytes, topo, [a for a in MODELED[collective] if a not in FLAT],
                            streams)[0]
        return name, t

    def _hierarchical(self, collective: str, nbytes: float, topo: Topology) -> float:
        """Phase by phase, as algorithms/hierarchical.py runs them (see there)."""
        H, L = topo.nhosts, topo.per_host
        if H == 1:
            return self.predict(collective, "ring", nbytes, topo)
        params = self._priced(nbytes, topo)
        local = Topology.from_hosts([0] * L, min(topo.cores))
        cross = topo.subset([m[0] for m in topo.members])  # one rank per host, in racks as the hosts are
        if L == 1:
            return self.best_phase(collective, nbytes, cross, 1)[1]
        if topo.uniform:
            shard = nbytes / L
            inter = self.best_phase(collective, shard, cross, L)[1]
            if collective == "allreduce":
                return (self.predict("reduce_scatter", "ring", nbytes, local) + inter
                        + self.predict("allgather", "ring", nbytes, local))
            if collective == "broadcast":
                scatter = Round(1, [(0, k, shard) for k in range(1, L)])
                return round_time(scatter, local.host_of, params, 1, local.cores) + inter + \
                    self.predict("allgather", "ring", nbytes, local)
            return inter + self.predict("allgather", "ring", nbytes, local) + nbytes * params.shm.beta
        inter = self.best_phase(collective, nbytes, cross, 1)[1]
        bcast = sum(round_time(r, local.host_of, params, 1, local.cores)
                    for r in binomial_pattern("broadcast", nbytes, L))
        if collective == "allreduce":
            reduce = sum(round_time(r, local.host_of, params, 1, local.cores)
                         for r in binomial_pattern("reduce", nbytes, L))
            return reduce + inter + bcast
        if collective == "broadcast":
            return inter + bcast
        gather = round_time(Round(1, [(k, 0, nbytes / topo.size) for k in range(1, L)]), local.host_of,
                            params, 1, local.cores)
        return gather + inter + bcast + nbytes * params.shm.beta

    def _flow_note(self) -> str:
        """' (one stream ..., cut over k)' where a flow is slower than the link or payloads are cut."""
        p = self.params
        if p.flow is None and p.nsocks == 1:
            return ""
        return f" (one stream {p.flow_link().describe()}, payloads cut over {p.nsocks})"

    def _spill_note(self) -> str:
        """', copies 2.8x slower beyond 32 MiB of cache' where a spill was measured."""
        p = self.params
        if p.spill <= 1.0 or p.cache <= 0:
            return ""
        return f", copies {p.spill:.2g}x slower beyond {p.cache / (1 << 20):.0f} MiB of cache"

    def table(self, topo: Topology, sizes: Sequence[int], collectives: Sequence[str] = tuple(MODELED),
              choose: Optional[Callable[[str, int], str]] = None) -> str:
        """Predicted time of every modeled algorithm per size; `*` marks what `choose` (or the model) picks."""
        head = f"{'collective':<15}{'algorithm':<20}" + "".join(f"{_size(s):>10}" for s in sizes)
        rdma = f", rdma {self.params.rdma.describe()}" if self.params.rdma is not None and self.params.rdma_hosts else ""
        lines = [f"tuner ({self.params.source}): shm {self.params.shm.describe()}, "
                 f"net {self.params.net.describe()}{self._flow_note()}{rdma}, reduce {1e-9 / self.params.gamma:.3g} GB/s"
                 f"{self._spill_note()}; "
                 f"{topo.size} ranks on {topo.nhosts} hosts", head]
        for coll in collectives:
            algos = MODELED[coll]
            picks = [choose(coll, s) if choose else self.rank(coll, s, topo, algos)[0][1] for s in sizes]
            for algo in algos:
                cells = "".join(f"{_time(self.predict(coll, algo, s, topo)) + ('*' if p == algo else ' '):>10}"
                                for s, p in zip(sizes, picks))
                lines.append(f"{coll:<15}{algo:<20}{cells}")
        return "\n".join(lines)


def _size(n: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def _time(t: float) -> str:
    if math.isinf(t):
        return "-"
    return f"{t * 1e6:.0f}us" if t < 1e-3 else f"{t * 1e3:.1f}ms" if t < 1 else f"{t:.2f}s"


def info_log() -> logging.Logger:
    """The tuner's logger, printing to stderr when PYCOLL_DEBUG is INFO or TRACE."""
    global _log_ready
    if not _log_ready and config.get("PYCOLL_DEBUG") in ("INFO", "TRACE"):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("pycoll INFO %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        _log_ready = True
    return log

"""What a job sent: the bytes and messages each rank sent each other rank, within hosts and between
them, per collective and per marked step, and each rank's time inside communication per step,
worked out from the flight recorder's dumps (`pycoll trace DIR --traffic`).

Nothing on the wire is counted: each recorded call's bytes come from its algorithm's communication
pattern, the rounds the tuner prices (pycoll/tuner.py; tests/test_patterns.py checks them against
the wire), given the call's collective, element count, dtype, root and its communicator's hosts;
the algorithms the tuner does not model by their formulas (pairwise alltoall(v), linear gather and
scatter, the dissemination barrier), and the hierarchical ones phase by phase as
algorithms/hierarchical.py runs them (the cross-host phase as the dump names it). Point-to-point
sends count as sent. Each rank's sends come from its own dump, so a rank without a dump is missing.

Messages follow the patterns' conventions (test_patterns.py's docstring): a pipelined chain
broadcast or double tree sends `segments` per edge, recursive doubling allreduce and
halving-doubling reduce_scatter one message per step, Bruck's allgather two where a window wraps.
The board algorithms (one-shot, two-shot, cma) move data through shared memory: their bytes are the
pattern's (one-shot: the slot reads; two-shot and cma: what their copies cost, in message bytes),
a message is a board post, and where the communicator's board cannot carry a call (the dump says
what it holds) the message-based fallback that ran is counted instead. Calls that may read
registered buffers in place count as the algorithm they fall back to. The ring and recursive
doubling (Bruck) allgatherv, the ring reduce_scatter with counts and the hierarchical allgather's
bundles are counted block by block; other v-variants by their total, as the tuner prices them.
MPI's own collectives (mpi_native) and allgather_ragged are not modeled: the report lists them.

Steps: rank r's step k is what it entered between its marks k-1 and k (pycoll.mark_step()); step 1
starts when its first communicator was made. A step counts only where every rank marked it and
every recorder still held all of it (a full ring drops its oldest calls). With no marks the
whole recorded span is one step.
"""
from __future__ import annotations

import bisect
import functools
import statistics
from collections import Counter, defaultdict
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

from . import analysis
from .analysis import TraceError

Pairs = Dict[Tuple[int, int], List[float]]  # (src, dst) -> [bytes, messages], in communicator ranks
BOARD = ("oneshot", "twoshot", "cma")
BASE = {"allgatherv": "allgather", "gatherv": "gather", "scatterv": "scatter"}  # call -> selection's name
ONE_MESSAGE_PER_STEP = {("allreduce", "recursive_doubling"), ("reduce_scatter", "halving_doubling")}
MATRIX_RANKS = 16  # the text report draws the rank-to-rank matrix up to this many ranks, else the heaviest pairs


# -- at dump time: name what a call ran ------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _names(collective: str) -> Dict[str, str]:
    """'module:function' -> algorithm name, for one collective of pycoll.selection."""
    from ..selection import IMPLEMENTATIONS
    return {impl: name for name, impl in IMPLEMENTATIONS.get(collective, {}).items()}


@functools.lru_cache(maxsize=256)
def _name(collective: str, fn: Any) -> Optional[str]:
    """The selection name of algorithm function `fn` (or a functools.partial of it)."""
    fn = getattr(fn, "func", fn)
    module = (getattr(fn, "__module__", "") or "").rsplit(".", 1)[-1]
    return _names(collective).get(f"{module}:{getattr(fn, '__name__', '')}")


def describe_algorithm(call: str, fn: Any, dtype: Any, count: Any, root: Optional[int]) -> Dict[str, Any]:
    """What a dump says of the algorithm `fn` that ran call `call`: {"algorithm": name}, "registered":
    true where it reads registered buffers in place when every rank passes one (the bytes are then
    counted as its fallback's), and for a hierarchical call "phase": the algorithm the selector
    picks for its cross-host phase (as algorithms/hierarchical.py asks it)."""
    coll = BASE.get(call, call)
    out: Dict[str, Any] = {}
    keywords = getattr(fn, "keywords", None) or {}
    if "fallback" in keywords:  # symmetric.py's in-place reads, around the algorithm picked for the call
        out["registered"] = True
        fn = keywords["fallback"]
        keywords = getattr(fn, "keywords", None) or {}
    name = _name(coll, fn)
    out["algorithm"] = name
    if name == "hierarchical" and dtype is not None and count is not None:
        topo, selector = keywords["topo"], keywords["selector"]
        key = (id(topo), id(selector), coll, dtype.itemsize, tuple(count) if isinstance(count, list) else count, root)
        if key not in _phases:
            if len(_phases) > 1024:
                _phases.clear()
            _phases[key] = _cross_phase(coll, topo, selector, dtype.itemsize, count, root)
        phase = _phases[key]
        if phase is not None:
            out["phase"] = phase
    return out


_phases: Dict[Tuple, Optional[str]] = {}  # describe_algorithm's answers: a dump names many alike calls


def _cross_phase(coll: str, topo: Any, selector: Any, itemsize: int, count: Any, root: Optional[int]
                 ) -> Optional[str]:
    """The algorithm of a hierarchical call's cross-host phase (local index 0's, where every local
    index runs one), from the sizes algorithms/hierarchical.py hands selector.phase()."""
    from ..algorithms.ring import chunk_edges
    if topo.nhosts < 2:
        return None
    counts = list(count) if isinstance(count, (list, tuple)) else [int(count)] * topo.size
    if topo.uniform:
        first = [m[0] for m in topo.members]
        if coll == "allgather":
            nbytes = sum(counts[c] for c in first) * itemsize
        else:
            edges = chunk_edges(int(count), topo.per_host)
            nbytes = (edges[1] - edges[0]) * itemsize
        members, streams = first, topo.per_host
    else:
        root_host = topo.host_of[root] if coll == "broadcast" and root is not None else -1
        members = [root if h == root_host else m[0] for h, m in enumerate(topo.members)]
        nbytes = (sum(counts) if coll == "allgather" else int(count)) * itemsize
        streams = 1
    if nbytes == 0:
        return None
    return _name(coll, selector.phase(coll, nbytes, topo.subset(members), streams))


# -- patterns: bytes and messages per pair of one call ---------------------------------------------
@functools.lru_cache(maxsize=1)
def _tuner() -> Any:
    """A Tuner for the patterns alone (their bytes do not depend on the calibration)."""
    from ..transports.shm_board import SLOT_BYTES, STAGE_BYTES
    from ..tuner import DEFAULT, Tuner
    return Tuner(DEFAULT, SLOT_BYTES, STAGE_BYTES)


def _add(into: Pairs, pairs: Pairs, ranks: Optional[Sequence[int]] = None) -> None:
    """Add `pairs` (on pattern ranks; ranks[i] is pattern rank i's rank in `into`) to `into`."""
    for (a, b), (x, m) in pairs.items():
        key = (a, b) if ranks is None else (ranks[a], ranks[b])
        slot = into.setdefault(key, [0.0, 0.0])
        slot[0] += x
        slot[1] += m


def _from_rounds(coll: str, algo: str, rounds: Iterable[Any], n: int) -> Pairs:
    """A pattern's rounds as bytes and messages per pair (the conventions of the module docstring)."""
    from ..tuner import BOARD_POST
    out: Pairs = {}
    for rnd in rounds:
        if algo in BOARD:
            per = rnd.msgs / BOARD_POST
        elif (coll, algo) == ("broadcast", "ring"):
            per = rnd.msgs - (n - 2)
        elif (coll, algo) == ("allreduce", "tree"):
            per = (rnd.msgs - 2 * max(1, (n - 1).bit_length())) / 2
        elif (coll, algo) in ONE_MESSAGE_PER_STEP:
            per = 1
        else:
            per = rnd.msgs
        for a, b, x in rnd.pairs:
            slot = out.setdefault((a, b), [0.0, 0.0])
            slot[0] += x
            slot[1] += per
    return out


def doubling_v(counts: Sequence[float], itemsize: float) -> Pairs:
    """recursive_doubling.allgather with block r of counts[r] elements, exactly: for a power of two,
    rank r sends its aligned group of 1, 2, 4, ... blocks to r ^ mask; else Bruck: the `count`
    blocks from its own on to r - dist, as two messages where they wrap past rank n-1 (empty pieces
    are not sent)."""
    n = len(counts)
    out: Pairs = {}

    def add(a: int, b: int, pieces: List[float]) -> None:
        slot = out.setdefault((a, b), [0.0, 0.0])
        slot[0] += sum(pieces) * itemsize
        slot[1] += sum(1 for x in pieces if x)
    if n & (n - 1) == 0:
        mask = 1
        while mask < n:
            for r in range(n):
                first = r & ~(mask - 1)
                add(r, r ^ mask, [sum(counts[first:first + mask])])
            mask <<= 1
        return out
    dist = 1
    while dist < n:
        count = min(dist, n - dist)
        for r in range(n):
            blocks = [counts[(r + k) % n] for k in range(count)]
            split = max(0, min(count, n - r))  # blocks before the wrap
            add(r, (r - dist) % n, [sum(blocks[:split]), sum(blocks[split:])])
        dist *= 2
    return out


def flat(coll: str, algo: str, nbytes: float, topo: Any, root: int = 0) -> Optional[Pairs]:
    """Bytes and messages per pair of one call of a flat (not hierarchical) algorithm moving
    `nbytes` (what the Communicator passes: the output of an allgather, else the input) on `topo`;
    None for an algorithm with no pattern."""
    from .. import tuner
    n = topo.size
    if n < 2 or nbytes == 0:
        return {}
    if algo in ("ring", "flat_ring"):
        order = topo.ring_order() if algo == "ring" else list(range(n))
        return _from_rounds(coll, "ring", tuner.ring_pattern(coll, nbytes, order, root), n)
    if algo == "recursive_doubling" and coll == "allgather" and n & (n - 1):
        return doubling_v([nbytes / n] * n, 1)
    if algo in ("recursive_doubling", "halving_doubling"):
        return _from_rounds(coll, algo, tuner.doubling_pattern(coll, nbytes, n, algo == "halving_doubling"), n)
    if algo == "tree" and coll == "allreduce":
        return _from_rounds(coll, algo, tuner.double_tree_pattern(nbytes, n), n)
    if algo in ("tree", "binomial"):
        return _from_rounds(coll, algo, tuner.binomial_pattern(coll, nbytes, n, root), n)
    if algo == "oneshot" and coll != "barrier":
        return _from_rounds(coll, algo, tuner.oneshot_pattern(coll, nbytes, n, root), n)
    if algo == "twoshot":
        return _from_rounds(coll, algo, _tuner().pattern(coll, algo, nbytes, topo), n)
    if algo == "cma":
        return _from_rounds(coll, algo, tuner.cma_pattern(coll, nbytes, n, 0.0, root), n)
    return None


def ring_v(coll: str, counts: Sequence[int], itemsize: int, order: Sequence[int]) -> Pairs:
    """The ring allgatherv / reduce_scatter with counts (algorithms/ring.py), exactly: along the ring
    each rank passes on every block but the next rank's own (allgather) or its own (reduce-scatter),
    each in segments_per_block(largest block) segments, empty ones skipped."""
    from ..algorithms.ring import segments_per_block
    n = len(order)
    ring = [counts[o] for o in order]
    spr = segments_per_block(int(max(ring) * itemsize))
    out: Pairs = {}
    for p in range(n):
        kept = (p + 1) % n if coll == "allgather" else p
        sent = [ring[b] for b in range(n) if b != kept]
        out[order[p], order[(p + 1) % n]] = [sum(sent) * itemsize, sum(min(spr, c) for c in sent)]
    return out


def allgather_v(coll: str, algo: str, counts: Sequence[float], itemsize: float, topo: Any) -> Pairs:
    """Ring allgatherv / reduce_scatter with counts, or recursive doubling (Bruck) allgatherv, block by block."""
    if algo == "recursive_doubling":
        return doubling_v(counts, itemsize)
    return ring_v(coll, counts, itemsize, topo.ring_order())


def formula(coll: str, algo: str, counts: Sequence[int], itemsize: int, n: int, root: int,
            sender: int) -> Optional[Pairs]:
    """What `sender` sends in one call of an algorithm the tuner does not model (docs/algorithms.md):
    pairwise alltoall(v) (counts: what it sends each rank), linear gather/scatter (counts: each
    rank's block), the dissemination barrier (one byte per round), the one-shot barrier (a post)."""
    out: Pairs = {}
    if algo == "pairwise":
        for k in range(1, n):
            dst = (sender + k) % n
            if counts[dst]:
                out[sender, dst] = [counts[dst] * itemsize, 1]
    elif algo == "linear" and coll == "gather":
        if sender != root and counts[sender]:
            out[sender, root] = [counts[sender] * itemsize, 1]
    elif algo == "linear" and coll == "scatter":
        if sender == root:
            out.update({(root, k): [counts[k] * itemsize, 1] for k in range(n) if k != root and counts[k]})
    elif algo == "dissemination":
        dist = 1
        while dist < n:
            slot = out.setdefault((sender, (sender + dist) % n), [0.0, 0.0])
            slot[0] += 1
            slot[1] += 1
            dist *= 2
    elif algo != "oneshot":  # (the one-shot barrier posts an empty slot: nothing sent)
        return None
    return out


def hierarchical(coll: str, nbytes: float, topo: Any, root: int, phase: Optional[str],
                 counts: Sequence[int], itemsize: int) -> Optional[Pairs]:
    """algorithms/hierarchical.py's phases, each as its own pattern on the ranks that run it
    (`phase`: the cross-host phase's algorithm; `counts`: elements per rank, allgather only)."""
    from ..algorithms.ring import chunk_edges
    members, H = topo.members, topo.nhosts
    out: Pairs = {}
    if phase is None and H > 1:
        return None

    def run(c: str, algo: str, size: float, ranks: Sequence[int], r: int = 0) -> bool:
        if len(ranks) < 2 or size == 0:
            return True
        got = flat(c, algo, size, topo.subset(ranks), r)
        if got is None:
            return False
        _add(out, got, ranks)
        return True

    def gather_across(blocks: List[float], ranks: Sequence[int]) -> bool:
        """The cross-host allgather(v) of `blocks` (elements per rank of `ranks`)."""
        if len(set(blocks)) > 1 and phase in ("ring", "recursive_doubling"):
            _add(out, allgather_v("allgather", phase, blocks, itemsize, topo.subset(ranks)), ranks)
            return True
        return run("allgather", phase or "ring", sum(blocks) * itemsize, ranks)

    ok = True
    if topo.uniform:
        L = topo.per_host
        if coll == "allgather":
            for j in range(L):
                cross = [m[j] for m in members]
                ok &= gather_across([counts[c] for c in cross], cross)
            sizes = [sum(counts[m[k]] for m in members) for k in range(L)]  # bundle k: local ranks k
            for m in members:
                if L > 1:
                    _add(out, ring_v("allgather", sizes, itemsize, list(range(L))), m)
            return out if ok else None
        edges = chunk_edges(int(round(nbytes / itemsize)), L)
        shards = [(b - a) * itemsize for a, b in zip(edges, edges[1:])]
        root_host = topo.host_of[root]
        for m in members:
            if coll == "allreduce":
                run("reduce_scatter", "ring", nbytes, m)
            elif m is members[root_host] and L > 1:
                j = m.index(root)
                _add(out, {(m[j], m[k]): [shards[k], 1] for k in range(L) if k != j and shards[k]})
        for j in range(L):
            ok &= run(coll, phase, shards[j], [m[j] for m in members], root_host if coll == "broadcast" else 0)
        for m in members:
            run("allgather", "ring", nbytes, m)
        return out if ok else None
    root_host = topo.host_of[root] if coll == "broadcast" else -1
    leaders = [root if h == root_host else m[0] for h, m in enumerate(members)]
    if coll == "allgather":
        for m in members:
            _add(out, {(r, m[0]): [counts[r] * itemsize, 1] for r in m[1:] if counts[r]})
        ok = gather_across([sum(counts[r] for r in m) for m in members], leaders)
        for m in members:
            run("broadcast", "tree", nbytes, m)
        return out if ok else None
    for h, m in enumerate(members):
        if coll == "allreduce":
            run("reduce", "tree", nbytes, m)
    ok = run(coll, phase, nbytes, leaders, root_host if coll == "broadcast" else 0)
    for h, m in enumerate(members):
        run("broadcast", "tree", nbytes, m, m.index(leaders[h]))
    return out if ok else None


# -- reading a job's dumps -------------------------------------------------------------------------
class _Comm:
    """One communicator as the dumps describe it: members' global ranks, hosts and board."""

    def __init__(self, group: List[int], hosts: List[str], racks: Optional[List[str]],
                 board: Optional[Sequence[Any]] = None) -> None:
        from ..topology import RankInfo, Topology
        self.group, self.board = group, board
        self.topo = Topology([RankInfo(host=h, rack=(racks[i] if racks else "")) for i, h in enumerate(hosts)])


def ran(call: str, algo: str, post: int, itemsize: int, n: int, board: Optional[Sequence[Any]]) -> str:
    """The algorithm a board algorithm `algo` really runs for `call`: itself, or its message-based
    fallback where the communicator's board (slot bytes, stage bytes, peers' memory reachable)
    cannot carry it (`post`: the bytes one rank posts, its block of an allgather)."""
    if algo not in BOARD or board is None:  # (no board recorded: as named)
        return algo
    slot, stage, memory = int(board[0]), int(board[1]), bool(board[2])
    coll = BASE.get(call, call)
    twoshot = "twoshot" if itemsize and stage // itemsize >= n else "halving_doubling"
    if algo == "twoshot":
        return twoshot
    if algo == "oneshot":
        if slot and post <= slot and call != "allgatherv":
            return algo
        return {"allreduce": "recursive_doubling", "allgather": "recursive_doubling",
                "barrier": "dissemination"}.get(coll, "tree")
    if slot and memory and call != "allgatherv":  # cma: every rank reaches the others' memory
        return algo
    return {"allreduce": twoshot, "reduce_scatter": "halving_doubling", "allgather": "recursive_doubling"
            }.get(coll, "tree")


def _sent(e: dict, comm: _Comm, me: int, cache: Dict[Tuple, Optional[Pairs]]) -> Optional[Pairs]:
    """What comm rank `me` sent in recorded call `e` (pairs in comm ranks), None if not modeled."""
    n = len(comm.group)
    item = e.get("itemsize") or 0
    if e.get("p2p"):
        if not e["call"].endswith("send") or e.get("peer") is None:
            return {}
        return {(me, int(e["peer"])): [_total(e.get("count")) * item, 1]}
    call = e["call"]
    coll = BASE.get(call, call)
    algo = e.get("algorithm") or ("linear" if coll in ("gather", "scatter") else None)
    if coll == "barrier":
        item = 1
    root = e.get("root") or 0
    count = e.get("count")
    if algo is None or algo == "mpi_native" or (count is None and coll not in ("barrier", "alltoallv")):
        return None
    if coll == "alltoallv":
        sc = e.get("send_counts")
        return None if sc is None else formula("alltoall", "pairwise", sc, item, n, root, me)
    counts = _per_rank(count, n)
    post = counts[me] * item if coll == "allgather" else _total(count) * item
    algo = ran(call, algo, post, item, n, comm.board)
    if algo in ("pairwise", "linear", "dissemination") or coll == "barrier":
        if coll == "alltoall":
            counts = [_total(count) // n] * n
        return formula(coll, algo, counts, item, n, root, me)
    nbytes = sum(counts) * item if coll == "allgather" else _total(count) * item
    if len(set(counts)) > 1 and (coll, algo) in (("allgather", "ring"), ("reduce_scatter", "ring"),
                                                  ("allgather", "recursive_doubling")):
        pairs = allgather_v(coll, algo, counts, item, comm.topo)
        return {p: v for p, v in pairs.items() if p[0] == me}
    key = (coll, algo, e.get("phase"), nbytes, item, root, tuple(counts) if coll == "allgather" else None,
           tuple(comm.topo.host_of), tuple(comm.topo.rack_of))
    if key not in cache:
        if algo == "hierarchical":
            cache[key] = hierarchical(coll, nbytes, comm.topo, root, e.get("phase"), counts, item)
        else:
            cache[key] = flat(coll, algo, nbytes, comm.topo, root)
    pairs = cache[key]
    return None if pairs is None else {p: v for p, v in pairs.items() if p[0] == me}


def _total(count: Any) -> int:
    """Elements of a dump's count (an int, per-rank counts, or the cut form {"total", "first"})."""
    if count is None:
        return 0
    if isinstance(count, dict):
        return int(count["total"])
    if isinstance(count, list):
        return sum(int(c) for c in count)
    return int(count)


def _per_rank(count: Any, n: int) -> List[int]:
    """Elements per rank: per-rank counts as given, else the same count for every rank."""
    if isinstance(count, list) and len(count) == n:
        return [int(c) for c in count]
    if isinstance(count, dict):  # cut to 16 in the dump: spread the total evenly
        return [int(count["total"]) // n] * n
    return [_total(count)] * n


def _steps(dump: dict) -> List[Tuple[int, float, float]]:
    """(step, start, end) of a dump's marked steps."""
    marks = [(int(k), float(t)) for k, t in dump.get("marks") or []]
    out = []
    for i, (k, t) in enumerate(marks):
        start = marks[i - 1][1] if i else (dump.get("started") or 0.0) if k == 1 else None
        if start is not None:
            out.append((k, start, t))
    return out


def _window_start(dump: dict) -> float:
    """From when on every recorder of the dump still holds all its calls (a full ring dropped older ones)."""
    start = 0.0
    for c in dump.get("comms", []):
        if c.get("recorded", 0) > c.get("capacity", 0) and c.get("calls"):
            start = max(start, min(e["enter"] for e in c["calls"]))
    return start


def _union(spans: List[Tuple[float, float]]) -> float:
    """Seconds covered by the intervals `spans`."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _median(values: List[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


class Tally(NamedTuple):
    """What the dumps of one job add up to, step by step (index i: the i-th counted step)."""

    ranks: List[int]  # every rank a dump names
    host_of: Dict[int, str]  # rank -> host id
    steps: List[int]  # the counted steps' numbers ([0]: the unmarked span)
    note: Optional[str]
    bytes: Dict[Tuple[int, int], List[float]]  # (src, dst) global ranks -> bytes sent in each step
    messages: Dict[Tuple[int, int], List[float]]
    kinds: Dict[Tuple[str, Optional[str]], Dict[str, List[float]]]  # (call, algorithm) -> calls, within, ...
    comm_s: Dict[int, List[float]]  # rank -> seconds inside communication in each step
    step_s: Dict[int, List[Optional[float]]]  # rank -> each step's length (None: unmarked)
    unmodeled: Counter
    unfinished: int


def tally(dumps: Dict[int, dict]) -> Tally:
    """Add up one job's dumps ({rank: dump}; one job: analysis.one_job) step by step."""
    if not dumps:
        raise TraceError("no rank*.json dumps to read (run the job with PYCOLL_TRACE_DIR set: every rank "
                         "dumps when it ends)")
    host_of: Dict[int, str] = {r: d["host_id"] for r, d in dumps.items() if d.get("host_id")}
    comms: Dict[Tuple[str, Tuple[int, ...]], _Comm] = {}
    for d in dumps.values():
        for c in d.get("comms", []):
            if c.get("hosts"):
                comms[c["id"], tuple(c["group"])] = _Comm(list(c["group"]), c["hosts"], c.get("racks"),
                                                          c.get("board"))
                for g, h in zip(c["group"], c["hosts"]):
                    host_of.setdefault(g, h)
    ranks = sorted(set(dumps) | {g for c in comms.values() for g in c.group})

    marked = {r: _steps(d) for r, d in dumps.items()}
    unmarked = [r for r, s in marked.items() if not s]
    note = None
    if unmarked:
        note = ("no step marks in the dumps" if len(unmarked) == len(dumps) else
                f"ranks {analysis.span(unmarked)} marked no steps") + \
               " (call pycoll.mark_step() at the end of each step): the whole recorded span counts as one step"
        spans = {r: (float("-inf"), float("inf")) for r in dumps}
        steps = [0]
        bounds = {r: {0: spans[r]} for r in dumps}
    else:
        common = set.intersection(*({k for k, _, _ in s} for s in marked.values()))
        bounds = {r: {k: (a, b) for k, a, b in s if k in common} for r, s in marked.items()}
        windows = {r: _window_start(d) for r, d in dumps.items()}
        steps = sorted(k for k in common if all(bounds[r][k][0] >= windows[r] for r in dumps))
        if not steps:
            raise TraceError("no step that every rank marked is held whole by every rank's flight recorder "
                             "(raise PYCOLL_TRACE_BUFFER, or mark steps with pycoll.mark_step())")
        dropped = len(common) - len(steps)
        if dropped:
            note = f"{dropped} earlier marked steps are left out: the recorders no longer hold all their calls"
    index = {k: i for i, k in enumerate(steps)}
    finder = {r: _Steps(bounds[r], index) for r in dumps}

    S = len(steps)
    pair_b = defaultdict(lambda: [0.0] * S)  # (src, dst) global -> bytes per step
    pair_m = defaultdict(lambda: [0.0] * S)
    kind = defaultdict(lambda: {"calls": [0] * S, "within": [0.0] * S, "between": [0.0] * S, "messages": [0.0] * S})
    busy: Dict[int, List[List[Tuple[float, float]]]] = {r: [[] for _ in steps] for r in dumps}
    unmodeled: Counter = Counter()
    unfinished = 0
    cache: Dict[Tuple, Optional[Pairs]] = {}
    for r, d in dumps.items():
        for c in d.get("comms", []):
            comm = comms.get((c["id"], tuple(c["group"])))
            if comm is None:  # a dump without hosts (an older pycoll): every member on its own known host
                comm = _Comm(list(c["group"]), [host_of.get(g, f"rank{g}") for g in c["group"]], None)
            me = c["rank"]
            for e in c.get("calls", []):
                i = finder[r].of(e["enter"])
                if i is None:
                    continue
                if e.get("state") != "completed":
                    unfinished += 1
                    continue
                busy[r][i].append((e.get("start") or e["enter"], e.get("end") or e["enter"]))
                label = e["call"] if not e.get("p2p") else "send" if e["call"].endswith("send") else "recv"
                algorithm = e.get("algorithm") or ("p2p" if e.get("p2p") else None)
                if label == "recv":
                    continue
                sent = _sent(e, comm, me, cache)
                if sent is None:
                    unmodeled[label, algorithm or "?"] += 1
                    continue
                k = kind[label, algorithm]
                if e.get("p2p") or me == 0:  # (a collective is one call of all its ranks: counted at rank 0)
                    k["calls"][i] += 1
                for (a, b), (x, m) in sent.items():
                    ga, gb = comm.group[a], comm.group[b]
                    pair_b[ga, gb][i] += x
                    pair_m[ga, gb][i] += m
                    k["between" if host_of.get(ga) != host_of.get(gb) else "within"][i] += x
                    k["messages"][i] += m

    return Tally(ranks, host_of, steps, note, dict(pair_b), dict(pair_m), dict(kind),
                 {r: [_union(b) for b in busy[r]] for r in dumps},
                 {r: [(bounds[r][k][1] - bounds[r][k][0]) if k else None for k in steps] for r in dumps},
                 unmodeled, unfinished)


def traffic(dumps: Dict[int, dict]) -> Dict[str, Any]:
    """The traffic report of one job's dumps ({rank: dump}; one job: analysis.one_job): per rank,
    pair and collective the median over the counted steps, each step's totals, and the window's."""
    t = tally(dumps)
    ranks, host_of, steps, S = t.ranks, t.host_of, t.steps, len(t.steps)
    pair_b, pair_m, kind = t.bytes, t.messages, t.kinds
    missing = [r for r in ranks if r not in dumps]
    hosts = list(dict.fromkeys(host_of[r] for r in ranks if r in host_of))
    between = {p: host_of.get(p[0]) != host_of.get(p[1]) for p in pair_b}
    per_step = []
    for i, k in enumerate(steps):
        per_step.append({
            "step": k,
            "bytes_within": sum(v[i] for p, v in pair_b.items() if not between[p]),
            "bytes_between": sum(v[i] for p, v in pair_b.items() if between[p]),
            "messages": sum(v[i] for v in pair_m.values()),
            "comm_s": {r: t.comm_s[r][i] for r in dumps},
            "step_s": {r: t.step_s[r][i] for r in dumps}})

    def rank_row(r: int) -> Dict[str, Any]:
        mine = [p for p in pair_b if p[0] == r]
        return {"host": hosts.index(host_of[r]) if r in host_of else None,
                "bytes_within": _median([sum(pair_b[p][i] for p in mine if not between[p]) for i in range(S)]),
                "bytes_between": _median([sum(pair_b[p][i] for p in mine if between[p]) for i in range(S)]),
                "messages": _median([sum(pair_m[p][i] for p in mine) for i in range(S)]),
                "comm_s": _median([s["comm_s"][r] for s in per_step]) if r in dumps else None,
                "step_s": _median([s["step_s"][r] for s in per_step]) if r in dumps and steps[0] else None}

    return {
        "job": next((d.get("job") for d in dumps.values() if d.get("job")), None),
        "ranks": ranks, "missing": missing, "hosts": hosts,
        "host_of": {r: hosts.index(host_of[r]) for r in ranks if r in host_of},
        "steps": {"marked": bool(steps[0]), "count": S, "numbers": steps, "note": t.note},
        "median_step": {
            "ranks": {r: rank_row(r) for r in ranks},
            "total": {"bytes_within": _median([s["bytes_within"] for s in per_step]),
                      "bytes_between": _median([s["bytes_between"] for s in per_step]),
                      "messages": _median([s["messages"] for s in per_step])},
            "collectives": [{"call": call, "algorithm": algo, "calls": _median(v["calls"]),
                             "bytes_within": _median(v["within"]), "bytes_between": _median(v["between"]),
                             "messages": _median(v["messages"])}
                            for (call, algo), v in sorted(kind.items(), key=lambda kv: (kv[0][0], kv[0][1] or ""))],
            "pairs": [{"src": a, "dst": b, "bytes": _median(pair_b[a, b]), "messages": _median(pair_m[a, b]),
                       "between_hosts": between[a, b]} for a, b in sorted(pair_b)]},
        "per_step": per_step,
        "window": {"bytes_within": sum(s["bytes_within"] for s in per_step),
                   "bytes_between": sum(s["bytes_between"] for s in per_step),
                   "messages": sum(s["messages"] for s in per_step),
                   "pairs": [{"src": a, "dst": b, "bytes": sum(pair_b[a, b]), "messages": sum(pair_m[a, b])}
                             for a, b in sorted(pair_b)]},
        "unmodeled": [{"call": c, "algorithm": a, "calls": n} for (c, a), n in sorted(t.unmodeled.items())],
        "unfinished": t.unfinished,
    }


class _Steps:
    """One rank's counted steps, to find the one a call was entered in."""

    def __init__(self, bounds: Dict[int, Tuple[float, float]], index: Dict[int, int]) -> None:
        spans = sorted((b, a, index[k]) for k, (a, b) in bounds.items() if k in index)
        self.ends = [b for b, _, _ in spans]
        self.spans = spans

    def of(self, t: float) -> Optional[int]:
        """The index of the counted step whose span (start, end] holds time `t`, None if none does."""
        at = bisect.bisect_left(self.ends, t)
        if at == len(self.ends):
            return None
        end, start, i = self.spans[at]
        return i if start < t <= end else None


# -- text -------------------------------------------------------------------------------------------
def _bytes(x: float) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if x >= 1 << shift:
            return f"{x / (1 << shift):.2f} {unit}"
    return f"{x:.0f} B"


def _ms(s: Optional[float]) -> str:
    return "-" if s is None else f"{s * 1e3:.2f} ms"


def render(report: Dict[str, Any], folder: str = "") -> str:
    """The traffic report as text."""
    st, med = report["steps"], report["median_step"]
    lines = [f"traffic of {len(report['ranks'])} ranks on {len(report['hosts'])} "
             f"host{'s' if len(report['hosts']) != 1 else ''}" + (f" ({folder})" if folder else "")
             + (f", job {report['job']}" if report["job"] else "")]
    for h, host in enumerate(report["hosts"]):
        on = [r for r, k in report["host_of"].items() if k == h]
        lines.append(f"  host{h}: ranks {analysis.span(on)} ({host.split('/')[0]})")
    if st["note"]:
        lines.append(f"note: {st['note']}")
    if report["missing"]:
        lines.append(f"ranks {analysis.span(report['missing'])} left no dump: their sends are not counted")
    if st["marked"]:
        lines.append(f"{st['count']} marked steps (steps {st['numbers'][0]}-{st['numbers'][-1]}); "
                     f"per step, the median over them:")
    else:
        lines.append("the recorded span as one step:")
    lines.append(f"  {'rank':<6}{'host':<7}{'sent within host':>18}{'between hosts':>16}{'messages':>10}"
                 f"{'in comm':>12}{'step':>12}")
    for r, row in med["ranks"].items():
        host = "-" if row["host"] is None else f"host{row['host']}"
        lines.append(f"  {r:<6}{host:<7}{_bytes(row['bytes_within']):>18}{_bytes(row['bytes_between']):>16}"
                     f"{row['messages']:>10.0f}{_ms(row['comm_s']):>12}{_ms(row['step_s']):>12}")
    t = med["total"]
    lines.append(f"  {'all':<13}{_bytes(t['bytes_within']):>18}{_bytes(t['bytes_between']):>16}{t['messages']:>10.0f}")
    lines.append("per collective (median step):")
    lines.append(f"  {'call':<16}{'algorithm':<20}{'calls':>6}{'within hosts':>15}{'between hosts':>15}{'messages':>10}")
    for k in med["collectives"]:
        lines.append(f"  {k['call']:<16}{k['algorithm'] or '-':<20}{k['calls']:>6.0f}{_bytes(k['bytes_within']):>15}"
                     f"{_bytes(k['bytes_between']):>15}{k['messages']:>10.0f}")
    if med["pairs"] and len(report["ranks"]) > MATRIX_RANKS:
        heavy = sorted(med["pairs"], key=lambda p: -p["bytes"])[:MATRIX_RANKS]
        lines.append(f"the {len(heavy)} heaviest pairs, median step; * crosses hosts:")
        lines += [f"  {p['src']:>6} -> {p['dst']:<6}{_bytes(p['bytes']):>12}{'*' if p['between_hosts'] else ''}"
                  f"  {p['messages']:.0f} messages" for p in heavy]
    elif med["pairs"]:
        ranks = report["ranks"]
        lines.append("bytes sent, rank (row) to rank (column), median step; * crosses hosts:")
        lines.append("  " + f"{'':>6}" + "".join(f"{c:>12}" for c in ranks))
        cell = {(p["src"], p["dst"]): p for p in med["pairs"]}
        for a in ranks:
            row = "".join(f"{'-' if (a, b) not in cell else _bytes(cell[a, b]['bytes']) + ('*' if cell[a, b]['between_hosts'] else ' '):>12}"
                          for b in ranks)
            lines.append(f"  {a:>6}{row}")
    w = report["window"]
    lines.append(f"all {st['count']} step{'s' if st['count'] != 1 else ''}: {_bytes(w['bytes_within'])} within hosts, "
                 f"{_bytes(w['bytes_between'])} between hosts, {w['messages']:.0f} messages")
    if report["unmodeled"]:
        lines.append("not counted (no pattern for their algorithm): " +
                     ", ".join(f"{u['call']} ({u['algorithm']}) x{u['calls']}" for u in report["unmodeled"]))
    if report["unfinished"]:
        lines.append(f"{report['unfinished']} calls that did not complete are not counted")
    return "\n".join(lines)

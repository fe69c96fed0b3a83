"""The tuner's cost model cannot drift from the code: every modeled algorithm runs on real ranks
with its transport and board instrumented, and what it puts on the wire is compared with the
communication pattern the tuner (pycoll/tuner.py) charges for it.

What runs: one job per n over tcp runs every flat message-based algorithm of tuner.MODELED, the
host-ordered ring and the hierarchical algorithms on a made-up two-host Topology handed to them
(tcp carries every message; the algorithms only plan by the Topology), and the algorithms the
model leaves out (pairwise alltoall, linear gather/scatter, the dissemination barrier), which are
checked against closed formulas (the ones docs/algorithms.md gives). One job per n over shm runs
the board algorithms (one-shot, two-shot, cma). In the ranks, the transport's isend records
(src, dst, payload bytes, tag, comm id, call number) of every message, ShmBoard.exchange counts
every post and hands out slots that record which rank's bytes are read, and the reduction
functions (ops.combine in the Channel, reduce_into in the algorithms, the ufuncs of the board
algorithms) count the bytes they reduce.

The segment sizes are lowered in the ranks and in the model alike (RING_SEG, TREE_SEG instead of
PYCOLL_RING_SEGMENT = 4 MiB and tree.SEGMENT_BYTES = 1 MiB), so that sizes of a few hundred KiB
already cut ring blocks, halving-doubling steps, double-tree lanes and chain broadcasts into
several segments and the segment counts are checked too.

What the model claims, and what is checked (a Round is `msgs` latencies and `pairs` (src, dst,
bytes); see tuner.Round):

* bytes: for every ordered pair (src, dst), the payload bytes src sends dst over the whole call
  equal the sum over the rounds of that pair's bytes (the model splits blocks as real numbers,
  the code in whole elements: they may differ by less than one element per message).
* messages: every (src, dst) entry of a round stands for `msgs` messages from src to dst, except
  in the two pipelined single-round patterns, where `msgs` also holds the pipeline's fill: the
  chain broadcast (msgs = n - 2 + segments: `segments` per edge) and the double binary tree
  (msgs = 2 depth + 2 segments: `segments` per tree edge and direction). A pair listed twice in
  a round (double tree, 2 ranks: each is the other's parent in one tree) carries it twice.
  Bruck's allgather (n not a power of two) sends a window that wraps past rank n-1 as two
  messages: there `msgs` (2 from windows of 2 blocks on) is what the busiest rank sends, and each
  pair carries 1 to `msgs`. Known exception (ONE_MESSAGE_PER_STEP): recursive doubling allreduce
  and halving-doubling's reduce_scatter send each step as one message but are charged
  ceil(bytes / ring segment) latencies per step like halving-doubling allreduce's segments
  (deliberately: measured over tcp, one 64 MiB message costs like a segmented exchange, see
  doubling_pattern); for them the test checks one message per pair and step.
* reductions: `reduce` is what the busiest rank of the round reduces, and a rank reduces only in
  rounds where it receives: so each rank reduces at most the sum of `reduce` over the rounds it
  receives in, and the busiest rank exactly that.
* board rounds: `msgs` counts posts at BOARD_POST each (one post per rank in a one-shot call,
  two per stage block in two-shot); a one-shot pair (a, b, x) is rank b reading x bytes of rank
  a's slot. Two-shot's pairs, (2n - 1) / 2n * nbytes / (n - 1) between every two ranks, stand for
  its (2n - 1) / n copies of nbytes per rank (in: the stage posts of the others' shares; its own
  reduced share written into its slot; out: the others' reduced shares copied out of the slots):
  the test checks those copies, and that a rank reduces (n - 1) / n of nbytes out of the others' slots.
  cma's pairs stand for single kernel copies, a quarter of a message's bytes where the other end is
  the scratch block (allreduce: its share read from every peer and written back; reduce_scatter: the
  reads) and half where both ends are arrays (allgather: every peer's block; broadcast: the root's
  buffer): the test counts the bytes read and written.

Hierarchical algorithms: the test assembles their pattern from the phases Tuner._hierarchical
adds up (ring reduce-scatter/allgather or binomial reduce/broadcast within each host, the
cross-host phase the tuner picks, run once per local index), each phase on its own ranks; on
uneven hosts it uses each host's own size where the model takes the largest. Uneven hierarchical
allgather is left out: its model takes equal host bundles across hosts.

The default run covers n = 3, 4, 5 and two sizes (about 25-45 s here); the full sweep (n = 2..8,
four sizes) is marked slow.
"""
import collections
import os

import numpy as np
import pytest

from multiproc import run_ranks

RING_SEG, TREE_SEG = 64 << 10, 32 << 10
SMALL, MID, LARGE, HUGE = 1000, 10_007, 150_001, 400_003  # float32 elements per rank (the Communicator's S)
ITEM = 4
FLAT = {"allreduce": ["ring", "flat_ring", "recursive_doubling", "halving_doubling", "tree", "binomial"],
        "reduce_scatter": ["ring", "halving_doubling"],
        "allgather": ["ring", "recursive_doubling"],
        "broadcast": ["tree", "ring"],
        "reduce": ["tree"]}
BOARD = {"allreduce": ["oneshot", "twoshot", "cma"], "allgather": ["oneshot", "cma"], "broadcast": ["oneshot", "cma"],
         "reduce": ["oneshot"], "reduce_scatter": ["cma"]}
HIERARCHICAL = ["allreduce", "broadcast", "allgather"]
# one message per step, charged ceil(bytes / segment) latencies on purpose (see the module docstring)
ONE_MESSAGE_PER_STEP = {("allreduce", "recursive_doubling"), ("reduce_scatter", "halving_doubling")}


def _fake_hosts(n):
    """Ranks dealt round-robin over two hosts: uniform for even n, uneven for odd n."""
    return [r % 2 for r in range(n)]


def _cases(n, sizes, board):
    """(collective, algorithm, count, hosts or None, root) to run on n ranks."""
    cases = []
    if board:
        for count in sizes:
            for coll, algos in BOARD.items():
                for algo in algos:
                    if algo == "oneshot" and count * ITEM > 16 << 10:
                        continue  # no slot that big: the message-based fallback would run
                    cases.append((coll, algo, _count(coll, count, n), None, 0))
        return cases + [("barrier", "oneshot", 0, None, 0)]
    for count in sizes:
        for coll, algos in FLAT.items():
            for algo in algos:
                cases.append((coll, algo, _count(coll, count, n), None, 0))
                if coll in ("broadcast", "reduce"):
                    cases.append((coll, algo, count, None, n - 1))
        # the host-ordered ring over interleaved hosts: its ring order is not the rank order
        for coll in ("allreduce", "reduce_scatter", "allgather", "broadcast"):
            cases.append((coll, "ring", _count(coll, count, n), _fake_hosts(n), 0))
        for coll in HIERARCHICAL:
            if coll == "allgather" and n % 2:
                continue  # uneven hosts: the model's cross-host phase takes equal bundles (see _hierarchical)
            cases.append((coll, "hierarchical", count, _fake_hosts(n), 0))
    for count in sizes[:1]:
        cases += [("alltoall", "pairwise", count * n, None, 0), ("gather", "linear", count, None, 1),
                  ("scatter", "linear", count, None, 1), ("barrier", "dissemination", 0, None, 0)]
    return cases


def _count(coll, count, n):
    """The Communicator's reduce_scatter takes equal blocks: a multiple of n elements."""
    return count - count % n if coll == "reduce_scatter" else count


# -- rank side --------------------------------------------------------------------------------------
class _Slot(np.ndarray):
    """A board slot handed to an algorithm: slicing it records a read of that many bytes."""

    def __getitem__(self, idx):
        out = np.ndarray.__getitem__(self, idx)
        rec = getattr(self, "_rec", None)
        if rec is not None:
            rec["reads"].append((rec["phase"], self._src, out.nbytes))
            self._sliced = True
        return out.view(np.ndarray) if isinstance(out, np.ndarray) else out

    def __setitem__(self, idx, value):
        rec = getattr(self, "_rec", None)
        if rec is not None:
            rec["writes"] += np.asarray(value).nbytes
        np.ndarray.__setitem__(self, idx, value)


class _Slots(list):
    """The list board.exchange returns: fetching a slot marks it; one never sliced was read whole."""

    def __init__(self, arrays, rec):
        slots = []
        for k, a in enumerate(arrays):
            s = a.view(_Slot)
            s._rec, s._src, s._sliced, s._phase = None, k, False, rec["phase"]
            slots.append(s)
        super().__init__(slots)
        self._rec = rec

    def _fetch(self, s):
        if s._rec is None:
            s._rec = self._rec
            self._rec["fetched"].append(s)
        return s

    def __getitem__(self, i):
        got = list.__getitem__(self, i)
        return [self._fetch(s) for s in got] if isinstance(i, slice) else self._fetch(got)

    def __iter__(self):
        return (self._fetch(s) for s in list.__iter__(self))


def _instrument(comm, rec):
    """Record every message and board post of this rank, and count reduced bytes."""
    from pycoll import channel, ops
    from pycoll.algorithms import cma, halving_doubling, oneshot, recursive_doubling, tree, twoshot
    from pycoll.transports import shm_board
    from pycoll.transports.capabilities import PeerMemory

    tr = comm.transport
    real_isend = tr.isend

    def isend(view, peer, key, dtype=0):
        rec["sends"].append((tr.rank, peer, view.nbytes, key.tag, key.comm_id, key.seq))
        return real_isend(view, peer, key, dtype)
    tr.isend = isend

    real_exchange = shm_board.ShmBoard.exchange

    def exchange(self, data, sig, order, timeout, what, stage=False, hole=(0, 0)):
        rec["posts"].append((rec["phase"], data.nbytes - (hole[1] - hole[0]) * data.itemsize, stage))
        arrays = real_exchange(self, data, sig, order, timeout, what, stage, hole)
        rec["phase"] += 1
        return _Slots(arrays, rec)
    shm_board.ShmBoard.exchange = exchange

    def counted_combine(op, a, b, out):
        rec["reduced"] += b.nbytes
        ops.combine(op, a, b, out)

    def counted_reduce_into(op, acc, other):
        rec["reduced"] += other.nbytes
        ops.reduce_into(op, acc, other)

    def counted_ufunc(op, dtype):
        fn = ops.ufunc(op, dtype)

        def call(a, b, out):
            rec["reduced"] += b.nbytes
            return fn(a, b, out=out)
        return call
    channel.combine = counted_combine
    for module in (recursive_doubling, halving_doubling, tree):
        module.reduce_into = counted_reduce_into
    oneshot.ufunc = twoshot.ufunc = cma.ufunc = counted_ufunc

    memory = tr.offers(PeerMemory)
    if memory is not None and memory.reaches(comm.group):  # (probed before the counting starts)
        real_read, real_write = memory.read, memory.write

        def read(peer, address, into):
            rec["cma"][0] += into.nbytes
            real_read(peer, address, into)

        def write(peer, address, data):
            rec["cma"][1] += data.nbytes
            real_write(peer, address, data)
        memory.read, memory.write = read, write


def _run_case(comm, case, selector):
    from pycoll.ops import ReduceOp
    from pycoll.topology import Topology

    coll, algo, count, hosts, root = case
    n, r = comm.size, comm.rank
    topo = Topology.from_hosts(hosts if hosts else [0] * n)
    x = np.arange(count, dtype=np.float32) % 7 + r
    ch = comm.channel(coll)
    if coll == "barrier":
        from pycoll.selection import resolve
        resolve(coll, algo)(ch)
        return
    fn = selector.bind(coll, algo, topo)
    if coll == "allreduce":
        fn(ch, x, ReduceOp.SUM)
    elif coll == "reduce_scatter":
        fn(ch, x, np.empty(count // n, np.float32), ReduceOp.SUM, None)
    elif coll == "allgather":
        fn(ch, x, np.empty(count * n, np.float32), None)
    elif coll == "broadcast":
        fn(ch, x, root)
    elif coll == "reduce":
        fn(ch, x, ReduceOp.SUM, root)
    elif coll == "alltoall":
        fn(ch, x, np.empty_like(x))
    elif coll == "gather":
        fn(ch, x, np.empty(count * n, np.float32) if r == root else None, root)
    elif coll == "scatter":
        fn(ch, np.zeros(count * n, np.float32) if r == root else None, x, root)


def _measure(comm, cases, ring_seg, tree_seg):
    """Rank side: run every case on a fresh call of `comm`; per case what this rank sent, posted,
    read out of others' board slots, and reduced."""
    from pycoll import tuner
    from pycoll.algorithms import ring, tree
    from pycoll.selection import Selector
    from pycoll.transports.shm_board import SLOT_BYTES, STAGE_BYTES

    assert ring.segment_bytes() == ring_seg  # PYCOLL_RING_SEGMENT, set for the ranks by _sweep
    tree.SEGMENT_BYTES = tuner.TREE_SEGMENT = tree_seg  # tuner's copy: the hierarchical phases' choice
    selector = Selector("", tuner.Tuner(tuner.DEFAULT, SLOT_BYTES, STAGE_BYTES))
    rec = {"sends": [], "posts": [], "reads": [], "fetched": [], "reduced": 0, "phase": 0, "writes": 0,
           "cma": [0, 0]}
    _instrument(comm, rec)
    out = []
    for case in cases:
        rec.update(sends=[], posts=[], reads=[], fetched=[], reduced=0, phase=0, writes=0, cma=[0, 0])
        _run_case(comm, case, selector)
        reads = [(phase, src, nbytes) for phase, src, nbytes in rec["reads"]]
        reads += [(s._phase, s._src, s.nbytes) for s in rec["fetched"] if not s._sliced]
        out.append({"sends": rec["sends"], "posts": rec["posts"], "reads": reads, "reduced": rec["reduced"],
                    "writes": rec["writes"], "cma": rec["cma"]})
    return out


# -- the model's side -------------------------------------------------------------------------------
class Expect:
    """What the model says one call moves: bytes and messages per ordered pair, the busiest rank's
    reduced bytes, and board posts per rank."""

    def __init__(self):
        self.bytes = collections.Counter()
        self.msgs = collections.Counter()     # messages per pair: at least
        self.msgs_hi = collections.Counter()  # ... and at most
        self.busiest = []                     # (pairs, msgs): some pair of the round carries msgs
        self.reduce = collections.Counter()  # per rank: the `reduce` of the rounds it receives in
        self.posts = 0.0

    def add(self, coll, algo, rounds, ranks):
        """The rounds of one (collective, algorithm) on `ranks` (pattern rank i is ranks[i])."""
        from pycoll.tuner import BOARD_POST
        g, n = ranks.__getitem__, len(ranks)
        for rnd in rounds:
            if algo in ("oneshot", "twoshot", "cma"):
                self.posts += rnd.msgs / BOARD_POST
                per_pair = 0
            elif (coll, algo) == ("broadcast", "ring"):
                per_pair = rnd.msgs - (n - 2)  # the chain's fill, then one message per segment per edge
            elif (coll, algo) == ("allreduce", "tree"):
                per_pair = (rnd.msgs - 2 * max(1, (n - 1).bit_length())) / 2  # fill up and down
            elif (coll, algo) in ONE_MESSAGE_PER_STEP:
                per_pair = 1
            else:
                per_pair = rnd.msgs
            bruck = (coll, algo) == ("allgather", "recursive_doubling") and n & (n - 1)
            for a, b, x in rnd.pairs:
                self.bytes[g(a), g(b)] += x
                self.msgs[g(a), g(b)] += 1 if bruck else per_pair
                self.msgs_hi[g(a), g(b)] += per_pair
            if bruck:  # a window that wraps goes as two messages: msgs is the most a rank sends
                self.busiest.append(([(g(a), g(b)) for a, b, _ in rnd.pairs], rnd.msgs))
            for rank in {g(b) for _, b, _ in rnd.pairs}:
                self.reduce[rank] += rnd.reduce


def _tuner():
    from pycoll import tuner
    from pycoll.transports.shm_board import SLOT_BYTES, STAGE_BYTES
    return tuner.Tuner(tuner.DEFAULT, SLOT_BYTES, STAGE_BYTES)


def _flat(coll, algo, nbytes, n, hosts, root):
    from pycoll.topology import Topology
    from pycoll.tuner import binomial_pattern, ring_pattern
    topo = Topology.from_hosts(hosts if hosts else [0] * n)
    e = Expect()
    if root and (coll, algo) == ("broadcast", "ring"):
        rounds = ring_pattern(coll, nbytes, topo.ring_order(), root)
    elif root and algo == "tree":
        rounds = binomial_pattern(coll, nbytes, n, root)
    else:
        rounds = _tuner().pattern(coll, algo, nbytes, topo)
    e.add(coll, algo, rounds, list(range(n)))
    return e


def _hierarchical(coll, nbytes, hosts):
    """The phases Tuner._hierarchical adds up, each as its own pattern on the ranks that run it."""
    from pycoll.topology import Topology
    from pycoll.tuner import Round, binomial_pattern, ring_pattern
    t = _tuner()
    topo = Topology.from_hosts(hosts)
    members, H = topo.members, topo.nhosts
    cross_topo = Topology.from_hosts(range(H))
    e = Expect()
    def phase(c, algo, rounds, ranks):
        sub = Expect()
        sub.add(c, algo, rounds, ranks)
        for mine, theirs in ((e.bytes, sub.bytes), (e.msgs, sub.msgs), (e.msgs_hi, sub.msgs_hi),
                             (e.reduce, sub.reduce)):
            mine.update(theirs)

    if topo.uniform:
        L = topo.per_host
        shard = nbytes / L
        best = t.best_phase(coll, shard, cross_topo, L)[0]
        for j in range(L):
            cross = [m[j] for m in members]
            phase(coll, best, t.pattern(coll, best, shard, cross_topo), cross)
        for m in members:
            if coll == "allreduce":
                phase("reduce_scatter", "ring", ring_pattern("reduce_scatter", nbytes, range(L)), m)
            if coll == "broadcast" and 0 in m:
                phase("scatter", "linear", [Round(1, [(0, k, shard) for k in range(1, L)])], m)
            phase("allgather", "ring", ring_pattern("allgather", nbytes, range(L)), m)
    else:
        leaders = [m[0] for m in members]
        best = t.best_phase(coll, nbytes, cross_topo, 1)[0]
        phase(coll, best, t.pattern(coll, best, nbytes, cross_topo), leaders)
        for m in members:
            if coll == "allreduce":
                phase("reduce", "tree", binomial_pattern("reduce", nbytes, len(m)), m)
            phase("broadcast", "tree", binomial_pattern("broadcast", nbytes, len(m)), m)
    return e, best


def _formula(coll, algo, count, n, root):
    """The algorithms the tuner does not model, by the formulas of docs/algorithms.md."""
    e = Expect()
    if coll == "alltoall":  # n-1 steps, a block of S/n to every other rank
        for a in range(n):
            for b in range(n):
                if a != b:
                    e.bytes[a, b], e.msgs[a, b] = count * ITEM / n, 1
    elif coll in ("gather", "scatter"):  # one message of S per rank to (from) the root
        for k in range(n):
            if k != root:
                pair = (k, root) if coll == "gather" else (root, k)
                e.bytes[pair], e.msgs[pair] = count * ITEM, 1
    elif algo == "dissemination":  # round k: r signals r + 2^k with one byte
        dist = 1
        while dist < n:
            for a in range(n):
                e.bytes[a, (a + dist) % n] += 1
                e.msgs[a, (a + dist) % n] += 1
            dist *= 2
    else:  # one-shot barrier: one empty post per rank
        e.posts = 1
    return e


def _nbytes(coll, count, n):
    """What the Communicator passes the tuner: the output of an allgather, else the input."""
    return count * ITEM * (n if coll == "allgather" else 1)


# -- comparison -------------------------------------------------------------------------------------
def _compare(n, case, got_per_rank):
    """Mismatches between what the ranks did and what the model says, as strings."""
    coll, algo, count, hosts, root = case
    nbytes = _nbytes(coll, count, n)
    label = f"n={n} {coll}/{algo} S={nbytes}" + (f" hosts={hosts}" if hosts else "") + (f" root={root}" if root else "")
    if algo == "hierarchical":
        want, best = _hierarchical(coll, nbytes, hosts)
        label += f" (cross-host phase: {best})"
    elif coll in ("alltoall", "gather", "scatter", "barrier"):
        want = _formula(coll, algo, count, n, root)
    else:
        want = _flat(coll, algo, nbytes, n, hosts, root)
    sent_bytes, sent_msgs = collections.Counter(), collections.Counter()
    for got in got_per_rank:
        for src, dst, nb, *_ in got["sends"]:
            sent_bytes[src, dst] += nb
            sent_msgs[src, dst] += 1
    bad = []
    for pair in sorted(set(want.bytes) | set(sent_bytes) | set(want.msgs)):
        if algo in ("oneshot", "twoshot", "cma"):
            continue
        w_b, g_b, w_m, g_m = want.bytes[pair], sent_bytes[pair], want.msgs[pair], sent_msgs[pair]
        hi = max(w_m, want.msgs_hi[pair])
        if abs(w_b - g_b) >= ITEM * max(1, g_m):
            bad.append(f"{label}: {pair[0]}->{pair[1]} carries {g_b} bytes, the model says {w_b:.0f}")
        if not w_m <= g_m <= hi:
            says = f"{w_m:g}" if w_m == hi else f"{w_m:g} to {hi:g}"
            bad.append(f"{label}: {pair[0]}->{pair[1]} carries {g_m} messages, the model says {says}")
    for pairs, msgs in want.busiest:  # each of these pairs is in one round only
        if max(sent_msgs[p] for p in pairs) != msgs:
            bad.append(f"{label}: a round of {msgs} messages has at most {max(sent_msgs[p] for p in pairs)} on a pair")
    reduced = [g["reduced"] for g in got_per_rank]
    model = [want.reduce[r] for r in range(n)]
    slack = ITEM * n * (1 + max(len(g["sends"]) + len(g["posts"]) for g in got_per_rank))
    if any(t > u + slack for t, u in zip(reduced, model)) or abs(max(reduced) - max(model)) > slack:
        bad.append(f"{label}: the ranks reduce {reduced} bytes, the model says at most {[f'{u:.0f}' for u in model]}")
    if algo in ("oneshot", "twoshot", "cma"):
        bad += _compare_board(label, n, coll, algo, nbytes, want, got_per_rank)
    return bad


def _compare_board(label, n, coll, algo, nbytes, want, got_per_rank):
    bad = []
    for r, got in enumerate(got_per_rank):
        if got["sends"]:
            bad.append(f"{label}: rank {r} sent {len(got['sends'])} messages on a board algorithm")
        if len(got["posts"]) != want.posts:
            bad.append(f"{label}: rank {r} posted {len(got['posts'])} times, the model says {want.posts:g}")
        if algo == "oneshot":  # pair (a, b, x): b reads x bytes of a's slot
            for a in range(n):
                if a != r:
                    read = sum(nb for _, src, nb in got["reads"] if src == a)
                    if read != want.bytes[a, r]:
                        bad.append(f"{label}: rank {r} reads {read} bytes of rank {a}'s slot, "
                                   f"the model says {want.bytes[a, r]:.0f}")
        elif algo == "cma":  # single copies: a quarter of a message through the scratch block, else half
            read, written = got["cma"]
            arriving = sum(want.bytes[a, r] for a in range(n) if a != r)
            share = 4 if coll in ("allreduce", "reduce_scatter") else 2
            if coll != "allreduce" and written or coll == "allreduce" and read != written \
                    or abs(read + written - share * arriving) > 2 * ITEM * n:  # (shares: +-1 element)
                bad.append(f"{label}: rank {r} reads {read} bytes of its peers and writes {written}, the model's "
                           f"pairs bring it {arriving:.0f} (1/{share} of the bytes copied)")
        else:  # in: the others' shares (stage posts), its own reduced share written into its slot; out:
            # the others' shares, read after each block's second post; together (2n-1)/n of nbytes
            copied_in = sum(nb for _, nb, stage in got["posts"] if stage)
            copied_out = sum(nb for phase, _, nb in got["reads"] if phase % 2 == 0)
            arriving = sum(want.bytes[a, r] for a in range(n) if a != r)
            copies = copied_in + got["writes"] + copied_out
            if copied_in != copied_out or copied_in + got["writes"] != nbytes \
                    or abs(copies - 2 * arriving) > ITEM * len(got["posts"]):
                bad.append(f"{label}: rank {r} copies {copied_in} bytes in, writes {got['writes']} of its own "
                           f"and copies {copied_out} out, the model's pairs bring it {arriving:.0f} (half the "
                           f"copies of {nbytes}: (2n-1)/2n of it)")
    return bad


def _sweep(ns, sizes):
    from pycoll import tuner
    from pycoll.algorithms import tree
    saved = tree.SEGMENT_BYTES, tuner.TREE_SEGMENT, os.environ.get("PYCOLL_RING_SEGMENT")
    tree.SEGMENT_BYTES = tuner.TREE_SEGMENT = TREE_SEG
    os.environ["PYCOLL_RING_SEGMENT"] = str(RING_SEG)  # the model here and the algorithms in the ranks
    bad = []
    try:
        for n in ns:
            for board, transport in ((False, "tcp"), (True, "shm")):
                cases = _cases(n, sizes, board)
                got = run_ranks(_measure, n, cases, RING_SEG, TREE_SEG, timeout=120,
                                env={"PYCOLL_TRANSPORT": transport, "PYCOLL_TUNER": "static"})
                for i, case in enumerate(cases):
                    bad += _compare(n, case, [g[i] for g in got])
    finally:
        tree.SEGMENT_BYTES, tuner.TREE_SEGMENT, ring_env = saved
        if ring_env is None:
            del os.environ["PYCOLL_RING_SEGMENT"]
        else:
            os.environ["PYCOLL_RING_SEGMENT"] = ring_env
    return bad


@pytest.mark.timeout(300)
def test_model_matches_the_wire():
    bad = _sweep([3, 4, 5], [SMALL, LARGE])
    assert not bad, f"{len(bad)} mismatches:\n" + "\n".join(bad)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_model_matches_the_wire_full_sweep():
    bad = _sweep(range(2, 9), [SMALL, MID, LARGE, HUGE])
    assert not bad, f"{len(bad)} mismatches:\n" + "\n".join(bad)

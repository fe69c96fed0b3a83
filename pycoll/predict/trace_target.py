"""What-if for a traced job: the same programs (trace_replay.py) on another cluster.

A target is where each of the trace's ranks runs (hosts: --hosts x --ppn packed or scattered, a
placement file, or a topology file's hosts), the links (--link-gbit, --link-latency-us, a topology
file's links, racks and uplinks) and the cores per host (--cores, --shared-cores). Each call is
repriced where its group's placement or link changes, by the difference the model makes:

    duration on the target = recorded duration + price(target) - price(recorded)

so what the recording measured beyond the model (Python, wake-ups, a loaded machine) stays, and
what the topology changes is added: a collective priced by the tuner (Tuner.call_time) for the
algorithm the selector would run on the target group (the recorded one where the group's hosts do
not change; a board algorithm cannot run across hosts, so a TP group that moves across hosts
runs and pays for a network algorithm), the algorithms the tuner has no formula for (pairwise
alltoall(v), linear gather/scatter, the barrier's) from their bytes per pair (trace/traffic.py)
as one round of the tuner's round_time, and a point-to-point message as one message on its
pair's link (alpha + bytes x beta). The recorded side is priced with the tuner's default links
(or a --topo-file's "links"): a trace recorded on one host needs no net link. Compute is scaled
per rank by its core sharing (ranks per core on its host, or over all ranks with --shared-cores)
against the recording's (ranks per core on the machine each rank ran on).

Both sides price a call with the crowding of every rank of the job that shares its cores, not of
the call's group alone (ClusterSpec.priced, .crowding): the tuner's per-round copies and its
per-call and per-message charges for ranks beyond the cores (CALL_OVERHEAD x crowd**2, WAKE) then
see that hosts emulated on one machine (--shared-cores) stay as crowded on the target as in the
recording, and that a TP pair among 8 ranks on 2 cores waits for cores like the 8.

A call's price counts the message latency of every round that crosses hosts, as the tuner charges
it, which is what it costs when all members come in together. When they come in one by one, as in a
replay, the others' messages have gone ahead and a member waits only for the crossings on the way
from the last member's data to it (recursive doubling over 3 hosts x 2: one from a rank of the third
host, two from the others): per last member and member, the latency spared (Pricer.relief) rides on
the costs (Costs.relief) and the replay takes it off the member's end when that member was last.

A link behind a token bucket (a topology file's links.net.burst_kib: tc's tbf, a cloud's traffic
shaper) passes up to the bucket's bytes at once and holds its rate only on average: the replay is
run, each call takes the tokens its links hold when it starts (bucket_scales), the calls that
found some are repriced with the slower part of their bytes only, and the replay runs again.
"""
from __future__ import annotations

import json
import math
import os
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..selection import NAMED_ONLY
from ..topology import RankInfo, Topology, load_topo_file, rack_of_rank
from ..trace import traffic
from ..trace.analysis import TraceError
from ..transports.shm_board import SLOT_BYTES, STAGE_BYTES
from ..tuner import CALL_OVERHEAD, DEFAULT, MODELED, WAKE, Link, Params, Round, Tuner, round_time
from .trace_replay import Costs, Instance, Key, Timeline, Trace, recorded_costs, simulate


@dataclass
class ClusterSpec:
    """A cluster: each global rank's host index, cores per host, racks (per host, "" none) and their
    uplinks, the tuner's parameters, `shared_cores` (> 0: every rank shares that many cores) and
    `burst`: bytes each host's link passes at once when its token bucket is full (a rate limiter
    such as tc's tbf or a cloud's traffic shaper: the rate holds on average, not for a burst; 0: a
    link of constant rate)."""

    host_of: List[int]
    cores: List[int]
    params: Params
    racks: List[str]
    uplink_gbit: Dict[str, float]
    shared_cores: int = 0
    burst: float = 0.0

    def topology(self, group: Sequence[int], cores: Optional[Dict[int, float]] = None) -> Topology:
        """The Topology of a communicator of global ranks `group` on this cluster (`cores`: per host
        index, in place of the cores its ranks report)."""
        infos = []
        for g in group:
            h = self.host_of[g]
            rack = self.racks[h] if h < len(self.racks) else ""
            n = cores[h] if cores is not None else self.cores[h] if h < len(self.cores) else 0
            infos.append(RankInfo(host=str(h), cores=n, rack=rack,  # type: ignore[arg-type]
                                  uplink_gbit=float(self.uplink_gbit.get(rack, 0.0)) if rack else 0.0))
        return Topology(infos)

    def sharing(self, rank: int) -> float:
        """Ranks per core where `rank` runs (at least 1)."""
        ranks, cores = self._pool(self.host_of[rank])
        return max(1.0, ranks / cores) if cores else 1.0

    def _pool(self, host: int) -> Tuple[int, float]:
        """(the job's ranks, cores) of the CPUs host `host`'s ranks run on: all ranks on the shared
        cores, else the host's ranks on its own (0 cores: unknown)."""
        if self.shared_cores > 0:
            return len(self.host_of), float(self.shared_cores)
        return self.host_of.count(host), float(self.cores[host] if host < len(self.cores) else 0)

    def crowding(self, group: Sequence[int]) -> Tuple[float, float]:
        """(ranks per core, ranks beyond the cores) where `group`'s most crowded member runs, counting
        every rank of the job that shares its cores, not only the group's: a TP pair among 8 ranks on
        2 cores computes and wakes up in turn with all 8 (the tuner's crowd and excess)."""
        pools = [self._pool(self.host_of[g]) for g in group]
        crowd = max([1.0] + [k / c for k, c in pools if c])
        return crowd, max([0.0] + [k - c for k, c in pools if 0 < c < k])

    def priced(self, group: Sequence[int]) -> Topology:
        """`group`'s Topology for pricing: each host's cores are the share of its CPUs that the
        group's ranks there get when every rank of the job sharing them runs (cores x the group's
        ranks there / the job's ranks on those cores; fractional), so the tuner's per-round
        crowding counts the whole job. (topology() keeps the cores a rank reports: the selector's view.)"""
        on = Counter(self.host_of[g] for g in group)
        share: Dict[int, float] = {}
        for h, k in on.items():
            ranks, cores = self._pool(h)
            share[h] = cores * k / ranks if cores else 0.0
        return self.topology(group, share)


def base_params(topo_file: Optional[Dict[str, Any]] = None) -> Params:
    """The tuner's default parameters, with the links a topology file declares."""
    params = DEFAULT
    if topo_file and "links" in topo_file:
        from ..calibration import file_links
        links = file_links(topo_file)
        params = replace(params, shm=links.get("shm", params.shm), net=links.get("net", params.net))
    return params


def recorded_cluster(trace: Trace, params: Optional[Params] = None) -> ClusterSpec:
    """The cluster the trace ran on: its ranks' hosts as the dumps name them, each with this
    machine's cores (the dumps do not say how many the recording's had); ranks that ran on one
    machine (hosts emulated in network namespaces) share its cores."""
    index: Dict[str, int] = {}
    host_of = [index.setdefault(trace.host_of[r], len(index)) for r in trace.ranks]
    n = os.cpu_count() or 1
    machines = {trace.machine_of.get(r, trace.host_of[r]) for r in trace.ranks}
    shared = n if len(index) > 1 and len(machines) == 1 else 0
    return ClusterSpec(host_of, [n] * len(index), params or base_params(), [""] * len(index), {}, shared)


def target_cluster(trace: Trace, *, hosts: Optional[int] = None, ppn: Optional[int] = None,
                   placement: str = "packed", topo_file: Optional[str] = None, link_gbit: Optional[float] = None,
                   link_latency_us: Optional[float] = None, shared_cores: int = 0,
                   cores: Optional[int] = None) -> ClusterSpec:
    """The target the options describe for the trace's ranks; ValueError naming the mismatch when
    a placement does not hold exactly the trace's ranks."""
    n = len(trace.ranks)
    spec: Dict[str, Any] = load_topo_file(topo_file) if topo_file else {}
    params = base_params(spec)
    if link_gbit is not None or link_latency_us is not None:
        if (link_gbit is not None and link_gbit <= 0) or (link_latency_us is not None and link_latency_us < 0):
            raise ValueError(f"--link-gbit must be > 0 and --link-latency-us >= 0 (got {link_gbit}, {link_latency_us})")
        params = replace(params, net=Link(params.net.alpha if link_latency_us is None else link_latency_us * 1e-6,
                                          params.net.beta if link_gbit is None else 8e-9 / link_gbit))
    recorded = recorded_cluster(trace, params)
    if spec.get("hosts"):
        placed = sorted(r for ranks in spec["hosts"].values() for r in ranks)
        if placed != list(range(n)):
            raise ValueError(f"{topo_file}: its hosts hold ranks {placed}, the trace has ranks 0-{n - 1}: a target "
                             "must place each of the trace's ranks once")
        host_of = [0] * n
        for h, name in enumerate(spec["hosts"]):
            for r in spec["hosts"][name]:
                host_of[r] = h
    elif hosts is not None or ppn is not None:
        if (hosts is None and n % ppn) or (ppn is None and n % hosts) or \
                (hosts is not None and ppn is not None and hosts * ppn != n):
            given = " x ".join(f"--{k} {v}" for k, v in (("hosts", hosts), ("ppn", ppn)) if v is not None)
            raise ValueError(f"the target does not fit the trace's {n} ranks: {given} cannot place them "
                             f"(a trace predicts the job it recorded: hosts x ppn must be {n})")
        hosts = hosts if hosts is not None else n // ppn
        ppn = ppn if ppn is not None else n // hosts
        if placement in ("packed", "scattered", "interleaved"):
            host_of = [r // ppn if placement == "packed" else r % hosts for r in range(n)]
        else:
            host_of = _placement_file(placement, n)
    elif placement not in ("packed", "scattered", "interleaved"):
        host_of = _placement_file(placement, n)
    else:
        host_of = list(recorded.host_of)
    nhosts = max(host_of) + 1
    per_host = [cores or (recorded.cores[0] if recorded.cores else 0)] * nhosts
    for r, over in spec.get("ranks", {}).items():
        if "cores" in over and int(r) < n:
            per_host[host_of[int(r)]] = int(over["cores"])
    racks, uplink = [""] * nhosts, {}
    for r, h in enumerate(host_of):  # a host is in the rack of its first rank
        if not racks[h] and spec:
            racks[h], gbit = rack_of_rank(spec, r)
            uplink[racks[h]] = gbit
    burst = float((spec.get("links", {}).get("net") or {}).get("burst_kib", 0.0)) * 1024
    if burst < 0:
        raise ValueError(f"{topo_file}: links.net.burst_kib must be >= 0, got {burst / 1024:g}")
    return ClusterSpec(host_of, per_host, params, racks, uplink, shared_cores, burst)


def _placement_file(path: str, n: int) -> List[int]:
    try:
        with open(path) as fh:
            host_of = [int(h) for h in json.load(fh)]
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"--placement {path}: not a JSON list of host indices ({e}); or use packed / scattered") \
            from None
    if len(host_of) != n or min(host_of) < 0:
        raise ValueError(f"--placement {path} places {len(host_of)} ranks, the trace has {n}: a target must place "
                         "each of the trace's ranks once (host indices from 0)")
    return host_of


# -- pricing ----------------------------------------------------------------------------------------
class Pricer:
    """Prices one call on a cluster (seconds as its caller sees it); None where nothing models it."""

    def __init__(self, trace: Trace, cluster: ClusterSpec) -> None:
        self.trace, self.cluster = trace, cluster
        self.cache: Dict[Tuple, Tuple[Optional[float], Optional[str]]] = {}

    def collective(self, inst: Instance, algo: Optional[str], net_scale: float = 1.0
                   ) -> Tuple[Optional[float], Optional[str]]:
        """(seconds, algorithm) of collective `inst` on this cluster: `algo`, or where None the
        tuner's pick for the group's placement; `net_scale` x the net link's seconds per byte (a
        call that finds tokens in its links' buckets: bucket_scales)."""
        comm = self.trace.comms[inst.comm]
        topo = self.cluster.topology(comm["group"])
        e = next(iter(inst.entries.values()))
        coll = traffic.BASE.get(inst.call, inst.call)
        counts = tuple(tuple(x.get("send_counts") or ()) for x in inst.entries.values()) \
            if inst.call == "alltoallv" else ()
        key = (inst.comm, inst.call, inst.nbytes, algo, e.get("root"), topo.layout, counts, net_scale)
        if key in self.cache:
            return self.cache[key]
        if algo is None and net_scale != 1.0:  # the selector knows the link's rate, not its bucket
            algo = self.collective(inst, None)[1]
        one_host = topo.nhosts == 1
        board = comm.get("board") or [SLOT_BYTES, STAGE_BYTES, True]
        params = self._params(net_scale)
        tuner = Tuner(params, int(board[0]) if one_host else 0, int(board[1]) if one_host else 0,
                      bool(board[2]) if one_host else False)
        if algo is None and coll in MODELED:
            ranked = tuner.rank(coll, inst.nbytes, topo, [a for a in MODELED[coll] if a not in NAMED_ONLY])
            algo = ranked[0][1]
        elif algo is None:  # (no formula: the recorded algorithm, or its fallback where no board reaches)
            algo = _ran(self.trace, inst) if one_host else traffic.ran(
                inst.call, e.get("algorithm") or "", 0, e.get("itemsize") or 0, len(inst.members), (0, 0, False))
        priced = self.cluster.priced(comm["group"])
        if coll in MODELED and (algo in MODELED[coll] or algo == "hierarchical"):
            t = tuner.predict(coll, algo, inst.nbytes, priced)
            if priced.size > 1:
                t += self._overhead(comm["group"], tuner.messages(coll, algo, inst.nbytes, priced))
            out = (t if math.isfinite(t) else None, algo)
        else:
            out = (self._pairs_time(inst, algo, priced, params), algo)
        self.cache[key] = out
        return out

    def relief(self, inst: Instance, algo: str) -> Dict[int, Dict[int, float]]:
        """Costs.relief of collective `inst` run by flat algorithm `algo` on this cluster: per member
        that arrives last, per member, the net latency it is spared. The tuner charges each round
        that crosses hosts its message latencies whoever arrives last; but with the others in
        early, a round waits only on messages that carry the last member's data, so the latency
        a member pays is the longest chain of crossing hops from the last member to it through the
        algorithm's rounds (recursive doubling over 3 hosts x 2: one hop from a rank of the third
        host, two from the others)."""
        key = ("relief", inst.comm, inst.call, inst.nbytes, algo)  # (calls alike are spared alike)
        if key not in self.cache:
            self.cache[key] = self._relief(inst, algo)  # type: ignore[assignment]
        return self.cache[key]  # type: ignore[return-value]

    def _relief(self, inst: Instance, algo: str) -> Dict[int, Dict[int, float]]:
        group = self.trace.comms[inst.comm]["group"]
        topo = self.cluster.topology(group)
        coll = traffic.BASE.get(inst.call, inst.call)
        if topo.nhosts == 1 or algo not in MODELED.get(coll, ()):  # (hierarchical: phases, not rounds)
            return {}
        try:
            rounds = Tuner(self.cluster.params, 0, 0, False).pattern(coll, algo, inst.nbytes, topo)
        except ValueError:
            return {}
        host, alpha = topo.host_of, self.cluster.params.net.alpha
        cost = [r.msgs * alpha if any(host[a] != host[b] for a, b, _ in r.pairs) else 0.0 for r in rounds]
        charged = sum(cost)
        if not charged:
            return {}
        out: Dict[int, Dict[int, float]] = {}
        for last in range(len(group)):
            t = [-math.inf] * len(group)
            t[last] = 0.0
            for r, c in zip(rounds, cost):
                now = list(t)
                for a, b, _ in r.pairs:
                    if t[a] > -math.inf:
                        now[b] = max(now[b], t[a] + (c if host[a] != host[b] else 0.0))
                t = now
            spared = {group[m]: charged - t[m] for m in range(len(group)) if t[m] > -math.inf and charged - t[m] > 0}
            if spared:
                out[group[last]] = spared
        return out

    def _params(self, net_scale: float) -> Params:
        params = self.cluster.params
        return params if net_scale == 1.0 else replace(params, net=Link(params.net.alpha, params.net.beta * net_scale))

    def _overhead(self, group: Sequence[int], messages: float) -> float:
        """What a call costs beyond its messages' transfers, as Tuner.call_time charges it
        (CALL_OVERHEAD x crowd**2, and a scheduling turn per rank beyond the cores for each message
        latency), with the crowding of every rank of the job that shares the group's cores
        (ClusterSpec.crowding): hosts emulated on one machine crowd their cores alike wherever
        the job's ranks are placed."""
        crowd, extra = self.cluster.crowding(group)
        return CALL_OVERHEAD * crowd * crowd + WAKE * extra * messages

    def _pairs_time(self, inst: Instance, algo: Optional[str], topo: Topology, params: Params) -> Optional[float]:
        """An algorithm without a tuner formula: its bytes per pair (every member's sends, as the
        traffic report counts them) as one round of messages."""
        comm = self.trace.comms[inst.comm]
        group = comm["group"]
        tc = traffic._Comm(list(group), [topo.hosts[h] for h in topo.host_of], None, comm.get("board"))
        tc.topo = topo
        pairs: Dict[Tuple[int, int], List[float]] = {}
        for m in inst.members:
            e = dict(inst.entries[m], algorithm=algo)
            sent = traffic._sent(e, tc, group.index(m), {})
            if sent is None:
                return None
            traffic._add(pairs, sent)
        if not pairs:
            return self._overhead(group, 0.0)
        per_rank: Dict[int, float] = {}
        for (a, _), (_, msgs) in pairs.items():
            per_rank[a] = per_rank.get(a, 0.0) + msgs
        rnd = Round(max(per_rank.values()), [(a, b, x) for (a, b), (x, _) in pairs.items()])
        return round_time(rnd, topo.host_of, params, 1, topo.cores, topo.uplinks) + \
            self._overhead(group, rnd.msgs)

    def message(self, inst: Instance, net_scale: float = 1.0) -> float:
        """One point-to-point message on its pair's link, and its receiver's scheduling turns where
        ranks outnumber the cores (Tuner.call_time's WAKE)."""
        a, b = inst.members
        same = self.cluster.host_of[a] == self.cluster.host_of[b]
        link = self.cluster.params.shm if same else self._params(net_scale).net
        return link.alpha + inst.nbytes * link.beta + WAKE * self.cluster.crowding([a, b])[1]


def retarget(trace: Trace, target: ClusterSpec, recorded: ClusterSpec,
             net_scale: Optional[Dict[Key, float]] = None) -> Tuple[Costs, Dict[str, Any]]:
    """The trace's costs on `target` (see the module docstring), and what was repriced: {"repriced",
    "kept", "unmodeled": {call (algorithm): calls}, "algorithms": {"call: recorded -> target": calls}}.
    `net_scale`: per instance, the factor on the target link's seconds per byte (bucket_scales)."""
    costs = recorded_costs(trace)
    was, will = Pricer(trace, recorded), Pricer(trace, target)
    scale = net_scale or {}
    info: Dict[str, Any] = {"repriced": 0, "kept": 0, "unmodeled": {}, "algorithms": {}}
    for key, inst in trace.instances.items():
        if inst.kind == "p2p":
            if _same(trace, inst.members, recorded, target):
                info["kept"] += 1
                continue
            delta = will.message(inst, scale.get(key, 1.0)) - was.message(inst)
        else:
            group = trace.comms[inst.comm]["group"]
            ran = _ran(trace, inst)
            if _same(trace, group, recorded, target):
                info["kept"] += 1
                continue
            before, _ = was.collective(inst, ran)
            moved = not _same_hosts(group, recorded, target)
            after, algo = will.collective(inst, None if moved else ran)
            if key in scale and after is not None:
                after, _ = will.collective(inst, algo, scale[key])
            if before is None or after is None:
                label = f"{inst.call} ({ran})"
                info["unmodeled"][label] = info["unmodeled"].get(label, 0) + 1
                continue
            delta = after - before
            if moved and algo is not None:
                relief = will.relief(inst, algo)
                if relief:
                    costs.relief[key] = relief
            label = f"{inst.call}: {ran} -> {algo}"
            info["algorithms"][label] = info["algorithms"].get(label, 0) + 1
        info["repriced"] += 1
        times = costs.times[key]
        for m, (h, a, o) in list(times.items()):
            times[m] = (h, max(0.0, a + delta), o) if a >= 0 else (h, a, o)
    costs.compute = {r: target.sharing(r) / recorded.sharing(r) for r in trace.ranks}
    costs.source = "recorded durations, repriced for the target where a call's placement or link changes"
    return costs, info


def bucket_scales(trace: Trace, tl: Timeline, target: ClusterSpec, recorded: ClusterSpec,
                  used: Optional[Dict[Key, float]] = None) -> Dict[Key, float]:
    """Per instance whose bytes cross hosts, the factor on the target link's seconds per byte that
    its links' token buckets leave (1: none left out). Each host's link, each way, holds up to
    `target.burst` bytes of tokens, refilled at the link's rate while it sends nothing: a call's
    bytes on it (its pattern's, as the traffic report counts them: trace_links.pair_bytes) pass at
    once up to the tokens there, the rest at the rate. Calls take the tokens in the order the
    simulated run `tl` (replayed with the factors `used`) starts them, each start moved by what
    the calls before it gained or lost at the rate against that run; a call's factor is its busiest
    link's bytes left to the rate over its bytes there."""
    from .trace_links import pair_bytes  # (it prices calls through this module)
    if target.burst <= 0:
        return {}
    was, will, rate = used or {}, Pricer(trace, target), 1.0 / target.params.net.beta
    calls = []
    for key, inst in trace.instances.items():
        pairs = pair_bytes(trace, inst, target, recorded, will) if key in tl.start else None
        load: Dict[Tuple[int, str], float] = {}
        for (a, b), x in (pairs or {}).items():
            ha, hb = target.host_of[a], target.host_of[b]
            if ha != hb:
                load[ha, "out"] = load.get((ha, "out"), 0.0) + x
                load[hb, "in"] = load.get((hb, "in"), 0.0) + x
        if load:
            calls.append((tl.start[key], key, load))
    tokens: Dict[Tuple[int, str], float] = {}
    idle: Dict[Tuple[int, str], float] = {}  # when each link last stopped sending at the rate
    out: Dict[Key, float] = {}
    shift = 0.0  # how much earlier (< 0) or later the calls so far ended than in `tl`
    for start, key, load in sorted(calls, key=lambda c: c[0]):
        t0, left = start + shift, {}
        for link, nbytes in load.items():
            held = min(target.burst, tokens.get(link, target.burst) + max(0.0, t0 - idle.get(link, t0)) * rate)
            at_once = min(nbytes, held)
            tokens[link], idle[link] = held - at_once, t0 + (nbytes - at_once) / rate
            left[link] = nbytes - at_once
        busiest = max(load, key=load.get)
        scale = left[busiest] / load[busiest]
        shift += (scale - was.get(key, 1.0)) * load[busiest] / rate
        if scale < 1.0:
            out[key] = scale
    return out


def _ran(trace: Trace, inst: Instance) -> Optional[str]:
    """The algorithm a recorded collective really ran (a board algorithm's fallback where its board
    could not carry it)."""
    e = next(iter(inst.entries.values()))
    algo = e.get("algorithm")
    if algo is None:
        return None
    n = len(inst.members)
    item = e.get("itemsize") or 0
    coll = traffic.BASE.get(inst.call, inst.call)
    counts = traffic._per_rank(e.get("count"), n)
    post = counts[0] * item if coll == "allgather" else traffic._total(e.get("count")) * item
    return traffic.ran(inst.call, algo, post, item, n, trace.comms[inst.comm].get("board"))


def _same_hosts(group: Sequence[int], a: ClusterSpec, b: ClusterSpec) -> bool:
    """Whether `group` is split over hosts alike on both clusters (the same ranks together)."""
    return _shape(group, a.host_of) == _shape(group, b.host_of)


def _shape(group: Sequence[int], host_of: Sequence[int]) -> Tuple[int, ...]:
    seen: Dict[int, int] = {}
    return tuple(seen.setdefault(host_of[g], len(seen)) for g in group)


def _same(trace: Trace, group: Sequence[int], a: ClusterSpec, b: ClusterSpec) -> bool:
    """Whether a call among `group` costs the same on both clusters: the same split over hosts, and
    where it crosses hosts the same net link and no racks on the way."""
    if not _same_hosts(group, a, b):
        return False
    crosses = len({a.host_of[g] for g in group}) > 1
    return not crosses or (a.params.net == b.params.net and a.params.flow == b.params.flow and not any(b.racks))


def whatif(trace: Trace, target: ClusterSpec, recorded: ClusterSpec) -> Dict[str, Any]:
    """The trace predicted on `target`: the replay's report (trace_replay.replay) for the repriced
    costs, with the recorded median step, the replay of the recording and what was repriced."""
    from .trace_replay import replay
    costs, info = retarget(trace, target, recorded)
    if target.burst > 0:  # the buckets' tokens, taken in the order the calls run (twice: the second
        scales: Dict[Key, float] = {}  # pass starts from a run whose calls are priced with them)
        for _ in range(2):
            scales = bucket_scales(trace, simulate(trace, costs), target, recorded, scales)
            costs, info = retarget(trace, target, recorded, scales)
        info["bucket_calls"] = len(scales)  # calls that found tokens
    out = replay(trace, costs)
    out["mode"] = "what-if"
    out.pop("error")  # (the measured step is the recording's, on its own cluster)
    for row in out["per_step"]:
        row["recorded_ms"] = row.pop("measured_ms")
    out["replay_step_ms"] = replay(trace)["step_ms"]
    out["target"] = {"ranks": len(target.host_of), "hosts": max(target.host_of) + 1, "host_of": target.host_of,
                     "cores": target.cores, "shared_cores": target.shared_cores,
                     "net": target.params.net.describe(), "shm": target.params.shm.describe(),
                     "burst_kib": target.burst / 1024,
                     "racks": target.racks if any(target.racks) else None}
    out["recorded"] = {"hosts": max(recorded.host_of) + 1, "host_of": recorded.host_of, "cores": recorded.cores,
                       "shared_cores": recorded.shared_cores}
    out["repriced"] = info
    out["compute_factor"] = {r: costs.compute[r] for r in trace.ranks}
    return out

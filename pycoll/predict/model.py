"""The step-time model: a recorded workload, replayed on a target cluster.

For one data-parallel step on N ranks (global batch B, so B/N samples per rank):

    compute  F = forward+backward at B/N samples (the workload's profile) * core sharing * interference
    bucket k is ready at ready_frac[k] * F on an average rank, at ready_frac[k] * (F + W) on the slowest,
             W = jitter_frac * F * E[max of N standard normals] (ranks drawn independently each step)
    the communicator's worker runs the queue in order: first the trainer's wait probe (a barrier),
             done at ready_frac[0] * (F + W) + barrier; then bucket k from max(its ready time, the
             previous item's end) for c[k], the tuner's predicted time of the algorithm it picks
    step     = max(F, end of the last bucket) + optimizer

That timeline is not computed here: the step is written as a trace (workload_trace.py: a program per
rank of compute, calls and waits, an average rank and the slowest) and run by the simulator that
`pycoll predict --trace` replays recorded jobs with (trace_replay.simulate), each allreduce priced
by the tuner (Tuner.call_time), as trace_target.py prices a recorded job's calls: one model for both.
The split is the one the trainer measures: compute (F + optimizer), wait (the blocked time until
the probe is done), exposed comm (the rest of the blocked time). Core sharing is ranks per core (per host, or
over all ranks when the hosts are emulated on one machine, `shared_cores`); interference is how much
slower a rank computed in the recorded run than alone (its communication threads take CPU too).
The interval redoes the sum with compute off by the recorded jitter and communication off by the
tuner's validated +-25%.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..selection import NAMED_ONLY
from ..topology import RankInfo, Topology
from ..tuner import MODELED, Link, Params, Tuner
from .workload import Workload
from .workload_trace import StepTimes, simulate_step

COMM_ERROR = 1.25  # the tuner's predictions of single collectives held within this factor (test_emulated_cluster)
BARRIER_BYTES = 8  # the wait probe is priced as the cheapest 8-byte allreduce (a barrier's rounds of tiny messages)


@dataclass(frozen=True)
class Target:
    """Where the workload is to run: ranks on hosts (with cores per host), link parameters, batch."""

    topo: Topology
    params: Params
    global_batch: int
    shared_cores: int = 0            # > 0: all ranks share this many cores (hosts emulated on one machine)
    algo: Optional[str] = None       # force one allreduce algorithm (else the tuner's pick per bucket)
    board_bytes: int = 0
    stage_bytes: int = 0


@dataclass(frozen=True)
class BucketTime:
    """One bucket on the predicted timeline (ms from the step's start, average rank)."""

    nbytes: int
    algorithm: str
    comm_ms: float
    ready_ms: float
    start_ms: float
    end_ms: float


@dataclass
class Prediction:
    """A predicted step: its split (the trainer's definitions), interval and scaling."""

    ranks: int
    hosts: int
    per_host: int
    local_batch: float
    step_ms: float
    low_ms: float
    high_ms: float
    compute_ms: float
    comm_ms: float          # exposed
    wait_ms: float
    comm_total_ms: float
    straggle_ms: float      # W: how much later than average the slowest rank ends backward
    sharing: float          # ranks per core factor applied to compute
    interference: float     # the recorded run's compute slowdown beyond core sharing, applied too
    latency_fit_us: float   # added to every message's latency (latency_fit; net too if recorded across hosts)
    one_rank_ms: float
    speedup: float
    efficiency: float
    buckets: List[BucketTime] = field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        """JSON form; `step_ms` is the predicted step."""
        d = asdict(self)
        d["buckets"] = [asdict(b) for b in self.buckets]
        return d


@lru_cache(maxsize=None)
def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals] (0 for n = 1), by quadrature."""
    if n <= 1:
        return 0.0
    x = np.linspace(-8.0, 8.0, 4001)
    pdf = np.exp(-x * x / 2) / math.sqrt(2 * math.pi)
    cdf = 0.5 * (1 + np.array([math.erf(v / math.sqrt(2)) for v in x]))
    return float(np.sum(x * n * pdf * cdf ** (n - 1)) * (x[1] - x[0]))


def sharing(topo: Topology, shared_cores: int = 0) -> float:
    """Ranks per core on the most crowded host (at least 1): their compute runs that much slower."""
    if shared_cores > 0:
        return max(1.0, topo.size / shared_cores)
    return max([1.0] + [len(m) / c for m, c in zip(topo.members, topo.cores) if c])


def interference(w: Workload, recorded_sharing: float) -> float:
    """How much slower the recorded run computed than one rank alone at the same batch, core sharing
    taken out (at least 1): CPU its communication took, caches it shared."""
    alone, _ = w.compute_at(w.local_batch)
    if not w.profile or alone <= 0 or w.ranks == 1:
        return 1.0
    return max(1.0, w.compute.fwd_bwd_ms / (alone * recorded_sharing))


def build_topology(host_of: Sequence[int], cores: Sequence[int] = (), racks: Sequence[str] = (),
                   uplink_gbit: Optional[Dict[str, float]] = None) -> Topology:
    """A Topology of ranks on hosts `host_of` (host indices), host h having cores[h] cores (0: unknown)
    and hanging off rack racks[h] ("" or absent: none) whose uplink runs at uplink_gbit[rack] (0: no limit)."""
    up = uplink_gbit or {}

    def info(h: int) -> RankInfo:
        rack = racks[h] if h < len(racks) else ""
        return RankInfo(host=str(h), cores=cores[h] if h < len(cores) else 0, rack=rack,
                        uplink_gbit=float(up.get(rack, 0.0)) if rack else 0.0)
    return Topology([info(h) for h in host_of])


def recorded_sharing(w: Workload) -> float:
    """Core sharing in the recorded run; hosts recorded on one machine (emulated) share its cores."""
    one_machine = len(w.machines) > 1 and len(set(w.machines)) == 1
    return sharing(build_topology(w.host_of, w.cores), w.cores[0] if one_machine and w.cores else 0)


def workload_topology(w: Workload) -> Topology:
    """The recorded run's topology: its ranks' hosts, cores and racks."""
    return build_topology(w.host_of, w.cores, w.racks, w.uplink_gbit)


def with_latency(params: Params, extra: float, net: bool = True) -> Params:
    """`params` with `extra` seconds added to every message's latency (shm, and net unless not `net`)."""
    return replace(params, shm=Link(params.shm.alpha + extra, params.shm.beta),
                   net=Link(params.net.alpha + (extra if net else 0.0), params.net.beta))


def recorded_target(w: Workload) -> Target:
    """The recorded run itself as a Target (its topology, tuner parameters and board)."""
    one_machine = len(w.machines) > 1 and len(set(w.machines)) == 1
    return Target(workload_topology(w), w.params, w.global_batch,
                  shared_cores=w.cores[0] if one_machine and w.cores else 0,
                  board_bytes=w.board_bytes, stage_bytes=w.stage_bytes)


def latency_fit(w: Workload) -> float:
    """Seconds per message the recorded run's communication took beyond the tuner's price (0 when
    it took no longer, or nothing was measured): the tuner's latency is the best of a few ping-pongs
    between idle ranks, while in a job a message waits for its receiver to be scheduled, on cores
    it shares with compute, the other ranks and everything else on the machine. Fitted as
    (measured comm total - priced) / messages of the buckets' algorithms, from a run across hosts
    only: on one host the excess is the shm wake-up delay of ranks sharing its cores, which (measured
    on emulated clusters, docs/predict.md) does not carry over to a job whose messages cross a
    network and overestimated 2-host steps by 57%."""
    measured = w.measured.get("comm_total_ms", math.nan) * 1e-3
    if len(set(w.host_of)) < 2 or not math.isfinite(measured) or not w.buckets:
        return 0.0
    target = recorded_target(w)
    probe = 1e-3
    base = sum(t for _, t in comm_times(w, target)[0])
    msgs = (sum(t for _, t in comm_times(w, target, probe)[0]) - base) / probe
    return max(0.0, (measured - base) / msgs) if msgs > 0 else 0.0


def _candidates(target: Target) -> List[str]:
    if target.algo:
        return [target.algo]
    return [a for a in MODELED["allreduce"] if a not in NAMED_ONLY]


def comm_times(w: Workload, target: Target, extra: float = 0.0,
               net: bool = True) -> Tuple[List[Tuple[str, float]], float]:
    """Per bucket (algorithm, seconds): the algorithm the tuner picks on the target with its own
    parameters (what the job's selector would run), priced as a call (Tuner.call_time: with the
    per-call cost and, where ranks outnumber cores, the wake-ups) with `extra` seconds more per message
    (on the net too unless not `net`); and the wait probe's (barrier's) seconds."""
    pick = Tuner(target.params, target.board_bytes, target.stage_bytes)
    price = Tuner(with_latency(target.params, extra, net), target.board_bytes, target.stage_bytes)
    cands = _candidates(target)
    out = []
    for b in w.buckets:
        t, name = pick.rank("allreduce", b.nbytes, target.topo, cands)[0]
        if math.isinf(t):
            raise ValueError(f"the tuner has no finite price for allreduce of {b.nbytes} B with {cands} on "
                             f"{target.topo.size} ranks / {target.topo.nhosts} hosts")
        out.append((name, price.call_time("allreduce", name, b.nbytes, target.topo)))
    name = pick.rank("allreduce", BARRIER_BYTES, target.topo, [a for a in MODELED["allreduce"] if a not in NAMED_ONLY])[0][1]
    return out, price.call_time("allreduce", name, BARRIER_BYTES, target.topo)


def predict(w: Workload, target: Target, fit: bool = True) -> Prediction:
    """The predicted step of workload `w` on `target` (see the module docstring); `fit`: carry the
    recorded run's measured slowdowns over (interference, latency_fit), else price compute from the
    profile and communication from the tuner's parameters alone."""
    topo = target.topo
    n = topo.size
    local = target.global_batch / n
    share = sharing(topo, target.shared_cores)
    was = recorded_sharing(w)
    slow = interference(w, was) if fit and n > 1 else 1.0  # alone, nothing communicates beside compute
    extra = latency_fit(w) if fit else 0.0
    fwd0, opt0 = w.compute_at(local)
    fwd, opt = fwd0 * share * slow, opt0 * share
    one_fwd, one_opt = w.compute_at(target.global_batch)
    one_rank = one_fwd + one_opt
    if n == 1:
        algos: List[Tuple[str, float]] = []
        barrier = 0.0
    else:
        priced, barrier_s = comm_times(w, target, extra)
        algos = [(a, t * 1e3) for a, t in priced]
        barrier = barrier_s * 1e3
    ready = [b.ready_frac for b in w.buckets] if n > 1 else []
    comm = [t for _, t in algos]
    straggle = w.jitter_frac * fwd * expected_max_normal(n)
    sizes = [b.nbytes for b in w.buckets]

    def run(f: float, c_scale: float, s_scale: float) -> StepTimes:
        return simulate_step(f, opt, ready, [(b, a, c * c_scale) for b, (a, c) in zip(sizes, algos)],
                             barrier * c_scale, straggle * s_scale)
    mid = run(fwd, 1.0, 1.0)
    step, wait, exposed, spans = mid.step, mid.wait, mid.exposed, mid.spans
    j = min(w.jitter_frac, 0.5)
    low = run(fwd * (1 - j), 1 / COMM_ERROR, 1 - j).step
    high = run(fwd * (1 + j), COMM_ERROR, 1 + j).step
    buckets = [BucketTime(b.nbytes, a, c, r, s, e) for b, (a, c), (r, s, e) in zip(w.buckets, algos, spans)]
    return Prediction(ranks=n, hosts=topo.nhosts, per_host=topo.per_host, local_batch=local, step_ms=step,
                      low_ms=low, high_ms=high, compute_ms=fwd + opt, comm_ms=exposed, wait_ms=wait,
                      comm_total_ms=sum(comm), straggle_ms=straggle, sharing=share, interference=slow,
                      latency_fit_us=extra * 1e6, one_rank_ms=one_rank, speedup=one_rank / step,
                      efficiency=one_rank / (n * step), buckets=buckets)


def placement(hosts: int, per_host: int, how: str) -> List[int]:
    """host_of for `hosts` x `per_host` ranks: packed (ranks 0..L-1 on host 0, ...) or scattered
    (rank r on host r mod H, round-robin)."""
    if how == "packed":
        return [r // per_host for r in range(hosts * per_host)]
    if how in ("scattered", "interleaved"):
        return [r % hosts for r in range(hosts * per_host)]
    raise ValueError(f"placement {how!r}: expected packed, scattered or a file")

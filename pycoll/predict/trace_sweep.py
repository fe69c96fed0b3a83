"""`pycoll predict --trace DIR --sweep`: a traced job over a ladder of host counts and link rates.

A trace has a fixed number of ranks: its world size is part of the job (a TP degree, the pipeline's
stages, the experts' split), so the first answer is the same job spread over more hosts: its ranks
placed on 1, 2, 4, ... hosts (as many per host as fit, packed or scattered), each (hosts, rate)
predicted by trace_target.retarget and a replay, with the share of its one-host speed it keeps and
its busiest link (trace_links.py).

Where the job is data parallel (every call an allreduce, broadcast or barrier over all ranks: the
gradient buckets of the trainer or DDP) the question users ask first is weak scaling: eight times
the devices, how much faster? The trace is then replicated to N ranks: rank g runs recorded rank
g mod n's program (its compute, scaled for core sharing on the target, and its calls), every
collective is a call of all N ranks, and its recorded duration is repriced as trace_target does,
`recorded + price(N ranks on the target) - price(as recorded)`, with the algorithm the tuner picks
for the N-rank group (1 rank: no communication at all). Against one rank, N ranks process N times
the samples per step: speedup N x T(1) / T(N), efficiency T(1) / T(N). The replicas repeat the
recorded ranks' compute and skew: a larger group's extra waiting for its slowest member is not
modelled. Whether a trace's allreduces sum gradients cannot be told from the trace alone (a
tensor-parallel job's are allreduces over all ranks too): the trainer's (called from pycoll/trainer)
count as data parallel, any other job's only with --data-parallel, and a job with point-to-point
messages, sub-communicators or other collectives is never replicated; the answer says which.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..trace import analysis, traffic
from ..tuner import Link, Params
from . import trace_links, trace_replay, trace_target
from .trace_replay import Costs, Instance, Trace
from .trace_target import ClusterSpec, Pricer

REPLICATED = ("allreduce", "broadcast", "barrier")  # what a data-parallel replica's calls may be
DP_HOSTS = 8  # default top of the weak-scaling ladder, in hosts
TRAINER_SITE = "/pycoll/trainer/"


def ladder(top: int) -> List[int]:
    """1, 2, 4, ... below `top`, then `top` (the workload sweep's ladder)."""
    out, k = [], 1
    while k < top:
        out.append(k)
        k *= 2
    return out + [top]


def params_for(base: Params, gbit: Optional[float], latency_us: Optional[float]) -> Params:
    """`base` with its net link at `gbit` and `latency_us` (None: as in `base`)."""
    if (gbit is not None and gbit <= 0) or (latency_us is not None and latency_us < 0):
        raise ValueError(f"link rates must be > 0 Gbit/s and latencies >= 0 us (got {gbit}, {latency_us})")
    return replace(base, net=Link(base.net.alpha if latency_us is None else latency_us * 1e-6,
                                  base.net.beta if gbit is None else 8e-9 / gbit))


def spread_placement(n: int, hosts: int, placement: str) -> List[int]:
    """Host of each of `n` ranks on `hosts` hosts: packed (as many per host as fit, in rank order)
    or scattered (rank r on host r mod hosts)."""
    if placement == "scattered":
        return [r % hosts for r in range(n)]
    ppn = -(-n // hosts)
    return [r // ppn for r in range(n)]


def _cluster(host_of: List[int], params: Params, cores: int, shared_cores: int) -> ClusterSpec:
    nhosts = max(host_of) + 1
    return ClusterSpec(host_of, [cores] * nhosts, params, [""] * nhosts, {}, shared_cores)


def _row(out: Dict[str, Any], cluster: ClusterSpec, compute: Dict[int, float]) -> Dict[str, Any]:
    """The columns a sweep row shares with a single prediction."""
    per_host = Counter(cluster.host_of)
    return {"hosts": len(per_host), "per_host": max(per_host.values()), "ranks": len(cluster.host_of),
            "gbit": float(f"{8e-9 / cluster.params.net.beta:.6g}"),
            "latency_us": float(f"{cluster.params.net.alpha * 1e6:.6g}"),
            "step_ms": out["step_ms"], "split": out["split"], "median_step": out["median_step"],
            "compute_factor": max(compute.values()) if compute else 1.0}


# -- the same job over more hosts ------------------------------------------------------------------
def spread(trace: Trace, recorded: ClusterSpec, hosts: Sequence[int], rates: Sequence[Params], placement: str,
           cores: int, shared_cores: int) -> List[Dict[str, Any]]:
    """One row per (rate, host count): the trace's ranks on that many hosts (host counts that place
    the ranks alike are predicted once), with the step relative to the same rate's 1-host step
    (`vs_one_host`: above 1 slower) and the step's busiest link between hosts, or inside one."""
    n = len(trace.ranks)
    rows = []
    for params in rates:
        seen = set()
        for h in hosts:
            host_of = spread_placement(n, min(h, n), placement)
            if tuple(host_of) in seen:
                continue
            seen.add(tuple(host_of))
            cluster = _cluster(host_of, params, cores, shared_cores)
            costs, info = trace_target.retarget(trace, cluster, recorded)
            out = trace_replay.replay(trace, costs)
            row = _row(out, cluster, costs.compute)
            links = trace_links.links(trace, out["_timeline"], out["median_step"], out["slowest_rank"], cluster,
                                      recorded)
            between = [x for x in links["links"] if x["between_hosts"]]
            busiest = (between or links["links"] or [None])[0]
            row.update(repriced=info["repriced"], host_of=host_of,
                       busiest_link=None if busiest is None else
                       {k: busiest[k] for k in ("link", "bytes", "busy_ms", "share", "gbit")})
            rows.append(row)
    for row in rows:
        one = next(r for r in rows if r["gbit"] == row["gbit"] and r["latency_us"] == row["latency_us"])
        row["vs_one_host"] = row["step_ms"] / one["step_ms"] if one["step_ms"] > 0 else None
        row["efficiency"] = one["step_ms"] / row["step_ms"] if row["step_ms"] > 0 else None
    return rows


# -- data parallel: more ranks by replicating the group --------------------------------------------
def data_parallel(trace: Trace, asserted: bool = False) -> Tuple[bool, str]:
    """(whether the trace can be replicated as data parallelism, and why or why not)."""
    n = len(trace.ranks)
    if any(i.kind == "p2p" for i in trace.instances.values()):
        return False, ("it sends point-to-point messages (pipeline stages, or hand-made exchanges): a replica "
                       "of a rank's partners cannot be made up from the trace")
    for cid in {i.comm for i in trace.instances.values()}:
        group = trace.comms[cid]["group"]
        if sorted(group) != list(trace.ranks):
            return False, (f"its communicator {trace.comms[cid]['name']} holds ranks {analysis.span(sorted(group))} "
                           f"of its {n}: a job with sub-groups (a TP x DP mesh) is not replicated here")
    calls = Counter(i.call for i in trace.instances.values())
    other = sorted(c for c in calls if c not in REPLICATED)
    if other:
        return False, (f"it calls {', '.join(other)}: only allreduce, broadcast and barrier are replicated (what "
                       "another collective moves per rank depends on how the job splits its data over the group)")
    if not calls.get("allreduce"):
        return False, "it makes no allreduce: there are no gradients to sum over replicas"
    sites = sorted({str(e.get("site") or "?") for i in trace.instances.values() if i.call == "allreduce"
                    for e in i.entries.values()})
    if all(TRAINER_SITE in s.replace("\\", "/") for s in sites):
        return True, "its allreduces are the pycoll trainer's gradient buckets (called from pycoll/trainer)"
    if asserted:
        return True, "--data-parallel: its allreduces are taken as gradient allreduces"
    shown = ", ".join(sites[:3]) + (f" and {len(sites) - 3} more" if len(sites) > 3 else "")
    return False, ("its calls are allreduces over all its ranks as data parallelism's are, but a tensor-parallel "
                   f"job's are too (they come from {shown}): the trace cannot tell whether they sum gradients; "
                   "pass --data-parallel if they do")


def replicate(trace: Trace, n: int) -> Trace:
    """The trace with `n` ranks: rank g runs recorded rank g mod len(trace.ranks)'s program, and
    every collective is a call of all `n` (only for a trace data_parallel() accepts)."""
    src = {g: trace.ranks[g % len(trace.ranks)] for g in range(n)}
    group = list(range(n))
    comms = {cid: dict(info, group=group, hosts=None) for cid, info in trace.comms.items()}
    instances = {}
    for key, i in trace.instances.items():
        instances[key] = Instance(key, i.kind, i.comm, i.call, group, {g: i.entries[src[g]] for g in group},
                                  {g: i.handoff[src[g]] for g in group}, {g: i.after[src[g]] for g in group},
                                  {g: i.own[src[g]] for g in group}, {g: i.queued[src[g]] for g in group})
    return Trace(trace.folder, trace.job, group, {g: trace.host_of[src[g]] for g in group},
                 {g: trace.machine_of.get(src[g], "") for g in group}, comms, instances,
                 {g: trace.programs[src[g]] for g in group}, {g: trace.begin[src[g]] for g in group},
                 trace.marked, list(trace.steps), {k: {g: v[src[g]] for g in group} for k, v in trace.measured.items()},
                 list(trace.notes))


def recorded_algorithm(trace: Trace, inst: Instance) -> Optional[str]:
    """The algorithm a recorded collective ran: as named, or its message-based fallback where the
    communicator's board could not carry it (traffic.ran)."""
    e = next(iter(inst.entries.values()))
    if e.get("algorithm") is None:
        return None
    item = e.get("itemsize") or 0
    n = len(inst.members)
    coll = traffic.BASE.get(inst.call, inst.call)
    counts = traffic._per_rank(e.get("count"), n)
    post = counts[0] * item if coll == "allgather" else traffic._total(e.get("count")) * item
    return traffic.ran(inst.call, e["algorithm"], post, item, n, trace.comms[inst.comm].get("board"))


def replicated_costs(trace: Trace, rep: Trace, target: ClusterSpec, recorded: ClusterSpec
                     ) -> Tuple[Costs, Dict[str, int]]:
    """`rep`'s (replicate(trace, N)) costs on `target`: each collective's recorded duration plus
    what the model adds for N ranks on the target over the recorded group on its cluster; on one
    rank nothing; the target algorithm of each call ({"call: algorithm": calls})."""
    n, size = len(trace.ranks), len(rep.ranks)
    costs = trace_replay.recorded_costs(rep)
    src = {g: trace.ranks[g % n] for g in rep.ranks}
    costs.compute = {g: target.sharing(g) / recorded.sharing(src[g]) for g in rep.ranks}
    algos: Dict[str, int] = {}
    if size == 1:
        costs.times = {key: {0: (0.0, 0.0, 0.0)} for key in rep.instances}
        return costs, algos
    was, will = Pricer(trace, recorded), Pricer(rep, target)
    same = size == n and target.host_of == recorded.host_of and \
        (len(set(target.host_of)) == 1 or target.params.net == recorded.params.net)
    for key, inst in rep.instances.items():
        ran = recorded_algorithm(trace, trace.instances[key])
        if same:
            label = f"{inst.call}: {ran}"
            algos[label] = algos.get(label, 0) + 1
            continue
        before, _ = was.collective(trace.instances[key], ran)
        after, algo = will.collective(inst, None)
        label = f"{inst.call}: {algo if after is not None and before is not None else ran + ' (kept as recorded)'}"
        algos[label] = algos.get(label, 0) + 1
        if before is None or after is None:
            continue
        times = costs.times[key]
        for m, (h, a, o) in list(times.items()):
            times[m] = (h, max(0.0, a + after - before), o) if a >= 0 else (h, a, o)
    return costs, algos


def weak(trace: Trace, recorded: ClusterSpec, ranks: Sequence[int], ppn: int, rates: Sequence[Params],
         cores: int, shared_cores: int) -> List[Dict[str, Any]]:
    """One row per (rate, N ranks): the replicated job on ceil(N / ppn) hosts of `ppn` ranks (packed),
    with its speedup and scaling efficiency against one rank on the same rate."""
    rows = []
    for params in rates:
        for size in ranks:
            rep = replicate(trace, size)
            cluster = _cluster([g // ppn for g in range(size)], params, cores, shared_cores)
            costs, algos = replicated_costs(trace, rep, cluster, recorded)
            out = trace_replay.replay(rep, costs)
            row = _row(out, cluster, costs.compute)
            row["algorithms"] = algos
            rows.append(row)
    for row in rows:
        one = next(r for r in rows if r["gbit"] == row["gbit"] and r["latency_us"] == row["latency_us"])
        eff = one["step_ms"] / row["step_ms"] if row["step_ms"] > 0 else None
        row["efficiency"] = eff
        row["speedup"] = row["ranks"] * eff if eff is not None else None
    return rows


def sweep(trace: Trace, *, hosts: Optional[int] = None, ppn: Optional[int] = None,
          gbits: Sequence[Optional[float]] = (None,), latency_us: Optional[float] = None,
          placement: str = "packed", cores: Optional[int] = None, shared_cores: int = 0,
          topo: Optional[Dict[str, Any]] = None, assert_dp: bool = False) -> Dict[str, Any]:
    """The trace over hosts and link rates (see the module docstring): {"spread": rows, "data_parallel":
    {"shown", "why", "ppn", "rows"}, ...}. `hosts`: the top of both ladders (default: one rank per host
    for the spread, DP_HOSTS hosts for weak scaling); `ppn`: ranks per host of the weak-scaling rows
    (default the recording's); `topo`: a topology file's contents, for its links."""
    if placement not in ("packed", "scattered"):
        raise ValueError(f"--sweep places the ranks itself, packed or scattered: --placement {placement} is a "
                         "placement of its own (predict it without --sweep)")
    if topo and (topo.get("hosts") or topo.get("racks")):
        raise ValueError("--sweep places the ranks itself: a --topo-file's hosts and racks are one placement "
                         "(predict it without --sweep); with --sweep a topology file gives links only")
    if (hosts is not None and hosts < 1) or (ppn is not None and ppn < 1):
        raise ValueError("--hosts and --ppn must be at least 1")
    base = trace_target.base_params(topo)
    rates = [params_for(base, g, latency_us) for g in gbits]
    recorded = trace_target.recorded_cluster(trace, base)
    n = len(trace.ranks)
    per_core = cores or (recorded.cores[0] if recorded.cores else 0)
    notes = []
    if hosts is not None and hosts > n:
        notes.append(f"the same job on more hosts stops at {n} hosts (one rank each): {hosts} hosts only in the "
                     "data-parallel rows")
    spread_rows = spread(trace, recorded, ladder(min(hosts or n, n)), rates, placement, per_core, shared_cores)
    ok, why = data_parallel(trace, assert_dp)
    rec_ppn = max(Counter(recorded.host_of).values())
    dp_ppn = ppn or rec_ppn
    dp: Dict[str, Any] = {"shown": ok, "why": why, "ppn": dp_ppn, "rows": []}
    if ok:
        dp["rows"] = weak(trace, recorded, ladder((hosts or DP_HOSTS) * dp_ppn), dp_ppn, rates, per_core,
                          shared_cores)
    return {"trace": trace.folder, "job": trace.job, "ranks": n, "marked": trace.marked, "notes": list(trace.notes)
            + notes, "placement": placement, "cores": per_core, "shared_cores": shared_cores,
            "recorded": {"hosts": max(recorded.host_of) + 1, "host_of": recorded.host_of},
            "spread": spread_rows, "data_parallel": dp}


# -- the answer ------------------------------------------------------------------------------------
def _split(r: Dict[str, Any]) -> str:
    s = r["split"]
    return f"{s['compute_ms']:.2f} | {s['comm_ms']:.2f} | {s['wait_ms']:.2f}"


def render(out: Dict[str, Any]) -> str:
    """The sweep as text: notes, the spread table and the weak-scaling table (or why there is none)."""
    step = "median predicted step (a decoding job's step is a token: time per output token)" if out["marked"] \
        else "predicted span (no step marks: the whole recorded span is one step)"
    lines = [f"sweep of trace {out['trace']}: {out['ranks']} ranks" + (f", job {out['job']}" if out["job"] else "")
             + f", recorded on {out['recorded']['hosts']} host(s)"]
    lines += [f"note: {x}" for x in out["notes"]]
    lines += ["", f"The same job spread over more hosts: its {out['ranks']} ranks (the job's world size: its TP "
              f"degree, stages, ...) placed {out['placement']} on each host count, {out['cores']} cores per host"
              + (f", all ranks on {out['shared_cores']} shared cores" if out["shared_cores"] else "")
              + f". Step ms: the {step}; vs 1 host: this step / the 1-host step at that rate.",
              "| link Gbit/s | latency us | hosts | ranks per host | step ms | compute | exposed comm | wait | "
              "vs 1 host | busiest link: share of the step, bytes |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in out["spread"]:
        b = r["busiest_link"]
        link = "-" if b is None else f"{b['link']}: {b['share']:.0%}, {trace_links.fmt_bytes(b['bytes'])}"
        lines.append(f"| {r['gbit']:.3g} | {r['latency_us']:.0f} | {r['hosts']} | {r['per_host']} | {r['step_ms']:.2f} "
                     f"| {_split(r)} | {r['vs_one_host']:.2f}x | {link} |")
    dp = out["data_parallel"]
    lines.append("")
    if not dp["shown"]:
        lines.append(f"Weak scaling (more ranks, data parallel): not predicted for this trace: {dp['why']}.")
        return "\n".join(lines)
    lines += [f"Weak scaling, data parallel ({dp['why']}): the job replicated to N ranks, {dp['ppn']} per host, "
              "each rank computing what a recorded rank did, every allreduce priced for all N; speedup = N x "
              "T(1 rank) / T(N) (N times the samples per step), efficiency = T(1) / T(N). The replicas repeat the "
              "recorded ranks' skew: a larger group's extra waiting for its slowest member is not modelled.",
              "| link Gbit/s | ranks | hosts | step ms | compute | exposed comm | wait | speedup | efficiency | "
              "algorithms |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in dp["rows"]:
        algos = ", ".join(f"{k} x{v}" for k, v in sorted(r["algorithms"].items())) or "-"
        lines.append(f"| {r['gbit']:.3g} | {r['ranks']} | {r['hosts']} | {r['step_ms']:.2f} | {_split(r)} | "
                     f"{r['speedup']:.2f}x | {r['efficiency']:.0%} | {algos} |")
    return "\n".join(lines)


def plot(out: Dict[str, Any], path: str) -> None:
    """Step time and efficiency over hosts, one line per link rate: the same job spread (solid;
    efficiency = 1-host step / step) and, for a data-parallel job, weak scaling (dashed, at N / ppn
    hosts: one rank of two per host at 0.5; efficiency = T(1 rank) / T(N))."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter
    fig = Figure(figsize=(10, 4.2))
    a, b = fig.subplots(1, 2)
    series = [(out["spread"], "o-", f"{out['ranks']} ranks spread", 0)]
    dp = out["data_parallel"]
    if dp["shown"]:
        series.append((dp["rows"], "s--", f"DP, {dp['ppn']} ranks per host", dp["ppn"]))
    for rows, style, what, ppn in series:
        for key in sorted({(r["gbit"], r["latency_us"]) for r in rows}):
            pts = sorted((r["ranks"] / ppn if ppn else r["hosts"], r["step_ms"], r["efficiency"]) for r in rows
                         if (r["gbit"], r["latency_us"]) == key)
            label = f"{what}, {key[0]:.3g} Gbit/s"
            a.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
            b.plot([p[0] for p in pts], [100 * p[2] for p in pts], style, label=label)
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlabel("hosts" + (" (DP: ranks / ranks per host)" if dp["shown"] else ""))
    a.set_ylabel("predicted median step (ms)")
    b.set_ylabel("scaling efficiency (%)")
    b.axhline(100, color="grey", lw=0.8)
    a.set_title(f"{out['trace']}: step time", fontsize=9)
    b.set_title("efficiency (spread: 1-host step / step; DP: T(1 rank) / T(N))", fontsize=9)
    a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)

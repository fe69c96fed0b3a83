"""The share of a predicted step each link carries (`pycoll predict --trace`: `links`).

A replay (trace_replay.simulate) says when each call ran: from its last member ready to its last
member's end. What a call sends between each pair of ranks comes from its algorithm's pattern,
as the traffic report counts it (pycoll/trace/traffic.py): the algorithm it ran where its group
sits on the hosts as recorded, else the one the tuner picks for the group on the target (as
trace_target.retarget prices it), a message's bytes for a send. Each pair's bytes go to the link
between the two ranks' hosts (one per host pair, both directions together) or, for two ranks on
one host, to that host's inside (shared memory). For the step the answer is about, every call
issued in it (by its first member) counts with all its bytes, and the link is taken as busy for
the call's whole simulated interval, cut to the step: per link the bytes, the busy time, its share
of the step and the rate the bytes imply over that time. Rack uplinks are not links of their own
here (the host pairs behind them are).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from ..trace import traffic
from ..tuner import Tuner
from .trace_replay import Instance, Key, Timeline, Trace
from .trace_target import ClusterSpec, Pricer

Link = Tuple[int, int]  # (host a, host b), a <= b; a == b: inside host a


def link_name(link: Link) -> str:
    """'host 0' (inside it) or 'host 0 - host 1'."""
    a, b = link
    return f"host {a}" if a == b else f"host {a} - host {b}"


def issue_steps(trace: Trace) -> Dict[Key, int]:
    """The step each instance was issued in, by its first member (as trace_replay.simulate counts
    steps: a mark ends its step)."""
    out: Dict[Key, int] = {}
    for r in trace.ranks:
        step = trace.steps[0] if trace.marked else 0
        for op in trace.programs[r]:
            if op.kind == "mark":
                step = op.step + 1
            elif op.kind == "issue" and trace.instances[op.key].members[0] == r:
                out[op.key] = step
    return out


def step_window(trace: Trace, tl: Timeline, step: int, rank: int) -> Tuple[float, float]:
    """(start, end) of `rank`'s step `step` on the simulated clock (trace_replay.step_times's span)."""
    first = min(trace.begin.values())
    zero = trace.begin[rank] - first
    if not trace.marked:
        return 0.0, tl.end[rank]
    start = tl.marks[rank].get(step - 1, zero) if step != trace.steps[0] else zero
    return start, tl.marks[rank][step]


def _shape(group: List[int], host_of: List[int]) -> Tuple[int, ...]:
    seen: Dict[int, int] = {}
    return tuple(seen.setdefault(host_of[g], len(seen)) for g in group)


def pair_bytes(trace: Trace, inst: Instance, cluster: ClusterSpec, recorded: ClusterSpec,
               pricer: Pricer) -> Optional[Dict[Tuple[int, int], float]]:
    """(src, dst) global ranks -> bytes instance `inst` sends on `cluster`; None where no pattern
    models its algorithm."""
    if inst.kind == "p2p":
        src, dst = inst.members
        return {(src, dst): float(inst.nbytes)} if inst.nbytes else {}
    comm = trace.comms[inst.comm]
    group = list(comm["group"])
    hosts = [str(cluster.host_of[g]) for g in group]
    moved = _shape(group, cluster.host_of) != _shape(group, recorded.host_of)
    algo = pricer.collective(inst, None)[1] if moved else None
    board = comm.get("board") if len(set(hosts)) == 1 else None
    tc = traffic._Comm(group, hosts, None, board)
    over = {} if algo is None else {"algorithm": algo}
    if algo == "hierarchical":
        over["phase"] = _phase(cluster, inst, group)
    cache: Dict[Tuple, Any] = {}
    out: Dict[Tuple[int, int], float] = {}
    for m in inst.members:
        e = dict(inst.entries[m], **over)
        sent = traffic._sent(e, tc, group.index(m), cache)
        if sent is None:
            return None
        for (a, b), (x, _) in sent.items():
            if x:
                out[group[a], group[b]] = out.get((group[a], group[b]), 0.0) + x
    return out


def _phase(cluster: ClusterSpec, inst: Instance, group: List[int]) -> Optional[str]:
    """The cross-host phase the tuner picks for a hierarchical call of `group` on `cluster` (as
    algorithms/hierarchical.py asks for it: one leader per host, or each local index where the
    hosts hold alike many ranks)."""
    topo = cluster.topology(group)
    if topo.nhosts < 2:
        return None
    coll = traffic.BASE.get(inst.call, inst.call)
    tuner = Tuner(cluster.params, 0, 0, False)
    if topo.uniform:
        cross = topo.subset([m[0] for m in topo.members])
        return tuner.best_phase(coll, inst.nbytes / topo.per_host, cross, topo.per_host)[0]
    return tuner.best_phase(coll, inst.nbytes, topo.subset([m[0] for m in topo.members]), 1)[0]


def _union(spans: List[Tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def links(trace: Trace, tl: Timeline, step: int, rank: int, cluster: ClusterSpec,
          recorded: ClusterSpec) -> Dict[str, Any]:
    """Per link, what it carried in step `step` (its span: `rank`'s, the step's slowest) of the
    simulated run `tl` of `trace` on `cluster` (`recorded`: the cluster the trace ran on):
    {"step", "step_ms", "bytes", "links": [{"link", "hosts", "between_hosts", "bytes", "bytes_ab",
    "bytes_ba", "calls", "busy_ms", "share", "gbit"}], "unmodeled": {call (algorithm): calls}},
    links busiest first."""
    t0, t1 = step_window(trace, tl, step, rank)
    span = t1 - t0
    steps = issue_steps(trace)
    pricer = Pricer(trace, cluster)
    use: Dict[Link, Dict[str, Any]] = {}
    unmodeled: Dict[str, int] = {}
    for key, inst in trace.instances.items():
        if steps.get(key) != step:
            continue
        pairs = pair_bytes(trace, inst, cluster, recorded, pricer)
        if pairs is None:
            label = f"{inst.call} ({next(iter(inst.entries.values())).get('algorithm')})"
            unmodeled[label] = unmodeled.get(label, 0) + 1
            continue
        a0 = max(tl.start[key], t0)
        a1 = min(max(tl.ends[key].values()), t1)
        touched = set()
        for (src, dst), x in pairs.items():
            ha, hb = cluster.host_of[src], cluster.host_of[dst]
            link = (min(ha, hb), max(ha, hb))
            u = use.setdefault(link, {"bytes_ab": 0.0, "bytes_ba": 0.0, "calls": 0, "spans": []})
            u["bytes_ab" if ha <= hb else "bytes_ba"] += x
            if link not in touched:
                touched.add(link)
                u["calls"] += 1
                if a1 > a0:
                    u["spans"].append((a0, a1))
    rows = []
    for link, u in use.items():
        busy = _union(u["spans"])
        total = u["bytes_ab"] + u["bytes_ba"]
        rows.append({"link": link_name(link), "hosts": list(link), "between_hosts": link[0] != link[1],
                     "bytes": total, "bytes_ab": u["bytes_ab"], "bytes_ba": u["bytes_ba"], "calls": u["calls"],
                     "busy_ms": busy * 1e3, "share": busy / span if span > 0 else 0.0,
                     "gbit": total * 8 / busy / 1e9 if busy > 0 else None})
    rows.sort(key=lambda x: (-x["share"], -x["bytes"], x["hosts"]))
    return {"step": step, "step_ms": span * 1e3, "bytes": sum(x["bytes"] for x in rows), "links": rows,
            "unmodeled": unmodeled}


def fmt_bytes(x: float) -> str:
    """'1.50 MiB'."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if x >= 1 << shift:
            return f"{x / (1 << shift):.2f} {unit}"
    return f"{x:.0f} B"


def describe(out: Dict[str, Any], shown: int = 12) -> List[str]:
    """The links' lines of the text answer (the `shown` busiest; --json has them all)."""
    what = f"step {out['step']}" if out["step"] else "the span"
    lines = [f"links in {what} ({out['step_ms']:.2f} ms; a link is busy while a call moves bytes over it, "
             f"bytes both ways):"]
    if not out["links"]:
        lines.append("  none: no call in it sent bytes")
    for x in out["links"][:shown]:
        rate = f"{x['gbit']:.3g} Gbit/s" if x["gbit"] is not None else "-"
        lines.append(f"  {x['link']:<16}{fmt_bytes(x['bytes']):>12} in {x['calls']:>4} calls, busy "
                     f"{x['busy_ms']:8.2f} ms = {x['share']:6.1%} of the step, {rate} while busy")
    if len(out["links"]) > shown:
        lines.append(f"  ... {len(out['links']) - shown} more links (--json has them all)")
    if out["unmodeled"]:
        lines.append("  not attributed (no pattern for their algorithm): " +
                     ", ".join(f"{k} x{v}" for k, v in sorted(out["unmodeled"].items())))
    return lines

"""`pycoll predict`: how long one training step takes on H hosts of L ranks, and why, from a workload
recorded once (`python -m pycoll.trainer ... --report-json FILE`, or a torch DDP model through
pycoll/predict/torch_record.py), or from any job's flight-recorder dumps (`--trace DIR`).

    pycoll predict --workload rec.json --hosts 4 --ppn 2 --link-gbit 1 --link-latency-us 50
    pycoll predict --workload rec.json --hosts 8 --ppn 4 --link-gbit 10 --sweep --sweep-gbit 1,10,100
    pycoll predict --workload rec.json --measured run2.json run4.json --plot pred.png
    pycoll predict --trace DIR                                   # replay the recorded job: predicted vs measured
    pycoll predict --trace DIR --hosts 2 --link-gbit 1 --json    # the same job with its ranks on 2 hosts

Predicted step = compute + exposed communication (bucket by bucket against backward, with the
algorithm the tuner picks on that topology) + waiting for the slowest rank; the model is
pycoll/predict/model.py. With --measured (the same trainer's reports of real runs) it predicts each
of those runs from the workload alone and prints predicted, measured and the error.

With --trace (a job run with PYCOLL_TRACE_DIR set, or `pycoll run --trace-dir DIR`; steps marked with
pycoll.mark_step()) every rank's calls and compute are replayed against each other
(pycoll/predict/trace_replay.py): with no target option the recorded run itself, its median step
against the measured one; with --hosts, --ppn, --placement, --link-gbit, --link-latency-us,
--topo-file, --shared-cores or --cores the same job on that cluster (pycoll/predict/trace_target.py).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import Any, Dict, List, Optional, Sequence

from ..errors import EnvError
from ..predict import trace_links, trace_replay, trace_sweep, trace_target
from ..predict.model import Prediction, Target, build_topology, placement, predict, recorded_target
from ..predict.workload import Workload, WorkloadError, load
from ..topology import load_topo_file, rack_of_rank
from ..trace.analysis import TraceError
from ..transports.shm_board import SLOT_BYTES, STAGE_BYTES
from ..tuner import Link


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pycoll predict", description=__doc__.split("\n\n")[0])
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--workload", metavar="FILE",
                        help="workload record (trainer --report-json, or a torch DDP model's: "
                             "pycoll/predict/torch_record.py)")
    source.add_argument("--trace", metavar="DIR",
                        help="a job's flight-recorder dumps (PYCOLL_TRACE_DIR, pycoll run --trace-dir): replay it, "
                             "or predict it on the target the options below describe")
    ap.add_argument("--hosts", type=int, help="hosts of the target cluster (default 1; --trace: the recorded ones)")
    ap.add_argument("--ppn", type=int, help="ranks per host (default 1; --trace: the trace's ranks / --hosts)")
    ap.add_argument("--link-gbit", type=float, help="inter-host link rate (default: the recorded tuner's; --trace: "
                                                    "the tuner's default or the --topo-file's links)")
    ap.add_argument("--link-latency-us", type=float, help="inter-host message latency (default: the recorded tuner's; "
                                                          "--trace: as --link-gbit)")
    ap.add_argument("--topo-file", metavar="T",
                    help="a PYCOLL_TOPO_FILE: hosts (placement), ranks' cores, links, racks and their uplinks")
    ap.add_argument("--placement", default="packed",
                    help="packed (ranks 0..L-1 on host 0, ...), scattered (rank r on host r mod H) or a JSON "
                         "file holding the host of each rank as a list")
    ap.add_argument("--batch-size", type=int, help="global batch of the target (default: the recorded one)")
    ap.add_argument("--cores", type=int, help="cores per host (default: the recorded host's; --trace: this machine's)")
    ap.add_argument("--shared-cores", type=int, default=0, metavar="N",
                    help="all ranks share N cores: hosts emulated on one machine (network namespaces)")
    ap.add_argument("--algo", help="price every bucket with this allreduce algorithm (default: the tuner's pick)")
    ap.add_argument("--no-fit", action="store_true",
                    help="ignore the recorded run's measured slowdowns (compute interference, message latency)")
    ap.add_argument("--sweep", action="store_true",
                    help="table over hosts 1, 2, 4, .., H and ppn 1, 2, 4, .., L; --trace: the job's ranks spread "
                         "over 1, 2, 4, .. hosts (up to --hosts, default one rank per host) and, for a data-parallel "
                         "job, replicated to more ranks (--ppn per host, up to --hosts hosts, default 8)")
    ap.add_argument("--sweep-gbit", metavar="G,G,...", help="with --sweep: also over these link rates")
    ap.add_argument("--data-parallel", action="store_true",
                    help="with --trace --sweep: the trace's allreduces sum gradients (data parallelism; the "
                         "trainer's are known to): also predict it on more ranks")
    ap.add_argument("--measured", nargs="+", metavar="FILE", help="trainer reports of real runs to predict and compare")
    ap.add_argument("--json", action="store_true", help="print JSON (the predicted step under step_ms)")
    ap.add_argument("--plot", metavar="OUT.png", help="with --measured: predicted against measured; with --sweep: "
                                                      "step time and efficiency over ranks (--trace: over hosts)")
    return ap


def target_for(w: Workload, args: argparse.Namespace, hosts: int, ppn: int, gbit: Optional[float] = None) -> Target:
    """The Target the options describe for `hosts` x `ppn` ranks."""
    params = w.params
    spec: Dict[str, Any] = load_topo_file(args.topo_file) if args.topo_file else {}
    if "links" in spec:
        from ..calibration import file_links
        links = file_links(spec)
        params = replace(params, shm=links.get("shm", params.shm), net=links.get("net", params.net))
    rate = gbit if gbit is not None else args.link_gbit
    net = Link(params.net.alpha if args.link_latency_us is None else args.link_latency_us * 1e-6,
               params.net.beta if rate is None else 8e-9 / rate)
    params = replace(params, net=net)
    if spec.get("hosts"):
        names = list(spec["hosts"])
        host_of = [0] * (1 + max(r for ranks in spec["hosts"].values() for r in ranks))
        for h, name in enumerate(names):
            for r in spec["hosts"][name]:
                host_of[r] = h
    elif args.placement in ("packed", "scattered", "interleaved"):
        host_of = placement(hosts, ppn, args.placement)
    else:
        with open(args.placement) as fh:
            host_of = [int(h) for h in json.load(fh)]
    nhosts = max(host_of) + 1
    cores = [args.cores or (w.cores[0] if w.cores else 0)] * nhosts
    for r, over in spec.get("ranks", {}).items():
        if "cores" in over and int(r) < len(host_of):
            cores[host_of[int(r)]] = int(over["cores"])
    racks, uplink = [""] * nhosts, {}
    for r, h in enumerate(host_of):  # a host is in the rack of its first rank
        if not racks[h]:
            racks[h], gbit = rack_of_rank(spec, r)
            uplink[racks[h]] = gbit
    single = nhosts == 1
    return Target(build_topology(host_of, cores, racks, uplink), params, args.batch_size or w.global_batch,
                  shared_cores=args.shared_cores, algo=args.algo,
                  board_bytes=(w.board_bytes or SLOT_BYTES) if single else 0,
                  stage_bytes=(w.stage_bytes or STAGE_BYTES) if single else 0)


def describe(p: Prediction, t: Target) -> str:
    """The answer for one target, with the bucket-by-bucket timeline."""
    lines = [f"{p.ranks} rank(s) on {p.hosts} host(s) ({p.per_host} per host), {p.local_batch:g} samples per rank, "
             f"net {t.params.net.describe()}",
             f"predicted step {p.step_ms:.2f} ms [{p.low_ms:.2f}, {p.high_ms:.2f}] = compute {p.compute_ms:.2f} + "
             f"exposed comm {p.comm_ms:.2f} + wait {p.wait_ms:.2f}",
             f"  communication {p.comm_total_ms:.2f} ms in all, {_hidden(p):.0%} hidden behind backward; slowest rank "
             f"{p.straggle_ms:.2f} ms behind; compute x{p.sharing:.2g} for core sharing, x{p.interference:.2f} "
             f"interference; +{p.latency_fit_us:.0f} us per message fitted",
             f"  1 rank: {p.one_rank_ms:.2f} ms per step -> speedup {p.speedup:.2f}x, scaling efficiency "
             f"{p.efficiency:.0%}"]
    topo = t.topo
    if topo.racks:
        racks = "; ".join(f"{name}: hosts {', '.join(str(h) for h, k in enumerate(topo.rack_of) if k == i)}"
                          + (f", uplink {g:g} Gbit/s" if g else "") for i, (name, g) in enumerate(zip(topo.racks, topo.uplink_gbit)))
        lines.append(f"  racks {racks}; host order of the rings {topo.host_order()}")
    if p.buckets:
        lines.append("  bucket        bytes  algorithm            ready    start      end   (ms from step start)")
        for k, b in enumerate(p.buckets):
            lines.append(f"  {k:>6} {b.nbytes:>12}  {b.algorithm:<18} {b.ready_ms:>7.2f} {b.start_ms:>8.2f} "
                         f"{b.end_ms:>8.2f}")
    return "\n".join(lines)


def _hidden(p: Prediction) -> float:
    return max(0.0, p.comm_total_ms - p.comm_ms) / p.comm_total_ms if p.comm_total_ms > 0 else 0.0


def _ladder(top: int) -> List[int]:
    out, k = [], 1
    while k < top:
        out.append(k)
        k *= 2
    return out + [top]


def sweep(w: Workload, args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Predictions over hosts x ppn (x link rates)."""
    rates: Sequence[Optional[float]] = [float(g) for g in args.sweep_gbit.split(",")] if args.sweep_gbit else [None]
    rows = []
    for gbit in rates:
        for hosts in _ladder(args.hosts):
            for ppn in _ladder(args.ppn):
                t = target_for(w, args, hosts, ppn, gbit)
                p = predict(w, t, fit=not args.no_fit)
                rows.append({"gbit": 8e-9 / t.params.net.beta, **p.to_dict(), "algorithm": _main_algo(p)})
    return rows


def _main_algo(p: Prediction) -> str:
    return max(p.buckets, key=lambda b: b.nbytes).algorithm if p.buckets else "-"


def sweep_table(rows: List[Dict[str, Any]]) -> str:
    """Markdown table of a sweep."""
    lines = ["| link Gbit/s | hosts | ppn | ranks | step ms [interval] | compute | exposed comm | wait | speedup | "
             "efficiency | largest bucket |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['gbit']:.3g} | {r['hosts']} | {r['per_host']} | {r['ranks']} | {r['step_ms']:.2f} "
                     f"[{r['low_ms']:.2f}, {r['high_ms']:.2f}] | {r['compute_ms']:.2f} | {r['comm_ms']:.2f} | "
                     f"{r['wait_ms']:.2f} | {r['speedup']:.2f}x | {r['efficiency']:.0%} | {r['algorithm']} |")
    return "\n".join(lines)


def compare(w: Workload, paths: Sequence[str], args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Each measured run (a trainer report) predicted from `w` on its own topology."""
    rows = []
    for path in paths:
        m = load(path)
        if [b.nbytes for b in m.buckets] != [b.nbytes for b in w.buckets]:
            raise ValueError(f"{path}: its gradient buckets {[b.nbytes for b in m.buckets]} are not the workload's "
                             f"{[b.nbytes for b in w.buckets]} (a different model or --bucket-kb)")
        t = recorded_target(m)
        params = t.params if args.link_gbit is None and args.link_latency_us is None else \
            replace(t.params, net=Link(t.params.net.alpha if args.link_latency_us is None else args.link_latency_us * 1e-6,
                                       t.params.net.beta if args.link_gbit is None else 8e-9 / args.link_gbit))
        t = replace(t, params=params, algo=args.algo, global_batch=m.global_batch,
                    shared_cores=args.shared_cores or t.shared_cores)
        p = predict(w, t, fit=not args.no_fit)
        rows.append({"run": path, "ranks": m.ranks, "hosts": t.topo.nhosts, "host_of": m.host_of,
                     "predicted_ms": p.step_ms, "low_ms": p.low_ms, "high_ms": p.high_ms, "measured_ms": m.step_ms,
                     "error": (p.step_ms - m.step_ms) / m.step_ms, "prediction": p.to_dict(),
                     "measured": m.measured})
    return rows


def compare_table(rows: List[Dict[str, Any]]) -> str:
    """Markdown table of predicted vs measured, with mean and max absolute error."""
    lines = ["| run | ranks | hosts | placement | predicted ms [interval] | measured ms | error |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['ranks']} | {r['hosts']} | {''.join(map(str, r['host_of']))} | "
                     f"{r['predicted_ms']:.1f} [{r['low_ms']:.1f}, {r['high_ms']:.1f}] | {r['measured_ms']:.1f} | "
                     f"{r['error']:+.0%} |")
    errs = [abs(r["error"]) for r in rows]
    lines.append(f"\nmean |error| {sum(errs) / len(errs):.0%}, max |error| {max(errs):.0%} over {len(errs)} run(s)")
    return "\n".join(lines)


def plot_compare(rows: List[Dict[str, Any]], path: str, title: str) -> None:
    """Predicted (with its interval) against measured step time, one point per run."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=(5.5, 5))
    ax = fig.subplots()
    top = max(max(r["measured_ms"], r["high_ms"]) for r in rows) * 1.1
    ax.plot([0, top], [0, top], color="grey", lw=0.8, label="predicted = measured")
    ax.fill_between([0, top], [0, top * 0.75], [0, top * 1.25], color="grey", alpha=0.12, label="+-25%")
    for r in rows:
        ax.errorbar(r["measured_ms"], r["predicted_ms"], yerr=[[r["predicted_ms"] - r["low_ms"]],
                                                               [r["high_ms"] - r["predicted_ms"]]], fmt="o", capsize=3)
        ax.annotate(f"{r['ranks']}r/{r['hosts']}h", (r["measured_ms"], r["predicted_ms"]), fontsize=7,
                    xytext=(4, -8), textcoords="offset points")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("measured step (ms, median)")
    ax.set_ylabel("predicted step (ms)")
    ax.set_title(title, fontsize=9)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_sweep(rows: List[Dict[str, Any]], path: str) -> None:
    """Predicted step time and scaling efficiency over ranks, one line per (link rate, ppn)."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=(10, 4))
    a, b = fig.subplots(1, 2)
    for key in sorted({(r["gbit"], r["per_host"]) for r in rows}):
        pts = sorted((r["ranks"], r["step_ms"], r["efficiency"]) for r in rows if (r["gbit"], r["per_host"]) == key)
        label = f"{key[0]:.3g} Gbit/s, {key[1]} per host"
        a.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
        b.plot([p[0] for p in pts], [100 * p[2] for p in pts], "o-", label=label)
    a.set_xlabel("ranks")
    a.set_ylabel("predicted step (ms)")
    b.set_xlabel("ranks")
    b.set_ylabel("scaling efficiency (%)")
    a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


TRACE_REFUSES = ("batch_size", "algo", "no_fit", "measured")


def trace_main(args: argparse.Namespace) -> int:
    """`pycoll predict --trace DIR [target options]`, or with --sweep over hosts and link rates."""
    given = [f"--{name.replace('_', '-')}" for name in TRACE_REFUSES if getattr(args, name)]
    if given:
        print(f"pycoll predict: {', '.join(given)} work with --workload only, not with --trace", file=sys.stderr)
        return 2
    alone = [f"--{name.replace('_', '-')}" for name in ("sweep_gbit", "plot", "data_parallel") if getattr(args, name)]
    if alone and not args.sweep:
        print(f"pycoll predict: {', '.join(alone)} work with --sweep (with --trace)", file=sys.stderr)
        return 2
    trace = trace_replay.load(args.trace)
    if args.sweep:
        return trace_sweep_main(trace, args)
    retargeted = (args.hosts is not None or args.ppn is not None or args.placement != "packed" or args.topo_file
                  or args.link_gbit is not None or args.link_latency_us is not None or args.shared_cores
                  or args.cores is not None)
    if retargeted:
        spec = load_topo_file(args.topo_file) if args.topo_file else {}
        recorded = trace_target.recorded_cluster(trace, trace_target.base_params(spec))
        target = trace_target.target_cluster(
            trace, hosts=args.hosts, ppn=args.ppn, placement=args.placement, topo_file=args.topo_file,
            link_gbit=args.link_gbit, link_latency_us=args.link_latency_us, shared_cores=args.shared_cores,
            cores=args.cores)
        out = trace_target.whatif(trace, target, recorded)
    else:
        target = recorded = trace_target.recorded_cluster(trace, trace_target.base_params())
        out = trace_replay.replay(trace)
        out["mode"] = "replay"
        typical = trace_replay.replay(trace, trace_replay.typical_costs(trace))
        out["typical"] = {"step_ms": typical["step_ms"], "error": typical["error"], "durations": typical["durations"]}
    out["links"] = trace_links.links(trace, out.pop("_timeline"), out["median_step"], out["slowest_rank"], target,
                                     recorded)
    print(json.dumps(out, indent=1) if args.json else describe_trace(out))
    return 0


def describe_trace(out: Dict[str, Any]) -> str:
    """The text answer of `--trace`."""
    lines = [f"trace {out['trace']}: {out['ranks']} ranks" + (f", job {out['job']}" if out["job"] else "")]
    lines += [f"note: {n}" for n in out["notes"]]
    what = (f"median of {len(out['steps'])} marked steps (steps {out['steps'][0]}-{out['steps'][-1]})"
            if out["marked"] else "the whole recorded span")
    sp = out["split"]
    split = (f"compute {sp['compute_ms']:.2f} + exposed comm {sp['comm_ms']:.2f} + wait {sp['wait_ms']:.2f} "
             f"(rank {out['slowest_rank']}, the slowest in step {out['median_step']})" if out["marked"] else
             f"compute {sp['compute_ms']:.2f} + exposed comm {sp['comm_ms']:.2f} + wait {sp['wait_ms']:.2f} "
             f"(rank {out['slowest_rank']})")
    lines_why = _why_lines(out["why"], out["marked"]) + trace_links.describe(out["links"])
    if out["mode"] == "replay":
        lines.append(f"replayed ({out['durations']}): {out['step_ms']:.2f} ms, measured {out['measured_step_ms']:.2f} "
                     f"ms ({what}): error {out['error']:+.1%}")
        lines.append(f"  = {split}")
        ty = out["typical"]
        lines.append(f"replayed with {ty['durations']}: {ty['step_ms']:.2f} ms: error {ty['error']:+.1%}")
        return "\n".join(lines + lines_why)
    t, rec = out["target"], out["recorded"]
    lines.append(f"target: {t['ranks']} ranks on {t['hosts']} host(s) (host of each rank {t['host_of']}), net {t['net']}"
                 + (f", all ranks on {t['shared_cores']} shared cores" if t["shared_cores"] else
                    f", {t['cores'][0]} cores per host")
                 + (f", racks {t['racks']} (host by host)" if t["racks"] else ""))
    lines.append(f"predicted {out['step_ms']:.2f} ms ({what}) = {split}")
    lines.append(f"  recorded on {rec['hosts']} host(s): measured {out['measured_step_ms']:.2f} ms, replayed "
                 f"{out['replay_step_ms']:.2f} ms; compute x{max(out['compute_factor'].values()):.2g} for core sharing")
    info = out["repriced"]
    lines.append(f"  calls repriced {info['repriced']}, kept as recorded {info['kept']}"
                 + "".join(f"; {k} x{v}" for k, v in sorted(info["algorithms"].items())))
    if info["unmodeled"]:
        lines.append("  kept as recorded (no model): " + ", ".join(f"{k} x{v}" for k, v in info["unmodeled"].items()))
    return "\n".join(lines + lines_why)


def trace_sweep_main(trace: trace_replay.Trace, args: argparse.Namespace) -> int:
    """`pycoll predict --trace DIR --sweep [--sweep-gbit G,..] [--plot OUT.png] [--json]`."""
    gbits: List[Optional[float]] = [args.link_gbit]
    if args.sweep_gbit:
        try:
            gbits = [float(g) for g in args.sweep_gbit.split(",")]
        except ValueError:
            raise ValueError(f"--sweep-gbit {args.sweep_gbit}: not a comma-separated list of rates (1,10,100)") \
                from None
    out = trace_sweep.sweep(trace, hosts=args.hosts, ppn=args.ppn, gbits=gbits, latency_us=args.link_latency_us,
                            placement=args.placement, cores=args.cores, shared_cores=args.shared_cores,
                            topo=load_topo_file(args.topo_file) if args.topo_file else None,
                            assert_dp=args.data_parallel)
    if args.plot:
        trace_sweep.plot(out, args.plot)
    print(json.dumps(out, indent=1) if args.json else trace_sweep.render(out))
    return 0


PATH_LINES = 24  # the text answer shows this many items of a critical path (--json: all of them)


def _why_lines(why: Dict[str, Any], marked: bool) -> List[str]:
    """The critical path of the median step and who waited for whom, as text."""
    path = why["critical_path"]
    what = f"step {why['step']}" if marked else "the span"
    lines = [f"why: the critical path of {what} (ending on rank {why['rank']}): compute {why['path_compute_ms']:.2f} ms"
             f" + calls {why['path_comm_ms']:.2f} ms, in order (ms from the step's start):"]
    shown = path if len(path) <= PATH_LINES else path[:PATH_LINES // 2] + [None] + path[-PATH_LINES // 2:]
    for p in shown:
        if p is None:
            lines.append(f"    ... {len(path) - PATH_LINES} more (--json has them all)")
            continue
        lines.append(f"  {p['t0_ms']:9.2f} {p['t1_ms']:9.2f}  rank {p['rank']:<4} {p['what']}")
    for r, peers in why["waiting_for_ms"].items():
        lines.append(f"  rank {r} waited for " + ", ".join(f"rank {p} {ms:.2f} ms" for p, ms in
                                                          sorted(peers.items(), key=lambda kv: -kv[1])))
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if (args.hosts is not None and args.hosts < 1) or (args.ppn is not None and args.ppn < 1):
        print("pycoll predict: --hosts and --ppn must be at least 1", file=sys.stderr)
        return 2
    if args.data_parallel and not args.trace:
        print("pycoll predict: --data-parallel works with --trace --sweep (a --workload is data parallel)",
              file=sys.stderr)
        return 2
    if args.trace:
        try:
            return trace_main(args)
        except (TraceError, EnvError, ValueError, OSError) as e:
            print(f"pycoll predict: {e}", file=sys.stderr)
            return 2
    args.hosts = 1 if args.hosts is None else args.hosts
    args.ppn = 1 if args.ppn is None else args.ppn
    try:
        w = load(args.workload)
        if args.measured:
            rows = compare(w, args.measured, args)
            errs = [abs(r["error"]) for r in rows]
            if args.plot:
                plot_compare(rows, args.plot, f"pycoll predict from {args.workload}")
            print(json.dumps({"runs": rows, "mean_abs_error": sum(errs) / len(errs), "max_abs_error": max(errs)},
                             indent=1) if args.json else compare_table(rows))
        elif args.sweep:
            rows = sweep(w, args)
            if args.plot:
                plot_sweep(rows, args.plot)
            print(json.dumps({"rows": rows}, indent=1) if args.json else sweep_table(rows))
        else:
            t = target_for(w, args, args.hosts, args.ppn)
            p = predict(w, t, fit=not args.no_fit)
            print(json.dumps(p.to_dict(), indent=1) if args.json else describe(p, t))
    except (WorkloadError, EnvError, ValueError, OSError) as e:
        print(f"pycoll predict: {e}", file=sys.stderr)
        return 2
    return 0

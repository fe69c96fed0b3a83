"""Measure the jobs of examples/parallel/ on 1 host and on 2 emulated hosts and write
docs/learning_path.json (every run's JSON and traffic report); docs/learning-path.md shows the tables.

    sudo PYTHONPATH=. python docs/make_learning_path.py [--only hybrid,pp,serve,ep] [--repeats 2]

Each job runs as a user runs it: `pycoll run -n N python examples/parallel/JOB.py --backend B --json F`
on this host, or `pycoll run --nnodes 2 --node-rank i ...` in each of two network namespaces
(tests/netns_cluster.py) joined by a tbf-limited link (rate) or by the userspace wire (one-way delay,
tests/netns_wire.py). The link's rate or round trip is measured in the same run. pycoll runs are traced
(`--trace-dir`) and `pycoll trace DIR --traffic --json` gives their bytes within and between hosts.
Runs of the two backends (and of the two placements) alternate, and the median of --repeats is kept.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from netns_cluster import Cluster  # noqa: E402
from parallel_cluster import round_trip_ms, run_cluster, run_local  # noqa: E402

OUT = os.path.join(HERE, "learning_path.json")
DOC = os.path.join(HERE, "learning-path.md")
SYSCTLS = {"net.ipv4.tcp_slow_start_after_idle": "0"}
BACKENDS = ("pycoll", "gloo")

# the job shapes: small enough for 2 cores, large enough that what each section is about shows
HYBRID = ["--dp-style", "ddp", "--dim", "32", "--heads", "4", "--mlp-ratio", "2", "--seq", "128", "--batch", "128",
          "--steps", "8"]
PP = ["--layers", "4", "--dim", "256", "--seq", "64", "--batch", "128", "--steps", "4"]
SERVE = ["--layers", "2", "--hidden", "64", "--heads", "4", "--batch", "1", "--prompt-len", "16",
         "--new-tokens", "24", "--steps", "3"]
PLACEMENTS = {"dp": ["--tp", "1"], "inside": ["--tp", "2", "--tp-inside-host"],
              "across": ["--tp", "2", "--tp-across-hosts"]}
EP = ["--tokens", "1024", "--hidden", "128", "--ffn", "512", "--steps", "4"]


def _repeat(n: int, runs: Dict[str, Callable[[], Dict[str, Any]]]) -> Dict[str, List[Dict[str, Any]]]:
    """Every labelled run `n` times, the labels taking turns (a slow spell hits them alike)."""
    got: Dict[str, List[Dict[str, Any]]] = {k: [] for k in runs}
    for _ in range(n):
        for label, fn in runs.items():
            t = time.monotonic()
            got[label].append(fn())
            print(f"  {label}: {time.monotonic() - t:.0f} s, step {got[label][-1]['result']['step_ms']:.1f} ms",
                  flush=True)
    return got


def _median_run(runs: List[Dict[str, Any]], key: str = "step_ms") -> Dict[str, Any]:
    """The run whose `key` is the median (the lower middle one for an even count), with every value."""
    ordered = sorted(runs, key=lambda j: j["result"][key])
    pick = dict(ordered[(len(ordered) - 1) // 2])
    pick["all"] = [j["result"][key] for j in runs]
    return pick


def hybrid(repeats: int) -> Dict[str, Any]:
    """DP alone and TP x DP on 4 ranks: one host, and 2 hosts x 2 ranks at 1 Gbit/s with TP inside or
    across hosts."""
    out: Dict[str, Any] = {"args": HYBRID}
    one = _repeat(repeats, {f"{place}/{b}": (lambda o=opts, b=b: run_local("hybrid.py", 4, [*o, *HYBRID], b,
                                                                           trace=b == "pycoll"))
                            for place, opts in (("dp", PLACEMENTS["dp"]), ("tp", PLACEMENTS["inside"]))
                            for b in BACKENDS})
    out["one_host"] = {k: _median_run(r) for k, r in one.items()}
    with Cluster(2, rate_mbit=1000, sysctls=SYSCTLS) as c:
        out["link_Bps"] = min(c.link_rate(0, 1), c.link_rate(1, 0))
        runs = {}
        for place, opts in PLACEMENTS.items():
            for b in BACKENDS:
                runs[f"{place}/{b}"] = (lambda o=opts, b=b: run_cluster(c, "hybrid.py", 2, [*o, *HYBRID], b,
                                                                        trace=b == "pycoll"))
        two = _repeat(repeats, runs)
    out["two_hosts"] = {k: _median_run(r) for k, r in two.items()}
    return out


def pp(repeats: int) -> Dict[str, Any]:
    """2 stages, GPipe and 1F1B, m = 1, 4, 8: on one host and with one stage per host (1 Gbit/s)."""
    out: Dict[str, Any] = {"args": PP, "one_host": {}, "two_hosts": {}}
    # torch's Schedule1F1B refuses fewer microbatches than stages; at m = 1 it would be GPipe anyway
    cases = [(s, m) for s in ("gpipe", "1f1b") for m in (1, 4, 8) if s == "gpipe" or m >= 2]

    def runs(go: Callable[[List[str], str], Dict[str, Any]]) -> Dict[str, Any]:
        return {f"{s}/m{m}/{b}": (lambda s=s, m=m, b=b: go(["--schedule", s, "--microbatches", str(m), *PP], b))
                for s, m in cases for b in BACKENDS}
    got = _repeat(repeats, runs(lambda a, b: run_local("pp.py", 2, a, b)))
    out["one_host"] = {k: _median_run(r) for k, r in got.items()}
    with Cluster(2, rate_mbit=1000, sysctls=SYSCTLS) as c:
        out["link_Bps"] = min(c.link_rate(0, 1), c.link_rate(1, 0))
        got = _repeat(repeats, runs(lambda a, b: run_cluster(c, "pp.py", 1, a, b)))
    out["two_hosts"] = {k: _median_run(r) for k, r in got.items()}
    return out


def serve(repeats: int) -> Dict[str, Any]:
    """TP decoding on 2 ranks: one host (pycoll vs gloo), then one rank per host with one-way delay d."""
    out: Dict[str, Any] = {"args": SERVE, "two_hosts": {}}
    got = _repeat(repeats, {b: (lambda b=b: run_local("serve.py", 2, SERVE, b, trace=b == "pycoll"))
                            for b in BACKENDS})
    out["one_host"] = {b: _median_run(r, "tpot_ms") for b, r in got.items()}
    for d in (0.0, 1.0, 4.0):
        with Cluster(2, delay_ms=d, sysctls=SYSCTLS) as c:
            rtt = round_trip_ms(c)
            got = _repeat(repeats, {b: (lambda b=b: run_cluster(c, "serve.py", 1, SERVE, b, trace=b == "pycoll"))
                                    for b in BACKENDS})
            rtt_after = round_trip_ms(c)
        out["two_hosts"][f"{d:g}"] = {"rtt_ms": [rtt, rtt_after],
                                      **{b: _median_run(r, "tpot_ms") for b, r in got.items()}}
    return out


def ep(repeats: int) -> Dict[str, Any]:
    """MoE with 8 experts on 4 ranks, uniform and skewed router: one host, and 2 hosts x 2 at 1 Gbit/s."""
    out: Dict[str, Any] = {"args": EP}

    def runs(go: Callable[[List[str], str], Dict[str, Any]]) -> Dict[str, Any]:
        return {f"{skew}/{b}": (lambda s=skew, b=b: go(EP + (["--skew"] if s == "skew" else []), b))
                for skew in ("uniform", "skew") for b in BACKENDS}
    got = _repeat(repeats, runs(lambda a, b: run_local("ep.py", 4, a, b, trace=b == "pycoll")))
    out["one_host"] = {k: _median_run(r) for k, r in got.items()}
    with Cluster(2, rate_mbit=1000, sysctls=SYSCTLS) as c:
        out["link_Bps"] = min(c.link_rate(0, 1), c.link_rate(1, 0))
        got = _repeat(repeats, runs(lambda a, b: run_cluster(c, "ep.py", 2, a, b, trace=b == "pycoll")))
    out["two_hosts"] = {k: _median_run(r) for k, r in got.items()}
    return out


# -- the page -----------------------------------------------------------------------------------------
def _ms(v: Any) -> str:
    return "—" if v is None else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def _mib(v: Any) -> str:
    return "—" if v is None else f"{v / 2**20:.2f} MiB" if v >= 2**17 else f"{v / 2**10:.1f} KiB"


def _between(job: Dict[str, Any]) -> Any:
    t = job.get("traffic")
    return None if not t else t["median_step"]["total"]["bytes_between"]


def _within(job: Dict[str, Any]) -> Any:
    t = job.get("traffic")
    return None if not t else t["median_step"]["total"]["bytes_within"]


def _algorithms(job: Dict[str, Any], call: str) -> str:
    t = job.get("traffic")
    if not t:
        return "—"
    return ", ".join(sorted({c["algorithm"] for c in t["median_step"]["collectives"]
                             if c["call"] == call and c["calls"]}))


def _spread(job: Dict[str, Any]) -> str:
    return f"{min(job['all']):.1f}-{max(job['all']):.1f}" if len(job["all"]) > 1 else ""


def hybrid_section(d: Dict[str, Any]) -> List[str]:
    two, one = d["two_hosts"], d["one_host"]
    rows = ["| where | ranks | step ms, pycoll (range) | step ms, gloo | gloo / pycoll | sent between hosts per step "
            "| sent within hosts per step |", "|---|---|---|---|---|---|---|"]
    for label, key, src in (("1 host, DP 4", "dp", one), ("1 host, TP 2 x DP 2", "tp", one),
                            ("2 hosts, DP 4", "dp", two), ("2 hosts, TP inside hosts", "inside", two),
                            ("2 hosts, TP across hosts", "across", two)):
        p, g = src[f"{key}/pycoll"], src[f"{key}/gloo"]
        rows.append(f"| {label} | {p['result']['mesh']} | {_ms(p['result']['step_ms'])} ({_spread(p)}) | "
                    f"{_ms(g['result']['step_ms'])} | {g['result']['step_ms'] / p['result']['step_ms']:.2f} | "
                    f"{_mib(_between(p))} | {_mib(_within(p))} |")
    inside, across = two["inside/pycoll"]["result"]["step_ms"], two["across/pycoll"]["result"]["step_ms"]
    ginside, gacross = two["inside/gloo"]["result"]["step_ms"], two["across/gloo"]["result"]["step_ms"]
    rows.append("")
    rows.append(f"TP across hosts / TP inside hosts: **{across / inside:.2f}x** on pycoll, {gacross / ginside:.2f}x on "
                f"gloo (goal: at least 1.5x); bytes between hosts per step {_mib(_between(two['across/pycoll']))} "
                f"against {_mib(_between(two['inside/pycoll']))}. Link measured in the same run: "
                f"{d['link_Bps'] * 8e-9:.2f} Gbit/s.")
    return rows


def pp_section(d: Dict[str, Any]) -> List[str]:
    rows = ["| schedule | m | theory (p-1)/(m+p-1) | 1 host: pycoll | 1 host: gloo | 2 hosts: pycoll | 2 hosts: gloo "
            "| pycoll within 20%? (1 host, 2 hosts) | pycoll's compute alone (1 host, 2 hosts) |",
            "|---|---|---|---|---|---|---|---|---|"]
    starred = False
    for key in d["one_host"]:
        s, m, b = key.split("/")
        if b != "pycoll":
            continue
        theory = d["one_host"][key]["result"]["bubble_theory"]
        vals = [d[where][f"{s}/{m}/{b2}"]["result"]["bubble"] for where in ("one_host", "two_hosts")
                for b2 in BACKENDS]
        alone = [d[where][key]["result"].get("bubble_compute_only") for where in ("one_host", "two_hosts")]
        ok = [_in_band(v, theory, a) for v, a in zip((vals[0], vals[2]), alone)]
        starred = starred or any(o.endswith("*") for o in ok)
        rows.append(f"| {s} | {m[1:]} | {theory:.3f} | {vals[0]:.3f} | {vals[1]:.3f} | {vals[2]:.3f} | {vals[3]:.3f} "
                    f"| {ok[0]}, {ok[1]} | {', '.join('-' if a is None else f'{a:.3f}' for a in alone)} |")
    if starred:
        rows += ["", "\\* the run's compute alone (last column) was already more than 20% off the formula: this "
                 "machine's uneven compute, before any link or bookkeeping."]
    return rows


def _in_band(bubble: float, theory: float, alone: Optional[float]) -> str:
    """yes / no for a measured bubble against the formula's 20% band; no* where the compute alone was outside it."""
    if abs(bubble - theory) <= 0.2 * theory:
        return "yes"
    return "no*" if alone is not None and abs(alone - theory) > 0.2 * theory else "no"


def ep_section(d: Dict[str, Any]) -> List[str]:
    rows = ["| where | router | backend | step ms | all-to-all bytes per step | slowest rank in all-to-all ms "
            "| busiest rank's extra expert time (wait) ms | load imbalance |", "|---|---|---|---|---|---|---|---|"]
    for where, label in (("one_host", "1 host"), ("two_hosts", "2 hosts")):
        for key, job in d[where].items():
            r = job["result"]
            skew, b = key.split("/")
            rows.append(f"| {label} | {skew} | {b} | {_ms(r['step_ms'])} | {_mib(r['a2a_bytes_per_step'])} | "
                        f"{_ms(max(r['a2a_ms']))} | {_ms(r['wait_ms'])} | {r['load_imbalance']:.2f} |")
    return rows


def cross_rounds(algorithm: str, nbytes: float, hosts: int = 2) -> float:
    """Message rounds of `algorithm` that cross hosts, for an allreduce of `nbytes` on one rank per host
    (the tuner's pattern: what it prices)."""
    from pycoll.topology import Topology
    from pycoll.tuner import DEFAULT, Tuner
    topo = Topology.from_hosts([f"h{i}" for i in range(hosts)])
    return sum(r.msgs for r in Tuner(DEFAULT).pattern("allreduce", algorithm, nbytes, topo)
               if any(topo.host_of[a] != topo.host_of[b] for a, b, _ in r.pairs))


def serve_section(d: Dict[str, Any]) -> List[str]:
    one = d["one_host"]
    rows = [f"One host, 2 ranks: time per output token p50 {_ms(one['pycoll']['result']['tpot_ms'])} ms on pycoll, "
            f"{_ms(one['gloo']['result']['tpot_ms'])} ms on gloo (p99 {_ms(one['pycoll']['result']['tpot_p99_ms'])} "
            f"and {_ms(one['gloo']['result']['tpot_p99_ms'])}).", "",
            "| one-way delay d | measured round trip ms | pycoll: p50 / p99 ms | gloo: p50 / p99 ms | pycoll's "
            "algorithm | its rounds across hosts | pycoll p50 growth over d=0 | predicted: allreduces x rounds x "
            "measured one-way | ratio |", "|---|---|---|---|---|---|---|---|---|"]
    base = d["two_hosts"]["0"]["pycoll"]["result"]["tpot_ms"]
    for key, row in d["two_hosts"].items():
        p, g = row["pycoll"], row["gloo"]
        algo = _algorithms(p, "allreduce")
        nbytes = p["result"]["allreduce_bytes_per_token"] / max(1, p["result"]["allreduces_per_token"])
        rounds = cross_rounds(algo, nbytes) if "," not in algo and algo != "—" else float("nan")
        one_way = (statistics_median(row["rtt_ms"]) - statistics_median(d["two_hosts"]["0"]["rtt_ms"])) / 2
        growth = p["result"]["tpot_ms"] - base
        predicted = p["result"]["allreduces_per_token"] * rounds * one_way
        ratio = f"{growth / predicted:.2f}" if predicted > 0 else "—"
        rows.append(f"| {key} ms | {' / '.join(f'{v:.2f}' for v in row['rtt_ms'])} | {_ms(p['result']['tpot_ms'])} / "
                    f"{_ms(p['result']['tpot_p99_ms'])} | {_ms(g['result']['tpot_ms'])} / {_ms(g['result']['tpot_p99_ms'])} "
                    f"| {algo} | {rounds:g} | {growth:.2f} | {p['result']['allreduces_per_token']:g} x {rounds:g} x "
                    f"{one_way:.2f} = {predicted:.2f} | {ratio} |")
    return rows


def statistics_median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _runs(section: Dict[str, Any]) -> str:
    n = len(next(iter(section["one_host"].values()))["all"])
    return {1: "one run per configuration", 2: "two runs per configuration, the faster shown"}.get(
        n, f"{n} runs per configuration, the median run shown")


def render(data: Dict[str, Any]) -> str:
    """The tables of docs/learning-path.md, between its markers, from learning_path.json."""
    parts = []
    for name, fn in (("hybrid", hybrid_section), ("pp", pp_section), ("ep", ep_section), ("serve", serve_section)):
        if name in data:
            m = data[name]["machine"]
            parts.append((name, "\n".join(fn(data[name]) + [
                "", f"_Measured {m['date']} on this project's {m['cpus']}-core VM (load average {m['load_before']:.1f} "
                    f"before), {_runs(data[name])}; `{os.path.basename(__file__)} --only {name}` re-measures it._"])))
    return parts


def write_doc(data: Dict[str, Any]) -> None:
    """Replace each `<!-- table:NAME -->...<!-- /table -->` block of docs/learning-path.md."""
    import re
    with open(DOC) as fh:
        text = fh.read()
    for name, table in render(data):
        text = re.sub(rf"(<!-- table:{name} -->\n).*?(\n<!-- /table -->)", lambda m: m.group(1) + table + m.group(2),
                      text, flags=re.S)
    with open(DOC, "w") as fh:
        fh.write(text)


SECTIONS = {"hybrid": hybrid, "pp": pp, "serve": serve, "ep": ep}


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections (default all)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each configuration (default 3)")
    p.add_argument("--render", action="store_true", help="only rewrite the page's tables from the JSON")
    args = p.parse_args(argv)
    if args.render:
        write_doc(json.load(open(OUT)))
        return 0
    data = json.load(open(OUT)) if os.path.exists(OUT) else {}
    for name in args.only.split(","):
        print(f"== {name}", flush=True)
        t = time.monotonic()
        data[name] = SECTIONS[name](args.repeats)
        data[name]["machine"] = {"cpus": os.cpu_count(), "load_before": os.getloadavg()[0],
                                 "seconds": time.monotonic() - t, "date": time.strftime("%Y-%m-%d %H:%M")}
        with open(OUT, "w") as fh:
            json.dump(data, fh, indent=1, default=str)
        write_doc(data)
    print(f"wrote {OUT} and {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

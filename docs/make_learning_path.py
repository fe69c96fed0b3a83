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
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from netns_cluster import Cluster  # noqa: E402
from parallel_cluster import round_trip_ms, run_cluster, run_local  # noqa: E402

OUT = os.path.join(HERE, "learning_path.json")
SYSCTLS = {"net.ipv4.tcp_slow_start_after_idle": "0"}
BACKENDS = ("pycoll", "gloo")

# the job shapes: small enough for 2 cores, large enough that what each section is about shows
HYBRID = ["--dp-style", "ddp", "--dim", "32", "--heads", "4", "--mlp-ratio", "2", "--seq", "128", "--batch", "64",
          "--steps", "4"]
PP = ["--layers", "4", "--dim", "64", "--seq", "32", "--batch", "64", "--steps", "4"]
SERVE = ["--layers", "2", "--hidden", "64", "--heads", "4", "--batch", "1", "--prompt-len", "16",
         "--new-tokens", "24", "--steps", "3"]
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
    """TP x DP on 4 ranks: one host, and 2 hosts x 2 ranks at 1 Gbit/s with TP inside or across hosts."""
    out: Dict[str, Any] = {"args": HYBRID}
    one = _repeat(repeats, {b: (lambda b=b: run_local("hybrid.py", 4, HYBRID, b, trace=b == "pycoll"))
                            for b in BACKENDS})
    out["one_host"] = {b: _median_run(r) for b, r in one.items()}
    with Cluster(2, rate_mbit=1000, sysctls=SYSCTLS) as c:
        out["link_Bps"] = min(c.link_rate(0, 1), c.link_rate(1, 0))
        runs = {}
        for place in ("inside", "across"):
            for b in BACKENDS:
                runs[f"{place}/{b}"] = (lambda p=place, b=b: run_cluster(
                    c, "hybrid.py", 2, [f"--tp-{p}-host" if p == "inside" else "--tp-across-hosts", *HYBRID], b,
                    trace=b == "pycoll"))
        two = _repeat(repeats, runs)
    out["two_hosts"] = {k: _median_run(r) for k, r in two.items()}
    return out


def pp(repeats: int) -> Dict[str, Any]:
    """2 stages, GPipe and 1F1B, m = 1, 4, 8: on one host and with one stage per host (1 Gbit/s)."""
    out: Dict[str, Any] = {"args": PP, "one_host": {}, "two_hosts": {}}
    cases = [(s, m) for s in ("gpipe", "1f1b") for m in (1, 4, 8)]

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


SECTIONS = {"hybrid": hybrid, "pp": pp, "serve": serve, "ep": ep}


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections (default all)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each configuration (default 3)")
    args = p.parse_args(argv)
    data = json.load(open(OUT)) if os.path.exists(OUT) else {}
    for name in args.only.split(","):
        print(f"== {name}", flush=True)
        t = time.monotonic()
        data[name] = SECTIONS[name](args.repeats)
        data[name]["machine"] = {"cpus": os.cpu_count(), "load_before": os.getloadavg()[0],
                                 "seconds": time.monotonic() - t, "date": time.strftime("%Y-%m-%d %H:%M")}
        with open(OUT, "w") as fh:
            json.dump(data, fh, indent=1, default=str)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

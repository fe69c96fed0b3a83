"""Validation of `pycoll predict` on emulated clusters (tests/netns_cluster.py): record the trainer's
workload, predict other clusters from it, run them and compare. Used by tests/test_predict_cluster.py
(slow) and docs/make_predict.py (which writes docs/predict.md).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any, Dict, List, Optional, Sequence

from netns_cluster import Cluster, ClusterError

from pycoll import config

SYSCTLS = {"net.ipv4.tcp_slow_start_after_idle": config.get("PYCOLL_SSAI")}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train_record(comm: Any, argv: List[str]) -> Optional[Dict[str, Any]]:
    """Inside the cluster: `python -m pycoll.trainer ARGV` on `comm`, returning rank 0's workload record."""
    from pycoll.trainer.__main__ import build_parser, config_from_args
    from pycoll.trainer.loop import train
    from pycoll.trainer.workload import record
    cfg = config_from_args(build_parser().parse_args(argv))
    result = train(comm, cfg)
    return record(comm, cfg, result)


def layout(hosts: int, per_host: int, how: str) -> List[int]:
    """Host of each rank: packed or interleaved (rank r on host r mod H)."""
    return [r // per_host for r in range(hosts * per_host)] if how == "packed" else \
        [r % hosts for r in range(hosts * per_host)]


def measure_run(hosts: int, per_host: int, how: str, rate_mbit: Optional[float], trainer: Sequence[str],
                out: str, tuner_cache: str, racks: Optional[Dict[str, Any]] = None,
                env: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """Build the cluster, measure its link rate (hosts > 1), train and record; writes the record to `out`.
    `racks` {"second": hosts behind a second switch, "uplink_mbit": its uplink, "file": where to write the
    PYCOLL_TOPO_FILE, "ranks": {rack: [ranks]}}: add_racks, then declare them with the uplink's measured rate."""
    env = {"PYCOLL_TUNER_CACHE": tuner_cache, "PYTHONPATH": os.environ.get("PYTHONPATH", REPO), **(env or {})}
    with Cluster(hosts=hosts, rate_mbit=rate_mbit if hosts > 1 else None, sysctls=SYSCTLS) as cluster:
        if racks:
            add_racks(cluster, racks["second"], racks["uplink_mbit"])
            uplink = min(cluster.link_rate(0, racks["second"][0]), cluster.link_rate(racks["second"][0], 0))
            with open(racks["file"], "w") as fh:
                json.dump({"racks": {k: {"ranks": v, "uplink_gbit": uplink * 8e-9} for k, v in racks["ranks"].items()}},
                          fh)
            env["PYCOLL_TOPO_FILE"] = racks["file"]
        rate = min(cluster.link_rate(0, 1), cluster.link_rate(1, 0)) if hosts > 1 else None
        rec = cluster.run("predict_cluster:train_record", layout(hosts, per_host, how), [list(trainer)],
                          env=env, timeout=500)[0]
    rec["cluster"] = {"hosts": hosts, "per_host": per_host, "placement": how, "rate_mbit": rate_mbit,
                      "link_Bps": rate, "racks": racks, "env": {k: v for k, v in env.items() if k == "PYCOLL_ALGO"}}
    with open(out, "w") as fh:
        json.dump(rec, fh, indent=1)
    return rec


def predict_runs(workload: str, runs: Sequence[str], gbit: float, extra: Sequence[str] = ()) -> Dict[str, Any]:
    """`pycoll predict --workload W --measured RUNS --link-gbit G --json` (a real process, as a user runs it)."""
    cmd = [sys.executable, "-m", "pycoll", "predict", "--workload", workload, "--measured", *runs,
           "--link-gbit", f"{gbit:.6g}", "--json", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=os.environ.get("PYTHONPATH", REPO)), timeout=120)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr}")
    return json.loads(proc.stdout)


def table(result: Dict[str, Any], label: Dict[str, str]) -> str:
    """Markdown: predicted, measured and error per run, then mean and max |error|."""
    lines = ["| run | ranks | placement | predicted ms [interval] | measured ms | error | predicted split (compute + "
             "comm + wait) | measured split (medians) |", "|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        p, m = r["prediction"], r["measured"]
        lines.append(f"| {label.get(r['run'], r['run'])} | {r['ranks']} | {''.join(map(str, r['host_of']))} | "
                     f"{r['predicted_ms']:.1f} [{r['low_ms']:.1f}, {r['high_ms']:.1f}] | {r['measured_ms']:.1f} | "
                     f"{r['error']:+.0%} | {p['compute_ms']:.1f} + {p['comm_ms']:.1f} + {p['wait_ms']:.1f} | "
                     f"{m['compute_ms']:.1f} + {m['comm_ms']:.1f} + {m['wait_ms']:.1f} |")
    lines.append(f"\nmean \\|error\\| **{result['mean_abs_error']:.0%}**, max \\|error\\| "
                 f"**{result['max_abs_error']:.0%}** over {len(result['runs'])} runs")
    return "\n".join(lines)


def scratch() -> str:
    """A fresh directory for records and the tuner cache."""
    return tempfile.mkdtemp(prefix="pycoll-predict-")


def add_racks(cluster: Cluster, second: Sequence[int], uplink_mbit: float) -> None:
    """Put hosts `second` of a built Cluster behind a rack switch of their own whose uplink to the
    cluster's bridge (the first rack's switch) runs at `uplink_mbit` both ways (tbf, as the hosts'
    links): every flow between the racks shares that one link. The second switch is a bridge in a
    namespace of its own (named like the hosts', so Cluster.close and the sweep of dead runs delete
    it, and the uplink's veth pair with it); the hosts' links keep their shaping."""
    ns = cluster.namespaces[0].rsplit("-h", 1)[0] + "-rack1"
    uplink = cluster.veths[0].rsplit("h", 1)[0] + "u"
    _ip("netns", "add", ns)
    cluster.namespaces.append(ns)  # close() deletes it after the hosts
    tc_in_ns = ["ip", "netns", "exec", ns, "tc"]
    _ip("-n", ns, "link", "add", "sw", "type", "bridge")
    _ip("-n", ns, "link", "set", "sw", "up")
    for h in second:  # the host's end in the root namespace moves to the rack's switch (its qdisc does not)
        veth = cluster.veths[h]
        _ip("link", "set", veth, "netns", ns)
        _ip("-n", ns, "link", "set", veth, "master", "sw")
        _ip("-n", ns, "link", "set", veth, "up")
        if cluster.rate_mbit:
            cluster._shape(tc_in_ns, veth)
    _ip("link", "add", uplink, "type", "veth", "peer", "name", "uplink", "netns", ns)
    _ip("link", "set", uplink, "master", cluster.bridge)
    _ip("link", "set", uplink, "up")
    _ip("-n", ns, "link", "set", "dev", "uplink", "master", "sw")
    _ip("-n", ns, "link", "set", "dev", "uplink", "up")
    for tc, dev in ((["tc"], uplink), (tc_in_ns, "uplink")):
        cmd = tc + ["qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{uplink_mbit}mbit",
                    "burst", f"{cluster.burst_kib}kb", "latency", f"{cluster.latency_ms:g}ms"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise ClusterError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip()}")


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode:
        raise ClusterError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")

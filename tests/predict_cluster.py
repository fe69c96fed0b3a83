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

from netns_cluster import Cluster

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
                out: str, tuner_cache: str) -> Dict[str, Any]:
    """Build the cluster, measure its link rate (hosts > 1), train and record; writes the record to `out`."""
    env = {"PYCOLL_TUNER_CACHE": tuner_cache, "PYTHONPATH": os.environ.get("PYTHONPATH", REPO)}
    with Cluster(hosts=hosts, rate_mbit=rate_mbit if hosts > 1 else None, sysctls=SYSCTLS) as cluster:
        rate = min(cluster.link_rate(0, 1), cluster.link_rate(1, 0)) if hosts > 1 else None
        rec = cluster.run("predict_cluster:train_record", layout(hosts, per_host, how), [list(trainer)],
                          env=env, timeout=500)[0]
    rec["cluster"] = {"hosts": hosts, "per_host": per_host, "placement": how, "rate_mbit": rate_mbit,
                      "link_Bps": rate}
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

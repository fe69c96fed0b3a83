"""Validation of `pycoll predict --trace` on emulated clusters (tests/netns_cluster.py): record a job
on one host, run the same job on H hosts, predict the H-host run from the one-host trace and compare.
Used by docs/make_predict_trace.py (every job, 2-4 hosts, two links) and
tests/test_predict_trace_cluster.py (slow: one job, one 2-host run).

    with Cluster(2, rate_mbit=200, sysctls=SYSCTLS) as c:
        link = measure_link(c)
        rec = run_traced(c, argv, nodes=[0, 0], ppn=2, keep=dir1)      # 4 ranks in host 0: one host
        tgt = run_traced(c, argv, nodes=[0, 1], ppn=2, keep=dir2)      # 2 hosts x 2 ranks
        pred = predict_trace(rec["trace"], 2, 2, link["gbit"], link["latency_us"], 2, c.burst_kib)
        error = pred["step_ms"] / tgt["measured_ms"] - 1

A job is started as a user starts a multi-node job, `pycoll run -n PPN --nnodes N --node-rank i
--trace-dir D python ...` once per node, each node in the namespace `nodes[i]`: the recording puts
every node in host 0 (one network namespace: one host id, so every pair of ranks talks over shared
memory), the target one node per host. Both see the same launcher variables (LOCAL_WORLD_SIZE = PPN),
so a job that builds its groups from them (hybrid.py's mesh) builds the same groups in both.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, Optional, Sequence

from netns_cluster import Cluster, ClusterError
from parallel_cluster import round_trip_ms

from pycoll import config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSCTLS = {"net.ipv4.tcp_slow_start_after_idle": config.get("PYCOLL_SSAI")}
# each rank computes with one thread: every emulated host shares this machine's cores
JOB_ENV = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0"}


def measure_link(cluster: Cluster, nbytes: int = 16 << 20) -> Dict[str, float]:
    """The link between hosts 0 and 1 as the model takes it: the slower direction's rate of one raw
    TCP stream (`gbit`) and the latency of one pycoll message between the hosts (`latency_us`: half
    the median round trip of an 8-byte send/recv ping-pong, what the tuner's net alpha is); beside
    them `echo_us`, half an 8-byte raw TCP echo's round trip (the link and the kernel alone)."""
    rate = min(cluster.link_rate(0, 1, nbytes), cluster.link_rate(1, 0, nbytes))
    rtt = round_trip_ms(cluster, 0, 1)
    env = dict(os.environ, PYTHONPATH=os.environ.get("PYTHONPATH", REPO), **JOB_ENV)
    one_way = max(cluster.run("predict_trace_cluster:ping_pong", [0, 1], [8, 300], env=env, timeout=120))
    return {"gbit": rate * 8e-9, "latency_us": one_way, "echo_us": rtt / 2 * 1e3}


def ping_pong(comm: Any, nbytes: int, rounds: int) -> float:
    """Inside the cluster (2 ranks): half the median round trip (us) of `nbytes` sent and received back
    with comm.send / comm.recv, the first 10 rounds left out."""
    import numpy as np
    out, back = np.ones(max(1, nbytes // 4), dtype=np.float32), np.empty(max(1, nbytes // 4), dtype=np.float32)
    peer = 1 - comm.rank
    comm.barrier()
    times = []
    for _ in range(rounds + 10):
        t0 = time.perf_counter()
        if comm.rank == 0:
            comm.send(out, peer)
            comm.recv(back, peer)
        else:
            comm.recv(back, peer)
            comm.send(out, peer)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[10:]) / 2 * 1e6


def run_traced(cluster: Cluster, argv: Sequence[str], nodes: Sequence[int], ppn: int, keep: str,
               timeout: float = 300.0, result_name: str = "result.json") -> Dict[str, Any]:
    """`pycoll run -n PPN --nnodes len(nodes) --trace-dir KEEP/trace ARGV` with node i in host
    `nodes[i]`; `{RESULT}` in argv becomes KEEP/result_name (the job's own JSON). Returns the run:
    {"status": "ok" | "failed", "wall_s", "load": [before, after], "trace", "result" (the job's JSON),
    "measured_ms" (the trace's median step, as predict --trace counts steps), "steps", "error"}."""
    os.makedirs(keep, exist_ok=True)
    out, trace = os.path.join(keep, result_name), os.path.join(keep, "trace")
    argv = [out if a == "{RESULT}" else a for a in argv]
    env = dict(os.environ, PYTHONPATH=os.environ.get("PYTHONPATH", REPO), **JOB_ENV)
    run: Dict[str, Any] = {"status": "failed", "trace": trace, "load": [os.getloadavg()[0]], "nodes": list(nodes)}
    t0 = time.monotonic()
    try:
        cluster.launch(["--trace-dir", trace, *argv], ppn, hosts=list(nodes), env=env, timeout=timeout)
        with open(out) as fh:
            run["result"] = json.load(fh)
        run.update(trace_steps(trace))
        run["status"] = "ok"
    except (ClusterError, OSError, ValueError, RuntimeError) as e:
        run["error"] = str(e)[-3000:]
    run["wall_s"] = time.monotonic() - t0
    run["load"].append(os.getloadavg()[0])
    return run


def trace_steps(trace: str) -> Dict[str, Any]:
    """The measured median step of a traced run and its steps (ms), counted as `pycoll predict
    --trace` counts them (marks; the first step left out; each step the slowest rank's)."""
    from pycoll.predict import trace_replay
    t = trace_replay.load(trace)
    steps = [s * 1e3 for s in t.measured_steps()]
    return {"measured_ms": statistics.median(steps), "steps": steps, "marked": t.marked}


def predict_trace(trace: str, hosts: int, ppn: int, gbit: float, latency_us: float, shared_cores: int,
                  burst_kib: float = 0.0, extra: Sequence[str] = (), timeout: float = 300.0) -> Dict[str, Any]:
    """`pycoll predict --trace TRACE --hosts H --ppn P --topo-file T --shared-cores C --json`, run as a
    user runs it, T declaring the net link (gbit, latency_us and, for a tbf's token bucket, burst_kib);
    its JSON answer."""
    fd, topo = tempfile.mkstemp(suffix=".json", prefix="pycoll-link-")
    with os.fdopen(fd, "w") as fh:
        json.dump({"links": {"net": {"gbit": gbit, "latency_us": latency_us, "burst_kib": burst_kib}}}, fh)
    cmd = [sys.executable, "-m", "pycoll", "predict", "--trace", trace, "--hosts", str(hosts), "--ppn", str(ppn),
           "--topo-file", topo, "--shared-cores", str(shared_cores), "--json", *extra]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=timeout,
                              env=dict(os.environ, PYTHONPATH=os.environ.get("PYTHONPATH", REPO)))
    finally:
        os.unlink(topo)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def error(predicted: Optional[float], measured: Optional[float]) -> Optional[float]:
    """(predicted - measured) / measured, None where either is missing."""
    if predicted is None or not measured:
        return None
    return predicted / measured - 1.0

"""Run the jobs of examples/parallel/ on one host and on emulated hosts, as a user would, and read
what they report and what pycoll's traffic report says of them (docs/make_learning_path.py,
tests/test_parallel_cluster.py).

    job = run_local("hybrid.py", 4, ["--tp", "2"], "pycoll", trace=True)
    with Cluster(2, rate_mbit=1000) as c:
        job = run_cluster(c, "hybrid.py", 2, ["--tp-across-hosts"], "pycoll", trace=True)
    job["result"]["step_ms"], job["traffic"]["median_step"]["total"]["bytes_between"]
"""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

from netns_cluster import Cluster

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOBS = os.path.join(REPO, "examples", "parallel")
PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "wire_probe.py")


def _env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.environ.get("PYTHONPATH", REPO), **(extra or {}))


def _argv(script: str, args: Sequence[str], backend: str, out: str) -> List[str]:
    return [sys.executable, os.path.join(JOBS, script), "--backend", backend, "--json", out, *args]


def _finish(out: str, trace_dir: Optional[str], log: str) -> Dict[str, Any]:
    try:
        with open(out) as fh:
            result = json.load(fh)
    except (OSError, ValueError) as e:
        raise RuntimeError(f"the job wrote no result to {out} ({e}); its output:\n{log[-4000:]}") from None
    job: Dict[str, Any] = {"result": result, "traffic": None}
    if trace_dir is not None:
        job["traffic"] = traffic(trace_dir)
    return job


def traffic(trace_dir: str) -> Dict[str, Any]:
    """`pycoll trace DIR --traffic --json`, run as a user runs it."""
    proc = subprocess.run([sys.executable, "-m", "pycoll", "trace", trace_dir, "--traffic", "--json"],
                          capture_output=True, text=True, env=_env(), timeout=300)
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"pycoll trace --traffic failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def run_local(script: str, ranks: int, args: Sequence[str], backend: str, trace: bool = False,
              env: Optional[Dict[str, str]] = None, timeout: float = 600) -> Dict[str, Any]:
    """`pycoll run -n RANKS python examples/parallel/SCRIPT --backend B --json F ARGS` on this host."""
    work = tempfile.mkdtemp(prefix="pycoll-par-")
    out, trace_dir = os.path.join(work, "result.json"), os.path.join(work, "trace") if trace else None
    cmd = [sys.executable, "-m", "pycoll", "run", "-n", str(ranks)]
    cmd += ["--trace-dir", trace_dir] if trace_dir else []
    proc = subprocess.run(cmd + _argv(script, args, backend, out), capture_output=True, text=True,
                          env=_env(env), timeout=timeout, cwd=REPO)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} {script} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    return _finish(out, trace_dir, proc.stdout + proc.stderr)


def run_cluster(cluster: Cluster, script: str, ppn: int, args: Sequence[str], backend: str,
                trace: bool = False, env: Optional[Dict[str, str]] = None, timeout: float = 600
                ) -> Dict[str, Any]:
    """The same job started by `pycoll run --nnodes H --node-rank i` in each emulated host. The hosts
    share this machine's cores, so each rank computes with one thread (OMP_NUM_THREADS=1; a job's
    common.init would give each its host's share, counting cores every namespace sees), and gloo
    uses the host's interface (GLOO_SOCKET_IFNAME=eth0: its own hostname resolves to loopback)."""
    env = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0", **(env or {})}
    work = tempfile.mkdtemp(prefix="pycoll-par-", dir=cluster.workdir)
    out, trace_dir = os.path.join(work, "result.json"), os.path.join(work, "trace") if trace else None
    opts = ["--trace-dir", trace_dir] if trace_dir else []
    logs = cluster.launch(opts + _argv(script, args, backend, out), ppn, env=_env(env), timeout=timeout)
    return _finish(out, trace_dir, "\n".join(logs))


def round_trip_ms(cluster: Cluster, src: int = 0, dst: int = 1, n: int = 60) -> float:
    """Median round trip of an 8-byte TCP echo from host `src` to host `dst` (tests/wire_probe.py)."""
    token = secrets.token_hex(4)
    ready = os.path.join(cluster.workdir, f"echo-{src}-{dst}-{token}.ready")
    port = str(23000 + secrets.randbelow(2000))
    server = cluster.popen(dst, [sys.executable, PROBE, "tcp-server", cluster.addresses[dst], port, ready])
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(ready):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the echo server in host {dst} did not start")
            time.sleep(0.01)
        proc = subprocess.run(["ip", "netns", "exec", cluster.namespaces[src], sys.executable, PROBE, "tcp-client",
                               cluster.addresses[dst], port, str(n)], capture_output=True, text=True, timeout=120)
        if proc.returncode:
            raise RuntimeError(f"echo client failed: {proc.stderr[-1000:]}")
        return float(proc.stdout)
    finally:
        if server.poll() is None:
            server.kill()
        server.wait()

"""The torch backend against gloo on all_to_all_single (even and uneven splits) and list all_to_all.

    python benchmarks/torch_alltoall.py [--rounds 5] [--ranks 2,4] [--json out.json] [--base OLD_TREE ...]

Every job is `pycoll run -n RANKS python benchmarks/torch_alltoall.py --worker BACKEND`: each backend
runs in processes of its own (no gloo inside pycoll's processes), launched the same way with the same
environment (OMP_NUM_THREADS=1, PYCOLL_TUNER_CACHE=off: each pycoll job calibrates afresh). Rounds
interleave the jobs (pycoll, gloo; then gloo, pycoll; ...) at each rank count. Each `--base OLD_TREE`
adds a job per round, pycoll from another checkout (labelled pycoll@<its folder name>), for
before/after figures of the backend.

A job times each case `CALLS` times after warm-up calls, every call preceded by a barrier; a call's time
is the slowest rank's (the ranks' medians are reduced with MAX), and the job's CPU per call is the sum
over ranks (process time: every thread). Cases, float32 rows of 64 (256 B):
- `uneven R`: all_to_all_single of R rows per rank, rank r sending to rank j a share weighted
  1 + (r + j) % n (as a skewed MoE router does), the receive splits from the same rule;
- `even R`: all_to_all_single with no splits (R / n rows to each rank);
- `list R`: dist.all_to_all of n tensors of R / n rows, into n tensors.
Tables report the median over jobs of each job's median call, the min-max of the job medians, and
the median over jobs of the quartiles of the calls (each the slowest rank's).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Dict, List

from torch_ddp import job_result  # one job's RESULT line, read as torch_ddp.py reads it

ROW = 64  # float32 per row
CASES = (("uneven", 16), ("even", 16), ("list", 16), ("uneven", 4096))
CALLS = {16: 400, 4096: 60}
HERE = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(HERE))


def splits(src: int, n: int, rows: int) -> List[int]:
    """Rows rank `src` sends to each rank: `rows` shared in proportion to 1 + (src + j) % n."""
    w = [1 + (src + j) % n for j in range(n)]
    out = [rows * x // sum(w) for x in w]
    out[-1] += rows - sum(out)
    return out


# -- one job (every rank) ------------------------------------------------------------------------
def worker(backend: str, scale: float) -> None:
    import torch
    import torch.distributed as dist
    if backend == "pycoll":
        import pycoll.torch  # noqa: F401
    torch.set_num_threads(1)
    dist.init_process_group(backend)
    rank, n = dist.get_rank(), dist.get_world_size()
    out: Dict[str, object] = {"ranks": n, "backend": backend}

    def slowest(v: float) -> float:
        t = torch.tensor([v], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    def total(v: float) -> float:
        t = torch.tensor([v], dtype=torch.float64)
        dist.all_reduce(t)
        return t.item()

    for kind, rows in CASES:
        name = f"{kind} {rows}"
        g = torch.Generator().manual_seed(rank)
        send = splits(rank, n, rows)
        recv = [splits(i, n, rows)[rank] for i in range(n)]
        if kind == "even":
            rows = rows // n * n
            x = torch.randn(rows, ROW, generator=g)
            y = torch.empty(rows, ROW)

            def call() -> None:
                dist.all_to_all_single(y, x)
        elif kind == "uneven":
            x = torch.randn(sum(send), ROW, generator=g)
            y = torch.empty(sum(recv), ROW)

            def call() -> None:
                dist.all_to_all_single(y, x, recv, send)
        else:  # (gloo's list all_to_all takes equal tensors only)
            ins = [torch.randn(rows // n, ROW, generator=g) for _ in range(n)]
            outs = [torch.empty(rows // n, ROW) for _ in range(n)]

            def call() -> None:
                dist.all_to_all(outs, ins)
        calls = max(10, int(CALLS[int(name.split()[1])] * scale))
        for _ in range(max(5, calls // 10)):
            call()
        times = []
        dist.barrier()
        cpu0 = time.process_time()
        for _ in range(calls):
            dist.barrier()
            t = time.perf_counter()
            call()
            times.append(time.perf_counter() - t)
        cpu = (time.process_time() - cpu0) / calls  # (the barriers included)
        q = statistics.quantiles(times, n=4)
        out[name] = {"median": slowest(statistics.median(times)), "q1": slowest(q[0]), "q3": slowest(q[2]),
                     "cpu": total(cpu)}
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    if backend == "pycoll":
        dist.destroy_process_group()  # gloo: none (torch 2.13's gloo teardown race); the exit closes it


# -- the driver ----------------------------------------------------------------------------------
def launch(backend: str, ranks: int, scale: float, tree: str = REPO) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYCOLL_TUNER_CACHE="off")
    env["PYTHONPATH"] = os.pathsep.join([tree, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [sys.executable, "-m", "pycoll", "run", "-n", str(ranks), "--timeout", "600",
           sys.executable, HERE, "--worker", backend, "--scale", str(scale)]
    return job_result(cmd, env, 660, f"{backend} x{ranks}")


def _us(v: float) -> str:
    return f"{v * 1e6:.0f}"


def report(jobs: List[dict]) -> str:
    labels = list(dict.fromkeys(j["backend"] for j in jobs))
    labels = sorted(labels, key=lambda b: (b == "gloo", b != "pycoll"))  # pycoll, the bases, gloo
    lines = [f"{os.cpu_count()} CPUs; {len(jobs)} jobs; rounds interleave the backends' jobs. Call: the "
             "median over jobs of each job's median call (slowest rank), in us; spread: min-max of the job "
             "medians; IQR: median over jobs of the slowest rank's quartiles; CPU: us per call summed "
             "over ranks (its barrier included).", "",
             "| case | ranks | backend | call us | spread | IQR | CPU us/call | /gloo |",
             "|---|---|---|---|---|---|---|---|"]
    for kind, rows in CASES:
        key = f"{kind} {rows}"
        for n in sorted({j["ranks"] for j in jobs}):
            got = {label: [j[key] for j in jobs if j["ranks"] == n and j["backend"] == label and key in j]
                   for label in labels}
            med = {label: statistics.median(m["median"] for m in v) for label, v in got.items() if v}
            for label, mine in got.items():
                if not mine:
                    continue
                meds = [m["median"] for m in mine]
                q1, q3 = (statistics.median(m[q] for m in mine) for q in ("q1", "q3"))
                cpu = statistics.median(m["cpu"] for m in mine)
                ratio = f"{med[label] / med['gloo']:.2f}" if "gloo" in med else ""
                lines.append(f"| {key} x {ROW} f32 | {n} | {label} | {_us(med[label])} | {_us(min(meds))}-"
                             f"{_us(max(meds))} | {_us(q1)}-{_us(q3)} | {_us(cpu)} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", choices=["pycoll", "gloo"], help=argparse.SUPPRESS)
    ap.add_argument("--scale", type=float, default=1.0, help="scale the timed calls per case")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--json", metavar="PATH", help="also write every job's raw figures here")
    ap.add_argument("--base", metavar="TREE", action="append", default=[],
                    help="also run pycoll from this checkout (repeatable)")
    a = ap.parse_args()
    if a.worker:
        worker(a.worker, a.scale)
        return
    jobs = []
    for r in range(a.rounds):
        for n in [int(v) for v in a.ranks.split(",")]:
            kinds = [("pycoll", "pycoll", REPO)]
            kinds += [(f"pycoll@{os.path.basename(os.path.abspath(b))}", "pycoll", os.path.abspath(b)) for b in a.base]
            kinds.append(("gloo", "gloo", REPO))
            for label, backend, tree in (kinds if r % 2 == 0 else kinds[::-1]):
                t = time.monotonic()
                job = launch(backend, n, a.scale, tree)
                job["backend"] = label
                jobs.append(job)
                print(f"round {r + 1}/{a.rounds}: {label} x{n} in {time.monotonic() - t:.0f} s",
                      file=sys.stderr, flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(jobs, fh)
    print(report(jobs))


if __name__ == "__main__":
    main()

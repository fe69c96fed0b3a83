"""The torch backend against gloo: a DDP training step, and the torch layer's cost per all_reduce.

    python benchmarks/torch_ddp.py [--rounds 3] [--ranks 2,4] [--json out.json] [--base OLD_TREE]

Every job is `pycoll run -n RANKS python benchmarks/torch_ddp.py --worker BACKEND`, so both
backends run in processes of their own, launched the same way with the same environment
(OMP_NUM_THREADS=1, PYCOLL_TUNER_CACHE=off: each pycoll job calibrates afresh, no cache carried
between jobs). Rounds interleave the backends (pycoll, gloo; then gloo, pycoll; ...) at each rank
count. A job runs, per model, warm-up steps then timed DDP steps (zero_grad, forward, cross-entropy,
backward, SGD step); the time of a step is the slowest rank's, its CPU seconds the sum over ranks
(process time: every thread). Then it times all_reduce at 8 B, 1 MiB and 16 MiB: a pycoll job
alternates `dist.all_reduce(t)` with `pg.comm.allreduce(t.numpy())` on the same tensor and the
same communicator (the difference is the torch layer's cost per call), a gloo job times
`dist.all_reduce` on gloo for reference. Every call is preceded by a barrier; per job the slowest
rank's median counts. Tables (markdown) report the median over jobs and the min-max of the job
medians. `--base OLD_TREE` adds a third job per round and rank count, pycoll from another checkout
(labelled pycoll-base), for before/after comparisons of the backend itself.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, List

MODELS = {  # name: (layer widths, batch, warm-up steps, timed steps at --steps 10)
    "25M": ([2048] * 7, 32, 3, 10),
    "100K": ([256, 256, 128, 10], 32, 10, 60),
}
SIZES = (8, 1 << 20, 16 << 20)
CALLS = {8: 300, 1 << 20: 40, 16 << 20: 10}
HERE = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(HERE))


# -- one job (every rank) ------------------------------------------------------------------------
def worker(backend: str, steps_scale: float, sizes: bool) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    if backend == "pycoll":
        import pycoll.torch  # noqa: F401
    torch.set_num_threads(1)
    dist.init_process_group(backend)
    rank, size = dist.get_rank(), dist.get_world_size()
    out: Dict[str, dict] = {"ranks": size, "backend": backend}

    def slowest(values: List[float]) -> List[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def total(value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t)
        return t.item()

    for name, (widths, batch, warm, steps) in MODELS.items():
        steps = max(3, int(steps * steps_scale))
        torch.manual_seed(0)
        layers: List[nn.Module] = []
        for a, b in zip(widths, widths[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        model = nn.Sequential(*layers[:-1])
        params = sum(p.numel() for p in model.parameters())
        ddp = DDP(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(batch, widths[0], generator=g)
        y = torch.randint(0, widths[-1], (batch,), generator=g)
        times = []
        cpu0 = 0.0
        for i in range(warm + steps):
            if i == warm:
                dist.barrier()
                cpu0 = time.process_time()
            t = time.perf_counter()
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
            times.append(time.perf_counter() - t)
        cpu = (time.process_time() - cpu0) / steps
        out[name] = {"params": params, "steps": slowest(times[warm:]), "cpu": total(cpu)}
        del ddp, opt

    if sizes:
        pg = dist.group.WORLD
        comm = getattr(pg, "comm", None)  # the pycoll ProcessGroup's communicator
        for nbytes in SIZES:
            t = torch.zeros(max(1, nbytes // 4))
            arr = t.numpy()
            calls = CALLS[nbytes]
            ways = {"torch": lambda: dist.all_reduce(t)}
            if comm is not None:
                ways["pycoll"] = lambda: comm.allreduce(arr)
            for _ in range(max(3, calls // 10)):
                for f in ways.values():
                    f()
            got: Dict[str, List[float]] = {k: [] for k in ways}
            order = list(ways)
            for i in range(calls):
                for k in (order if i % 2 == 0 else order[::-1]):
                    (comm.barrier() if comm is not None else dist.barrier())
                    s = time.perf_counter()
                    ways[k]()
                    got[k].append(time.perf_counter() - s)
            out[f"ar{nbytes}"] = {k: slowest([float(np.median(v))])[0] for k, v in got.items()}
        if comm is not None:  # the tuner's picks (each job calibrates afresh): for the sizes and DDP's buckets
            def pick(nbytes: int) -> str:
                fn = comm.selector.function("allreduce", nbytes, comm.topology, None)
                fn = getattr(fn, "func", fn)
                return f"{getattr(fn, '__module__', '').rsplit('.', 1)[-1]}.{getattr(fn, '__name__', fn)}"
            out["algos"] = {str(b): pick(b) for b in (*SIZES, 25 << 20)}
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    if backend == "pycoll":
        dist.destroy_process_group()  # gloo: none (torch 2.13's gloo teardown race); the exit closes it


# -- the driver ----------------------------------------------------------------------------------
def launch(backend: str, ranks: int, steps_scale: float, sizes: bool, tree: str = REPO) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYCOLL_TUNER_CACHE="off")
    env["PYTHONPATH"] = os.pathsep.join([tree, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [sys.executable, "-m", "pycoll", "run", "-n", str(ranks), "--timeout", "900",
           sys.executable, HERE, "--worker", backend, "--steps-scale", str(steps_scale)]
    if not sizes:
        cmd.append("--no-sizes")
    return job_result(cmd, env, 960, f"{backend} x{ranks}")


def job_result(cmd: List[str], env: Dict[str, str], timeout: float, label: str) -> dict:
    """Run one `pycoll run` job and return what its rank 0 printed after "RESULT " (JSON)."""
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    for line in res.stdout.splitlines():
        if "RESULT " in line:
            return json.loads(line.split("RESULT ", 1)[1])
    raise RuntimeError(f"{label}: no result (exit {res.returncode})\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")


def _ms(v: float) -> str:
    return f"{v * 1e3:.1f}" if v >= 0.01 else f"{v * 1e3:.2f}"


def _us(v: float) -> str:
    return f"{v * 1e6:.0f} us" if v < 1e-3 else f"{v * 1e3:.2f} ms"


def _cell(v: List[float]) -> str:
    return f"{_us(statistics.median(v))} ({_us(min(v))}-{_us(max(v))})" if v else "-"


def report(jobs: List[dict]) -> str:
    lines = [f"{os.cpu_count()} CPUs; {len(jobs)} jobs; rounds interleave the backends. "
             "Step: median over jobs of each job's median step (slowest rank); spread: min-max of "
             "job medians; IQR: of all timed steps pooled. CPU s/step: summed over ranks.", "",
             "| model | ranks | backend | step ms median | spread (job medians) | IQR (all steps) | "
             "CPU s/step | pycoll/this |", "|---|---|---|---|---|---|---|---|"]
    ranks_seen = sorted({j["ranks"] for j in jobs})
    labels = [b for b in ("pycoll", "pycoll-base", "gloo") if any(j["backend"] == b for j in jobs)]
    for model in MODELS:
        for n in ranks_seen:
            med = {}
            for backend in labels:
                mine = [j for j in jobs if j["ranks"] == n and j["backend"] == backend]
                if not mine:
                    continue
                medians = [statistics.median(j[model]["steps"]) for j in mine]
                pooled = sorted(s for j in mine for s in j[model]["steps"])
                q = statistics.quantiles(pooled, n=4)
                med[backend] = statistics.median(medians)
                cpu = statistics.median(j[model]["cpu"] for j in mine)
                ratio = f"{med['pycoll'] / med[backend]:.2f}" if backend != "pycoll" and "pycoll" in med else ""
                lines.append(f"| {model} ({mine[0][model]['params'] / 1e6:.2f}M params) | {n} | {backend} | "
                             f"{_ms(med[backend])} | {_ms(min(medians))}-{_ms(max(medians))} | "
                             f"{_ms(q[0])}-{_ms(q[2])} | {cpu:.3f} | {ratio} |")
    if any(f"ar{SIZES[0]}" in j for j in jobs):
        lines += ["", "all_reduce, median call (slowest rank), median over jobs (min-max): torch layer = "
                  "dist.all_reduce minus comm.allreduce on the same tensor and communicator", "",
                  "| ranks | size | tree | pycoll: dist.all_reduce | pycoll: comm.allreduce | torch layer | "
                  "gloo: dist.all_reduce |", "|---|---|---|---|---|---|---|"]
        cases = [(n, nbytes, label) for n in ranks_seen for nbytes in SIZES for label in labels if label != "gloo"]
        for n, nbytes, label in cases:
            key = f"ar{nbytes}"
            p = [j[key] for j in jobs if j["ranks"] == n and j["backend"] == label and key in j]
            g = [j[key]["torch"] for j in jobs if j["ranks"] == n and j["backend"] == "gloo" and key in j]
            if not p:
                continue
            pt, pc = [x["torch"] for x in p], [x["pycoll"] for x in p]
            layer = [x["torch"] - x["pycoll"] for x in p]
            lines.append(f"| {n} | {nbytes} B | {label} | {_cell(pt)} | {_cell(pc)} | "
                         f"{statistics.median(layer) * 1e6:+.0f} us ({min(layer) * 1e6:+.0f}.."
                         f"{max(layer) * 1e6:+.0f}) | {_cell(g)} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", choices=["pycoll", "gloo"], help=argparse.SUPPRESS)
    ap.add_argument("--steps-scale", type=float, default=1.0, help="scale the timed steps per model")
    ap.add_argument("--no-sizes", action="store_true", help="skip the all_reduce sizes")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--json", metavar="PATH", help="also write every job's raw figures here")
    ap.add_argument("--base", metavar="TREE", help="also run pycoll from this checkout (pycoll-base)")
    a = ap.parse_args()
    if a.worker:
        worker(a.worker, a.steps_scale, not a.no_sizes)
        return
    jobs = []
    for r in range(a.rounds):
        for n in [int(v) for v in a.ranks.split(",")]:
            kinds = [("pycoll", "pycoll", REPO), ("gloo", "gloo", REPO)]
            if a.base:
                kinds.insert(1, ("pycoll-base", "pycoll", os.path.abspath(a.base)))
            for label, backend, tree in (kinds if r % 2 == 0 else kinds[::-1]):
                t = time.monotonic()
                job = launch(backend, n, a.steps_scale, not a.no_sizes, tree)
                job["backend"] = label
                jobs.append(job)
                print(f"round {r + 1}/{a.rounds}: {label} x{n} in {time.monotonic() - t:.0f} s "
                      f"{job.get('algos', '')}",
                      file=sys.stderr, flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(jobs, fh)
    print(report(jobs))


if __name__ == "__main__":
    main()

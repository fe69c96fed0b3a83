"""Do `pycoll bench --np N --compare`'s peer columns match the peers measured on their own?

    python benchmarks/standalone_peers.py [--np 2] [--sizes 64K,1M,16M] [--peers mpi,mpi-tcp,gloo]
                                          [--repeats 8] [--rounds 3] [--tolerance 0.15]

Each repeat runs the bench once (pycoll over shm beside the peers), then each peer alone: a plain
mpi4py or torch.distributed Gloo loop in processes that import nothing of pycoll, launched by the
same mpirun line (same binding, same environment), on the same buffers (np.ones, in-place float32
SUM), the same iterations per round and rounds the bench used, each round visiting every size as the
bench's do, a round's figure taken the same way (the slowest rank's mean call). Bench and standalone
runs alternate (bench first on even repeats, the loops first on odd ones, with the bench's iterations
of the repeat before), and a run (bench or loop job) that a check of the machine's cross-CPU state
(cross_cpu.py) finds slow before or after runs again, on both sides alike. On this VM a small call's
time flips between states for seconds at a time (an 8 B Open MPI call: 0.8-0.9 or 1.4-1.6 us, round to
round), so per (peer, size) the figure judged is the median ratio over every pair of a bench round
and a standalone round (all repeats): many short samples spread over the same minutes, compared by
an estimate that neither a shifting share of the two states nor a spell moves much (a ratio of
medians jumps). Exit status 1 if any such ratio is off by more than the tolerance.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pycoll.cli import bench_compare  # noqa: E402
from pycoll.cli.bench import parse_size  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cross_cpu  # noqa: E402

LOOP = r'''
import json, os, resource, sys, time
import numpy as np
LIB, PLAN, ROUNDS, PORT = %r, %r, %r, %r
if LIB == "gloo":
    import torch, torch.distributed as dist
    rank, size = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{PORT}", rank=rank, world_size=size)
    wrap, allreduce, barrier = torch.from_numpy, dist.all_reduce, dist.barrier
    def combine(v, op):
        t = torch.tensor(v, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return t.tolist()
else:
    from mpi4py import MPI
    w = MPI.COMM_WORLD
    rank, size, wrap, barrier = w.rank, w.size, (lambda x: x), w.Barrier
    allreduce = lambda x: w.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
    def combine(v, op):
        mine, got = np.array(v, np.float64), np.empty(len(v))
        w.Allreduce(mine, got, op=MPI.MAX if op == "max" else MPI.SUM)
        return got.tolist()
def cpu():
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime
bufs = {}
for nbytes, iters in PLAN:
    x = np.ones(max(nbytes // 4, 1), np.float32)
    buf = wrap(x)
    allreduce(buf)
    assert (x == size).all(), f"rank {rank}: {LIB} allreduce of {nbytes} B: wrong sum"
    x.fill(0)
    for _ in range(2):
        allreduce(buf)
    bufs[nbytes] = buf
means = {nbytes: [] for nbytes, _ in PLAN}
cpus = {nbytes: [] for nbytes, _ in PLAN}
for _ in range(ROUNDS):  # each round visits every size, as the bench's rounds do
    for nbytes, iters in PLAN:
        buf = bufs[nbytes]
        allreduce(buf)  # warm again after the other sizes, as the bench's warm-up call per turn
        barrier()
        c0, t0 = cpu(), time.perf_counter()
        for _ in range(iters):
            allreduce(buf)
        means[nbytes].append((time.perf_counter() - t0) / iters)
        cpus[nbytes].append((cpu() - c0) / iters)
out = {nbytes: {"time": combine(means[nbytes], "max"), "cpu": [c / size for c in combine(cpus[nbytes], "sum")]}
       for nbytes, _ in PLAN}
if rank == 0:
    print("RESULT " + json.dumps(out), flush=True)
if LIB == "gloo":
    dist.destroy_process_group()
'''

def standalone(lib: str, n: int, bind: str, plan: List[Tuple[int, int]], rounds: int,
               tries: int = 3) -> Tuple[Dict[int, Dict[str, Any]], int]:
    """One plain loop job of `lib`: per size its rounds' figures (the slowest rank's mean call, s) and
    the median of the ranks' mean CPU seconds per call; and how many times it ran (a job that a slow
    check of the machine brackets runs again, at most `tries` times)."""
    def job() -> Dict[str, Any]:
        script = LOOP % (lib, plan, rounds, bench_compare.free_port())
        run = ["-c", script] if lib == "gloo" else ["-m", "mpi4py", "-c", script]  # mpi4py: an error aborts the job
        cmd = bench_compare.mpirun_prefix(lib, n, bind) + [sys.executable] + run
        proc = subprocess.run(cmd, capture_output=True, text=True, env=bench_compare.job_env(), timeout=900)
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[7:])
        raise RuntimeError(f"standalone {lib} loop failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n"
                           f"{proc.stderr[-2000:]}")
    result, _, ran = cross_cpu.bracketed(job, tries)
    return {int(k): {"rounds": v["time"], "cpu": statistics.median(v["cpu"])} for k, v in result.items()}, ran


Samples = Dict[Tuple[str, int, str], List[Any]]


def alone(got: Samples, plan: Dict[str, List[Tuple[int, int]]], peers: List[str], rep: int, n: int, bind: str,
          rounds: int) -> int:
    """Every peer's standalone loop once (the order rotating with the repeat), into `got`: per (peer,
    size, "alone") one entry per repeat, (its rounds' times in us, its CPU per call in us). Returns
    how many jobs ran again."""
    again = 0
    for peer in peers[rep % len(peers):] + peers[:rep % len(peers)]:
        measured, ran = standalone(peer, n, bind, plan[peer], rounds)
        again += ran - 1
        for nbytes, m in measured.items():
            got.setdefault((peer, nbytes, "alone"), []).append(([t * 1e6 for t in m["rounds"]], m["cpu"] * 1e6))
    return again


def pair_ratio(bench: List[float], alone: List[float]) -> float:
    """The median, over every pair of a bench round and a standalone round, of their ratio (the
    Hodges-Lehmann estimate of how much one side is slower): with rounds that fall into two states it
    stays at the typical ratio where a ratio of medians jumps when one side's median crosses from one
    state to the other, and rounds caught in one of the machine's spells barely move it."""
    return statistics.median(b / a for b in bench for a in alone)


def agreement(n: int, sizes: List[int], peers: List[str], repeats: int, rounds: int, round_seconds: float,
              bind: str = "core:overload-allowed") -> List[Dict[str, Any]]:
    """Per (peer, size) and side (bench, alone): every round of every repeat (us), their median
    ("time") and fastest; per repeat the median round ("runs"); the median over repeats of CPU per
    call. Ratios bench/alone: "ratio", the one judged (pair_ratio over all rounds), and of the
    medians, the fastest rounds and CPU ("time_ratio", "best_ratio", "cpu_ratio")."""
    got: Samples = {}
    plan: Dict[str, List[Tuple[int, int]]] = {}
    again = {"bench": 0, "alone": 0}
    for rep in range(repeats):
        if rep % 2 and plan:  # odd repeats: the standalone loops first
            again["alone"] += alone(got, plan, peers, rep, n, bind, rounds)
        rows, _, ran = cross_cpu.bracketed(
            lambda: bench_compare.run(n, sizes, ["shm"], peers, rounds, round_seconds, 1, bind))
        again["bench"] += ran - 1
        plan = {peer: [(r["size"], r["iters"]) for r in rows if r["library"] == peer] for peer in peers}
        for row in rows:
            if row["library"] in peers:
                got.setdefault((row["library"], row["size"], "bench"), []).append((row["round_us"], row["cpu_us"]))
        if not rep % 2:
            again["alone"] += alone(got, plan, peers, rep, n, bind, rounds)
        print(f"# repeat {rep + 1}/{repeats} done, load average {os.getloadavg()[0]:.2f}; run again after a slow "
              f"check so far: bench {again['bench']}, loop jobs {again['alone']}", flush=True)
    out = []
    for peer in peers:
        for nbytes in sizes:
            row: Dict[str, Any] = {"peer": peer, "size": nbytes}
            for side in ("bench", "alone"):
                reps = got[peer, nbytes, side]
                every = [t for times, _ in reps for t in times]
                row.update({f"{side}_time_us": statistics.median(every), f"{side}_best_us": min(every),
                            f"{side}_rounds_us": every,
                            f"{side}_time_runs": [statistics.median(times) for times, _ in reps],
                            f"{side}_cpu_us": statistics.median(cpu for _, cpu in reps)})
            row["ratio"] = pair_ratio(row["bench_rounds_us"], row["alone_rounds_us"])
            for m in ("time", "best", "cpu"):
                row[f"{m}_ratio"] = row[f"bench_{m}_us"] / row[f"alone_{m}_us"]
            out.append(row)
    return out


def markdown(rows: List[Dict[str, Any]], tolerance: float) -> str:
    """The agreement rows as a markdown table; a judged ratio off by more than `tolerance` is marked."""
    def ratio(v: float) -> str:
        return f"**{v:.2f}**" + ("" if abs(v - 1) <= tolerance else " (outside)")

    def runs(values: List[float]) -> str:
        return " ".join(f"{v:.{1 if v < 10 else 0}f}" for v in values)
    lines = ["| peer | size | bench/standalone, round by round | median round: bench / standalone (us) | "
             "median round per repeat: bench | the same: standalone | fastest round: bench / standalone (us) | "
             "CPU/call: bench / standalone (us) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['peer']} | {r['size']} | {ratio(r['ratio'])} | {r['bench_time_us']:.1f} / "
                     f"{r['alone_time_us']:.1f} = {r['time_ratio']:.2f} | {runs(r['bench_time_runs'])} | "
                     f"{runs(r['alone_time_runs'])} | {r['bench_best_us']:.1f} / {r['alone_best_us']:.1f} = "
                     f"{r['best_ratio']:.2f} | {r['bench_cpu_us']:.1f} / {r['alone_cpu_us']:.1f} = "
                     f"{r['cpu_ratio']:.2f} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--sizes", default="64K,1M,16M")
    ap.add_argument("--peers", default="mpi,mpi-tcp,gloo")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--round-seconds", type=float, default=0.1)
    ap.add_argument("--tolerance", type=float, default=0.15)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    load0 = os.getloadavg()[0]
    rows = agreement(a.np, [parse_size(s) for s in a.sizes.split(",")], a.peers.split(","), a.repeats, a.rounds,
                     a.round_seconds)
    print(f"\nN={a.np}: bench peer column vs standalone loop, every round of {a.repeats} alternating repeats "
          f"(load average {load0:.2f} at the start, {os.getloadavg()[0]:.2f} at the end)\n")
    print(markdown(rows, a.tolerance))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0 if all(abs(r["ratio"] - 1) <= a.tolerance for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

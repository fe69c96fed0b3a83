"""Regenerate docs/benchmarks.md: `pycoll bench allreduce --np N --compare mpi,mpi-tcp,gloo` with pycoll
over shm and over tcp, at N=2 and N=4, each run one interleaved measurement of all five jobs; plots.

    python docs/make_benchmarks.py [--sizes 8,64K,1M,16M,64M] [--ranks 2,4] [--runs 2] [--rounds 7]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from typing import Any, Dict, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from pycoll.cli.bench import parse_size, plot  # noqa: E402

LABELS = {"pycoll-shm": "pycoll (shm)", "pycoll-tcp": "pycoll (tcp)", "mpi": "Open MPI", "mpi-tcp": "Open MPI, TCP",
          "gloo": "Gloo"}
TABLES = {"shm": ("pycoll-shm", ["mpi", "gloo"]), "tcp": ("pycoll-tcp", ["mpi-tcp", "gloo", "mpi"])}


def run_bench(n: int, sizes: str, rounds: int, out: str) -> Tuple[str, Dict[str, Any]]:
    """One interleaved run of all jobs; (its printed table, its JSON)."""
    cmd = [sys.executable, "-m", "pycoll", "bench", "allreduce", "--np", str(n), "--transport", "shm,tcp",
           "--compare", "mpi,mpi-tcp,gloo", "--sizes", sizes, "--rounds", str(rounds), "--json", out]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=3000,
                          cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")
    with open(out) as fh:
        return proc.stdout, json.load(fh)


def human(nbytes: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes} B"


def ms(us: float) -> str:
    """A time with its unit: 3.1 us, 412 us, 1.23 ms, 84.1 ms."""
    if us < 100:
        return f"{us:.1f} us"
    if us < 1000:
        return f"{us:.0f} us"
    return f"{us / 1e3:.2f} ms" if us < 1e4 else f"{us / 1e3:.1f} ms"


def table(runs: List[Dict[str, Any]], ours: str, peers: List[str]) -> str:
    """Run 1's times (median, min-max over rounds) and CPU per call; every run's ratio peer/pycoll and
    the range of the round-by-round ratios."""
    cell = [{(r["size"], r["library"]): r for r in run["rows"]} for run in runs]
    sizes = sorted({r["size"] for r in runs[0]["rows"]})
    head = (f"| size | {LABELS[ours]} (min-max) | CPU/call | algorithm | "
            + " | ".join(f"{LABELS[p]} (min-max) | CPU/call | **{LABELS[p]} / pycoll**" for p in peers) + " |")
    lines = [head, "|" + "---|" * (4 + 3 * len(peers))]
    for s in sizes:
        me = cell[0][s, ours]
        row = [human(s), f"{ms(me['time_us'])} ({ms(me['min_us'])}-{ms(me['max_us'])})", ms(me["cpu_us"]), me["algo"]]
        for p in peers:
            peer = cell[0][s, p]
            ratios = ", ".join(f"{c[s, p]['ratio'][ours]:.2f}" for c in cell)
            rounds = [v for c in cell for v in c[s, p]["round_ratios"][ours]]
            row += [f"{ms(peer['time_us'])} ({ms(peer['min_us'])}-{ms(peer['max_us'])})", ms(peer["cpu_us"]),
                    f"**{ratios}** ({min(rounds):.2f}-{max(rounds):.2f})"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def load_line(runs: List[Dict[str, Any]]) -> str:
    return "; ".join(f"run {i + 1}: load average {r['meta']['load_start'][0]:.1f} at the start, "
                     f"{r['meta']['load_end'][0]:.1f} at the end, waiting jobs {r['meta']['waiting_cpu_s']:.2f} "
                     f"CPU s in {r['meta']['turns_s']:.0f} s of turns" for i, r in enumerate(runs))


HOW = """## How this was measured

- **One command**, `python -m pycoll bench allreduce --np N --transport shm,tcp --compare mpi,mpi-tcp,gloo
  --sizes {sizes} --rounds {rounds}`, run {runs} time(s) per N. It launches five jobs, each
  `mpirun --oversubscribe --bind-to core:overload-allowed -np N` of `pycoll/cli/bench_worker.py`: pycoll
  over shm, pycoll over tcp (`pycoll.init(transport=...)`, bootstrapped over mpi4py as under any mpirun),
  Open MPI through mpi4py (`Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)`, default selection here: ob1 with
  btl vader,self), Open MPI forced over TCP (`--mca pml ob1 --mca btl tcp,self`, loopback), and torch
  Gloo (`dist.all_reduce` over `torch.from_numpy(x)`, `init_process_group("gloo")` with its own TCP
  store). No library shares a process with another; the peers' processes import nothing of pycoll.
  Every job gets the same launch, binding (rank i on core i mod {cores}) and environment.
- **Same buffers**: each rank makes `x = np.ones(size / 4, np.float32)` as a user would (from 1 MiB up
  numpy places it 16 bytes into a page: the `offset` column of the raw tables), checks the first
  in-place SUM (every element = N), then fills it with zeros so repeated sums stay finite.
- **Interleaved**: ranks wait on a blocking socket read from the driver between turns, and during a
  job's turn the other jobs' ranks are stopped (SIGSTOP, then SIGCONT): an idle Gloo rank wakes about
  100 times a second (2-4 ms of CPU a second), and those wake-ups landed in the other libraries'
  timings. The waiting jobs' CPU during timed turns (their mpirun included) is measured from /proc
  and listed below: near 0. Each round visits
  every size, and at each size each job in turn (the order rotating); a turn is one untimed call, the
  library's barrier, then a timed loop of about 0.1 s (iterations calibrated per job and size from
  its first calls, at least 2). A job's time at a size is the median over rounds of the slowest
  rank's mean call; min-max is the spread over rounds; **CPU/call** is user+sys of the whole rank
  process (all threads; `getrusage` around the timed loop), the ranks' mean, median over rounds:
  with ranks sharing cores, that is what a collective takes from compute.
- **Ratios** (bold) are peer time / pycoll time at the same size in the same run: above 1, pycoll is
  faster. With `--runs 2`, the two runs' ratios are listed (run 1, run 2), then in brackets the range
  of the ratio round by round (a peer's turn against pycoll's turn of the same round, seconds
  apart) over both runs; the times are run 1's.
  The algorithm column is what pycoll's tuner chose for that size.
- **Peer columns checked**: `benchmarks/standalone_peers.py` times plain mpi4py and Gloo loops (no
  bench, no pycoll) under the same mpirun line and compares them with the bench's peer columns
  (slow test `test_peer_columns_agree_with_standalone_loops`).
- **Machine**: {node}, {cores} cores, Python {py}, Open MPI {ompi}, torch {torch}. Other jobs were
  running: {load}. With N=4 two ranks share each core; under such load every figure moves by
  2x and more between rounds, so read the spreads and the run-to-run ratios, not one digit.
"""


def agreement_section(sizes: str) -> str:
    """benchmarks/standalone_peers.py at N=2: the bench's peer columns against plain loops run alone."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import standalone_peers
    load = os.getloadavg()[0]
    repeats, rounds = 8, 3
    rows = standalone_peers.agreement(2, [parse_size(s) for s in sizes.split(",")], ["mpi", "mpi-tcp", "gloo"],
                                      repeats, rounds, 0.1)
    inside = sum(abs(r["ratio"] - 1) <= 0.15 for r in rows)
    return ("### Do the peer columns match the peers on their own?\n\n"
            "`python benchmarks/standalone_peers.py --np 2 --sizes " + sizes + "`: the bench (pycoll over shm beside "
            f"the three peers) and plain mpi4py / torch loops under the same mpirun line, alternating, {repeats} "
            f"repeats of {rounds} rounds each (load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at "
            "the end). The figure judged is the median of bench/standalone over every pair of a bench round and a "
            "standalone round: on this VM rounds fall into two states (an 8 B Open MPI call takes 0.8-0.9 or "
            "1.4-1.6 us for seconds at a time), and a ratio of medians jumps when one side's median crosses "
            f"between them. The goal is within 15%: {inside} of {len(rows)} are. The per-repeat columns show how "
            "far each side's repeats scatter.\n\n"
            + standalone_peers.markdown(rows, 0.15) + "\n")


def versions() -> Tuple[str, str]:
    ompi = subprocess.run(["mpirun", "--version"], capture_output=True, text=True).stdout.split("\n")[0].split()[-1]
    torch = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                           text=True).stdout.strip()
    return ompi, torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8,64K,1M,16M,64M")
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--agreement-sizes", default="8,64K,1M,16M",
                    help="sizes of the bench-vs-standalone check at N=2 ('' skips it)")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp()
    os.environ["PYCOLL_TUNER_CACHE"] = os.path.join(tmp, "tuner")  # measured afresh, by this code
    sections, loads = [], []
    for n in [int(v) for v in args.ranks.split(",")]:
        runs, raw = [], []
        for i in range(args.runs):
            text, got = run_bench(n, args.sizes, args.rounds, os.path.join(tmp, f"n{n}_{i}.json"))
            runs.append(got)
            raw.append("\n".join(line for line in text.splitlines() if not line.startswith("# round")))
        loads.append(f"N={n}: " + load_line(runs))
        with open(os.path.join(HERE, f"benchmarks_allreduce_n{n}.json"), "w") as fh:
            json.dump(runs, fh, indent=1)
        lines: Dict[str, List[Tuple[int, float]]] = {}
        for row in runs[0]["rows"]:
            lines.setdefault(LABELS[row["library"]], []).append((row["size"], row["busbw"]))
        plot(lines, os.path.join(HERE, f"benchmarks_allreduce_n{n}.png"),
             f"allreduce float32 sum in place, {n} ranks on one {os.cpu_count()}-core host (run 1)")
        for kind, (ours, peers) in TABLES.items():
            sections.append(f"### N={n}, {kind}: {LABELS[ours]} against {', '.join(LABELS[p] for p in peers)}\n\n"
                            + table(runs, ours, peers) + "\n")
        sections.append(f"![allreduce busbw, N={n}](benchmarks_allreduce_n{n}.png)\n")
        sections.append(f"<details><summary>N={n}: the bench's own output</summary>\n\n```\n"
                        + "\n\n".join(raw) + "\n```\n</details>\n")
    if args.agreement_sizes:
        sections.append(agreement_section(args.agreement_sizes))
    ompi, torch = versions()
    how = HOW.format(sizes=args.sizes, rounds=args.rounds, runs=args.runs, cores=os.cpu_count(), node=platform.node(),
                     py=platform.python_version(), ompi=ompi, torch=torch, load="; ".join(loads))
    head = ("# pycoll benchmarks\n\nAllreduce, float32 SUM in place, one host. Generated by "
            "`python docs/make_benchmarks.py`; every table comes from one interleaved run of all five jobs "
            "(pycoll over shm and over tcp, Open MPI, Open MPI over TCP, Gloo), each library in processes "
            "of its own. The shm tables put pycoll over shared memory against Open MPI's shared-memory "
            "path (and Gloo, which has only TCP); the tcp tables put pycoll over TCP against Open MPI "
            "forced over TCP and Gloo.\n\n")
    latency = os.path.join(HERE, "benchmarks_latency.md")  # docs/make_latency.py's section, kept as it is
    kept = open(latency).read() if os.path.exists(latency) else ""
    with open(os.path.join(HERE, "benchmarks.md"), "w") as fh:
        fh.write(head + "\n".join(sections) + "\n" + how + ("\n" + kept if kept else ""))


if __name__ == "__main__":
    main()

"""Regenerate the section "Persistent collectives and the small-message floor" of docs/benchmarks.md:
`pycoll bench allreduce --np N --transport shm,tcp --persistent --compare mpi,mpi-tcp,python-shm,torch-pycoll`
at N=2 and N=4, each one interleaved run of all eight jobs, each library in processes of its own.

    python docs/make_latency.py [--sizes 8,4K,16K] [--ranks 2,4] [--rounds 7]

The section goes to docs/benchmarks_latency.md and between its markers in docs/benchmarks.md (where
docs/make_benchmarks.py keeps it when it rewrites the rest); the rows to benchmarks_latency_n<N>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SECTION = os.path.join(HERE, "benchmarks_latency.md")
BEGIN, END = "<!-- latency: docs/make_latency.py -->", "<!-- /latency -->"
JOBS = "pycoll-shm, pycoll-tcp, their -persistent twins, mpi, mpi-tcp, python-shm, torch-pycoll"
# the goals: (pycoll job, peer, most allowed ratio pycoll / peer), per N
GOALS = {2: [("pycoll-shm", "mpi", 6.0), ("pycoll-shm-persistent", "mpi", 3.0), ("pycoll-tcp", "mpi-tcp", 4.0)],
         4: [("pycoll-shm", "mpi", 3.0), ("pycoll-shm-persistent", "mpi", 2.0), ("pycoll-tcp", "mpi-tcp", 4.0)]}
TORCH_GOAL_US = 12.0  # dist.all_reduce of 16 KiB on 2 ranks
SHOWN = ("pycoll-shm", "pycoll-shm-persistent", "python-shm", "mpi", "pycoll-tcp", "pycoll-tcp-persistent", "mpi-tcp",
         "torch-pycoll")
LABELS = {"pycoll-shm": "pycoll shm", "pycoll-shm-persistent": "pycoll shm, handle", "python-shm": "Python floor",
          "mpi": "Open MPI", "pycoll-tcp": "pycoll tcp", "pycoll-tcp-persistent": "pycoll tcp, handle",
          "mpi-tcp": "Open MPI TCP", "torch-pycoll": "torch on pycoll"}


def run_bench(n: int, sizes: str, rounds: int, out: str) -> Dict[str, Any]:
    cmd = [sys.executable, "-m", "pycoll", "bench", "allreduce", "--np", str(n), "--transport", "shm,tcp",
           "--persistent", "--compare", "mpi,mpi-tcp,python-shm,torch-pycoll", "--sizes", sizes, "--rounds",
           str(rounds), "--json", out]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=3000,
                          cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")
    with open(out) as fh:
        return json.load(fh)


def human(nbytes: int) -> str:
    return f"{nbytes >> 10} KiB" if nbytes >= 1024 else f"{nbytes} B"


def cell(row: Optional[Dict[str, Any]]) -> str:
    return "-" if row is None else f"{row['time_us']:.1f} us ({row['cpu_us']:.1f})"


def table(run: Dict[str, Any]) -> str:
    """Time per call (CPU per call) of every job at every size."""
    rows = {(r["size"], r["library"]): r for r in run["rows"]}
    sizes = sorted({r["size"] for r in run["rows"]})
    head = "| size | " + " | ".join(LABELS[j] for j in SHOWN) + " |\n|---|" + "---|" * len(SHOWN) + "\n"
    return head + "".join(f"| {human(s)} | " + " | ".join(cell(rows.get((s, j))) for j in SHOWN) + " |\n"
                          for s in sizes)


def goals(n: int, run: Dict[str, Any]) -> List[str]:
    """One line per goal of the issue: the ratio at each size, met or missed; not judged when the
    machine was loaded beyond twice its cores at the start or the end (then a call's time is mostly
    other processes' time slices, for every library alike but not by the same amount)."""
    rows = {(r["size"], r["library"]): r for r in run["rows"]}
    sizes = sorted({r["size"] for r in run["rows"] if r["size"] <= 4096})
    meta = run["meta"]
    load = max(meta["load_start"][0], meta["load_end"][0])
    judged = load <= 2 * meta["cores"]
    out = [] if judged else [f"- **not judged**: load average up to {load:.1f} on {meta['cores']} cores; re-run "
                             "`python docs/make_latency.py` on a quiet machine"]
    for ours, peer, most in GOALS[n]:
        ratios = [rows[s, ours]["time_us"] / rows[s, peer]["time_us"] for s in sizes]
        verdict = ("met" if max(ratios) <= most else "**missed**") if judged else "not judged"
        out.append(f"- {LABELS[ours]} / {LABELS[peer]} at " + ", ".join(
            f"{human(s)} {r:.1f}x" for s, r in zip(sizes, ratios)) + f" (goal at most {most:g}x): {verdict}")
    floor = [rows[s, "pycoll-shm-persistent"]["time_us"] / rows[s, "python-shm"]["time_us"] for s in sizes]
    out.append("- pycoll shm, handle / Python's floor at " + ", ".join(
        f"{human(s)} {r:.1f}x" for s, r in zip(sizes, floor)) + " (how far the handle is from a bare Python loop)")
    if n == 2 and (16384, "torch-pycoll") in rows:
        t = rows[16384, "torch-pycoll"]["time_us"]
        out.append(f"- torch, dist.all_reduce of 16 KiB: {t:.1f} us (goal at most {TORCH_GOAL_US:g} us): "
                   + (("met" if t <= TORCH_GOAL_US else "**missed**") if judged else "not judged"))
    return out


SINGLE = r'''
import json, time, numpy as np, pycoll
from pycoll.channel import Channel
comm = pycoll.init()  # one rank: nothing to wait for, so this is the CPU of the Python path itself
x = np.zeros(2, np.float32)
h = comm.allreduce_init(x)
fresh = lambda: Channel(comm.transport, comm.group, comm.rank, comm.comm_id, 1, 10.0, None, comm.board, comm.windows,
                        "allreduce", comm.name)
ch = h._ch
ch.board_exchange(x, 5)
ch.board_exchange(x, 5)
go = ch.prepared[id(x)][4]
def start_wait():
    h.start()
    h.wait()
parts = {"plain allreduce": lambda: comm.allreduce(x), "handle h()": h, "handle start() + wait()": start_wait,
         "checks at a start (h._ready)": h._ready,
         "flight recorder (Recorder.call, empty body)": lambda: comm._recorder.call(1, "allreduce", h._fp, h._algo,
                                                                                  lambda c: None, ch),
         "a Channel made (plain call)": fresh,
         "a Channel made and its board exchange (plain call)": lambda: fresh().board_exchange(x, 5),
         "board exchange, prepared (handle)": lambda: go(10.0, "w"),
         "the reduction of two 8 B inputs (np.add)": lambda: np.add(x, x, out=x)}
out = {}
for name, f in parts.items():
    for _ in range(2000):
        f()
    best = 1e9
    for _ in range(7):
        t0 = time.thread_time()
        for _ in range(4000):
            f()
        best = min(best, (time.thread_time() - t0) / 4000)
    out[name] = best * 1e6
print("RESULT " + json.dumps(out))
comm.close()
'''


def single_rank() -> Dict[str, float]:
    """Thread CPU per call of the Python path on one rank (8 B, shm board), min over 7 batches: robust to
    other load, as it counts only this thread's CPU."""
    proc = subprocess.run([sys.executable, "-c", SINGLE], capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT, PYCOLL_TRANSPORT="shm", PYCOLL_TUNER="model"))
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise SystemExit(f"single-rank measurement failed:\n{proc.stdout}\n{proc.stderr}")


def single_table(us: Dict[str, float]) -> str:
    return ("\n### Where a small call's microseconds go (one rank, thread CPU per call, 8 B)\n\n"
            "With no peer to wait for, this is the Python path alone; the thread's own CPU time, minimum over "
            "7 batches, so other processes' load hardly moves it. The parts are timed by themselves.\n\n"
            "| what | us per call |\n|---|---|\n" + "".join(f"| {k} | {v:.2f} |\n" for k, v in us.items()))


def section(runs: Dict[int, Dict[str, Any]], rounds: int, single: Optional[Dict[str, float]] = None) -> str:
    parts = [f"{BEGIN}\n## Persistent collectives and the small-message floor\n\n"
             "`h = comm.allreduce_init(x, op=...)` (and `reduce_`, `broadcast_`, `allgather_`, `reduce_scatter_`, "
             "`alltoall_`, `barrier_init`, `send_init`/`recv_init`) checks the call and picks its algorithm once; "
             "`h()` (or `h.start()` ... `h.wait()`) then runs it on the same buffers as often as wanted "
             "(pycoll/persistent.py). A start still takes the next call number, checks that the communicator is "
             "open and the buffers are unchanged, is recorded by the flight recorder and bounded by the timeout; "
             "it skips the argument conversion and checks, the op and algorithm choice, the call's closure and "
             "Channel, and its board posts are prepared once (ShmBoard.prepare). The torch backend runs a handle "
             "for a tensor whose memory (address, count, dtype, op) it has allreduced before "
             "(pycoll/torch/reuse.py).\n\n"
             f"Generated by `python docs/make_latency.py`: at each N one interleaved run of eight jobs ({JOBS}), "
             f"{rounds} rounds, each library in its own `mpirun` job as in the tables above. **Python floor** "
             "(`--compare python-shm`) is the same exchange as pycoll's one-shot board (post to a shared slot, "
             "publish a counter, yield until every counter is there, sum the slots in rank order) written as a "
             "bare loop over a file in /dev/shm with no pycoll in it: what Python itself costs. **torch on "
             "pycoll** is `dist.all_reduce` on backend pycoll. Each cell: median time per call over rounds "
             "(slowest rank's mean), in brackets CPU per call (user+sys, the ranks' mean).\n"]
    for n, run in sorted(runs.items()):
        meta = run["meta"]
        parts.append(f"\n### N={n} (load average {meta['load_start'][0]:.1f} at the start, "
                     f"{meta['load_end'][0]:.1f} at the end, {meta['cores']} cores)\n\n" + table(run) + "\n"
                     + "\n".join(goals(n, run)) + "\n")
    if single:
        parts.append(single_table(single))
    parts.append(f"\n{END}\n")
    return "".join(parts)


def splice(text: str, block: str) -> str:
    """`text` with the block between the markers replaced (appended where there is none)."""
    if BEGIN in text and END in text:
        before, rest = text.split(BEGIN, 1)
        return before + block.rstrip("\n") + rest.split(END, 1)[1]
    return text.rstrip("\n") + "\n\n" + block


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8,4K,16K")
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--from-json", action="store_true", help="rewrite the section from the saved runs")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp()
    runs = {}
    for n in [int(v) for v in args.ranks.split(",")]:
        saved = os.path.join(HERE, f"benchmarks_latency_n{n}.json")
        if args.from_json:
            with open(saved) as fh:
                runs[n] = json.load(fh)
            continue
        runs[n] = run_bench(n, args.sizes, args.rounds, os.path.join(tmp, f"n{n}.json"))
        with open(saved, "w") as fh:
            json.dump(runs[n], fh, indent=1)
    single_path = os.path.join(HERE, "benchmarks_latency_single.json")
    if args.from_json:
        with open(single_path) as fh:
            single = json.load(fh)
    else:
        single = single_rank()
        with open(single_path, "w") as fh:
            json.dump(single, fh, indent=1)
    block = section(runs, args.rounds, single)
    with open(SECTION, "w") as fh:
        fh.write(block)
    path = os.path.join(HERE, "benchmarks.md")
    with open(path) as fh:
        text = fh.read()
    with open(path, "w") as fh:
        fh.write(splice(text, block))


if __name__ == "__main__":
    main()

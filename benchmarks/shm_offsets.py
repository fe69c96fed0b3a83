"""Allreduce time against where the buffer starts within its 4 KiB page, between checkouts of pycoll.

    python benchmarks/shm_offsets.py TREE [TREE ...] [--rounds 3] [--ranks 4] [--sizes 1,16,64]

Each round launches `pycoll run -n RANKS` over shm once per tree and kind of buffer (the order
rotating every round). In a launch every rank times in-place float32 SUM allreduce on buffers that
start at byte 0, 8, 16, 64 and 2048+16 of a page: slices of a larger ordinary array ("plain"), or,
where the tree has registered buffers (`Communicator.empty`), in a launch of their own (a
communicator that has registered buffers asks at every call whether all ranks pass one), slices of
a registered buffer; the calls of the offsets of a size are interleaved (one call of each in turn). A launch reports per
variant the slowest rank's median call, and the largest median CPU time (user+sys) a rank spent per
call: with 4 ranks on 2 cores other jobs' load moves the wall time by 2x and more, the CPU time far
less. Prints per (tree, size, registered) the median over launches (spread: min-max of the launch
medians) at every offset, and the worst offset's time over the best's, for wall time and CPU time.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Tuple

OFFSETS = (0, 8, 16, 64, 2048 + 16)

RANK = r'''
import json, time, numpy as np, pycoll
OFFSETS, SIZES, CALLS, KIND = %r, %r, %r, %r
comm = pycoll.init()
registered = KIND == "registered"
out = {}
for mib in SIZES:
    nbytes = mib << 20
    variants = []
    for off in OFFSETS if not registered else ():
        raw = np.empty(nbytes + 8192, np.uint8)
        base = (-raw.ctypes.data) %% 4096
        variants.append(("plain", off, raw[base + off:base + off + nbytes].view(np.float32)))
    windows = []
    if registered:
        for off in OFFSETS:
            win = comm.empty(nbytes + 8192, np.uint8)
            windows.append(win)
            variants.append(("registered", off, win[off:off + nbytes].view(np.float32)))
    for _, _, x in variants:
        x[:] = 1
        comm.allreduce(x)
    times = {(kind, off): [] for kind, off, _ in variants}
    cpu = {(kind, off): [] for kind, off, _ in variants}
    for _ in range(CALLS[mib]):
        for kind, off, x in variants:
            comm.barrier()
            t, c = time.perf_counter(), time.process_time()
            comm.allreduce(x)
            cpu[kind, off].append(time.process_time() - c)
            times[kind, off].append(time.perf_counter() - t)
    for kind, off, x in variants:
        mine = np.array([np.median(times[kind, off]), np.median(cpu[kind, off])])
        comm.allreduce(mine, op="max")
        out[f"{mib}/{kind}/{off}"] = float(mine[0])
        out[f"{mib}/{kind}/{off}/cpu"] = float(mine[1])
    del variants, x
    for win in windows:
        comm.free(win)
if comm.rank == 0:
    print("RESULT " + json.dumps(out), flush=True)
comm.close()
'''


def launch(tree: str, kind: str, ranks: int, sizes: List[int], calls: Dict[int, int]) -> Dict[str, float]:
    """One `pycoll run` job of `tree` over shm on `kind` buffers; {"MiB/kind/offset[/cpu]": seconds}."""
    env = dict(os.environ, PYTHONPATH=tree, PYCOLL_TRANSPORT="shm")
    script = RANK % (OFFSETS, sizes, calls, kind)
    cmd = [sys.executable, "-m", "pycoll", "run", "-n", str(ranks), sys.executable, "-c", script]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200, cwd=tree)
    for line in out.stdout.splitlines():
        if "RESULT " in line:
            return json.loads(line.split("RESULT ", 1)[1])
    raise RuntimeError(f"{tree}: no result\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trees", nargs="+", help="pycoll checkouts (each goes on PYTHONPATH)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--sizes", default="1,16,64", help="MiB, comma-separated")
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    calls = {s: max(6, min(40, 256 // s)) for s in sizes}
    got: Dict[Tuple[str, str], List[float]] = {}
    jobs = [(tree, kind) for tree in a.trees for kind in ("plain", "registered")
            if kind == "plain" or os.path.exists(os.path.join(tree, "pycoll", "windows.py"))]
    for r in range(a.rounds):
        for tree, kind in jobs[r % len(jobs):] + jobs[:r % len(jobs)]:
            for key, t in launch(tree, kind, a.ranks, sizes, calls).items():
                got.setdefault((tree, key), []).append(t)
        print(f"round {r + 1}/{a.rounds} done at {time.strftime('%H:%M:%S')}", file=sys.stderr, flush=True)
    print(f"N={a.ranks}, shm, in-place float32 SUM; median over {a.rounds} launches of the slowest rank's "
          "median call, ms (spread min-max)\n")
    for what, suffix in (("wall time per call", ""), ("CPU time per call (user+sys, the busiest rank)", "/cpu")):
        print(f"\n{what}\n")
        print("| tree | size | buffer | " + " | ".join(f"offset {o}" for o in OFFSETS) + " | worst/best |")
        print("|---|---|---|" + "---|" * (len(OFFSETS) + 1))
        for tree in a.trees:
            for mib in sizes:
                for kind in ("plain", "registered"):
                    runs = [got.get((tree, f"{mib}/{kind}/{o}{suffix}")) for o in OFFSETS]
                    if not all(runs):
                        continue
                    med = [statistics.median(v) for v in runs]
                    cells = [f"{m * 1e3:.2f} ({min(v) * 1e3:.2f}-{max(v) * 1e3:.2f})" for m, v in zip(med, runs)]
                    print(f"| {os.path.basename(os.path.normpath(tree))} | {mib} MiB | {kind} | "
                          + " | ".join(cells) + f" | {max(med) / min(med):.2f} |")


if __name__ == "__main__":
    main()

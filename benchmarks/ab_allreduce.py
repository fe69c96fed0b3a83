"""A/B timing of allreduce between two checkouts of pycoll, launches interleaved.

    python benchmarks/ab_allreduce.py OLD_TREE NEW_TREE [--rounds 6] [--ranks 4]

Each round launches `pycoll run -n RANKS` once per (tree, transport), alternating the trees, and
each launch times in-place float32 allreduce at 8 B, 1 MiB and 16 MiB on ordinary numpy arrays.
Prints per (transport, size) the median over rounds of each launch's median call, the spread
(min-max of the launch medians) and new/old.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SIZES = (8, 1 << 20, 16 << 20)
CALLS = {8: 400, 1 << 20: 60, 16 << 20: 12}

RANK = r'''
import json, time, numpy as np, pycoll
comm = pycoll.init()
out = {}
for nbytes, calls in %s:
    x = np.ones(nbytes // 4, np.float32)
    for _ in range(max(3, calls // 10)):
        comm.allreduce(x)
    times = []
    for _ in range(calls):
        comm.barrier()
        t = time.perf_counter()
        comm.allreduce(x)
        times.append(time.perf_counter() - t)
    mine = np.array([np.median(times)])
    comm.allreduce(mine, op="max")  # the slowest rank's median
    out[nbytes] = float(mine[0])
if comm.rank == 0:
    print("RESULT " + json.dumps(out), flush=True)
comm.close()
'''


def launch(tree: str, transport: str, ranks: int) -> dict:
    env = dict(os.environ, PYTHONPATH=tree, PYCOLL_TRANSPORT=transport)
    script = RANK % repr([(s, CALLS[s]) for s in SIZES])
    cmd = [sys.executable, "-m", "pycoll", "run", "-n", str(ranks), sys.executable, "-c", script]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tree)
    for line in out.stdout.splitlines():
        if "RESULT " in line:
            return {int(k): v for k, v in json.loads(line.split("RESULT ", 1)[1]).items()}
    raise RuntimeError(f"{tree} {transport}: no result\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--transports", default="shm,tcp")
    a = ap.parse_args()
    got = {}
    for r in range(a.rounds):
        for transport in a.transports.split(","):
            order = ("old", "new") if r % 2 == 0 else ("new", "old")
            for which in order:
                res = launch(getattr(a, which), transport, a.ranks)
                for size, t in res.items():
                    got.setdefault((transport, size, which), []).append(t)
        print(f"round {r + 1}/{a.rounds} done at {time.strftime('%H:%M:%S')}", file=sys.stderr, flush=True)
    print("| transport | size | old median (spread) | new median (spread) | new/old |")
    print("|---|---|---|---|---|")
    for transport in a.transports.split(","):
        for size in SIZES:
            o, n = got[(transport, size, "old")], got[(transport, size, "new")]
            mo, mn = statistics.median(o), statistics.median(n)
            fmt = (lambda v: f"{v * 1e6:.0f} us") if size < (1 << 20) else (lambda v: f"{v * 1e3:.2f} ms")
            print(f"| {transport} | {size} B | {fmt(mo)} ({fmt(min(o))}-{fmt(max(o))}) | "
                  f"{fmt(mn)} ({fmt(min(n))}-{fmt(max(n))}) | {mn / mo:.2f} |")


if __name__ == "__main__":
    main()

"""pycoll's allreduce on registered buffers (Communicator.empty) and on ordinary arrays against Open MPI's,
each library in processes of its own under the same mpirun, launches interleaved.

    python benchmarks/registered_vs_mpi.py [--ranks 4] [--rounds 5] [--sizes 1,16,64]

Each round runs, in an order that rotates every round, three `mpirun --oversubscribe -np RANKS`
jobs: mpi4py `Allreduce(IN_PLACE, x)` on an ordinary numpy array (np.ones: 16 bytes into its page),
pycoll `allreduce(x)` on the same kind of array, and pycoll on a registered buffer. Every job times
in-place float32 SUM at each size (a barrier before each call) and reports the slowest rank's
median call. Prints per size the median over rounds (spread: min-max) and Open MPI time / pycoll
time (>1: pycoll is faster).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MPI_RANK = r'''
import json, time, numpy as np
from mpi4py import MPI
comm = MPI.COMM_WORLD
SIZES, CALLS = %r, %r
out = {}
for mib in SIZES:
    x = np.ones((mib << 20) // 4, np.float32)
    for _ in range(3):
        comm.Allreduce(MPI.IN_PLACE, x)
    times = []
    for _ in range(CALLS[mib]):
        comm.Barrier()
        t = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, x)
        times.append(time.perf_counter() - t)
    out[mib] = comm.allreduce(float(np.median(times)), op=MPI.MAX)
if comm.rank == 0:
    print("RESULT " + json.dumps(out), flush=True)
'''

PYCOLL_RANK = r'''
import json, time, numpy as np, pycoll
SIZES, CALLS, REGISTERED = %r, %r, %r
comm = pycoll.init()
out = {}
for mib in SIZES:
    n = (mib << 20) // 4
    x = comm.empty(n, np.float32) if REGISTERED else np.empty(n, np.float32)
    x[:] = 1
    for _ in range(3):
        comm.allreduce(x)
    times = []
    for _ in range(CALLS[mib]):
        comm.barrier()
        t = time.perf_counter()
        comm.allreduce(x)
        times.append(time.perf_counter() - t)
    mine = np.array([np.median(times)])
    comm.allreduce(mine, op="max")
    out[mib] = float(mine[0])
    if REGISTERED:
        comm.free(x)
if comm.rank == 0:
    print("RESULT " + json.dumps(out), flush=True)
comm.close()
'''


def mpirun(ranks: int, script: str) -> Dict[int, float]:
    """One job under `mpirun --oversubscribe -np ranks`; {MiB: seconds}."""
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_btl_tcp_if_include": "lo", "OMPI_MCA_oob_tcp_if_include": "lo",
           "PYTHONPATH": ROOT, "PYCOLL_TRANSPORT": "shm"}
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PYCOLL_STORE_HOSTED"):
        env.pop(var, None)
    mpi = shutil.which("mpirun")
    if mpi is None:
        raise SystemExit("mpirun not found (apt-get install openmpi-bin)")
    out = subprocess.run([mpi, "--oversubscribe", "-np", str(ranks), sys.executable, "-c", script],
                         capture_output=True, text=True, env=env, timeout=1200, cwd=ROOT)
    for line in out.stdout.splitlines():
        if "RESULT " in line:
            return {int(k): v for k, v in json.loads(line.split("RESULT ", 1)[1]).items()}
    raise RuntimeError(f"no result\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sizes", default="1,16,64", help="MiB, comma-separated")
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    calls = {s: max(8, min(60, 320 // s)) for s in sizes}
    jobs = {"Open MPI": MPI_RANK % (sizes, calls),
            "pycoll, numpy array": PYCOLL_RANK % (sizes, calls, False),
            "pycoll, registered": PYCOLL_RANK % (sizes, calls, True)}
    names = list(jobs)
    got: Dict[Tuple[str, int], List[float]] = {}
    for r in range(a.rounds):
        for name in names[r % 3:] + names[:r % 3]:
            for mib, t in mpirun(a.ranks, jobs[name]).items():
                got.setdefault((name, mib), []).append(t)
        print(f"round {r + 1}/{a.rounds} done at {time.strftime('%H:%M:%S')}", file=sys.stderr, flush=True)
    print(f"N={a.ranks} under mpirun --oversubscribe, in-place float32 SUM, median over {a.rounds} interleaved "
          "launches of the slowest rank's median call, ms (spread min-max)\n")
    print("| size | " + " | ".join(names) + " | Open MPI / pycoll numpy | Open MPI / pycoll registered |")
    print("|---|" + "---|" * (len(names) + 2))
    for mib in sizes:
        med = {name: statistics.median(got[name, mib]) for name in names}
        cells = [f"{med[name] * 1e3:.2f} ({min(got[name, mib]) * 1e3:.2f}-{max(got[name, mib]) * 1e3:.2f})"
                 for name in names]
        print(f"| {mib} MiB | " + " | ".join(cells) + f" | {med['Open MPI'] / med['pycoll, numpy array']:.2f}x"
              f" | {med['Open MPI'] / med['pycoll, registered']:.2f}x |")


if __name__ == "__main__":
    main()

"""What waiting on a Work costs, flight recorder on and off: async allreduce + wait, and isend/irecv + wait.

    python -m pycoll run -n 1 benchmarks/wait_overhead.py [--calls 100000] [--batch 5000]

The world communicator records (the default ring; its Works stamp the caller's waits in their calls'
entries); a duplicate made with PYCOLL_TRACE_BUFFER=0 does not. The loops, `--calls` of each, run in
batches of `--batch`, alternating between the two communicators batch by batch so that drift in the
machine's load hits both alike: `allreduce(x, async_op=True).wait()` and, on 1 rank, `isend` to itself
+ `irecv` + both waited (on 2 ranks: rank 0 sends, rank 1 receives). Rank 0 prints per loop the min
and median over batches of ns per loop. These loops are dominated by the hand-off to the queue's
thread (tens of us) and swing with the load; the last line isolates what recording a wait adds:
Work.wait() on a Work that is already done, with and without a recorder entry to stamp (min and
median over 300 rounds of 1,000 waits, the two interleaved).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from concurrent.futures import Future
from typing import Callable, Dict, List

import numpy as np

import pycoll
from pycoll.work import Work


def _async_allreduce(comm: pycoll.Communicator, x: np.ndarray, calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        comm.allreduce(x, async_op=True).wait()
    return (time.perf_counter() - t) / calls


def _p2p(comm: pycoll.Communicator, x: np.ndarray, calls: int) -> float:
    y = np.empty_like(x)
    t = time.perf_counter()
    if comm.size == 1:
        for _ in range(calls):
            s = comm.isend(x, 0)
            comm.irecv(y, 0).wait()
            s.wait()
    elif comm.rank == 0:
        for _ in range(calls):
            comm.isend(x, 1).wait()
    elif comm.rank == 1:
        for _ in range(calls):
            comm.irecv(y, 0).wait()
    return (time.perf_counter() - t) / calls


def _wait_alone(entry: bool, n: int = 1000) -> float:
    """Seconds per Work.wait() on `n` done Works, each with a fresh recorder entry to stamp (`entry`) or none."""
    works = []
    for _ in range(n):
        f: "Future[None]" = Future()
        f.set_result(None)
        e = [0, "allreduce", None, None, 2, 0.0, 0.0, 0.0, None, 0, None, None, None, None]
        works.append(Work("bench", f, None, e) if entry else Work("bench", f, None))
    t = time.perf_counter()
    for w in works:
        w.wait()
    return (time.perf_counter() - t) / n


def _ns(values: List[float]) -> str:
    return f"{min(values) * 1e9:.0f} / {statistics.median(values) * 1e9:.0f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=100000)
    p.add_argument("--batch", type=int, default=5000)
    args = p.parse_args()
    on = pycoll.init()
    os.environ["PYCOLL_TRACE_BUFFER"] = "0"
    off = on.dup()
    assert on._recorder is not None and off._recorder is None
    x = np.zeros(2, np.float32)
    loops: Dict[str, Callable[[pycoll.Communicator, np.ndarray, int], float]] = {
        "allreduce(async_op=True).wait()": _async_allreduce, "isend/irecv + wait()": _p2p}
    results: Dict[str, Dict[str, List[float]]] = {}
    for label, loop in loops.items():
        for comm in (off, on):
            loop(comm, x, 1000)  # warm: connections, the algorithm's caches, the workers
        runs: Dict[str, List[float]] = {"off": [], "on": []}
        for r in range(max(2, args.calls // args.batch)):
            order = (("off", off), ("on", on)) if r % 2 == 0 else (("on", on), ("off", off))
            for name, comm in order:
                on.barrier()
                runs[name].append(loop(comm, x, args.batch))
        results[label] = runs
    if on.rank == 0:
        print(f"{on.size} rank(s) over {on.transport.name}, {args.calls} loops each in batches of {args.batch}, "
              f"load average {os.getloadavg()[0]:.2f}")
        print("| loop | recorder off: ns, min / median | recorder on: ns, min / median |")
        print("|---|---|---|")
        for label, runs in results.items():
            print(f"| {label} | {_ns(runs['off'])} | {_ns(runs['on'])} |")
        alone: Dict[bool, List[float]] = {False: [], True: []}
        for _ in range(300):
            for entry in (False, True):
                alone[entry].append(_wait_alone(entry))
        print(f"\nWork.wait() on a done Work, ns min / median: {_ns(alone[False])} with no entry, "
              f"{_ns(alone[True])} stamping its entry")
    off.close()
    on.close()


if __name__ == "__main__":
    main()

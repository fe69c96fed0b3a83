"""What waiting on a Work costs, flight recorder on and off: async allreduce + wait, and isend/irecv + wait.

    python -m pycoll run -n 1 benchmarks/wait_overhead.py [--calls 100000] [--rounds 5]

The world communicator records (the default ring); a duplicate made with PYCOLL_TRACE_BUFFER=0 does
not. Each round times a batch of `--calls` loops on one, then on the other (the order alternating
round by round, so drift in the machine's load hits both alike): `allreduce(x, async_op=True).wait()`
and, on 1 rank, `isend` to itself + `irecv` + both waited (on 2 ranks: rank 0 sends, rank 1 receives).
Rank 0 prints the median over rounds of ns per loop, and on - off. A last line times Work.wait()
alone on a Work that is already done, with and without a recorder entry to stamp (what recording a
wait adds, free of the call's own cost).
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


def _wait_alone(n: int, entry: bool) -> float:
    """ns of Work.wait() on a done Work, with a recorder entry to stamp (`entry`) or none."""
    total = 0.0
    for _ in range(n // 1000):
        works = []
        for _ in range(1000):
            f: "Future[None]" = Future()
            f.set_result(None)
            e = [0, "allreduce", None, None, 2, 0.0, 0.0, 0.0, None, 0, None, None, None, None]
            works.append(Work("bench", f, None, e) if entry else Work("bench", f, None))
        t = time.perf_counter()
        for w in works:
            w.wait()
        total += time.perf_counter() - t
    return total / n * 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=100000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    on = pycoll.init()
    os.environ["PYCOLL_TRACE_BUFFER"] = "0"
    off = on.dup()
    assert on._recorder is not None and off._recorder is None
    x = np.ones(2, np.float32)
    loops: Dict[str, Callable[[pycoll.Communicator, np.ndarray, int], float]] = {
        "allreduce(async_op=True).wait()": _async_allreduce, "isend/irecv + wait()": _p2p}
    results: Dict[str, Dict[str, List[float]]] = {}
    for label, loop in loops.items():
        for comm in (off, on):
            loop(comm, x, max(100, args.calls // 20))  # warm: connections, the algorithm's caches, workers
        runs: Dict[str, List[float]] = {"off": [], "on": []}
        for r in range(args.rounds):
            order = (("off", off), ("on", on)) if r % 2 == 0 else (("on", on), ("off", off))
            for name, comm in order:
                on.barrier()
                runs[name].append(loop(comm, x, args.calls))
        results[label] = runs
    if on.rank == 0:
        print(f"{on.size} rank(s) over {on.transport.name}, {args.calls} loops x {args.rounds} interleaved rounds, "
              f"load average {os.getloadavg()[0]:.2f}")
        print("| loop | recorder off: ns | recorder on: ns | on - off: ns |")
        print("|---|---|---|---|")
        for label, runs in results.items():
            m_off, m_on = statistics.median(runs["off"]) * 1e9, statistics.median(runs["on"]) * 1e9
            print(f"| {label} | {m_off:.0f} | {m_on:.0f} | {m_on - m_off:+.0f} |")
        bare = statistics.median(_wait_alone(100000, False) for _ in range(5))
        stamped = statistics.median(_wait_alone(100000, True) for _ in range(5))
        print(f"\nWork.wait() on a done Work: {bare:.0f} ns with no entry, {stamped:.0f} ns stamping its entry "
              f"({stamped - bare:+.0f} ns)")
    off.close()
    on.close()


if __name__ == "__main__":
    main()

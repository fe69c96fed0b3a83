"""What the flight recorder costs: allreduce of 8 B and 1 MiB with the recorder on and off, interleaved.

    python -m pycoll run -n 2 benchmarks/trace_overhead.py [--rounds 15] [--calls8 400] [--calls1m 40]

The world communicator records (the default ring; under `pycoll run` PYCOLL_TRACE_DIR is set, so the
live file is updated too); every rank makes one duplicate of it with PYCOLL_TRACE_BUFFER=0
(recording off). Only the first two board lanes a process opens have a stage (two-shot's), so a
second duplicate would run another algorithm above a slot: the table names the algorithm each side
ran. Each round times a batch of calls on one, then on the other, the order alternating round by
round, so drift in the machine's load hits both alike. Rank 0 prints, per size, the median over
rounds of the batch's mean call time, the spread (25th-75th percentile of the rounds), on/off of the
medians, and the median of the rounds' on/off ratios (each on batch against the off batch next to
it, which cancels slow drift in a noisy machine's load). A second table times the recording alone
(Recorder.call around an empty body, call site included) in a loop.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Dict, List

import numpy as np

import pycoll
from pycoll.trace import recorder


def _batch(comm: pycoll.Communicator, x: np.ndarray, calls: int) -> float:
    comm.barrier()
    t = time.perf_counter()
    for _ in range(calls):
        comm.allreduce(x)
    return (time.perf_counter() - t) / calls


def _quartiles(values: List[float]) -> str:
    q = statistics.quantiles(values, n=4)
    return f"{q[0] * 1e6:.1f}-{q[2] * 1e6:.1f}"


def _record_alone(n: int) -> float:
    """Seconds that recording adds to a blocking call (ring of 2000, call site included): a loop of
    Recorder.call around a body that does nothing, less the same loop calling the body directly."""
    rec = recorder.Recorder("bench", 1, 0, [0], 2000)
    fp = (np.dtype(np.float32), 2, pycoll.ReduceOp.SUM, None)

    def body(ch: object) -> None:
        return None
    t = time.perf_counter()
    for seq in range(n):
        rec.call(seq, "allreduce", fp, None, body, None)
    recorded = time.perf_counter() - t
    t = time.perf_counter()
    for seq in range(n):
        body(None)
    return (recorded - (time.perf_counter() - t)) / n


def _ran(comm: pycoll.Communicator, x: np.ndarray) -> str:
    """The algorithm `comm` runs for an allreduce of `x` (two-shot falls back without a stage)."""
    name = comm.selector.choose("allreduce", x.nbytes, comm.size, None, comm.topology)
    if name == "twoshot" and not (comm.board is not None and comm.board.stage_bytes):
        name = "halving_doubling (twoshot without a stage)"
    return name


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls8", type=int, default=400, help="calls per batch at 8 B")
    p.add_argument("--calls1m", type=int, default=40, help="calls per batch at 1 MiB")
    args = p.parse_args()
    on = pycoll.init()
    os.environ["PYCOLL_TRACE_BUFFER"] = "0"
    off = on.dup()
    if on._recorder is None:
        raise SystemExit("the world communicator does not record: unset PYCOLL_TRACE_BUFFER=0")
    assert off._recorder is None
    results: Dict[int, Dict[str, List[float]]] = {}
    algos: Dict[int, Dict[str, str]] = {}
    for nbytes, calls in ((8, args.calls8), (1 << 20, args.calls1m)):
        x = np.zeros(nbytes // 4, np.float32)  # (ones summed in place overflow to inf)
        for comm in (off, on):  # warm both: connections, boards, the algorithm's buffers
            _batch(comm, x, max(10, calls // 4))
        algos[nbytes] = {"off": _ran(off, x), "on": _ran(on, x)}
        runs: Dict[str, List[float]] = {"off": [], "on": []}
        for r in range(args.rounds):
            order = (("off", off), ("on", on)) if r % 2 == 0 else (("on", on), ("off", off))
            for name, comm in order:
                runs[name].append(_batch(comm, x, calls))
        results[nbytes] = runs
    if on.rank == 0:
        print(f"allreduce, {on.size} ranks over {on.transport.name}, {args.rounds} interleaved rounds "
              f"(PYCOLL_TRACE_DIR {'set' if os.environ.get('PYCOLL_TRACE_DIR') else 'unset'})")
        print("| size | algorithm (off, on) | recorder off: median us (IQR) | recorder on: median us (IQR) "
              "| on/off of medians | on/off paired by round: median (IQR) |")
        print("|---|---|---|---|---|---|")
        for nbytes, runs in results.items():
            m_off, m_on = statistics.median(runs["off"]), statistics.median(runs["on"])
            ratios = [a / b for a, b in zip(runs["on"], runs["off"])]
            q = statistics.quantiles(ratios, n=4)
            label = "8 B" if nbytes == 8 else "1 MiB"
            ran = algos[nbytes]
            print(f"| {label} | {ran['off']}, {ran['on']} | {m_off * 1e6:.1f} ({_quartiles(runs['off'])}) "
                  f"| {m_on * 1e6:.1f} ({_quartiles(runs['on'])}) | {m_on / m_off:.3f} | {statistics.median(ratios):.3f} "
                  f"({q[0]:.3f}-{q[2]:.3f}) |")
        alone = statistics.median(_record_alone(20000) for _ in range(5))
        print(f"\nrecording alone (Recorder.call, call site included): {alone * 1e9:.0f} ns per call")
    off.close()
    on.close()


if __name__ == "__main__":
    main()

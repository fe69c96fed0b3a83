"""Single collectives on one host, ranks sharing its cores: the tuner's prediction of a call
(Tuner.call_time) against the measured time (slow), beside predict() alone (before the per-call cost
and the wake-ups of ranks beyond the cores) and the same model with parameters measured sustained
(median, 4 MiB) instead of the probe's best of a few. `python tests/test_predict_cores.py 2,4,8`
prints the table (`--save F` keeps the measurements, `--load F` prints them again with today's model)."""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import replace
from typing import Any, Dict, List, Sequence

import numpy as np
import pytest

from multiproc import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import cross_cpu  # noqa: E402
from pycoll.topology import Topology
from pycoll.tuner import Link, Params, Tuner

SIZES = [8, 64 << 10, 1 << 20, 4 << 20]
ALGOS = ["oneshot", "twoshot", "cma", "ring", "recursive_doubling", "halving_doubling", "tree"]
SUSTAINED_BYTES = 4 << 20


def sustained(comm: Any, iters: int) -> List[float]:
    """Ranks 0 and 1 ping-pong 8 B and SUSTAINED_BYTES (the others wait): [alpha, beta] from the
    median round trips, where the tuner's probe takes the best of a few (and 1 MiB, in cache)."""
    small, big = np.zeros(1, np.float64), np.zeros(SUSTAINED_BYTES // 8, np.float64)
    rtt: Dict[int, List[float]] = {small.nbytes: [], big.nbytes: []}
    if comm.rank < 2:
        for buf in (small, big):
            for _ in range(iters + 1):
                t = time.perf_counter()
                if comm.rank == 0:
                    comm.send(buf, 1)
                    comm.recv(buf, 1)
                else:
                    comm.recv(buf, 0)
                    comm.send(buf, 0)
                rtt[buf.nbytes].append(time.perf_counter() - t)
    out = np.array([statistics.median(rtt[8][1:]), statistics.median(rtt[big.nbytes][1:])] if comm.rank == 0
                   else [0.0, 0.0])
    comm.broadcast(out, root=0)
    alpha = out[0] / 2
    return [alpha, max(out[1] / 2 - alpha, 1e-6) / big.nbytes]


def reduce_gamma(comm: Any, iters: int) -> float:
    """Seconds per byte of a float32 add of SUSTAINED_BYTES on rank 0 alone (median; the probe's is the
    best of a few 256 KiB adds, in cache)."""
    out = np.zeros(1)
    if comm.rank == 0:
        a = np.ones(SUSTAINED_BYTES // 4, np.float32)
        b = np.ones_like(a)
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            np.add(a, b, out=a)
            times.append(time.perf_counter() - t)
        out[0] = statistics.median(times) / a.nbytes
    comm.broadcast(out, root=0)
    return float(out[0])


def bench(comm: Any, sizes: Sequence[int], algos: Sequence[str], iters: int) -> Dict[str, Any]:
    """Per size and algorithm the median over `iters` of the slowest rank's time, measured in rounds
    that visit every point once (the first round warms up; in each visit a call of the same shape
    runs first, as in a loop of them): a spell of the machine's slow state (measure()) then lands on a
    few samples of every point, not on all samples of a few; the tuner's parameters and choice; a
    sustained measure of the same links."""
    tuner = comm.selector.tuner
    link = sustained(comm, iters) + [reduce_gamma(comm, iters)]
    points = [(nbytes, algo) for nbytes in sizes for algo in algos
              if not math.isinf(tuner.predict("allreduce", algo, nbytes, comm.topology))]
    times: Dict[Any, List[float]] = {point: [] for point in points}
    for it in range(iters + 1):
        for nbytes, algo in points:
            x = np.full(max(1, nbytes // 4), comm.rank + 1, np.float32)
            comm.allreduce(x, algo=algo)  # warm, as a call of the same shape just before leaves it
            comm.barrier()
            t = time.perf_counter()
            comm.allreduce(x, algo=algo)
            took = np.array([time.perf_counter() - t])
            comm.allreduce(took, op="max", algo="recursive_doubling")
            if it:
                times[nbytes, algo].append(float(took[0]))
    chosen = {nbytes: comm.selector.choose("allreduce", nbytes, comm.size, topo=comm.topology) for nbytes in sizes}
    rows = [{"bytes": nbytes, "algo": algo, "chosen": algo == chosen[nbytes],
             "measured": statistics.median(times[nbytes, algo])} for nbytes, algo in points]
    return {"rows": rows, "params": list(tuner.params.row()), "cores": comm.topology.cores[0],
            "board": tuner.board_bytes, "stage": tuner.stage_bytes, "sustained": link,
            "load": os.getloadavg()[0]}


def measure(ranks: Sequence[int], iters: int = 7, tries: int = 3) -> Dict[int, Dict[str, Any]]:
    """bench on n ranks of this host, for each n (a fresh tuner probe each time). This VM has spells of
    10-30 s in which all data crossing between its CPUs runs 6-8x slower (benchmarks/cross_cpu.py);
    a model calibrated at init cannot follow them, so the machine's state is measured before and after
    each job, and a job that a slow check brackets runs again (at most `tries` times; the last is kept,
    marked)."""
    out = {}
    for n in ranks:
        res, checks, attempt = cross_cpu.bracketed(
            lambda: run_ranks(bench, n, SIZES, ALGOS, iters, timeout=600, env={"PYCOLL_TUNER_CACHE": "off"})[0],
            tries)
        res.update(machine=checks, slow_state=any(c["slow"] for c in checks), attempt=attempt)
        out[n] = res
    return out


def predictions(res: Dict[str, Any], n: int) -> List[Dict[str, Any]]:
    """Each row with the tuner's call time from its probe parameters and from the sustained ones."""
    probe = Params.from_row(res["params"], "probe")
    a, b, g = res["sustained"]
    steady = replace(probe, shm=Link(a, b), gamma=g, source="sustained")  # the cache and spill probed
    topo = Topology.from_hosts([0] * n, res["cores"])
    out = []
    for row in res["rows"]:
        got = dict(row)
        for name, p in (("probe", probe), ("sustained", steady)):
            got[name] = Tuner(p, res["board"], res["stage"]).call_time("allreduce", row["algo"], row["bytes"], topo)
        got["before"] = Tuner(probe, res["board"], res["stage"]).predict("allreduce", row["algo"], row["bytes"], topo)
        out.append(got)
    return out


def errors(results: Dict[int, Dict[str, Any]], key: str, chosen: bool = True) -> List[float]:
    """log(measured / predicted[key]) over the rows (the tuner's choices only, by default)."""
    return [math.log(r["measured"] / r[key]) for n, res in results.items() for r in predictions(res, n)
            if r["chosen"] or not chosen]


def table(results: Dict[int, Dict[str, Any]]) -> str:
    """Markdown: per ranks, size and algorithm, predicted (probe / sustained parameters) and measured."""
    lines = ["| ranks | cores | size | algorithm (* chosen) | before: predict() (ms) | call_time, probe (ms) | "
             "call_time, sustained (ms) | measured (ms) | measured / call_time (probe) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for n, res in results.items():
        for r in predictions(res, n):
            lines.append(f"| {n} | {res['cores']} | {r['bytes']} | {r['algo']}{' *' if r['chosen'] else ''} | "
                         f"{r['before'] * 1e3:.3f} | {r['probe'] * 1e3:.3f} | {r['sustained'] * 1e3:.3f} | "
                         f"{r['measured'] * 1e3:.3f} | {r['measured'] / r['probe']:.2f} |")
    for key in ("before", "probe", "sustained"):
        for chosen in (True, False):
            e = errors(results, key, chosen)
            lines.append(f"\n{key}, {'the chosen algorithms' if chosen else 'every algorithm'}: measured/predicted "
                         f"geometric mean {math.exp(statistics.mean(e)):.2f}, typical factor "
                         f"{math.exp(statistics.mean(map(abs, e))):.2f}, within 2x {sum(abs(x) <= math.log(2) for x in e)}"
                         f"/{len(e)}")
    notes = [f"{n} ranks: probe shm {Params.from_row(res['params'], 'p').shm.describe()}, sustained "
             f"{Link(*res['sustained'][:2]).describe()}, reduce {1e-9 / res['sustained'][2]:.2g} GB/s "
             f"(probe {1e-9 / res['params'][4]:.2g}); load {res['load']:.1f}{_machine(res)}"
             for n, res in results.items()]
    return "\n".join(lines + [""] + notes)


def _machine(res: Dict[str, Any]) -> str:
    """The cross-CPU checks around the job (benchmarks/cross_cpu.py), where they were made."""
    if "machine" not in res:
        return ""
    ratios = " and ".join(f"{m['ratio']:.1f}x" for m in res["machine"] if m["ratio"] is not None)
    return (f"; cross-CPU exchange before and after: {ratios}{' (SLOW STATE)' if res['slow_state'] else ''}"
            f"{', job run ' + str(res['attempt']) + ' times' if res.get('attempt', 1) > 1 else ''}")


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_single_collectives_within_2x_with_ranks_sharing_cores():
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > 4 * cores:  # other jobs' runnable tasks, which the model does not know, would dominate
        pytest.skip(f"load average {load:.1f} on {cores} cores: measured 2-6x slower at 4-8 ranks than unloaded")
    results = measure([2, 4, 8])
    print("\n" + table(results))
    now, every, before = errors(results, "probe"), errors(results, "probe", False), errors(results, "before")
    # on a machine others load too, single points swing 2-6x from run to run: the claim is for the set
    assert math.exp(statistics.mean(map(abs, now))) <= 2.0, table(results)  # the tuner's picks: within 2x, typically
    assert abs(statistics.mean(every)) <= math.log(2), table(results)      # and no bias beyond 2x over all algorithms
    assert statistics.mean(map(abs, now)) < 0.5 * statistics.mean(map(abs, before)), table(results)


def save(path: str, results: Dict[int, Dict[str, Any]]) -> None:
    """Keep measure()'s results in a JSON file, for load()."""
    with open(path, "w") as fh:
        json.dump(results, fh)


def load(path: str) -> Dict[int, Dict[str, Any]]:
    """Results kept by save() (JSON keys are strings)."""
    with open(path) as fh:
        return {int(n): res for n, res in json.load(fh).items()}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="the table of single collectives on ranks sharing cores")
    ap.add_argument("ranks", nargs="?", default="2,4,8")
    ap.add_argument("--save", help="also write the measurements to this JSON file")
    ap.add_argument("--load", help="print the table from measurements saved before (with today's model)")
    a = ap.parse_args()
    got = load(a.load) if a.load else measure([int(n) for n in a.ranks.split(",")])
    if a.save:
        save(a.save, got)
    print(table(got))

"""One rank of the two-VM bench (tests/rdma/guest-pair.sh, under `pycoll run --nnodes 2`): the same
collectives over verbs, tcp and auto between the VMs, side by side in one run.

Every rank opens one communicator per transport (three pycoll.init()s in one process), then for
each collective and size runs a few rounds, the transports interleaved within each round (so a
noisy moment of the emulated machine hits them alike), and keeps each one's median round. Rank 0
prints the table and writes it as JSON. Per call: wall time, bus bandwidth (nccl-tests' busbw),
and CPU time per byte of the buffer: the ranks' own (user + system, all their threads) and their VMs'
whole (busy jiffies of /proc/stat: the kernel's share too, where soft-RoCE and TCP do their work).

    pycoll run --nnodes 2 --node-rank N --master-addr A -n 1 python3 tests/rdma/pair_bench.py --json F
"""
import argparse
import json
import os
import resource
import time
from typing import Dict, List

import numpy as np

import pycoll

TRANSPORTS = ("verbs", "tcp", "auto")
SIZES = [8, 1 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20]
BUS = {"allreduce": lambda n: 2 * (n - 1) / n, "broadcast": lambda n: 1.0}
_TICK = os.sysconf("SC_CLK_TCK")


def vm_busy() -> float:
    """Seconds this VM's CPUs have been busy (all of /proc/stat's first line but idle and iowait)."""
    with open("/proc/stat") as fh:
        fields = [int(v) for v in fh.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / _TICK


def own_cpu() -> float:
    """User + system seconds of this process, every thread."""
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def iters_for(nbytes: int) -> int:
    return max(3, min(40, (32 << 20) // max(nbytes, 1)))


def measure(comm: pycoll.Communicator, coll: str, nbytes: int, iters: int) -> List[float]:
    """[wall s per call, own CPU s per call, VM busy s per call, wrong results] on this rank."""
    x = np.ones(max(1, nbytes // 4), np.float32)
    wrong = 0
    run = (lambda: comm.allreduce(x)) if coll == "allreduce" else (lambda: comm.broadcast(x, root=0))
    for _ in range(2):  # warm-up (registrations, buffers)
        x[:] = 1
        run()
    comm.barrier()
    t, c, v = time.perf_counter(), own_cpu(), vm_busy()
    for _ in range(iters):
        x[:] = 1
        run()
    t, c, v = time.perf_counter() - t, own_cpu() - c, vm_busy() - v
    want = comm.size if coll == "allreduce" else 1
    wrong += int((x != want).any())
    return [t / iters, c / iters, v / iters, float(wrong)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="rank 0 writes the rows here")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    comms = {t: pycoll.init(transport=t) for t in TRANSPORTS}
    world = comms["tcp"]
    rows = []
    for coll in BUS:
        for nbytes in SIZES:
            samples: Dict[str, List[List[float]]] = {t: [] for t in TRANSPORTS}
            for _ in range(args.rounds):
                for t in TRANSPORTS:
                    samples[t].append(measure(comms[t], coll, nbytes, iters_for(nbytes)))
            for t in TRANSPORTS:
                mid = sorted(samples[t], key=lambda s: s[0])[len(samples[t]) // 2]  # the median round
                every = world.allgather(np.array(mid))  # (ranks, 4)
                wall = float(every[:, 0].max())
                rows.append({"collective": coll, "size": nbytes, "transport": comms[t].transport.name,
                             "time_us": wall * 1e6,
                             "busbw_gbs": nbytes / wall * BUS[coll](world.size) / 1e9,
                             "cpu_ns_per_byte": float(every[:, 1].sum()) / nbytes * 1e9,
                             "vm_ns_per_byte": float(every[:, 2].sum()) / nbytes * 1e9,
                             "wrong": int(every[:, 3].sum())})
    if world.rank == 0:
        print(table(rows))
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(rows, fh, indent=1)
    for c in comms.values():
        c.close()
    return 1 if any(r["wrong"] for r in rows) else 0


def table(rows: List[dict]) -> str:
    """Markdown: one line per collective and size, each transport's time, busbw and CPU per byte."""
    names = list(dict.fromkeys(r["transport"] for r in rows))
    head = "| collective | size (B) | " + " | ".join(
        f"{n} us | {n} GB/s | {n} CPU ns/B (ranks / VMs)" for n in names) + " |"
    lines = [head, "|---|---:|" + "---:|" * (3 * len(names))]
    by = {(r["collective"], r["size"], r["transport"]): r for r in rows}
    for coll, size in dict.fromkeys((r["collective"], r["size"]) for r in rows):
        cells = []
        for n in names:
            r = by[(coll, size, n)]
            cells += [f"{r['time_us']:.0f}", f"{r['busbw_gbs']:.4f}",
                      f"{r['cpu_ns_per_byte']:.3g} / {r['vm_ns_per_byte']:.3g}"]
        lines.append(f"| {coll} | {size} | " + " | ".join(cells) + " |")
    lines.append(f"# wrong results: {sum(r['wrong'] for r in rows)}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())

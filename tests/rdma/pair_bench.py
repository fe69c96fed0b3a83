"""One rank of the two-VM bench (tests/rdma/guest-pair.sh, under `pycoll run --nnodes 2`): the same
collectives over verbs, tcp and auto between the VMs, side by side in one run.

Every rank opens one communicator per transport (pycoll.init()s in one process; verbs twice: with
the default ACK timeout, 0.27 s per try, and with 17 ms, PYCOLL_VERBS_ACK_TIMEOUT=12, because the
emulated link drops frames and soft-RoCE then waits out the timeout before it resends), then for
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

# (label, PYCOLL_TRANSPORT, environment while it is made)
TRANSPORTS = (("verbs", "verbs", {}), ("verbs ack 17 ms", "verbs", {"PYCOLL_VERBS_ACK_TIMEOUT": "12"}),
              ("tcp", "tcp", {}), ("auto", "auto", {}))
SIZES = [8, 1 << 10, 64 << 10, 1 << 20, 4 << 20]
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
    """Calls per round: the same on every rank (a count, not a time), fewer for large sizes."""
    return max(1, min(20, (4 << 20) // max(nbytes, 1)))


def measure(comm: pycoll.Communicator, coll: str, nbytes: int, iters: int) -> List[float]:
    """[wall s per call, own CPU s per call, VM busy s per call, wrong results] on this rank."""
    x = np.ones(max(1, nbytes // 4), np.float32)
    wrong = 0
    run = (lambda: comm.allreduce(x)) if coll == "allreduce" else (lambda: comm.broadcast(x, root=0))
    for _ in range(1):  # warm-up (registrations, buffers)
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


def made_with(transport: str, env: Dict[str, str]) -> pycoll.Communicator:
    """A world communicator over `transport`, made while `env` is set (the transports read it then)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return pycoll.init(transport=transport)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="rank 0 writes the rows here")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", help="comma list of the labels to run (default all: " +
                    ", ".join(t[0] for t in TRANSPORTS) + ")")
    args = ap.parse_args()
    only = args.only.split(",") if args.only else [t[0] for t in TRANSPORTS]
    comms = {label: made_with(transport, env) for label, transport, env in TRANSPORTS if label in only}
    world = next(iter(comms.values()))
    labels = list(comms)
    rows = []
    for coll in BUS:
        for nbytes in SIZES:
            samples: Dict[str, List[List[float]]] = {t: [] for t in labels}
            for _ in range(args.rounds):
                for t in labels:
                    samples[t].append(measure(comms[t], coll, nbytes, iters_for(nbytes)))
            for t in labels:
                mid = sorted(samples[t], key=lambda s: s[0])[len(samples[t]) // 2]  # the median round
                every = world.allgather(np.array(mid))  # (ranks, 4)
                wall = float(every[:, 0].max())
                rows.append({"collective": coll, "size": nbytes, "transport": f"{t}: {comms[t].transport.name}",
                             "time_us": wall * 1e6,
                             "busbw_gbs": nbytes / wall * BUS[coll](world.size) / 1e9,
                             "cpu_ns_per_byte": float(every[:, 1].sum()) / nbytes * 1e9,
                             "vm_ns_per_byte": float(every[:, 2].sum()) / nbytes * 1e9,
                             "wrong": int(every[:, 3].sum())})
                if world.rank == 0:  # as it goes: a run cut short still shows what it measured
                    r = rows[-1]
                    print(f"{coll} {nbytes} B over {r['transport']}: {r['time_us']:.0f} us, {r['busbw_gbs']:.4f} "
                          f"GB/s, CPU {r['cpu_ns_per_byte']:.3g} / {r['vm_ns_per_byte']:.3g} ns/B", flush=True)
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

"""`pycoll bench`: an nccl-tests-style benchmark, and (with --np) pycoll beside Open MPI and torch Gloo.

Run on every rank (`pycoll run -n 4 pycoll bench allreduce ...` or under mpirun), rank 0 prints the
table: size, count, type, redop, root, then time/algbw/busbw/#wrong out-of-place and in-place.
With `--np N --compare mpi,mpi-tcp,gloo`, run once: it launches every library as a job of its own
(bench_compare.py) and times in-place float32 SUM allreduce in interleaved rounds.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

NAMES = {"all_reduce": "allreduce", "all_gather": "allgather", "reduce_scatter": "reduce_scatter",
         "alltoall": "alltoall", "broadcast": "broadcast", "reduce": "reduce", "allreduce": "allreduce",
         "allgather": "allgather"}
NCCL_TYPES = {"float32": "float", "float64": "double", "float16": "half", "bfloat16": "bfloat16",
              "int32": "int32", "int64": "int64", "int8": "int8", "uint8": "uint8"}


@dataclass(frozen=True)
class Spec:
    """How one collective is sized and scored (nccl-tests conventions)."""

    factor: Callable[[int], float]  # busbw = algbw * factor(n)
    total_is_sum: bool              # S counts every rank's block (allgather, reduce_scatter, alltoall)
    reduces: bool
    rooted: bool


SPECS = {
    "allreduce": Spec(lambda n: 2 * (n - 1) / n, False, True, False),
    "reduce_scatter": Spec(lambda n: (n - 1) / n, True, True, False),
    "allgather": Spec(lambda n: (n - 1) / n, True, False, False),
    "alltoall": Spec(lambda n: (n - 1) / n, True, False, False),
    "broadcast": Spec(lambda n: 1.0, False, False, True),
    "reduce": Spec(lambda n: 1.0, False, True, True),
}


def parse_size(text: str) -> int:
    """'8', '64K', '16M', '1G' -> bytes."""
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B")
    return int(float(text[:-1]) * mult[text[-1]]) if text and text[-1] in mult else int(text)


def sizes(begin: int, end: int, factor: int, step: int) -> List[int]:
    out, s = [], begin
    while s <= end:
        out.append(s)
        s = s * factor if factor > 1 else s + max(step, 1)
    return out


def pattern(rank: int, count: int, dtype: np.dtype, offset: int = 0) -> np.ndarray:
    """Small integers, so sums of a few ranks are exact in any dtype and any order."""
    return ((np.arange(offset, offset + count) + rank) % 7).astype(dtype)


class Case:
    """Buffers and expected results for one collective at one size on this rank."""

    def __init__(self, coll: str, nbytes: int, dtype: np.dtype, n: int, rank: int, root: int) -> None:
        self.coll, self.dtype, self.n, self.rank, self.root = coll, dtype, n, rank, root
        total = max(nbytes // dtype.itemsize, 0)
        spec = SPECS[coll]
        self.count = total - total % n if spec.total_is_sum else total  # elements counted by nccl-tests
        self.block = self.count // n if spec.total_is_sum else self.count
        self.nbytes = self.count * dtype.itemsize

    def inputs(self) -> np.ndarray:
        c = self.coll
        if c in ("allreduce", "reduce"):
            return pattern(self.rank, self.count, self.dtype)
        if c == "broadcast":
            return pattern(0, self.count, self.dtype) + (0 if self.rank == self.root else 1)
        if c == "allgather":
            return pattern(0, self.block, self.dtype, self.rank * self.block)
        return pattern(self.rank, self.count, self.dtype)  # reduce_scatter, alltoall

    def expected(self) -> Optional[np.ndarray]:
        c, n, r, b = self.coll, self.n, self.rank, self.block
        if c in ("allreduce", "reduce"):
            if c == "reduce" and r != self.root:
                return None
            return sum(pattern(i, self.count, np.int64) for i in range(n)).astype(self.dtype)
        if c == "broadcast":
            return pattern(0, self.count, self.dtype)
        if c == "allgather":
            return pattern(0, self.count, self.dtype)
        if c == "reduce_scatter":
            return sum(pattern(i, self.count, np.int64)[r * b:(r + 1) * b] for i in range(n)).astype(self.dtype)
        return np.concatenate([pattern(i, self.count, self.dtype)[r * b:(r + 1) * b] for i in range(n)])

    def out_buffer(self) -> np.ndarray:
        return np.empty(self.block if self.coll == "reduce_scatter" else self.count, self.dtype)


def pycoll_call(comm: Any, case: Case, x: np.ndarray, out: Optional[np.ndarray], algo: Optional[str],
                op: str) -> Callable[[], Any]:
    """One collective call; out=None means in place (out aliases x for the block collectives)."""
    c, r, root = case.coll, case.rank, case.root
    kw = {} if algo in (None, "auto") else {"algo": algo}
    if c == "allreduce":
        return lambda: comm.allreduce(x, out=out, op=op, **kw)
    if c == "reduce":
        return lambda: comm.reduce(x, root=root, op=op, out=out, **kw)
    if c == "broadcast":
        return lambda: comm.broadcast(x, root=root, **kw)
    if c == "allgather":
        if out is None:  # in place: my block already sits inside the output
            buf = x
            return lambda: comm.allgather(buf[r * case.block:(r + 1) * case.block], out=buf, **kw)
        return lambda: comm.allgather(x, out=out, **kw)
    if c == "reduce_scatter":
        return lambda: comm.reduce_scatter(x, out=out, op=op, **kw)
    return lambda: comm.alltoall(x, out=out, **kw)


def time_rounds(barrier: Callable[[], Any], calls: Dict[str, Callable[[], Any]], iters: int, warmup: int,
                rounds: int, reduce_max: Callable[[np.ndarray], np.ndarray]) -> Dict[str, float]:
    """Seconds per call of each variant: its `iters` calls split over `rounds` rounds that take the
    variants in turn (order rotating), so a burst of noise on a shared machine falls on all of them
    alike; a variant's time is the median over rounds of the slowest rank's mean in that round."""
    for call in calls.values():
        for _ in range(warmup):
            call()
    rounds = max(1, min(rounds, iters))
    names = list(calls)
    means = np.zeros((len(names), rounds))
    base, extra = divmod(iters, rounds)
    for r in range(rounds):
        count, turn = base + (r < extra), r % len(names)
        for i in list(range(turn, len(names))) + list(range(turn)):
            call = calls[names[i]]
            barrier()
            t0 = time.perf_counter()
            for _ in range(count):
                call()
            means[i, r] = (time.perf_counter() - t0) / count
    slowest = reduce_max(means)
    return {name: float(np.median(slowest[i])) for i, name in enumerate(names)}


def count_wrong(got: Optional[np.ndarray], want: Optional[np.ndarray]) -> int:
    if want is None or got is None:
        return 0
    return int(np.count_nonzero(got.reshape(-1).astype(np.float64) != want.reshape(-1).astype(np.float64)))


def header(args: argparse.Namespace, comm: Any, algo: str) -> str:
    cols = ["#", f"# pycoll bench {args.collective}: {comm.size} ranks ({comm.local_size} on this host), "
                 f"transport {comm.transport.name}, algorithm {algo}, dtype {args.dtype}, op {args.op}, "
                 f"iters {args.iters}, warmup {args.warmup}, check {args.check}",
            f"# time = median over {max(1, min(args.rounds, args.iters))} rounds of the slowest rank's mean; "
            "each round times every column in turn"]
    cols += ["#",
             f"# {'':>62}out-of-place{'':>23}in-place",
             f"# {'size':>10} {'count':>12} {'type':>8} {'redop':>6} {'root':>5} "
             f"{'time':>8} {'algbw':>7} {'busbw':>7} {'#wrong':>6} "
             f"{'time':>8} {'algbw':>7} {'busbw':>7} {'#wrong':>6}",
             f"# {'(B)':>10} {'(elements)':>12} {'':>8} {'':>6} {'':>5} "
             f"{'(us)':>8} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6} {'(us)':>8} {'(GB/s)':>7} {'(GB/s)':>7}"]
    return "\n".join(cols)


def bench_algo(args: argparse.Namespace, comm: Any, algo: str) -> List[Dict[str, Any]]:
    """Run every size for one algorithm; print rows on rank 0; return them."""
    dtype = _dtype(args.dtype)
    spec = SPECS[args.collective]
    root = args.root if spec.rooted else -1

    def reduce_max(v: np.ndarray) -> np.ndarray:
        return comm.allreduce(np.ascontiguousarray(v, np.float64), op="max")

    rows = []
    if comm.rank == 0:
        print(header(args, comm, algo), flush=True)
    for nbytes in sizes(args.minbytes, args.maxbytes, args.stepfactor, args.stepbytes):
        case = Case(args.collective, nbytes, dtype, comm.size, comm.rank, max(root, 0))
        row: Dict[str, Any] = {"collective": args.collective, "algo": algo, "ranks": comm.size,
                               "transport": comm.transport.name, "size": case.nbytes, "count": case.count,
                               "type": args.dtype, "redop": args.op if spec.reduces else "none",
                               "root": root}
        calls: Dict[str, Callable[[], Any]] = {}
        wrong = np.zeros(2, np.int64)
        for i, place in enumerate(("out", "in")):
            inplace_gather = place == "in" and args.collective == "allgather"
            x = _allgather_inplace(case) if inplace_gather else case.inputs()
            calls[place] = pycoll_call(comm, case, x, case.out_buffer() if place == "out" else None, algo, args.op)
            wrong[i] = count_wrong(calls[place](), case.expected()) if args.check else 0
        wrong = comm.allreduce(wrong)
        with np.errstate(all="ignore"):  # repeated in-place sums may overflow; timing only
            times = time_rounds(comm.barrier, calls, args.iters, args.warmup, args.rounds, reduce_max)
        for i, place in enumerate(("out", "in")):
            row[place] = _scores(case, spec, comm.size, times[place], int(wrong[i]))
        rows.append(row)
        if comm.rank == 0:
            print(format_row(row), flush=True)
    if comm.rank == 0:
        avg = np.mean([r["out"]["busbw"] for r in rows]) if rows else 0.0
        wrong = sum(r["out"]["wrong"] + r["in"]["wrong"] for r in rows)
        print(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
        print(f"# Avg bus bandwidth    : {avg:.6g}")
        print("#", flush=True)
    return rows


def _allgather_inplace(case: Case) -> np.ndarray:
    buf = np.zeros(case.count, case.dtype)
    buf[case.rank * case.block:(case.rank + 1) * case.block] = case.inputs()
    return buf


def _scores(case: Case, spec: Spec, n: int, seconds: float, wrong: int) -> Dict[str, float]:
    algbw = case.nbytes / seconds / 1e9 if seconds > 0 else 0.0
    return {"time_us": seconds * 1e6, "algbw": algbw, "busbw": algbw * spec.factor(n), "wrong": wrong}


def format_row(row: Dict[str, Any]) -> str:
    cells = f"  {row['size']:>10} {row['count']:>12} {NCCL_TYPES.get(row['type'], row['type']):>8} " \
            f"{row['redop']:>6} {row['root']:>5}"
    for place in ("out", "in"):
        s = row[place]
        cells += f" {s['time_us']:>8.1f} {s['algbw']:>7.3f} {s['busbw']:>7.3f} {s['wrong']:>6}"
    return cells


def _dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        from ..ops import bfloat16
        return bfloat16()
    return np.dtype(name)


def busbw_lines(rows: List[Dict[str, Any]]) -> Dict[str, List[Tuple[int, float]]]:
    """Out-of-place busbw per size, one line per algorithm and transport (rows of bench_algo)."""
    lines: Dict[str, List[Tuple[int, float]]] = {}
    for row in rows:
        if row["size"]:
            lines.setdefault(f"pycoll {row['algo']} ({row['transport']})", []).append((row["size"], row["out"]["busbw"]))
    return lines


def plot(lines: Dict[str, List[Tuple[int, float]]], path: str, title: str) -> None:
    """busbw vs size, one line per label (library, algorithm)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, points in lines.items():
        points = sorted(set(points))
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pycoll bench", description=__doc__.splitlines()[0])
    p.add_argument("collective", choices=sorted(NAMES), help="which collective to measure")
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("32M"))
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("32M"))
    p.add_argument("-f", "--stepfactor", type=int, default=1)
    p.add_argument("-i", "--stepbytes", type=parse_size, default=parse_size("1M"))
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("-w", "--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5,
                   help="split the iterations over this many rounds, columns interleaved (median reported)")
    p.add_argument("-c", "--check", type=int, default=1)
    p.add_argument("-d", "--dtype", default="float32")
    p.add_argument("-o", "--op", default="sum")
    p.add_argument("-r", "--root", type=int, default=0)
    p.add_argument("--algo", default="auto", help="algorithm, comma list, or 'all'")
    p.add_argument("--transport", default=None,
                   help="PYCOLL_TRANSPORT for this run (with --np a comma list: one pycoll job per transport)")
    p.add_argument("--np", type=int, default=0,
                   help="launch N ranks per library itself and compare libraries (allreduce float32 sum in place)")
    p.add_argument("--compare", default="", help="with --np: comma list of peers: mpi, mpi-tcp (Open MPI with "
                   "btl tcp,self), gloo, torch-pycoll (dist.all_reduce on backend pycoll), python-shm (Python's "
                   "floor: the one-shot exchange as a bare loop over shared memory, no pycoll)")
    p.add_argument("--persistent", action="store_true",
                   help="with --np: also a job per transport that calls persistent handles (allreduce_init)")
    p.add_argument("--sizes", default="8,64K,1M,16M,64M", help="with --np: comma list of sizes")
    p.add_argument("--round-seconds", type=float, default=0.1,
                   help="with --np: about this long per library per size in a round (iterations calibrated)")
    p.add_argument("--bind", default="core:overload-allowed", help="with --np: mpirun --bind-to for every job")
    p.add_argument("--json", default=None, help="write every row to this JSON file")
    p.add_argument("--plot", default=None, help="write busbw vs size to this PNG")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    args.collective = NAMES[args.collective]
    if args.np:
        return compare_main(args)
    if args.compare:
        print("pycoll bench: --compare needs --np N (each library runs in processes of its own, launched by "
              "the bench: run it once, not under mpirun)", file=sys.stderr)
        return 2
    if args.minbytes > args.maxbytes or args.iters < 1 or args.stepfactor < 1:
        print("pycoll bench: need -b <= -e, -n >= 1 and -f >= 1", file=sys.stderr)
        return 2
    import pycoll
    from ..selection import IMPLEMENTATIONS
    comm = pycoll.init(transport=args.transport)
    impls = IMPLEMENTATIONS[args.collective]
    native_ok = comm.transport.name == "mpi"  # MPI's own collectives need the mpi transport
    algos = [a for a in impls if a != "mpi_native" or native_ok] if args.algo == "all" else args.algo.split(",")
    for algo in algos:
        if algo != "auto" and algo not in impls:
            print(f"pycoll bench: {args.collective} has no algorithm {algo!r} (choose from {sorted(impls)})",
                  file=sys.stderr)
            return 2
    rows: List[Dict[str, Any]] = []
    for algo in algos:
        rows += bench_algo(args, comm, algo)
    if comm.rank == 0:
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(rows, fh, indent=1)
        if args.plot:
            plot(busbw_lines(rows), args.plot, f"{args.collective}, {comm.size} ranks, {args.dtype} {args.op}")
    comm.close()
    return 0


def compare_main(args: argparse.Namespace) -> int:
    """`--np N`: pycoll and the peers, each in jobs of its own (bench_compare.py)."""
    from . import bench_compare
    peers = [p for p in args.compare.split(",") if p]
    bad = [p for p in peers if p not in bench_compare.PEERS]
    if args.collective != "allreduce" or args.dtype != "float32" or args.op != "sum" or bad or args.np < 1:
        print(f"pycoll bench --np: compares allreduce, float32, sum with peers {', '.join(bench_compare.PEERS)} "
              f"(got {args.collective}, {args.dtype}, {args.op}, --np {args.np}, unknown peers {bad})", file=sys.stderr)
        return 2
    if shutil.which("mpirun") is None:
        print("pycoll bench --np: launches every library with mpirun, which is not on PATH (apt-get install "
              "openmpi-bin)", file=sys.stderr)
        return 2
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    transports = (args.transport or "auto").split(",")
    try:
        rows = bench_compare.run(args.np, sizes, transports, peers, args.rounds, args.round_seconds, args.warmup,
                                 args.bind, args.json, args.persistent)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    if args.plot:
        lines: Dict[str, List[Tuple[int, float]]] = {}
        for row in rows:
            lines.setdefault(row["library"], []).append((row["size"], row["busbw"]))
        plot(lines, args.plot, f"allreduce float32 sum in place, {args.np} ranks")
    return 0 if all(row["wrong"] == 0 for row in rows) else 1

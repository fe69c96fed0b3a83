"""The collective test matrix, run inside each rank: every collective x algorithm x count x dtype/op.

Each rank regenerates every rank's inputs from seeds, computes numpy's answer, and reports
mismatches; the parent asserts there are none and that float results are bit-identical.
"""
from __future__ import annotations

import functools
import hashlib
from typing import Dict, List, Tuple

import numpy as np

from pycoll.selection import IMPLEMENTATIONS
from pycoll.transports.capabilities import MpiCommunicators

UFUNC = {"sum": np.add, "avg": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
         "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}


def dtype_of(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def make_input(rank: int, count: int, dtype: str, op: str, salt: int) -> np.ndarray:
    """Small integer values so float sums are exact in any order; 1..2 for prod so nothing overflows."""
    rng = np.random.default_rng([rank, count, salt])
    hi = 3 if op == "prod" else 11
    return rng.integers(1 if op == "prod" else 0, hi, count).astype(dtype_of(dtype))


def reduce_ref(inputs: List[np.ndarray], op: str) -> np.ndarray:
    out = functools.reduce(lambda a, b: UFUNC[op](a, b), [x.copy() for x in inputs])
    if op == "avg":
        kind = out.dtype.kind
        out = (out / len(inputs)).astype(out.dtype) if kind == "f" or out.dtype.name == "bfloat16" \
            else out // len(inputs)
    return out


def counts_for(n: int, big: bool) -> List[int]:
    return [0, 1, max(n - 1, 0), 7, 1009] + ([1_000_003] if big else [])


COMBOS = [("float32", "sum"), ("float64", "max"), ("int32", "bxor"), ("int64", "prod"),
          ("float16", "sum"), ("bfloat16", "sum"), ("float32", "avg"), ("int32", "avg"),
          ("uint8", "band"), ("float64", "min")]


def run_matrix(comm, collectives: Tuple[str, ...], big: bool) -> Dict[str, object]:
    """Run every case on this rank; return {'checked': k, 'failures': [...], 'digests': [...]}."""
    n = comm.size
    failures: List[str] = []
    digests: List[str] = []
    checked = 0
    salt = 0
    for coll in collectives:
        for algo in IMPLEMENTATIONS[coll]:
            if algo == "mpi_native" and comm.transport.offers(MpiCommunicators) is None:
                continue  # MPI's own collectives exist only over the mpi transport
            for count in counts_for(n, big):
                combos = COMBOS if count < 10_000 else [("float32", "sum")]
                if coll not in ("allreduce", "reduce", "reduce_scatter"):
                    combos = combos[:3] if count < 10_000 else combos[:1]
                for dtype, op in combos:
                    salt += 1
                    root = salt % n
                    label = f"{coll}/{algo} n={n} count={count} {dtype} {op} root={root}"
                    try:
                        ok = CHECKS[coll](comm, algo, count, dtype, op, root, salt, digests)
                    except Exception as e:  # report, and keep going so one bug shows all its cases
                        ok = f"raised {type(e).__name__}: {e}"
                    checked += 1
                    if ok is not True:
                        failures.append(f"{label}: {ok}")
    return {"checked": checked, "failures": failures, "digests": digests}


def _compare(got: np.ndarray, want: np.ndarray) -> object:
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return f"shape {got.shape} != {want.shape}"
    if got.tobytes() != want.astype(got.dtype).tobytes():
        bad = np.flatnonzero(got.reshape(-1).astype(np.float64) != want.reshape(-1).astype(np.float64))
        return f"{bad.size} wrong elements, first at {bad[:3]}: got {got.reshape(-1)[bad[:3]]}, " \
               f"want {want.reshape(-1)[bad[:3]]}"
    return True


def _both(first, second):
    """The first failure of two checks, or True."""
    return first if first is not True else second


def _all_inputs(n, count, dtype, op, salt):
    return [make_input(i, count, dtype, op, salt) for i in range(n)]


def check_allreduce(comm, algo, count, dtype, op, root, salt, digests):
    ins = _all_inputs(comm.size, count, dtype, op, salt)
    x = ins[comm.rank].copy()
    out = np.empty_like(x)
    comm.allreduce(x, out=out, op=op, algo=algo)
    if count and dtype == "float32" and op == "sum":  # random floats: results must agree bit for bit
        f = np.random.default_rng([comm.rank, salt]).standard_normal(count).astype(np.float32)
        comm.allreduce(f, algo=algo)
        digests.append(hashlib.sha1(f.tobytes()).hexdigest())
    untouched = True if x.tobytes() == ins[comm.rank].tobytes() else "out-of-place allreduce changed its input"
    return _both(_compare(out, reduce_ref(ins, op)), untouched)


def check_reduce(comm, algo, count, dtype, op, root, salt, digests):
    ins = _all_inputs(comm.size, count, dtype, op, salt)
    x = ins[comm.rank].copy()
    comm.reduce(x, root=root, op=op, algo=algo)
    return _compare(x, reduce_ref(ins, op) if comm.rank == root else ins[comm.rank])


def check_reduce_scatter(comm, algo, count, dtype, op, root, salt, digests):
    n = comm.size
    ins = _all_inputs(n, count * n, dtype, op, salt)
    got = comm.reduce_scatter(ins[comm.rank], op=op, algo=algo)
    ok = _compare(got, reduce_ref(ins, op)[comm.rank * count:(comm.rank + 1) * count])
    counts = [(count + 3 * i) % 5 for i in range(n)]  # uneven blocks; every rank runs both calls
    vins = _all_inputs(n, sum(counts), dtype, op, salt + 10_000)
    got = comm.reduce_scatter(vins[comm.rank], op=op, counts=counts, algo=algo)
    start = sum(counts[:comm.rank])
    return _both(ok, _compare(got, reduce_ref(vins, op)[start:start + counts[comm.rank]]))


def check_broadcast(comm, algo, count, dtype, op, root, salt, digests):
    ins = _all_inputs(comm.size, count, dtype, op, salt)
    x = ins[comm.rank].copy()
    comm.broadcast(x, root=root, algo=algo)
    return _compare(x, ins[root])


def check_allgather(comm, algo, count, dtype, op, root, salt, digests):
    n = comm.size
    ins = _all_inputs(n, count, dtype, op, salt)
    ok = _compare(comm.allgather(ins[comm.rank], algo=algo), np.stack(ins))
    counts = [(count + 2 * i) % 4 + (i == 0) for i in range(n)]  # every rank runs both calls
    vins = [make_input(i, counts[i], dtype, op, salt) for i in range(n)]
    return _both(ok, _compare(comm.allgatherv(vins[comm.rank], counts, algo=algo), np.concatenate(vins)))


def check_alltoall(comm, algo, count, dtype, op, root, salt, digests):
    n = comm.size
    ins = _all_inputs(n, count * n, dtype, op, salt)
    want = np.concatenate([ins[i][comm.rank * count:(comm.rank + 1) * count] for i in range(n)])
    return _compare(comm.alltoall(ins[comm.rank], algo=algo), want)


def check_alltoallv(comm, algo, count, dtype, op, root, salt, digests):
    n, r = comm.size, comm.rank
    sc = [[(count + 3 * i + 5 * j) % 6 for j in range(n)] for i in range(n)]  # sc[i][j]: i sends j
    ins = [make_input(i, sum(sc[i]), dtype, op, salt) for i in range(n)]
    pieces = [ins[i][sum(sc[i][:r]):sum(sc[i][:r + 1])] for i in range(n)]
    got = comm.alltoallv(ins[r], sc[r], [sc[i][r] for i in range(n)], algo=algo)
    return _compare(got, np.concatenate(pieces))


def check_gather(comm, algo, count, dtype, op, root, salt, digests):
    ins = _all_inputs(comm.size, count, dtype, op, salt)
    got = comm.gather(ins[comm.rank], root=root)
    return _compare(got, np.stack(ins)) if comm.rank == root else (got is None or "non-root got data")


def check_scatter(comm, algo, count, dtype, op, root, salt, digests):
    full = make_input(root, count * comm.size, dtype, op, salt).reshape(comm.size, count)
    got = comm.scatter(full if comm.rank == root else None, root=root,
                       out=np.empty(count, full.dtype))
    return _compare(got, full[comm.rank])


def check_barrier(comm, algo, count, dtype, op, root, salt, digests):
    comm.barrier()
    return True


CHECKS = {"allreduce": check_allreduce, "reduce": check_reduce, "reduce_scatter": check_reduce_scatter,
          "broadcast": check_broadcast, "allgather": check_allgather, "alltoall": check_alltoall,
          "alltoallv": check_alltoallv, "gather": check_gather, "scatter": check_scatter,
          "barrier": check_barrier}

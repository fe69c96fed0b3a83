"""Tree, chain, double-tree, pairwise and linear algorithms on real ranks, checked against numpy.

One run_ranks call per rank count runs every case in order (a channel per call); the parent
regenerates each rank's deterministic input and compares the returned buffers with numpy.
Inputs are small integers, so float sums are exact in any order.
"""
from typing import Any, List, NamedTuple, Optional

import ml_dtypes
import numpy as np
import pytest

from multiproc import run_ranks
from pycoll.algorithms import linear, pairwise, tree
from pycoll.ops import ReduceOp

BF16 = np.dtype(ml_dtypes.bfloat16)
FLOATS = [np.dtype(np.float32), np.dtype(np.float64), BF16, np.dtype(np.float16)]
INT32 = np.dtype(np.int32)
UFUNCS = {ReduceOp.SUM: np.add, ReduceOp.MAX: np.maximum, ReduceOp.PROD: np.multiply,
          ReduceOp.BXOR: np.bitwise_xor}
SMALL_SEG = 4096  # bytes: forces many pipeline segments on modest counts
SENTINEL = -7
BIG = [(np.dtype(np.float32), ReduceOp.SUM), (INT32, ReduceOp.BXOR), (BF16, ReduceOp.MAX)]
ALLREDUCES = ("allreduce", "allreduce_double_tree")
PIPELINED = ("allreduce_double_tree", "broadcast_chain")
ROOTED = ("broadcast", "broadcast_chain", "gather", "scatter")
ALLTOALLS = ("alltoall", "alltoallv")
VCOUNTED = ("gather", "scatter")
LARGE = ("allreduce", "allreduce_double_tree", "reduce", "broadcast", "broadcast_chain")
NS = [1, 2, 3, 4, 5, 7, 8]


class Case(NamedTuple):
    algo: str
    count: int
    dtype: np.dtype
    op: ReduceOp = ReduceOp.SUM
    root: int = 0
    seg: int = tree.SEGMENT_BYTES
    vcounts: bool = False  # gather/scatter with per-rank counts
    rand: bool = False     # random float32 input instead of small integers


def _combos() -> List[tuple]:
    """(dtype, op) pairs: every float dtype with sum/max/prod, int32 with those and bxor."""
    ops = [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.PROD]
    return [(d, op) for d in FLOATS for op in ops] + [(INT32, op) for op in ops + [ReduceOp.BXOR]]


def _roots(n: int) -> List[int]:
    return sorted({0, n - 1, n // 2})


def _cases(n: int) -> List[Case]:
    """Every (dtype, op, root) at small counts, a few combinations at 100_003 and 1_000_003."""
    f32, roots = np.dtype(np.float32), _roots(n)
    cases: List[Case] = []
    for count in sorted({0, 1, n - 1, 7, 1000}):
        for dtype, op in _combos():
            cases += [Case(a, count, dtype, op) for a in ALLREDUCES]
            cases += [Case("reduce", count, dtype, op, root) for root in roots]
        for dtype in FLOATS + [INT32]:
            cases += [Case(a, count, dtype, root=root) for a in ROOTED for root in roots]
            cases += [Case(a, count, dtype) for a in ALLTOALLS]
        cases += [Case(a, count, f32, root=root, vcounts=True) for a in VCOUNTED for root in roots]
        cases += [Case(a, count, dtype, op, seg=SMALL_SEG) for a in PIPELINED for dtype, op in BIG]
    for dtype, op in BIG:
        cases += [Case(a, 100_003, dtype, op, roots[-1]) for a in LARGE]
        cases += [Case(a, 100_003, dtype, op, seg=SMALL_SEG) for a in PIPELINED]
    cases += [Case(a, 100_003 // n, f32) for a in ALLTOALLS]
    cases += [Case(a, 100_003 // n, f32, root=roots[-1], vcounts=True) for a in VCOUNTED]
    cases += [Case(a, 100_003, f32, rand=True) for a in ALLREDUCES]
    return cases + [Case(a, 1_000_003, f32) for a in PIPELINED]  # several default 1 MiB segments


def _heavy_cases(n: int) -> List[Case]:
    """1_000_003 elements through every tree algorithm and each of the BIG combinations."""
    return [Case(a, 1_000_003, dtype, op, _roots(n)[-1]) for dtype, op in BIG for a in LARGE]


def _data(idx: int, rank: int, count: int, case: Case) -> np.ndarray:
    """Rank `rank`'s deterministic input for case number `idx`."""
    rng = np.random.default_rng([idx, rank])
    if case.rand:
        return rng.standard_normal(count).astype(case.dtype)
    if case.op is ReduceOp.PROD:
        vals = rng.choice([-2, -1, 1, 2], count)  # products are +-powers of two: exact everywhere
    elif case.op is ReduceOp.BXOR:
        vals = rng.integers(0, 1 << 30, count)
    else:
        vals = rng.integers(-8, 9, count)
    return vals.astype(case.dtype)


def _vcounts(count: int, n: int) -> List[int]:
    """Per-rank block sizes for gatherv/scatterv (some zero)."""
    return [(count + 2 * i) % (count + 3) for i in range(n)]


def _pair_count(count: int, src: int, dst: int) -> int:
    """alltoallv: elements `src` sends to `dst` (0 for some pairs)."""
    return (count + 3 * src + 5 * dst) % (count + 4)


def _displs(counts: List[int]) -> List[int]:
    """Offsets with a one-element gap before each block, so displacements really matter."""
    return np.cumsum([1 + c for c in [0] + counts[:-1]]).tolist()


def _v_layout(counts: List[int]) -> tuple:
    displs = _displs(counts)
    return displs, displs[-1] + counts[-1]


def _execute(comm: Any, idx: int, case: Case) -> Optional[np.ndarray]:
    """Run one case on this rank; returns the buffer the algorithm wrote (None where not significant)."""
    n, r = comm.size, comm.rank
    tree.SEGMENT_BYTES = case.seg
    ch = comm.channel(case.algo)
    if case.algo in ("broadcast", "broadcast_chain"):
        buf = _data(idx, r, case.count, case) if r == case.root else np.full(case.count, SENTINEL, case.dtype)
        getattr(tree, case.algo)(ch, buf, case.root)
        return buf
    if case.algo == "reduce":
        buf = _data(idx, r, case.count, case)
        tree.reduce(ch, buf, case.op, case.root)
        return buf
    if case.algo in ALLREDUCES:
        buf = _data(idx, r, case.count, case)
        getattr(tree, case.algo)(ch, buf, case.op)
        return buf
    if case.algo == "alltoall":
        send = _data(idx, r, n * case.count, case)
        recv = np.full(send.size, SENTINEL, case.dtype)
        pairwise.alltoall(ch, send, recv)
        return recv
    if case.algo == "alltoallv":
        scounts = [_pair_count(case.count, r, i) for i in range(n)]
        rcounts = [_pair_count(case.count, i, r) for i in range(n)]
        (sdispls, ssize), (rdispls, rsize) = _v_layout(scounts), _v_layout(rcounts)
        recv = np.full(rsize, SENTINEL, case.dtype)
        pairwise.alltoallv(ch, _data(idx, r, ssize, case), scounts, sdispls, recv, rcounts, rdispls)
        return recv
    counts = _vcounts(case.count, n) if case.vcounts else [case.count] * n
    if case.algo == "gather":
        recv = np.full(sum(counts), SENTINEL, case.dtype) if r == case.root else None
        linear.gather(ch, _data(idx, r, counts[r], case), recv, case.root,
                      counts if case.vcounts else None)
        return recv
    send = _data(idx, r, sum(counts), case) if r == case.root else None
    recv = np.full(counts[r], SENTINEL, case.dtype)
    linear.scatter(ch, send, recv, case.root, counts if case.vcounts else None)
    return recv


def _run_all(comm: Any, cases: List[Case]) -> List[Optional[np.ndarray]]:
    return [_execute(comm, idx, case) for idx, case in enumerate(cases)]


def _expected(idx: int, case: Case, n: int) -> List[Optional[np.ndarray]]:
    """What each rank's returned buffer must hold."""
    inputs = [_data(idx, r, case.count, case) for r in range(n)]
    if case.algo in ("broadcast", "broadcast_chain"):
        return [inputs[case.root]] * n
    if case.algo in ("reduce",) + ALLREDUCES:
        total = UFUNCS[case.op].reduce(np.stack(inputs), axis=0).astype(case.dtype)
        if case.algo == "reduce":
            return [total if r == case.root else inputs[r] for r in range(n)]
        return [total] * n
    if case.algo == "alltoall":
        sends = [_data(idx, r, n * case.count, case) for r in range(n)]
        return [np.concatenate([s[r * case.count:(r + 1) * case.count] for s in sends]) for r in range(n)]
    if case.algo == "alltoallv":
        sends = []
        for s in range(n):
            counts = [_pair_count(case.count, s, i) for i in range(n)]
            displs, size = _v_layout(counts)
            sends.append((_data(idx, s, size, case), displs))
        want = []
        for r in range(n):
            rcounts = [_pair_count(case.count, i, r) for i in range(n)]
            rdispls, rsize = _v_layout(rcounts)
            out = np.full(rsize, SENTINEL, case.dtype)
            for i, (data, sdispls) in enumerate(sends):
                out[rdispls[i]: rdispls[i] + rcounts[i]] = data[sdispls[r]: sdispls[r] + rcounts[i]]
            want.append(out)
        return want
    counts = _vcounts(case.count, n) if case.vcounts else [case.count] * n
    if case.algo == "gather":
        full = np.concatenate([_data(idx, r, counts[r], case) for r in range(n)])
        return [full if r == case.root else None for r in range(n)]
    full = _data(idx, case.root, sum(counts), case)
    ends = np.cumsum(counts).tolist()
    return [full[e - c: e] for e, c in zip(ends, counts)]


def _check(cases: List[Case], results: List[List[Optional[np.ndarray]]], n: int) -> None:
    for idx, case in enumerate(cases):
        got = [results[r][idx] for r in range(n)]
        if case.rand:  # float rounding differs from numpy's order; all ranks must agree bit for bit
            want = np.stack([_data(idx, r, case.count, case) for r in range(n)]).astype(np.float64).sum(0)
            np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5, err_msg=str(case))
            assert all(g.tobytes() == got[0].tobytes() for g in got), f"ranks differ bit-wise: {case}"
            continue
        for r, (g, w) in enumerate(zip(got, _expected(idx, case, n))):
            if w is None:
                assert g is None, f"rank {r}: {case}"
                continue
            assert g.dtype == w.dtype and g.shape == w.shape, f"rank {r}: {case}"
            bad = np.flatnonzero(g.view(np.uint8) != w.view(np.uint8))
            assert not bad.size, f"rank {r}: {case}: first differing byte {bad[0]}"


def _run_and_check(n: int, cases: List[Case]) -> None:
    results = run_ranks(_run_all, n, cases, timeout=280, env={"PYCOLL_TIMEOUT": "60"})
    _check(cases, results, n)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", NS)
def test_algorithms_match_numpy(n: int) -> None:
    _run_and_check(n, _cases(n))


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", NS)
def test_large_buffers_match_numpy(n: int) -> None:
    _run_and_check(n, _heavy_cases(n))

"""Ring, recursive doubling and Rabenseifner (allreduce, reduce-scatter, allgather) on real ranks.

One job per n loops over every case inside it (process start-up dominates otherwise). Inputs are
small integers, so any reduction order gives numpy's exact answer, bit for bit; one random float32
allreduce per algorithm checks that all ranks agree bit-wise. Results bigger than SHIP elements
come back as digests and are compared with the digest of the reference.
"""
import functools
import hashlib
import os

import numpy as np
import pytest

from multiproc import run_ranks

ALGOS = {"allreduce": ["ring", "recursive_doubling", "halving_doubling"],
         "reduce_scatter": ["ring", "halving_doubling"],
         "allgather": ["ring", "recursive_doubling"]}
DTYPES = ["float32", "float64", "int32", "bfloat16", "float16"]
UFUNCS = {"sum": np.add, "max": np.maximum, "prod": np.multiply, "bxor": np.bitwise_xor}
SHIP = 4096
NS = [1, 2, 3, 4, 5, 7, 8]
LARGE = 1_000_003


def _dtype(name):
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _ops(dtype):
    return ["sum", "max", "prod", "bxor"] if dtype == "int32" else ["sum", "max", "prod"]


def _case(kind, algo, counts, dtype="float32", op="sum", data="int", segment=None):
    """counts: (count,) for allreduce, else one block size per rank (v-counts if they differ)."""
    return kind, algo, tuple(counts), dtype, op, data, segment


def _cases(n, sizes):
    """Every algorithm x count x dtype x op; reduce-scatter/allgather blocks hold `count` // n."""
    cases = []
    for count in sizes:
        block = count // n if count > 1000 else count
        for dtype in DTYPES:
            for op in _ops(dtype):
                cases += [_case("allreduce", a, (count,), dtype, op) for a in ALGOS["allreduce"]]
                cases += [_case("reduce_scatter", a, (block,) * n, dtype, op)
                          for a in ALGOS["reduce_scatter"]]
            cases += [_case("allgather", a, (block,) * n, dtype, None) for a in ALGOS["allgather"]]
    return cases


def _extra_cases(n):
    """v-counts (with empty blocks), random float32, and tiny segments to stress the ring pipeline."""
    cases = []
    for counts in [[(3 * i) % 7 for i in range(n)], [1000 + 37 * i for i in range(n)]]:
        for algo in ALGOS["reduce_scatter"]:
            cases += [_case("reduce_scatter", algo, counts, "float32", "sum"),
                      _case("reduce_scatter", algo, counts, "int32", "bxor")]
        cases += [_case("allgather", a, counts, "float64", None) for a in ALGOS["allgather"]]
    cases += [_case("allreduce", a, (100_003,), data="random") for a in ALGOS["allreduce"]]
    cases += [_case("allreduce", "ring", (10_007,), segment=512),
              _case("allreduce", "ring", (n + 1,), "int32", "bxor", segment=4),
              _case("reduce_scatter", "ring", (3001,) * n, segment=512),
              _case("reduce_scatter", "ring", [i * 501 for i in range(n)], "float64", "max", segment=256),
              _case("allgather", "ring", [501 * (n - i) for i in range(n)], segment=256)]
    return cases


def _large_cases(n):
    """LARGE elements in all: allreduce, and reduce-scatter/allgather with uneven blocks summing to it.

    float64 blocks are over 2 MiB for n <= 3, so the ring runs more than two segments per block.
    """
    base, extra = divmod(LARGE, n)
    blocks = [base + (i < extra) for i in range(n)]
    return [_case(kind, a, (LARGE,) if kind == "allreduce" else blocks, dtype, op)
            for dtype, op in [("float64", "sum"), ("float32", "max"), ("int32", "bxor")]
            for kind, algos in ALGOS.items() for a in algos]


def _input(case_id, rank, size, dtype, op, data):
    """Rank `rank`'s input for a case: the same in the rank and in the parent."""
    rng = np.random.default_rng([case_id, rank])
    if data == "random":
        return rng.standard_normal(size).astype(dtype)
    if op == "bxor":
        vals = rng.integers(0, 2 ** 31, size)
    elif op == "prod":
        vals = rng.choice([-2, -1, 1, 2], size)
    elif op == "max":
        vals = rng.integers(-100, 101, size)
    else:
        vals = rng.integers(-4, 5, size)
    return vals.astype(dtype) if dtype.kind in "iu" else vals.astype(np.float32).astype(dtype)


def _layout(case, n):
    """(elements of each rank's input, result slice of rank r) for a case on n ranks."""
    kind, _, counts, *_ = case
    if kind == "allreduce":
        return lambda r: counts[0], lambda r: slice(None)
    edges = np.concatenate([[0], np.cumsum(counts)])
    if kind == "reduce_scatter":
        return lambda r: int(edges[-1]), lambda r: slice(edges[r], edges[r + 1])
    return lambda r: counts[r], lambda r: slice(None)


def _ship(arr, data):
    if data == "random" or arr.size <= SHIP:
        return arr
    return hashlib.blake2b(arr.tobytes(), digest_size=16).hexdigest()


def _span(arr):
    start = arr.__array_interface__["data"][0]
    return start, start + arr.nbytes


class HazardChannel:
    """A Channel (and reduce_into) wrapper that fails on any buffer race, whatever the timing.

    Until wait() returns, a transport may still read a posted send's buffer (zero-copy) and may
    write a posted receive's buffer at any moment. So writing (receive or reduce) into memory of
    any pending request, or reading (send or reduce operand) memory of a pending receive, is a bug.
    """

    def __init__(self, ch):
        self.ch, self.rank, self.size = ch, ch.rank, ch.size
        self.pending = {}  # id(request) -> (request, is_recv, (start, end))

    def _touch(self, arr, write, what):
        lo, hi = _span(arr)
        for req, is_recv, (a, b) in self.pending.values():
            if lo < b and a < hi and arr.nbytes and (write or is_recv):
                raise AssertionError(f"rank {self.rank}: {what} overlaps a pending {req.describe()} "
                                     f"tag {req.key.tag}")

    def _track(self, req, arr, is_recv):
        self.pending[id(req)] = (req, is_recv, _span(arr))
        return req

    def isend(self, arr, peer, tag=0):
        self._touch(arr, False, f"send to {peer} tag {tag}")
        return self._track(self.ch.isend(arr, peer, tag), arr, False)

    def irecv(self, arr, peer, tag=0):
        self._touch(arr, True, f"receive from {peer} tag {tag}")
        return self._track(self.ch.irecv(arr, peer, tag), arr, True)

    def irecv_reduce(self, out, other, peer, tag, op, scratch):
        """Until wait, `out` may be written and `other` read at any moment (reduction on arrival)."""
        self._touch(out, True, f"reduce-receive from {peer} tag {tag}")
        self._touch(other, False, f"reduce operand for {peer} tag {tag}")
        req = self._track(self.ch.irecv_reduce(out, other, peer, tag, op, scratch), out, True)
        self.pending[(id(req), "operand")] = (req, False, _span(other))
        return req

    def scratch(self, shape, dtype):
        return self.ch.scratch(shape, dtype)

    def wait(self, *reqs):
        self.ch.wait(*reqs)
        for req in reqs:
            self.pending.pop(id(req), None)
            self.pending.pop((id(req), "operand"), None)

    def sendrecv(self, send, dst, recv, src, tag=0):
        self.wait(self.irecv(recv, src, tag), self.isend(send, dst, tag))

    def reduce_into(self, op, acc, other):
        from pycoll.ops import reduce_into
        self._touch(acc, True, "reduction result")
        self._touch(other, False, "reduction operand")
        reduce_into(op, acc, other)


def _run_cases(comm, cases):
    """Rank side: run each case on a fresh (hazard-checked) channel; return (result or digest,
    send untouched)."""
    from pycoll.algorithms import halving_doubling, recursive_doubling, ring
    from pycoll.ops import as_op, reduce_into
    modules = {"ring": ring, "recursive_doubling": recursive_doubling,
               "halving_doubling": halving_doubling}
    default_segment = ring.segment_bytes()
    out = []
    for i, case in enumerate(cases):
        kind, algo, counts, dtype, op, data, segment = case
        dt = _dtype(dtype)
        size_of, _ = _layout(case, comm.size)
        mine = _input(i, comm.rank, size_of(comm.rank), dt, op, data)
        kept = None if kind == "allreduce" else mine.tobytes()
        v = None if len(set(counts)) == 1 else list(counts)
        fn = getattr(modules[algo], kind)
        ch = HazardChannel(comm.channel("allreduce"))
        for module in modules.values():
            module.reduce_into = ch.reduce_into
        os.environ["PYCOLL_RING_SEGMENT"] = str(segment or default_segment)
        try:
            if kind == "allreduce":
                fn(ch, mine, as_op(op))
                res = mine
            elif kind == "reduce_scatter":
                res = np.empty(counts[comm.rank], dt)
                fn(ch, mine, res, as_op(op), v)
            else:
                res = np.empty(sum(counts), dt)
                fn(ch, mine, res, v)
        finally:
            os.environ["PYCOLL_RING_SEGMENT"] = str(default_segment)
            for module in modules.values():
                module.reduce_into = reduce_into
        out.append((_ship(res, data), kept is None or mine.tobytes() == kept))
    return out


def _first_diff(got, want):
    bits = f"u{got.itemsize}"
    idx = np.flatnonzero(got.view(bits) != want.view(bits))[:5]
    return f"first differences at {idx.tolist()}: got {got[idx]}, want {want[idx]}"


def _check(n, cases, results):
    """Parent side: compare every rank's result with numpy's."""
    for i, case in enumerate(cases):
        kind, algo, counts, dtype, op, data, segment = case
        label = f"n={n} case {i}: {kind} {algo} counts={list(counts)[:8]} {dtype} {op} {data} seg={segment}"
        dt = _dtype(dtype)
        size_of, part = _layout(case, n)
        inputs = [_input(i, r, size_of(r), dt, op, data) for r in range(n)]
        if kind == "allgather":
            ref = np.concatenate(inputs)
        elif data == "random":
            ref = np.sum([x.astype(np.float64) for x in inputs], axis=0)
        else:
            ref = functools.reduce(UFUNCS[op], inputs)
        for r in range(n):
            got, intact = results[r][i]
            want = ref[part(r)]
            assert intact, f"{label}: rank {r} changed its send buffer"
            if data == "random":
                np.testing.assert_allclose(got.astype(np.float64), want, rtol=1e-5, atol=1e-5,
                                           err_msg=label)
                assert got.tobytes() == results[0][i][0].tobytes(), f"{label}: ranks 0 and {r} disagree"
            elif isinstance(got, str):
                assert got == _ship(np.ascontiguousarray(want), data), f"{label}: rank {r} digest differs"
            else:
                assert got.dtype == want.dtype and got.shape == want.shape, label
                assert got.tobytes() == want.tobytes(), f"{label}: rank {r}: {_first_diff(got, want)}"


def _run_and_check(n, cases, timeout=280):
    results = run_ranks(_run_cases, n, cases, timeout=timeout)
    _check(n, cases, results)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", NS)
def test_algorithms_match_numpy(n):
    _run_and_check(n, _cases(n, (0, 1, max(n - 1, 0), 7, 1000, 100_003)) + _extra_cases(n))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", NS)
def test_large_counts(n):
    _run_and_check(n, _large_cases(n))

"""First allreduce end to end: every rank gets numpy's answer, bit-identical across ranks."""
import numpy as np
import pytest

from multiproc import run_ranks

TCP = {"PYCOLL_TRANSPORT": "tcp"}  # these are the tcp transport's tests; shm has its own


def _allreduce(comm, count, dtype, op):
    rng = np.random.default_rng(comm.rank)
    x = (rng.random(count) * 10).astype(dtype)
    inputs = [(np.random.default_rng(r).random(count) * 10).astype(dtype) for r in range(comm.size)]
    out = np.empty_like(x)
    comm.allreduce(x, out=out, op=op)
    comm.allreduce(x, op=op)  # in place
    return out, x, inputs


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_allreduce_sum_matches_numpy(n):
    for count in (0, 1, n - 1, 17, 100_003):
        results = run_ranks(_allreduce, n, count, np.float64, "sum", env=TCP)
        inputs = results[0][2]
        ref = np.sum(inputs, axis=0) if count else np.zeros(0)
        for out, inplace, _ in results:
            np.testing.assert_allclose(out, ref, rtol=1e-12)
            np.testing.assert_array_equal(out, inplace)
        for out, _, _ in results[1:]:
            assert out.tobytes() == results[0][0].tobytes(), "ranks disagree bit-wise"

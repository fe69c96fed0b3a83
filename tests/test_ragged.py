"""allgather_ragged: blocks whose sizes only their owners know, over tcp and shm in real processes.
Every rank gets the blocks in rank order and the counts (zero-length blocks, large blocks past tcp's
bulk threshold, several dtypes), async calls keep their order with the calls around them, and ranks
that pass different dtypes raise ProtocolError instead of mixing them."""
import numpy as np
import pytest

from multiproc import run_ranks

pytestmark = pytest.mark.timeout(120)


def _block(rank, count, dtype):
    return (np.arange(count) % 97 + 1000 * rank).astype(dtype)


def _ragged(comm):
    """Counts that differ per rank (rank 1 has none), per dtype, blocking and async."""
    import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)
    bad = []
    for dtype in (np.float32, np.int64, np.uint8, "bfloat16"):
        for base in (0, 5, 200_000):
            counts = [0 if r == 1 else base + 3 * r for r in range(comm.size)]
            want = np.concatenate([_block(r, c, dtype) for r, c in enumerate(counts)])
            out, got = comm.allgather_ragged(_block(comm.rank, counts[comm.rank], dtype))
            if got != counts or out.dtype != np.dtype(dtype) or out.tobytes() != want.tobytes():
                bad.append(f"{dtype} base {base}: counts {got}")
    # async, between two other async calls: each completes with its own result, in call order
    x = np.ones(8, np.float64)
    first = comm.allreduce(x, async_op=True)
    ragged = comm.allgather_ragged(np.full(comm.rank + 1, comm.rank, np.int32), async_op=True)
    last = comm.broadcast(np.full(3, comm.rank, np.int64), root=comm.size - 1, async_op=True)
    out, counts = ragged.result()
    if counts != list(range(1, comm.size + 1)) or out.tolist() != [r for r in range(comm.size) for _ in range(r + 1)]:
        bad.append(f"async: {counts} {out.tolist()}")
    if first.result().tolist() != [comm.size] * 8 or last.result().tolist() != [comm.size - 1] * 3:
        bad.append("the calls around the async ragged gather went wrong")
    return bad


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_allgather_ragged_gathers_blocks_of_every_size_in_rank_order(transport):
    for rank, bad in enumerate(run_ranks(_ragged, 3, env={"PYCOLL_TRANSPORT": transport})):
        assert not bad, (rank, bad)


def _dtype_mismatch(comm):
    import pycoll
    try:
        comm.allgather_ragged(np.ones(4, np.float32 if comm.rank else np.float64), timeout=20)
    except pycoll.ProtocolError as e:
        return str(e)
    return "no error"


def test_allgather_ragged_with_different_dtypes_raises_on_every_rank():
    for rank, msg in enumerate(run_ranks(_dtype_mismatch, 2, env={"PYCOLL_TRANSPORT": "shm"})):
        assert "dtype" in msg, (rank, msg)

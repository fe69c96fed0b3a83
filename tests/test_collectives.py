"""Every collective through the public API, on real processes over tcp, against numpy."""
import numpy as np
import pytest

from collective_cases import CHECKS, run_matrix
from multiproc import run_ranks

TCP = {"PYCOLL_TRANSPORT": "tcp"}  # these are the tcp transport's tests; shm has its own

ALL = tuple(CHECKS)


def _assert_matrix(results):
    for r, res in enumerate(results):
        assert res["checked"] > 0
        assert not res["failures"], f"rank {r}:\n" + "\n".join(res["failures"][:20])
    for res in results[1:]:
        assert res["digests"] == results[0]["digests"], "ranks disagree bit-wise on float32 results"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8])
def test_every_collective_and_algorithm(n):
    _assert_matrix(run_ranks(run_matrix, n, ALL, n in (3, 4), timeout=560, env=TCP))


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("n", [2, 5, 7, 8])
def test_every_collective_and_algorithm_large_counts(n):
    _assert_matrix(run_ranks(run_matrix, n, ("allreduce", "reduce_scatter", "allgather", "broadcast"),
                             True, timeout=860, env=TCP))


def _async_mixed(comm):
    """Several async collectives on the world and on split communicators in flight at once, from
    several threads, with messages big enough for tcp's bulk streams (so they share those too)."""
    even = comm.split(comm.rank % 2, key=-comm.rank)  # reverse order inside each half
    dup = comm.dup()
    a = np.full(50_000, comm.rank, np.float64)
    b = np.full(100_000, comm.rank + 1, np.int64)
    c = np.full(300_000, comm.rank, np.float32)
    works = [comm.allreduce(a, async_op=True),
             even.allreduce(b, op="max", async_op=True),
             dup.broadcast(c, root=comm.size - 1, async_op=True),
             comm.barrier(async_op=True)]
    g = even.allgather(np.array([comm.rank], np.int32))  # blocking, on a third thread's communicator
    for w in works:
        assert w.wait(timeout=60)
        assert w.is_completed() and w.exception() is None
    members = [r for r in range(comm.size) if r % 2 == comm.rank % 2]
    return (float(a[0]), int(b[0]), float(c[0]), g.reshape(-1).tolist(), even.rank, even.size,
            sorted(members, reverse=True))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 5])
def test_async_collectives_on_split_and_dup_communicators(n):
    for r, (a, b, c, g, sub_rank, sub_size, members) in enumerate(run_ranks(_async_mixed, n, env=TCP)):
        assert a == sum(range(n))
        assert b == max(m + 1 for m in members)
        assert c == n - 1
        assert g == members and sub_size == len(members) and sub_rank == members.index(r)


def _bad_calls(comm):
    import pycoll
    x = np.zeros(8, np.float32)
    calls = {
        "bitwise on float": lambda: comm.allreduce(x, op="band"),
        "unknown op": lambda: comm.allreduce(x, op="median"),
        "bad root": lambda: comm.broadcast(x, root=comm.size),
        "read-only": lambda: comm.allreduce(np.zeros(4).setflags(write=False) or b"abcd"),
        "out dtype": lambda: comm.allreduce(x, out=np.zeros(8, np.float64)),
        "non-contiguous": lambda: comm.allreduce(np.zeros((4, 4))[:, 0]),
        "indivisible": lambda: comm.reduce_scatter(np.zeros(comm.size * 2 + 1)),
        "bad counts": lambda: comm.allgatherv(x, [1] * (comm.size + 1)),
        "bad algo": lambda: comm.allreduce(x, algo="pairwise"),
        "complex max": lambda: comm.allreduce(np.zeros(2, np.complex64), op="max"),
        "object dtype": lambda: comm.allreduce(np.zeros(2, object)),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = "no error"
        except (ValueError, TypeError) as e:
            out[name] = type(e).__name__
    comm.allreduce(x)  # nothing was sent by the bad calls: the next call still matches up
    return out


@pytest.mark.timeout(60)
def test_bad_arguments_raise_before_anything_is_sent():
    for out in run_ranks(_bad_calls, 2, env=TCP):
        assert out == {"bitwise on float": "TypeError", "unknown op": "ValueError",
                       "bad root": "ValueError", "read-only": "ValueError", "out dtype": "ValueError",
                       "non-contiguous": "ValueError", "indivisible": "ValueError",
                       "bad counts": "ValueError", "bad algo": "ValueError",
                       "complex max": "TypeError", "object dtype": "TypeError"}


def _torch_zero_copy(comm):
    import torch
    t = torch.full((1000,), float(comm.rank + 1))
    ptr = t.data_ptr()
    comm.allreduce(t)
    bf = torch.full((33,), 2.0, dtype=torch.bfloat16)
    comm.allreduce(bf, op="avg")
    g = torch.arange(4, dtype=torch.int64) * (comm.rank + 1)
    gathered = comm.allgather(g)
    return t.data_ptr() == ptr, float(t[0]), float(bf[5]), gathered.tolist()


@pytest.mark.timeout(120)
def test_torch_cpu_tensors_without_copies():
    pytest.importorskip("torch")
    n = 3
    for same_ptr, total, avg, gathered in run_ranks(_torch_zero_copy, n, env=TCP):
        assert same_ptr and total == sum(range(1, n + 1)) and avg == 2.0
        assert gathered == [[i * (r + 1) for i in range(4)] for r in range(n)]


def _algo_env(comm):
    from pycoll.selection import Selector
    return Selector().choose("allreduce", 1 << 24, comm.size), Selector().choose("broadcast", 8, comm.size)


@pytest.mark.timeout(60)
def test_pycoll_algo_environment_variable():
    got = run_ranks(_algo_env, 2, env={"PYCOLL_ALGO": "Tree;allreduce:^ring,halving_doubling,tree"})
    assert got[0] == ("recursive_doubling", "tree")


def test_pycoll_algo_errors_on_bad_tokens():
    from pycoll.selection import parse_algo
    for bad in ("rings", "allreduce:bogus", "nosuchcoll:ring", "allreduce:"):
        with pytest.raises(ValueError, match="PYCOLL_ALGO"):
            parse_algo(bad)
    assert parse_algo("ring;allreduce:^ring")["allreduce"] == frozenset(
        {"recursive_doubling", "halving_doubling", "tree", "binomial", "hierarchical", "oneshot", "twoshot", "cma"})

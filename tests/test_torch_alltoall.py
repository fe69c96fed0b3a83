"""The torch backend's calls the caller waits on at once (async_op=False) run on the caller's thread,
as dist.all_reduce does: all_to_all_single (even and uneven) and the list all_to_all against gloo's
results, with no hand-off to the communicator's worker thread; async_op=True still queues them and
completes in call order; a bad call raises through torch's wrapper either way."""
import os

import pytest

torch = pytest.importorskip("torch")

from multiproc import run_ranks  # noqa: E402


def _join(rank, size, path):
    """A gloo world and a pycoll group over one FileStore."""
    import torch.distributed as dist
    import pycoll.torch  # noqa: F401  (registers "pycoll")
    dist.init_process_group("gloo", store=dist.FileStore(path, size), rank=rank, world_size=size)
    return dist, dist.new_group(backend="pycoll")


def _rows(src, dst, size):
    """Rows rank `src` sends to rank `dst` (uneven, one pair sends none)."""
    return 0 if (src, dst) == (0, size - 1) else 1 + (2 * src + dst) % 3


def _a2a(rank, size, path):
    dist, pg = _join(rank, size, path)
    comm, gloo = pg.comm, dist.group.WORLD
    send = [_rows(rank, j, size) for j in range(size)]
    recv = [_rows(i, rank, size) for i in range(size)]
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(sum(send), 5, generator=g)
    even = torch.randn(size * 3, 2, generator=g).to(torch.float64)
    ins = [torch.full((2, j + 1), float(10 * rank + j)) for j in range(size)]
    results = {}

    def run(group, async_op):
        out = torch.empty(sum(recv), 5)
        w1 = dist.all_to_all_single(out, x, recv, send, group=group, async_op=async_op)
        out_even = torch.empty_like(even)
        w2 = dist.all_to_all_single(out_even, even, group=group, async_op=async_op)
        outs = [torch.empty(2, rank + 1) for _ in range(size)]
        w3 = dist.all_to_all(outs, ins, group=group, async_op=async_op) if group is pg else None
        if async_op:
            assert all(w is not None for w in (w1, w2, w3))
            # a blocking call issued behind the queued ones: it waits for them, in call order
            t = torch.full((4,), float(rank + 1))
            dist.all_reduce(t, group=group)
            results["sum behind queued"] = t.tolist()
            assert w3.wait() and w2.is_completed() and w1.is_completed()
        else:
            assert (w1, w2, w3) == (None, None, None)  # dist's wrapper returns None too
        return out, out_even, outs

    mine = run(pg, async_op=False)
    results["worker thread after blocking calls"] = comm._worker is not None
    queued = run(pg, async_op=True)
    results["worker thread after async calls"] = comm._worker is not None
    theirs = run(gloo, async_op=False)
    want_list = [torch.full((2, rank + 1), float(10 * i + rank)) for i in range(size)]
    results["blocking equals gloo"] = torch.equal(mine[0], theirs[0]) and torch.equal(mine[1], theirs[1])
    results["async equals gloo"] = torch.equal(queued[0], theirs[0]) and torch.equal(queued[1], theirs[1])
    results["list equals"] = all(torch.equal(a, b) for outs in (mine[2], queued[2]) for a, b in zip(outs, want_list))

    # bad splits: refused before anything is sent, raised through torch's wrapper either way
    for async_op in (False, True):
        try:
            w = dist.all_to_all_single(torch.empty(sum(recv), 5), x, recv, [s + 1 for s in send], group=pg,
                                       async_op=async_op)
            if w is not None:
                w.wait()
            results[f"bad splits async={async_op}"] = "no error"
        except ValueError as e:
            results[f"bad splits async={async_op}"] = str(e)
    dist.barrier(group=pg)  # still in step after the refused calls
    return results


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 3])
def test_blocking_all_to_all_runs_on_the_callers_thread_and_matches_gloo(size, tmp_path):
    got = run_ranks(_a2a, size, size, os.path.join(tmp_path, "store"), init=False, timeout=110)
    for rank, r in enumerate(got):
        assert r["worker thread after blocking calls"] is False, (rank, r)
        assert r["worker thread after async calls"] is True, (rank, r)
        assert r["blocking equals gloo"] and r["async equals gloo"] and r["list equals"], (rank, r)
        assert r["sum behind queued"] == [size * (size + 1) / 2] * 4, (rank, r)
        for async_op in (False, True):
            assert "send_counts sum to" in r[f"bad splits async={async_op}"], (rank, r)

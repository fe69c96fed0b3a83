"""The torch.distributed backend "pycoll" (pycoll.torch) in real processes, checked against gloo:
every rank joins a gloo world and a pycoll group over the same store and runs each call on both."""
import os
import subprocess
import sys
import tempfile

import pytest

torch = pytest.importorskip("torch")

from multiproc import free_port, run_ranks  # noqa: E402

INT_OPS = ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")
FLOAT_OPS = ("SUM", "PRODUCT", "MIN", "MAX")
DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64")


def _join(rank, size, path):
    """A gloo world and a pycoll group over one FileStore (no second port)."""
    import torch.distributed as dist
    import pycoll.torch  # noqa: F401  (registers "pycoll")
    store = dist.FileStore(path, size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
    return dist, dist.new_group(backend="pycoll")


def _data(rank, shape, dtype, low=-20, high=20, salt=0):
    g = torch.Generator().manual_seed(1000 * rank + salt)
    return torch.randint(low, high, shape, generator=g).to(getattr(torch, dtype))


class Checker:
    """Runs one call on gloo and on pycoll and records any difference (bit-exact unless `close`)."""

    def __init__(self):
        self.checks, self.failures, self.inexact = 0, [], []

    def same(self, what, ours, theirs, close=False):
        self.checks += 1
        ours, theirs = list(ours), list(theirs)
        for a, b in zip(ours, theirs):
            if a.dtype != b.dtype or a.shape != b.shape:
                self.failures.append(f"{what}: {a.dtype}{tuple(a.shape)} vs gloo {b.dtype}{tuple(b.shape)}")
                return
            if torch.equal(a, b):
                continue
            if close and torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-6):
                self.inexact.append(what)
                continue
            self.failures.append(f"{what}: {a.tolist()} vs gloo {b.tolist()}")
            return

    def report(self):
        return {"checks": self.checks, "failures": self.failures, "inexact": self.inexact}


def _all_methods(rank, size, path):
    dist, pg = _join(rank, size, path)
    chk = Checker()
    gloo = dist.group.WORLD

    def both(fn):
        return fn(pg), fn(gloo)

    # all_reduce: every op that the dtype allows (gloo has no AVG: compare with SUM / size)
    for dtype in DTYPES:
        ops = INT_OPS if "int" in dtype else FLOAT_OPS
        for op in ops:
            low, high = (-3, 4) if op == "PRODUCT" else (-20, 20)
            x = _data(rank, (7, 3), dtype, low, high)

            def red(group, x=x, op=op):
                t = x.clone()
                dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=group)
                return [t]
            chk.same(f"all_reduce {op} {dtype}", *both(red))
        if "int" not in dtype:
            x = _data(rank, (10,), dtype)
            t = x.clone()
            dist.all_reduce(t, op=dist.ReduceOp.AVG, group=pg)
            s = x.clone()
            dist.all_reduce(s, group=gloo)
            chk.same(f"all_reduce AVG {dtype}", [t], [s / size], close=dtype in ("float32", "float64"))
    # real-valued float32 sums: equal within rounding (bit-identical where the order agrees)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(1000, generator=g)
    chk.same("all_reduce SUM float32 random", *both(lambda grp: [_ar(dist, x.clone(), grp)]), close=True)
    # a non-contiguous tensor
    base = _data(rank, (6, 4), "float32")
    chk.same("all_reduce non-contiguous", *both(lambda grp: [_ar(dist, base.clone().t(), grp)]))

    for dtype in ("float32", "bfloat16", "int64"):
        x = _data(rank, (5, 2), dtype)
        root = size - 1

        def bcast(group, x=x, root=root):
            t = x.clone()
            dist.broadcast(t, src=root, group=group)
            return [t]
        chk.same(f"broadcast {dtype}", *both(bcast))

        def gather_list(group, x=x):
            outs = [torch.empty_like(x) for _ in range(size)]
            dist.all_gather(outs, x, group=group)
            return outs
        chk.same(f"all_gather {dtype}", *both(gather_list))

        def gather_tensor(group, x=x):
            out = torch.empty((size * 5, 2), dtype=x.dtype)
            dist.all_gather_into_tensor(out, x, group=group)
            return [out]
        chk.same(f"all_gather_into_tensor {dtype}", *both(gather_tensor))

        y = _data(rank, (size * 4, 3), dtype, salt=1)

        def rs_tensor(group, y=y):
            out = torch.empty((4, 3), dtype=y.dtype)
            dist.reduce_scatter_tensor(out, y, group=group)
            return [out]
        chk.same(f"reduce_scatter_tensor {dtype}", *both(rs_tensor))

        def rs_list(group, y=y):
            out = torch.empty((4, 3), dtype=y.dtype)
            dist.reduce_scatter(out, list(y.chunk(size)), op=dist.ReduceOp.MAX, group=group)
            return [out]
        chk.same(f"reduce_scatter MAX {dtype}", *both(rs_list))

        def a2a_single(group, y=y):
            out = torch.empty_like(y)
            dist.all_to_all_single(out, y, group=group)
            return [out]
        chk.same(f"all_to_all_single {dtype}", *both(a2a_single))

        # uneven splits: rank r sends r + j + 1 rows to rank j
        send = [rank + j + 1 for j in range(size)]
        recv = [i + rank + 1 for i in range(size)]
        z = _data(rank, (sum(send), 2), dtype, salt=2)

        def a2a_uneven(group, z=z, send=send, recv=recv):
            out = torch.empty((sum(recv), 2), dtype=z.dtype)
            dist.all_to_all_single(out, z, recv, send, group=group)
            return [out]
        chk.same(f"all_to_all_single uneven {dtype}", *both(a2a_uneven))

        def reduce(group, x=x, root=root):
            t = x.clone()
            dist.reduce(t, dst=root, op=dist.ReduceOp.MIN, group=group)
            return [t] if rank == root else []
        chk.same(f"reduce MIN {dtype}", *both(reduce))

        def gather(group, x=x):
            outs = [torch.empty_like(x) for _ in range(size)] if rank == 0 else None
            dist.gather(x, outs, dst=0, group=group)
            return outs or []
        chk.same(f"gather {dtype}", *both(gather))

        def scatter(group, y=y, root=root):
            out = torch.empty((4, 3), dtype=y.dtype)
            dist.scatter(out, list(y.chunk(size)) if rank == root else None, src=root, group=group)
            return [out]
        chk.same(f"scatter {dtype}", *both(scatter))

    def a2a_list(group):
        ins = [torch.full((j + 1,), 10 * rank + j, dtype=torch.int32) for j in range(size)]
        outs = [torch.empty(rank + 1, dtype=torch.int32) for _ in range(size)]
        dist.all_to_all(outs, ins, group=group)
        return outs
    if size > 0:
        try:
            theirs = a2a_list(gloo)
        except RuntimeError:  # gloo has no list all_to_all: check the values directly
            theirs = [torch.full((rank + 1,), 10 * i + rank, dtype=torch.int32) for i in range(size)]
        chk.same("all_to_all list", a2a_list(pg), theirs)

    # uneven all_gather (gloo has none: the expected values directly), coalesced calls, objects,
    # functional collectives (they find the group by name) and the coalescing manager
    outs = [torch.empty(i + 1, dtype=torch.int64) for i in range(size)]
    dist.all_gather(outs, torch.full((rank + 1,), rank, dtype=torch.int64), group=pg)
    chk.same("all_gather uneven", outs, [torch.full((i + 1,), i, dtype=torch.int64) for i in range(size)])

    def coalesced(group):
        ts = [_data(rank, (3,), "float32"), _data(rank, (5,), "float32", salt=3)]
        dist.all_reduce_coalesced(ts, op=dist.ReduceOp.MAX, group=group)
        return ts
    chk.same("all_reduce_coalesced", *both(coalesced))
    objs = [None] * size
    dist.all_gather_object(objs, {"rank": rank, "name": f"r{rank}"}, group=pg)
    chk.checks += 1
    if objs != [{"rank": i, "name": f"r{i}"} for i in range(size)]:
        chk.failures.append(f"all_gather_object: {objs}")
    sent = [rank, "x", {"from": rank}]
    dist.broadcast_object_list(sent, src=size - 1, group=pg)
    chk.checks += 1
    if sent != [size - 1, "x", {"from": size - 1}]:
        chk.failures.append(f"broadcast_object_list: {sent}")
    import torch.distributed._functional_collectives as fc
    assert pg.group_name and pg.group_name != gloo.group_name
    v = _data(rank, (size * 2,), "float32")
    for what, fn in (("functional all_reduce", lambda grp: fc.all_reduce(v, "sum", grp)),
                     ("functional all_gather_tensor", lambda grp: fc.all_gather_tensor(v, 0, grp)),
                     ("functional reduce_scatter_tensor", lambda grp: fc.reduce_scatter_tensor(v, "sum", 0, grp))):
        chk.same(what, *both(lambda grp: [fc.wait_tensor(fn(grp))]))

    def coalescing_manager(group):
        a, b = torch.empty(2 * size), torch.empty(2 * size)
        with dist._coalescing_manager(group=group, async_ops=True) as cm:
            dist.all_gather_into_tensor(a, torch.ones(2) * rank, group=group)
            dist.all_gather_into_tensor(b, torch.ones(2) * (rank + 5), group=group)
        cm.wait()
        return [a, b]
    chk.same("coalescing manager all_gather_into_tensor", *both(coalescing_manager))

    # point to point: a ring with tags, isend/irecv, and a blocking pair
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    for group, name in ((pg, "pycoll"), (gloo, "gloo")):
        got = torch.empty(3, dtype=torch.float64)
        reqs = [dist.isend(torch.full((3,), float(rank), dtype=torch.float64), dst=nxt, group=group, tag=7),
                dist.irecv(got, src=prv, group=group, tag=7)]
        for r in reqs:
            r.wait()
        chk.same(f"isend/irecv ring tag 7 ({name})", [got], [torch.full((3,), float(prv), dtype=torch.float64)])
    if rank in (0, 1):
        t = torch.arange(4, dtype=torch.int64) if rank == 0 else torch.zeros(4, dtype=torch.int64)
        u = t.clone() + 100
        if rank == 0:  # two tags, sent out of the receiver's order
            dist.send(u, 1, group=pg, tag=2)
            dist.send(t, 1, group=pg, tag=1)
        else:
            dist.recv(t, 0, group=pg, tag=1)
            dist.recv(u, 0, group=pg, tag=2)
            chk.same("send/recv tags", [t, u], [torch.arange(4), torch.arange(4) + 100])
    dist.barrier(group=pg)
    dist.barrier(group=gloo)
    return chk.report()  # no destroy_process_group beside gloo: see _ddp (it is tested in _subgroups)


def _ar(dist, t, group):
    dist.all_reduce(t, group=group)
    return t


@pytest.mark.parametrize("size", [2, 3])
def test_every_method_matches_gloo(size, tmp_path):
    reports = run_ranks(_all_methods, size, size, str(tmp_path / "store"), init=False, timeout=110)
    for rank, rep in enumerate(reports):
        assert rep["failures"] == [], f"rank {rank}: {rep['failures']}"
        assert rep["checks"] >= 76  # every call above ran and was compared
    if size == 2:  # two-rank sums have one order: bit-identical
        assert all(r["inexact"] == [] for r in reports), reports


def _async_work(rank, size, path):
    dist, pg = _join(rank, size, path)
    x = torch.full((1000,), float(rank + 1))
    work = dist.all_reduce(x, group=pg, async_op=True)
    doubled = work.get_future().then(lambda fut: fut.value()[0] * 2)
    assert work.wait() is True and work.is_completed() and work.is_success()
    expect = float(sum(range(1, size + 1)))
    assert torch.equal(x, torch.full((1000,), expect))
    assert torch.equal(doubled.wait(), torch.full((1000,), 2 * expect))
    # several in flight complete in call order, each with its own tensor
    ts = [torch.full((10,), float(i * (rank + 1))) for i in range(5)]
    works = [dist.all_reduce(t, group=pg, async_op=True) for t in ts]
    assert all(w.wait() for w in works)
    assert [t[0].item() for t in ts] == [i * expect for i in range(5)]
    return True


def test_async_work_and_future():
    with tempfile.TemporaryDirectory() as d:
        assert run_ranks(_async_work, 2, 2, os.path.join(d, "store"), init=False, timeout=60) == [True, True]


def _sparse(rank, size, path):
    """Sparse COO allreduce on pycoll against the same on gloo: values of several dtypes, a dense
    dimension, ranks with different nonzeros (one with none); MAX is refused through wait()."""
    dist, pg = _join(rank, size, path)
    same = []
    for dtype in (torch.float32, torch.float64, torch.int64):
        nnz = 0 if rank == 1 else rank + 2
        idx = torch.stack([torch.arange(nnz) % 5, torch.full((nnz,), rank % 3)])
        vals = _data(rank, (nnz, 4), str(dtype).split(".")[1], salt=nnz)
        got = torch.sparse_coo_tensor(idx, vals, (5, 3, 4), check_invariants=True)
        want = got.clone()
        dist.all_reduce(got, group=pg)
        dist.all_reduce(want)  # the gloo world
        same.append(torch.equal(got.to_dense(), want.to_dense()) and got.is_coalesced())
    try:
        dist.all_reduce(torch.sparse_coo_tensor(idx, vals, (5, 3, 4), check_invariants=True), op=dist.ReduceOp.MAX, group=pg)
        refused = "no error"
    except ValueError as e:
        refused = str(e)
    return same, refused


@pytest.mark.timeout(90)
@pytest.mark.parametrize("size", [2, 3])
def test_sparse_allreduce_matches_gloo(size):
    with tempfile.TemporaryDirectory() as d:
        got = run_ranks(_sparse, size, size, os.path.join(d, "store"), init=False, timeout=80)
    for same, refused in got:
        assert same == [True] * 3
        assert "sparse allreduce takes" in refused and "op MAX" in refused, refused


def _sparse_async(rank, size, path):
    """async_op=True on a sparse tensor queues the call like any other: the Work returns before a late
    peer has entered it, completes when it has, in call order with a dense call queued behind it."""
    import time
    dist, pg = _join(rank, size, path)
    idx = torch.tensor([[rank % 5, 4], [0, rank % 3]])
    sparse = torch.sparse_coo_tensor(idx, torch.tensor([1.0 + rank, 10.0]), (5, 3))
    dense = torch.full((6,), float(rank + 1))
    dist.barrier(group=pg)
    if rank == 1:
        time.sleep(1.0)
    t0 = time.monotonic()
    first = dist.all_reduce(sparse, group=pg, async_op=True)
    second = dist.all_reduce(dense, group=pg, async_op=True)
    returned, done_at_once = time.monotonic() - t0, first.is_completed()
    ok = first.wait() and second.wait()
    want = torch.zeros(5, 3)
    for r in range(size):
        want[r % 5, 0] += 1.0 + r
        want[4, r % 3] += 10.0
    return (returned, done_at_once, ok, torch.equal(sparse.to_dense(), want) and sparse.is_coalesced(),
            torch.equal(dense, torch.full((6,), float(sum(range(1, size + 1))))))


@pytest.mark.timeout(90)
def test_async_sparse_allreduce_is_queued_and_completes_with_its_call():
    with tempfile.TemporaryDirectory() as d:
        got = run_ranks(_sparse_async, 2, 2, os.path.join(d, "store"), init=False, timeout=80)
    returned, done_at_once, ok, sparse_right, dense_right = got[0]  # rank 0 calls before its late peer
    assert returned < 0.5 and not done_at_once, got[0]
    for r in got:
        assert r[2:] == (True, True, True), r


def _mismatch(rank, size, path):
    import datetime
    dist, _ = _join(rank, size, path)
    pg = dist.new_group(backend="pycoll", timeout=datetime.timedelta(seconds=5))
    x = torch.ones(10 if rank == 0 else 20)  # a size mismatch
    work = dist.all_reduce(x, group=pg, async_op=True)
    try:
        work.wait()
    except Exception as e:  # noqa: BLE001  (the point: it raises)
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_mismatch_raises_through_wait():
    with tempfile.TemporaryDirectory() as d:
        got = run_ranks(_mismatch, 2, 2, os.path.join(d, "store"), init=False, timeout=60)
    assert all(g != "no error" for g in got), got


def _dead_peer(rank, size, path):
    import datetime
    import time
    dist, _ = _join(rank, size, path)
    pg = dist.new_group(backend="pycoll", timeout=datetime.timedelta(seconds=5))
    dist.barrier(group=pg)
    if rank == 1:
        os._exit(3)
    time.sleep(0.5)
    start = time.monotonic()
    work = dist.all_reduce(torch.ones(1 << 16), group=pg, async_op=True)
    try:
        work.wait()
    except Exception as e:  # noqa: BLE001
        return (type(e).__name__, str(e), time.monotonic() - start)
    return ("no error", "", time.monotonic() - start)


def test_dead_peer_raises_through_wait():
    with tempfile.TemporaryDirectory() as d:
        got = run_ranks(_dead_peer, 2, 2, os.path.join(d, "store"), init=False, timeout=60, expect_fail=True)
    ok, value = got[0]
    assert ok, value
    kind, message, seconds = value
    assert kind != "no error" and seconds < 30, value


def _ddp(rank, size, port, steps):
    """DDP on "pycoll" and on "gloo" from the same initial model and data; returns both parameters.
    The world here is pycoll itself, reached with init_method=tcp:// (no launcher variables)."""
    for k in ("MASTER_ADDR", "MASTER_PORT", "PYCOLL_JOB_TOKEN", "PYCOLL_STORE_HOSTED"):
        os.environ.pop(k, None)
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    import pycoll.torch  # noqa: F401
    dist.init_process_group("pycoll", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    gloo = dist.new_group(backend="gloo")
    results = {}
    for name, group in (("pycoll", None), ("gloo", gloo)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
        ddp = DDP(model, process_group=group, bucket_cap_mb=0.01)  # several buckets
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        for step in range(steps):
            g = torch.Generator().manual_seed(step * 100 + rank)
            x = torch.randn(32, 16, generator=g)
            y = torch.randint(0, 4, (32,), generator=g)
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
        # numpy, not tensors: torch would pass tensors through shared memory the exiting child owns
        results[name] = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()
        _KEEP.append(ddp)
    # No destroy_process_group and no freeing the DDP models: torch 2.13 can deadlock when a DDP
    # Reducer frees the last reference to a gloo group (~ProcessGroupGloo joins its run-loop thread
    # holding the GIL while that thread frees a work that needs it; seen 2 in ~30 runs). The process
    # ends with os._exit (multiprocessing), so nothing here is destroyed.
    return results


_KEEP = []


@pytest.mark.parametrize("size", [2, 3])
def test_ddp_matches_gloo(size):
    out = run_ranks(_ddp, size, size, free_port(), 10, init=False, timeout=110)
    out = [{k: torch.from_numpy(v) for k, v in r.items()} for r in out]
    for rank in range(size):  # replicas agree bit for bit on each backend
        assert torch.equal(out[rank]["pycoll"], out[0]["pycoll"])
        assert torch.equal(out[rank]["gloo"], out[0]["gloo"])
    ours, theirs = out[0]["pycoll"], out[0]["gloo"]
    diff = (ours - theirs).abs().max().item()
    print(f"DDP {size} ranks, 10 steps: max |pycoll - gloo| = {diff:.3g}, "
          f"bit-identical: {torch.equal(ours, theirs)}")
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6), diff
    if size == 2:
        assert torch.equal(ours, theirs)


def test_import_pycoll_does_not_import_torch():
    code = "import sys, pycoll; assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def _timeouts(rank, size, path):
    import datetime
    import time
    import pycoll
    dist, _ = _join(rank, size, path)
    pg = dist.new_group(backend="pycoll", timeout=datetime.timedelta(seconds=3))
    seen = {}
    if rank == 0:
        x = torch.ones(8)
        work = dist.all_reduce(x, group=pg, async_op=True)
        try:  # wait(timeout) gives up on the handle, not the collective
            work.wait(datetime.timedelta(seconds=0.2))
        except pycoll.TimeoutError:
            seen["short wait"] = "TimeoutError"
        work.wait()
        seen["then"] = x.tolist()
        start = time.monotonic()
        late = dist.all_reduce(torch.ones(8), group=pg, async_op=True)  # rank 1 never joins this one
        try:
            late.wait()
        except pycoll.TimeoutError as e:
            seen["group timeout"] = (round(time.monotonic() - start, 1), "rank 1" in str(e))
    else:
        time.sleep(1.0)
        dist.all_reduce(torch.ones(8), group=pg)
        time.sleep(6)  # stays alive, silent, past rank 0's group timeout
    return seen


def test_wait_timeout_and_group_timeout():
    with tempfile.TemporaryDirectory() as d:
        got = run_ranks(_timeouts, 2, 2, os.path.join(d, "store"), init=False, timeout=60)
    assert got[0]["short wait"] == "TimeoutError" and got[0]["then"] == [2.0] * 8, got
    seconds, names_peer = got[0]["group timeout"]
    assert 2.5 <= seconds < 10 and names_peer, got


def _subgroups(rank, size, port):
    """new_group on a pycoll world: children of the world's communicator on its connections."""
    import time
    for k in ("MASTER_ADDR", "MASTER_PORT", "PYCOLL_JOB_TOKEN", "PYCOLL_STORE_HOSTED"):
        os.environ.pop(k, None)
    import torch.distributed as dist
    import pycoll.torch  # noqa: F401
    dist.init_process_group("pycoll", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    world = dist.group.WORLD  # a Python ProcessGroup is the group itself
    assert isinstance(world, pycoll.torch.ProcessGroupPycoll)
    start = time.monotonic()
    layouts = [list(range(size)), [0, 2], [1, 2], [0, 1]]
    groups = [dist.new_group(ranks) for ranks in layouts]  # every rank creates every group, in order
    seconds = time.monotonic() - start
    sums = []
    for ranks, group in zip(layouts, groups):
        if rank not in ranks:
            continue
        ours = group
        assert isinstance(ours, pycoll.torch.ProcessGroupPycoll)
        assert ours.comm.transport is world.comm.transport and ours.comm is not world.comm
        assert dist.get_rank(group) == ranks.index(rank)
        t = torch.full((5,), float(rank + 1), dtype=torch.float64)
        dist.all_reduce(t, group=group)
        b = torch.full((3,), float(rank))
        dist.broadcast(b, src=ranks[-1], group=group)  # src is a global rank
        assert b.tolist() == [float(ranks[-1])] * 3
        sums.append((ranks, t[0].item()))
    dist.all_reduce(torch.ones(1))  # the world still works after its children
    dist.destroy_process_group()
    return sums, seconds


def test_new_group_reuses_the_worlds_connections():
    out = run_ranks(_subgroups, 3, 3, free_port(), init=False, timeout=60)
    for rank, (sums, seconds) in enumerate(out):
        expect = [(r, float(sum(m + 1 for m in r))) for r in ([0, 1, 2], [0, 2], [1, 2], [0, 1]) if rank in r]
        assert sums == expect, (rank, sums)
    print(f"4 subgroups created in {max(s for _, s in out):.3f} s")


_NEVER_IMPORTS_PYCOLL = r'''
import sys, torch, torch.distributed as dist
rank, port = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("pycoll", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
t = torch.full((4,), float(rank + 1))
dist.all_reduce(t)
print("RESULT", t.tolist(), "pycoll.torch" in sys.modules, flush=True)
'''


@pytest.mark.timeout(120)
def test_a_script_that_never_imports_pycoll_gets_the_backend_through_torchs_autoload():
    """The `torch.backends` entry point names the backend at `import torch`; pycoll.torch loads with the
    group; and a script that exits without destroy_process_group exits cleanly (rank 0 used to abort)."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", _NEVER_IMPORTS_PYCOLL, str(r), str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=100)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0 and "RESULT [3.0, 3.0, 3.0, 3.0] True" in out, out


@pytest.mark.timeout(60)
def test_import_torch_stays_light_and_the_autoload_switch_turns_the_hook_off():
    probe = ("import sys, torch, torch.distributed as dist; "
             "print('pycoll' in dist.Backend.backend_list, 'zmq' in sys.modules, 'pycoll.torch' in sys.modules)")
    on = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=50)
    off = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=50,
                         env=dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0"))
    assert on.stdout.split() == ["True", "False", "False"], on.stdout + on.stderr  # named, nothing heavy loaded
    assert off.stdout.split() == ["False", "False", "False"], off.stdout + off.stderr

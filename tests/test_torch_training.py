"""Training through torch.distributed on backend "pycoll" in real processes: FSDP2 and DTensor against
the same run on gloo, PREMUL_SUM, and a rank killed in the middle of DDP training."""
import os
import tempfile
import time

import pytest

torch = pytest.importorskip("torch")

from multiproc import free_port, run_ranks  # noqa: E402

pytestmark = pytest.mark.timeout(240)


def _world(rank, size, port, backend, timeout_s=60):
    """A world of `backend` reached with init_method=tcp:// (no launcher variables)."""
    import datetime
    for k in ("MASTER_ADDR", "MASTER_PORT", "PYCOLL_JOB_TOKEN", "PYCOLL_STORE_HOSTED"):
        os.environ.pop(k, None)
    import torch.distributed as dist
    import pycoll.torch  # noqa: F401
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return dist


def _model():
    from torch import nn
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def _batch(step, rank):
    g = torch.Generator().manual_seed(step * 100 + rank)
    return torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)


_KEEP = []  # no teardown of gloo groups or models: torch 2.13's gloo teardown race (see test_torch_backend)


def _fsdp2(rank, size, port, backend, steps):
    """FSDP2 (fully_shard per layer and at the root) on a 1-D CPU mesh; returns the full parameters."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    dist = _world(rank, size, port, backend)
    mesh = init_device_mesh("cpu", (size,))
    model = _model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        x, y = _batch(step, rank)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    full = torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])
    _KEEP.append((model, dist.group.WORLD))
    return full.numpy().copy()


@pytest.mark.parametrize("size", [2, 3])
def test_fsdp2_matches_gloo(size):
    runs = {b: run_ranks(_fsdp2, size, size, free_port(), b, 6, init=False, timeout=200)
            for b in ("pycoll", "gloo")}
    full = {b: [torch.from_numpy(v) for v in out] for b, out in runs.items()}
    for b, replicas in full.items():  # every rank reassembles the same full parameters
        assert all(torch.equal(r, replicas[0]) for r in replicas), b
    ours, theirs = full["pycoll"][0], full["gloo"][0]
    diff = (ours - theirs).abs().max().item()
    print(f"FSDP2 {size} ranks, 6 steps: max |pycoll - gloo| = {diff:.3g}, bit-identical: "
          f"{torch.equal(ours, theirs)}")
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6), diff
    if size == 2:
        assert torch.equal(ours, theirs)


def _sparse_ddp(rank, size, port, backend, steps):
    """DDP over a sparse embedding (its gradients are sparse COO: DDP allreduces them asynchronously
    during backward) and a dense head; returns the parameters after `steps` SGD steps."""
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist = _world(rank, size, port, backend)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.EmbeddingBag(50, 8, mode="sum", sparse=True), nn.Linear(8, 3)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        g = torch.Generator().manual_seed(step * 100 + rank)
        ids = torch.randint(0, 50, (16, 4), generator=g)  # each rank touches other rows
        y = torch.randint(0, 3, (16,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(ids), y).backward()
        opt.step()
    _KEEP.append((model, dist.group.WORLD))
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


def test_ddp_with_sparse_gradients_matches_gloo():
    runs = {b: run_ranks(_sparse_ddp, 2, 2, free_port(), b, 5, init=False, timeout=200) for b in ("pycoll", "gloo")}
    for b, replicas in runs.items():
        assert (replicas[0] == replicas[1]).all(), f"{b}: the replicas differ"
    ours, theirs = (torch.from_numpy(runs[b][0]) for b in ("pycoll", "gloo"))
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6), (ours - theirs).abs().max().item()


def _dtensor(rank, size, port, backend):
    """DTensor sharding, redistribution and a sharded matmul, plus functional collectives, on `backend`."""
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    _world(rank, size, port, backend)
    mesh = init_device_mesh("cpu", (size,))
    torch.manual_seed(1)
    a, b = torch.randn(6 * size, 8), torch.randn(8, 5 * size)
    da = distribute_tensor(a, mesh, [Shard(0)])
    db = distribute_tensor(b, mesh, [Shard(1)])
    out = {
        "local rows": da.to_local().shape[0],
        "replicate": torch.equal(da.redistribute(mesh, [Replicate()]).to_local(), a),
        "shard 1": torch.equal(da.redistribute(mesh, [Shard(1)]).full_tensor(), a),
        "matmul": (da @ db).full_tensor(),
        "sum": da.sum().full_tensor(),
    }
    t = torch.full((4,), float(rank + 1))
    out["funcol all_reduce"] = funcol.all_reduce(t, "sum", mesh).wait().tolist()
    out["funcol all_gather"] = funcol.all_gather_tensor(t, 0, mesh).wait().tolist()
    out["funcol reduce_scatter"] = funcol.reduce_scatter_tensor(
        torch.arange(2.0 * size), "sum", 0, mesh).wait().tolist()
    out["expected matmul"] = a @ b
    out["expected sum"] = a.sum()
    return {k: (v.numpy().copy() if isinstance(v, torch.Tensor) else v) for k, v in out.items()}


def test_dtensor_and_functional_collectives():
    size = 2
    out = run_ranks(_dtensor, size, size, free_port(), "pycoll", init=False, timeout=200)
    for rank, got in enumerate(out):
        assert got["local rows"] == 6 and got["replicate"] and got["shard 1"], got
        assert abs(got["matmul"] - got["expected matmul"]).max() < 1e-5
        assert abs(got["sum"] - got["expected sum"]) < 1e-4
        total = float(sum(r + 1 for r in range(size)))
        assert got["funcol all_reduce"] == [total] * 4
        assert got["funcol all_gather"] == [float(r + 1) for r in range(size) for _ in range(4)]
        assert got["funcol reduce_scatter"] == [float(size * (2 * rank + i)) for i in range(2)]


def _premul(rank, size, path):
    """PREMUL_SUM (a float and a tensor factor) on pycoll against gloo's SUM of the scaled inputs."""
    import torch.distributed as dist
    import pycoll.torch  # noqa: F401
    dist.init_process_group("gloo", store=dist.FileStore(path, size), rank=rank, world_size=size)
    pg = dist.new_group(backend="pycoll")
    got = {}
    for name, factor in (("float", 0.25), ("tensor", torch.tensor([3.0]))):
        x = torch.arange(6.0) + rank
        scaled = x * factor
        ours = x.clone()
        dist.all_reduce(ours, op=dist._make_nccl_premul_sum(factor), group=pg)
        dist.all_reduce(scaled)
        got[f"allreduce {name}"] = torch.equal(ours, scaled)
        rs = torch.empty(6 // size)
        dist.reduce_scatter_tensor(rs, x, op=dist._make_nccl_premul_sum(factor), group=pg)
        got[f"reduce_scatter {name}"] = torch.equal(rs, scaled.view(size, -1)[rank])
        got[f"input kept {name}"] = torch.equal(x, torch.arange(6.0) + rank)
        red = x.clone()
        dist.reduce(red, dst=0, op=dist._make_nccl_premul_sum(factor), group=pg)
        got[f"reduce {name}"] = torch.equal(red, scaled) if rank == 0 else torch.equal(red, x)
    _KEEP.append(pg)
    return got


def test_premul_sum():
    with tempfile.TemporaryDirectory() as d:
        out = run_ranks(_premul, 2, 2, os.path.join(d, "store"), init=False, timeout=120)
    for rank, got in enumerate(out):
        assert all(got.values()), (rank, got)


def _killed(rank, size, port, victim, stamp):
    """DDP training on pycoll where `victim` dies at step 3: the others' step must raise, naming it."""
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    _world(rank, size, port, "pycoll", timeout_s=60)  # far longer than the 5 s the test allows
    ddp = DDP(_model(), bucket_cap_mb=0.01)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(1000):
        if step == 3 and rank == victim:
            with open(stamp, "w") as f:
                f.write(repr(time.time()))
            os._exit(9)
        x, y = _batch(step, rank)
        opt.zero_grad()
        try:
            nn.functional.cross_entropy(ddp(x), y).backward()
        except Exception as e:  # noqa: BLE001  (the point: the step raises)
            return (step, time.time(), f"{type(e).__name__}: {e}")
        opt.step()
    return (None, time.time(), "no error")


def test_rank_killed_mid_ddp_training_raises_within_5s_on_every_other_rank():
    size, victim = 3, 2
    with tempfile.TemporaryDirectory() as d:
        stamp = os.path.join(d, "died")
        got = run_ranks(_killed, size, size, free_port(), victim, stamp, init=False, timeout=120,
                        expect_fail=True)
        with open(stamp) as f:
            died = float(f.read())
    for rank in range(size):
        if rank == victim:
            continue
        ok, value = got[rank]
        assert ok, value
        step, when, message = value
        print(f"rank {rank}: step {step} raised {when - died:.2f} s after rank {victim} died: {message[:200]}")
        assert step is not None and step >= 3, value
        assert when - died <= 5.0, (when - died, message)
        assert f"rank {victim}" in message, message


def _integers(rank, size, port):
    """Integer dtypes gloo lacks (int16, uint16, uint32, uint64) and bool, on pycoll against local sums."""
    dist = _world(rank, size, port, "pycoll")
    got = {}
    for name in ("int16", "uint16", "uint32", "uint64"):
        dtype = getattr(torch, name)
        t = torch.arange(6, dtype=torch.int64).add(rank).to(dtype)
        dist.all_reduce(t)
        expect = sum(torch.arange(6, dtype=torch.int64) + r for r in range(size))
        got[name] = t.to(torch.int64).tolist() == expect.tolist() and t.dtype == dtype
    flags = torch.tensor([rank == 0, True, False])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    got["bool max"] = flags.tolist() == [True, True, False]
    return got


def test_integer_dtypes_gloo_lacks():
    out = run_ranks(_integers, 2, 2, free_port(), init=False, timeout=120)
    for rank, got in enumerate(out):
        assert all(got.values()), (rank, got)

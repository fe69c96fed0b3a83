"""torch.distributed's own parallelisms, a few training steps each, on the backend named on the command line:

    torchrun --nproc-per-node 2 tests/framework_jobs/torch_job.py ddp fsdp2 tp pp --backend pycoll --out DIR
    pycoll run -n 2 python tests/framework_jobs/torch_job.py pp --schedule 1f1b --backend gloo --out DIR

ddp: DistributedDataParallel over a DistributedSampler. fsdp2: fully_shard per Linear and at the root.
tp: DTensor tensor parallelism (parallelize_module: the first Linear column-wise, the second row-wise), every
rank on the same batch. pp: torch.distributed.pipelining, one stage per rank, --schedule gpipe or 1f1b.
The only pycoll-specific thing is the backend's name. The jobs run one after the other in one process group
(one launch for all: starting the processes costs far more than the training), each on a fresh model, and
each rank writes each job's final weights to DIR/<job>/rank<R>.pt (full tensors; for pp its own stage's).
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

import common


def ddp(rank: int, size: int):
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler
    net = common.model()
    model = DDP(net)
    opt = common.optimizer(model.parameters())
    data = common.dataset()
    loader = DataLoader(data, batch_size=common.BATCH, sampler=DistributedSampler(data, size, rank, seed=0))
    for step, (x, y) in zip(range(common.STEPS), loader):
        opt.zero_grad()
        common.loss(model(x), y).backward()
        opt.step()
    return dict(net.named_parameters())


def fsdp2(rank: int, size: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (size,))
    model = common.model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = common.optimizer(model.parameters())
    for step in range(common.STEPS):
        x, y = common.batch(step * size + rank)  # each rank its own share of the data
        opt.zero_grad()
        common.loss(model(x), y).backward()
        opt.step()
    return {k: p.full_tensor() for k, p in model.named_parameters()}


def tp(rank: int, size: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (size,))
    model = parallelize_module(common.model(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = common.optimizer(model.parameters())
    for step in range(common.STEPS):
        x, y = common.batch(step)  # tensor parallelism: every rank the same batch
        opt.zero_grad()
        common.loss(model(x), y).backward()
        opt.step()
    return {k: p.full_tensor() if isinstance(p, DTensor) else p for k, p in model.named_parameters()}


def pp(rank: int, size: int, schedule: str, microbatches: int = 4):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    model = common.model()
    layers = list(model)
    cuts = [round(i * len(layers) / size) for i in range(size + 1)]  # contiguous modules per stage
    mine = range(cuts[rank], cuts[rank + 1])
    stage = PipelineStage(nn.Sequential(*(layers[i] for i in mine)), rank, size, torch.device("cpu"))
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    sched = kind(stage, n_microbatches=microbatches, loss_fn=common.loss)
    opt = common.optimizer(stage.submod.parameters())
    for step in range(common.STEPS):
        x, y = common.batch(step, common.BATCH * microbatches // 2)
        opt.zero_grad()
        if rank == 0:
            sched.step(x)
        elif rank == size - 1:
            sched.step(target=y, losses=[])
        else:
            sched.step()
        opt.step()
    return {k: p for k, p in model.named_parameters() if int(k.split(".")[0]) in mine}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("jobs", nargs="+", choices=["ddp", "fsdp2", "tp", "pp"])
    parser.add_argument("--backend", default="pycoll")
    parser.add_argument("--schedule", choices=["gpipe", "1f1b"], default="gpipe")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group(args.backend)  # the one line that selects pycoll
    rank, size = dist.get_rank(), dist.get_world_size()
    jobs = {"ddp": ddp, "fsdp2": fsdp2, "tp": tp, "pp": lambda r, s: pp(r, s, args.schedule)}
    for job in args.jobs:
        common.save(os.path.join(args.out, job), rank, jobs[job](rank, size), dist.get_backend())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

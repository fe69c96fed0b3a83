"""Hugging Face Accelerate training a few steps on CPU processes (torchrun or pycoll run starts them):

    torchrun --nproc-per-node 2 tests/framework_jobs/accelerate_job.py --backend pycoll --out DIR
    torchrun --nproc-per-node 2 tests/framework_jobs/accelerate_job.py --backend gloo --out DIR

On CPU, Accelerate (1.16) picks the backend itself, gloo (or mpi), and refuses another one named through
`InitProcessGroupKwargs(backend=...)` ("Your assigned backend pycoll is not available"); but it keeps a
process group that already exists. So the one line that selects pycoll is
`torch.distributed.init_process_group("pycoll")` before `Accelerator(cpu=True)`. With --backend gloo this
job lets Accelerate choose, as an Accelerate user would. Each rank writes its final weights to DIR/rank<R>.pt.
"""
import argparse

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch.utils.data import DataLoader

import common


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="pycoll")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.backend != "gloo":
        dist.init_process_group(args.backend)  # the one line that selects pycoll
    accelerator = Accelerator(cpu=True)
    if accelerator.distributed_type != DistributedType.MULTI_CPU or accelerator.num_processes != dist.get_world_size():
        raise RuntimeError(f"Accelerate did not run distributed: {accelerator.state}")
    net = common.model()
    opt = common.optimizer(net.parameters())
    model, opt, loader = accelerator.prepare(net, opt, DataLoader(common.dataset(), batch_size=common.BATCH))
    for step, (x, y) in zip(range(common.STEPS), loader):
        opt.zero_grad()
        accelerator.backward(common.loss(model(x), y))
        opt.step()
    accelerator.wait_for_everyone()
    common.save(args.out, accelerator.process_index, dict(accelerator.unwrap_model(model).named_parameters()),
                dist.get_backend())
    accelerator.end_training()


if __name__ == "__main__":
    main()

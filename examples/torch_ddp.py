"""Plain torch DDP on the "pycoll" backend: an MLP on scikit-learn's digits.

    torchrun --nproc-per-node 2 examples/torch_ddp.py --backend pycoll
    torchrun --nproc-per-node 2 examples/torch_ddp.py --backend gloo     # the same run on gloo
    pycoll run -n 2 python examples/torch_ddp.py --backend pycoll        # pycoll run works too

`import pycoll.torch` registers the backend; after that the script is ordinary torch.distributed
code (init_process_group from torchrun's environment, DistributedSampler, DistributedDataParallel).
Each rank prints a digest of its parameters at the end: every rank prints the same one, and at
two ranks the pycoll and gloo runs print the same one too (the two-rank sum has one order).
Under `pycoll run`, torch's store binds MASTER_PORT and pycoll's launcher store has a port of its own.
"""
import argparse
import hashlib
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import pycoll.torch  # noqa: F401  (registers the "pycoll" backend)


def digits():
    """(train, test) TensorDatasets: 8x8 digit images scaled to [0, 1], a fixed 80/20 split."""
    from sklearn.datasets import load_digits
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    cut = int(0.8 * len(x))
    return TensorDataset(x[:cut], y[:cut]), TensorDataset(x[cut:], y[cut:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["pycoll", "gloo"], default="pycoll")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32, help="per-rank batch size")
    args = parser.parse_args()

    dist.init_process_group(args.backend)  # rank, size and store from torchrun's environment
    rank, size = dist.get_rank(), dist.get_world_size()
    train, test = digits()
    torch.manual_seed(0)  # DDP broadcasts rank 0's parameters anyway; this keeps runs comparable
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    sampler = DistributedSampler(train, num_replicas=size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=args.batch, sampler=sampler)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total, batches = torch.zeros(1), 0
        for x, y in loader:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(ddp(x), y)
            loss.backward()
            opt.step()
            pycoll.mark_step()  # a step boundary in pycoll's flight recorder (pycoll trace --traffic)
            total += loss.detach()
            batches += 1
        dist.all_reduce(total, op=dist.ReduceOp.SUM)  # the mean loss over every rank's batches
        with torch.no_grad():
            xs, ys = test.tensors
            accuracy = (model(xs).argmax(1) == ys).float().mean().item()
        if rank == 0:
            print(f"[{args.backend}] epoch {epoch + 1}/{args.epochs}: loss {total.item() / (batches * size):.4f}, "
                  f"test accuracy {accuracy:.3f}", flush=True)

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]
    print(f"[{args.backend}] rank {rank}/{size}: parameters sha256 {digest}, test accuracy {accuracy:.3f}",
          flush=True)
    if args.backend == "pycoll":
        dist.destroy_process_group()
    else:  # torch 2.13's gloo teardown can abort ("terminate called without an active exception"), with or
        os._exit(0)  # without destroy_process_group: leave before it runs (the output is flushed above)


if __name__ == "__main__":
    main()

"""DDP by hand: a small torch model whose gradients pycoll averages while backward is still running.

    pycoll run -n 2 python examples/torch_ddp_style.py
    mpirun -np 2 python examples/torch_ddp_style.py

Every parameter gets a post-accumulate-grad hook that launches comm.allreduce(grad, op="avg",
async_op=True) the moment autograd has produced that gradient (last layer first, as in DDP, one
tensor per bucket; torch CPU tensors go to pycoll without a copy); the step waits for all of them
before optimizer.step(). At the end each rank checks that its replica matches the other ranks' bit
for bit and a single-process model trained on the whole global batch to float tolerance.
torch is optional: without it the example says so and exits 0.
"""
import copy
import hashlib
from typing import List

import numpy as np

import pycoll

try:
    import torch
    from torch import nn
except ImportError:
    torch = None

GLOBAL_BATCH, STEPS, LR, LOG_EVERY = 32, 30, 0.1, 10


def make_model(seed: int) -> "nn.Module":
    """A two-layer regression net in float64 (so that the comparison can be tight)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1)).double()


def batch(step: int):
    """The global batch of `step`: every rank draws the same one, then keeps its slice."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(GLOBAL_BATCH, 8, generator=g, dtype=torch.float64)
    return x, torch.sin(x.sum(dim=1, keepdim=True))


def attach_allreduce_hooks(model: "nn.Module", comm: pycoll.Communicator, pending: List[pycoll.Work]) -> None:
    """Average each gradient across ranks as soon as autograd has accumulated it."""
    def launch(p: "torch.Tensor") -> None:
        pending.append(comm.allreduce(p.grad, op="avg", async_op=True))
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(launch)


def train_step(model: "nn.Module", opt: "torch.optim.Optimizer", x, y) -> "torch.Tensor":
    """zero_grad, forward, backward (the caller waits for the gradients, then steps); returns the loss."""
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss


def main() -> None:
    if torch is None:
        print("torch is not installed; skipping the example (pip install 'pycoll[torch]')")
        return
    with pycoll.init() as comm:
        model = make_model(seed=comm.rank)  # different on every rank, until rank 0's start is broadcast
        with torch.no_grad():
            for p in model.parameters():
                comm.broadcast(p, root=0)
        single = copy.deepcopy(model)  # what one process training on the whole global batch would do
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        single_opt = torch.optim.SGD(single.parameters(), lr=LR, momentum=0.9)
        pending: List[pycoll.Work] = []
        attach_allreduce_hooks(model, comm, pending)
        per_rank = GLOBAL_BATCH // comm.size
        mine = slice(comm.rank * per_rank, (comm.rank + 1) * per_rank)
        for step in range(1, STEPS + 1):
            x, y = batch(step)
            loss = train_step(model, opt, x[mine], y[mine])
            for work in pending:
                work.wait()
            pending.clear()
            opt.step()
            train_step(single, single_opt, x, y)
            single_opt.step()
            global_loss = comm.allreduce(loss.detach().reshape(1), op="avg")
            if comm.rank == 0 and step % LOG_EVERY == 0:
                print(f"step {step}/{STEPS}: loss {global_loss.item():.6f}")

        params = [p.detach().numpy() for p in model.parameters()]
        digest = np.frombuffer(hashlib.blake2b(b"".join(p.tobytes() for p in params), digest_size=16).digest(),
                               np.uint8)
        identical = bool((comm.allgather(digest) == digest).all())
        diff = max(float(np.abs(p - q.detach().numpy()).max()) for p, q in zip(params, single.parameters()))
        ok = identical and diff < 1e-10
        print(f"rank {comm.rank}/{comm.size}: replicas identical: {'yes' if identical else 'NO'}; "
              f"max |param - single-process param| = {diff:.1e}; {'OK' if ok else 'WRONG'}")


if __name__ == "__main__":
    main()

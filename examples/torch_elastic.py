"""Elastic torch DDP on pycoll: a rank is killed mid-training, restarted, and healed; the run ends
with every replica equal.

    pycoll run --elastic --max-restarts 1 -n 3 python examples/torch_elastic.py --kill-slot 2 --kill-step 15 \
        --min-ranks 3

The rank in launcher slot 2 SIGKILLs itself at step 15 (its first life only: PYCOLL_RESTART_COUNT
says which life this is). The others drop that step, shrink to 2 ranks and go on; `pycoll run`
starts slot 2 again as a newcomer, whose pycoll.init() (inside ElasticDDP) joins the running job at
the members' next step boundary, where DDP is made again over the grown group and rank 0's model,
optimizer state and step counter reach it (pycoll/torch/elastic.py). With --min-ranks 3 the run does
not end before the restarted rank is back (a restart takes seconds, this training much less), up to
--max-steps. Each rank prints a digest of its parameters at the end: all print the same one.
"""
import argparse
import hashlib
import os
import signal

import torch
from torch import nn

from pycoll.torch.elastic import ElasticDDP


def digits():
    """8x8 digit images scaled to [0, 1] and their labels, in a fixed order."""
    from sklearn.datasets import load_digits
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    return x[order], y[order]


def my_share(x, y, step, rank, size, batch):
    """This rank's part of global batch `step` (the same global batches whatever the group's size)."""
    at = (step * batch) % (len(x) - batch)
    part = torch.arange(at, at + batch).tensor_split(size)[rank]
    return x[part], y[part]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=48, help="global batch size")
    parser.add_argument("--kill-slot", type=int, default=None, help="launcher slot (RANK) that kills itself")
    parser.add_argument("--kill-step", type=int, default=15)
    parser.add_argument("--min-ranks", type=int, default=0, help="go on past --steps until the group has this many")
    parser.add_argument("--max-steps", type=int, default=100000, help="but stop at this step in any case")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    el = ElasticDDP(model, opt)  # el.state["step"]: the steps completed on every rank (healed to a newcomer)
    x, y = digits()
    first_life = os.environ.get("PYCOLL_RESTART_COUNT", "0") == "0"
    # every rank sees the same step and size (agreed), so all leave the loop together
    while el.state["step"] < args.steps or (el.size < args.min_ranks and el.state["step"] < args.max_steps):
        step = el.state["step"]
        if step == args.kill_step and first_life and os.environ.get("RANK") == str(args.kill_slot):
            os.kill(os.getpid(), signal.SIGKILL)
        xb, yb = my_share(x, y, step, el.rank, el.size, args.batch)
        el.step(lambda ddp: nn.functional.cross_entropy(ddp(xb), yb).backward())  # False: dropped, re-shard
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]
    loss = nn.functional.cross_entropy(model(x), y).item()
    print(f"rank {el.rank} of {el.size}: {el.state['step']} steps, loss {loss:.4f}, parameters {digest}", flush=True)
    el.close()


if __name__ == "__main__":
    main()

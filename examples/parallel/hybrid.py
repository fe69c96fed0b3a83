"""2-D parallelism: tensor parallelism along one mesh dimension, data parallelism (FSDP2 or DDP) along the other.

    pycoll run -n 4 python examples/parallel/hybrid.py --tp 2 --json hybrid.json
    pycoll run -n 2 --nnodes 2 --node-rank R ... python examples/parallel/hybrid.py --tp 2 --tp-across-hosts

The world's ranks form a (dp, tp) mesh with dimension names ("dp", "tp"). Each transformer block of the
tp.py stack gets the Megatron plan over its "tp" row (4 activation-sized allreduces per block per step,
all inside the TP group), then FSDP2's fully_shard (or DDP) over its "dp" column (the gradients' reduction
once per step). Which ranks share a TP group is the placement:

  --tp-inside-host (default)  consecutive ranks, which share a host (LOCAL_WORLD_SIZE ranks per host, in
                              rank order as torchrun and `pycoll run` place them): the chatty TP traffic
                              stays on the host and only the DP reduction crosses hosts;
  --tp-across-hosts           one rank from each of `tp` hosts (same local rank): every TP allreduce crosses
                              hosts. The mesh is built from that explicit rank list.

Each DP replica trains on its own seeded batches (the same for every rank of its TP group), so both
placements train the same model. The JSON adds the placement, the mesh's rank list, the DP replicas'
mean final loss and a digest of the full weights: bit-identical against gloo when every group has at most
2 ranks, else within float32 rounding.
"""
from __future__ import annotations

import logging
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import Layout, Steps, env_layout, finish, init, make_parser, report, weights_digest
from tp import add_model_args, build_stack, check_model_args, full_params, make_batch, tp_plan


def mesh_ranks(layout: Layout, tp: int, inside: bool) -> List[List[int]]:
    """The (dp, tp) grid of global ranks: row i is DP replica i's TP group. Inside hosts: consecutive
    ranks; across hosts: the ranks with one local rank on `tp` consecutive hosts."""
    world, local = layout.world, layout.local_world
    grid = torch.arange(world)
    if inside:
        grid = grid.view(world // tp, tp)
    else:  # [host group][host in group][local rank] -> rows of one local rank on tp hosts
        grid = grid.view(layout.hosts // tp, tp, local).permute(0, 2, 1).reshape(world // tp, tp)
    return grid.tolist()


def check_placement(p, layout: Layout, tp: int, inside: bool) -> None:
    """parser.error (before anything is sent) when the mesh does not divide the world or the placement
    cannot be made on these hosts."""
    if tp < 1 or layout.world % tp:
        p.error(f"a ({layout.world} // {tp}, {tp}) mesh does not divide the world: --tp {tp} must divide "
                f"the {layout.world} ranks")
    if inside and layout.local_world % tp:
        p.error(f"--tp-inside-host: TP groups of {tp} ranks do not fit in hosts of {layout.local_world} ranks "
                f"(LOCAL_WORLD_SIZE); use a --tp dividing it, or --tp-across-hosts")
    if not inside and layout.hosts % tp:
        p.error(f"--tp-across-hosts: a TP group takes one rank from each of {tp} hosts, and the job's "
                f"{layout.hosts} host(s) (WORLD_SIZE / LOCAL_WORLD_SIZE) are not a multiple of {tp}")


def main() -> None:
    p = make_parser(__doc__)
    add_model_args(p)
    p.add_argument("--tp", type=int, default=2, help="TP degree: ranks per TP group (default 2); DP = world / TP")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--tp-inside-host", dest="inside", action="store_true", default=True,
                       help="TP groups of consecutive ranks on one host (default)")
    where.add_argument("--tp-across-hosts", dest="inside", action="store_false",
                       help="TP groups of one rank per host")
    p.add_argument("--dp-style", choices=("fsdp", "ddp"), default="fsdp",
                   help="data parallelism: FSDP2 fully_shard or DistributedDataParallel (default fsdp)")
    args = p.parse_args()
    layout = env_layout()
    check_placement(p, layout, args.tp, args.inside)
    check_model_args(p, args, args.tp)
    ranks = mesh_ranks(layout, args.tp, args.inside)
    init(args.backend)

    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import parallelize_module
    mesh = DeviceMesh("cpu", ranks, mesh_dim_names=("dp", "tp"))
    replica = mesh.get_local_rank("dp")
    model = build_stack(args)
    for block in model:
        parallelize_module(block, mesh["tp"], tp_plan())
    if args.dp_style == "fsdp":
        from torch.distributed.fsdp import fully_shard
        for block in model:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        trained = model
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP
        trained = DDP(model, device_mesh=mesh["dp"])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    steps = Steps(args.warmup)
    loss = torch.zeros(())
    for step in range(args.warmup + args.steps):
        x, y = make_batch(args, step * len(ranks) + replica)  # replica `replica`'s own batches
        with steps.step():
            opt.zero_grad()
            loss = F.mse_loss(trained(x), y)
            loss.backward()
            opt.step()
    # full_tensor() of an FSDP2 + TP weight gathers along both mesh dims one after the other, and torch warns
    # that this is suboptimal on every rank: once, for the digest, it does not matter
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    losses: List[Optional[float]] = [None] * layout.world
    dist.all_gather_object(losses, loss.item())
    replica_losses = [losses[row[0]] for row in ranks]
    largest = max(len(ranks), args.tp)
    report(args, steps, placement="tp-inside-host" if args.inside else "tp-across-hosts", dp=len(ranks),
           tp=args.tp, dp_style=args.dp_style, mesh=ranks, loss=sum(replica_losses) / len(replica_losses),
           **weights_digest(full_params(model)), match="bit-identical" if largest <= 2 else "float32 rounding")
    finish(args.backend)


if __name__ == "__main__":
    main()

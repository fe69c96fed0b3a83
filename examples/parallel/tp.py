"""Megatron-style tensor parallelism with torch DTensor: a stack of transformer blocks trained for a few steps.

    pycoll run -n 2 python examples/parallel/tp.py --backend pycoll --json tp.json
    torchrun --nproc-per-node 2 examples/parallel/tp.py --backend gloo

Every rank builds the same seeded model; `parallelize_module` then shards each block over all ranks:
attention's fused q/k/v projection and the MLP's first linear column-wise (each rank keeps whole heads
and a slice of the hidden units), the attention output projection and the MLP's second linear row-wise.
So a block's forward makes two allreduces (after each row-wise linear) and its backward two more (the
input gradients of the column-wise linears), all of activation size (batch x seq x dim floats). The batch
is the same on every rank. The JSON adds the final loss, a digest of the full weights and `match`:
bit-identical against gloo at 2 ranks (a sum of two has one order), within float32 rounding beyond.

The model (Block, build_stack, make_batch, TP_PLAN) is shared with pp.py and hybrid.py.
"""
from __future__ import annotations

import argparse
from typing import Dict, List, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from common import Layout, Steps, env_layout, finish, init, make_parser, report, weights_digest


class Attention(nn.Module):
    """Causal multi-head self-attention. The fused projection's output is laid out head by head
    ([head][q, k, v][head_dim]), so a column-wise shard holds whole heads and its forward needs no
    communication; the head count is read from the (possibly sharded) output size."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wqkv = nn.Linear(dim, 3 * dim)
        self.wo = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.wqkv(x).view(b, s, -1, 3, self.head_dim)  # -1: the heads this rank holds
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(3))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """dim -> hidden -> dim with a GELU between."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    """A pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def tp_plan() -> Dict[str, object]:
    """The Megatron plan for one Block: column-wise then row-wise in attention and in the MLP."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    return {"attn.wqkv": ColwiseParallel(), "attn.wo": RowwiseParallel(),
            "mlp.w1": ColwiseParallel(), "mlp.w2": RowwiseParallel()}


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model's and batch's sizes (small defaults: a test-sized job)."""
    p.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    p.add_argument("--dim", type=int, default=64, help="model width (default 64)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--mlp-ratio", type=int, default=4, help="MLP hidden units per model unit (default 4)")
    p.add_argument("--seq", type=int, default=16, help="sequence length (default 16)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")


def check_model_args(p: argparse.ArgumentParser, args: argparse.Namespace, tp: int) -> None:
    """parser.error (exit 2, before anything is sent) for sizes the model or a TP degree `tp` cannot take."""
    for name in ("layers", "dim", "heads", "mlp_ratio", "seq", "batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.dim % args.heads:
        p.error(f"--heads {args.heads} does not divide --dim {args.dim}")
    if args.heads % tp:
        p.error(f"the TP degree {tp} does not divide --heads {args.heads}: each rank must hold whole heads")
    if (args.dim * args.mlp_ratio) % tp:
        p.error(f"the TP degree {tp} does not divide the MLP's {args.dim * args.mlp_ratio} hidden units")


def build_stack(args: argparse.Namespace) -> nn.Sequential:
    """The whole seeded model (every rank builds the same one): `--layers` Blocks in a Sequential."""
    torch.manual_seed(args.seed)
    return nn.Sequential(*(Block(args.dim, args.heads, args.dim * args.mlp_ratio) for _ in range(args.layers)))


def make_batch(args: argparse.Namespace, step: int, batch: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s seeded (input, target), each batch x seq x dim (batch: `--batch` unless given)."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    shape = (batch or args.batch, args.seq, args.dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def full_params(model: nn.Module) -> List[torch.Tensor]:
    """Every Linear's and LayerNorm's weight and bias as whole tensors, in module order (DTensors
    gathered: collective, every rank calls). Read as attributes, not model.parameters(): DDP over a
    slice of a TP mesh (hybrid.py) leaves the TP weights as plain DTensor attributes after a forward."""
    out = []
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.LayerNorm)):
            for t in (module.weight, module.bias):
                out.append(t.full_tensor() if hasattr(t, "full_tensor") else t.detach())
    return out


def main() -> None:
    p = make_parser(__doc__)
    add_model_args(p)
    args = p.parse_args()
    layout: Layout = env_layout()
    check_model_args(p, args, layout.world)
    init(args.backend)

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    mesh = init_device_mesh("cpu", (layout.world,), mesh_dim_names=("tp",))
    model = build_stack(args)
    for block in model:
        parallelize_module(block, mesh, tp_plan())
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    steps = Steps(args.warmup)
    loss = torch.zeros(())
    for step in range(args.warmup + args.steps):
        x, y = make_batch(args, step)
        with steps.step():
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
    report(args, steps, tp=layout.world, layers=args.layers, loss=loss.item(),
           **weights_digest(full_params(model)),
           match="bit-identical" if layout.world <= 2 else "float32 rounding")
    finish(args.backend)


if __name__ == "__main__":
    main()

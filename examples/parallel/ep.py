"""Expert parallelism: a mixture-of-experts layer whose tokens travel to their experts by all-to-all.

    pycoll run -n 4 python examples/parallel/ep.py --backend pycoll --json ep.json
    pycoll run -n 4 python examples/parallel/ep.py --backend gloo --skew --json ep-skew-gloo.json
    torchrun --nproc-per-node 4 examples/parallel/ep.py --experts 8 --top-k 2

Every rank holds --experts / ranks experts (a two-layer GELU MLP each) and a replica of the router. Each
step, every rank routes its own --tokens tokens to their top-k experts, exchanges how many tokens go to
each expert (all_to_all_single of the counts: the receivers need them to size their buffers), sends the
tokens to the experts' ranks (all_to_all_single with uneven splits), runs its experts, sends the outputs
back the same way and combines them weighted by the router's gates. Backward runs the two exchanges in
reverse (the autograd function below, as MoE codebases write it); the router's gradient is averaged over
the ranks with one all_reduce; then an SGD step. --skew S adds S * (1 - e / (E - 1)) to expert e's router
logit, so the first experts (the first ranks') get more tokens and the others wait for them.

Reported: a2a_bytes_per_step (bytes all ranks send to other ranks in all-to-alls per step, median over
steps), tokens_per_rank (the token copies each rank's experts process per step), expert_ms and a2a_ms (each
rank's time in expert compute, forward and backward, and inside all-to-alls), wait_ms (the busiest rank's
expert time minus the median rank's: how long it holds the others at the next exchange) and, to compare
backends, losses, weights_sha and checksum. The all-to-alls only move data, so the only reduction is the
router's all_reduce: bit-identical with gloo on 2 ranks (a + b has one order), float32 rounding beyond.
"""
from __future__ import annotations

import hashlib
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from common import Steps, env_layout, finish, init, make_parser, median, report, weights_digest


class A2AClock:
    """What one step's all-to-alls cost on this rank: time inside them, bytes sent to other ranks, and the
    two backward timestamps that bracket the experts' backward compute."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.a2a_s = 0.0
        self.calls = 0
        self.bytes_sent = 0
        self.combine_backward_end: Optional[float] = None
        self.dispatch_backward_start: Optional[float] = None

    def exchange(self, out: torch.Tensor, inp: torch.Tensor, out_splits: Optional[List[int]],
                 in_splits: Optional[List[int]], group: Any) -> None:
        """dist.all_to_all_single(out, inp, out_splits, in_splits), timed and its bytes counted."""
        world = dist.get_world_size(group)
        sends = in_splits if in_splits is not None else [inp.shape[0] // world] * world
        t0 = time.perf_counter()
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)
        self.a2a_s += time.perf_counter() - t0
        self.calls += 1
        row = inp[0].numel() * inp.element_size() if inp.shape[0] else 0
        self.bytes_sent += row * (sum(sends) - sends[dist.get_rank(group)])


class AllToAll(torch.autograd.Function):
    """all_to_all_single as an autograd op: backward sends the gradients back along the same routes
    (output and input splits swapped)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: List[int], in_splits: List[int], group: Any,
                clock: A2AClock, name: str) -> torch.Tensor:
        ctx.splits, ctx.group, ctx.clock, ctx.name = (out_splits, in_splits), group, clock, name
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        clock.exchange(out, x.contiguous(), out_splits, in_splits, group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        out_splits, in_splits = ctx.splits
        if ctx.name == "dispatch":
            ctx.clock.dispatch_backward_start = time.perf_counter()
        back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        ctx.clock.exchange(back, grad.contiguous(), in_splits, out_splits, ctx.group)
        if ctx.name == "combine":
            ctx.clock.combine_backward_end = time.perf_counter()
        return back, None, None, None, None, None


class Expert(nn.Module):
    """A two-layer GELU MLP, its weights drawn from a generator seeded by its global index, so an expert
    has the same weights whatever rank holds it."""

    def __init__(self, hidden: int, ffn: int, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w1 = nn.Parameter(torch.randn(hidden, ffn, generator=g) / hidden ** 0.5)
        self.w2 = nn.Parameter(torch.randn(ffn, hidden, generator=g) / ffn ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(x @ self.w1) @ self.w2


class MoELayer(nn.Module):
    """A top-k routed mixture of `experts` experts, experts/world of them on each rank of `group`."""

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int, skew: float, seed: int,
                 group: Any = None) -> None:
        super().__init__()
        self.group = group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.experts_total, self.top_k = experts, top_k
        self.local = experts // self.world
        g = torch.Generator().manual_seed(seed)
        self.router = nn.Parameter(torch.randn(hidden, experts, generator=g) / hidden ** 0.5)  # the same on every rank
        ramp = 1.0 - torch.arange(experts, dtype=torch.float32) / max(experts - 1, 1)
        self.register_buffer("bias", skew * ramp)
        first = self.rank * self.local
        self.experts = nn.ModuleList(Expert(hidden, ffn, seed * 1_000_003 + 1 + e)
                                     for e in range(first, first + self.local))
        self.clock = A2AClock()
        self.expert_s = 0.0
        self.tokens_in = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, world, local = self.top_k, self.world, self.local
        gates, chosen = torch.softmax(x @ self.router + self.bias, dim=-1).topk(k, dim=-1)
        gates = gates / gates.sum(dim=-1, keepdim=True)
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)  # token copies grouped by expert, so by rank
        token = order // k
        per_expert = torch.bincount(flat, minlength=self.experts_total)
        # How many tokens each rank sends to each of my experts: its counts for my experts.
        incoming = torch.empty_like(per_expert)
        self.clock.exchange(incoming, per_expert, None, None, self.group)
        in_splits = per_expert.view(world, local).sum(1).tolist()
        counts = incoming.view(world, local)  # counts[s, j]: rows from rank s for my expert j
        out_splits = counts.sum(1).tolist()
        received = AllToAll.apply(x[token], out_splits, in_splits, self.group, self.clock, "dispatch")

        t0 = time.perf_counter()
        starts = (torch.cumsum(counts.reshape(-1), 0) - counts.reshape(-1)).view(world, local).tolist()
        rows = counts.tolist()
        perm = torch.cat([torch.arange(starts[s][j], starts[s][j] + rows[s][j])
                          for j in range(local) for s in range(world)])  # received rows, expert by expert
        sizes = counts.sum(0).tolist()
        outs = [expert(chunk) for expert, chunk in zip(self.experts, received[perm].split(sizes))]
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel())
        done = torch.cat(outs)[inverse]  # back in the order they arrived
        self.expert_s += time.perf_counter() - t0
        self.tokens_in += int(perm.numel())

        back = AllToAll.apply(done, in_splits, out_splits, self.group, self.clock, "combine")
        weighted = back * gates.reshape(-1)[order].unsqueeze(1)
        return torch.zeros_like(x).index_add(0, token, weighted)


def batch(seed: int, step: int, tokens: int, hidden: int, rank: int, world: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of step `step`'s global batch (inputs and regression targets): the same global
    batch whatever the number of ranks."""
    g = torch.Generator().manual_seed(seed * 7919 + 17 + step)
    x = torch.randn(world * tokens, hidden, generator=g)
    y = torch.randn(world * tokens, hidden, generator=g)
    rows = slice(rank * tokens, (rank + 1) * tokens)
    return x[rows], y[rows]


def check(args: Any, world: int) -> Optional[str]:
    """What is wrong with these options on `world` ranks, or None."""
    if args.experts < 1 or args.experts % world:
        return f"--experts {args.experts} cannot be divided among {world} ranks (give a multiple of {world})"
    if not 1 <= args.top_k <= args.experts:
        return f"--top-k {args.top_k} must be between 1 and --experts ({args.experts})"
    for name in ("tokens", "hidden", "ffn"):
        if getattr(args, name) < 1:
            return f"--{name} must be at least 1, got {getattr(args, name)}"
    if args.skew < 0:
        return f"--skew must be 0 or more, got {args.skew}"
    if args.lr <= 0:
        return f"--lr must be positive, got {args.lr}"
    return None


def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--experts", type=int, default=None,
                        help="experts in all (default 2 per rank); a multiple of the number of ranks")
    parser.add_argument("--top-k", type=int, default=2, help="experts each token goes to (default 2)")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per rank per step (default 1024)")
    parser.add_argument("--hidden", type=int, default=256, help="model width (default 256)")
    parser.add_argument("--ffn", type=int, default=1024, help="each expert's inner width (default 1024)")
    parser.add_argument("--skew", type=float, nargs="?", const=2.0, default=0.0, metavar="S",
                        help="router bias towards the first experts (--skew alone: 2.0; default 0: none)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    args = parser.parse_args()
    layout = env_layout()
    if args.experts is None:
        args.experts = 2 * layout.world
    problem = check(args, layout.world)
    if problem:
        parser.error(problem)
    init(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()

    moe = MoELayer(args.hidden, args.ffn, args.experts, args.top_k, args.skew, args.seed)
    steps = Steps(args.warmup)
    mine: List[Dict[str, float]] = []
    for i in range(args.warmup + args.steps):
        x, y = batch(args.seed, i, args.tokens, args.hidden, rank, world)
        moe.clock.reset()
        moe.expert_s, moe.tokens_in = 0.0, 0
        x.requires_grad_()  # as if layers below it were trained too: backward returns the tokens' gradients
        with steps.step():
            moe.zero_grad(set_to_none=True)
            loss = ((x + moe(x) - y) ** 2).mean()
            loss.backward()
            dist.all_reduce(moe.router.grad)  # the router is replicated: average its gradient (data parallel)
            moe.router.grad /= world
            with torch.no_grad():  # plain SGD (torch.optim's first use imports ~800 modules: 2-3 s a rank)
                for p in moe.parameters():
                    p -= args.lr * p.grad
        clock = moe.clock
        backward_experts = clock.dispatch_backward_start - clock.combine_backward_end
        if i >= args.warmup:
            mine.append({"loss": loss.item(), "expert_ms": (moe.expert_s + backward_experts) * 1e3,
                         "a2a_ms": clock.a2a_s * 1e3, "a2a_calls": clock.calls, "bytes": clock.bytes_sent,
                         "tokens": moe.tokens_in})

    every: List[Any] = [None] * world
    dist.all_gather_object(every, {"steps": mine, **weights_digest(moe.parameters())})
    per = [[every[r]["steps"][s] for r in range(world)] for s in range(args.steps)]  # per[step][rank]
    expert_ms = [[m["expert_ms"] for m in row] for row in per]
    a2a_bytes = [sum(m["bytes"] for m in row) for row in per]
    report(args, steps,
           experts=args.experts, top_k=args.top_k, tokens=args.tokens, hidden=args.hidden, ffn=args.ffn,
           skew=args.skew,
           a2a_bytes_per_step=median(a2a_bytes), a2a_bytes=a2a_bytes,
           a2a_calls_per_step=per[0][0]["a2a_calls"],
           tokens_per_rank=[[m["tokens"] for m in row] for row in per],
           load_imbalance=median(max(m["tokens"] for m in row) * world / sum(m["tokens"] for m in row)
                                 for row in per),
           expert_ms=[median(row[r] for row in expert_ms) for r in range(world)],
           a2a_ms=[median(row[r]["a2a_ms"] for row in per) for r in range(world)],
           wait_ms=median(max(row) - median(row) for row in expert_ms),
           loss=sum(m["loss"] for m in per[-1]) / world,
           losses=[[m["loss"] for m in row] for row in per],
           weights_sha=hashlib.sha256("".join(e["weights_sha"] for e in every).encode()).hexdigest(),
           checksum=sum(e["checksum"] for e in every),
           match="bit-identical" if world <= 2 else "float32 rounding")
    finish(args.backend)


if __name__ == "__main__":
    main()

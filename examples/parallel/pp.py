"""Pipeline parallelism with torch.distributed.pipelining: the tp.py block stack split into one stage per rank.

    pycoll run -n 2 python examples/parallel/pp.py --schedule gpipe --microbatches 4 --json pp.json
    torchrun --nproc-per-node 2 examples/parallel/pp.py --backend gloo --schedule 1f1b --microbatches 4

Rank r holds blocks r*L/p .. (r+1)*L/p-1 as a PipelineStage; ScheduleGPipe or Schedule1F1B splits each
batch into `--microbatches` m and passes activations forward and their gradients back point to point.
With p stages of equal cost and free communication each stage sits idle for (p-1)/(m+p-1) of a step (the
bubble). The job measures it: each stage times its own forward and backward compute (an autograd stamp
at either end of the stage's backward), and a stage's idle fraction of a step is 1 - compute / the
schedule's step time. The JSON adds `bubble` (median over steps of the stages' mean), `bubble_per_stage`,
`bubble_theory`, `bubble_compute_only` (the bubble the step's own compute spans imply with free
communication and no schedule overhead: the formula's assumptions but for equal, steady compute; the
gap from it to `bubble` is the link and the bookkeeping, from the formula to it uneven compute),
`pipe_ms` (median schedule.step time), the last step's loss (the microbatches' mean) and a digest of the
whole model's weights: bit-identical against gloo (no reductions, only copies).
"""
from __future__ import annotations

import time
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from common import Steps, env_layout, finish, init, make_parser, median, report, weights_digest
from tp import add_model_args, build_stack, check_model_args, make_batch

SCHEDULES = ("gpipe", "1f1b")


class _BackwardBegins(torch.autograd.Function):
    """Identity on the stage's output; its backward runs first in the stage's backward and stamps the time."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, stage: "TimedStage") -> torch.Tensor:  # type: ignore[override]
        ctx.stage = stage
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        ctx.stage.backward_began = time.perf_counter()
        return grad, None


class _BackwardEnds(torch.autograd.Function):
    """Identity on the stage's input; its backward runs last and adds the backward's span to the stage's busy time."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, stage: "TimedStage") -> torch.Tensor:  # type: ignore[override]
        ctx.stage = stage
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        now = time.perf_counter()
        ctx.stage.busy_s += now - ctx.stage.backward_began
        ctx.stage.spans.append(("B", ctx.stage.backward_began, now))
        return grad, None


class TimedStage(nn.Module):
    """A stage's blocks, keeping `busy_s`: the seconds spent computing its forwards and backwards, and
    `spans`: each forward's and backward's (kind "F" or "B", start, end)."""

    def __init__(self, blocks: List[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*blocks)
        self.busy_s = 0.0
        self.backward_began = 0.0
        self.spans: List[Tuple[str, float, float]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        if not x.requires_grad:  # the first stage's input: let its backward end be stamped too
            x = x.detach().requires_grad_()
        y = _BackwardBegins.apply(self.blocks(_BackwardEnds.apply(x, self)), self)
        now = time.perf_counter()
        self.busy_s += now - t0
        self.spans.append(("F", t0, now))
        return y


def compute_only_bubble(stages: List[List[Tuple[str, float, float]]]) -> Optional[float]:
    """The bubble one step's own compute implies with free communication and no overhead: each
    stage runs its forwards and backwards in the order it ran them (the k-th forward or backward is
    microbatch k), each as long as it took, a forward after the previous stage's forward of the same
    microbatch and a backward after the next stage's backward; the stages' mean idle fraction of
    that replayed step. Unequal and uneven (jittery) compute shows here; the link and the schedule's
    bookkeeping do not. None if the spans do not pair up."""
    p = len(stages)
    ops = []
    for spans in stages:
        seen = {"F": 0, "B": 0}
        mine = []
        for kind, t0, t1 in sorted(spans, key=lambda e: e[1]):
            mine.append((kind, seen[kind], t1 - t0))
            seen[kind] += 1
        ops.append(mine)
    end: dict = {}
    clock, at = [0.0] * p, [0] * p
    moved = True
    while moved:
        moved = False
        for s in range(p):
            while at[s] < len(ops[s]):
                kind, i, took = ops[s][at[s]]
                dep = (s - 1, "F", i) if kind == "F" and s > 0 else (s + 1, "B", i) if kind == "B" and s < p - 1 \
                    else None
                if dep is not None and dep not in end:
                    break
                clock[s] = max(clock[s], end[dep] if dep is not None else 0.0) + took
                end[(s, kind, i)] = clock[s]
                at[s] += 1
                moved = True
    if any(at[s] < len(ops[s]) for s in range(p)) or not max(clock):
        return None
    step = max(clock)
    return sum(1.0 - sum(took for _, _, took in ops[s]) / step for s in range(p)) / p


def main() -> None:
    p = make_parser(__doc__)
    add_model_args(p)
    p.add_argument("--schedule", choices=SCHEDULES, default="gpipe", help="pipeline schedule (default gpipe)")
    p.add_argument("--microbatches", type=int, default=4, metavar="M", help="microbatches per step (default 4)")
    args = p.parse_args()
    layout = env_layout()
    stages = layout.world
    check_model_args(p, args, 1)
    if args.layers % stages:
        p.error(f"{stages} stages (one per rank) do not divide --layers {args.layers}: stages must be equal")
    if args.microbatches < 1 or args.batch % args.microbatches:
        p.error(f"--microbatches {args.microbatches} does not divide --batch {args.batch}")
    if args.schedule == "1f1b" and args.microbatches < stages:
        p.error(f"1F1B needs at least as many microbatches as stages ({stages}), got --microbatches "
                f"{args.microbatches} (torch's Schedule1F1B refuses fewer; with one it is GPipe)")
    init(args.backend)

    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    rank, per_stage = layout.rank, args.layers // stages
    blocks = list(build_stack(args))  # every rank builds the whole seeded model and keeps its stage
    stage_mod = TimedStage(blocks[rank * per_stage:(rank + 1) * per_stage])
    stage = PipelineStage(stage_mod, rank, stages, torch.device("cpu"))
    kind = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
    schedule = kind(stage, n_microbatches=args.microbatches, loss_fn=F.mse_loss)
    opt = torch.optim.SGD(stage_mod.parameters(), lr=args.lr, momentum=0.9)
    first, last = rank == 0, rank == stages - 1

    steps = Steps(args.warmup)
    pipe_ms: List[float] = []
    idle: List[float] = []
    spans: List[List[Tuple[str, float, float]]] = []  # per measured step, this stage's compute spans
    loss: Optional[float] = None
    # every step's batch is made before the timed loop, as a DataLoader's workers would have it ready: the
    # first stage's data making would otherwise count as the next stage's idle time; each keeps what it feeds
    batches = [(x if first else None, y if last else None)
               for x, y in (make_batch(args, step) for step in range(args.warmup + args.steps))]
    for step in range(args.warmup + args.steps):
        x, y = batches[step]
        with steps.step():
            opt.zero_grad()
            stage_mod.spans = []
            busy0, t0 = stage_mod.busy_s, time.perf_counter()
            losses: List[torch.Tensor] = []
            if first and last:
                schedule.step(x, target=y, losses=losses)
            elif first:
                schedule.step(x)
            elif last:
                schedule.step(target=y, losses=losses)
            else:
                schedule.step()
            pipe_s = time.perf_counter() - t0
            opt.step()
        if step >= args.warmup:
            pipe_ms.append(pipe_s * 1e3)
            idle.append(1.0 - (stage_mod.busy_s - busy0) / pipe_s)
            spans.append(stage_mod.spans)
        if last:
            loss = torch.stack(losses).mean().item()

    mine = {"idle": idle, "pipe_ms": pipe_ms, "loss": loss, "spans": spans,
            "weights": torch.cat([q.detach().reshape(-1) for q in stage_mod.parameters()])}
    everyone: List[Optional[dict]] = [None] * stages
    dist.all_gather_object(everyone, mine)
    per_stage_idle = [[r["idle"][i] for r in everyone] for i in range(len(idle))]
    alone = [compute_only_bubble([r["spans"][i] for r in everyone]) for i in range(len(idle))]
    report(args, steps, schedule=args.schedule, stages=stages, microbatches=args.microbatches,
           bubble=median(sum(s) / stages for s in per_stage_idle),
           bubble_per_stage=[median(r["idle"]) for r in everyone],
           bubble_theory=(stages - 1) / (args.microbatches + stages - 1),
           bubble_compute_only=median(alone) if None not in alone else None,
           pipe_ms=median(max(r["pipe_ms"][i] for r in everyone) for i in range(len(pipe_ms))),
           loss=everyone[-1]["loss"], **weights_digest(r["weights"] for r in everyone), match="bit-identical")
    finish(args.backend)


if __name__ == "__main__":
    main()

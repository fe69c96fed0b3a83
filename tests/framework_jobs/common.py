"""What every framework job shares: the tiny model, its data, the optimizer settings and how the final
weights are written, so that a pycoll run and a gloo run of the same job can be compared weight by weight."""
import os
from typing import Dict, Iterable, Tuple

import torch
from torch import nn

STEPS = 5          # optimizer steps each job takes
BATCH = 16         # samples per rank per step (the data-parallel jobs)
LR, MOMENTUM = 0.1, 0.9


def model() -> nn.Sequential:
    """The same seeded MLP on every rank and in every job: 16 -> 48 -> 48 -> 4. Its 48-wide layers split
    evenly over 2 or 3 ranks (tensor parallelism) and its five modules over 2 or 3 stages (pipelining)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 48), nn.ReLU(), nn.Linear(48, 48), nn.ReLU(), nn.Linear(48, 4))


def dataset(n: int = 512) -> torch.utils.data.TensorDataset:
    """n seeded random samples of 16 features with one of 4 labels."""
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g))


def batch(step: int, size: int = BATCH) -> Tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s batch for jobs that feed every rank the same data (tensor and pipeline parallelism)."""
    x, y = dataset().tensors
    return x[step * size:(step + 1) * size], y[step * size:(step + 1) * size]


def optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y)


def save(out_dir: str, rank: int, weights: Dict[str, torch.Tensor], backend: str) -> None:
    """Write this rank's final weights (full tensors, by parameter name) and the backend it really ran on
    (what torch.distributed reports, not what was asked for) to OUT_DIR/rank<R>.pt."""
    os.makedirs(out_dir, exist_ok=True)
    state = {k: v.detach().clone().contiguous() for k, v in weights.items()}
    torch.save({"weights": state, "backend": backend}, os.path.join(out_dir, f"rank{rank}.pt"))

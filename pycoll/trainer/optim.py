"""SGD with momentum and Adam, updating numpy parameters in place from (averaged) gradients."""
from __future__ import annotations

from typing import List, Sequence, Union

import numpy as np

OPTIMIZERS = ("sgd", "adam")


class SGD:
    """Heavy-ball SGD: v = momentum * v + g; p -= lr * v (torch.optim.SGD's convention)."""

    def __init__(self, params: Sequence[np.ndarray], lr: float, momentum: float = 0.9) -> None:
        self.params, self.lr, self.momentum = list(params), lr, momentum
        self.velocity = [np.zeros_like(p) for p in self.params]

    def state_arrays(self) -> List[np.ndarray]:
        """The state a replica joining the run must receive (elastic training heals it with them)."""
        return self.velocity

    def step(self, grads: Sequence[np.ndarray]) -> None:
        """Apply one update."""
        for p, g, v in zip(self.params, grads, self.velocity):
            v *= self.momentum
            v += g
            p -= self.lr * v


class Adam:
    """Adam (Kingma & Ba) with bias correction."""

    def __init__(self, params: Sequence[np.ndarray], lr: float, betas: tuple = (0.9, 0.999),
                 eps: float = 1e-8) -> None:
        self.params, self.lr, self.betas, self.eps = list(params), lr, betas, eps
        self.m = [np.zeros_like(p) for p in self.params]
        self.v = [np.zeros_like(p) for p in self.params]
        self.t = 0

    def state_arrays(self) -> List[np.ndarray]:
        """The moments a replica joining the run must receive (and `t`, the steps taken)."""
        return self.m + self.v

    def step(self, grads: Sequence[np.ndarray]) -> None:
        """Apply one update."""
        self.t += 1
        b1, b2 = self.betas
        scale = float(self.lr * np.sqrt(1 - b2 ** self.t) / (1 - b1 ** self.t))
        for p, g, m, v in zip(self.params, grads, self.m, self.v):
            m *= b1
            m += (1 - b1) * g
            v *= b2
            v += (1 - b2) * g * g
            p -= scale * m / (np.sqrt(v) + self.eps)


Optimizer = Union[SGD, Adam]


def make_optimizer(name: str, params: Sequence[np.ndarray], lr: float) -> Optimizer:
    """The optimizer called `name` ("sgd" or "adam") over `params`."""
    if name == "sgd":
        return SGD(params, lr)
    if name == "adam":
        return Adam(params, lr)
    raise ValueError(f"unknown optimizer {name!r} (choose from {', '.join(OPTIMIZERS)})")


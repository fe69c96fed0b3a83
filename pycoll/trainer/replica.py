"""One rank's copy of the model and its training step: forward, streaming backward, gradient sync, update."""
from __future__ import annotations

import time
from typing import Optional, Tuple

import numpy as np

from ..comm import Communicator
from .buckets import GradBuckets
from .model import Params, backward, forward, loss_and_correct
from .optim import make_optimizer
from .timing import BACKWARD_END, PROBE_LAUNCH, STEP_END, STEP_START, SYNC_END, record_width


class Replica:
    """Parameters, optimizer state and gradient buckets of one data-parallel rank (comm=None: alone)."""

    def __init__(self, params: Params, optimizer: str, lr: float, bucket_bytes: int,
                 comm: Optional[Communicator], straggle_s: float = 0.0) -> None:
        self.params = params
        self.buckets = GradBuckets(params, bucket_bytes, comm)
        self.optimizer = make_optimizer(optimizer, params, lr)
        self.straggle_s = straggle_s

    @property
    def record_width(self) -> int:
        """Columns of the timing record each step returns."""
        return record_width(len(self.buckets.plan))

    def step(self, x: np.ndarray, y: np.ndarray) -> Tuple[float, int, np.ndarray]:
        """Train on this rank's shard (x, y) of a global batch; return summed loss, right answers and
        the step's timing record (see timing.py)."""
        loss, correct, row = self.gradients(x, y)
        self.update(row)
        return loss, correct, row

    def gradients(self, x: np.ndarray, y: np.ndarray, weight: float = 1.0) -> Tuple[float, int, np.ndarray]:
        """The first part of step(): forward, backward and the averaged gradients, nothing updated
        (elastic training applies them only once the survivors agree the step completed everywhere).
        `weight`: model.backward's, for shards of uneven sizes."""
        row = np.empty(self.record_width)
        row[STEP_START] = time.perf_counter()
        if self.straggle_s:
            time.sleep(self.straggle_s)
        logits, inputs = forward(self.params, x)
        loss, correct = loss_and_correct(logits, y)
        self.buckets.begin()
        for i in backward(self.params, logits, inputs, y, self.buckets.grads, weight):
            self.buckets.ready(i)
        row[BACKWARD_END] = time.perf_counter()
        row[PROBE_LAUNCH:] = self.buckets.wait()
        row[SYNC_END] = time.perf_counter()
        return loss, correct, row

    def update(self, row: np.ndarray) -> None:
        """The second part of step(): apply the averaged gradients."""
        self.optimizer.step(self.buckets.grads)
        row[STEP_END] = time.perf_counter()

"""DDP-style gradient buckets: gradients are views of one flat buffer, filled last layer first, and
each bucket is allreduced asynchronously (averaged) the moment its last gradient has been written.

Before the first bucket of a step a barrier is queued on the same communicator (the "wait probe"):
the communicator's worker runs calls in order, so the probe finishes only when the slowest rank has
produced its first bucket, which separates waiting for that rank from moving the bytes.
"""
from __future__ import annotations

import threading
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

from ..comm import Communicator
from ..work import Work


def plan_buckets(nbytes: Sequence[int], cap_bytes: int) -> List[List[int]]:
    """Parameter indices grouped into buckets, last parameter first (the order backward produces them).

    DDP's rule: a bucket closes once it holds at least `cap_bytes`, so one large parameter may exceed it.
    """
    buckets: List[List[int]] = []
    current: List[int] = []
    filled = 0
    for i in reversed(range(len(nbytes))):
        current.append(i)
        filled += nbytes[i]
        if filled >= cap_bytes:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets


class _Timed:
    """A Work plus when it was launched and when the communicator's worker finished it."""

    def __init__(self, work: Work) -> None:
        self.work, self.launched, self.done = work, time.perf_counter(), float("nan")
        self._finished = threading.Event()
        work.get_future().add_done_callback(self._on_done)

    def _on_done(self, _: object) -> None:
        self.done = time.perf_counter()
        self._finished.set()

    def wait(self) -> None:
        """Wait for the collective (re-raising its error) and for its completion time."""
        self.work.wait()
        self._finished.wait()


class GradBuckets:
    """Gradient storage for `params` plus the asynchronous, bucketed averaging of it across `comm`.

    With comm=None (a rank training alone, e.g. the 1-rank baseline) nothing is communicated.
    """

    def __init__(self, params: Sequence[np.ndarray], cap_bytes: int, comm: Optional[Communicator]) -> None:
        self.comm = comm
        self.plan = plan_buckets([p.nbytes for p in params], cap_bytes)
        self.flat = np.zeros(sum(p.size for p in params), params[0].dtype)
        self.grads: List[np.ndarray] = [np.empty(0)] * len(params)
        self.views: List[np.ndarray] = []
        self._bucket_of: Dict[int, int] = {}
        offset = 0
        for k, bucket in enumerate(self.plan):
            start = offset
            for i in bucket:
                self.grads[i] = self.flat[offset:offset + params[i].size].reshape(params[i].shape)
                self._bucket_of[i] = k
                offset += params[i].size
            self.views.append(self.flat[start:offset])
        self._missing: List[int] = []
        self._inflight: List[_Timed] = []
        self._ready_at: List[float] = []  # when each bucket's last gradient was written (this step)

    def begin(self) -> None:
        """Start a step: every bucket waits for all of its gradients again."""
        self._missing = [len(b) for b in self.plan]
        self._inflight = []
        self._ready_at = [float("nan")] * len(self.plan)

    def ready(self, i: int) -> None:
        """Gradient `i` has been written; launch its bucket if that was the bucket's last one."""
        k = self._bucket_of[i]
        self._missing[k] -= 1
        if self._missing[k]:
            return
        self._ready_at[k] = time.perf_counter()
        if self.comm is None:
            return
        if k == 0:
            self._inflight.append(_Timed(self.comm.barrier(async_op=True)))
        self._inflight.append(_Timed(self.comm.allreduce(self.views[k], op="avg", async_op=True)))

    def abandon(self) -> None:
        """A step failed (elastic training): wait for its queued collectives to end, failed or not,
        so none runs after the survivors have agreed and realigned their calls."""
        for t in self._inflight:
            try:
                t.wait()
            except Exception:  # each fails on its own; the step is dropped as a whole
                pass
        self._inflight = []

    def wait(self) -> np.ndarray:
        """Block until every bucket is averaged; return [probe launch, probe done, then per bucket
        launch, done] in perf_counter seconds (without a communicator: each bucket's launch is when it
        became ready, the rest NaN, so a 1-rank run still records when backward produced each bucket)."""
        times = np.full(2 * (len(self.plan) + 1), np.nan)
        if self.comm is None:
            times[2::2] = self._ready_at
        for j, t in enumerate(self._inflight):
            t.wait()
            times[2 * j:2 * j + 2] = t.launched, t.done
        return times

"""A workload record from a torch DDP model trained through pycoll's torch backend: the same JSON as
`python -m pycoll.trainer --report-json FILE`, so `pycoll predict --workload FILE` reads either.

    import pycoll.torch                      # registers the "pycoll" backend
    dist.init_process_group("pycoll")
    ddp = DistributedDataParallel(model)
    rec = Recorder(ddp, optimizer, loss_fn)  # registers a DDP comm hook (DDP's public API)
    for x, y in loader:
        rec.step(x, y)                       # forward, backward, optimizer step, timed
    rec.save("rec.json", global_batch, x_pool, y_pool)   # collective; rank 0 writes

The comm hook is DDP's default one (divide by the world size, allreduce, on pycoll's communicator)
with timestamps: a bucket's launch is when DDP hands it over (its gradients are ready), its end when
its allreduce's future completes. Ahead of the first bucket of a step it queues a barrier, the
trainer's wait probe, so the measured split (compute, exposed comm, waiting for the slowest rank)
has the trainer's definitions (pycoll/trainer/timing.py). Backward ends when DDP hands over its last
bucket; `loss.backward()` returns once every bucket is averaged (DDP waits in its final callback).
The compute profile is rank 0 timing a copy of the model and optimizer alone at local batches
B, B/2, ... (the other ranks wait in a barrier), sliced from `x_pool`/`y_pool`.
"""
from __future__ import annotations

import copy
import json
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from ..comm import Communicator
from ..trainer.timing import (BACKWARD_END, BUCKETS_FROM, PROBE_DONE, PROBE_LAUNCH, STEP_END, STEP_START,
                              SYNC_END, record_width)
from ..trainer.workload import PROFILE_STEPS, from_records, profile_batches, with_prediction
from .workload import ComputePoint, Workload

WARMUP_STEPS = 1  # dropped: DDP rebuilds its buckets after the first step, and caches are cold


def communicator(group: Optional[Any] = None) -> Communicator:
    """The pycoll Communicator under a torch process group of backend "pycoll" (default: the world)."""
    pg = group if group is not None else dist.group.WORLD
    comm = getattr(pg, "comm", None)
    if not isinstance(comm, Communicator):
        raise ValueError(f"Recorder: process group {pg!r} is not on the \"pycoll\" backend "
                         f"(dist.init_process_group(\"pycoll\") after `import pycoll.torch`)")
    return comm


class Recorder:
    """Times a DDP model's training steps through a comm hook and writes them as a workload record."""

    def __init__(self, ddp: torch.nn.parallel.DistributedDataParallel, optimizer: torch.optim.Optimizer,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], group: Optional[Any] = None) -> None:
        self.ddp, self.optimizer, self.loss_fn = ddp, optimizer, loss_fn
        self.group = group
        self.comm = communicator(group)
        self.size = self.comm.size
        self.steps: List[Tuple[np.ndarray, List[int]]] = []  # (record row, bucket bytes in launch order)
        self._launch: List[Tuple[float, int]] = []           # this step's buckets: (launch time, bytes)
        self._done: Dict[int, float] = {}
        self._probe: List[float] = [np.nan, np.nan]
        ddp.register_comm_hook(self, _timed_allreduce)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One training step (forward, loss, backward, optimizer step, zero_grad), recorded; the loss."""
        self._launch, self._done, self._probe = [], {}, [np.nan, np.nan]
        start = time.perf_counter()
        loss = self.loss_fn(self.ddp(x), y)
        loss.backward()
        synced = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad()
        end = time.perf_counter()
        if self._launch:  # no buckets: a no_sync step, nothing to record
            row = np.full(record_width(len(self._launch)), np.nan)
            row[[STEP_START, BACKWARD_END, SYNC_END, STEP_END]] = start, self._launch[-1][0], synced, end
            row[[PROBE_LAUNCH, PROBE_DONE]] = self._probe
            for k, (t, _) in enumerate(self._launch):
                row[BUCKETS_FROM + 2 * k] = t
                row[BUCKETS_FROM + 2 * k + 1] = self._done.get(k, np.nan)
            self.steps.append((row, [n for _, n in self._launch]))
        return float(loss.detach())

    def _launched(self, nbytes: int) -> int:
        """Note a bucket handed over now (the first of a step queues the wait probe); its index."""
        now = time.perf_counter()
        if not self._launch:
            probe = self._probe
            probe[0] = now
            self.comm.barrier(async_op=True).get_future().add_done_callback(
                lambda _: probe.__setitem__(1, time.perf_counter()))
        self._launch.append((now, nbytes))
        return len(self._launch) - 1

    def workload(self, global_batch: int, x_pool: torch.Tensor, y_pool: torch.Tensor) -> Optional[Workload]:
        """Collective: profile the compute on rank 0, gather every rank's step records; rank 0 gets
        the Workload, the others None. `global_batch`: samples per step over all ranks."""
        profile = self._profile(global_batch, x_pool, y_pool)
        rows, buckets = self._rows()
        counts = np.zeros(self.size, np.int64)
        self.comm.allgather(np.array([rows.shape[0]], np.int64), out=counts)
        if len(set(counts.tolist())) != 1 or rows.shape[0] == 0:
            raise ValueError(f"Recorder rank {self.comm.rank}: ranks recorded {counts.tolist()} steps with the "
                             f"final bucket layout after {WARMUP_STEPS} warm-up step(s); expected the same "
                             f"number, at least one (call step() more often)")
        every = np.zeros((self.size,) + rows.shape)
        self.comm.allgather(rows, out=every)
        if self.comm.rank != 0:
            return None
        return from_records(self.comm, every, buckets, global_batch, profile, "pycoll.torch",
                            {"torch": {"version": torch.__version__, "model": type(self.ddp.module).__name__,
                                       "optimizer": type(self.optimizer).__name__,
                                       "threads": torch.get_num_threads()}})

    def save(self, path: str, global_batch: int, x_pool: torch.Tensor, y_pool: torch.Tensor) -> Optional[Dict[str, Any]]:
        """Collective: workload(), then rank 0 writes it to `path` with the model's prediction of this
        run under "prediction" (as the trainer's --report-json does) and returns it; None elsewhere."""
        w = self.workload(global_batch, x_pool, y_pool)
        if w is None:
            return None
        out = with_prediction(w)
        with open(path, "w") as fh:
            json.dump(out, fh, indent=1)
            fh.write("\n")
        return out

    def _rows(self) -> Tuple[np.ndarray, List[int]]:
        """The recorded steps after the warm-up that have the last step's buckets, and those buckets."""
        if not self.steps:
            return np.zeros((0, BUCKETS_FROM)), []
        last = self.steps[-1][1]
        keep = [row for row, b in self.steps[WARMUP_STEPS:] if b == last]
        return (np.stack(keep) if keep else np.zeros((0, record_width(len(last))))), last

    def _profile(self, global_batch: int, x_pool: torch.Tensor, y_pool: torch.Tensor) -> List[ComputePoint]:
        """Forward+backward and optimizer ms per local batch size, on rank 0 alone (a copy of the
        model and optimizer, no communication); every rank returns the same list."""
        batches = profile_batches(global_batch, self.size)
        table = np.zeros((len(batches), 2))
        if self.comm.rank == 0:
            model = copy.deepcopy(self.ddp.module)
            opt = type(self.optimizer)(model.parameters(), **self.optimizer.defaults)
            for i, b in enumerate(batches):
                pick = torch.arange(b) % len(x_pool)
                x, y = x_pool[pick], y_pool[pick]
                timed = []
                for _ in range(PROFILE_STEPS + 1):
                    t0 = time.perf_counter()
                    self.loss_fn(model(x), y).backward()
                    t1 = time.perf_counter()
                    opt.step()
                    opt.zero_grad()
                    timed.append((t1 - t0, time.perf_counter() - t1))
                table[i] = np.median(np.array(timed[1:]), axis=0) * 1e3
        self.comm.barrier()
        self.comm.broadcast(table, root=0)
        return [ComputePoint(float(b), float(f), float(o)) for b, (f, o) in zip(batches, table)]


def _timed_allreduce(rec: Recorder, bucket: "dist.GradBucket") -> "torch.futures.Future[torch.Tensor]":
    """DDP's default comm hook (average the bucket over the ranks), timestamped for the Recorder."""
    buf = bucket.buffer()
    k = rec._launched(buf.numel() * buf.element_size())
    ends = rec._done
    buf.div_(rec.size)
    fut = dist.all_reduce(buf, group=rec.group, async_op=True).get_future()

    def done(f: "torch.futures.Future[Any]") -> torch.Tensor:
        ends[k] = time.perf_counter()
        return f.value()[0]
    return fut.then(done)


# DDP checks a hook's annotations as objects (this module's are strings: `from __future__ import annotations`)
_timed_allreduce.__annotations__.update(bucket=dist.GradBucket, **{"return": torch.futures.Future[torch.Tensor]})

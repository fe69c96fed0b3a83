"""`--report-json FILE`: the run as a workload record for `pycoll predict` (pycoll/predict/workload.py),
with the measured step, its split, and the model's own prediction of this very run beside it.

What the record needs beyond the step records every run keeps: a compute profile, i.e. forward+backward
and the optimizer timed on rank 0 alone (a copy of the model, no communication, the other ranks
waiting in a barrier) at local batches B, B/2, B/4, ... (down to B/32 or 1 sample), so that a
prediction for more ranks knows how long their smaller share of the batch takes.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

import numpy as np

from ..comm import Communicator
from ..predict.model import predict, recorded_target
from ..predict.workload import Bucket, ComputePoint, Workload, median
from ..tuner import DEFAULT
from .data import global_batches, load_digits
from .replica import Replica
from .schema import TrainConfig, TrainResult
from .timing import BACKWARD_END, BUCKETS_FROM, STEP_END, STEP_START, SYNC_END, breakdown

PROFILE_STEPS = 7      # timed steps per local batch size (after one warm-up step); their median counts
PROFILE_SPAN = 32      # smallest profiled batch: B / PROFILE_SPAN


def profile_batches(global_batch: int, ranks: int) -> List[int]:
    """Local batch sizes to profile: B, B/2, B/4, ... down to B/PROFILE_SPAN (at least 1), and B/ranks."""
    sizes = {global_batch // ranks}
    b = global_batch
    while b >= max(1, global_batch // PROFILE_SPAN):
        sizes.add(b)
        b //= 2
    return sorted(s for s in sizes if s >= 1)


def compute_profile(comm: Communicator, cfg: TrainConfig, params: List[np.ndarray]) -> List[ComputePoint]:
    """Rank 0 alone times forward+backward and the optimizer per local batch size (the other ranks
    wait in a barrier); every rank returns the same list (broadcast from rank 0)."""
    batches = profile_batches(cfg.batch_size, comm.size)
    table = np.zeros((len(batches), 2))
    if comm.rank == 0:
        from threadpoolctl import threadpool_limits  # installed with scikit-learn
        with threadpool_limits(cfg.blas_threads, user_api="blas"):
            table[:] = _profile(cfg, params, batches)
    comm.broadcast(table, root=0)
    return [ComputePoint(float(b), float(f), float(o)) for b, (f, o) in zip(batches, table)]


def _profile(cfg: TrainConfig, params: List[np.ndarray], batches: List[int]) -> np.ndarray:
    """compute_profile's timing on rank 0: (forward+backward ms, optimizer ms) per batch size."""
    table = np.zeros((len(batches), 2))
    data = load_digits(np.dtype(cfg.dtype))
    alone = Replica([p.copy() for p in params], cfg.optimizer, cfg.lr, int(cfg.bucket_kb * 1024), None)
    order = next(global_batches(len(data.y_train), len(data.y_train), 0, cfg.seed))
    for i, b in enumerate(batches):
        rows = []
        for _ in range(PROFILE_STEPS + 1):
            pick = order[:b]
            rows.append(alone.step(data.x_train[pick], data.y_train[pick])[2])
            order = np.roll(order, -b)
        timed = np.array(rows[1:])
        table[i] = (np.median(timed[:, BACKWARD_END] - timed[:, STEP_START]) * 1e3,
                    np.median(timed[:, STEP_END] - timed[:, SYNC_END]) * 1e3)
    return table


def _bucket_bytes(result: TrainResult) -> List[int]:
    return [sum(result.params[i].nbytes for i in bucket) for bucket in result.plan]


def build(comm: Communicator, cfg: TrainConfig, result: TrainResult, profile: List[ComputePoint]) -> Workload:
    """The workload record of a finished run (rank 0: it holds every rank's step records)."""
    assert result.records is not None
    rec = result.records[:, 1:] if result.records.shape[1] > 1 else result.records  # the first step warms up
    return from_records(comm, rec, _bucket_bytes(result), cfg.batch_size, profile, "pycoll.trainer",
                        {"trainer": {"hidden": list(cfg.hidden), "bucket_kb": cfg.bucket_kb, "dtype": cfg.dtype,
                                     "optimizer": cfg.optimizer, "epochs": cfg.epochs}})


def from_records(comm: Communicator, rec: np.ndarray, bucket_bytes: List[int], global_batch: int,
                 profile: List[ComputePoint], source: str, extra: Dict[str, Any]) -> Workload:
    """A workload record from every rank's step records `rec` (ranks, steps, pycoll.trainer.timing's
    columns; warm-up steps already dropped) of a run whose buckets, in launch order, hold
    `bucket_bytes`: the trainer's, or a torch DDP model's (pycoll/predict/torch_record.py)."""
    fwd = rec[:, :, BACKWARD_END] - rec[:, :, STEP_START]
    opt = rec[:, :, STEP_END] - rec[:, :, SYNC_END]
    nb = len(bucket_bytes)
    launch = rec[:, :, BUCKETS_FROM:BUCKETS_FROM + 2 * nb:2] - rec[:, :, STEP_START:STEP_START + 1]
    ready = [median((launch[:, :, k] / fwd).ravel().tolist()) for k in range(nb)]
    rel = np.concatenate([(f / np.median(f) - 1.0) for f in fwd])
    jitter = float(1.4826 * np.median(np.abs(rel - np.median(rel))))
    per_rank = [breakdown(rows) for rows in rec]
    splits = {name: median([float(np.median(getattr(b, name))) * 1e3 for b in per_rank])
              for name in ("compute", "comm", "wait", "comm_total")}
    topo = comm.topology
    tuner = comm.selector.tuner
    machines = [topo.ranks[m[0]].hostname for m in topo.members]
    racks = [topo.racks[k] if k >= 0 else "" for k in topo.rack_of] if topo.racks else []
    step_ms = median((rec[:, :, STEP_END] - rec[:, :, STEP_START]).ravel() * 1e3)
    return Workload(
        source=source, global_batch=global_batch, ranks=comm.size, host_of=list(topo.host_of),
        cores=list(topo.cores), machines=machines, racks=racks,
        uplink_gbit=dict(zip(topo.racks, topo.uplink_gbit)),
        buckets=[Bucket(n, r if math.isfinite(r) else 1.0) for n, r in zip(bucket_bytes, ready)],
        compute=ComputePoint(global_batch / comm.size, median((fwd * 1e3).ravel().tolist()),
                             median((opt * 1e3).ravel().tolist())),
        jitter_frac=jitter, profile=profile,
        params=tuner.params if tuner is not None else DEFAULT,
        board_bytes=tuner.board_bytes if tuner is not None else 0,
        stage_bytes=tuner.stage_bytes if tuner is not None else 0,
        step_ms=step_ms,
        measured={"step_ms": step_ms, "compute_ms": splits["compute"], "comm_ms": splits["comm"],
                  "wait_ms": splits["wait"], "comm_total_ms": splits["comm_total"], "steps": int(rec.shape[1]),
                  "per_rank_fwd_bwd_ms": [median(f * 1e3) for f in fwd]},
        extra=extra)


def with_prediction(w: Workload) -> Dict[str, Any]:
    """The record's JSON form with the model's prediction of this very run under "prediction"
    (the tuner's parameters, nothing fitted)."""
    out = w.to_dict()
    out["prediction"] = predict(w, recorded_target(w), fit=False).to_dict()
    return out


def record(comm: Communicator, cfg: TrainConfig, result: TrainResult) -> Optional[Dict[str, Any]]:
    """Profile (collective: every rank calls it), then on rank 0 the record with the model's
    prediction of this run under "prediction"; None on the other ranks."""
    profile = compute_profile(comm, cfg, result.params)
    if comm.rank != 0:
        return None
    return with_prediction(build(comm, cfg, result, profile))


def prediction_line(rec: Dict[str, Any]) -> str:
    """The report's line: the model's step for this run next to the measured one."""
    p, m = rec["prediction"], rec["measured"]
    err = (p["step_ms"] - m["step_ms"]) / m["step_ms"]
    return (f"predicted step {p['step_ms']:.2f} ms [{p['low_ms']:.2f}, {p['high_ms']:.2f}] = compute "
            f"{p['compute_ms']:.2f} + comm {p['comm_ms']:.2f} + wait {p['wait_ms']:.2f} (the tuner's parameters, nothing fitted) vs "
            f"measured {m['step_ms']:.2f} ms = compute {m['compute_ms']:.2f} + comm {m['comm_ms']:.2f} + wait "
            f"{m['wait_ms']:.2f} (median): error {err:+.0%}")

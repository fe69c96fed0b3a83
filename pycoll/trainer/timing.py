"""Per-step timing records and their split into compute, communication and waiting for the slowest rank.

A step's record holds perf_counter times (seconds) in the columns below, then two per bucket:

* compute = forward + backward (+ any --straggler sleep) + optimizer step, on the training thread;
* blocked = end of backward until every bucket is averaged (the training thread can do nothing);
* wait    = the part of `blocked` before the wait probe (a barrier queued ahead of bucket 0) finished:
            time this rank sat idle until the slowest rank had produced its first bucket;
* comm    = blocked - wait: communication that backward could not hide;
* comm_total = time the communicator's worker spent on the buckets, hidden or not. The worker runs
            calls in order, so bucket k starts when it is launched or when bucket k-1 (the probe, for
            k=0) is done, whichever is later, and ends when its Work completes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

STEP_START, BACKWARD_END, SYNC_END, STEP_END, PROBE_LAUNCH, PROBE_DONE = range(6)
BUCKETS_FROM = 6  # bucket k: launch at BUCKETS_FROM + 2k, done at BUCKETS_FROM + 2k + 1


def record_width(buckets: int) -> int:
    """Number of columns of a step record for a model with `buckets` gradient buckets."""
    return BUCKETS_FROM + 2 * buckets


def bucket_spans(rows: np.ndarray) -> np.ndarray:
    """(steps, buckets, 2) start and end of each bucket's allreduce on the communicator's worker."""
    launch, done = rows[:, BUCKETS_FROM::2], rows[:, BUCKETS_FROM + 1::2]
    previous = np.concatenate([rows[:, PROBE_DONE:PROBE_DONE + 1], done[:, :-1]], axis=1)
    return np.stack([np.maximum(launch, previous), done], axis=2)


@dataclass(frozen=True)
class Breakdown:
    """Seconds per step (arrays over steps) spent in each category."""
    step: np.ndarray
    compute: np.ndarray
    wait: np.ndarray
    comm: np.ndarray
    comm_total: np.ndarray


def breakdown(rows: np.ndarray) -> Breakdown:
    """Split each step record of `rows` (steps, columns) into compute / wait / exposed comm."""
    blocked = rows[:, SYNC_END] - rows[:, BACKWARD_END]
    wait = np.clip(np.nan_to_num(rows[:, PROBE_DONE] - rows[:, BACKWARD_END]), 0, blocked)
    spans = bucket_spans(rows)
    return Breakdown(step=rows[:, STEP_END] - rows[:, STEP_START],
                     compute=rows[:, STEP_END] - rows[:, STEP_START] - blocked,
                     wait=wait, comm=blocked - wait,
                     comm_total=np.nan_to_num(spans[:, :, 1] - spans[:, :, 0]).sum(axis=1))


def throughput(rows_per_rank: np.ndarray, global_batch: int) -> float:
    """Samples per second of training steps: the slowest rank's total step time sets the pace."""
    # (NaN rows: steps an elastic newcomer was not there for)
    busy = np.nansum(rows_per_rank[:, :, STEP_END] - rows_per_rank[:, :, STEP_START], axis=1).max()
    return rows_per_rank.shape[1] * global_batch / busy


def scaling_efficiency(samples_per_s: float, ranks: int, baseline_samples_per_s: float) -> float:
    """Strong-scaling efficiency: measured throughput over `ranks` times the 1-rank throughput."""
    return samples_per_s / (ranks * baseline_samples_per_s)

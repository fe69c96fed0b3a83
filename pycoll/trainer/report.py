"""What rank 0 prints: a line every few steps and per epoch, the final summary, a progress bar on a terminal."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import List

import numpy as np

from .schema import Metrics, TrainConfig, TrainResult
from .timing import STEP_START, breakdown, scaling_efficiency

BAR_WIDTH = 30


@dataclass(frozen=True)
class Window:
    """Loss and accuracy over some training steps of all ranks, and one step's mean time split (ms)."""
    loss: float
    accuracy: float
    step_ms: float
    compute_ms: float
    wait_ms: float
    comm_ms: float
    comm_total_ms: float


def _hidden(comm_ms: float, comm_total_ms: float) -> float:
    """Fraction of the communication that ran while backward was still computing."""
    return max(0.0, comm_total_ms - comm_ms) / comm_total_ms if comm_total_ms > 0 else 0.0


def _split(w: Window) -> str:
    return (f"step {w.step_ms:.2f} ms = compute {w.compute_ms:.2f} + comm {w.comm_ms:.2f} + wait "
            f"{w.wait_ms:.2f} (comm total {w.comm_total_ms:.2f}, {_hidden(w.comm_ms, w.comm_total_ms):.0%} "
            f"hidden)")


def header_line(cfg: TrainConfig, ranks: int, n_train: int, n_test: int, sizes: List[int]) -> str:
    """What is being trained, on how many ranks."""
    return (f"pycoll.trainer: {ranks} rank(s), digits {n_train} train / {n_test} test, MLP "
            f"{'-'.join(map(str, sizes))} ({cfg.dtype}), {cfg.optimizer} lr {cfg.lr:g}, global batch "
            f"{cfg.batch_size} ({cfg.batch_size // ranks} per rank), {cfg.epochs} epoch(s)")


def step_line(epoch: int, epochs: int, step: int, total: int, w: Window) -> str:
    """The line printed every --log-every steps (loss and accuracy over those steps)."""
    return f"epoch {epoch + 1}/{epochs} step {step}/{total}: loss {w.loss:.4f} acc {w.accuracy:.1%} | {_split(w)}"


def epoch_line(epoch: int, epochs: int, w: Window, test: Metrics) -> str:
    """The line printed after each epoch: running train metrics, held-out test metrics, time split."""
    return (f"epoch {epoch + 1}/{epochs} done: train loss {w.loss:.4f} acc {w.accuracy:.1%} | "
            f"test loss {test.loss:.4f} acc {test.accuracy:.1%} | {_split(w)}")


def summary_lines(result: TrainResult, cfg: TrainConfig) -> List[str]:
    """Final metrics, each rank's mean time split per step, throughput and scaling efficiency (rank 0)."""
    assert result.records is not None and result.samples_per_s is not None and result.baseline_sps is not None
    ranks = len(result.records)
    lines = [f"final: train loss {result.train.loss:.4f} acc {result.train.accuracy:.1%} | "
             f"test loss {result.test.loss:.4f} acc {result.test.accuracy:.1%}",
             f"gradient buckets (--bucket-kb {cfg.bucket_kb:g}, parameters last first): "
             + " ".join(str(b) for b in result.plan),
             "time per step (ms)  compute     comm     wait |  step  comm total  hidden"]
    for r, rows in enumerate(result.records):
        b = breakdown(rows[~np.isnan(rows[:, STEP_START])])  # (an elastic newcomer has no rows before it joined)
        comm, total = 1000 * b.comm.mean(), 1000 * b.comm_total.mean()
        lines.append(f"  rank {r:<12} {1000 * b.compute.mean():8.2f} {comm:8.2f} {1000 * b.wait.mean():8.2f} | "
                     f"{1000 * b.step.mean():5.2f} {total:11.2f} {_hidden(comm, total):6.0%}")
    lines.append(f"throughput {result.samples_per_s:.0f} samples/s on {ranks} rank(s) "
                 f"(global batch {cfg.batch_size}, {result.records.shape[1]} steps)")
    lines.append(_scaling_line(result.samples_per_s, ranks, result.baseline_sps, cfg))
    lines.append(f"replicas bit-identical across {ranks} rank(s): {'yes' if result.replicas_identical else 'NO'}")
    lines += [f"elastic: {event}" for event in result.events]
    return lines


def _scaling_line(sps: float, ranks: int, baseline: float, cfg: TrainConfig) -> str:
    if cfg.baseline_sps is not None:
        source = "passed in with --baseline-sps"
    elif ranks == 1:
        source = "this run itself"
    else:
        source = "measured on rank 0 alone in this run, no communication"
    return (f"scaling efficiency {scaling_efficiency(sps, ranks, baseline):.1%} = {sps:.0f} / "
            f"({ranks} x {baseline:.0f} samples/s 1-rank baseline, {source})")


class Console:
    """Rank 0's output: whole lines on stdout, plus a \\r progress bar while stderr is a terminal."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._bar = enabled and sys.stderr.isatty()
        self._drawn = False

    def line(self, text: str) -> None:
        """Print one line (clearing the progress bar first)."""
        if not self.enabled:
            return
        self._clear()
        print(text, flush=True)

    def progress(self, step: int, total: int) -> None:
        """Redraw the bar at step/total."""
        if not self._bar:
            return
        filled = BAR_WIDTH * step // total
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {step}/{total} steps")
        sys.stderr.flush()
        self._drawn = True

    def done(self) -> None:
        """Remove the bar at the end of training."""
        self._clear()

    def _clear(self) -> None:
        if self._drawn:
            sys.stderr.write("\r" + " " * (BAR_WIDTH + 24) + "\r")
            sys.stderr.flush()
            self._drawn = False

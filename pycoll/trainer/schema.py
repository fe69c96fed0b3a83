"""The trainer's records: what a run is asked to do (TrainConfig) and what it gives back
(TrainResult, with its Metrics), apart from the code that runs and reports it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

import numpy as np

from .model import Params


@dataclass(frozen=True)
class TrainConfig:
    """What defines a run (the CLI's options); batch_size is global and split evenly across ranks."""
    epochs: int = 5
    batch_size: int = 64
    lr: float = 0.05
    optimizer: str = "sgd"
    hidden: Tuple[int, ...] = (128, 64)
    bucket_kb: float = 16.0
    seed: int = 0
    log_every: int = 10
    dtype: str = "float32"
    straggler: Optional[Tuple[int, float]] = None  # (rank, milliseconds it sleeps every step)
    baseline_sps: Optional[float] = None  # 1-rank samples/s; None: measure it in this run
    blas_threads: int = 1  # per rank, like torchrun's OMP_NUM_THREADS=1: ranks share the cores
    elastic: bool = False  # a dead rank costs its step: survivors shrink and go on (elastic.py)


@dataclass(frozen=True)
class Metrics:
    """Mean loss and accuracy (0..1) over a data set."""
    loss: float
    accuracy: float


@dataclass
class TrainResult:
    """Final parameters and metrics; the gathered timings and throughput are filled in on rank 0 only."""
    params: Params
    train: Metrics
    test: Metrics
    plan: List[List[int]]
    replicas_identical: bool
    records: Optional[np.ndarray] = None  # (ranks, steps, columns), seconds since the common start
    samples_per_s: Optional[float] = None
    baseline_sps: Optional[float] = None
    events: List[Any] = field(default_factory=list)  # elastic.Event: ranks lost, when, and the recovery
    comm: Any = None  # the communicator the run ended on (elastic: the survivors')

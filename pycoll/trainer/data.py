"""The digits data set (scikit-learn's bundled copy, offline) and how a global batch is split across ranks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

TEST_FRACTION = 0.2
SPLIT_SEED = 0  # the train/test split never changes with --seed, so runs stay comparable


@dataclass(frozen=True)
class Digits:
    """8x8 digit images scaled to [0, 1] (64 features) with labels 0..9, split into train and test."""
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    @property
    def features(self) -> int:
        """Input width of the model."""
        return self.x_train.shape[1]

    @property
    def classes(self) -> int:
        """Number of labels."""
        return int(max(self.y_train.max(), self.y_test.max())) + 1


def load_digits(dtype: np.dtype = np.float32) -> Digits:
    """Load scikit-learn's digits and split off a fixed random 20% as the held-out test set."""
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ImportError:
        raise ImportError("pycoll.trainer needs scikit-learn for its data set: "
                          "pip install 'pycoll[trainer]' (or scikit-learn)") from None
    raw = sk_load_digits()
    x = (raw.data / 16.0).astype(dtype)
    y = raw.target.astype(np.int64)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(y))
    n_test = int(round(len(y) * TEST_FRACTION))
    test, train = order[:n_test], order[n_test:]
    return Digits(x[train], y[train], x[test], y[test])


def global_batches(n: int, batch: int, epoch: int, seed: int) -> Iterator[np.ndarray]:
    """Sample indices of each global batch of one epoch: a seeded shuffle every rank draws alike.

    The last incomplete batch is dropped so that every step has exactly `batch` samples.
    """
    order = np.random.default_rng([seed, epoch]).permutation(n)
    for start in range(0, n - batch + 1, batch):
        yield order[start:start + batch]


def shard(indices: np.ndarray, rank: int, size: int) -> np.ndarray:
    """This rank's contiguous share of a global batch (which must divide evenly)."""
    if len(indices) % size:
        raise ValueError(f"global batch {len(indices)} is not divisible by {size} ranks")
    per = len(indices) // size
    return indices[rank * per:(rank + 1) * per]


def steps_per_epoch(n: int, batch: int) -> int:
    """How many full global batches one epoch holds."""
    return n // batch


def eval_shard(n: int, rank: int, size: int) -> slice:
    """This rank's part of an evaluation pass over n samples (parts may differ by one)."""
    bounds = np.linspace(0, n, size + 1).astype(int)
    return slice(int(bounds[rank]), int(bounds[rank + 1]))

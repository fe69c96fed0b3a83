"""Data-parallel training of a small numpy MLP on scikit-learn's digits, over pycoll.

Each rank trains on its shard of every global batch; gradients go into DDP-style buckets that are
averaged with asynchronous allreduces while backward continues (see README.md in this folder).
"""
from .loop import ConfigError, evaluate, train
from .model import init_params, layer_sizes
from .schema import TrainConfig, TrainResult

__all__ = ["ConfigError", "TrainConfig", "TrainResult", "evaluate", "init_params", "layer_sizes", "train"]

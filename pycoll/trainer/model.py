"""A numpy multi-layer perceptron (ReLU hidden layers, softmax cross-entropy) with a streaming backward."""
from __future__ import annotations

from typing import Iterator, List, Sequence, Tuple

import numpy as np

Params = List[np.ndarray]  # [W1, b1, W2, b2, ...], W of shape (fan_in, fan_out): parameters() order


def layer_sizes(features: int, hidden: Sequence[int], classes: int) -> List[int]:
    """Widths from input to output, e.g. [64, 128, 64, 10]."""
    return [features, *hidden, classes]


def init_params(sizes: Sequence[int], seed: int, dtype: np.dtype = np.float32) -> Params:
    """He-initialised weights and zero biases for the layers between consecutive `sizes`."""
    rng = np.random.default_rng(seed)
    params: Params = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        params.append((rng.standard_normal((fan_in, fan_out)) * np.sqrt(2.0 / fan_in)).astype(dtype))
        params.append(np.zeros(fan_out, dtype))
    return params


def forward(params: Params, x: np.ndarray) -> Tuple[np.ndarray, List[np.ndarray]]:
    """Logits for `x`, plus every layer's input (what backward needs)."""
    inputs = [x]
    h = x
    for i in range(0, len(params), 2):
        z = h @ params[i] + params[i + 1]
        h = np.maximum(z, 0) if i + 2 < len(params) else z
        inputs.append(h)
    return inputs.pop(), inputs


def loss_and_correct(logits: np.ndarray, y: np.ndarray) -> Tuple[float, int]:
    """Summed cross-entropy and number of right answers (sums, so ranks can add them up)."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_p = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return float(-log_p[np.arange(len(y)), y].sum()), int((logits.argmax(axis=1) == y).sum())


def backward(params: Params, logits: np.ndarray, inputs: List[np.ndarray], y: np.ndarray,
             grads: Params, weight: float = 1.0) -> Iterator[int]:
    """Write d(mean loss)/d(param) into `grads` (times `weight`), last layer first, yielding each index
    as it is ready.

    Yielding lets the caller start communicating a layer's gradients while earlier layers are
    still being differentiated, the way DDP's autograd hooks do. `weight`: this shard's share of the
    global batch times the ranks, so that averaging uneven shards' gradients gives the global batch's.
    """
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(y)), y] -= 1.0
    delta = p / len(y) if weight == 1.0 else p * (weight / len(y))
    for i in range(len(params) - 2, -1, -2):
        np.sum(delta, axis=0, out=grads[i + 1])
        yield i + 1
        np.matmul(inputs[i // 2].T, delta, out=grads[i])
        yield i
        if i:
            delta = (delta @ params[i].T) * (inputs[i // 2] > 0)

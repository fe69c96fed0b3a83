"""Dissemination barrier: ceil(log2 n) rounds, in round k rank r signals r+2^k and hears from r-2^k."""
from __future__ import annotations

import numpy as np

from ..channel import Channel


def barrier(ch: Channel) -> None:
    """Return only after every rank of the channel has entered the barrier."""
    n, r = ch.size, ch.rank
    token, got = np.zeros(1, np.uint8), np.empty(1, np.uint8)
    dist, step = 1, 0
    while dist < n:
        ch.sendrecv(token, (r + dist) % n, got, (r - dist) % n, tag=step)
        dist, step = dist * 2, step + 1

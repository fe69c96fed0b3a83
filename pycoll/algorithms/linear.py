"""Linear gather(v)/scatter(v): the root posts all n-1 transfers at once (1 step, (n-1)/n * S bytes
through the root's link); block i holds counts[i] elements, packed in rank order."""
from __future__ import annotations

from itertools import accumulate
from typing import List, Optional, Sequence

import numpy as np

from ..channel import Channel


def _blocks(buf: np.ndarray, counts: Sequence[int]) -> List[np.ndarray]:
    """Consecutive views of `buf`, block i with counts[i] elements."""
    return [buf[end - c: end] for end, c in zip(accumulate(counts), counts)]


def gather(ch: Channel, send: np.ndarray, recv: Optional[np.ndarray], root: int,
           counts: Optional[Sequence[int]] = None) -> None:
    """Rank i's `send` lands in block i of `recv` at `root` (counts[i] elements, default send.size)."""
    n, r = ch.size, ch.rank
    if r != root:
        if send.size:
            ch.wait(ch.isend(send, root, tag=0))
        return
    blocks = _blocks(recv, [send.size] * n if counts is None else counts)
    reqs = [ch.irecv(block, i, tag=0) for i, block in enumerate(blocks) if i != root and block.size]
    np.copyto(blocks[root], send)
    ch.wait(*reqs)


def scatter(ch: Channel, send: Optional[np.ndarray], recv: np.ndarray, root: int,
            counts: Optional[Sequence[int]] = None) -> None:
    """Block i of `send` at `root` (counts[i] elements, default recv.size) lands in rank i's `recv`."""
    n, r = ch.size, ch.rank
    if r != root:
        if recv.size:
            ch.wait(ch.irecv(recv, root, tag=0))
        return
    blocks = _blocks(send, [recv.size] * n if counts is None else counts)
    reqs = [ch.isend(block, i, tag=0) for i, block in enumerate(blocks) if i != root and block.size]
    np.copyto(recv, blocks[root])
    ch.wait(*reqs)

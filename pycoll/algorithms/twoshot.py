"""Two-shot allreduce on a shared-memory board's stage (the two-shot of NCCL and TensorRT-LLM, the
segmented reduce of Open MPI's coll/sm): block by block, every rank copies its block into its stage
slot, reduces its 1/n share of the block straight out of everyone's slots, signals with an empty
post, and copies everyone's reduced shares out. A reduce-scatter and an allgather with one copy in
and one copy out, and two synchronisations per block instead of 2 lg n message rounds.

Only where the transport has a stage for the communicator (all ranks on one host over shm);
elsewhere halving-doubling runs instead, the same decision on every rank.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..channel import Channel
from ..ops import ReduceOp, ufunc
from . import halving_doubling
from .board_signature import TWOSHOT_POSTED, TWOSHOT_REDUCED, board_signature
from .ring import chunk_bounds

_COUNT_BITS = 36  # a block's two posts also carry the call's element count (mod 2**36) in their signature


def allreduce(ch: Channel, buf: np.ndarray, op: ReduceOp, src: Optional[np.ndarray] = None) -> None:
    """buf = op over every rank's `src` (or `buf` in place). Each share of a block is reduced by
    one rank (its own input first, then the others' in rank order) and copied by all: the same bits
    on every rank."""
    flat = buf.reshape(-1)
    source = flat if src is None else src.reshape(-1)
    per_block = ch.stage_bytes() // flat.itemsize
    if per_block < ch.size:
        halving_doubling.allreduce(ch, flat, op, None if src is None else source)
        return
    fn, me = ufunc(op, flat.dtype), ch.rank
    # ranks with different counts fail at the first block, even where its size is the same
    count = (flat.size & ((1 << _COUNT_BITS) - 1)) << 8
    posted = board_signature(TWOSHOT_POSTED, op) | count
    reduced = board_signature(TWOSHOT_REDUCED, op) | count
    done = np.empty(0, flat.dtype)
    for lo in range(0, flat.size, per_block):
        hi = min(flat.size, lo + per_block)
        slots = ch.board_exchange(source[lo:hi], posted, stage=True)
        assert slots is not None  # the stage holds per_block elements on every rank
        shares = chunk_bounds(hi - lo, ch.size)
        a, b = shares[me]
        mine = slots[me][a:b]
        for peer, theirs in enumerate(slots):
            if peer != me:
                fn(mine, theirs[a:b], out=mine)
        ch.board_exchange(done, reduced)  # every share is reduced; slots stay valid until after the next post
        for peer, (a, b) in enumerate(shares):
            flat[lo + a:lo + b] = slots[peer][a:b]


allreduce.accepts_src = True  # type: ignore[attr-defined]

"""Two-shot allreduce on a shared-memory board's stage (the two-shot of NCCL and TensorRT-LLM, the
segmented reduce of Open MPI's coll/sm): block by block, every rank copies its block into its stage
slot, reduces its 1/n share of the block straight out of everyone's slots, and, once everyone has
posted the next block (or an empty post after the last), copies everyone's reduced shares out. A
reduce-scatter and an allgather with one copy in and one copy out, and one synchronisation per block
(plus one) instead of 2 lg n message rounds.

Only where the transport has a stage for the communicator (all ranks on one host over shm);
elsewhere halving-doubling runs instead, the same decision on every rank.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

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
    on every rank. The post of block i + 1 also says "my share of block i is reduced" (a rank posts
    only after reducing), so a call of k blocks synchronises k + 1 times, not 2k: with ranks
    sharing cores, each synchronisation costs context switches."""
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
    pending = None  # (lo, shares, slots) of the block reduced but not yet copied out
    for lo in range(0, flat.size, per_block):
        hi = min(flat.size, lo + per_block)
        # the slots of the block before stay valid: peers overwrite them only after this rank's next post
        slots = ch.board_exchange(source[lo:hi], posted, stage=True)
        assert slots is not None  # the stage holds per_block elements on every rank
        if pending is not None:
            _copy_out(flat, *pending)
        shares = chunk_bounds(hi - lo, ch.size)
        a, b = shares[me]
        mine = slots[me][a:b]
        for peer, theirs in enumerate(slots):
            if peer != me:
                fn(mine, theirs[a:b], out=mine)
        pending = (lo, shares, slots)
    if pending is not None:  # (an empty array has no block)
        ch.board_exchange(np.empty(0, flat.dtype), reduced)  # the last block's shares are reduced
        _copy_out(flat, *pending)


def _copy_out(flat: np.ndarray, lo: int, shares: List[Tuple[int, int]], slots: List[np.ndarray]) -> None:
    """Every rank's reduced share of the block at `lo`, from its slot into `flat`."""
    for peer, (a, b) in enumerate(shares):
        flat[lo + a:lo + b] = slots[peer][a:b]


allreduce.accepts_src = True  # type: ignore[attr-defined]

"""Board post signatures: what a post on a shared-memory board is for (call kind, op, root), so
that a rank whose peers posted for another call raises ProtocolError instead of reading them."""
from __future__ import annotations

import zlib
from typing import Optional, Sequence

import numpy as np

from ..ops import ReduceOp

# the kinds of post, one number each: one-shot's calls, then two-shot's two posts per block, then the
# posts of the collectives on registered buffers (algorithms/symmetric.py): where the buffers are, and
# the synchronisations after it, then cross-memory attach's two (algorithms/cma.py)
ALLREDUCE, REDUCE, BROADCAST, ALLGATHER, BARRIER, TWOSHOT_POSTED, TWOSHOT_REDUCED = range(1, 8)
SYM_ALLREDUCE, SYM_BROADCAST, SYM_ALLGATHER, SYM_REDUCE_SCATTER, SYM_SYNC = range(8, 13)
CMA_WHERE, CMA_DONE = 13, 14
_OPS = {op: k for k, op in enumerate(ReduceOp, 1)}


def board_signature(kind: int, op: Optional[ReduceOp] = None, root: int = -1,
                    counts: Optional[Sequence[int]] = None) -> int:
    """The signature of a post of `kind` for reduction `op` and `root` (bits 0-3, 4-7 and 8 up); a call
    with per-rank `counts` and no root carries their digest where the root goes."""
    where = root + 1 if counts is None else counts_digest(counts)
    return kind | (_OPS[op] if op is not None else 0) << 4 | where << 8


def counts_digest(counts: Sequence[int]) -> int:
    """32 bits that tell apart the ways to split a call into per-rank blocks: ranks that split the same
    total differently must raise, not read each other's arrays at the wrong places."""
    return zlib.crc32(np.asarray(counts, np.int64).tobytes())

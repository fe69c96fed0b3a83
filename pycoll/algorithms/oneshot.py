"""One-shot collectives on a shared-memory board (NCCL's one-shot allreduce, Open MPI's coll/sm):
every rank posts its input once and reads everyone's, so a call is one synchronisation instead of
lg n message rounds. Only where the transport has a board for the communicator (all ranks on one
host over shm) and the data fits its slots; elsewhere the message-based algorithm runs instead,
the same decision on every rank.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..channel import Channel
from ..ops import ReduceOp, ufunc
from . import barrier as dissemination
from . import recursive_doubling


def allreduce(ch: Channel, buf: np.ndarray, op: ReduceOp, src: Optional[np.ndarray] = None) -> None:
    """Every rank reduces all ranks' inputs (`src`, or `buf` in place) in rank order itself into
    `buf`: bit-identical results everywhere, and out of place without a copy."""
    inputs = ch.board_exchange(buf if src is None else src)
    if inputs is None:
        if src is not None:
            np.copyto(buf, src)
        recursive_doubling.allreduce(ch, buf, op)
        return
    flat = buf.reshape(-1)
    np.copyto(flat, inputs[0])
    fn = ufunc(op, buf.dtype)
    for other in inputs[1:]:
        fn(flat, other, out=flat)


allreduce.accepts_src = True  # type: ignore[attr-defined]


def barrier(ch: Channel) -> None:
    """Return once every rank has posted to the board (dissemination without a board)."""
    if ch.board_exchange(np.empty(0, np.uint8)) is None:
        dissemination.barrier(ch)

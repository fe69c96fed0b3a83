"""One-shot collectives on a shared-memory board (NCCL's one-shot allreduce, Open MPI's coll/sm):
every rank posts its input once and reads everyone's, so a call is one synchronisation instead of
lg n message rounds. Only where the transport has a board for the communicator (all ranks on one
host over shm) and the data fits its slots; elsewhere the message-based algorithm runs instead,
the same decision on every rank.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

from ..channel import Channel
from ..ops import ReduceOp, ufunc
from . import barrier as dissemination
from . import recursive_doubling, tree
from .board_signature import ALLGATHER, ALLREDUCE, BARRIER, BROADCAST, REDUCE, board_signature


def allreduce(ch: Channel, buf: np.ndarray, op: ReduceOp, src: Optional[np.ndarray] = None) -> None:
    """Every rank reduces all ranks' inputs (`src`, or `buf` in place) in rank order itself into
    `buf`: bit-identical results everywhere, and out of place without a copy."""
    inputs = ch.board_exchange(buf if src is None else src, _ALLREDUCE_SIGNATURES[op])
    if inputs is None:
        if src is not None:
            np.copyto(buf, src)
        recursive_doubling.allreduce(ch, buf, op)
        return
    _reduce_in_rank_order(inputs, buf, op)


allreduce.accepts_src = True  # type: ignore[attr-defined]
_ALLREDUCE_SIGNATURES = {op: board_signature(ALLREDUCE, op) for op in ReduceOp}  # a lookup per small call


def _reduce_in_rank_order(inputs: List[np.ndarray], out: np.ndarray, op: ReduceOp) -> None:
    """out (flat) = ((inputs[0] op inputs[1]) op inputs[2]) ...: the same bits wherever it runs."""
    if len(inputs) == 1:
        np.copyto(out, inputs[0])
        return
    fn = ufunc(op, out.dtype)
    fn(inputs[0], inputs[1], out=out)  # the first two straight into buf: no copy of inputs[0] first
    for other in inputs[2:]:
        fn(out, other, out=out)


def reduce(ch: Channel, buf: np.ndarray, op: ReduceOp, root: int) -> None:
    """Every rank posts; only `root` reduces (the others' buffers stay as they were)."""
    inputs = ch.board_exchange(buf, board_signature(REDUCE, op, root))
    if inputs is None:
        tree.reduce(ch, buf, op, root)
    elif ch.rank == root:
        _reduce_in_rank_order(inputs, buf, op)


def broadcast(ch: Channel, buf: np.ndarray, root: int) -> None:
    """Every rank posts (the root's post is the data), the others copy the root's slot."""
    inputs = ch.board_exchange(buf, board_signature(BROADCAST, root=root))
    if inputs is None:
        tree.broadcast(ch, buf, root)
    elif ch.rank != root:
        np.copyto(buf.reshape(-1), inputs[root])


def allgather(ch: Channel, send: np.ndarray, recv: np.ndarray, counts: Optional[Sequence[int]] = None) -> None:
    """Every rank posts its block and copies everyone's into `recv`. allgatherv (counts given) runs
    recursive doubling / Bruck: whether its counts are equal may differ between ranks that disagree
    on them, and the choice of path must not."""
    inputs = ch.board_exchange(send, board_signature(ALLGATHER)) if counts is None else None
    if inputs is None:
        recursive_doubling.allgather(ch, send, recv, counts)
        return
    for k, block in enumerate(inputs):
        recv[k * send.size:(k + 1) * send.size] = block


def barrier(ch: Channel) -> None:
    """Return once every rank has posted to the board (dissemination without a board)."""
    if ch.board_exchange(np.empty(0, np.uint8), board_signature(BARRIER)) is None:
        dissemination.barrier(ch)

"""PYCOLL_DEBUG=DETAIL: before each collective the ranks compare fingerprints of their calls
(collective, dtype, count, op, root), like TORCH_DISTRIBUTED_DEBUG=DETAIL.

The fingerprints travel in an allgather on a shadow communicator id with the call's own number,
so they never mix with user traffic and the call numbering is the same with or without DETAIL.
Every rank must run with the same PYCOLL_DEBUG. alltoallv's per-peer counts legitimately differ
between ranks, so only the transport's header check (ProtocolError) covers them.
"""
from __future__ import annotations

import functools
import hashlib
from typing import Any, Callable, Optional, Sequence, Tuple, Union

import numpy as np

from . import config
from .algorithms.recursive_doubling import allgather
from .channel import Channel
from .errors import ProtocolError
from .ids import derived_id
from .ops import BFLOAT16_CODE, DTYPE_CODES, ReduceOp, as_op, dtype_code

COLLECTIVES = ("allreduce", "reduce", "reduce_scatter", "broadcast", "allgather", "allgatherv",
               "alltoall", "alltoallv", "gather", "scatter", "barrier", "allgather_ragged")
FIELDS = ("collective", "dtype", "count", "per-rank counts", "op", "root")
_OPS = tuple(ReduceOp)
_UNSET = -1  # a field the collective does not have (no op, no root, ...)

Count = Union[int, Sequence[int], None]  # elements, or per-rank counts that must agree everywhere
Fingerprint = Tuple[Optional[np.dtype], Count, Union[ReduceOp, str, None], Optional[int]]  # dtype, count, op, root


class MismatchError(ProtocolError, ValueError):
    """Ranks called different collectives, or one collective with different arguments; `peer` differs."""


def enabled() -> bool:
    """True when PYCOLL_DEBUG=DETAIL."""
    return config.get("PYCOLL_DEBUG") == "DETAIL"


def checked(collective: str, fingerprint: Fingerprint, body: Callable[[Channel], Any]
            ) -> Callable[[Channel], Any]:
    """`body`, preceded by the cross-rank comparison of this call's fingerprint."""
    mine = encode(collective, *fingerprint)

    def run(ch: Channel) -> Any:
        verify(ch, mine)
        return body(ch)
    return run


def encode(collective: str, dtype: Optional[np.dtype], count: Count, op: Optional[ReduceOp],
           root: Optional[int]) -> np.ndarray:
    """The fixed-size int64 fingerprint of one call, laid out as FIELDS."""
    layout = _UNSET
    if count is not None and not isinstance(count, (int, np.integer)):
        counts = np.asarray(count, np.int64)
        layout = int.from_bytes(hashlib.blake2b(counts.tobytes(), digest_size=7).digest(), "little")
        count = int(counts.sum())
    return np.array([COLLECTIVES.index(collective), _UNSET if dtype is None else dtype_code(dtype),
                     _UNSET if count is None else count, layout,
                     _UNSET if op is None else _OPS.index(as_op(op)), _UNSET if root is None else root], np.int64)


def verify(ch: Channel, mine: np.ndarray) -> None:
    """Allgather the fingerprints; MismatchError on every rank naming the first rank that differs from 0."""
    if ch.size == 1:
        return
    table = np.empty((ch.size, mine.size), np.int64)
    shadow = ch.derive(comm_id=_shadow_id(ch.comm_id), what=f"{ch.what} (PYCOLL_DEBUG=DETAIL check)")
    allgather(shadow, mine, table.reshape(-1), None)
    for r in range(1, ch.size):
        diff = np.flatnonzero(table[r] != table[0])
        if diff.size:
            raise MismatchError(f"{ch.what}: PYCOLL_DEBUG=DETAIL: ranks disagree on the {FIELDS[diff[0]]}: "
                                f"rank {r} called {describe(table[r])} but rank 0 called "
                                f"{describe(table[0])}", r)


def describe(fp: np.ndarray) -> str:
    """A fingerprint as a call, e.g. 'broadcast (count 10, float32, root 1)'."""
    coll, dtype, count, layout, op, root = (int(v) for v in fp)
    parts = [] if count == _UNSET else [f"count {count}" + (f" split {layout:014x}" if layout != _UNSET else "")]
    if dtype != _UNSET:
        parts.append(_dtype_name(dtype))
    if op != _UNSET:
        parts.append(f"op {_OPS[op].value}")
    if root != _UNSET:
        parts.append(f"root {root}")
    return COLLECTIVES[coll] + (f" ({', '.join(parts)})" if parts else "")


def _dtype_name(code: int) -> str:
    names = {c: str(dt) for dt, c in DTYPE_CODES.items()}
    return names.get(code, "bfloat16" if code == BFLOAT16_CODE else f"dtype code {code}")


@functools.lru_cache(maxsize=None)
def _shadow_id(comm_id: int) -> int:
    """The communicator id the DETAIL check of `comm_id`'s calls travels on (derived: revoked with it)."""
    return derived_id(comm_id, "detail")

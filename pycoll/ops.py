"""Reduction operators and the dtype table (numpy dtypes plus bfloat16 via ml_dtypes)."""
from __future__ import annotations

import enum
from typing import Callable, Dict, Union

import numpy as np

_DTYPES = [np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64,
           np.uint64, np.float16, np.float32, np.float64, np.complex64, np.complex128]
# wire code of each dtype; 0 means raw bytes (p2p of arbitrary buffers)
DTYPE_CODES: Dict[np.dtype, int] = {np.dtype(t): i + 1 for i, t in enumerate(_DTYPES)}
BFLOAT16_CODE = 64  # ml_dtypes.bfloat16: registered on first use, since importing ml_dtypes costs ~0.5 s


def bfloat16() -> np.dtype:
    """numpy's bfloat16 dtype from ml_dtypes (imported on demand)."""
    import ml_dtypes
    dt = np.dtype(ml_dtypes.bfloat16)
    DTYPE_CODES.setdefault(dt, BFLOAT16_CODE)
    return dt


def is_bfloat16(dtype: np.dtype) -> bool:
    """True for ml_dtypes' bfloat16, without importing ml_dtypes."""
    return np.dtype(dtype).name == "bfloat16"


class ReduceOp(enum.Enum):
    """The reductions every collective supports (torch.distributed / MPI names)."""

    SUM = "sum"
    PROD = "prod"
    MIN = "min"
    MAX = "max"
    AVG = "avg"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"

    # members are singletons compared by identity: hash them so too (Enum's own __hash__ is Python code,
    # and ops key dicts on every call's path)
    __hash__ = object.__hash__


SUM, PROD, MIN, MAX, AVG = ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG
BAND, BOR, BXOR = ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR

_ALIASES = {"product": "prod", "mean": "avg", "average": "avg"}
_UFUNCS: Dict[ReduceOp, Callable] = {
    SUM: np.add, AVG: np.add, PROD: np.multiply, MIN: np.minimum, MAX: np.maximum,
    BAND: np.bitwise_and, BOR: np.bitwise_or, BXOR: np.bitwise_xor,
}
_BITWISE = (BAND, BOR, BXOR)
_FITTING: set = set()  # (op, dtype) pairs check_op has passed


def as_op(op: Union[ReduceOp, str]) -> ReduceOp:
    """Accept a ReduceOp or its name in any case ('sum', 'MAX', 'product')."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        name = op.lower()
        try:
            return ReduceOp(_ALIASES.get(name, name))
        except ValueError:
            pass
    raise ValueError(f"unknown reduction op {op!r}; use one of {[o.value for o in ReduceOp]}")


def dtype_code(dtype: np.dtype) -> int:
    """The wire code of a dtype; TypeError for dtypes no collective supports."""
    code = DTYPE_CODES.get(dtype)  # the hot path: a dict hit, no dtype introspection
    if code is not None:
        return code
    dtype = np.dtype(dtype)
    if is_bfloat16(dtype):
        return DTYPE_CODES.setdefault(dtype, BFLOAT16_CODE)
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} is not supported by pycoll collectives "
                        f"(supported: {sorted(str(d) for d in DTYPE_CODES)})") from None


def check_op(op: ReduceOp, dtype: np.dtype) -> None:
    """TypeError when the op does not fit the dtype (bitwise on floats, ordering on complex)."""
    if (op, dtype) in _FITTING:  # every call checks: a pair that fitted once is a set hit
        return
    dtype_code(dtype)
    if not isinstance(dtype, np.dtype):
        dtype = np.dtype(dtype)
    if op in _BITWISE and dtype.kind not in "biu":
        raise TypeError(f"op {op.value} needs an integer or bool dtype, got {dtype}")
    if op in (MIN, MAX) and dtype.kind == "c":
        raise TypeError(f"op {op.value} is not defined for complex dtype {dtype}")
    _FITTING.add((op, dtype))


def reduction(op: Union[ReduceOp, str], dtype: np.dtype) -> ReduceOp:
    """`op` as the ReduceOp it names, checked against `dtype` (ValueError, TypeError): what a call
    validates before any byte moves."""
    if type(op) is ReduceOp and (op, dtype) in _FITTING:  # the hot path: a pair that fitted before
        return op
    op = as_op(op)
    check_op(op, dtype)
    return op


def ufunc(op: ReduceOp, dtype: np.dtype) -> Callable:
    """The numpy ufunc that computes `op` on `dtype` (AVG sums: the caller divides at the end)."""
    if dtype.kind == "b":
        if op is SUM or op is AVG:
            return np.logical_or
        if op is PROD:
            return np.logical_and
    return _UFUNCS[op]


def reduce_into(op: ReduceOp, acc: np.ndarray, other: np.ndarray) -> None:
    """acc = op(acc, other), elementwise and in place (AVG sums; the caller divides at the end)."""
    ufunc(op, acc.dtype)(acc, other, out=acc)


def combine(op: ReduceOp, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """out = op(a, b) elementwise, with no temporary (out may be a or b)."""
    ufunc(op, out.dtype)(a, b, out=out)


def finish_avg(buf: np.ndarray, size: int) -> None:
    """Turn a sum over `size` ranks into the average: true division for floats, floor for integers."""
    if buf.dtype.kind in "fc" or is_bfloat16(buf.dtype):
        np.divide(buf, size, out=buf, casting="unsafe")
    else:
        np.floor_divide(buf, size, out=buf, casting="unsafe")

"""Turn user buffers (numpy, torch CPU tensors, buffer protocol, __array_interface__, DLPack)
into numpy views of the same memory, validating before any byte moves."""
from __future__ import annotations

import sys
from typing import Any

import numpy as np

from .ops import bfloat16


def _from_torch(t: Any) -> np.ndarray:
    try:  # the common case in one call: fewer torch entry points run cold after a large call
        return t.numpy()
    except (TypeError, RuntimeError):  # another device, requires_grad, bfloat16, ...: checked below
        pass
    if not t.is_cpu:
        raise ValueError(f"pycoll works on CPU tensors; got a tensor on {t.device}")
    if t.requires_grad:
        t = t.detach()
    torch = sys.modules["torch"]
    if t.dtype is torch.bfloat16:
        return t.view(torch.int16).numpy().view(bfloat16())
    return t.numpy()


def as_array(obj: Any, name: str = "buffer", writable: bool = True, role: str = "") -> np.ndarray:
    """A numpy view of `obj` without copying; ValueError/TypeError if it cannot be used as is, naming
    it "`name` `role`" (e.g. "allreduce" "x": the words are joined only for an error)."""
    if isinstance(obj, np.ndarray):
        arr = obj
    elif "torch" in sys.modules and isinstance(obj, sys.modules["torch"].Tensor):
        arr = _from_torch(obj)
    elif hasattr(obj, "__array_interface__"):
        arr = np.asarray(obj)
    elif hasattr(obj, "__dlpack__"):
        arr = np.from_dlpack(obj)
    else:
        try:
            mv = memoryview(obj)
        except TypeError:
            raise TypeError(f"{_label(name, role)} of type {type(obj).__name__} has no buffer protocol, "
                            "__array_interface__ or DLPack; pass a numpy array or tensor") from None
        arr = np.asarray(mv)
    if not arr.flags.c_contiguous:
        raise ValueError(f"{_label(name, role)} must be C-contiguous (got strides {arr.strides} for shape "
                         f"{arr.shape}); pass a contiguous copy, e.g. np.ascontiguousarray(x)")
    if writable and not arr.flags.writeable:
        raise ValueError(f"{_label(name, role)} is read-only; pycoll writes the result into it (pass out= "
                         "with a writable buffer)")
    return arr


def _label(name: str, role: str) -> str:
    return f"{name} {role}" if role else name


def flat(arr: np.ndarray) -> np.ndarray:
    """A 1-D view of a C-contiguous array (the array itself when it is one already)."""
    return arr if arr.ndim == 1 else arr.reshape(-1)

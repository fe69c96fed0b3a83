"""Persistent allreduce handles for tensors whose memory recurs (DDP's buckets, a TP layer's activation
buffer at every decoding step): the backend's allreduce looks the tensor's memory up and, on a hit,
starts the handle made the first time (pycoll/persistent.py), skipping the tensor's conversion to
numpy, the argument checks, the op resolution and the algorithm choice of a plain call.

What a hit checks, per call: the tensor's data address, element count and dtype, and the op (the key),
then that it is a contiguous CPU tensor. Why that is enough: the handle works on the memory region
[address, address + count * itemsize) as `count` elements of the dtype, in place, and reads it only
while this call runs, when the tensor passed to it owns that region (torch keeps a call's tensors
alive until it completes; the handle's view keeps nothing alive). A contiguous CPU tensor with that
address, count and dtype is exactly that region, whichever tensor object it is: one freed and its
memory reused by a new tensor of the same size is the same bytes, so the allreduce reads and writes
what the plain call would. Its contents may have changed (that is the point); its storage version
does not matter, as nothing of the contents is kept. A non-contiguous tensor (a transposed view has the
same address and count, but its elements lie in another order, which may differ between ranks)
and anything sparse or off the CPU take the plain path.

The handles are made unmarked (persistent.py): their runs are plain calls on the wire, so a rank's
hit meets a peer's miss. Their algorithm was chosen when they were made, as a plain call would choose
it now only while the communicator's selector and its use of registered buffers are unchanged: the
cache empties when either changes, so every rank's call runs what a plain call runs.
"""
from __future__ import annotations

import ctypes
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch

from ..buffers import as_array
from ..comm import Communicator
from ..ops import ReduceOp
from ..persistent import collective

MAX_HANDLES = 256  # the cache empties when full: tensors at ever new addresses must not grow it for good


def raw_view(address: int, count: int, dtype: np.dtype) -> np.ndarray:
    """`count` elements of `dtype` at `address`, writable, holding no reference to their owner."""
    return np.frombuffer((ctypes.c_char * (count * dtype.itemsize)).from_address(address), dtype, count)


Key = Tuple[int, int, torch.dtype, ReduceOp]


class Handles:
    """One communicator's persistent allreduce handles, by (data address, count, dtype, op). A memory
    region gets its handle the second time it is seen: a tensor seen once (a new address every call)
    costs a set entry, not a handle."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self._handles: Dict[Key, Any] = {}
        self._seen: Dict[Key, bool] = {}  # seen once, no handle yet
        self._made_for: Tuple[Any, bool] = (comm.selector, False)
        self.hits = self.made = 0

    def get(self, t: torch.Tensor, op: ReduceOp) -> Optional[Any]:
        """The handle that allreduces `t` in place with `op`; None where `t` takes the plain path: its
        memory not seen before, or sparse, strided, off the CPU or empty."""
        try:
            key = (t.data_ptr(), t.numel(), t.dtype, op)
        except RuntimeError:  # sparse tensors have no data pointer
            return None
        comm = self.comm
        made_for = (comm.selector, comm.windows is not None and comm.windows.used)
        if made_for != self._made_for:  # a plain call would choose afresh: so do the handles
            self._handles.clear()
            self._made_for = made_for
        h = self._handles.get(key)
        if not (key[1] and t.is_contiguous() and t.is_cpu):
            return None
        if h is not None:
            self.hits += 1
            return h
        if key not in self._seen:
            if len(self._seen) >= MAX_HANDLES:
                self._seen.clear()
            self._seen[key] = True
            return None
        del self._seen[key]
        dtype = as_array(t, "all_reduce tensor", True).dtype  # (bfloat16's too)
        if len(self._handles) >= MAX_HANDLES:
            self._handles.clear()
        h = self._handles[key] = collective(comm, comm.allreduce, (raw_view(key[0], key[1], dtype), None, op), {},
                                            None, [], marked=False)
        self.made += 1
        return h

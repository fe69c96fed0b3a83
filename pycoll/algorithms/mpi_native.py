"""mpi_native: every collective is MPI's own (Allreduce, Bcast, ...), to compare pycoll's algorithms with.

Works only over PYCOLL_TRANSPORT=mpi, whose transport hands out one MPI communicator per pycoll
communicator (same ranks, same order). Data moves as whole elements (a contiguous MPI type of the
item size), so every dtype moves, bfloat16 included. Reductions use MPI's predefined type and op where
MPI has them, otherwise (bool, float16, bfloat16) a commutative user-defined MPI.Op that reduces with
numpy like pycoll's algorithms; AVG is MPI's SUM and the Communicator divides afterwards. MPI's
collectives block with no deadline, so PYCOLL_TIMEOUT does not bound them.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ..channel import Channel, byte_view
from ..ops import AVG, ReduceOp, reduce_into
from ..transports.capabilities import MpiCommunicators
from .ring import displacements


def _mpi() -> Any:
    """mpi4py's MPI module, imported only once a channel runs over MPI (importing it initializes MPI)."""
    from mpi4py import MPI
    return MPI


@contextlib.contextmanager
def _native(ch: Channel) -> Iterator[Any]:
    """The MPI communicator of the channel's group, held in the transport's MPI context."""
    mpi = ch.transport.offers(MpiCommunicators)
    if mpi is None:
        raise ValueError(f"mpi_native needs PYCOLL_TRANSPORT=mpi (under mpirun), but {ch.what} runs over "
                         f"the {ch.transport.name} transport; choose another algorithm")
    comm = mpi.comm_for(ch.group, ch.comm_id)
    with mpi.serialized():
        yield comm


@functools.lru_cache(maxsize=None)
def _element_type(itemsize: int) -> Any:
    """An MPI datatype of one element of `itemsize` bytes (data movement needs no more)."""
    MPI = _mpi()
    return MPI.BYTE if itemsize == 1 else MPI.BYTE.Create_contiguous(itemsize).Commit()


def _buf(arr: np.ndarray) -> List[Any]:
    return [byte_view(arr), _element_type(arr.dtype.itemsize)]


def _bufv(arr: np.ndarray, counts: Sequence[int], displs: Sequence[int]) -> List[Any]:
    return [byte_view(arr), (list(counts), list(displs)), _element_type(arr.dtype.itemsize)]


@functools.lru_cache(maxsize=None)
def _reduction(op: ReduceOp, dtype: np.dtype) -> Tuple[Any, Any]:
    """(MPI datatype, MPI op) reducing `dtype` by `op`: MPI's own if it has them, else numpy in an MPI.Op."""
    MPI = _mpi()
    if dtype.kind in "iuc" or (dtype.kind == "f" and dtype.itemsize >= 4):
        return MPI.Datatype.fromcode(dtype.char), getattr(MPI, "SUM" if op is AVG else op.name)  # same names

    def apply(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
        reduce_into(op, np.frombuffer(inoutbuf, dtype), np.frombuffer(inbuf, dtype))
    return _element_type(dtype.itemsize), MPI.Op.Create(apply, commute=True)


def _reducible(arr: np.ndarray, op: ReduceOp) -> Tuple[List[Any], Any]:
    datatype, mpi_op = _reduction(op, arr.dtype)
    return [byte_view(arr), arr.size, datatype], mpi_op


def allreduce(ch: Channel, buf: np.ndarray, op: ReduceOp) -> None:
    """MPI_Allreduce in place."""
    spec, mpi_op = _reducible(buf, op)
    with _native(ch) as comm:
        comm.Allreduce(_mpi().IN_PLACE, spec, mpi_op)


def broadcast(ch: Channel, buf: np.ndarray, root: int) -> None:
    """MPI_Bcast."""
    with _native(ch) as comm:
        comm.Bcast(_buf(buf), root)


def reduce(ch: Channel, buf: np.ndarray, op: ReduceOp, root: int) -> None:
    """MPI_Reduce, in place at root; the other ranks' buffers are only read."""
    spec, mpi_op = _reducible(buf, op)
    with _native(ch) as comm:
        if ch.rank == root:
            comm.Reduce(_mpi().IN_PLACE, spec, mpi_op, root)
        else:
            comm.Reduce(spec, None, mpi_op, root)


def _own_part(send: np.ndarray, recv: np.ndarray, start: int) -> Any:
    """Allgather's send buffer: IN_PLACE when `send` already is this rank's block of `recv`, a copy
    when it overlaps `recv` anywhere else (MPI forbids aliased buffers)."""
    if not np.may_share_memory(send, recv):
        return _buf(send)
    block = recv[start:start + send.size]
    if block.__array_interface__["data"][0] == send.__array_interface__["data"][0]:
        return _mpi().IN_PLACE
    return _buf(send.copy())


def allgather(ch: Channel, send: np.ndarray, recv: np.ndarray,
              counts: Optional[Sequence[int]] = None) -> None:
    """MPI_Allgather, or MPI_Allgatherv with per-rank `counts`."""
    edges = displacements([send.size] * ch.size if counts is None else counts)
    mine = _own_part(send, recv, edges[ch.rank])
    with _native(ch) as comm:
        if counts is None:
            comm.Allgather(mine, _buf(recv))
        else:
            comm.Allgatherv(mine, _bufv(recv, counts, edges[:-1]))


def reduce_scatter(ch: Channel, send: np.ndarray, recv: np.ndarray, op: ReduceOp,
                   counts: Optional[Sequence[int]] = None) -> None:
    """MPI_Reduce_scatter_block for equal blocks, MPI_Reduce_scatter for uneven `counts`."""
    datatype, mpi_op = _reduction(op, send.dtype)
    sendspec, recvspec = [byte_view(send), datatype], [byte_view(recv), datatype]
    with _native(ch) as comm:
        if counts is None or len(set(counts)) <= 1:
            comm.Reduce_scatter_block(sendspec, recvspec, mpi_op)
        else:
            comm.Reduce_scatter(sendspec, recvspec, list(counts), mpi_op)


def alltoall(ch: Channel, send: np.ndarray, recv: np.ndarray) -> None:
    """MPI_Alltoall."""
    with _native(ch) as comm:
        comm.Alltoall(_buf(send), _buf(recv))


def alltoallv(ch: Channel, send: np.ndarray, send_counts: Sequence[int], send_displs: Sequence[int],
              recv: np.ndarray, recv_counts: Sequence[int], recv_displs: Sequence[int]) -> None:
    """MPI_Alltoallv (counts and displacements in elements)."""
    with _native(ch) as comm:
        comm.Alltoallv(_bufv(send, send_counts, send_displs), _bufv(recv, recv_counts, recv_displs))


def gather(ch: Channel, send: np.ndarray, recv: Optional[np.ndarray], root: int,
           counts: Optional[Sequence[int]] = None) -> None:
    """MPI_Gather, or MPI_Gatherv with per-rank `counts`; `recv` is None off the root."""
    if recv is not None and counts is not None:
        target: Any = _bufv(recv, counts, displacements(counts)[:-1])
    else:
        target = None if recv is None else _buf(recv)
    with _native(ch) as comm:
        (comm.Gather if counts is None else comm.Gatherv)(_buf(send), target, root)


def scatter(ch: Channel, send: Optional[np.ndarray], recv: np.ndarray, root: int,
            counts: Optional[Sequence[int]] = None) -> None:
    """MPI_Scatter, or MPI_Scatterv with per-rank `counts`; `send` is None off the root."""
    if send is not None and counts is not None:
        source: Any = _bufv(send, counts, displacements(counts)[:-1])
    else:
        source = None if send is None else _buf(send)
    with _native(ch) as comm:
        (comm.Scatter if counts is None else comm.Scatterv)(source, _buf(recv), root)


def barrier(ch: Channel) -> None:
    """MPI_Barrier."""
    with _native(ch) as comm:
        comm.Barrier()

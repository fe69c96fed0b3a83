"""The torch.distributed backend "pycoll": `import pycoll.torch`, then
`dist.init_process_group("pycoll", ...)` runs torch's collectives on a pycoll Communicator.

Importing this module registers the backend for CPU tensors. The backend rendezvouses through the
c10d store torch hands it (no second port), with the same job token rules as
`pycoll.init(rank=, size=, store=)`. Every collective returns a Work whose wait() re-raises
pycoll's error and whose get_future() gives the output tensors (DDP comm hooks use it).
`import pycoll` alone never imports torch.
"""
from __future__ import annotations

import atexit
import concurrent.futures
import datetime
import math
import os
import threading
import weakref
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from .. import config
from ..bootstrap.env import discover
from ..bootstrap.store import Store
from ..comm import Communicator
from ..errors import TimeoutError
from ..ops import ReduceOp
from ..world import connect
from ..torch_autoload import BACKEND

_OPS = {
    dist.ReduceOp.RedOpType.SUM: ReduceOp.SUM, dist.ReduceOp.RedOpType.AVG: ReduceOp.AVG,
    dist.ReduceOp.RedOpType.PRODUCT: ReduceOp.PROD, dist.ReduceOp.RedOpType.MIN: ReduceOp.MIN,
    dist.ReduceOp.RedOpType.MAX: ReduceOp.MAX, dist.ReduceOp.RedOpType.BAND: ReduceOp.BAND,
    dist.ReduceOp.RedOpType.BOR: ReduceOp.BOR, dist.ReduceOp.RedOpType.BXOR: ReduceOp.BXOR,
}


_OPS_BY_VALUE = {k.value: v for k, v in _OPS.items()}
_PREMUL_SUM = dist.ReduceOp.RedOpType.PREMUL_SUM.value
_SPARSE = torch.sparse_coo


def _dense(t: torch.Tensor) -> Optional[np.ndarray]:
    """The numpy view of a dense, C-contiguous CPU tensor that numpy can hold (None for any other:
    sparse, strided, requires_grad, bfloat16, another device), in one torch call: with caches cold
    after a large call, every torch entry point costs 8-56 us (t.layout 10, t.is_contiguous() 8,
    t.numpy() 56, measured here), so the blocking allreduce asks only this one."""
    try:
        arr = t.numpy()
    except (TypeError, RuntimeError):
        return None
    return arr if arr.flags.c_contiguous else None


class C10dStore(Store):
    """pycoll's Store interface over a torch c10d store (the one torch gives the backend)."""

    def __init__(self, store: "dist.Store", timeout: float) -> None:
        self._store, self.timeout = store, timeout

    def _wait(self, keys: Sequence[str], timeout: Optional[float]) -> None:
        t = self.timeout if timeout is None else timeout
        try:
            self._store.wait(list(keys), datetime.timedelta(seconds=max(t, 0.001)))
        except RuntimeError as e:  # c10d's DistStoreError: a timeout (or a lost store)
            missing = [k for k in keys if not self.check([k])]
            raise TimeoutError(f"store keys still missing after {t:g} s: {missing} ({e})") from None

    def set(self, key: str, value: bytes) -> None:
        self._store.set(key, bytes(value))

    def get(self, key: str, timeout: Optional[float] = None) -> bytes:
        self._wait([key], timeout)
        return bytes(self._store.get(key))

    def add(self, key: str, amount: int) -> int:
        return int(self._store.add(key, int(amount)))

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self._store.check(list(keys)))

    def wait(self, keys: Sequence[str], timeout: Optional[float] = None) -> None:
        self._wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        return bool(self._store.delete_key(key))


def _as_torch_error(e: BaseException) -> BaseException:
    """pycoll's timeout as torch users and tools look for it (gloo: "Timed out waiting ..."): the
    same class and peers, the message prefixed, pycoll's own error kept as the cause."""
    if isinstance(e, TimeoutError) and not str(e).startswith("[pycoll] Timed out "):
        wrapped = TimeoutError(f"[pycoll] Timed out waiting: {e}", e.peers)
        wrapped.__cause__ = e
        return wrapped
    return e


def _sparse_bytes(t: torch.Tensor) -> np.ndarray:
    """Coalesced sparse `t` as bytes, one row per nonzero: its sparse_dim int64 indices, then its value
    row (so every rank's rows, gathered one after another, are rows of one table)."""
    nnz, row = t._nnz(), math.prod(t.shape[t.sparse_dim():]) * t.element_size()
    idx = np.ascontiguousarray(t.indices().numpy().T).view(np.uint8)  # (nnz, 8 * sparse_dim)
    vals = t.values().contiguous()
    raw = vals.view(torch.uint8) if vals.numel() else torch.empty(0, dtype=torch.uint8)
    return np.concatenate([idx, raw.numpy().reshape(nnz, row)], axis=1).reshape(-1)


def _sparse_sum(t: torch.Tensor, gathered: np.ndarray) -> torch.Tensor:
    """The coalesced sum of every rank's rows (_sparse_bytes) of a tensor shaped like `t`."""
    dense = t.shape[t.sparse_dim():]  # each value row's shape
    at = 8 * t.sparse_dim()
    rows = torch.from_numpy(gathered).view(-1, at + math.prod(dense) * t.element_size())
    idx = rows[:, :at].contiguous().view(torch.int64)
    vals = rows[:, at:].contiguous().view(t.dtype).view(rows.shape[0], *dense)
    return torch.sparse_coo_tensor(idx.t(), vals, t.shape).coalesce()


class PycollWork(dist.Work):
    """A torch Work over one or more pycoll Works (queued in order on one communicator): done when
    the last is, then `post` (copies into torch's output tensors) runs once; errors re-raise in
    wait() and reach get_future()'s waiters. The torch Future is built only when asked for (DDP
    does; a plain dist.all_reduce does not), so a call pays for no future it never uses."""

    def __init__(self, works: Sequence[Any], outputs: List[torch.Tensor],
                 post: Optional[Callable[[], None]] = None, error: Optional[BaseException] = None) -> None:
        super().__init__()
        self._works, self._outputs, self._post = works, outputs, post
        self._lock = threading.RLock()  # RLock: completing the future runs its callbacks, which may call us
        self._src: "Optional[torch.futures.Future[List[torch.Tensor]]]" = None
        self._fut: "Optional[torch.futures.Future[List[torch.Tensor]]]" = None
        # the outcome, final once _finished is set (after _error: readers check _finished first)
        self._error: Optional[BaseException] = None if error is None else _as_torch_error(error)
        self._finished = not works

    def _finish(self, _: Any = None) -> None:
        """Once the last pycoll Work is done: check them in call order (the first error is the
        cause), run `post`, and complete the torch future if one was asked for."""
        with self._lock:
            if not self._finished:
                error: Optional[BaseException] = None
                try:
                    for w in self._works:
                        w.result()
                    if self._post is not None:
                        self._post()
                except BaseException as e:
                    error = _as_torch_error(e)
                self._error = error
                self._finished = True
            if self._src is not None and not self._src.done():
                if self._error is not None:
                    self._src.set_exception(self._error)
                else:
                    self._src.set_result(self._outputs)

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        if not self._finished:
            last = self._works[-1]
            if seconds:
                try:
                    last.get_future().exception(seconds)  # waits; the error itself is raised below
                except concurrent.futures.TimeoutError:
                    raise TimeoutError(f"pycoll torch work was not complete after wait({seconds} s)") from None
            else:
                try:
                    last.wait()  # may run the queued call on this thread
                except BaseException:  # raised below, after the earlier works are checked
                    pass
            self._finish()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        if not self._finished and self._works[-1].is_completed():
            self._finish()
        return self._finished

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self) -> Optional[BaseException]:
        return self._error if self.is_completed() else None

    def result(self) -> List[torch.Tensor]:
        self.wait()
        return self._outputs

    def get_future(self) -> "torch.futures.Future[List[torch.Tensor]]":
        with self._lock:
            if self._fut is None:
                # errors at C++ level: a then() child of the future we complete, so that a failed
                # collective under DDP raises in backward (set_exception alone stores it as the value)
                self._src = torch.futures.Future()
                self._fut = self._src.then(_unwrap)
                if self._finished:
                    self._finish()
                else:
                    self._works[-1].get_future().add_done_callback(self._finish)
            return self._fut


def _unwrap(fut: "torch.futures.Future[Any]") -> Any:
    return fut.wait()


def _flat_cat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.empty(0)


class ProcessGroupPycoll(dist.ProcessGroup):
    """A torch ProcessGroup whose collectives run on a pycoll Communicator."""

    def __init__(self, comm: Communicator, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self.comm = comm
        self._group_name = ""
        self._group_desc = ""

    # -- identity (FSDP2/DTensor/functional collectives need the names) -------------------------
    def getBackendName(self) -> str:
        return BACKEND

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupDesc(self) -> str:
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_name(self) -> str:
        return self._group_name

    def __repr__(self) -> str:
        return f"ProcessGroupPycoll({self.comm!r})"

    # -- helpers --------------------------------------------------------------------------------
    @staticmethod
    def _op(opts: Any) -> Tuple[ReduceOp, Any]:
        """(pycoll's op, the PREMUL_SUM factor or None) for `opts.reduceOp` (opts None: SUM), which is
        read once: each torch entry point costs microseconds, tens with caches cold."""
        if opts is None:
            return ReduceOp.SUM, None
        red = opts.reduceOp
        kind = getattr(red, "op", red).value  # .value: pybind enums hash and compare slowly
        op = _OPS_BY_VALUE.get(kind)
        if op is not None:
            return op, None
        if kind == _PREMUL_SUM:  # a SUM of inputs scaled first (_premul)
            return ReduceOp.SUM, red.factor
        raise ValueError(f"pycoll backend: reduce op {getattr(red, 'op', red)} is not supported")

    @staticmethod
    def _premul(factor: Any, t: torch.Tensor, in_place: bool) -> torch.Tensor:
        """`t` scaled by a PREMUL_SUM op's factor (a float or a 1-element tensor), as NCCL scales each
        input before summing; `t` itself without one (factor None: every other op)."""
        if factor is None:
            return t
        return t.mul_(factor) if in_place else t * factor

    @staticmethod
    def _contig(t: torch.Tensor):
        """(a contiguous buffer for `t`, a copy-back or None): pycoll needs C-contiguous memory."""
        if t.is_contiguous():
            return t, None
        tmp = t.contiguous()
        return tmp, (lambda: t.copy_(tmp))

    @staticmethod
    def _chain(*steps: Optional[Callable[[], Any]]) -> Optional[Callable[[], None]]:
        live = [s for s in steps if s is not None]
        if not live:
            return None

        def run() -> None:
            for s in live:
                s()
        return run

    # -- reductions -----------------------------------------------------------------------------
    def allreduce(self, tensors: List[torch.Tensor], opts: Any = None) -> Optional[PycollWork]:
        op, factor = self._op(opts)
        if opts is not None and not opts.asyncOp:  # dist.all_reduce(async_op=False): the caller waits at
            return self._blocking(tensors, op, factor)  # once, so run here: no hand-off to the worker thread
        for t in tensors:
            if t.layout is _SPARSE:
                return self._sparse_allreduce(tensors, op)
        works, posts = [], []
        for t in tensors:
            buf, back = self._contig(t)
            buf = self._premul(factor, buf, in_place=True)
            works.append(self.comm.allreduce(buf, op=op, async_op=True))
            posts.append(back)
        return PycollWork(works, tensors, self._chain(*posts))

    def _blocking(self, tensors: List[torch.Tensor], op: ReduceOp, factor: Any) -> Optional[PycollWork]:
        """allreduce on this thread (behind any queued work, in call order). None once it succeeded:
        torch's wrapper then has nothing to wait on (as for a backend that syncs in C++), and a call
        builds no Work, which costs tens of microseconds with caches cold after a large call; a
        finished Work that re-raises in wait() if it failed. A dense tensor runs on its numpy view
        (_dense: one torch call); only the others are asked whether they are sparse or strided."""
        views = [_dense(t) for t in tensors]
        if any(v is None and t.layout is _SPARSE for t, v in zip(tensors, views)):
            return self._sparse_allreduce(tensors, op)  # torch's wrapper waits on it
        try:
            for t, view in zip(tensors, views):
                if view is None:
                    buf, back = self._contig(t)
                    self.comm.allreduce(self._premul(factor, buf, in_place=True), op=op)
                    if back is not None:
                        back()
                else:
                    self._premul(factor, t, in_place=True)  # (the view's memory)
                    self.comm.allreduce(view, op=op)
        except BaseException as e:  # wait() re-raises it, as for an async call
            return PycollWork([], tensors, None, e)
        return None

    def _sparse_allreduce(self, tensors: List[torch.Tensor], op: ReduceOp) -> PycollWork:
        """SUM of sparse COO tensors, as gloo does it: every rank gathers all ranks' (indices, values)
        and sums them; each tensor becomes the coalesced sum in place. One allgather_ragged per tensor
        (its indices and values packed as bytes), queued like any call: the Work completes with it."""
        try:
            if op != ReduceOp.SUM or any(t.layout != torch.sparse_coo for t in tensors):
                raise ValueError(f"pycoll backend, rank {self.comm.rank}: sparse allreduce takes sparse COO "
                                 f"tensors only and op SUM only (got op {op.name} on layouts "
                                 f"{[str(t.layout) for t in tensors]})")
            works = [self.comm.allgather_ragged(_sparse_bytes(t.coalesce()), async_op=True) for t in tensors]
        except BaseException as e:  # wait() re-raises it, as for an async call
            return PycollWork([], tensors, None, e)

        def post() -> None:
            for t, w in zip(tensors, works):
                t.copy_(_sparse_sum(t, w.result()[0]))
        return PycollWork(works, tensors, post)

    def allreduce_coalesced(self, tensors: List[torch.Tensor], opts: Any = None) -> PycollWork:
        return self.allreduce(tensors, opts)

    def reduce(self, tensors: List[torch.Tensor], opts: Any) -> PycollWork:
        (op, factor), root = self._op(opts), opts.rootRank
        t = tensors[opts.rootTensor]
        buf, back = self._contig(t)
        scaled = self._premul(factor, buf, in_place=False)
        if scaled is not buf:  # only root's result lands in `t`; the others keep their input
            buf, back = scaled, (lambda: t.copy_(scaled.view(t.shape)))
        work = self.comm.reduce(buf, root=root, op=op, async_op=True)
        return PycollWork([work], tensors, back if self.comm.rank == root else None)

    def reduce_scatter(self, outputs: List[torch.Tensor], inputs: List[List[torch.Tensor]],
                       opts: Any) -> PycollWork:
        (op, factor), works, posts = self._op(opts), [], []
        for out, ins in zip(outputs, inputs):
            src = self._premul(factor, _flat_cat(ins), in_place=True)  # a copy of its own already
            counts = [t.numel() for t in ins]
            buf, back = self._contig(out)
            works.append(self.comm.reduce_scatter(src, out=buf, op=op, counts=counts, async_op=True))
            posts.append(back)
        return PycollWork(works, outputs, self._chain(*posts))

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> PycollWork:
        op, factor = self._op(opts)
        src = self._premul(factor, input if input.is_contiguous() else input.contiguous(), in_place=False)
        buf, back = self._contig(output)
        work = self.comm.reduce_scatter(src, out=buf, op=op, async_op=True)
        return PycollWork([work], [output], back)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor],
                                        opts: Any) -> PycollWork:
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return self._join(works, outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- data movement --------------------------------------------------------------------------
    def broadcast(self, tensors: List[torch.Tensor], opts: Any) -> PycollWork:
        works, posts = [], []
        for t in tensors:
            buf, back = self._contig(t)
            works.append(self.comm.broadcast(buf, root=opts.rootRank, async_op=True))
            posts.append(back)
        return PycollWork(works, tensors, self._chain(*posts))

    def allgather(self, outputs: List[List[torch.Tensor]], inputs: List[torch.Tensor],
                  opts: Any = None) -> PycollWork:
        works, posts = [], []
        for outs, inp in zip(outputs, inputs):
            src = inp if inp.is_contiguous() else inp.contiguous()
            counts = [o.numel() for o in outs]
            gathered = torch.empty(sum(counts), dtype=inp.dtype)
            if len(set(counts)) == 1:
                works.append(self.comm.allgather(src, out=gathered, async_op=True))
            else:
                works.append(self.comm.allgatherv(src, counts, out=gathered, async_op=True))
            posts.append(self._scatter_into(gathered, outs))
        return PycollWork(works, [o for outs in outputs for o in outs], self._chain(*posts))

    @staticmethod
    def _scatter_into(flat: torch.Tensor, outs: List[torch.Tensor]) -> Callable[[], None]:
        def copy() -> None:
            for piece, o in zip(torch.split(flat, [o.numel() for o in outs]), outs):
                o.copy_(piece.view(o.shape))
        return copy

    def allgather_coalesced(self, outputs: List[List[torch.Tensor]], inputs: List[torch.Tensor],
                            opts: Any = None) -> PycollWork:
        """outputs[r][j] receives rank r's inputs[j] (c10d's layout: one list per rank, as gloo)."""
        works = [self.allgather([[per_rank[j] for per_rank in outputs]], [inp], opts)
                 for j, inp in enumerate(inputs)]
        return self._join(works, [o for outs in outputs for o in outs])

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> PycollWork:
        src = input if input.is_contiguous() else input.contiguous()
        buf, back = self._contig(output)
        work = self.comm.allgather(src, out=buf, async_op=True)
        return PycollWork([work], [output], back)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor],
                                    opts: Any = None) -> PycollWork:
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return self._join(works, outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def _join(self, works: List[PycollWork], outputs: List[torch.Tensor]) -> PycollWork:
        """One Work over several of ours (each already queued in order on the communicator): their
        pycoll Works in order, then each one's copy-back."""
        failed = [w._error for w in works if not w._works and w._error is not None]
        parts = [p for w in works for p in w._works]
        if failed or not parts:
            return PycollWork([], outputs, None, failed[0] if failed else None)
        return PycollWork(parts, outputs, self._chain(*(w._post for w in works)))

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: Optional[List[int]], input_split_sizes: Optional[List[int]],
                          opts: Any = None) -> PycollWork:
        src = input if input.is_contiguous() else input.contiguous()
        buf, back = self._contig(output)
        if not output_split_sizes and not input_split_sizes:
            work = self.comm.alltoall(src, out=buf, async_op=True)
        else:
            n = self.comm.size
            in_row = src.numel() // max(src.shape[0], 1) if src.dim() else 1
            out_row = buf.numel() // max(buf.shape[0], 1) if buf.dim() else 1
            sc = [s * in_row for s in input_split_sizes] if input_split_sizes else [src.numel() // n] * n
            rc = [s * out_row for s in output_split_sizes] if output_split_sizes else [buf.numel() // n] * n
            work = self.comm.alltoallv(src, sc, rc, out=buf, async_op=True)
        return PycollWork([work], [output], back)

    alltoall_base = all_to_all_single

    def alltoall(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor], opts: Any = None) -> PycollWork:
        src = _flat_cat(inputs)
        sc, rc = [t.numel() for t in inputs], [t.numel() for t in outputs]
        gathered = torch.empty(sum(rc), dtype=src.dtype)
        work = self.comm.alltoallv(src, sc, rc, out=gathered, async_op=True)
        return PycollWork([work], outputs, self._scatter_into(gathered, outputs))

    def gather(self, outputs: List[List[torch.Tensor]], inputs: List[torch.Tensor], opts: Any) -> PycollWork:
        root, inp = opts.rootRank, inputs[0]
        src = inp if inp.is_contiguous() else inp.contiguous()
        if self.comm.rank == root:
            gathered = torch.empty(self.comm.size * src.numel(), dtype=src.dtype)
            work = self.comm.gather(src, root=root, out=gathered, async_op=True)
            return PycollWork([work], outputs[0], self._scatter_into(gathered, outputs[0]))
        return PycollWork([self.comm.gather(src, root=root, async_op=True)], [])

    def scatter(self, outputs: List[torch.Tensor], inputs: List[List[torch.Tensor]], opts: Any) -> PycollWork:
        root = opts.rootRank
        buf, back = self._contig(outputs[0])
        src = _flat_cat(inputs[0]).to(buf.dtype) if self.comm.rank == root else None
        work = self.comm.scatter(src, root=root, out=buf, async_op=True)
        return PycollWork([work], outputs, back)

    def barrier(self, opts: Any = None) -> PycollWork:
        return PycollWork([self.comm.barrier(async_op=True)], [])

    # -- point to point -------------------------------------------------------------------------
    def send(self, tensors: List[torch.Tensor], dst: int, tag: int) -> PycollWork:
        works = [self.comm.isend(t if t.is_contiguous() else t.contiguous(), dst, tag) for t in tensors]
        return PycollWork(works, tensors)

    def recv(self, tensors: List[torch.Tensor], src: int, tag: int) -> PycollWork:
        works, posts = [], []
        for t in tensors:
            buf, back = self._contig(t)
            works.append(self.comm.irecv(buf, src, tag))
            posts.append(back)
        return PycollWork(works, tensors, self._chain(*posts))

    def recv_anysource(self, tensors: List[torch.Tensor], tag: int) -> PycollWork:
        """dist.recv / dist.irecv without src: the first message with `tag` from any rank; the Work's
        _source_rank() (what dist.recv returns, as a group rank) is the sender."""
        works, posts = [], []
        for t in tensors:
            buf, back = self._contig(t)
            works.append(self.comm.irecv(buf, None, tag))
            posts.append(back)
        work = PycollWork(works, tensors, self._chain(*posts))
        work._source_rank = work.source_rank = lambda: _sender(works)  # type: ignore[method-assign]
        return work

    # -- lifetime -------------------------------------------------------------------------------
    def shutdown(self) -> None:
        self.comm.close()

    def abort(self) -> None:
        self.comm.close()


def _sender(works: Sequence[Any]) -> int:
    """The group rank that sent a completed any-source receive (torch's Work.source_rank)."""
    works[-1].wait()
    return int(works[-1].source)


_world: Optional[Communicator] = None  # the default group's communicator, when the default is pycoll


def create(opts: Any, backend_options: Any = None) -> ProcessGroupPycoll:
    """The backend creator torch calls (extended API) once per process group on its members.

    The default group rendezvouses through torch's store (already namespaced per group) and
    connects pycoll's transport; a later group over the default group's ranks is a child of that
    communicator on the same connections (no rendezvous, no new sockets); a group made beside a
    default group of another backend rendezvouses on its own."""
    global _world
    rank, size = int(opts.group_rank), int(opts.group_size)
    seconds = opts.timeout.total_seconds() if opts.timeout is not None else config.load()["PYCOLL_TIMEOUT"]
    members = [int(r) for r in (opts.global_ranks_in_group or [])]
    world = _world if dist.is_initialized() else None
    if world is not None and not world.closed and members and world.size == dist.get_world_size():
        comm = world._child(f"torch/{opts.group_id}", members)
        comm.timeout = seconds
        if comm.rank != rank:
            raise RuntimeError(f"pycoll backend: group {opts.group_id} puts this process at rank {comm.rank}, "
                               f"torch at {rank}")
        return ProcessGroupPycoll(comm, rank, size)
    comm = _rendezvous(opts.store, rank, size, seconds)
    if not dist.is_initialized():
        _world = comm
    _opened.add(comm)
    return ProcessGroupPycoll(comm, rank, size)


_opened: "weakref.WeakSet[Communicator]" = weakref.WeakSet()  # with transports of their own, closed at exit


@atexit.register
def _close_at_exit() -> None:
    """Close what a script left open (no destroy_process_group) while the interpreter is whole: torch's
    store must not be torn down under pycoll's threads (seen: std::terminate at exit on rank 0)."""
    for comm in list(_opened):
        comm.close()


def _rendezvous(store: "dist.Store", rank: int, size: int, seconds: float) -> Communicator:
    """A communicator of its own over `store`, with pycoll.init(rank=, size=, store=)'s token rules."""
    env = dict(os.environ)
    if not env.get("MASTER_ADDR"):  # init_method=tcp:// or a store of the user's: say where the store is
        host = getattr(getattr(store, "underlying_store", store), "host", None)
        env["MASTER_ADDR"] = host or "127.0.0.1"
        env.pop("MASTER_PORT", None)
    job = discover(rank, size, env)
    return connect(job, C10dStore(store, seconds), config.load()["PYCOLL_TRANSPORT"], seconds)


if BACKEND not in dist.Backend.backend_list:  # else torch's autoload did (pycoll/torch_autoload.py)
    dist.Backend.register_backend(BACKEND, create, extended_api=True, devices=["cpu"])

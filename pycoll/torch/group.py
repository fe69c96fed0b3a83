"""The backend's torch ProcessGroup: each of torch's collective and point-to-point calls mapped onto
one pycoll Communicator (lists become flat buffers plus counts), returning a PycollWork; a call the
caller waits on at once (async_op=False) runs on the caller's thread and returns None."""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..comm import Communicator
from ..ops import ReduceOp
from ..torch_autoload import BACKEND
from .options import premul, reduce_op
from .reuse import Handles
from .tensors import contig, dense, flat_cat, scatter_into, sparse_bytes, sparse_sum
from .work import PycollWork, chain

_SPARSE = torch.sparse_coo
# a torch call in pycoll's terms: the communicator's calls to make, arguments bound (async_op= is left
# to ProcessGroupPycoll._issue), and what copies their results into torch's outputs afterwards (or None)
Plan = Tuple[List[Callable[..., Any]], Optional[Callable[[], Any]]]


class ProcessGroupPycoll(dist.ProcessGroup):
    """A torch ProcessGroup whose collectives run on a pycoll Communicator."""

    def __init__(self, comm: Communicator, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self.comm = comm
        self.handles = Handles(comm)  # persistent allreduces of recurring tensor memory (reuse.py)
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

    # -- reductions -----------------------------------------------------------------------------
    def allreduce(self, tensors: List[torch.Tensor], opts: Any = None) -> Optional[PycollWork]:
        op, factor = reduce_op(opts)
        if opts is not None and not opts.asyncOp:  # dist.all_reduce(async_op=False): the caller waits at
            return self._blocking(tensors, op, factor)  # once, so run here: no hand-off to the worker thread
        for t in tensors:
            if t.layout is _SPARSE:
                return self._sparse_allreduce(tensors, op)
        works, posts = [], []
        for t in tensors:
            h = self.handles.get(t, op)
            if h is not None:  # this memory's handle: its run queued as the plain call's would be
                premul(factor, t, in_place=True)
                works.append(h._enqueue())
                continue
            buf, back = contig(t)
            buf = premul(factor, buf, in_place=True)
            works.append(self.comm.allreduce(buf, op=op, async_op=True))
            posts.append(back)
        return PycollWork(works, tensors, chain(*posts))

    def _blocking(self, tensors: List[torch.Tensor], op: ReduceOp, factor: Any) -> Optional[PycollWork]:
        """allreduce on this thread (behind any queued work, in call order). None once it succeeded:
        torch's wrapper then has nothing to wait on (as for a backend that syncs in C++), and a call
        builds no Work, which costs tens of microseconds with caches cold after a large call; a
        finished Work that re-raises in wait() if it failed. A dense tensor runs on its numpy view
        (tensors.dense: one torch call); only the others are asked whether they are sparse or strided.
        Tensors whose memory was allreduced before run their persistent handles (reuse.py)."""
        handles = [self.handles.get(t, op) for t in tensors]
        if None not in handles:
            try:
                for t, h in zip(tensors, handles):
                    premul(factor, t, in_place=True)
                    h()
            except BaseException as e:  # wait() re-raises it, as for an async call
                return PycollWork([], tensors, None, e)
            return None
        views = [dense(t) for t in tensors]
        if any(v is None and t.layout is _SPARSE for t, v in zip(tensors, views)):
            return self._sparse_allreduce(tensors, op)  # torch's wrapper waits on it
        try:
            for t, view in zip(tensors, views):
                if view is None:
                    buf, back = contig(t)
                    self.comm.allreduce(premul(factor, buf, in_place=True), op=op)
                    if back is not None:
                        back()
                else:
                    premul(factor, t, in_place=True)  # (the view's memory)
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
            works = [self.comm.allgather_ragged(sparse_bytes(t.coalesce()), async_op=True) for t in tensors]
        except BaseException as e:  # wait() re-raises it, as for an async call
            return PycollWork([], tensors, None, e)

        def post() -> None:
            for t, w in zip(tensors, works):
                t.copy_(sparse_sum(t, w.get_future().result()[0]))  # (done; not a wait of the caller's)
        return PycollWork(works, tensors, post)

    def allreduce_coalesced(self, tensors: List[torch.Tensor], opts: Any = None) -> Optional[PycollWork]:
        return self.allreduce(tensors, opts)

    def _issue(self, opts: Any, outputs: List[torch.Tensor], plan: "Plan") -> Optional[PycollWork]:
        """Run a plan: its calls (the communicator's, arguments bound) in order, then its copy into
        torch's outputs. With opts.asyncOp False (dist.<call>(async_op=False): the caller waits at once)
        they run on this thread, as the blocking allreduce does, behind any queued work in call order
        and with no hand-off to the worker thread and back: None once they succeeded (torch's wrapper
        then has nothing to wait on), a finished Work that re-raises in wait() if one failed. Else
        each is queued (async_op=True) and one Work over them returned."""
        calls, post = plan
        if opts is not None and not opts.asyncOp:
            try:
                for call in calls:
                    call()
                if post is not None:
                    post()
            except BaseException as e:  # wait() re-raises it, as for an async call
                return PycollWork([], outputs, None, e)
            return None
        return PycollWork([call(async_op=True) for call in calls], outputs, post)

    def _issue_all(self, opts: Any, outputs: List[torch.Tensor], plans: Sequence["Plan"]) -> Optional[PycollWork]:
        """Several plans as one (the coalesced calls): every call in order, then every copy."""
        return self._issue(opts, outputs, ([c for calls, _ in plans for c in calls], chain(*(p for _, p in plans))))

    def reduce(self, tensors: List[torch.Tensor], opts: Any) -> Optional[PycollWork]:
        (op, factor), root = reduce_op(opts), opts.rootRank
        t = tensors[opts.rootTensor]
        buf, back = contig(t)
        scaled = premul(factor, buf, in_place=False)
        if scaled is not buf:  # only root's result lands in `t`; the others keep their input
            buf, back = scaled, (lambda: t.copy_(scaled.view(t.shape)))
        return self._issue(opts, tensors, ([partial(self.comm.reduce, buf, root=root, op=op)],
                                           back if self.comm.rank == root else None))

    def reduce_scatter(self, outputs: List[torch.Tensor], inputs: List[List[torch.Tensor]],
                       opts: Any) -> Optional[PycollWork]:
        (op, factor), calls, posts = reduce_op(opts), [], []
        for out, ins in zip(outputs, inputs):
            src = premul(factor, flat_cat(ins), in_place=True)  # a copy of its own already
            counts = [t.numel() for t in ins]
            buf, back = contig(out)
            calls.append(partial(self.comm.reduce_scatter, src, out=buf, op=op, counts=counts))
            posts.append(back)
        return self._issue(opts, outputs, (calls, chain(*posts)))

    def _reduce_scatter_plan(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> "Plan":
        op, factor = reduce_op(opts)
        src = premul(factor, input if input.is_contiguous() else input.contiguous(), in_place=False)
        buf, back = contig(output)
        return [partial(self.comm.reduce_scatter, src, out=buf, op=op)], back

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: Any) -> Optional[PycollWork]:
        return self._issue(opts, [output], self._reduce_scatter_plan(output, input, opts))

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor],
                                        opts: Any) -> Optional[PycollWork]:
        return self._issue_all(opts, outputs, [self._reduce_scatter_plan(o, i, opts)
                                               for o, i in zip(outputs, inputs)])

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- data movement --------------------------------------------------------------------------
    def broadcast(self, tensors: List[torch.Tensor], opts: Any) -> Optional[PycollWork]:
        calls, posts = [], []
        for t in tensors:
            buf, back = contig(t)
            calls.append(partial(self.comm.broadcast, buf, root=opts.rootRank))
            posts.append(back)
        return self._issue(opts, tensors, (calls, chain(*posts)))

    def _allgather_plan(self, outs: List[torch.Tensor], inp: torch.Tensor) -> "Plan":
        src = inp if inp.is_contiguous() else inp.contiguous()
        counts = [o.numel() for o in outs]
        gathered = torch.empty(sum(counts), dtype=inp.dtype)
        if len(set(counts)) == 1:
            call = partial(self.comm.allgather, src, out=gathered)
        else:
            call = partial(self.comm.allgatherv, src, counts, out=gathered)
        return [call], scatter_into(gathered, outs)

    def allgather(self, outputs: List[List[torch.Tensor]], inputs: List[torch.Tensor],
                  opts: Any = None) -> Optional[PycollWork]:
        return self._issue_all(opts, [o for outs in outputs for o in outs],
                               [self._allgather_plan(outs, inp) for outs, inp in zip(outputs, inputs)])

    def allgather_coalesced(self, outputs: List[List[torch.Tensor]], inputs: List[torch.Tensor],
                            opts: Any = None) -> Optional[PycollWork]:
        """outputs[r][j] receives rank r's inputs[j] (c10d's layout: one list per rank, as gloo)."""
        return self._issue_all(opts, [o for outs in outputs for o in outs],
                               [self._allgather_plan([per_rank[j] for per_rank in outputs], inp)
                                for j, inp in enumerate(inputs)])

    def _all_gather_single_plan(self, output: torch.Tensor, input: torch.Tensor) -> "Plan":
        src = input if input.is_contiguous() else input.contiguous()
        buf, back = contig(output)
        return [partial(self.comm.allgather, src, out=buf)], back

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Any = None) -> Optional[PycollWork]:
        return self._issue(opts, [output], self._all_gather_single_plan(output, input))

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor],
                                    opts: Any = None) -> Optional[PycollWork]:
        return self._issue_all(opts, outputs, [self._all_gather_single_plan(o, i)
                                               for o, i in zip(outputs, inputs)])

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: Optional[List[int]], input_split_sizes: Optional[List[int]],
                          opts: Any = None) -> Optional[PycollWork]:
        src = input if input.is_contiguous() else input.contiguous()
        buf, back = contig(output)
        if not output_split_sizes and not input_split_sizes:
            return self._issue(opts, [output], ([partial(self.comm.alltoall, src, out=buf)], back))
        n = self.comm.size
        in_row = src.numel() // max(src.shape[0], 1) if src.dim() else 1
        out_row = buf.numel() // max(buf.shape[0], 1) if buf.dim() else 1
        sc = [s * in_row for s in input_split_sizes] if input_split_sizes else [src.numel() // n] * n
        rc = [s * out_row for s in output_split_sizes] if output_split_sizes else [buf.numel() // n] * n
        return self._issue(opts, [output], ([partial(self.comm.alltoallv, src, sc, rc, out=buf)], back))

    alltoall_base = all_to_all_single

    def alltoall(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor],
                 opts: Any = None) -> Optional[PycollWork]:
        src = flat_cat(inputs)
        sc, rc = [t.numel() for t in inputs], [t.numel() for t in outputs]
        gathered = torch.empty(sum(rc), dtype=src.dtype)
        return self._issue(opts, outputs, ([partial(self.comm.alltoallv, src, sc, rc, out=gathered)],
                                           scatter_into(gathered, outputs)))

    def gather(self, outputs: List[List[torch.Tensor]], inputs: List[torch.Tensor],
               opts: Any) -> Optional[PycollWork]:
        root, inp = opts.rootRank, inputs[0]
        src = inp if inp.is_contiguous() else inp.contiguous()
        if self.comm.rank == root:
            gathered = torch.empty(self.comm.size * src.numel(), dtype=src.dtype)
            return self._issue(opts, outputs[0], ([partial(self.comm.gather, src, root=root, out=gathered)],
                                                  scatter_into(gathered, outputs[0])))
        return self._issue(opts, [], ([partial(self.comm.gather, src, root=root)], None))

    def scatter(self, outputs: List[torch.Tensor], inputs: List[List[torch.Tensor]],
                opts: Any) -> Optional[PycollWork]:
        root = opts.rootRank
        buf, back = contig(outputs[0])
        src = flat_cat(inputs[0]).to(buf.dtype) if self.comm.rank == root else None
        return self._issue(opts, outputs, ([partial(self.comm.scatter, src, root=root, out=buf)], back))

    def barrier(self, opts: Any = None) -> Optional[PycollWork]:
        return self._issue(opts, [], ([self.comm.barrier], None))

    # -- point to point -------------------------------------------------------------------------
    def send(self, tensors: List[torch.Tensor], dst: int, tag: int) -> PycollWork:
        works = [self.comm.isend(t if t.is_contiguous() else t.contiguous(), dst, tag) for t in tensors]
        return PycollWork(works, tensors)

    def recv(self, tensors: List[torch.Tensor], src: int, tag: int) -> PycollWork:
        works, posts = [], []
        for t in tensors:
            buf, back = contig(t)
            works.append(self.comm.irecv(buf, src, tag))
            posts.append(back)
        return PycollWork(works, tensors, chain(*posts))

    def recv_anysource(self, tensors: List[torch.Tensor], tag: int) -> PycollWork:
        """dist.recv / dist.irecv without src: the first message with `tag` from any rank; the Work's
        _source_rank() (what dist.recv returns, as a group rank) is the sender."""
        works, posts = [], []
        for t in tensors:
            buf, back = contig(t)
            works.append(self.comm.irecv(buf, None, tag))
            posts.append(back)
        work = PycollWork(works, tensors, chain(*posts))
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

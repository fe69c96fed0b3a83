"""What torch.distributed itself costs around a Python backend's collective: the floor under the torch layer.

    python -m pycoll run -n 2 python benchmarks/torch_layer_floor.py [--rounds 200]

A second process group runs on "null", a Python backend whose allreduce does nothing and returns None
(as pycoll's blocking allreduce does once it has run). Each round first runs a real pycoll allreduce of
the size (so caches are as a real call of that size leaves them), then times, alternating by round,
`dist.all_reduce(t, group=null)` or the null backend's own `allreduce([t], opts)` called directly.
The difference of the medians is what torch's wrapper, dispatch and pybind trampoline cost per call
for any backend written in Python: no Python backend's torch layer can be cheaper. For comparison the
same job measures pycoll's torch layer as benchmarks/torch_ddp.py does (`dist.all_reduce` minus
`comm.allreduce` on the same tensor). Rank 0 prints the table (medians over rounds, slowest rank).
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Dict, List

import numpy as np
import torch
import torch.distributed as dist

import pycoll.torch  # noqa: F401  (registers "pycoll")

SIZES = (8, 1 << 20, 16 << 20)


class NullGroup(dist.ProcessGroup):
    """A Python backend whose allreduce returns at once ("null": torch's own cost around a call), or
    ("bare") after the two reads no backend can skip: the op from the options, the tensor's memory."""

    def __init__(self, rank: int, size: int, reads: bool) -> None:
        super().__init__(rank, size)
        self.reads = reads

    def getBackendName(self) -> str:
        return "bare" if self.reads else "null"

    def allreduce(self, tensors: List[torch.Tensor], opts: Any = None) -> None:
        if self.reads:
            opts.reduceOp
            for t in tensors:
                t.numpy()
        return None

    def barrier(self, opts: Any = None) -> None:
        return None


def _creator(reads: bool) -> Any:
    def create(opts: Any, backend_options: Any = None) -> NullGroup:
        return NullGroup(int(opts.group_rank), int(opts.group_size), reads)
    return create


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=200)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.Backend.register_backend("null", _creator(False), extended_api=True, devices=["cpu"])
    dist.Backend.register_backend("bare", _creator(True), extended_api=True, devices=["cpu"])
    dist.init_process_group("pycoll")
    null, bare = dist.new_group(backend="null"), dist.new_group(backend="bare")
    backend = null if isinstance(null, NullGroup) else null._get_backend(torch.device("cpu"))
    world = dist.group.WORLD
    comm = (world if hasattr(world, "comm") else world._get_backend(torch.device("cpu"))).comm
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    results: Dict[int, Dict[str, float]] = {}
    for nbytes in SIZES:
        t = torch.zeros(nbytes // 4)
        x = t.numpy()
        kinds = ["null_dist", "null_direct", "bare_dist", "pycoll_dist", "pycoll_comm"]
        times: Dict[str, List[float]] = {k: [] for k in kinds}
        for r in range(args.rounds + 10):
            for kind in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:  # the order rotates by round
                comm.allreduce(x)  # caches as a call of this size leaves them
                comm.barrier()
                t0 = time.perf_counter()
                if kind == "null_dist":
                    dist.all_reduce(t, group=null)
                    comm.allreduce(x)
                elif kind == "null_direct":
                    backend.allreduce([t], opts)
                    comm.allreduce(x)
                elif kind == "bare_dist":
                    dist.all_reduce(t, group=bare)
                    comm.allreduce(x)
                elif kind == "pycoll_dist":
                    dist.all_reduce(t)
                else:
                    comm.allreduce(x)
                dt = time.perf_counter() - t0
                if r >= 10:
                    times[kind].append(dt)
        medians = np.array([statistics.median(times[k]) for k in sorted(times)])
        slowest = torch.from_numpy(medians)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        results[nbytes] = dict(zip(sorted(times), slowest.tolist()))
    if dist.get_rank() == 0:
        print(f"{dist.get_world_size()} ranks, {args.rounds} rounds per size, each call after a real pycoll "
              f"allreduce of its size; medians (slowest rank)")
        print("| size | null: dist.all_reduce + comm.allreduce | null: allreduce called directly + comm.allreduce "
              "| torch's floor (null: dist minus direct) | with the op and tensor reads (bare: dist minus null direct) "
              "| pycoll: dist.all_reduce minus comm.allreduce |")
        print("|---|---|---|---|---|---|")
        for nbytes, m in results.items():
            print(f"| {nbytes} B | {m['null_dist'] * 1e6:.1f} us | {m['null_direct'] * 1e6:.1f} us "
                  f"| **+{(m['null_dist'] - m['null_direct']) * 1e6:.1f} us** "
                  f"| **+{(m['bare_dist'] - m['null_direct']) * 1e6:.1f} us** "
                  f"| +{(m['pycoll_dist'] - m['pycoll_comm']) * 1e6:.1f} us |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

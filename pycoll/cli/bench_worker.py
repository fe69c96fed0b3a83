"""One rank of one library in `pycoll bench --np N --compare ...` (pycoll/cli/bench_compare.py).

Run by path, not as a module, so a peer library's process imports nothing of pycoll. It connects to
the driver, then blocks on that socket between commands (no library call, no CPU) and, per command,
times in-place float32 SUM allreduce on an ordinary numpy array (a torch tensor over it for Gloo):
the library's barrier, then `iters` calls; it answers wall and CPU (user+sys) seconds of the loop.

    python bench_worker.py LIB DRIVER_PORT [--transport T] [--store-port P]   (under mpirun)
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import sys
import time
import traceback
from typing import Any, Callable, Dict, Tuple

import numpy as np


def cpu_seconds() -> float:
    """User+system CPU of this process, all its threads (the library's progress threads too)."""
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


class Library:
    """The few calls the bench needs from one library: wrap a buffer, allreduce it in place, barrier."""

    def __init__(self, name: str, transport: str, store_port: int) -> None:
        self.name, self.algo = name, lambda nbytes: ""
        self.wrap: Callable[[np.ndarray], Any] = lambda x: x
        if name == "pycoll":
            import pycoll
            comm = pycoll.init(transport=transport or None)
            self.rank, self.size, self.close = comm.rank, comm.size, comm.close
            self.allreduce, self.barrier = comm.allreduce, comm.barrier
            self.algo = lambda nbytes: comm.selector.choose("allreduce", nbytes, comm.size, None, comm.topology)
            self.transport = comm.transport.name
        elif name in ("mpi", "mpi-tcp"):
            from mpi4py import MPI
            world = MPI.COMM_WORLD
            self.rank, self.size, self.close, self.barrier = world.rank, world.size, lambda: None, world.Barrier
            self.allreduce = lambda x: world.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
            self.transport = "btl tcp,self" if name == "mpi-tcp" else "default btl (vader,self)"
        elif name == "gloo":
            import torch
            import torch.distributed as dist
            rank, size = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{store_port}", rank=rank,
                                    world_size=size)
            self.rank, self.size, self.close, self.barrier = rank, size, dist.destroy_process_group, dist.barrier
            self.wrap, self.allreduce = torch.from_numpy, dist.all_reduce
            self.transport = "tcp"
        else:
            raise ValueError(f"bench worker: no library {name!r} (pycoll, mpi, mpi-tcp, gloo)")


def first_call(lib: Library, nbytes: int) -> Tuple[np.ndarray, Any, int]:
    """A buffer as a user makes one (np.ones: for large sizes numpy puts it 16 bytes into a page), its
    wrapper, and how many elements the first allreduce got wrong; then zeros, so repeated in-place
    sums stay finite."""
    x = np.ones(max(nbytes // 4, 1), np.float32)
    buf = lib.wrap(x)
    lib.allreduce(buf)
    wrong = int(np.count_nonzero(x != lib.size))
    x.fill(0)
    return x, buf, wrong


def serve(lib: Library, conn: socket.socket) -> None:
    """Answer the driver's commands (one JSON line each) until it says quit or hangs up."""
    bufs: Dict[int, Tuple[np.ndarray, Any, int]] = {}
    reader = conn.makefile("r")
    for line in reader:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            return
        nbytes = cmd["nbytes"]
        if nbytes not in bufs:
            bufs[nbytes] = first_call(lib, nbytes)
        x, buf, wrong = bufs[nbytes]
        for _ in range(cmd["warmup"]):
            lib.allreduce(buf)
        lib.barrier()
        c0, t0 = cpu_seconds(), time.perf_counter()
        for _ in range(cmd["iters"]):
            lib.allreduce(buf)
        seconds, cpu = time.perf_counter() - t0, cpu_seconds() - c0
        reply = {"seconds": seconds, "cpu": cpu, "wrong": wrong, "offset": x.ctypes.data % 4096,
                 "algo": lib.algo(x.nbytes)}
        conn.sendall((json.dumps(reply) + "\n").encode())


def main() -> None:
    """Serve the driver; any error ends this process at once, so mpirun ends the job (rather than the
    other ranks waiting in a call, or this one in MPI_Finalize)."""
    try:
        run()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def run() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("lib")
    ap.add_argument("driver_port", type=int)
    ap.add_argument("--transport", default="")
    ap.add_argument("--store-port", type=int, default=0)
    a = ap.parse_args()
    lib = Library(a.lib, a.transport, a.store_port)
    with socket.create_connection(("127.0.0.1", a.driver_port), timeout=60) as conn:
        conn.settimeout(None)
        hello = {"lib": a.lib, "transport": a.transport, "rank": lib.rank, "size": lib.size, "pid": os.getpid(),
                 "via": lib.transport}
        conn.sendall((json.dumps(hello) + "\n").encode())
        serve(lib, conn)
    lib.close()


if __name__ == "__main__":
    main()

"""One rank of one library in `pycoll bench --np N --compare ...` (pycoll/cli/bench_compare.py).

Run by path, not as a module, so a peer library's process imports nothing of pycoll. It connects to
the driver, then blocks on that socket between commands (no library call, no CPU) and, per command,
times in-place float32 SUM allreduce on an ordinary numpy array (a torch tensor over it for Gloo and
for pycoll through torch): the library's barrier, then `iters` calls; it answers wall and CPU
(user+sys) seconds of the loop. Libraries: pycoll (with --persistent: one allreduce_init handle per
buffer, called), mpi, mpi-tcp, gloo, torch-pycoll (dist.all_reduce on backend "pycoll") and
python-shm, Python's floor: the same exchange as pycoll's one-shot board written as a bare loop over
a shared-memory file, with no pycoll in it (ShmFloor).

    python bench_worker.py LIB DRIVER_PORT [--transport T] [--persistent] [--store-port P]   (under mpirun)
"""
from __future__ import annotations

import argparse
import functools
import json
import mmap
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


class ShmFloor:
    """Python's floor for a small allreduce among the processes of one host: what pycoll's one-shot
    board does, in a bare loop and nothing else. Each rank has a counter (its own 64-byte line) and
    two slots in a file in /dev/shm; a call copies the buffer into this rank's slot b % 2, publishes
    b, spins (sched_yield) until every counter reaches b, and sums the slots in rank order into the
    buffer. A slot is written again at call b + 2, after every rank published b + 1, that is, finished
    reading call b. No doorbell (a waiter never sleeps), no checks, no timeout, no recorder."""

    LINE = 64

    def __init__(self, rank: int, size: int, tag: str) -> None:
        self.rank, self.size, self.tag = rank, size, tag
        self._maps: Dict[int, Any] = {}

    def _region(self, nbytes: int) -> Tuple[Any, memoryview]:
        """The mapped file for calls of `nbytes` (made by rank 0, opened by the others), and its counters."""
        if nbytes in self._maps:
            return self._maps[nbytes]
        slot = -(-nbytes // self.LINE) * self.LINE
        total = self._header() + 2 * self.size * slot
        path = f"/dev/shm/pycoll-bench-floor-{self.tag}-{nbytes}"
        if self.rank == 0:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, total)
        else:
            deadline = time.monotonic() + 60
            while True:
                try:
                    fd = os.open(path, os.O_RDWR)
                    if os.fstat(fd).st_size == total:
                        break
                    os.close(fd)
                except FileNotFoundError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"python-shm: rank 0 did not make {path}")
                time.sleep(0.001)
        mem = mmap.mmap(fd, total)
        os.close(fd)
        words = memoryview(mem).cast("q")
        ready = self.LINE * self.size // 8  # then a word per rank: it has mapped the file
        if self.rank == 0:
            words[ready] = 1
        while words[ready] != 1:
            time.sleep(0.001)
        words[ready + 1 + self.rank] = 1
        if self.rank == 0:  # once every rank has it mapped, the name can go: nothing is left behind
            while not all(words[ready + 1 + r] for r in range(self.size)):
                time.sleep(0.001)
            os.unlink(path)
        self._maps[nbytes] = (mem, words, slot)
        return self._maps[nbytes]

    def bind(self, x: np.ndarray) -> Callable[[], None]:
        """The call, for this buffer: views of every slot made once."""
        mem, words, slot = self._region(x.nbytes)
        base, n, me = self._header(), self.size, self.rank
        slots = [[np.frombuffer(mem, x.dtype, x.size, base + (k * n + r) * slot) for r in range(n)] for k in (0, 1)]
        counter = [self.LINE * r // 8 for r in range(n)]
        mine, others = counter[me], [c for r, c in enumerate(counter) if r != me]
        add, yield_cpu, state = np.add, os.sched_yield, [words[mine]]

        def call() -> None:
            b = state[0] = state[0] + 1
            s = slots[b & 1]
            s[me][...] = x
            words[mine] = b
            for c in others:
                while words[c] < b:
                    yield_cpu()
            add(s[0], s[1], out=x)
            for r in range(2, n):
                add(x, s[r], out=x)
        return call

    def _header(self) -> int:
        """Bytes before the slots: a counter line per rank, then the ready word and a mapped flag per rank."""
        return self.LINE * self.size + -(-8 * (self.size + 1) // self.LINE) * self.LINE


class Library:
    """The few calls the bench needs from one library: wrap a buffer, bind an in-place allreduce to
    it (a call with no arguments: a persistent handle for pycoll --persistent), barrier."""

    def __init__(self, name: str, transport: str, store_port: int, persistent: bool = False,
                 tag: str = "") -> None:
        self.name, self.algo = name, lambda nbytes: ""
        self.wrap: Callable[[np.ndarray], Any] = lambda x: x
        self.bind: Callable[[Any], Callable[[], Any]] = lambda buf: functools.partial(self.allreduce, buf)
        if name == "pycoll":
            import pycoll
            comm = pycoll.init(transport=transport or None)
            self.rank, self.size, self.close = comm.rank, comm.size, comm.close
            self.allreduce, self.barrier = comm.allreduce, comm.barrier
            if persistent:
                self.bind = comm.allreduce_init
            self.algo = lambda nbytes: comm.selector.choose("allreduce", nbytes, comm.size, None, comm.topology)
            self.transport = comm.transport.name + (", persistent handles" if persistent else "")
        elif name == "python-shm":
            rank, size = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
            floor = ShmFloor(rank, size, tag)
            # (close: nothing to do; the files were unlinked once every rank mapped them)
            self.rank, self.size, self.close, self.bind = rank, size, lambda: None, floor.bind
            self.barrier = floor.bind(np.zeros(1, np.float32))
            self.transport = "a bare loop over /dev/shm"
        elif name in ("torch-pycoll", "gloo"):  # torch.distributed on backend pycoll or gloo
            import torch
            import torch.distributed as dist
            backend = "pycoll" if name == "torch-pycoll" else "gloo"
            if backend == "pycoll":
                import pycoll.torch  # noqa: F401  (registers the backend)
            rank, size = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{store_port}", rank=rank,
                                    world_size=size)
            self.rank, self.size, self.close, self.barrier = rank, size, dist.destroy_process_group, dist.barrier
            self.wrap, self.allreduce = torch.from_numpy, dist.all_reduce
            self.transport = "dist.all_reduce, backend pycoll" if backend == "pycoll" else "tcp"
        elif name in ("mpi", "mpi-tcp"):
            from mpi4py import MPI
            world = MPI.COMM_WORLD
            self.rank, self.size, self.close, self.barrier = world.rank, world.size, lambda: None, world.Barrier
            self.allreduce = lambda x: world.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
            self.transport = "btl tcp,self" if name == "mpi-tcp" else "default btl (vader,self)"
        else:
            raise ValueError(f"bench worker: no library {name!r} (pycoll, mpi, mpi-tcp, gloo, python-shm, torch-pycoll)")


def first_call(lib: Library, nbytes: int) -> Tuple[np.ndarray, Callable[[], Any], int]:
    """A buffer as a user makes one (np.ones: for large sizes numpy puts it 16 bytes into a page), the
    library's call bound to it, and how many elements the first allreduce got wrong; then zeros, so
    repeated in-place sums stay finite."""
    x = np.ones(max(nbytes // 4, 1), np.float32)
    call = lib.bind(lib.wrap(x))
    call()
    wrong = int(np.count_nonzero(x != lib.size))
    x.fill(0)
    return x, call, wrong


def serve(lib: Library, conn: socket.socket) -> None:
    """Answer the driver's commands (one JSON line each) until it says quit or hangs up."""
    bufs: Dict[int, Tuple[np.ndarray, Callable[[], Any], int]] = {}
    reader = conn.makefile("r")
    for line in reader:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            return
        nbytes = cmd["nbytes"]
        if nbytes not in bufs:
            bufs[nbytes] = first_call(lib, nbytes)
        x, call, wrong = bufs[nbytes]
        for _ in range(cmd["warmup"]):
            call()
        lib.barrier()
        c0, t0 = cpu_seconds(), time.perf_counter()
        for _ in range(cmd["iters"]):
            call()
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
    ap.add_argument("--persistent", action="store_true")
    ap.add_argument("--store-port", type=int, default=0)
    a = ap.parse_args()
    lib = Library(a.lib, a.transport, a.store_port, a.persistent, str(a.driver_port))
    with socket.create_connection(("127.0.0.1", a.driver_port), timeout=60) as conn:
        conn.settimeout(None)
        hello = {"lib": a.lib, "transport": a.transport, "rank": lib.rank, "size": lib.size, "pid": os.getpid(),
                 "via": lib.transport}
        conn.sendall((json.dumps(hello) + "\n").encode())
        serve(lib, conn)
    lib.close()


if __name__ == "__main__":
    main()

"""async_op=True: launch an allreduce, keep working, wait later, so the communication hides behind the work.

    pycoll run -n 2 python examples/async_overlap.py

Each rank times (best of a few tries, every try starting at a barrier, the variants taking turns) the
allreduce alone, the work alone, one after the other, and overlapped (launch, work, Work.wait()), for
two kinds of work:

* numpy: elementwise math on the CPU. It releases the GIL, so pycoll's progress thread can run
  beside it, but only if a core is free: with fewer cores than busy threads there is little to win;
* off-CPU: time.sleep, standing in for a GPU kernel or I/O: the CPU is free and the allreduce hides.
"""
import time
from typing import Callable, List

import numpy as np

import pycoll

ELEMENTS = 1 << 23  # 32 MiB of float32 to allreduce
TRIES = 9


def best(comm: pycoll.Communicator, *fns: Callable[[], None]) -> List[float]:
    """Fastest of TRIES runs of each fn(), in seconds, each run started with all ranks in step. The
    functions take turns, so a moment of load elsewhere on the machine slows a try of each, not
    every try of one."""
    times: List[List[float]] = [[] for _ in fns]
    for _ in range(TRIES):
        for fn, spent in zip(fns, times):
            comm.barrier()
            start = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - start)
    return [min(spent) for spent in times]


def agree(comm: pycoll.Communicator, value: float) -> float:
    """The largest value any rank proposes, so that every rank does the same amount of work."""
    return float(comm.allreduce(np.array([value]), op="max")[0])


def main() -> None:
    with pycoll.init() as comm:
        grad = np.empty(ELEMENTS, np.float32)
        scratch = np.random.default_rng(comm.rank).random(ELEMENTS // 4).astype(np.float32)

        def allreduce() -> None:
            grad.fill(comm.rank + 1)
            comm.allreduce(grad)

        def overlap(work: Callable[[], None]) -> Callable[[], None]:
            def run() -> None:
                grad.fill(comm.rank + 1)
                handle = comm.allreduce(grad, async_op=True)  # returns at once; a worker thread sends
                work()
                handle.wait()
            return run

        t_comm, one_pass = best(comm, allreduce, lambda: np.sin(scratch, out=scratch))
        passes = int(agree(comm, max(1, round(t_comm / one_pass))))
        nap = agree(comm, t_comm)
        works = {"numpy": lambda: [np.sin(scratch, out=scratch) for _ in range(passes)],
                 "off-CPU": lambda: time.sleep(nap)}
        expected = comm.size * (comm.size + 1) / 2
        for name, work in works.items():
            t_work, t_seq, t_overlap = best(comm, work, lambda: (allreduce(), work()), overlap(work))
            ok = bool(np.all(grad == expected))
            print(f"rank {comm.rank}/{comm.size} {name} work: allreduce {grad.nbytes >> 20} MiB "
                  f"{t_comm * 1e3:.1f} ms, work {t_work * 1e3:.1f} ms, one after the other {t_seq * 1e3:.1f} ms, "
                  f"overlapped {t_overlap * 1e3:.1f} ms ({1 - t_overlap / t_seq:.0%} saved); "
                  f"result {'OK' if ok else 'WRONG'}")


if __name__ == "__main__":
    main()

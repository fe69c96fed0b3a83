"""A training-like loop of allreduces in which the last rank misbehaves once, as the flight-recorder
tests (tests/test_trace.py) need: `python tests/trace_job.py MODE`, under `pycoll run` or mpirun.

MODE: ok (nobody misbehaves), skip (skips one allreduce), bcast (calls broadcast instead),
dtype (passes float64), sleep (computes forever), kill (SIGKILLs itself), deadlock (ranks 0 and 1
both receive from each other before sending).
"""
import os
import signal
import sys
import time

import numpy as np

import pycoll

STEPS, BAD_STEP = 8, 5


def compute_forever() -> None:
    while True:
        time.sleep(3600)


def main(mode: str) -> None:
    comm = pycoll.init()
    bad = comm.rank == comm.size - 1
    x = np.ones(4, np.float32)
    if mode == "deadlock":
        comm.allreduce(x)
        if comm.rank < 2:
            comm.recv(x, 1 - comm.rank)  # each waits for the other's message first: neither sends
            comm.send(x, 1 - comm.rank)
        comm.barrier()
        return
    for step in range(STEPS):
        if bad and step == BAD_STEP:
            if mode == "skip":
                continue
            if mode == "bcast":
                comm.broadcast(x, root=0)
                continue
            if mode == "dtype":
                comm.allreduce(np.ones(4, np.float64))
                continue
            if mode == "sleep":
                compute_forever()
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
        comm.allreduce(x)
    comm.barrier()
    print(f"rank {comm.rank}: done")


if __name__ == "__main__":
    main(sys.argv[1])

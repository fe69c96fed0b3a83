"""Allgather under mpirun: every rank contributes a row and every rank prints the whole table.

    mpirun -np 3 python examples/mpirun_allgather.py
    pycoll run -n 3 python examples/mpirun_allgather.py   (works the same)

pycoll.init() reads the rank from OMPI_COMM_WORLD_*; with no MASTER_ADDR, rank 0 publishes the
rendezvous store's address over mpi4py. allgatherv shows uneven contributions: rank r sends r+1 values.
"""
import os

import numpy as np

import pycoll


def main() -> None:
    with pycoll.init() as comm:
        row = np.array([comm.rank, comm.rank ** 2, os.getpid()], np.int64)
        table = comm.allgather(row)  # shape (size, 3), the same on every rank
        counts = [r + 1 for r in range(comm.size)]
        ragged = comm.allgatherv(np.full(comm.rank + 1, comm.rank, np.int64), counts)
        ranks = list(range(comm.size))
        ok = (table[:, 0].tolist() == ranks and table[:, 1].tolist() == [r * r for r in ranks]
              and table[comm.rank, 2] == os.getpid() and len(set(table[:, 2].tolist())) == comm.size
              and ragged.tolist() == [r for r in ranks for _ in range(r + 1)])
        print(f"rank {comm.rank}/{comm.size}: allgather ranks {table[:, 0].tolist()} squares "
              f"{table[:, 1].tolist()} pids {table[:, 2].tolist()}; allgatherv {ragged.tolist()} "
              f"{'OK' if ok else 'WRONG'}")


if __name__ == "__main__":
    main()

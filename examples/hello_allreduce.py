"""Hello, allreduce: every rank contributes its rank number and all end with the same sum.

    pycoll run -n 4 python examples/hello_allreduce.py
    mpirun -np 4 python examples/hello_allreduce.py
"""
import numpy as np

import pycoll


def main() -> None:
    with pycoll.init() as comm:
        x = np.full(4, comm.rank, dtype=np.float32)
        comm.allreduce(x)
        expected = comm.size * (comm.size - 1) / 2
        print(f"rank {comm.rank}/{comm.size} (local {comm.local_rank}/{comm.local_size}): "
              f"allreduce(sum of ranks) = {x.tolist()} {'OK' if np.all(x == expected) else 'WRONG'}")
        comm.barrier()


if __name__ == "__main__":
    main()

"""The collective matrix over shared memory, and over auto mixing shm and tcp on two fake hosts."""
import os

import pytest

from collective_cases import run_matrix
from multiproc import run_ranks
from test_collectives import ALL, _assert_matrix

SIZES = [2, 3, 4, 8]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", SIZES)
def test_matrix_over_shm(n):
    _assert_matrix(run_ranks(run_matrix, n, ALL, n in (3, 4), timeout=280, env={"PYCOLL_TRANSPORT": "shm"}))


def _matrix_on_two_fake_hosts(rank, collectives):
    """Even ranks on one host, odd ranks on another: each pair of neighbours talks over tcp."""
    os.environ["PYCOLL_HOSTID"] = f"fake-host-{rank % 2}"
    import pycoll
    with pycoll.init() as comm:
        assert comm.transport.name == ("auto(tcp)" if comm.size == 2 or comm.size == 3 and rank == 1
                                       else "auto(shm+tcp)"), comm.transport.name
        return run_matrix(comm, collectives, False)  # big messages mixed: see test_shm


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", SIZES)
def test_matrix_over_auto_with_two_fake_hosts(n):
    _assert_matrix(run_ranks(_matrix_on_two_fake_hosts, n, ALL, timeout=280, init=False,
                             env={"PYCOLL_TRANSPORT": "auto"}))

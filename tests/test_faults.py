"""Faults: a rank killed mid-collective is named by every survivor within seconds, no hang."""
import os
import signal
import time

import numpy as np
import pytest

from multiproc import run_ranks

pytestmark = pytest.mark.timeout(120)


def _killed_mid_allreduce(comm, victim, transport):
    import pycoll
    x = np.ones(1 << 20, np.float32)
    comm.allreduce(x)  # everyone is connected and working
    if comm.rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        for _ in range(50):
            comm.allreduce(x)
    except pycoll.PeerError as e:
        return "PeerError", e.peer, str(e), time.monotonic() - t0
    except pycoll.TimeoutError as e:
        return "TimeoutError", e.peers, str(e), time.monotonic() - t0
    return "no error", None, "", time.monotonic() - t0


@pytest.mark.parametrize("transport", ["tcp"])
def test_survivors_name_the_dead_rank_within_5s(transport):
    n, victim = 4, 2
    results = run_ranks(_killed_mid_allreduce, n, victim, transport, expect_fail=True, timeout=90,
                        env={"PYCOLL_TRANSPORT": transport, "PYCOLL_TIMEOUT": "30"})
    for rank, (ok, value) in enumerate(results):
        if rank == victim:
            assert not ok  # it died without a result
            continue
        assert ok, value
        kind, peer, msg, took = value
        assert took < 5.0, f"rank {rank} took {took:.1f} s to notice"
        # the direct neighbours see the dead rank; the others see a neighbour's error or the dead rank
        assert kind == "PeerError", (rank, kind, msg)
        assert "allreduce" in msg and f"rank {rank}" in msg

"""A payload from another host whose receive is posted late is read while the receiver computes.

A receiver that leaves data unread delays its TCP acknowledgements, so the sender runs out of window
and the transfer stalls until the receive is posted (pipeline stages post their receive just before
they need it). The tcp transport's background thread (PYCOLL_TCP_PROGRESS_MS) reads it aside instead,
while bulk payloads pass between the hosts (it sleeps otherwise).
Two emulated hosts (tests/netns_cluster.py), one rank each, real sockets.
"""
from __future__ import annotations

import os
import time
from typing import Any, Dict

import numpy as np
import pytest

from netns_cluster import Cluster, unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=f"emulated cluster: {unavailable()}")

NBYTES = 2 << 20


def _parked_complete(comm: Any) -> bool:
    """Whether the tcp part holds a payload from rank 0 read whole before its receive was posted."""
    tcp = comm.transport._tcp
    with tcp._match:
        return any(getattr(arrival, "complete", False)
                   for queue in tcp.matcher.unexpected.values() for _, (_, arrival) in queue)


def late_receive(comm: Any, quiet_s: float) -> Dict[str, Any]:
    """After one 2 MiB exchange (bulk traffic between the hosts: the reader looks while it lasts), rank 0
    sends 2 MiB; rank 1 makes no call for up to `quiet_s` s (as if computing), watching whether the
    payload was read meanwhile, then receives it."""
    data = np.arange(NBYTES // 4, dtype=np.float32)
    if comm.rank == 0:
        comm.send(data, 1)
    else:
        comm.recv(np.zeros_like(data), 0)
    comm.barrier()
    if comm.rank == 0:
        comm.send(data, 1)
        comm.barrier()
        return {}
    read_early, deadline = False, time.monotonic() + quiet_s
    while not read_early and time.monotonic() < deadline:
        time.sleep(0.005)  # (no call into pycoll: only a thread of its own can read the stream)
        read_early = _parked_complete(comm)
    got = np.zeros_like(data)
    comm.recv(got, 0)
    comm.barrier()
    return {"read_early": read_early, "equal": bool(np.array_equal(got, data))}


def _run(progress_ms: str, quiet_s: float) -> Dict[str, Any]:
    env = {"PYCOLL_TCP_PROGRESS_MS": progress_ms, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    with Cluster(hosts=2, rate_mbit=1000) as cluster:
        return cluster.run("test_tcp_background:late_receive", [0, 1], args=[quiet_s], env=env, timeout=100)[1]


@pytest.mark.timeout(120)
def test_a_late_receive_finds_its_payload_read():
    got = _run("2", 20.0)
    assert got["equal"]
    assert got["read_early"], "the payload was not read while the receiver made no call"


@pytest.mark.timeout(120)
def test_without_the_thread_the_payload_waits_for_its_receive():
    got = _run("0", 0.5)
    assert got["equal"]
    assert not got["read_early"], "with PYCOLL_TCP_PROGRESS_MS=0 nothing should read before the receive"

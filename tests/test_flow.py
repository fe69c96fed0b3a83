"""tcp flow control (pycoll/transports/flow.py): a rank that runs ahead cannot fill its peers' memory,
held sends keep their order, and a rank waiting on credit still drains what comes in (no deadlock)."""
import re
import time

import numpy as np
import pytest

from multiproc import run_ranks
from pycoll.transports import flow
from pycoll.transports.flow import ASK_AFTER, OVERHEAD, PINNED, Credits

TCP = {"PYCOLL_TRANSPORT": "tcp"}
SMALL = PINNED + OVERHEAD  # what a message of up to 8 KiB costs


# -- the credit bookkeeping alone ----------------------------------------------------------------
def test_sends_past_the_window_wait_behind_each_other():
    c = Credits([1], 2, 10 * SMALL)
    assert all(c.admit(1, 100) for _ in range(10))
    assert not c.admit(1, 100)  # the window is full
    c.hold(1, 100, lambda: None, None, now=0.0)
    assert c.held == 1
    assert len(c.credit(1, 5 * SMALL, now=0.0)) == 1
    assert c.admit(1, 100)      # room again, nothing held
    c.hold(1, 100, lambda: None, None, now=0.0)  # (as if the window were full again)
    assert not c.admit(1, 0)    # behind a held send even though it would fit: order is kept


def test_credit_releases_held_sends_in_order():
    c = Credits([1], 2, 4 * SMALL)
    for _ in range(4):
        assert c.admit(1, 1)
    order = []
    for i in range(5):
        c.hold(1, 1, lambda i=i: order.append(i), None, now=0.0)
    for start in c.credit(1, 2 * SMALL, now=0.0):
        start()
    assert order == [0, 1] and c.held == 3
    for start in c.credit(1, 10 * SMALL, now=0.0):
        start()
    assert order == [0, 1, 2, 3, 4] and c.held == 0


def test_a_message_bigger_than_the_window_goes_alone():
    c = Credits([1], 2, 4 * SMALL)
    assert c.admit(1, 10 * SMALL)       # nothing in flight: it goes
    assert not c.admit(1, 1)            # and nothing else until it is consumed
    c.hold(1, 1, lambda: None, None, now=0.0)
    assert len(c.credit(1, flow.cost(10 * SMALL), now=0.0)) == 1


def test_receiver_returns_credit_in_batches_or_at_once_when_asked():
    c = Credits([0], 2, 8 * SMALL)  # batches of 2 * SMALL
    assert c.consumed(0, 10) == 0
    assert c.consumed(0, 10) == 2 * SMALL
    assert c.consumed(0, 10) == 0
    assert c.asked(0) == SMALL            # asked: all it owes, now
    assert c.asked(0) == 0                # owes nothing: the next consume returns at once
    assert c.consumed(0, 10) == SMALL
    assert c.consumed(0, 10) == 0         # and then batches again


def test_a_held_sender_asks_once_after_ask_after():
    c = Credits([1], 2, SMALL)
    assert c.admit(1, 1)
    c.hold(1, 1, lambda: None, None, now=10.0)
    assert c.asks_due(10.0)[0] == [] and c.asks_due(10.0)[1] == pytest.approx(ASK_AFTER)
    assert c.asks_due(10.0 + ASK_AFTER)[0] == [1]
    assert c.asks_due(20.0) == ([], float("inf"))  # one ASK out at a time, until credit comes
    c.hold(1, 1, lambda: None, None, now=20.0)
    assert len(c.credit(1, SMALL, now=20.0)) == 1   # one of two goes; the other waits again
    assert c.asks_due(20.0 + ASK_AFTER)[0] == [1]
    assert c.drop(1) and c.held == 0 and c.asks_due(30.0) == ([], float("inf"))


# -- over real ranks -------------------------------------------------------------------------------
CALLS = 10_000
SIZES = [8 << k for k in range(14)]  # 8 B .. 64 KiB: all ride zmq
SLEEP = 3.0
GROWTH_MIB = 20  # seen +3..6 MiB (a 4 MiB window from one sender); without flow control +135 MiB


def _rss_mib():
    with open("/proc/self/status") as fh:
        return int(re.search(r"VmRSS:\s+(\d+) kB", fh.read()).group(1)) / 1024


def _run_ahead(comm):
    """Rank 0 broadcasts CALLS times while the others sleep; what they hold when they wake."""
    bufs = {n: np.empty(n, np.uint8) for n in SIZES}
    comm.barrier()
    before = _rss_mib()
    if comm.rank:
        time.sleep(SLEEP)
    woke = _rss_mib()
    bad = 0
    for i in range(CALLS):
        buf = bufs[SIZES[i % len(SIZES)]]
        if comm.rank == 0:
            buf.fill(i % 251)
        comm.broadcast(buf, root=0)
        bad += int(np.any(buf != i % 251))
    comm.barrier()
    flow = comm.transport._flow
    return {"before": before, "woke": woke, "bad": bad, "flow": flow.stats() if flow else {}}


@pytest.mark.timeout(120)
def test_a_rank_running_ahead_keeps_its_peers_memory_bounded():
    results = run_ranks(_run_ahead, 4, timeout=110, env=TCP)
    for rank, r in enumerate(results):
        print(rank, {k: v for k, v in r.items() if k != "flow"}, r["flow"]["held_back"])
        assert r["bad"] == 0, (rank, r)
        assert r["woke"] - r["before"] < GROWTH_MIB, (rank, r)
    assert results[0]["flow"]["held_back"] > 0  # the window held the root back while they slept


N_P2P = 3000


def _both_ahead(comm):
    """Each rank posts N_P2P sends to the other (most of them held back for credit), then the receives,
    then waits on all: a rank waiting on held sends must still drain and answer what comes in. Sizes
    cycle across the bulk threshold on one tag, so held eager sends and bulk announcements must keep
    their order."""
    peer = 1 - comm.rank
    sizes = [100, 200_000, 1000, 8]
    ch = comm.channel("flow-test", timeout=60)
    out = [np.full(sizes[i % 4], (i + comm.rank) % 251, np.uint8) for i in range(N_P2P)]
    got = [np.empty(sizes[i % 4], np.uint8) for i in range(N_P2P)]
    if comm.rank == 1:
        time.sleep(1.0)
    reqs = [ch.isend(x, peer, tag=7) for x in out] + [ch.irecv(g, peer, tag=7) for g in got]
    ch.wait(*reqs)
    bad = sum(int(np.any(g != (i + peer) % 251)) for i, g in enumerate(got))
    return {"bad": bad, "flow": comm.transport._flow.stats()}


@pytest.mark.timeout(120)
def test_ranks_waiting_on_credit_still_drain_their_inbound_traffic():
    results = run_ranks(_both_ahead, 2, timeout=110, env=TCP)
    for rank, r in enumerate(results):
        assert r["bad"] == 0, (rank, r)
        assert r["flow"]["held"] == 0, (rank, r)
    assert results[0]["flow"]["held_back"] > 0, results

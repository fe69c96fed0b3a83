"""Per-call `timeout=`: a call some rank never makes raises pycoll.TimeoutError within about that
timeout (not PYCOLL_TIMEOUT), naming the collective, its call number and the peers not heard from;
a bad timeout is refused before anything is sent."""
import math
import time

import numpy as np
import pytest

from multiproc import run_ranks

pytestmark = pytest.mark.timeout(120)
T = 1.0            # the per-call timeout under test
SLACK = 3.0        # how much later than T a loaded 2-core machine may raise
ENV_TIMEOUT = "60"  # PYCOLL_TIMEOUT: far longer, so only timeout= can explain a quick error
ABSENT = 2

# name -> call with timeout=T; rooted ones are rooted at the absent rank, so every caller waits on it
CALLS = {
    "allreduce": lambda c: c.allreduce(np.ones(1000, np.float32), timeout=T),
    "barrier": lambda c: c.barrier(timeout=T),
    "broadcast": lambda c: c.broadcast(np.ones(10), root=ABSENT, timeout=T),
    "allgather": lambda c: c.allgather(np.ones(10), timeout=T),
    "reduce_scatter": lambda c: c.reduce_scatter(np.ones(30), timeout=T),
    "alltoall": lambda c: c.alltoall(np.ones(30), timeout=T),
    "scatter": lambda c: c.scatter(None, root=ABSENT, out=np.empty(4), timeout=T),
    "async allreduce": lambda c: c.allreduce(np.ones(8), async_op=True, timeout=T).wait(),
}


def _one_rank_never_calls(comm):
    """Ranks other than ABSENT make every call of CALLS; ABSENT stays alive but never calls (it waits
    for every caller's point-to-point goodbye, which takes no call number, so it leaves only once no
    one waits on it any more)."""
    import pycoll
    comm.allreduce(np.ones(4))  # call 1: everyone is connected
    if comm.rank == ABSENT:
        for caller in (0, 1):
            comm.recv(np.empty(1), caller, tag=99, timeout=100)
        return None
    seen = {}
    for seq, (name, call) in enumerate(CALLS.items(), start=2):
        t0 = time.monotonic()
        try:
            call(comm)
            seen[name] = ("no error", seq, "", [], time.monotonic() - t0)
        except pycoll.TimeoutError as e:
            seen[name] = ("TimeoutError", seq, str(e), e.peers, time.monotonic() - t0)
    comm.send(np.ones(1), ABSENT, tag=99)
    return seen


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_call_one_rank_never_makes_times_out_naming_call_and_peers(transport):
    results = run_ranks(_one_rank_never_calls, 3, timeout=110,
                        env={"PYCOLL_TRANSPORT": transport, "PYCOLL_TIMEOUT": ENV_TIMEOUT})
    for name in CALLS:
        blamed = set()
        for rank in (0, 1):
            kind, seq, msg, peers, took = results[rank][name]
            print(f"{transport} rank {rank} {name}: {kind} after {took:.2f} s, peers {peers}")
            assert kind == "TimeoutError", (rank, name, kind)
            assert T * 0.9 <= took < T + SLACK, (rank, name, took)
            collective = name.split()[-1]
            assert f"{collective} (call {seq} on world, rank {rank} of 3) timed out after {T:g} s" in msg, msg
            assert peers and all(f"rank {p}" in msg for p in peers), (peers, msg)
            blamed |= set(peers)
        assert ABSENT in blamed, (name, blamed)  # whoever waits on it directly names it


def _p2p_timeouts(comm, transport):
    import pycoll
    out = {}
    if comm.rank == 0:
        for what, call in [("recv", lambda: comm.recv(np.empty(8), 1, tag=5, timeout=T)),
                           ("send", lambda: comm.send(np.ones(16 << 20, np.float32), 1, tag=6, timeout=T))]:
            if what == "send" and transport != "shm":
                continue  # tcp buffers a send whole at the receiver: only shm's ring can fill up
            t0 = time.monotonic()
            try:
                call()
                out[what] = ("no error", "", [], time.monotonic() - t0)
            except pycoll.TimeoutError as e:
                out[what] = ("TimeoutError", str(e), e.peers, time.monotonic() - t0)
    else:
        time.sleep(T + SLACK + 1)  # not in pycoll at all: nothing drains rank 0's send on shm
    comm.barrier(timeout=30)
    return out


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_send_and_recv_time_out_naming_the_peer_and_tag(transport):
    got = run_ranks(_p2p_timeouts, 2, transport, env={"PYCOLL_TRANSPORT": transport,
                                                       "PYCOLL_TIMEOUT": ENV_TIMEOUT})[0]
    assert set(got) == ({"recv", "send"} if transport == "shm" else {"recv"})
    for what, (kind, msg, peers, took) in got.items():
        tag = 5 if what == "recv" else 6
        assert kind == "TimeoutError" and peers == [1], (what, kind, msg)
        assert f"{what} {'from' if what == 'recv' else 'to'} rank 1 tag {tag} on world timed out" in msg, msg
        assert T * 0.9 <= took < T + SLACK, (what, took)


BAD = ["3", -1, 0, math.nan, True, [1.0]]


def _bad_timeouts(comm):
    """Only rank 0 makes the bad calls: had any of them sent a message or taken a call number,
    the allreduce after them would not match up."""
    refused = []
    if comm.rank == 0:
        for bad in BAD:
            for name, call in [("allreduce", lambda: comm.allreduce(np.ones(4), timeout=bad)),
                               ("barrier", lambda: comm.barrier(timeout=bad)),
                               ("send", lambda: comm.send(np.ones(4), 1, timeout=bad)),
                               ("recv", lambda: comm.recv(np.empty(4), 1, timeout=bad))]:
                try:
                    call()
                    refused.append((name, repr(bad), "accepted"))
                except ValueError as e:
                    refused.append((name, repr(bad), str(e)))
    x = np.full(4, comm.rank + 1.0)
    comm.allreduce(x, timeout=30)
    comm.allreduce(x, timeout=math.inf)
    return refused, x.tolist()


def test_bad_timeouts_are_refused_before_anything_is_sent():
    (refused, x0), (_, x1) = run_ranks(_bad_timeouts, 2, env={"PYCOLL_TRANSPORT": "tcp"})
    assert len(refused) == 4 * len(BAD)
    for name, bad, msg in refused:
        assert f"{name} timeout={bad} must be a positive number of seconds" in msg, (name, bad, msg)
    assert x0 == x1 == [6.0] * 4

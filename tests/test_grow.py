"""comm.grow() / pycoll.join() (pycoll/grow.py) with real processes: members and newcomers form one
communicator (members keep their ranks, newcomers follow by slot), a stranger with the wrong token is
refused and logged while the job goes on, grow between calls only, a newcomer that never connects
costs the members a bounded wait and nothing else, and a newcomer stops waiting when the job ends."""
import json
import logging
import queue
import secrets
import time

import numpy as np
import pytest

from multiproc import _CTX, _child, rank_env

from pycoll.bootstrap.store import TCPStore, TCPStoreServer

TRANSPORTS = [pytest.param("tcp", marks=pytest.mark.slow), pytest.param("shm", marks=pytest.mark.slow), "auto"]


def run_job(member, n, newcomers=(), args=(), env=None, timeout=90.0, strangers=()):
    """member(comm, *args) on n ranks started together, and newcomer(comm, *args) on processes that
    join the running job (PYCOLL_NEWCOMER=1, RANK = their slot), all in one store served here.
    `newcomers`: (slot, fn) pairs; `strangers`: (slot, fn, token) pairs that start as newcomers with
    their own token. Returns ({rank: value}, {slot: (ok, value)}, the store server's address);
    a member's failure raises AssertionError with its traceback."""
    token = secrets.token_bytes(16)
    server = TCPStoreServer("127.0.0.1", 0, token)
    results = _CTX.Queue()
    base = {"PYCOLL_TIMEOUT": "30"}
    base.update(env or {})
    procs = [_CTX.Process(target=_child, daemon=True, args=(member, r, rank_env(r, n, server.port, token, base),
                                                              True, args, results)) for r in range(n)]
    for slot, fn in newcomers:
        extra = dict(base, PYCOLL_NEWCOMER="1")
        procs.append(_CTX.Process(target=_child, daemon=True, args=(
            fn, f"slot{slot}", rank_env(slot, slot + 1, server.port, token, extra), True, args, results)))
    for slot, fn, theirs in strangers:
        extra = dict(base, PYCOLL_NEWCOMER="1")
        procs.append(_CTX.Process(target=_child, daemon=True, args=(
            fn, f"slot{slot}", rank_env(slot, slot + 1, server.port, theirs, extra), True, args, results)))
    for p in procs:
        p.start()
    got = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < len(procs) and time.monotonic() < deadline:
            try:
                who, ok, value = results.get(timeout=0.2)
                got[who] = (ok, value)
            except queue.Empty:
                pass
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        server.close()
    members = {}
    for r in range(n):
        ok, value = got.get(r, (False, "no result before the deadline"))
        assert ok, f"member {r} failed:\n{value}\n(others: {got})"
        members[r] = value
    return members, {k: v for k, v in got.items() if not isinstance(k, int)}


def _step_until(comm, want, steps=3000):
    """Members' loop: one allreduce and one agreement (carrying the arrivals) per step, until `want`
    newcomers are agreed to wait (or `steps` pass); returns the agreed arrivals ticket."""
    from pycoll import ft, grow
    arrived = 0
    for _ in range(steps):
        x = np.ones(8, np.float32)
        comm.allreduce(x)
        assert x[0] == comm.size
        _, dead, arrived = ft.agree_max(comm, True, grow.arrivals(comm))
        assert not dead
        if arrived - grow.admitted(comm) >= want:
            break
        time.sleep(0.005)
    return arrived


def _summary(comm):
    """(rank, size, sum of ranks by allreduce, growth's member count) on the grown communicator."""
    from pycoll import grow
    y = np.array([float(comm.rank)])
    comm.allreduce(y)
    joined = grow.growth(comm)
    return comm.rank, comm.size, float(y[0]), joined.members if joined else None, comm.name


def _member_grows_by_two(comm):
    old_rank, old_id = comm.rank, comm.comm_id
    arrived = _step_until(comm, 2)
    new = comm.grow(arrivals=arrived)
    old_closed = comm.closed
    try:
        comm.allreduce(np.ones(2))
        old_usable = True
    except RuntimeError:
        old_usable = False
    out = (old_rank, new.comm_id != old_id, old_closed, old_usable) + _summary(new)
    new.close()
    return out


def _newcomer(comm):
    import os
    out = (int(os.environ["RANK"]),) + _summary(comm)
    comm.close()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_members_and_newcomers_form_one_communicator(transport):
    members, joined = run_job(_member_grows_by_two, 3, newcomers=[(7, _newcomer), (5, _newcomer)],
                              env={"PYCOLL_TRANSPORT": transport})
    for r, (old_rank, new_id, old_closed, old_usable, rank, size, total, before, name) in members.items():
        assert (old_rank, rank, size) == (r, r, 5), "members keep their ranks"
        assert new_id and old_closed and not old_usable, "a new communicator; the old one is released"
        assert total == 0 + 1 + 2 + 3 + 4 and before == 3
        assert name == members[0][-1]
    slots = {v[1][0]: v[1] for v in joined.values()}
    assert all(ok for ok, _ in joined.values()), joined
    # newcomers follow the members, in slot order (slot 5 arrived second, or first: same ranks)
    assert slots[5][1:5] == (3, 5, 10.0, 3) and slots[7][1:5] == (4, 5, 10.0, 3), slots


def _member_meets_stranger_then_newcomer(comm):
    arrived = _step_until(comm, 1)
    new = comm.grow(arrivals=arrived)
    out = _summary(new)
    new.close()
    return out


def _stranger(comm):
    raise AssertionError("a process with the wrong token joined the job")


@pytest.mark.timeout(120)
def test_a_newcomer_with_the_wrong_token_is_refused_and_logged_and_the_job_goes_on(caplog):
    caplog.set_level(logging.WARNING, logger="pycoll.store")
    members, joined = run_job(_member_meets_stranger_then_newcomer, 2, newcomers=[(3, _newcomer)],
                              strangers=[(2, _stranger, secrets.token_bytes(16))],
                              env={"PYCOLL_TRANSPORT": "tcp"})
    assert [m[:3] for m in members.values()] == [(0, 3, 3.0), (1, 3, 3.0)]
    ok, why = joined["slot2"]
    assert not ok and "StoreError" in why and "wrong job token" in why, why
    assert joined["slot3"][0] and joined["slot3"][1][1:3] == (2, 3)
    rejected = [r.getMessage() for r in caplog.records if r.name == "pycoll.store"]
    assert any("rejected client" in m and "wrong job token" in m for m in rejected), rejected


def _grow_while_in_flight(comm):
    import pycoll
    x = np.ones(1 << 16, np.float32)
    work = comm.allreduce(x, async_op=True)
    try:
        comm.grow()
        said = None
    except RuntimeError as e:
        said = str(e)
    work.wait()
    after = comm.grow()  # between calls, nobody waiting: the same communicator, still usable
    y = np.ones(4)
    after.allreduce(y)
    return said, after is comm, float(x[0]), float(y[0]), isinstance(pycoll.default_comm(), type(comm))


@pytest.mark.timeout(60)
def test_grow_while_a_call_is_in_flight_fails_clearly_and_changes_nothing():
    members, _ = run_job(_grow_while_in_flight, 3, env={"PYCOLL_TRANSPORT": "auto"})
    for said, same, x, y, _ in members.values():
        assert said is not None and "in flight" in said and "step boundary" in said, said
        assert same and x == 3.0 and y == 3.0


def _announce_and_vanish(port, token):
    """What a newcomer that dies after announcing itself leaves behind: a ticket and its key."""
    store = TCPStore("127.0.0.1", port, token=token, timeout=10)
    ticket = store.add("pycoll/elastic/arrivals", 1)
    store.set(f"pycoll/elastic/newcomer/{ticket}", json.dumps({"slot": 9, "pid": 0, "host": "gone"}).encode())
    store.close()


def _member_waits_for_ghost(comm):
    import pycoll
    arrived = _step_until(comm, 1)
    began = time.monotonic()
    try:
        comm.grow(arrivals=arrived, timeout=3)
        error = None
    except pycoll.GrowError as e:
        error = str(e)
    waited = time.monotonic() - began
    x = np.ones(4)
    comm.allreduce(x)  # the members go on, on the old communicator
    again = comm.grow()  # the ghost's ticket was dealt with: nobody waits now
    return error, waited, float(x[0]), again is comm


def _ghost_member(comm):
    """Rank 0 first leaves a ghost newcomer in the store (the others learn of it from the store)."""
    import os
    if comm.rank == 0:
        _announce_and_vanish(int(os.environ["MASTER_PORT"]), bytes.fromhex(os.environ["PYCOLL_JOB_TOKEN"]))
    return _member_waits_for_ghost(comm)


@pytest.mark.timeout(90)
def test_a_newcomer_that_never_connects_costs_the_members_a_bounded_wait():
    members, _ = run_job(_ghost_member, 3, env={"PYCOLL_TRANSPORT": "tcp"})
    for error, waited, x, again in members.values():
        assert error is not None and "slot 9" in error and "usable again" in error, error
        assert waited < 3 + 15, waited  # the grow's timeout, plus an agreement
        assert x == 3.0 and again


def _members_finish(comm):
    from pycoll import grow
    _step_until(comm, 1)  # the newcomer has announced itself
    comm.barrier()
    if comm.rank == 0:
        grow.finish(comm)  # the job ends without taking it in
    return comm.size


def _left_waiting(comm):
    raise AssertionError("admitted although the job ended")


@pytest.mark.timeout(90)
def test_a_waiting_newcomer_gives_up_when_the_job_ends():
    members, joined = run_job(_members_finish, 2, newcomers=[(4, _left_waiting)], env={"PYCOLL_TRANSPORT": "tcp"})
    assert list(members.values()) == [2, 2]
    ok, why = joined["slot4"]
    assert not ok and why.startswith("JobEnded: slot 4: the job ended before admitting newcomer ticket 1"), why

"""The point-to-point API beyond send/recv, in real processes over tcp and shm: receives from any
source (several senders, per-sender order, payloads past tcp's bulk threshold and shm's ring, a
death while one waits, a timeout), batch_isend_irecv, gatherv/scatterv, the non-collective
subgroup, and torch's dist.recv(src=None) / dist.batch_isend_irecv on the pycoll backend."""
import os

import numpy as np
import pytest

from multiproc import free_port, run_ranks

TRANSPORTS = ["tcp", "shm"]
BIG = 300_000  # float32: 1.2 MB, past tcp's bulk threshold (128 KiB) and the 256 KiB ring set below
SMALL_RING = {"PYCOLL_SHM_RING": str(256 << 10)}


def _env(transport, **extra):
    return {"PYCOLL_TRANSPORT": transport, **SMALL_RING, **extra}


# -- any source ------------------------------------------------------------------------------------
def _any_source(comm, count):
    """Every other rank sends 3 messages (its rank, then a counter) on tag 5 and one on tag 6; rank 0
    takes them all with any-source receives, some posted before the messages came, some after."""
    import pycoll
    msgs = 3
    if comm.rank != 0:
        for k in range(msgs):
            comm.send(np.full(count, comm.rank * 100 + k, np.float32), 0, tag=5)
        comm.send(np.full(4, comm.rank, np.int64), 0, tag=6)
        comm.barrier()
        return None
    early = [(np.empty(count, np.float32), None) for _ in range(comm.size - 1)]
    early = [(buf, comm.irecv(buf, pycoll.ANY_SOURCE, tag=5)) for buf, _ in early]  # posted at once
    seen = {}
    for buf, work in early:
        work.wait(60)
        assert np.all(buf == buf[0]), "a message arrived torn"
        seen.setdefault(work.source, []).append(int(buf[0]) - 100 * work.source)
    import time
    time.sleep(0.5)  # the rest are unexpected by now (bulk payloads parked, ring messages drained)
    for _ in range((comm.size - 1) * (msgs - 1)):
        buf, st = np.empty(count, np.float32), pycoll.Status()
        comm.recv(buf, None, tag=5, status=st)
        assert np.all(buf == buf[0]) and st.tag == 5 and st.nbytes == buf.nbytes
        seen.setdefault(st.source, []).append(int(buf[0]) - 100 * st.source)
    other = {}
    for _ in range(comm.size - 1):
        small = np.empty(4, np.int64)
        w = comm.irecv(small, tag=6)  # src defaults to any source
        w.wait(60)
        other[w.source] = int(small[0])
    comm.barrier()
    return seen, other


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("count", [3, BIG])
def test_any_source_takes_every_sender_in_each_senders_order(transport, count):
    got = run_ranks(_any_source, 3, count, env=_env(transport), timeout=150)[0]
    seen, other = got
    assert seen == {1: [0, 1, 2], 2: [0, 1, 2]}, seen  # non-overtaking per sender
    assert other == {1: 1, 2: 2}


def _wild_and_specific(comm):
    """An arrival goes to the earliest posted receive that matches: a receive from rank 1 posted
    before an any-source one gets rank 1's first message; the any-source one gets the next."""
    if comm.rank == 1:
        comm.barrier()
        comm.send(np.array([1], np.int64), 0, tag=3)
        comm.send(np.array([2], np.int64), 0, tag=3)
        return None
    a, b = np.zeros(1, np.int64), np.zeros(1, np.int64)
    wa = comm.irecv(a, 1, tag=3)
    wb = comm.irecv(b, None, tag=3)
    comm.barrier()
    wa.wait(30), wb.wait(30)
    return int(a[0]), int(b[0]), wb.source


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_an_arrival_takes_the_earliest_posted_matching_receive(transport):
    assert run_ranks(_wild_and_specific, 2, env=_env(transport))[0] == (1, 2, 1)


def _death_during_any_source(comm):
    import time
    import pycoll
    comm.barrier()
    if comm.rank == 1:
        time.sleep(0.5)
        os._exit(3)
    if comm.rank == 2:
        time.sleep(8)  # alive and silent
        return "idle"
    start = time.monotonic()
    try:
        comm.recv(np.empty(10), None, tag=1, timeout=30)
    except pycoll.PeerError as e:
        return type(e).__name__, str(e), e.peer, time.monotonic() - start
    return "no error"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_death_fails_a_waiting_any_source_receive_naming_the_dead_rank(transport):
    got = run_ranks(_death_during_any_source, 3, env=_env(transport), expect_fail=True, timeout=60)
    ok, value = got[0]
    assert ok, value
    kind, message, peer, seconds = value
    assert peer == 1 and "rank 1" in message and "recv from any rank tag 1" in message, value
    assert seconds < 20, value


def _any_source_timeout(comm):
    import pycoll
    if comm.rank == 0:
        try:
            comm.recv(np.empty(2), tag=4, timeout=1.0)
        except pycoll.TimeoutError as e:
            return str(e), e.peers
        return "no error"
    return None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_an_any_source_timeout_names_the_call(transport):
    message, peers = run_ranks(_any_source_timeout, 2, env=_env(transport))[0]
    assert "recv from any rank tag 4" in message and "timed out after 1 s" in message, message
    assert peers == []


# -- batches ---------------------------------------------------------------------------------------
def _batch(comm):
    """A ring where each rank lists its big send before its receive (blocking sends in this order
    would deadlock), then a pairwise exchange of several tensors with both orders mixed."""
    import pycoll
    r, n = comm.rank, comm.size
    nxt, prv = (r + 1) % n, (r - 1) % n
    out, got = np.full(BIG * 4, r, np.float32), np.empty(BIG * 4, np.float32)
    works = comm.batch_isend_irecv([pycoll.P2POp("isend", out, nxt, 1), pycoll.P2POp(comm.irecv, got, prv, 1)])
    assert len(works) == 2 and all(w.wait(60) for w in works) and np.all(got == prv)
    assert works[1].result() is got and works[1].source == prv and works[0].source == nxt
    a = [np.full(1000 * (k + 1), 10 * r + k, np.int32) for k in range(3)]
    b = [np.empty(1000 * (k + 1), np.int32) for k in range(3)]
    ops = [pycoll.P2POp("irecv", b[k], prv, 2) for k in range(3)] + [pycoll.P2POp("isend", a[k], nxt, 2) for k in range(3)]
    if r % 2:  # sends first; within a kind the order stays (it pairs messages of one pair)
        ops = ops[3:] + ops[:3]
    for w in comm.batch_isend_irecv(ops):
        w.wait(60)
    assert [int(x[0]) for x in b] == [10 * prv + k for k in range(3)] and all(np.all(x == x[0]) for x in b)
    # a bad op anywhere in the batch: nothing of it is posted
    errors = []
    for bad in ([pycoll.P2POp("isend", a[0], nxt, 9), pycoll.P2POp("isend", a[0], n, 9)],
                [pycoll.P2POp("isend", a[0], nxt, 9), pycoll.P2POp("irecv", b"ro", prv, 9)],
                [pycoll.P2POp("isend", a[0], nxt, 9), pycoll.P2POp("send_later", a[0], prv, 9)],
                [pycoll.P2POp("isend", a[0], nxt, 9), ("isend", a[0], prv, 9)],
                [pycoll.P2POp("isend", a[0], None, 9)], []):
        try:
            comm.batch_isend_irecv(bad)
            errors.append(None)
        except (ValueError, TypeError) as e:
            errors.append(type(e).__name__)
    comm.barrier()
    try:
        comm.recv(np.empty(a[0].size, np.int32), None, tag=9, timeout=0.5)
        errors.append("a message of a rejected batch arrived")
    except pycoll.TimeoutError:
        pass
    comm.barrier()
    return errors


@pytest.mark.timeout(150)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_batch_isend_irecv_posts_everything_before_waiting_and_checks_everything_first(transport):
    for errors in run_ranks(_batch, 3, env=_env(transport), timeout=120):
        assert errors == ["ValueError", "ValueError", "ValueError", "TypeError", "ValueError", "ValueError"]


# -- gatherv / scatterv ----------------------------------------------------------------------------
def _v(comm, counts, root):
    r = comm.rank
    mine = np.arange(counts[r], dtype=np.float64) + 1000 * r
    gathered = comm.gatherv(mine, counts, root=root)
    out = np.full(sum(counts), -1.0) if r == root else None
    again = comm.gatherv(mine, counts, root=root, out=out, async_op=True).result()
    full = np.concatenate([np.arange(c, dtype=np.float64) + 1000 * i for i, c in enumerate(counts)])
    src = full if r == root else None
    part = comm.scatterv(src, counts, root=root, out=np.empty(counts[r]))
    part2 = comm.scatterv(full if r == root else np.empty(0), counts, root=root)  # dtype from x
    ok_root = r != root or (np.array_equal(gathered, full) and again is out and np.array_equal(out, full))
    return bool(ok_root and (gathered is None) == (r != root) and np.array_equal(part, mine)
                and np.array_equal(part2, mine))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("counts,root", [([3, 0, 5], 0), ([0, 0, 0], 1), ([2, BIG, 0], 2)])
def test_gatherv_scatterv(transport, counts, root):
    assert run_ranks(_v, 3, counts, root, env=_env(transport)) == [True] * 3


def _v_errors(comm):
    import pycoll
    calls = [
        lambda: comm.gatherv(np.zeros(2), [2, 2, 2, 2], root=0),         # wrong number of counts
        lambda: comm.gatherv(np.zeros(2), [2, -1, 2], root=0),            # negative count
        lambda: comm.gatherv(np.zeros(3), [2, 2, 2], root=0),             # x is not counts[rank]
        lambda: comm.gatherv(np.zeros(2), [2, 2, 2], root=3),             # bad root
        lambda: comm.gatherv(np.zeros(2), [2, 2, 2], root=comm.rank, out=np.zeros(5)),
        lambda: comm.scatterv(None, [1, 1, 1], root=(comm.rank + 1) % 3),  # no out, no dtype
        lambda: comm.scatterv(np.zeros(3), [1, 1, 1], root=0, out=np.zeros(2)),
        lambda: comm.scatterv(np.zeros(4), [1, 1, 1], root=comm.rank),     # root x != sum(counts)
        lambda: comm.scatterv(None, [1, 1, 1], root=comm.rank, out=np.zeros(1)),
    ]
    errors = []
    for call in calls:
        try:
            call()
            errors.append(None)
        except ValueError:
            errors.append("ValueError")
    # nothing was sent: the next collective still lines up
    total = comm.allreduce(np.ones(1))
    got = comm.gatherv(np.full(comm.rank, comm.rank, np.int32), [0, 1, 2], root=1)
    return errors, float(total[0]), None if got is None else got.tolist()


@pytest.mark.timeout(120)
def test_gatherv_scatterv_check_their_arguments_before_sending():
    got = run_ranks(_v_errors, 3, env={"PYCOLL_TRANSPORT": "tcp"})
    for errors, total, _ in got:
        assert errors == ["ValueError"] * 9 and total == 3.0
    assert got[1][2] == [1, 2, 2] and got[0][2] is None


# -- subgroup --------------------------------------------------------------------------------------
def _subgroup(comm):
    """Ranks 2 and 0 make a subgroup (in that order) while rank 1 never calls it; its traffic and
    the parent's on the same tags do not mix, and the parent keeps working."""
    import pycoll
    r = comm.rank
    if r == 1:
        assert comm.subgroup([2, 0], "pair") is None  # a non-member calling it is harmless
        with pytest.raises(ValueError):
            comm.subgroup([0, 0], "dup ranks")
        total = comm.allreduce(np.ones(1))
        return float(total[0])
    sub = comm.subgroup([2, 0], "pair")
    assert sub.size == 2 and sub.rank == (0 if r == 2 else 1) and sub.comm_id != comm.comm_id
    with pytest.raises(ValueError):
        comm.subgroup([2, 0], "pair")  # one subgroup per (name, ranks)
    other = comm.subgroup([0, 2], "pair")  # other ranks order: another communicator
    assert other.comm_id != sub.comm_id and other.rank == (0 if r == 0 else 1)
    if r == 2:
        comm.send(np.array([111], np.int64), 0, tag=0)   # parent first ...
        sub.send(np.array([222], np.int64), 1, tag=0)    # ... then the subgroup, same tag
        other.send(np.array([333], np.int64), 0, tag=0)
    got = []
    if r == 0:
        for c, src in ((sub, 0), (other, 1), (comm, 2)):  # received in another order than sent
            buf = np.zeros(1, np.int64)
            c.recv(buf, None, tag=0, status=(st := pycoll.Status()))
            got.append((int(buf[0]), st.source == src))
    s = sub.allreduce(np.full(2, float(r)))
    total = comm.allreduce(np.ones(1))
    sub.close()
    other.close()
    return got, s.tolist(), float(total[0])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_subgroup_is_made_by_its_members_alone_and_keeps_its_traffic_apart(transport):
    got = run_ranks(_subgroup, 3, env=_env(transport))
    assert got[1] == 3.0
    assert got[0] == ([(222, True), (333, True), (111, True)], [2.0, 2.0], 3.0)
    assert got[2] == ([], [2.0, 2.0], 3.0)


# -- the transports that refuse --------------------------------------------------------------------
def test_auto_across_hosts_refuses_any_source_at_post_time():
    from pycoll.transports.base import ANY, MsgKey
    from pycoll.transports.mux import AutoTransport
    t = AutoTransport(0, 3, "127.0.0.1", ["a", "a", "b"])
    try:
        with pytest.raises(ValueError, match="any source"):
            t.irecv(memoryview(bytearray(4)), ANY, MsgKey(1, 0, 0))
    finally:
        t.close()


# -- torch -----------------------------------------------------------------------------------------
def _torch_p2p(rank, size, port):
    for k in ("MASTER_ADDR", "MASTER_PORT", "PYCOLL_JOB_TOKEN", "PYCOLL_STORE_HOSTED"):
        os.environ.pop(k, None)
    import torch
    import torch.distributed as dist
    import pycoll.torch  # noqa: F401
    dist.init_process_group("pycoll", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    result = {}
    if rank == 0:  # dist.recv without src returns the sender; irecv without src too
        senders = []
        for _ in range(size - 1):
            t = torch.empty(5)
            src = dist.recv(t, tag=3)
            senders.append((src, t[0].item()))
        result["recv"] = sorted(senders)
        t = torch.empty(2, dtype=torch.int64)
        w = dist.irecv(t, tag=4)
        w.wait()
        result["irecv"] = (w._source_rank(), t.tolist())
    else:
        dist.send(torch.full((5,), float(rank)), 0, tag=3)
        if rank == size - 1:
            dist.send(torch.tensor([7, 8]), 0, tag=4)
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    out = torch.full((200_000,), float(rank))
    got = torch.empty(200_000)
    small_out, small_got = torch.arange(3) + 10 * rank, torch.empty(3, dtype=torch.int64)
    ops = [dist.P2POp(dist.isend, out, nxt), dist.P2POp(dist.irecv, got, prv),
           dist.P2POp(dist.irecv, small_got, nxt, tag=1), dist.P2POp(dist.isend, small_out, prv, tag=1)]
    if rank % 2:
        ops.reverse()
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    result["batch"] = (got[0].item(), bool(torch.all(got == got[0])), small_got.tolist())
    dist.barrier()
    dist.destroy_process_group()
    return result


@pytest.mark.timeout(150)
def test_torch_recv_from_any_source_and_batch_isend_irecv():
    pytest.importorskip("torch")
    size = 3
    got = run_ranks(_torch_p2p, size, size, free_port(), init=False, timeout=120)
    assert got[0]["recv"] == [(1, 1.0), (2, 2.0)] and got[0]["irecv"] == (2, [7, 8])
    for rank, res in enumerate(got):
        nxt, prv = (rank + 1) % size, (rank - 1) % size
        assert res["batch"] == (float(prv), True, [10 * nxt + k for k in range(3)]), (rank, res)

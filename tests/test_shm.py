"""The shared-memory transport and the auto mux: p2p of every dtype from 0 B to 64 MiB (beyond the
ring), matching and mismatches, many ranks on few cores, threads, authentication, /dev/shm cleanup
(also after kill -9), and shm + tcp mixed on two fake hosts."""
import os
import signal
import threading
import time

import numpy as np
import pytest

from multiproc import run_ranks
from test_p2p import DTYPES, _dtype, _large, _mismatch, _out_of_order, _pass_payload, _ring_of_sends

SHM = {"PYCOLL_TRANSPORT": "shm"}
MIB = 1 << 20


def _dtypes_and_sizes(comm):
    got = []
    for i, name in enumerate(DTYPES):
        item = _dtype(name).itemsize
        for count in (0, 1, MIB // item):  # 0 B, one element (1 B for the byte types), 1 MiB
            _pass_payload(comm, name, count, i, got)
    return got


@pytest.mark.timeout(60)
def test_every_dtype_at_0_1_and_1mib_bytes():
    _, got = run_ranks(_dtypes_and_sizes, 2, env=SHM)
    assert len(got) == len(DTYPES) * 3 and all(got)


def _large_and_ring(comm):
    return _large(comm), comm.transport.ring_bytes


@pytest.mark.timeout(60)
def test_64_mib_message_streams_through_the_smaller_ring():
    (_, ring), (ok, _) = run_ranks(_large_and_ring, 2, env=SHM)
    assert ok is True and 0 < ring < 64 * MIB


def _ring_of_big_sends(comm):
    """Everyone sends 24 MiB right before receiving from the left: only eager draining avoids deadlock."""
    n = 3 * MIB
    comm.send(np.arange(n, dtype=np.int64) + comm.rank, (comm.rank + 1) % comm.size)
    buf = np.empty(n, np.int64)
    left = (comm.rank - 1) % comm.size
    comm.recv(buf, left)
    return bool(np.array_equal(buf, np.arange(n, dtype=np.int64) + left))


@pytest.mark.timeout(60)
def test_big_sends_before_receives_do_not_deadlock():
    assert run_ranks(_ring_of_big_sends, 3, env=SHM) == [True] * 3


def _unexpected_then_posted(comm):
    """A big message starts arriving as unexpected (the receiver waits on another tag) and is then
    claimed by its receive halfway through; a smaller one is fully buffered before it is claimed."""
    from pycoll.transports.base import MsgKey
    tr, key = comm.transport, lambda tag: MsgKey(0xC0FFEE, 0, tag)
    big, small = np.arange(8 * MIB, dtype=np.int64), np.arange(1000, dtype=np.int32)
    if comm.rank == 0:
        msgs = (big, small, small[:10])
        tr.wait([tr.isend(memoryview(m).cast("B"), 1, key(t)) for t, m in enumerate(msgs, 1)], 30, "sends")
        return None
    last = np.empty(10, np.int32)
    r3 = tr.irecv(memoryview(last).cast("B"), 0, key(3))
    tr.wait_for([r3], 0.01)  # drains tag 1 into an unexpected buffer meanwhile (or all of it)
    got_big, got_small = np.empty_like(big), np.empty_like(small)
    r1 = tr.irecv(memoryview(got_big).cast("B"), 0, key(1))
    r2 = tr.irecv(memoryview(got_small).cast("B"), 0, key(2))
    tr.wait([r1, r2, r3], 30, "recvs")
    return (bool(np.array_equal(got_big, big)), bool(np.array_equal(got_small, small)),
            bool(np.array_equal(last, small[:10])))


@pytest.mark.timeout(60)
def test_unexpected_messages_are_claimed_whole_or_halfway():
    assert run_ranks(_unexpected_then_posted, 2, env=SHM)[1] == (True, True, True)


def _sinks(comm):
    """Receives with a sink (how the ring algorithms reduce on arrival): small, in one piece in the
    ring, longer than the ring, unexpected (whole or still arriving), and one that does not fit."""
    import pycoll
    from pycoll.transports.base import MsgKey
    tr, key = comm.transport, lambda tag: MsgKey(0x5111C, 0, tag)
    sizes = {0: 8, 1: 3 * MIB, 2: 40 * MIB, 6: 100, 3: 2 * MIB, 4: 24 * MIB, 5: 16}  # in sending order
    msgs = {t: np.random.default_rng(t).integers(0, 255, n, dtype=np.uint8) for t, n in sizes.items()}
    if comm.rank == 0:
        tr.wait([tr.isend(memoryview(m), 1, key(t)) for t, m in msgs.items()], 60, "sends")
        return None
    seen = {}

    def post(t, nbytes=None):
        def sink(payload, offset):
            seen[t] = offset == 0 and bytes(payload) == msgs[t].tobytes()
        return tr.irecv(memoryview(np.empty(nbytes or sizes[t], np.uint8)), 0, key(t), sink=sink)
    tr.wait([post(t) for t in (0, 1, 2)], 60, "posted first")
    last = post(5)
    tr.wait_for([last], 0.01)  # waiting behind them drains 6, 3 and (part of) 4 into unexpected buffers
    r6 = post(6, 50)
    tr.wait([post(3), post(4), last], 60, "posted late")
    assert tr.wait_for([r6], 10) and isinstance(r6.error, pycoll.ProtocolError) and 6 not in seen
    return seen


@pytest.mark.timeout(60)
def test_sinks_get_every_payload_in_one_piece():
    assert run_ranks(_sinks, 2, env=SHM)[1] == {t: True for t in range(6)}


def _close_flushes(comm):
    from pycoll.transports.base import MsgKey
    big = np.arange(6 * MIB, dtype=np.int64)  # 48 MiB: several rings' worth still queued at close()
    if comm.rank == 0:
        comm.transport.isend(memoryview(big).cast("B"), 1, MsgKey(7, 0, 0))
        return None
    buf = np.empty_like(big)
    comm.transport.wait([comm.transport.irecv(memoryview(buf).cast("B"), 0, MsgKey(7, 0, 0))], 30, "recv")
    return bool(np.array_equal(buf, big))


@pytest.mark.timeout(60)
def test_close_flushes_queued_sends():
    assert run_ranks(_close_flushes, 2, env=SHM)[1] is True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("count,mixed", [(4, False), (100_000, True)])
def test_tags_out_of_order_and_fifo_within_a_tag(count, mixed):
    assert run_ranks(_out_of_order, 2, count, mixed, env=SHM)[1] == [3, 1, 2, 10, 11, 12]


@pytest.mark.timeout(60)
def test_size_and_dtype_mismatch_is_a_protocol_error():
    _, (size_msg, dtype_msg, intact) = run_ranks(_mismatch, 2, 10, env=SHM)
    assert "40 bytes" in size_msg and "expects 80 bytes" in size_msg and "rank 0" in size_msg
    assert "dtype" in dtype_msg and intact


def _big_mismatch(comm):
    """A rejected message longer than the ring is read and dropped; the next one still matches."""
    import pycoll
    if comm.rank == 0:
        comm.send(np.ones(8 * MIB, np.float32), 1)
        comm.send(np.arange(10, dtype=np.float32), 1, tag=1)
        return None
    buf = np.full(MIB, 5, np.float32)
    with pytest.raises(pycoll.ProtocolError, match=f"{32 * MIB} bytes"):
        comm.recv(buf, 0)
    nxt = np.empty(10, np.float32)
    comm.recv(nxt, 0, tag=1)
    return bool(np.all(buf == 5)), nxt.tolist()


@pytest.mark.timeout(60)
def test_mismatch_longer_than_the_ring_leaves_the_buffer_and_the_stream_intact():
    assert run_ranks(_big_mismatch, 2, env=SHM)[1] == (True, list(range(10)))


def _busy(comm):
    x = np.full(MIB, comm.rank, np.float32)
    for _ in range(10):
        comm.allreduce(x, op="max")
        comm.barrier()
    return _ring_of_sends(comm), float(x[0]), comm.transport.name


@pytest.mark.timeout(120)
def test_eight_ranks_on_two_cores():
    n = 8
    for r, (ring, top, name) in enumerate(run_ranks(_busy, n, env=SHM, timeout=110)):
        assert ring == float((r - 1) % n) and top == n - 1 and name == "shm"


def _threads(comm):
    """Four threads, each on its own communicator, run p2p and allreduce at once (some beyond the ring)."""
    comms = [comm.dup() for _ in range(4)]
    out, errors = {}, []

    def work(i):
        try:
            c = comms[i]
            for k in range(5):
                x = np.full(MIB * (i + 1) // 2, c.rank + k, np.float64)
                c.allreduce(x)
                y = np.empty(100, np.int32)
                c.send(np.full(100, i, np.int32), (c.rank + 1) % c.size, tag=k)
                c.recv(y, (c.rank - 1) % c.size, tag=k)
                out[i, k] = (float(x[0]), int(y[0]))
        except BaseException as e:  # pragma: no cover - reported to the parent
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors, out


@pytest.mark.timeout(60)
def test_threads_on_several_communicators_share_one_transport():
    n = 3
    for errors, out in run_ranks(_threads, n, env=SHM):
        assert not errors
        assert out == {(i, k): (float(sum(range(n)) + n * k), i) for i in range(4) for k in range(5)}


def _segments(comm):
    names = dict(comm.transport.segments)
    assert not os.path.exists(f"/dev/shm/{names[comm.rank]}"), "still linked after connect"
    comm.allreduce(np.ones(MIB))
    return names


def _ours():
    return {s for s in os.listdir("/dev/shm") if s.startswith("pycoll-")}


def _left_behind(before):
    """Segments created since `before` that stay (a concurrent test's vanish once it is connected)."""
    deadline = time.monotonic() + 10
    while _ours() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    return _ours() - before


@pytest.mark.timeout(60)
def test_nothing_left_in_dev_shm_after_a_run():
    before = _ours()
    names = run_ranks(_segments, 3, env=SHM)[0]
    assert len(names) == 3 and not set(names.values()) & _ours()
    assert not _left_behind(before)


def _die(comm):
    names = dict(comm.transport.segments)
    comm.barrier()
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    import pycoll
    try:  # a message to the dead rank bigger than the ring can never complete
        comm.send(np.ones(16 * MIB, np.float32), 1, timeout=30)
    except pycoll.PeerError as e:
        return names, e.peer, str(e)
    return names, None, "no error"


@pytest.mark.timeout(60)
def test_nothing_left_in_dev_shm_after_kill_9():
    before = _ours()
    (ok0, (names, peer, msg)), (ok1, story) = run_ranks(_die, 2, env=SHM, expect_fail=True)
    assert ok0 and not ok1 and "code -9" in story
    assert peer == 1 and "rank 1 died" in msg  # noticed within a slice, not at the 30 s deadline
    assert len(names) == 2 and not set(names.values()) & _ours()
    assert not _left_behind(before)


def _fake_hosts(rank, transport):
    os.environ["PYCOLL_HOSTID"] = f"fake-host-{rank % 2}"
    os.environ["PYCOLL_TRANSPORT"] = transport
    import pycoll
    try:
        comm = pycoll.init()
    except ValueError as e:
        return str(e)
    with comm:
        n, r = comm.size, comm.rank
        base = np.arange(6 * MIB, dtype=np.float32) % 1000  # 24 MiB: beyond the shm ring, many tcp frames
        x = base + r
        comm.allreduce(x)
        total = np.array_equal(x, n * base + sum(range(n)))
        gathered = np.array_equal(comm.allgather(np.full(5, r)), np.arange(n).repeat(5).reshape(n, 5))
        a2a = comm.alltoall(np.arange(n * 4, dtype=np.int32) + 100 * r)
        want = np.concatenate([np.arange(4 * r, 4 * r + 4, dtype=np.int32) + 100 * i for i in range(n)])
        tcp = getattr(comm.transport, "_tcp", None)
        return (comm.transport.name, bool(total), bool(gathered), bool(np.array_equal(a2a, want)),
                None if tcp is None else tcp.peers)


@pytest.mark.timeout(90)
def test_auto_mixes_shm_and_tcp_on_two_fake_hosts():
    """Ranks 0, 2 on one fake host and 1, 3 on the other: tcp connects each rank only to the other
    host's ranks (and itself), shm serves its host."""
    for r, got in enumerate(run_ranks(_fake_hosts, 4, "auto", init=False, timeout=80)):
        assert got == ("auto(shm+tcp)", True, True, True, sorted({r, (r + 1) % 4, (r + 3) % 4}))


def _transport_name(comm):
    return comm.transport.name


@pytest.mark.timeout(60)
def test_auto_on_one_host_is_pure_shm():
    assert run_ranks(_transport_name, 2) == ["auto(shm)", "auto(shm)"]


@pytest.mark.timeout(60)
def test_shm_across_hosts_is_a_clear_error():
    msgs = run_ranks(_fake_hosts, 4, "shm", init=False)
    assert "ranks [1, 3] are on other hosts" in msgs[0] and "ranks [0, 2]" in msgs[1]
    assert all("PYCOLL_TRANSPORT=shm" in m for m in msgs)


def _connect(rank, token, store, out):
    from pycoll.transports.shm import ShmTransport
    tr = ShmTransport(rank, 2)
    try:
        tr.connect(store, token, 10)
        out[rank] = "connected"
    except Exception as e:
        out[rank] = e
    finally:
        out[rank, "names"] = dict(tr.segments)
        tr.close()


@pytest.mark.timeout(60)
def test_a_peer_without_the_job_token_is_not_trusted(tmp_path):
    from pycoll.bootstrap.store import FileStore
    from pycoll.errors import PeerError
    store, out = FileStore(str(tmp_path)), {}
    threads = [threading.Thread(target=_connect, args=(r, bytes([r]) * 32, store, out)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(isinstance(out[r], PeerError) and out[r].peer == 1 - r for r in range(2)), out
    assert any("failed authentication" in str(out[r]) for r in range(2)), out  # the other may see it gone
    assert not {s for r in range(2) for s in out[r, "names"].values()} & _ours()


@pytest.mark.timeout(60)
def test_a_peer_that_never_connects_is_named_and_nothing_is_left(tmp_path):
    from pycoll.bootstrap.store import FileStore
    from pycoll.errors import TimeoutError
    from pycoll.transports.shm import ShmTransport
    before, tr = _ours(), ShmTransport(0, 3)
    with pytest.raises(TimeoutError, match=r"ranks \[1, 2\] never published") as err:
        tr.connect(FileStore(str(tmp_path)), b"t" * 32, 0.5)
    tr.close()
    assert err.value.peers == [1, 2] and not _left_behind(before)

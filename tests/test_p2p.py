"""send/recv over the tcp transport: every dtype, 0 B to 64 MiB, tags, ordering, and mismatches."""
import numpy as np
import pytest

from multiproc import run_ranks

TCP = {"PYCOLL_TRANSPORT": "tcp"}  # these are the tcp transport's tests; shm has its own

pytestmark = pytest.mark.timeout(120)

DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
          "float16", "float32", "float64", "complex64", "complex128", "bfloat16"]


def _dtype(name):
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _payload(dtype, count, seed):
    data = np.random.default_rng(seed).integers(0, 100, count)
    return data.astype(_dtype(dtype))


def _pass_payload(comm, name, count, tag, got):
    """Rank 0 sends a seeded payload to rank 1, which appends whether it arrived intact to `got`."""
    if comm.rank == 0:
        comm.send(_payload(name, count, tag), 1, tag=tag)
    else:
        buf = np.empty(count, _dtype(name))
        comm.recv(buf, 0, tag=tag)
        got.append(bool(np.array_equal(buf, _payload(name, count, tag))))


def _every_dtype_and_size(comm):
    got = []
    for i, name in enumerate(DTYPES):
        for count in (0, 1, 1000, 70_000):
            _pass_payload(comm, name, count, i, got)
    if comm.rank == 0:
        comm.send(bytearray(b"\x07"), 1, tag=99)       # one byte, plain buffer protocol
    else:
        one = bytearray(1)
        comm.recv(one, 0, tag=99)
        got.append(one == bytearray(b"\x07"))
    return got


def test_every_dtype_and_size():
    _, got = run_ranks(_every_dtype_and_size, 2, env=TCP)
    assert len(got) == len(DTYPES) * 4 + 1 and all(got)


def _large(comm):
    n = (64 << 20) // 8
    if comm.rank == 0:
        comm.send(np.arange(n, dtype=np.int64), 1)
        return None
    buf = np.empty(n, np.int64)
    comm.recv(buf, 0)
    return bool(np.array_equal(buf, np.arange(n, dtype=np.int64)))


def test_64_mib_message():
    assert run_ranks(_large, 2, env=TCP)[1] is True


def _stream_buffers(comm):
    import socket
    bulk = comm.transport._bulk
    return {peer: (peer in bulk.local, socks[0].getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF))
            for peer, socks in bulk.socks.items()}


def test_same_host_bulk_streams_get_a_send_buffer_no_bigger_than_the_window():
    """Loopback streams get a fixed SO_SNDBUF (the kernel doubles it, capped by wmem_max), so queued
    data never leaves from the peer's CPU on an ACK (bulk.py); PYCOLL_TCP_LOCAL_SNDBUF=0 autotunes."""
    with open("/proc/sys/net/core/wmem_max") as f:
        want = 2 * min(1 << 19, int(f.read()))
    got = run_ranks(_stream_buffers, 3, env=TCP)
    for rank, streams in enumerate(got):
        assert sorted(streams) == [p for p in range(3) if p != rank]
        assert all(local and size == want for local, size in streams.values()), streams
    got = run_ranks(_stream_buffers, 2, env={**TCP, "PYCOLL_TCP_LOCAL_SNDBUF": "0"})
    assert [list(streams.values())[0][0] for streams in got] == [False, False]


BULK = 100_000  # int32 elements: 400 KB, above PYCOLL_TCP_BULK_THRESHOLD, so on the raw stream


def _out_of_order(comm, count, mixed):
    """Tags received in another order than sent (the receiver waits on the last one first, so the
    earlier bulk payloads hold up their stream until read aside), then FIFO within one tag."""
    same_tag = [count, 4, count] if mixed else [count] * 3  # small and bulk messages on one key
    if comm.rank == 0:
        for tag in (1, 2, 3):
            comm.send(np.full(count, tag, np.int32), 1, tag=tag)
        for k, n in enumerate(same_tag):  # same tag: delivered in send order
            comm.send(np.full(n, 10 + k, np.int32), 1, tag=7)
        return None
    order = []
    for tag in (3, 1, 2):
        buf = np.empty(count, np.int32)
        comm.recv(buf, 0, tag=tag)
        order.append(int(buf[0]) if np.all(buf == buf[0]) else -1)
    for n in same_tag:
        buf = np.empty(n, np.int32)
        comm.recv(buf, 0, tag=7)
        order.append(int(buf[0]) if np.all(buf == buf[0]) else -1)
    return order


@pytest.mark.parametrize("count,mixed", [(4, False), (BULK, False), (BULK, True)])
def test_tags_match_out_of_order_and_fifo_within_a_tag(count, mixed):
    assert run_ranks(_out_of_order, 2, count, mixed, env=TCP)[1] == [3, 1, 2, 10, 11, 12]


def _ring_of_sends(comm):
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    buf = np.empty(1000, np.float64)
    if comm.rank % 2 == 0:
        comm.send(np.full(1000, comm.rank, np.float64), right)
        comm.recv(buf, left)
    else:
        comm.recv(buf, left)
        comm.send(np.full(1000, comm.rank, np.float64), right)
    return float(buf[0])


@pytest.mark.parametrize("n", [2, 4, 8])
def test_many_ranks_exchange(n):
    got = run_ranks(_ring_of_sends, n, env=TCP)
    assert got == [float((r - 1) % n) for r in range(n)]


def _mismatch(comm, n):
    import pycoll
    if comm.rank == 0:
        comm.send(np.zeros(n, np.float32), 1)
        comm.send(np.zeros(n, np.float32), 1, tag=1)
        comm.send(np.arange(n, dtype=np.float32), 1, tag=2)
        return "sent"
    buf = np.full(2 * n, 5, np.float32)
    try:
        comm.recv(buf, 0)
    except pycoll.ProtocolError as e:
        assert np.all(buf == 5), "a rejected message must not touch the buffer"
        msg = str(e)
    try:
        comm.recv(np.empty(n, np.int32), 0, tag=1)
    except pycoll.ProtocolError as e:
        dtype_msg = str(e)
    after = np.empty(n, np.float32)
    comm.recv(after, 0, tag=2)  # the stream is still in step after the rejected payloads
    return msg, dtype_msg, bool(np.array_equal(after, np.arange(n, dtype=np.float32)))


@pytest.mark.parametrize("n", [10, BULK])
def test_size_and_dtype_mismatch_is_an_error_not_garbage(n):
    _, (size_msg, dtype_msg, intact) = run_ranks(_mismatch, 2, n, env=TCP)
    assert f"{4 * n} bytes" in size_msg and f"expects {8 * n} bytes" in size_msg and "rank 0" in size_msg
    assert "dtype" in dtype_msg and intact


def _bad_args(comm):
    errors = []
    for call in (lambda: comm.send(np.zeros(1), 5), lambda: comm.recv(np.zeros(1), -2),
                 lambda: comm.send(np.zeros(1), 0, tag=-3), lambda: comm.recv(b"ro", 0),
                 lambda: comm.send(np.zeros((4, 4))[:, 1], 0), lambda: comm.send(object(), 0)):
        try:
            call()
            errors.append(None)
        except (ValueError, TypeError) as e:
            errors.append(type(e).__name__)
    return errors


def test_bad_arguments_fail_before_sending():
    for errors in run_ranks(_bad_args, 2, env=TCP):
        assert errors == ["ValueError", "ValueError", "ValueError", "ValueError", "ValueError",
                          "TypeError"]


def _nonblocking(comm):
    """isend/irecv: a ring of 1 MiB messages both ways at once (each rank posts both before
    waiting), tags matched out of posting order, and errors raised through the Work."""
    n, r = comm.size, comm.rank
    nxt, prv = (r + 1) % n, (r - 1) % n
    out = np.full(1 << 18, r, np.float32)
    got = np.empty_like(out)
    works = [comm.irecv(got, prv, tag=3), comm.isend(out, nxt, tag=3)]
    assert all(w.wait(30) for w in works)
    assert works[0].result() is got and np.all(got == prv)
    a, b = np.empty(4, np.int64), np.empty(4, np.int64)
    if r == 0:
        wb = comm.isend(np.arange(4, dtype=np.int64) + 10, 1, tag=2)
        wa = comm.isend(np.arange(4, dtype=np.int64), 1, tag=1)
        wb.wait(), wa.wait()
    elif r == 1:
        wa, wb = comm.irecv(a, 0, tag=1), comm.irecv(b, 0, tag=2)
        wa.wait(), wb.wait()
        assert a.tolist() == [0, 1, 2, 3] and b.tolist() == [10, 11, 12, 13]
    with pytest.raises(ValueError):
        comm.isend(out, n, tag=0)
    comm.barrier()
    return True


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_isend_irecv(transport):
    assert run_ranks(_nonblocking, 3, env={"PYCOLL_TRANSPORT": transport}) == [True] * 3

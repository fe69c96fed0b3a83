"""Fuzz the two ports a stranger can reach: the rendezvous store and the tcp transport's ROUTER.

Random bytes, truncated and oversized frames, forged pycoll headers and replayed handshakes must be
turned away without crashing or stalling the server, and a job under fire keeps computing right.
Inputs come from a seeded generator (hypothesis costs ~3 ms an input here, too slow for 10,000
in the default run): every run sends the same inputs (up to the job's own random token), and a
failure names the input that broke.
"""
from __future__ import annotations

import logging
import math
import random
import socket
import struct
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Tuple, TypeVar

import numpy as np
import pytest
import zmq

from multiproc import run_ranks
from pycoll.bootstrap import store as proto
from pycoll.bootstrap.store import TCPStore, TCPStoreServer
from pycoll.transports import wire

STORE_INPUTS = 4000       # to the store server (a connection each: ~1.3 ms an input)
TRANSPORT_INPUTS = 16000  # to a live rank's ROUTER (~50 us an input); issue #7 asks for 10,000 in all
STALL = 10.0              # seconds any single reply, hang-up or collective may take
TOKEN = b"fuzzing-the-store"  # fixed, like the seeds: the same inputs every run
# the store's valid answer to its challenge: made for an all-zero nonce here; _store_exchange puts the
# answer to the connection's real nonce in place of each intact copy (a mutated one stays garbage)
HELLO = proto._encode(proto.OP_HELLO, proto._MAGIC, proto.store_mac(TOKEN, bytes(proto.NONCE_BYTES)))
_U32, _F64 = struct.Struct("!I"), struct.Struct("!d")
T = TypeVar("T")


def fuzz(make: Callable[[random.Random], T], send: Callable[[T], None], n: int, seed: int) -> None:
    """send(make(rng)) for `n` inputs from a fixed seed; an error names the input that caused it."""
    rng = random.Random(seed)
    for i in range(n):
        case = make(rng)
        try:
            send(case)
        except Exception as e:
            raise AssertionError(f"fuzz input {i} (seed {seed}) {case!r:.400}: {e}") from e


def blob(rng: random.Random, max_size: int) -> bytes:
    """Random bytes; empty, one byte or `max_size` long now and then."""
    return rng.randbytes(rng.choice((0, 1, max_size)) if rng.random() < 0.2 else rng.randint(0, max_size))


def mutate(rng: random.Random, data: bytes) -> bytes:
    """`data` as it is, with one byte flipped, cut short, or with random bytes spliced in."""
    how, i = rng.randrange(4), rng.randint(0, len(data))
    if how == 1 and i < len(data):
        return data[:i] + bytes([data[i] ^ rng.randint(1, 255)]) + data[i + 1:]
    if how == 2:
        return data[:i]
    return data[:i] + blob(rng, 16) + data[i:] if how == 3 else data


@pytest.fixture
def quiet(caplog):
    """The store logs a warning per rejected client: keep thousands of them out of the report."""
    caplog.set_level(logging.ERROR, logger="pycoll.store")


# -- the store ------------------------------------------------------------------------------------
# Blocking ops (GET, WAIT) only carry short, NaN or negative timeouts: a well-formed request to wait
# an hour is honoured, not a stall (unbounded timeouts have their own test below).
_TIMEOUTS = (math.nan, -math.inf, -1.0, -0.0, 0.0, 1e-9, 0.01, 0.05)
_LENGTHS = (0, 1, proto.MAX_HELLO_FRAME, proto.MAX_HELLO_FRAME + 1, proto.MAX_FRAME, proto.MAX_FRAME + 1,
            2 ** 32 - 1)
_FIELDS = (proto._MAGIC, TOKEN, b"k", b"")


def _store_frame(rng: random.Random) -> bytes:
    """One request: a known or any op, with fitting or random fields, its length true, lying or cut."""
    op = rng.randint(1, 8) if rng.random() < 0.7 else rng.randrange(256)
    fields = [rng.choice(_FIELDS) if rng.random() < 0.3 else blob(rng, 24) for _ in range(rng.randint(0, 3))]
    blocking = op in (proto.OP_GET, proto.OP_WAIT)
    if blocking:
        fields.insert(min(len(fields), int(op == proto.OP_GET)), _F64.pack(rng.choice(_TIMEOUTS)))
    if blocking or rng.random() < 0.7:
        body = bytes([op]) + b"".join(_U32.pack(len(f)) + f for f in fields)
    else:
        body = bytes([op]) + blob(rng, 64)
    r = rng.random()
    frame = _U32.pack(len(body) if r < 0.6 else rng.choice(_LENGTHS) if r < 0.8 else rng.getrandbits(32)) + body
    return frame[:rng.randint(0, len(frame))] if rng.random() < 0.2 else frame


def _store_case(rng: random.Random) -> bytes:
    """Half the time after a valid handshake, so the garbage reaches the request loop; hellos replayed."""
    parts = [HELLO] if rng.random() < 0.5 else []
    for _ in range(rng.randint(1, 3)):
        r = rng.random()
        parts.append(HELLO if r < 0.1 else mutate(rng, HELLO) if r < 0.2 else blob(rng, 200) if r < 0.4
                     else _store_frame(rng))
    return b"".join(parts)


def _replies(data: bytes) -> Iterator[bytes]:
    """The reply bodies in what the server sent; AssertionError if it is not well framed."""
    pos = 0
    while pos < len(data):
        (n,) = _U32.unpack_from(data, pos)
        body = data[pos + 4:pos + 4 + n]
        assert len(body) == n >= 1 and body[0] <= proto.ST_BAD, f"malformed reply {data!r}"
        yield body
        pos += 4 + n


def _store_exchange(port: int, data: bytes) -> List[bytes]:
    """Send `data`, half-close, and collect every reply until the server hangs up (within STALL s)."""
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=STALL) as s:
        challenge = proto._recv_frame(s)  # the server speaks first: ST_OK | magic | nonce
        assert challenge[0] == proto.ST_OK, challenge
        nonce = proto._decode_fields(challenge[1:])[1]
        data = data.replace(HELLO, proto._encode(proto.OP_HELLO, proto._MAGIC, proto.store_mac(TOKEN, nonce)))
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except socket.timeout:
            raise AssertionError("store server stalled reading") from None
        except OSError:  # it already hung up on us: a rejection
            pass
        try:
            while chunk := s.recv(65536):
                got += chunk
        except socket.timeout:
            raise AssertionError("store server stalled: no reply and no hang-up") from None
        except ConnectionResetError:  # it hung up with our bytes unread
            pass
    return list(_replies(got))


def _check_store_reply(port: int) -> Callable[[bytes], None]:
    def send(data: bytes) -> None:
        replies = _store_exchange(port, data)
        if data.startswith(HELLO):
            assert replies[:1] == [bytes([proto.ST_OK])], replies
        else:  # a stranger gets a refusal at most
            assert replies in ([], [bytes([proto.ST_DENIED])]), replies
    return send


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.timeout(120)
def test_store_server_survives_fuzzing(quiet):
    srv = TCPStoreServer("127.0.0.1", 0, token=TOKEN)
    threads_before = threading.active_count()
    try:
        t0 = time.monotonic()
        fuzz(_store_case, _check_store_reply(srv.port), STORE_INPUTS, seed=1)
        took = time.monotonic() - t0
        good = TCPStore("127.0.0.1", srv.port, token=TOKEN, timeout=5)
        good.set("still", b"works")
        assert good.get("still") == b"works" and good.add("n", 2) == 2
        good.close()
        deadline = time.monotonic() + STALL  # every connection's thread ends: none is stuck
        while threading.active_count() > threads_before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert threading.active_count() <= threads_before
    finally:
        srv.close()
    print(f"store: {STORE_INPUTS} inputs in {took:.1f} s")


def _hung_up(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.mark.timeout(60)
def test_store_drops_an_oversized_first_frame_at_once(quiet):
    """A stranger announcing a huge frame is dropped before the server allocates or waits for it."""
    srv = TCPStoreServer("127.0.0.1", 0, token=TOKEN)
    try:
        for claim in (proto.MAX_HELLO_FRAME + 1, proto.MAX_FRAME, 2 ** 32 - 1):
            with socket.create_connection(("127.0.0.1", srv.port), timeout=STALL) as s:
                proto._recv_frame(s)  # the server's challenge
                s.sendall(_U32.pack(claim) + b"\x01")  # and keep the connection open
                t0 = time.monotonic()
                assert _hung_up(s) and time.monotonic() - t0 < 2, claim
    finally:
        srv.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("timeout", [math.nan, -math.inf, math.inf, 1e300])
def test_store_wait_timeouts_that_are_not_plain_numbers(timeout):
    """NaN or negative: an immediate 'missing'; infinite or huge: wait until the key appears."""
    srv = TCPStore("127.0.0.1", 0, is_master=True, token=TOKEN, timeout=5, bind_host="127.0.0.1")
    try:
        if timeout > 0:  # the late key comes from a client of its own (one client is one connection)
            other = TCPStore("127.0.0.1", srv.port, token=TOKEN, timeout=5)
            timer = threading.Timer(0.3, other.set, args=("late", b"v"))
            timer.start()
            try:
                assert srv.get("late", timeout=timeout) == b"v"
            finally:
                timer.join()
                other.close()
        else:
            t0 = time.monotonic()
            with pytest.raises(TimeoutError):
                srv.get("late", timeout=timeout)
            assert time.monotonic() - t0 < 2
        srv.set("after", b"1")  # the connection survived
        assert srv.get("after") == b"1"
    finally:
        srv.close()


# -- the tcp transport ----------------------------------------------------------------------------
def _zmtp(rng: random.Random) -> bytes:
    """A ZMTP 3.0 greeting and READY as a DEALER, then frames whose sizes lie (up to 2**63-1)."""
    greeting = b"\xff" + b"\0" * 8 + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" * 32
    ready = b"\x05READY\x0bSocket-Type" + _U32.pack(6) + b"DEALER"
    out = greeting + b"\x04" + bytes([len(ready)]) + ready
    for more in [1] * rng.randint(0, 2) + [0]:
        size = rng.randrange(256) if rng.random() < 0.5 else rng.choice((256, 2 ** 31, 2 ** 40, 2 ** 63 - 1))
        head = bytes([more, size]) if size < 256 else bytes([more | 2]) + struct.pack("!Q", size)
        out += head + blob(rng, 64)
    return mutate(rng, out)


def _header(rng: random.Random, comm_id: int) -> bytes:
    """A well-formed pycoll header with forged fields, half of them aimed at the running job's calls."""
    live = rng.random() < 0.5
    return wire.pack_header(
        rng.choice((wire.KIND_DATA, wire.KIND_HELLO, wire.KIND_BYE, rng.randrange(256))),
        rng.randrange(17) if live else rng.randrange(65536), comm_id if live else rng.getrandbits(64),
        rng.randrange(64) if live else rng.getrandbits(64), rng.randrange(16) if live else rng.getrandbits(63),
        rng.choice((0, 8, 4096, 2 ** 64 - 1, rng.getrandbits(64))))


def _transport_case(comm_id: int, replay: List[bytes]) -> Callable[[random.Random], Tuple[str, object]]:
    """('zmq', frames) for a stranger's DEALER (9 in 10: a TCP connection costs far more) or ('raw', bytes)."""
    def make(rng: random.Random) -> Tuple[str, object]:
        r = rng.random()
        if r < 0.1:
            return "raw", blob(rng, 300) if rng.random() < 0.5 else _zmtp(rng)
        if r < 0.2:
            return "zmq", replay  # a replayed hello
        if r < 0.35:
            return "zmq", [replay[0], mutate(rng, replay[1]) if rng.random() < 0.7 else blob(rng, 56)]
        if r < 0.9:
            payloads = [mutate(rng, replay[1]) if rng.random() < 0.2 else blob(rng, 128)
                        for _ in range(rng.randint(0, 3))]
            return "zmq", [mutate(rng, _header(rng, comm_id))] + payloads
        return "zmq", [blob(rng, 2 * wire.HEADER.size) for _ in range(rng.randint(1, 3))]  # no header at all
    return make


def _fuzz_endpoint(tr, comm_id: int, n: int, stats: Dict[str, Any], done: threading.Event) -> None:
    """Rank 0's fuzzer thread: `n` inputs against its own transport's ROUTER, then `done` (and any error)."""
    host, port = tr.endpoint[len("tcp://"):].rsplit(":", 1)
    ctx = zmq.Context()
    hello = wire.make_hello(tr._token, tr.rank, tr.rank, bytes(16))  # this job has not seen the nonce
    replay = [wire.pack_header(wire.KIND_HELLO, 0, 0, 0, 0, len(hello)), hello]
    original = ctx.socket(zmq.DEALER)  # the one genuine use of this hello; every other copy is a replay
    original.connect(tr.endpoint)
    seen = len(tr._seen_nonces)
    original.send_multipart(replay)
    # only once the transport has taken it: zmq keeps no order between sockets, and a stranger's copy
    # that arrived first would be that genuine first use (its forged messages then delivered as rank 0's)
    deadline = time.monotonic() + STALL
    while len(tr._seen_nonces) == seen and time.monotonic() < deadline:
        time.sleep(0.001)
    strangers = [ctx.socket(zmq.DEALER) for _ in range(4)]
    for s in strangers:
        s.connect(tr.endpoint)

    def send(case: Tuple[str, object]) -> None:
        kind, data = case
        stats[kind] += 1
        if kind == "zmq":
            strangers[stats["zmq"] % len(strangers)].send_multipart(data)
            return
        with socket.create_connection((host, int(port)), timeout=STALL) as s:
            try:
                s.sendall(data)
            except (BrokenPipeError, ConnectionResetError):  # zmq hung up on us: fine
                pass
    try:
        fuzz(_transport_case(comm_id, replay), send, n, seed=2)
    except Exception as e:  # for the main thread to raise
        stats["error"] = e
    finally:
        for s in strangers + [original]:
            s.close(linger=2000)  # what is queued still reaches the ROUTER
        ctx.term()
        done.set()


def _job_under_fire(comm, n_inputs: int) -> Dict[str, Any]:
    """Both ranks allreduce and check every result while rank 0's thread fuzzes its own endpoint."""
    logging.getLogger("pycoll.tcp").setLevel(logging.ERROR)  # one warning per rejected input otherwise
    tr = comm.transport
    stats: Dict[str, Any] = {"zmq": 0, "raw": 0}
    done = threading.Event()
    before = tr.rejected
    if comm.rank == 0:
        threading.Thread(target=_fuzz_endpoint, args=(tr, comm.comm_id, n_inputs, stats, done),
                         daemon=True).start()
    t_start, worst, calls, finished = time.monotonic(), 0.0, 0, False
    while not finished:
        x = np.full(calls % 97 + 2, float(comm.rank + 1 + calls))
        x[-1] = float(comm.rank == 0 and done.is_set() and (  # stop once every forged message is counted
            tr.rejected - before >= stats["zmq"] or time.monotonic() - t_start > 90))
        t0 = time.monotonic()
        comm.allreduce(x, timeout=STALL)
        worst = max(worst, time.monotonic() - t0)
        assert np.all(x[:-1] == 2 * calls + 3), f"call {calls}: wrong allreduce result {x[:4]}"
        calls, finished = calls + 1, bool(x[-1])
    if "error" in stats:
        raise stats["error"]
    return {"calls": calls, "worst_s": round(worst, 3), "took_s": round(time.monotonic() - t_start, 1),
            "rejected": tr.rejected - before, "left_unmatched": len(tr.matcher.unexpected), "dead": len(tr.dead),
            **stats}


@pytest.mark.timeout(150)
def test_tcp_transport_survives_fuzzing_while_a_job_runs():
    fuzzed, other = run_ranks(_job_under_fire, 2, TRANSPORT_INPUTS, timeout=140, env={"PYCOLL_TRANSPORT": "tcp"})
    print(f"transport: {fuzzed}")
    assert fuzzed["zmq"] + fuzzed["raw"] == TRANSPORT_INPUTS
    assert fuzzed["rejected"] >= fuzzed["zmq"], "a forged message was not turned away"
    assert fuzzed["left_unmatched"] == fuzzed["dead"] == 0  # nothing forged was queued as a peer's message
    assert fuzzed["worst_s"] < STALL and other["calls"] == fuzzed["calls"] > 10

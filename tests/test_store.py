"""TCPStore, FileStore and PrefixStore: semantics, timeouts, tokens, hostile, silent and flooding
clients, many processes."""
import logging
import os
import random
import re
import socket
import struct
import threading
import time

import numpy as np
import pytest

from multiproc import free_port, run_ranks
from pycoll.bootstrap import store as store_mod
from pycoll.bootstrap.store import FileStore, PrefixStore, TCPStore, TCPStoreServer
from pycoll.errors import StoreError, TimeoutError
from pycoll.logutil import RateLimitedLog

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=["tcp", "file"])
def store(request, tmp_path):
    if request.param == "tcp":
        s = TCPStore("127.0.0.1", 0, is_master=True, token=b"secret", timeout=5, bind_host="127.0.0.1")
    else:
        s = FileStore(str(tmp_path / "store"), timeout=5)
    yield s
    s.close()


def test_set_get_add_check_delete(store):
    store.set("a", b"1")
    assert store.get("a") == b"1"
    store.set("a", b"")
    assert store.get("a") == b""
    assert store.add("n", 3) == 3 and store.add("n", -1) == 2
    assert store.get("n") == b"2"
    assert store.check(["a", "n"]) and not store.check(["a", "nope"])
    assert store.delete_key("a") and not store.delete_key("a")
    store.set("bin", bytes(range(256)) * 1000)
    assert store.get("bin") == bytes(range(256)) * 1000


def test_get_times_out_naming_the_key(store):
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="'missing'"):
        store.get("missing", timeout=0.3)
    assert time.monotonic() - t0 < 3


def test_wait_names_missing_keys(store):
    store.set("x", b"1")
    with pytest.raises(TimeoutError, match="'y'"):
        store.wait(["x", "y"], timeout=0.3)


def test_blocked_get_is_woken_by_set_from_another_thread(store):
    threading.Timer(0.2, store.set, args=("late", b"v")).start()
    assert store.get("late", timeout=5) == b"v"


def test_prefix_store_isolates_namespaces(store):
    a, b = PrefixStore("a", store), PrefixStore("b", store)
    a.set("k", b"1")
    b.set("k", b"2")
    assert (a.get("k"), b.get("k")) == (b"1", b"2")
    assert not a.check(["other"])


def test_wrong_token_is_refused():
    srv = TCPStore("127.0.0.1", 0, is_master=True, token=b"right", timeout=2, bind_host="127.0.0.1")
    with pytest.raises(StoreError, match="refused"):
        TCPStore("127.0.0.1", srv.port, token=b"wrong", timeout=2)
    srv.close()


def test_unreachable_store_names_the_address():
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(StoreError, match=f"127.0.0.1:{port}"):
        TCPStore("127.0.0.1", port, timeout=1)
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("garbage", [
    random.Random(0).randbytes(64),                 # fixed, so xdist workers collect the same ids
    struct.pack("!I", 0xFFFFFFF0) + b"x" * 10,      # oversized length field
    struct.pack("!I", 100) + b"short",              # truncated frame
    struct.pack("!I", 5) + b"\x01\x00\x00\x00\xff",  # field length past the end
    b"",
], ids=["random", "oversized", "truncated", "field-past-end", "empty"])
def test_hostile_clients_do_not_hurt_the_server(garbage):
    srv = TCPStoreServer("127.0.0.1", 0, token=b"t")
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", srv.port)) as s:
            s.sendall(garbage)
    good = TCPStore("127.0.0.1", srv.port, token=b"t", timeout=5)
    good.set("still", b"works")
    assert good.get("still") == b"works"
    good.close()
    srv.close()


def _count_up(rank, port, token):
    s = TCPStore("127.0.0.1", port, token=token, timeout=20)
    values = [s.add("counter", 1) for _ in range(50)]
    s.set(f"done/{rank}", b"1")
    s.wait([f"done/{r}" for r in range(4)])
    return values, int(s.get("counter"))


def test_atomic_add_across_processes():
    srv = TCPStoreServer("127.0.0.1", 0, token=b"tok")
    try:
        results = run_ranks(_count_up, 4, srv.port, b"tok", init=False, timeout=60)
    finally:
        srv.close()
    seen = sorted(v for values, _ in results for v in values)
    assert seen == list(range(1, 201)) and all(total == 200 for _, total in results)


# -- strangers that connect and say nothing, or trickle, or flood the log -------------------------------
def _hung_up_within(sock: socket.socket, limit: float) -> float:
    """Seconds until the server closes `sock` (AssertionError after `limit`)."""
    t0 = time.monotonic()
    sock.settimeout(limit)
    try:
        while sock.recv(1):
            pass
    except ConnectionResetError:
        pass
    except socket.timeout:
        raise AssertionError(f"still connected after {limit:g} s") from None
    return time.monotonic() - t0


@pytest.mark.parametrize("trickle", [False, True], ids=["silent", "one-byte-a-second"])
def test_a_stranger_gets_a_few_seconds_for_its_first_frame(trickle):
    srv = TCPStoreServer("127.0.0.1", 0, token=b"t")
    try:
        with socket.create_connection(("127.0.0.1", srv.port)) as s:
            if trickle:  # a valid length prefix, then the frame a byte at a time
                threading.Thread(target=_trickle, args=(s,), daemon=True).start()
            took = _hung_up_within(s, store_mod.HANDSHAKE_TIMEOUT + 5)
        assert store_mod.HANDSHAKE_TIMEOUT - 0.5 < took < store_mod.HANDSHAKE_TIMEOUT + 2, took
    finally:
        srv.close()


def _trickle(s: socket.socket) -> None:
    try:
        s.sendall(struct.pack("!I", 100))
        for _ in range(100):
            time.sleep(1.0)
            s.sendall(b"x")
    except OSError:
        pass  # hung up on: what the test waits for


def _conn_threads() -> int:
    return sum(t.name == "pycoll-store-conn" for t in threading.enumerate())


def _hung_up(s: socket.socket) -> bool:
    """True once the server closed `s`: read away what it sent (its challenge) until EOF or nothing more."""
    try:
        while True:
            if s.recv(65536, socket.MSG_DONTWAIT) == b"":
                return True
    except BlockingIOError:
        return False
    except OSError:  # reset, or closed by a failed reopen
        return True


class _Strangers:
    """`n` connections that never say a word, reopened as soon as the server drops one."""

    def __init__(self, port: int, n: int) -> None:
        self.port, self.reopened, self.most_threads = port, 0, 0
        self.socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]
        self._stop = threading.Event()
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._hold, daemon=True)
        self._thread.start()

    def _hold(self) -> None:
        while not self._stop.wait(0.05):
            self.most_threads = max(self.most_threads, _conn_threads())
            for i, s in enumerate(self.socks):
                dropped = _hung_up(s)
                if dropped:
                    s.close()
                    try:
                        self.socks[i] = socket.create_connection(("127.0.0.1", self.port))
                    except OSError:
                        continue  # the next round tries again
                    with self._changed:
                        self.reopened += 1
                        self._changed.notify_all()

    def wait_reopened(self, n: int, timeout: float) -> None:
        """Wait until `n` connections were dropped by the server and reopened (or `timeout` passes)."""
        with self._changed:
            self._changed.wait_for(lambda: self.reopened >= n, timeout)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for s in self.socks:
            s.close()


def _allreduce_via(rank, port, token):
    os.environ.update(MASTER_PORT=str(port), PYCOLL_JOB_TOKEN=token.hex())
    import pycoll
    with pycoll.init() as comm:
        x = np.full(1000, rank + 1.0)
        comm.allreduce(x)
        comm.barrier()
        return float(x[0])


@pytest.mark.timeout(90)
@pytest.mark.parametrize("cap", [None, 8], ids=["default-cap", "cap-8"])
def test_job_works_while_50_strangers_hold_connections(monkeypatch, cap):
    """50 silent connections, reopened whenever dropped: the job still rendezvouses and computes, and
    with a cap below 50 the server never runs more than the cap of threads for strangers."""
    if cap is not None:
        monkeypatch.setattr(store_mod, "MAX_UNAUTHENTICATED", cap)
    limit = store_mod.MAX_UNAUTHENTICATED
    token = b"job-token"
    srv = TCPStoreServer("127.0.0.1", 0, token=token)
    strangers = _Strangers(srv.port, 50)
    try:
        time.sleep(0.5)  # all 50 are in
        t0 = time.monotonic()
        results = run_ranks(_allreduce_via, 3, srv.port, token, init=False, timeout=80)
        took = time.monotonic() - t0
        if limit < 50:  # evicted while the job ran; the strangers notice each within a sweep or two
            strangers.wait_reopened(50 - limit, timeout=20)
    finally:
        strangers.close()
        srv.close()
    print(f"cap {limit}: job took {took:.1f} s, strangers reopened {strangers.reopened} times, "
          f"at most {strangers.most_threads} connection threads")
    assert results == [6.0] * 3
    # strangers' threads, the ranks' own connections (a few each), evicted threads still winding down
    assert strangers.most_threads <= limit + 20
    if limit < 50:
        assert strangers.reopened >= 50 - limit  # the oldest were evicted as new ones came in


def test_rejections_are_logged_rate_limited(caplog):
    caplog.set_level(logging.WARNING, logger="pycoll.store")
    srv = TCPStoreServer("127.0.0.1", 0, token=b"t")
    for _ in range(100):
        with socket.create_connection(("127.0.0.1", srv.port)) as s:
            s.sendall(struct.pack("!I", 5) + b"\x01\x00\x00\x00\xff")  # a broken first frame
            s.recv(16)  # the challenge (the server may still be reading the broken frame)
    deadline = time.monotonic() + 30
    while srv.rejects.total < 100 and time.monotonic() < deadline:  # every rejection counted before close()
        time.sleep(0.01)
    good = TCPStore("127.0.0.1", srv.port, token=b"t", timeout=5)
    good.set("still", b"works")
    good.close()
    srv.close()
    messages = [r.getMessage() for r in caplog.records if r.name == "pycoll.store"]
    assert sum("rejected client (" in m for m in messages) == srv.rejects.burst, messages
    assert re.fullmatch(r"store: rejected clients: 95 more suppressed in the last \d+ s \(100 in all\)",
                        messages[-1]), messages
    assert len(messages) == srv.rejects.burst + 1


def test_rate_limited_log_lets_a_burst_through_per_interval(caplog):
    caplog.set_level(logging.WARNING, logger="test.flood")
    now = [0.0]
    limiter = RateLimitedLog(logging.getLogger("test.flood"), "bad frames", burst=3, interval=10.0,
                             clock=lambda: now[0])
    for i in range(20):
        limiter.warning("bad frame %d", i)
    now[0] = 12.0
    limiter.warning("bad frame %d", 20)  # a new interval: the summary, then this one
    limiter.flush()  # nothing left to report
    assert [r.getMessage() for r in caplog.records] == [
        "bad frame 0", "bad frame 1", "bad frame 2",
        "bad frames: 17 more suppressed in the last 12 s (21 in all)", "bad frame 20"]
    assert limiter.total == 21 and limiter.suppressed == 0

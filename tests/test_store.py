"""TCPStore, FileStore and PrefixStore: semantics, timeouts, tokens, hostile clients, many processes."""
import random
import socket
import struct
import threading
import time

import pytest

from multiproc import run_ranks
from pycoll.bootstrap.store import FileStore, PrefixStore, TCPStore, TCPStoreServer
from pycoll.errors import StoreError, TimeoutError

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
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
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

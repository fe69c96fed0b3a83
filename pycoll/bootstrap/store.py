"""Rendezvous key-value stores: TCPStore (served by rank 0 or the launcher), FileStore, PrefixStore.

The TCP protocol is length-prefixed binary with no pickle: a request is one frame
`u32 length | op byte | fields`, each field `u32 length | bytes`; a reply is one frame
`status byte | fields`. The server opens each connection with a challenge (`ST_OK | magic | nonce`);
the client's first frame answers it with HMAC(job token, nonce) within HANDSHAKE_TIMEOUT seconds,
so the token never crosses the wire and a captured answer is worthless on any other connection; at most MAX_UNAUTHENTICATED connections wait for theirs (a new one
evicts the oldest), so strangers cannot pin the server's threads. Rejections are logged
rate-limited (pycoll.logutil).
"""
from __future__ import annotations

import fcntl
import hashlib
import hmac
import logging
import os
import secrets
import socket
import struct
import threading
import time
import urllib.parse
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence, Tuple

from ..errors import StoreError, TimeoutError
from ..logutil import RateLimitedLog

log = logging.getLogger("pycoll.store")

DEFAULT_TIMEOUT = 300.0
MAX_FRAME = 64 << 20  # larger length fields are hostile or broken: the connection is dropped
MAX_HELLO_FRAME = 1024  # a client's first frame, read before its token is checked: strangers get no more
HANDSHAKE_TIMEOUT = 5.0  # seconds a new connection has to send its whole first frame
MAX_UNAUTHENTICATED = 64  # connections awaiting their first frame; a new one evicts the oldest
EVICT_WAIT = 0.5  # s the accept loop waits for an evicted stranger's thread to end before serving more
_WAIT_SLICE = 3600.0  # longest single condition wait: huge or infinite timeouts overflow the lock's limit
_MAGIC = b"PYCS2"  # 2: challenge-response hello (1 sent the token itself)
NONCE_BYTES = 16
_U32 = struct.Struct("!I")
_I64 = struct.Struct("!q")
_F64 = struct.Struct("!d")

(OP_HELLO, OP_SET, OP_GET, OP_ADD, OP_CHECK, OP_WAIT, OP_DELETE, OP_NUM_KEYS) = range(1, 9)
ST_OK, ST_MISSING, ST_DENIED, ST_BAD = range(4)


def store_mac(token: bytes, nonce: bytes) -> bytes:
    """A client's answer to the server's challenge: proof it holds `token`, good for this nonce only."""
    return hmac.new(token, b"pycoll-store" + nonce, hashlib.sha256).digest()


def challenge_frame(nonce: bytes) -> bytes:
    """The server's first frame on every connection."""
    body = bytes([ST_OK]) + _U32.pack(len(_MAGIC)) + _MAGIC + _U32.pack(len(nonce)) + nonce
    return _U32.pack(len(body)) + body


class Store(ABC):
    """A blocking key-value store shared by all ranks of a job (torch c10d Store semantics)."""

    timeout: float = DEFAULT_TIMEOUT

    @abstractmethod
    def set(self, key: str, value: bytes) -> None:
        """Store `value` under `key`, waking every rank blocked on it."""

    @abstractmethod
    def get(self, key: str, timeout: Optional[float] = None) -> bytes:
        """Return the value of `key`, waiting for it up to `timeout` seconds."""

    @abstractmethod
    def add(self, key: str, amount: int) -> int:
        """Atomically add `amount` to the integer under `key` (0 if absent) and return the sum."""

    @abstractmethod
    def check(self, keys: Sequence[str]) -> bool:
        """True when every key exists, without waiting."""

    @abstractmethod
    def delete_key(self, key: str) -> bool:
        """Remove `key`; True if it existed."""

    def wait(self, keys: Sequence[str], timeout: Optional[float] = None) -> None:
        """Block until every key exists; TimeoutError lists the keys still missing."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        for key in keys:
            try:
                self.get(key, timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                missing = [k for k in keys if not self.check([k])]
                raise TimeoutError(f"store keys still missing after the timeout: {missing}") from None

    def close(self) -> None:
        """Release connections and files held by this handle."""


def _encode(op: int, *fields: bytes) -> bytes:
    body = bytes([op]) + b"".join(_U32.pack(len(f)) + f for f in fields)
    return _U32.pack(len(body)) + body


def _decode_fields(body: bytes) -> List[bytes]:
    fields, pos = [], 0
    while pos < len(body):
        if pos + 4 > len(body):
            raise ValueError("truncated field length")
        (n,) = _U32.unpack_from(body, pos)
        pos += 4
        if pos + n > len(body):
            raise ValueError("field runs past the end of the frame")
        fields.append(body[pos:pos + n])
        pos += n
    return fields


def _recv_exact(sock: socket.socket, n: int, deadline: Optional[float] = None) -> bytes:
    """Exactly `n` bytes; with a monotonic `deadline`, socket.timeout once it passes (however the
    bytes trickle in)."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout(f"deadline passed with {got} of {n} bytes received")
            sock.settimeout(left)
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("connection closed")
        got += k
    return bytes(buf)


def _recv_frame(sock: socket.socket, limit: int = MAX_FRAME, deadline: Optional[float] = None) -> bytes:
    (n,) = _U32.unpack(_recv_exact(sock, 4, deadline))
    if n == 0 or n > limit:
        raise ValueError(f"frame length {n} out of range")
    return _recv_exact(sock, n, deadline)


class TCPStoreServer:
    """The store's server: a thread per client over a dict guarded by one condition variable."""

    def __init__(self, host: str = "0.0.0.0", port: int = 0, token: Optional[bytes] = None) -> None:
        self._token = token
        self._data: Dict[bytes, bytes] = {}
        self._cond = threading.Condition()
        self._closed = False
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as e:
            self._sock.close()
            raise StoreError(f"cannot serve the rendezvous store on {host}:{port}: {e} "
                             "(is MASTER_PORT already in use?)") from e
        self._sock.listen(1024)
        self.host = host
        self.port = self._sock.getsockname()[1]
        self._conns: List[socket.socket] = []
        # connections awaiting their first frame -> the thread serving each
        self._pending: "OrderedDict[socket.socket, threading.Thread]" = OrderedDict()
        self._pending_lock = threading.Lock()
        self.rejects = RateLimitedLog(log, "store: rejected clients")
        self._thread = threading.Thread(target=self._accept_loop, name="pycoll-store", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, addr = self._sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._conns.append(conn)
            evicted = None
            with self._pending_lock:
                if len(self._pending) >= MAX_UNAUTHENTICATED:
                    oldest, evicted = self._pending.popitem(last=False)
                    _hang_up(oldest)  # its thread sees the connection close and ends
                    self.rejects.warning("store: dropped the oldest of %d connections still silent "
                                         "(a new one came in)", MAX_UNAUTHENTICATED)
                thread = self._pending[conn] = threading.Thread(target=self._serve, args=(conn, addr), daemon=True,
                                                                name="pycoll-store-conn")
            if evicted is not None:  # a flood of strangers waits for their threads to end, not the CPU's mercy
                evicted.join(EVICT_WAIT)
            thread.start()

    def _serve(self, conn: socket.socket, addr) -> None:
        try:
            if not self._handshake(conn, addr):
                return
            while not self._closed:
                body = _recv_frame(conn)
                reply = self._handle(body[0], _decode_fields(body[1:]))
                conn.sendall(_U32.pack(len(reply)) + reply)
        except (ConnectionError, OSError):
            pass
        except (ValueError, IndexError, struct.error) as e:
            self.rejects.warning("store: dropped client %s after a malformed request: %s", addr, e)
        finally:
            conn.close()
            self._conns.remove(conn)

    def _handshake(self, conn: socket.socket, addr) -> bool:
        """Challenge the client, read its answer within HANDSHAKE_TIMEOUT s and reply; True for a job member."""
        nonce = secrets.token_bytes(NONCE_BYTES)
        try:
            conn.sendall(challenge_frame(nonce))
            body = _recv_frame(conn, MAX_HELLO_FRAME, time.monotonic() + HANDSHAKE_TIMEOUT)
            fields = _decode_fields(body[1:])
            ok = body[0] == OP_HELLO and len(fields) == 2 and fields[0] == _MAGIC
            if ok and self._token is not None:
                ok = hmac.compare_digest(fields[1], store_mac(self._token, nonce))
        except (ValueError, IndexError, socket.timeout) as e:
            self.rejects.warning("store: rejected client %s: bad handshake (%s)", addr, e)
            return False
        finally:
            with self._pending_lock:
                self._pending.pop(conn, None)
        conn.settimeout(None)
        status = ST_OK if ok else ST_DENIED
        conn.sendall(_U32.pack(1) + bytes([status]))
        if not ok:
            self.rejects.warning("store: rejected client %s: wrong job token or protocol", addr)
        return ok

    def _wait_keys(self, keys: List[bytes], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not all(k in self._data for k in keys):
                left = deadline - time.monotonic()
                if not left > 0 or self._closed:  # `not >`: a NaN timeout must not spin
                    return False
                self._cond.wait(min(left, _WAIT_SLICE))
            return True

    def _handle(self, op: int, f: List[bytes]) -> bytes:
        def reply(status: int, *fields: bytes) -> bytes:
            return bytes([status]) + b"".join(_U32.pack(len(x)) + x for x in fields)

        if op == OP_SET:
            with self._cond:
                self._data[f[0]] = f[1]
                self._cond.notify_all()
            return reply(ST_OK)
        if op == OP_GET:
            if not self._wait_keys([f[0]], _F64.unpack(f[1])[0]):
                return reply(ST_MISSING)
            with self._cond:
                return reply(ST_OK, self._data[f[0]])
        if op == OP_ADD:
            with self._cond:
                value = int(self._data.get(f[0], b"0")) + _I64.unpack(f[1])[0]
                self._data[f[0]] = str(value).encode()
                self._cond.notify_all()
            return reply(ST_OK, _I64.pack(value))
        if op == OP_CHECK:
            with self._cond:
                return reply(ST_OK if all(k in self._data for k in f) else ST_MISSING)
        if op == OP_WAIT:
            return reply(ST_OK if self._wait_keys(f[1:], _F64.unpack(f[0])[0]) else ST_MISSING)
        if op == OP_DELETE:
            with self._cond:
                return reply(ST_OK if self._data.pop(f[0], None) is not None else ST_MISSING)
        if op == OP_NUM_KEYS:
            with self._cond:
                return reply(ST_OK, _I64.pack(len(self._data)))
        return reply(ST_BAD)

    def put(self, key: str, value: bytes) -> None:
        """Set `key` from the serving process itself (a launcher telling the ranks something), waking
        every client blocked on it, as a client's set would."""
        with self._cond:
            self._data[key.encode()] = bytes(value)
            self._cond.notify_all()

    def close(self) -> None:
        """Stop serving; clients blocked in get/wait see the connection close."""
        self._closed = True
        with self._cond:
            self._cond.notify_all()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        for c in list(self._conns):
            _hang_up(c)
        self.rejects.flush()


def _hang_up(conn: socket.socket) -> None:
    """Shut a connection down, waking the thread blocked reading it (which then closes it)."""
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class TCPStore(Store):
    """Client of a TCPStoreServer; with `is_master=True` it also starts the server in this process."""

    def __init__(self, host: str, port: int, *, is_master: bool = False, token: Optional[bytes] = None,
                 timeout: float = DEFAULT_TIMEOUT, bind_host: str = "0.0.0.0") -> None:
        self.timeout = timeout
        self.server: Optional[TCPStoreServer] = None
        if is_master:
            self.server = TCPStoreServer(bind_host, port, token)
            port = self.server.port
        self.host, self.port = host, port
        self._token = token or b""
        self._local = threading.local()  # one connection per thread: a blocked get never stalls a set
        self._socks: List[socket.socket] = []
        self._sock()

    def _sock(self) -> socket.socket:
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = self._local.sock = self._connect(self._token)
            self._socks.append(sock)
        return sock

    def _connect(self, token: bytes) -> socket.socket:
        deadline = time.monotonic() + self.timeout
        delay, last = 0.01, None
        while True:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=min(5.0, self.timeout))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.settimeout(min(HANDSHAKE_TIMEOUT, self.timeout))
                challenge = _recv_frame(sock, MAX_HELLO_FRAME)
                fields = _decode_fields(challenge[1:])
                if challenge[0] != ST_OK or len(fields) != 2 or fields[0] != _MAGIC:
                    sock.close()
                    raise StoreError(f"{self.host}:{self.port} is not a pycoll rendezvous store of this "
                                     "version (no challenge)")
                sock.sendall(_encode(OP_HELLO, _MAGIC, store_mac(token, fields[1]) if token else b""))
                status = _recv_frame(sock)[0]
                if status == ST_DENIED:
                    sock.close()
                    raise StoreError(f"the rendezvous store at {self.host}:{self.port} refused this "
                                     "client: wrong job token (PYCOLL_JOB_TOKEN) or protocol")
                sock.settimeout(None)
                return sock
            except (OSError, ValueError) as e:
                last = e
            if time.monotonic() + delay > deadline:
                raise StoreError(f"could not reach the rendezvous store at {self.host}:{self.port} "
                                 f"within {self.timeout:g} s (check MASTER_ADDR/MASTER_PORT and that "
                                 f"rank 0 is running): {last}")
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    def _call(self, op: int, *fields: bytes) -> Tuple[int, List[bytes]]:
        sock = self._sock()
        try:
            sock.sendall(_encode(op, *fields))
            body = _recv_frame(sock)
        except (OSError, ValueError) as e:
            raise StoreError(f"lost the rendezvous store at {self.host}:{self.port}: {e}") from e
        return body[0], _decode_fields(body[1:])

    def set(self, key: str, value: bytes) -> None:
        self._call(OP_SET, key.encode(), bytes(value))

    def get(self, key: str, timeout: Optional[float] = None) -> bytes:
        t = self.timeout if timeout is None else timeout
        status, fields = self._call(OP_GET, key.encode(), _F64.pack(t))
        if status != ST_OK:
            raise TimeoutError(f"store key {key!r} did not appear within {t:g} s")
        return fields[0]

    def add(self, key: str, amount: int) -> int:
        return _I64.unpack(self._call(OP_ADD, key.encode(), _I64.pack(amount))[1][0])[0]

    def check(self, keys: Sequence[str]) -> bool:
        return self._call(OP_CHECK, *[k.encode() for k in keys])[0] == ST_OK

    def wait(self, keys: Sequence[str], timeout: Optional[float] = None) -> None:
        t = self.timeout if timeout is None else timeout
        if self._call(OP_WAIT, _F64.pack(t), *[k.encode() for k in keys])[0] != ST_OK:
            missing = [k for k in keys if not self.check([k])]
            raise TimeoutError(f"store keys still missing after {t:g} s: {missing}")

    def delete_key(self, key: str) -> bool:
        return self._call(OP_DELETE, key.encode())[0] == ST_OK

    def num_keys(self) -> int:
        """How many keys the server holds."""
        return _I64.unpack(self._call(OP_NUM_KEYS)[1][0])[0]

    def close(self) -> None:
        try:
            for sock in self._socks:
                sock.close()
        finally:
            if self.server is not None:
                self.server.close()


class FileStore(Store):
    """A store in a directory on a shared file system: one file per key, atomic rename on set."""

    def __init__(self, path: str, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.path, self.timeout = path, timeout
        os.makedirs(path, exist_ok=True)

    def _file(self, key: str) -> str:
        return os.path.join(self.path, "k_" + urllib.parse.quote(key, safe=""))

    def set(self, key: str, value: bytes) -> None:
        tmp = f"{self._file(key)}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "wb") as fh:
            fh.write(bytes(value))
        os.replace(tmp, self._file(key))

    def get(self, key: str, timeout: Optional[float] = None) -> bytes:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        delay = 0.001
        while True:
            try:
                with open(self._file(key), "rb") as fh:
                    return fh.read()
            except FileNotFoundError:
                pass
            if time.monotonic() >= deadline:
                raise TimeoutError(f"store key {key!r} did not appear in {self.path}")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def add(self, key: str, amount: int) -> int:
        with open(os.path.join(self.path, ".lock"), "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                with open(self._file(key), "rb") as fh:
                    value = int(fh.read()) + amount
            except FileNotFoundError:
                value = amount
            self.set(key, str(value).encode())
            return value

    def check(self, keys: Sequence[str]) -> bool:
        return all(os.path.exists(self._file(k)) for k in keys)

    def delete_key(self, key: str) -> bool:
        try:
            os.unlink(self._file(key))
            return True
        except FileNotFoundError:
            return False


class PrefixStore(Store):
    """Namespaces every key of an underlying store, so communicators never collide."""

    def __init__(self, prefix: str, store: Store) -> None:
        self.prefix, self.store = prefix, store
        self.timeout = store.timeout

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    def set(self, key: str, value: bytes) -> None:
        self.store.set(self._k(key), value)

    def get(self, key: str, timeout: Optional[float] = None) -> bytes:
        return self.store.get(self._k(key), timeout)

    def add(self, key: str, amount: int) -> int:
        return self.store.add(self._k(key), amount)

    def check(self, keys: Sequence[str]) -> bool:
        return self.store.check([self._k(k) for k in keys])

    def wait(self, keys: Sequence[str], timeout: Optional[float] = None) -> None:
        self.store.wait([self._k(k) for k in keys], timeout)

    def delete_key(self, key: str) -> bool:
        return self.store.delete_key(self._k(key))

"""Where the job token comes from, so that it never travels through the rendezvous store.

In order (docs/security.md has the per-launcher table):
1. PYCOLL_JOB_TOKEN (hex) or PYCOLL_JOB_TOKEN_FILE (a file only its owner can read), e.g. from
   `pycoll run`, which draws one;
2. under an MPI launcher with mpi4py: rank 0 draws it and broadcasts it over MPI;
3. every rank on this host: rank 0 writes it to a file private to the uid (a 0700 folder under the
   temp dir, the file 0600) and the store carries only the file's name and a fingerprint;
4. otherwise (several hosts, no secret): an EnvError saying what to set, unless PYCOLL_INSECURE=1,
   which warns on every rank and passes the token through the store as before.
Same-uid processes on a host are trusted: they can read that file, as they could ptrace a rank.
"""
from __future__ import annotations

import errno
import hashlib
import logging
import os
import secrets
import stat
import tempfile
import time
from typing import Mapping, Optional

from .. import config
from ..errors import EnvError, StoreError, TimeoutError

log = logging.getLogger("pycoll.token")

TOKEN_BYTES = 32
REF_KEY = "tokenref"   # the store key of the file id and fingerprint (case 3): nothing secret
INSECURE_KEY = "token"  # PYCOLL_INSECURE=1 only: the token itself, in the store
WHAT_TO_SET = ("set PYCOLL_JOB_TOKEN (e.g. `export PYCOLL_JOB_TOKEN=$(openssl rand -hex 32)` on every node) or "
               "PYCOLL_JOB_TOKEN_FILE (a chmod 600 file on a shared file system), launch with `pycoll run` "
               "or under mpirun with mpi4py installed; PYCOLL_INSECURE=1 lets any host that reaches the "
               "store join the job")


def draw() -> bytes:
    return secrets.token_bytes(TOKEN_BYTES)


def fingerprint(token: bytes) -> str:
    """A non-secret check that a file holds this job's token (sha256, first 16 bytes, hex)."""
    return hashlib.sha256(b"pycoll-token-fingerprint" + token).hexdigest()[:32]


def read_token_file(path: str) -> bytes:
    """The hex token in `path`; EnvError if it is missing, empty, not hex, or readable by group/other."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise EnvError(f"PYCOLL_JOB_TOKEN_FILE={path}: cannot open it: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if st.st_mode & 0o077:
            raise EnvError(f"PYCOLL_JOB_TOKEN_FILE={path} can be read by other users (mode "
                           f"{stat.S_IMODE(st.st_mode):o}): `chmod 600 {path}`")
        text = os.read(fd, 4096).decode(errors="replace").strip()
    finally:
        os.close(fd)
    try:
        token = bytes.fromhex(text)
    except ValueError:
        token = b""
    if not token:
        raise EnvError(f"PYCOLL_JOB_TOKEN_FILE={path} does not hold a hex token "
                       "(write one with `openssl rand -hex 32 > FILE`)")
    return token


def env_token(env: Optional[Mapping[str, str]] = None) -> Optional[bytes]:
    """Source 1: PYCOLL_JOB_TOKEN, else the file PYCOLL_JOB_TOKEN_FILE names; None if neither is set."""
    token = config.get("PYCOLL_JOB_TOKEN", env)
    if token is not None:
        return token
    path = config.get("PYCOLL_JOB_TOKEN_FILE", env)
    return read_token_file(path) if path else None


_mpi_token: Optional[bytes] = None  # one per process: the first broadcast serves every later group


def mpi_token(rank: int, size: int, source: str) -> Optional[bytes]:
    """Source 2: drawn by MPI rank 0 and broadcast over MPI_COMM_WORLD (collective: every rank of the
    world calls it); None without mpi4py, or when this group is not the MPI world."""
    global _mpi_token
    from .env import MPI_SOURCES
    if source not in MPI_SOURCES:
        return None
    if _mpi_token is not None:
        return _mpi_token
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    world = MPI.COMM_WORLD
    if world.Get_size() != size or world.Get_rank() != rank:
        return None
    _mpi_token = world.bcast(draw() if rank == 0 else None, root=0)
    return _mpi_token


def _all_refuse(store, rank: int, size: int, wait: float = 5.0) -> None:
    """Every rank reaches the same refusal; rank 0 (which may serve the store) waits a little for the
    others to count in, so they raise the same helpful error rather than 'lost the store'."""
    try:
        store.add("refused", 1)
        if rank == 0:
            deadline = time.monotonic() + wait
            while store.add("refused", 0) < size and time.monotonic() < deadline:
                time.sleep(0.02)
    except Exception:  # noqa: BLE001  (best effort: the error that follows is what matters)
        pass


# -- source 3: a file private to this uid ----------------------------------------------------------------
def private_dir() -> str:
    """`<tmp>/pycoll-<uid>`, mode 0700 and ours; EnvError if someone else made it or opened it up."""
    path = os.path.join(tempfile.gettempdir(), f"pycoll-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise EnvError(f"{path} must be a folder owned by uid {os.getuid()} with mode 700 (it holds job "
                       f"tokens): it is {'not a folder' if not stat.S_ISDIR(st.st_mode) else oct(st.st_mode & 0o777)}"
                       f" owned by uid {st.st_uid}; remove it or `chmod 700 {path}`")
    return path


def write_private(name: str, token: bytes) -> str:
    """Write `token` (hex) to `name` in private_dir(), atomically, mode 0600; return its path."""
    folder = private_dir()
    path = os.path.join(folder, name)
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, token.hex().encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def read_private(name: str) -> Optional[bytes]:
    """The token in `name` of private_dir(); None if there is no such file (yet)."""
    path = os.path.join(private_dir(), name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ELOOP):
            return None
        raise
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            return None
        text = os.read(fd, 4096).decode(errors="replace")
    finally:
        os.close(fd)
    try:
        return bytes.fromhex(text) or None
    except ValueError:
        return None


def remove_private(path: Optional[str]) -> None:
    if path:
        try:
            os.unlink(path)
        except OSError:
            pass


def port_file(port: int) -> str:
    """The private file of the token of the store on loopback port `port` (one job per port)."""
    return f"store-{port}.token"


def loopback_store_client(host: str, port: int, timeout: float):
    """A rank other than 0 of a one-host job whose rank 0 serves pycoll's store on loopback `port`:
    read the token rank 0 left in the private port file and connect with it. A stale file (an earlier
    job on that port) is refused by the store, so keep re-reading until the deadline."""
    from .store import TCPStore
    deadline = time.monotonic() + timeout
    delay, last = 0.01, "no token file yet"
    while True:
        token = read_private(port_file(port))
        if token is not None:
            try:
                store = TCPStore(host, port, token=token, timeout=max(0.1, min(2.0, deadline - time.monotonic())))
                store.timeout = timeout
                return store, token
            except StoreError as e:
                last = str(e)
        if time.monotonic() + delay > deadline:
            raise StoreError(f"could not join the rendezvous store at {host}:{port} within {timeout:g} s: "
                             f"{last} (rank 0 writes this job's token to {private_dir()}/{port_file(port)}; "
                             "is it running, as the same user, on this host?)")
        time.sleep(delay)
        delay = min(delay * 2, 0.25)


def agree(store, rank: int, size: int, source: str, local_size: int, timeout: float):
    """The token of a job that had none when its store was made; returns (token, file rank 0 should
    remove once every peer has connected). `store` is this job's namespace."""
    if size == 1:
        return draw(), None
    token = mpi_token(rank, size, source)
    if token is not None:
        return token, None
    if local_size == size:  # every rank is on this host: a uid-private file
        if rank == 0:
            token = draw()
            fid = secrets.token_hex(8)
            path = write_private(f"job-{fid}.token", token)
            store.set(REF_KEY, f"{fid}:{fingerprint(token)}".encode())
            return token, path
        try:
            fid, fp = store.get(REF_KEY, timeout).decode().split(":")
        except (ValueError, UnicodeDecodeError):
            raise EnvError(f"rank {rank}: the store's {REF_KEY!r} entry is malformed") from None
        if not all(c in "0123456789abcdef" for c in fid):
            raise EnvError(f"rank {rank}: the store's {REF_KEY!r} entry names no token file")
        deadline = time.monotonic() + timeout
        while True:
            token = read_private(f"job-{fid}.token")
            if token is not None and secrets.compare_digest(fingerprint(token), fp):
                return token, None
            if time.monotonic() > deadline:
                raise EnvError(f"rank {rank}: {private_dir()}/job-{fid}.token is missing or holds another "
                               "job's token: do all ranks run as the same user on this host?")
            time.sleep(0.02)
    if not config.get("PYCOLL_INSECURE"):
        _all_refuse(store, rank, size)
        raise EnvError(f"rank {rank} of {size}: the ranks are on several hosts and share no secret, so "
                       f"any process that reaches the rendezvous store could join the job: {WHAT_TO_SET}")
    log.warning("rank %d: PYCOLL_INSECURE=1: the job token travels through the rendezvous store, so any "
                "process that can reach the store can read it and join the job", rank)
    if rank == 0:
        token = draw()
        store.set(INSECURE_KEY, token)
        return token, None
    try:
        return store.get(INSECURE_KEY, timeout), None
    except TimeoutError:
        raise TimeoutError(f"rank {rank}: rank 0 published no job token within {timeout:g} s "
                           "(set PYCOLL_INSECURE=1 on every rank, or none)") from None

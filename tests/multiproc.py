"""Run a function on N ranks in real processes that talk over real transports.

The parent serves the rendezvous store on a random port (like `pycoll run`), so parallel
tests under pytest-xdist never clash; every run has a deadline and kills its children.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import random
import secrets
import socket
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

from pycoll.bootstrap.store import TCPStoreServer

_CTX = mp.get_context("spawn")


class RankFailure(AssertionError):
    """One or more ranks raised, crashed or hung; the message holds every rank's story."""


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port nobody is bound to now, below the kernel's ephemeral range. A port the kernel
    hands out on bind(0) may be handed out again, as some connection's source port, before the
    test's launcher binds it (seen under pytest -n 2); ports below that range are only ever bound
    on purpose."""
    high = _ephemeral_low()
    low = max(1024, high - 12000)
    for _ in range(200):
        port = random.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port between {low} and {high}")


def _child(fn: Callable, rank: int, env: Dict[str, str], init: bool, args: tuple, results) -> None:
    os.environ.update(env)
    try:
        if init:
            import pycoll
            with pycoll.init() as comm:
                value = fn(comm, *args)
        else:
            value = fn(rank, *args)
        results.put((rank, True, value))
    except BaseException as e:  # report everything, SystemExit included, to the parent
        results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def rank_env(rank: int, size: int, port: int, token: bytes, extra: Optional[Dict[str, str]] = None
             ) -> Dict[str, str]:
    """The torchrun-style variables `pycoll run` would give rank `rank`."""
    env = {"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank),
           "LOCAL_WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "PYCOLL_STORE_HOSTED": "1", "PYCOLL_JOB_TOKEN": token.hex()}
    env.update(extra or {})
    return env


def run_ranks(fn: Callable, n: int, *args: Any, timeout: float = 60.0, init: bool = True,
              env: Optional[Dict[str, str]] = None, expect_fail: bool = False) -> List[Any]:
    """Call fn(comm, *args) (or fn(rank, *args) with init=False) on n ranks; results in rank order.

    With expect_fail=True, return [(ok, value_or_traceback)] per rank instead of raising.
    """
    token = secrets.token_bytes(16)
    server = TCPStoreServer("127.0.0.1", 0, token)
    results = _CTX.Queue()
    procs = [_CTX.Process(target=_child, daemon=True,
                          args=(fn, r, rank_env(r, n, server.port, token, env), init, args, results))
             for r in range(n)]
    for p in procs:
        p.start()
    got: Dict[int, tuple] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < n and time.monotonic() < deadline:
            try:
                rank, ok, value = results.get(timeout=0.2)
                got[rank] = (ok, value)
            except queue.Empty:
                for r, p in enumerate(procs):  # a rank that died without reporting
                    if r not in got and p.exitcode is not None and results.empty():
                        got[r] = (False, f"process exited with code {p.exitcode} without a result")
            if not expect_fail and any(not ok for ok, _ in got.values()):
                time.sleep(0.5)  # give the others a moment to report their side
                while not results.empty():
                    rank, ok, value = results.get()
                    got[rank] = (ok, value)
                break
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        server.close()
    if expect_fail:
        return [got.get(r, (False, "no result before the deadline")) for r in range(n)]
    failures = {r: v for r, (ok, v) in got.items() if not ok}
    missing = [r for r in range(n) if r not in got]
    if failures or missing:
        story = "\n".join(f"--- rank {r} ---\n{v}" for r, v in sorted(failures.items()))
        raise RankFailure(f"{len(failures)} rank(s) failed, ranks {missing} gave no result within "
                          f"{timeout:g} s\n{story}")
    return [got[r][1] for r in range(n)]

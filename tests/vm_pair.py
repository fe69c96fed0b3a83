"""Run a function on ranks split over the two soft-RoCE VMs of tests/rdma/run-vm-pair.sh.

Both VMs run the same tests in the same order (tests/test_verbs_hosts.py), so both call run_split
with the same arguments: each starts its own share of the job's ranks (VM 0 the first half, and
serves the job's store), and the two exchange their ranks' results through that store, so each VM
can check every rank. The job's port comes from a counter both VMs advance alike.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

from pycoll import config
from pycoll.bootstrap.store import TCPStore, TCPStoreServer

_CTX = mp.get_context("spawn")
BASE_PORT = 29600  # jobs use BASE_PORT, BASE_PORT + 2, ... (one per run_split call)
_jobs = 0


def pair() -> Optional[Tuple[int, str]]:
    """(this VM's node, 0 or 1; VM 0's address) inside the pair (PYCOLL_RDMA_PAIR), else None."""
    value = config.get("PYCOLL_RDMA_PAIR")
    if not value:
        return None
    node, _, master = value.partition(",")
    return int(node), master


def split(n: int) -> List[List[int]]:
    """The ranks of each VM for a job of n: VM 0 the first ceil(n/2), VM 1 the rest."""
    half = (n + 1) // 2
    return [list(range(half)), list(range(half, n))]


def _child(fn: Callable, rank: int, env: Dict[str, str], args: tuple, results: Any) -> None:
    os.environ.update(env)
    try:
        import pycoll
        with pycoll.init() as comm:
            value = fn(comm, *args)
        results.put((rank, True, value))
    except BaseException as e:  # report everything to the parent
        results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_split(fn: Callable, n: int, *args: Any, timeout: float, env: Optional[Dict[str, str]] = None,
              node_env: Optional[Dict[int, Dict[str, str]]] = None,
              rank_env: Optional[Dict[int, Dict[str, str]]] = None) -> List[Tuple[bool, Any]]:
    """fn(comm, *args) on n ranks split over the VMs (split(n)); `node_env[node]` adds to one VM's
    ranks' environment, `rank_env[rank]` to one rank's. Returns (ok, value or traceback) for every rank of the job, as both VMs see
    it (values pass through JSON: tuples come back as lists)."""
    global _jobs
    where = pair()
    if where is None:
        raise RuntimeError("run_split runs inside the VM pair of tests/rdma/run-vm-pair.sh (PYCOLL_RDMA_PAIR)")
    node, master = where
    port = BASE_PORT + 2 * (_jobs % 500)
    _jobs += 1
    token = bytes.fromhex(os.environ["PYCOLL_JOB_TOKEN"])
    mine = split(n)[node]
    server = TCPStoreServer("0.0.0.0", port, token) if node == 0 else None
    try:
        envs = {r: {**(env or {}), **(node_env or {}).get(node, {}), **(rank_env or {}).get(r, {})} for r in mine}
        local = _run_local(fn, n, mine, args, timeout, master, port, token, envs)
        return _exchange(node, local, master, port, token, timeout)
    finally:
        if server is not None:
            server.close()


def _run_local(fn: Callable, n: int, mine: List[int], args: tuple, timeout: float, master: str, port: int,
               token: bytes, envs: Dict[int, Dict[str, str]]) -> Dict[int, Tuple[bool, Any]]:
    results = _CTX.Queue()
    procs = {}
    for i, rank in enumerate(mine):
        rank_env = {"RANK": str(rank), "WORLD_SIZE": str(n), "LOCAL_RANK": str(i), "LOCAL_WORLD_SIZE": str(len(mine)),
                    "MASTER_ADDR": master, "MASTER_PORT": str(port), "PYCOLL_STORE_HOSTED": "1",
                    "PYCOLL_JOB_TOKEN": token.hex(), **envs[rank]}
        procs[rank] = _CTX.Process(target=_child, args=(fn, rank, rank_env, args, results), daemon=True)
        procs[rank].start()
    got: Dict[int, Tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < len(mine) and time.monotonic() < deadline:
            try:
                rank, ok, value = results.get(timeout=0.2)
                got[rank] = (ok, json.loads(json.dumps(value, default=repr)))
            except queue.Empty:
                for rank, p in procs.items():  # a rank that died without reporting
                    if rank not in got and p.exitcode is not None and results.empty():
                        got[rank] = (False, f"process exited with code {p.exitcode} without a result")
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
            p.join(5)
    return {rank: got.get(rank, (False, f"no result within {timeout:g} s")) for rank in mine}


def _exchange(node: int, local: Dict[int, Tuple[bool, Any]], master: str, port: int, token: bytes,
              timeout: float) -> List[Tuple[bool, Any]]:
    """Each VM's results to the other through the job's store (VM 0 keeps serving it until VM 1's
    came): every rank's, in rank order."""
    store = TCPStore(master, port, token=token, timeout=timeout)
    try:
        mine = json.dumps({str(r): v for r, v in local.items()}).encode()
        if node == 0:
            store.set("results/0", mine)
            other = store.get("results/1", timeout)
        else:
            other = store.get("results/0", timeout)
            store.set("results/1", mine)
    finally:
        store.close()
    merged = {**{int(r): (ok, v) for r, (ok, v) in json.loads(other).items()}, **local}
    return [merged[r] for r in sorted(merged)]

"""Rendezvous: build the store for a job, agree on the job token, and learn who shares a host."""
from __future__ import annotations

import ipaddress
import secrets
import time
from dataclasses import dataclass, field
from typing import List, Optional

from ..errors import EnvError, TimeoutError
from ..topology import RankInfo, detect, host_id  # noqa: F401  (host_id: re-exported)
from .env import MPI_SOURCES, JobEnv
from .netif import select_address
from .store import Store, TCPStore


def is_loopback(host: Optional[str]) -> bool:
    """True for localhost, 127.0.0.0/8 and ::1 (a job that can only be on this machine)."""
    if host is None:
        return True
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def make_store(job: JobEnv, timeout: float) -> Store:
    """The job's TCPStore: the launcher's at MASTER_ADDR:PYCOLL_STORE_PORT, else at MASTER_ADDR:MASTER_PORT,
    or published by rank 0 over MPI under mpirun."""
    if job.master_addr is not None and job.store_port is not None:
        return TCPStore(job.master_addr, job.store_port, is_master=False, token=job.token, timeout=timeout)
    if job.master_addr is not None:
        bind = "127.0.0.1" if is_loopback(job.master_addr) else "0.0.0.0"
        return TCPStore(job.master_addr, job.master_port or 0,
                        is_master=job.rank == 0 and not job.store_hosted,
                        token=job.token, timeout=timeout, bind_host=bind)
    if job.size == 1:
        return TCPStore("127.0.0.1", 0, is_master=True, token=job.token, timeout=timeout,
                        bind_host="127.0.0.1")
    if job.source in MPI_SOURCES:
        return _store_over_mpi(job, timeout)
    raise EnvError(f"rank {job.rank}: no way to reach the rendezvous store (no MASTER_ADDR)")


def _store_over_mpi(job: JobEnv, timeout: float) -> Store:
    try:
        from mpi4py import MPI
    except ImportError:
        raise EnvError(f"rank {job.rank} of {job.size} runs under an MPI launcher ({job.source}) with no "
                       "MASTER_ADDR, and mpi4py is not installed: `pip install pycoll[mpi]` or set "
                       "MASTER_ADDR/MASTER_PORT") from None
    world = MPI.COMM_WORLD
    single_host = job.local_size == job.size
    info = None
    if job.rank == 0:
        addr = "127.0.0.1" if single_host else select_address()[1]
        token = job.token or secrets.token_bytes(32)
        store = TCPStore(addr, 0, is_master=True, token=token, timeout=timeout, bind_host=addr)
        info = (addr, store.port, token.hex())
    info = world.bcast(info, root=0)
    if job.rank == 0:
        return store
    return TCPStore(info[0], info[1], token=bytes.fromhex(info[2]), timeout=timeout)


def job_token(store: Store, job: JobEnv, timeout: float) -> bytes:
    """The secret every peer proves it holds: from the launcher, else drawn by rank 0."""
    if job.token is not None:
        return job.token
    if job.rank == 0:
        token = secrets.token_bytes(32)
        store.set("token", token)
        return token
    return store.get("token", timeout)


@dataclass
class Membership:
    """Who shares a host with whom, learned from every rank's host id."""

    hosts: List[str]      # host id of each rank
    local_rank: int
    local_size: int
    ranks: List[RankInfo] = field(default_factory=list)  # what each rank reported (pycoll.topology)


def join(store: Store, rank: int, size: int, timeout: float) -> Membership:
    """Announce this rank (its RankInfo) and wait for all; TimeoutError names the ranks that never joined."""
    me = detect(rank)
    store.set(f"join/{rank}", me.to_json().encode())
    deadline = time.monotonic() + timeout
    infos: List[RankInfo] = []
    for peer in range(size):
        try:
            infos.append(RankInfo.from_json(
                store.get(f"join/{peer}", max(0.0, deadline - time.monotonic())).decode()))
        except TimeoutError:
            missing = [p for p in range(size) if not store.check([f"join/{p}"])]
            raise TimeoutError(f"rank {rank}: ranks {missing} of {size} never joined the job within "
                               f"{timeout:g} s (did they start, with the same MASTER_ADDR/MASTER_PORT?)",
                               peers=missing) from None
    hosts = [info.host for info in infos]
    same = [p for p in range(size) if hosts[p] == me.host]
    return Membership(hosts=hosts, local_rank=same.index(rank), local_size=len(same), ranks=infos)

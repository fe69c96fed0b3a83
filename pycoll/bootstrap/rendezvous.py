"""Rendezvous: build the store for a job, agree on the job token, and learn who shares a host."""
from __future__ import annotations

import ipaddress
import time
from dataclasses import dataclass, field, replace
from typing import List, Optional, Tuple

from ..errors import EnvError, TimeoutError
from ..topology import RankInfo, detect
from .env import MPI_SOURCES, JobEnv
from . import token as token_mod
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


def make_store(job: JobEnv, timeout: float) -> Tuple[Store, JobEnv]:
    """The job's TCPStore (the launcher's at MASTER_ADDR:PYCOLL_STORE_PORT, else at MASTER_ADDR:MASTER_PORT,
    or published by rank 0 over MPI under mpirun) and the job with the token it agreed on, when one could
    be had before the store: from the environment, over MPI, or (store on loopback) through a file
    private to the uid. The store then demands it."""
    if job.token is None and job.size > 1:
        job = replace(job, token=token_mod.mpi_token(job.rank, job.size, job.source))
    if job.master_addr is not None and job.store_port is not None:
        return TCPStore(job.master_addr, job.store_port, is_master=False, token=job.token, timeout=timeout), job
    if job.master_addr is not None:
        loopback = is_loopback(job.master_addr)
        bind = "127.0.0.1" if loopback else "0.0.0.0"
        master = job.rank == 0 and not job.store_hosted
        if job.token is None and loopback and not job.store_hosted and job.size > 1 and job.master_port:
            if not master:
                store, token = token_mod.loopback_store_client(job.master_addr, job.master_port, timeout)
                return store, replace(job, token=token)
            token = token_mod.draw()
            store = TCPStore(job.master_addr, job.master_port, is_master=True, token=token, timeout=timeout,
                             bind_host=bind)  # bound first: a busy port leaves another job's file alone
            path = token_mod.write_private(token_mod.port_file(store.port), token)
            return store, replace(job, token=token, token_file=path)
        return TCPStore(job.master_addr, job.master_port or 0, is_master=master,
                        token=job.token, timeout=timeout, bind_host=bind), job
    if job.size == 1:
        job = replace(job, token=job.token or token_mod.draw())
        return TCPStore("127.0.0.1", 0, is_master=True, token=job.token, timeout=timeout,
                        bind_host="127.0.0.1"), job
    if job.source in MPI_SOURCES:
        if job.token is None:
            raise EnvError(f"rank {job.rank} of {job.size} runs under an MPI launcher ({job.source}) with no "
                           "MASTER_ADDR, and mpi4py is not installed: `pip install pycoll[mpi]` or set "
                           "MASTER_ADDR/MASTER_PORT")
        return _store_over_mpi(job, timeout), job
    raise EnvError(f"rank {job.rank}: no way to reach the rendezvous store (no MASTER_ADDR)")


def _store_over_mpi(job: JobEnv, timeout: float) -> Store:
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    single_host = job.local_size == job.size
    info = None
    if job.rank == 0:
        addr = "127.0.0.1" if single_host else select_address()[1]
        store = TCPStore(addr, 0, is_master=True, token=job.token, timeout=timeout, bind_host=addr)
        info = (addr, store.port)  # no secret: every rank already holds the token (token.mpi_token)
    info = world.bcast(info, root=0)
    if job.rank == 0:
        return store
    return TCPStore(info[0], info[1], token=job.token, timeout=timeout)


def job_token(store: Store, job: JobEnv, membership: "Membership", timeout: float) -> Tuple[bytes, Optional[str]]:
    """The secret every peer proves it holds, and a file rank 0 removes once all peers connected:
    bootstrap/token.py's sources, in order. It is never written to the store (PYCOLL_INSECURE=1 aside)."""
    if job.token is not None:
        return job.token, job.token_file
    return token_mod.agree(store, job.rank, job.size, job.source, membership.local_size, timeout)


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

"""pycoll.init(): discover the job, rendezvous, connect the transport, and keep a default communicator."""
from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any, Callable, Optional

from . import config, grow
from .bootstrap.env import JobEnv, discover
from .bootstrap.rendezvous import is_loopback, job_token, make_store
from .bootstrap.rendezvous import join as rendezvous
from .bootstrap.store import PrefixStore, Store
from .bootstrap.token import remove_private
from .comm import Communicator
from .errors import EnvError
from .trace import recorder
from .transports import create_transport

_generation = itertools.count()  # each init() in a process gets its own namespace in the store
_default: Optional[Communicator] = None


def init(rank: Optional[int] = None, size: Optional[int] = None, store: Optional[Store] = None, *,
         transport: Optional[str] = None, timeout: Optional[float] = None) -> Communicator:
    """Join the job and return the world communicator (also the default for module-level calls).

    With no arguments everything comes from the launcher's environment (torchrun, mpirun,
    Slurm, `pycoll run`); `rank=, size=, store=` set it up by hand. A newcomer to a running job
    (PYCOLL_NEWCOMER=1: a rank `pycoll run --elastic` restarted) joins it instead (join()).
    Every PYCOLL_* variable is checked first: a bad one is an EnvError naming it and what it accepts.
    """
    global _default
    settings = config.load()
    if settings["PYCOLL_NEWCOMER"] and rank is None and size is None and store is None:
        _default = join(timeout)
        return _default
    timeout = settings["PYCOLL_TIMEOUT"] if timeout is None else float(timeout)
    if store is not None and rank is None:
        raise EnvError("init(store=...) also needs rank= and size=")
    job = discover(rank, size)
    if store is None:
        base, job = make_store(job, timeout)
    else:
        base = store
    ns = PrefixStore(f"pycoll/{next(_generation)}", base)
    comm = connect(job, ns, transport or settings["PYCOLL_TRANSPORT"], timeout,
                   owned_store=base if store is None else None)
    _default = comm
    return comm


def connect(job: JobEnv, ns: Store, transport: str, timeout: float, *, owned_store: Optional[Store] = None,
            name: str = "world") -> Communicator:
    """Rendezvous on `ns` (a store namespace of this job's own), agree on the job token, connect the
    transport and calibrate: the world communicator of init() and of the torch backend (pycoll.torch).
    `owned_store` is closed with the communicator."""
    membership = rendezvous(ns, job.rank, job.size, timeout)
    token, token_file = job_token(ns, job, membership, timeout)
    recorder.agreed_token(token)  # the flight recorder's dumps name the job by it (never the token itself)
    single_host = membership.local_size == job.size
    address = "127.0.0.1" if single_host and is_loopback(job.master_addr) else None
    tr = create_transport(transport, job.rank, job.size, address, membership.hosts)
    try:
        tr.connect(ns, token, timeout)
    except BaseException:
        tr.close()
        raise
    finally:  # connected: every peer has proved it holds the token, so rank 0's file has done its job
        remove_private(token_file)
    comm = Communicator(tr, range(job.size), job.rank, name, membership, timeout,
                        store=owned_store, owns_transport=True)
    grow.register(comm, ns, replace(job, token=token), transport)  # where newcomers announce themselves
    try:
        comm.calibrate()
    except BaseException:
        comm.close()
        raise
    return comm


def join(timeout: Optional[float] = None) -> Communicator:
    """Join a running job as a newcomer (a restarted rank, a new node's ranks): announce this process
    in the job's store and wait for the members' next comm.grow(); returns the grown communicator
    (also the default), in which this rank follows the members. pycoll/grow.py says how."""
    global _default
    _default = grow.join(timeout)
    return _default


def default_comm() -> Communicator:
    """The communicator of the last init(); RuntimeError before init()."""
    if _default is None or _default.closed:
        raise RuntimeError("pycoll.init() has not been called (or its communicator was closed)")
    return _default


def _on_default(name: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(default_comm(), name)(*args, **kwargs)
    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"Communicator.{name} on the default communicator (the last pycoll.init())."
    return call


COLLECTIVES = ("allreduce", "reduce", "reduce_scatter", "broadcast", "allgather", "allgatherv",
               "alltoall", "alltoallv", "gather", "scatter", "barrier", "send", "recv")
allreduce, reduce, reduce_scatter, broadcast, allgather, allgatherv, alltoall, alltoallv, gather, \
    scatter, barrier, send, recv = (_on_default(n) for n in COLLECTIVES)

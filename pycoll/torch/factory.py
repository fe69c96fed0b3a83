"""The backend's creator, which torch calls once per process group: a pycoll Communicator for the
group (a rendezvous through torch's store, or a child of the default group's communicator on its
connections) inside a ProcessGroupPycoll; and the closing of what a script leaves open at exit."""
from __future__ import annotations

import atexit
import os
import weakref
from typing import Any, Optional

import torch.distributed as dist

from .. import config
from ..bootstrap.env import discover
from ..comm import Communicator
from ..world import connect
from .group import ProcessGroupPycoll
from .options import timeout_seconds
from .store import C10dStore

_world: Optional[Communicator] = None  # the default group's communicator, when the default is pycoll


def default_comm() -> Optional[Communicator]:
    """The default group's communicator, when the default group was made by this backend (else None)."""
    return _world


def create(opts: Any, backend_options: Any = None) -> ProcessGroupPycoll:
    """The backend creator torch calls (extended API) once per process group on its members.

    The default group rendezvouses through torch's store (already namespaced per group) and
    connects pycoll's transport; a later group over the default group's ranks is a child of that
    communicator on the same connections (no rendezvous, no new sockets); a group made beside a
    default group of another backend rendezvouses on its own."""
    global _world
    rank, size = int(opts.group_rank), int(opts.group_size)
    seconds = timeout_seconds(opts)
    members = [int(r) for r in (opts.global_ranks_in_group or [])]
    world = _world if dist.is_initialized() else None
    if world is not None and not world.closed and members and world.size == dist.get_world_size():
        comm = world._child(f"torch/{opts.group_id}", members)
        comm.timeout = seconds
        if comm.rank != rank:
            raise RuntimeError(f"pycoll backend: group {opts.group_id} puts this process at rank {comm.rank}, "
                               f"torch at {rank}")
        return ProcessGroupPycoll(comm, rank, size)
    comm = _rendezvous(opts.store, rank, size, seconds)
    if not dist.is_initialized():
        _world = comm
    _opened.add(comm)
    return ProcessGroupPycoll(comm, rank, size)


_opened: "weakref.WeakSet[Communicator]" = weakref.WeakSet()  # with transports of their own, closed at exit


@atexit.register
def _close_at_exit() -> None:
    """Close what a script left open (no destroy_process_group) while the interpreter is whole: torch's
    store must not be torn down under pycoll's threads (seen: std::terminate at exit on rank 0)."""
    for comm in list(_opened):
        comm.close()


def _rendezvous(store: "dist.Store", rank: int, size: int, seconds: float) -> Communicator:
    """A communicator of its own over `store`, with pycoll.init(rank=, size=, store=)'s token rules."""
    env = dict(os.environ)
    if not env.get("MASTER_ADDR"):  # init_method=tcp:// or a store of the user's: say where the store is
        host = getattr(getattr(store, "underlying_store", store), "host", None)
        env["MASTER_ADDR"] = host or "127.0.0.1"
        env.pop("MASTER_PORT", None)
    job = discover(rank, size, env)
    return connect(job, C10dStore(store, seconds), config.load()["PYCOLL_TRANSPORT"], seconds)

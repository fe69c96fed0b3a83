"""The torch.distributed backend "pycoll": `import pycoll.torch`, then
`dist.init_process_group("pycoll", ...)` runs torch's collectives on a pycoll Communicator.

Importing this module registers the backend for CPU tensors. The backend rendezvouses through the
c10d store torch hands it (no second port), with the same job token rules as
`pycoll.init(rank=, size=, store=)`. Every collective returns a Work whose wait() re-raises
pycoll's error and whose get_future() gives the output tensors (DDP comm hooks use it).
`import pycoll` alone never imports torch.

Its parts: `group` (ProcessGroupPycoll: torch's calls on a Communicator), `work` (PycollWork),
`options` (torch's reduce ops and timeouts read), `tensors` (tensors as pycoll buffers and back),
`store` (C10dStore), `factory` (create(): the group factory torch calls; closing at exit); the
registration with torch is pycoll/torch_autoload.py's, here called on import. `elastic` (imported on
its own: ElasticDDP, DDP on a pycoll group that shrinks when ranks die and grows when they come back).
"""
from __future__ import annotations

from typing import Any

from ..torch_autoload import BACKEND, register_backend as _register_backend
from . import factory as _factory
from .factory import create
from .group import ProcessGroupPycoll
from .store import C10dStore
from .work import PycollWork

__all__ = ["BACKEND", "C10dStore", "ProcessGroupPycoll", "PycollWork", "create"]


def __getattr__(name: str) -> Any:
    """`_world`, the default group's communicator when the default group is pycoll's, read where
    create() sets it."""
    if name == "_world":
        return _factory.default_comm()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_register_backend(create)  # unless torch's autoload did (pycoll/torch_autoload.py)

"""torch's `torch.backends` entry point: after `import torch`, `init_process_group("pycoll")` works in
a script that never imports pycoll. It only names the backend; pycoll.torch (and the transports) load
when the first group is created. It never makes `import torch` fail, and
TORCH_DEVICE_BACKEND_AUTOLOAD=0 (torch's own switch) keeps it from running at all."""
from __future__ import annotations

import logging
from typing import Any, Callable

log = logging.getLogger("pycoll.torch")
BACKEND = "pycoll"


def register_backend(creator: Callable[..., Any]) -> None:
    """Make backend "pycoll" known to torch.distributed with `creator` as its group factory (extended
    API, CPU tensors), unless it is already (or torch lacks it). `import pycoll.torch` calls it too."""
    import torch.distributed as dist
    if dist.is_available() and BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, creator, extended_api=True, devices=["cpu"])


def register() -> None:
    """The entry point: register the backend with a factory that loads pycoll.torch on first use."""
    try:
        register_backend(_create)
    except Exception as e:  # a broken hook must not break `import torch`
        log.warning("pycoll: the torch backend was not registered at `import torch` (%s); "
                    "`import pycoll.torch` registers it", e)


def _create(*args: Any, **kwargs: Any) -> Any:
    """The backend's factory, loaded on first use."""
    from .torch import create
    return create(*args, **kwargs)

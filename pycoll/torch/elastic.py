"""Elastic DDP on pycoll: a torch training loop that survives a dead rank and takes a restarted one
back, with pycoll's own revoke/agree/shrink/grow (pycoll/ft.py, pycoll/grow.py) under torch's
DistributedDataParallel (torchft is not needed).

    el = ElasticDDP(model, optimizer)    # pycoll.init(): a restarted rank joins here, healed from rank 0
    while el.state["step"] < steps:      # the steps that completed everywhere
        x, y = my_share(el.state["step"], el.rank, el.size)
        el.step(lambda ddp: loss_fn(ddp(x), y).backward())

Each step runs `compute(ddp)` (forward and backward: DDP averages the gradients over the group),
then the members agree that it completed everywhere and on the newcomers seen (one agreement,
ft.agree_max), and only then apply optimizer.step() and count it in state["step"], so every replica
takes the same steps:

* a rank died: the survivors shrink the communicator, wrap it in a new ProcessGroupPycoll and make
  DDP again over it; the step is dropped everywhere (False) and the caller re-shards over el.size;
* newcomers arrived (`pycoll run --elastic --max-restarts K` restarted a rank, or a node joined): at
  the end of the step all grow the communicator, make DDP again (its constructor broadcasts rank 0's
  parameters and buffers: the newcomer's model is healed), and rank 0 broadcasts the optimizer's
  state_dict and `state` (the loop's counters) to everyone.

The group is not torch's default group: pass `el.group` to torch.distributed calls of your own.
"""
from __future__ import annotations

import io
import json
import time
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import ft, grow
from ..comm import Communicator
from ..errors import GrowError, PeerError, RevokedError, TimeoutError
from ..world import init
from .group import ProcessGroupPycoll

_FAILURES = (PeerError, RevokedError, TimeoutError)
_FAILURE_WORDS = ("PeerError", "RevokedError", "was revoked", "died", "timed out")  # as DDP re-raises them


class ElasticDDP:
    """`module` under DDP on a pycoll group that shrinks when ranks die and grows when they come back."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 state: Optional[Dict[str, Any]] = None, comm: Optional[Communicator] = None,
                 **ddp_kwargs: Any) -> None:
        """`comm`: the job's world communicator (default: pycoll.init(), which makes a newcomer join);
        `state`: the loop's JSON-able counters, healed with the model ("step": the steps completed, which
        step() counts); `ddp_kwargs` go to DDP."""
        self.comm = init() if comm is None else comm
        self.module, self.optimizer = module, optimizer
        self.state: Dict[str, Any] = {"step": 0, **(state or {})}
        self.events: List[str] = []  # what happened when: "[t=...] ranks [2] died at step 7; went on with 3 ranks"
        self._ddp_kwargs = ddp_kwargs
        self._arrived = 0
        self.ddp = self._wrap()
        grow.arrivals(self.comm)  # watch the store for newcomers from now on
        joined = grow.growth(self.comm)
        if joined is not None and self.comm.rank >= joined.members:  # a newcomer: take rank 0's state
            self._collectively(self._heal)

    @property
    def rank(self) -> int:
        """This process's rank in the group now."""
        return self.comm.rank

    @property
    def size(self) -> int:
        """Ranks in the group now (shard the data over them)."""
        return self.comm.size

    @property
    def group(self) -> ProcessGroupPycoll:
        """The process group DDP runs on now."""
        return self._group

    def _wrap(self) -> DDP:
        """A new group over the current communicator and DDP over it (DDP broadcasts rank 0's parameters)."""
        self._group = ProcessGroupPycoll(self.comm, self.comm.rank, self.comm.size)
        return DDP(self.module, process_group=self._group, **self._ddp_kwargs)

    def step(self, compute: Callable[[DDP], Any]) -> bool:
        """One training step: zero the gradients, compute(ddp) (forward and backward), agree, and
        optimizer.step() if the step completed on every rank: True then, and state["step"] counts it.
        False: it was dropped everywhere (a rank died: the group shrank, so re-shard over `size`).
        Either way, newcomers that arrived are taken in at its end."""
        self.optimizer.zero_grad()
        error: Optional[BaseException] = None
        try:
            compute(self.ddp)
            ok = True
        except Exception as e:  # noqa: BLE001  (judged after the agreement: a failure, or this rank's bug)
            error, ok = e, False
            self.comm.revoke()
        ok, dead, self._arrived = ft.agree_max(self.comm, ok, grow.arrivals(self.comm))
        step = self.state["step"]
        if dead:
            self._shrink(dead, step)
        elif error is not None:
            if not _is_failure(error):
                raise error  # this rank's own exception, not the group's
            self.ddp = self._wrap()  # a failed call may have left DDP's reducer midway
        if ok:
            self.optimizer.step()
            self.state["step"] = step + 1
        if not dead and self._arrived > grow.admitted(self.comm):
            self._grow(step)
        return ok

    def _shrink(self, dead: List[int], step: int) -> None:
        old = self.comm
        self.comm = old.shrink()
        self.ddp = self._wrap()
        self._event(f"ranks {[old.group[r] for r in dead]} died at step {step}; went on with {self.size} ranks")

    def _grow(self, step: int) -> None:
        began = time.perf_counter()
        try:
            grown = self.comm.grow(arrivals=self._arrived)
        except GrowError as e:
            self._event(f"newcomers not admitted at step {step}: {e}")
            if e.dead:
                self._shrink(e.dead, step)
            return
        if grown is self.comm:
            return
        self.comm = grown
        self._collectively(self._heal)
        self._event(f"ranks {grow.growth(grown).newcomers} joined after step {step}; went on with {self.size} "
                    f"ranks after {time.perf_counter() - began:.2f} s")

    def _heal(self) -> None:
        """Make DDP over the grown group (rank 0's parameters and buffers reach everyone) and broadcast
        rank 0's optimizer state and counters (members already hold them: they change nothing there)."""
        self.ddp = self._wrap()
        blob = np.frombuffer(_dumps(self.optimizer.state_dict(), self.state), np.uint8).copy()
        length = np.array([blob.size], np.int64)
        self.comm.broadcast(length, root=0)
        if self.comm.rank != 0:
            blob = np.empty(int(length[0]), np.uint8)
        self.comm.broadcast(blob, root=0)
        optimizer_state, self.state = _loads(blob.tobytes())
        self.optimizer.load_state_dict(optimizer_state)

    def _collectively(self, fn: Callable[[], None]) -> None:
        """fn() until it completes on every survivor (a rank dying in it: shrink and again)."""
        while True:
            try:
                fn()
                ok = True
            except Exception as e:  # noqa: BLE001
                if not _is_failure(e):
                    raise
                self.comm.revoke()
                ok = False
            ok, dead = self.comm.agree(ok)
            if dead:
                self._shrink(dead, self.state["step"])
            if ok:
                return

    def _event(self, what: str) -> None:
        line = f"[t={time.monotonic():.3f}] {what}"
        self.events.append(line)
        if self.comm.rank == 0:
            print(f"pycoll.torch.elastic: {line}", flush=True)

    def close(self) -> None:
        """Mark the job ended for newcomers still waiting (rank 0) and close the communicator."""
        if self.comm.rank == 0:
            grow.finish(self.comm)
        self.comm.close()


def _is_failure(error: BaseException) -> bool:
    """Whether `error` is the group's failure (a dead or cut-off peer, a revocation, a timeout), as
    pycoll raises it or as DDP re-raises it from pycoll's Work."""
    return isinstance(error, _FAILURES) or (isinstance(error, RuntimeError)
                                            and any(w in str(error) for w in _FAILURE_WORDS))


def _dumps(optimizer_state: Dict[str, Any], state: Dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save({"optimizer": optimizer_state, "state": json.dumps(state)}, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    got = torch.load(io.BytesIO(data), weights_only=True)  # tensors and plain containers only
    return got["optimizer"], json.loads(got["state"])

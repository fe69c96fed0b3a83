"""The backend's torch Work: one over pycoll Works queued in order, completing when the last does,
its errors (timeouts worded as torch users look for them) re-raised in wait() and sent to
get_future()'s waiters."""
from __future__ import annotations

import concurrent.futures
import datetime
import threading
import time
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..errors import TimeoutError


def _as_torch_error(e: BaseException) -> BaseException:
    """pycoll's timeout as torch users and tools look for it (gloo: "Timed out waiting ..."): the
    same class and peers, the message prefixed, pycoll's own error kept as the cause."""
    if isinstance(e, TimeoutError) and not str(e).startswith("[pycoll] Timed out "):
        wrapped = TimeoutError(f"[pycoll] Timed out waiting: {e}", e.peers)
        wrapped.__cause__ = e
        return wrapped
    return e


def chain(*steps: Optional[Callable[[], Any]]) -> Optional[Callable[[], None]]:
    """One `post` step that runs the given ones in order (None for none: no copy-back to run)."""
    live = [s for s in steps if s is not None]
    if not live:
        return None

    def run() -> None:
        for s in live:
            s()
    return run


class PycollWork(dist.Work):
    """A torch Work over one or more pycoll Works (queued in order on one communicator): done when
    the last is, then `post` (copies into torch's output tensors) runs once; errors re-raise in
    wait() and reach get_future()'s waiters. The torch Future is built only when asked for (DDP
    does; a plain dist.all_reduce does not), so a call pays for no future it never uses."""

    def __init__(self, works: Sequence[Any], outputs: List[torch.Tensor],
                 post: Optional[Callable[[], None]] = None, error: Optional[BaseException] = None) -> None:
        super().__init__()
        self._works, self._outputs, self._post = works, outputs, post
        self._lock = threading.RLock()  # RLock: completing the future runs its callbacks, which may call us
        self._src: "Optional[torch.futures.Future[List[torch.Tensor]]]" = None
        self._fut: "Optional[torch.futures.Future[List[torch.Tensor]]]" = None
        # the outcome, final once _finished is set (after _error: readers check _finished first)
        self._error: Optional[BaseException] = None if error is None else _as_torch_error(error)
        self._finished = not works

    def _finish(self, _: Any = None) -> None:
        """Once the last pycoll Work is done: check them in call order (the first error is the
        cause), run `post`, and complete the torch future if one was asked for."""
        with self._lock:
            if not self._finished:
                error: Optional[BaseException] = None
                try:
                    for w in self._works:  # (done: their futures, not their waits, which would record one)
                        w.get_future().result()
                    if self._post is not None:
                        self._post()
                except BaseException as e:
                    error = _as_torch_error(e)
                self._error = error
                self._finished = True
            if self._src is not None and not self._src.done():
                if self._error is not None:
                    self._src.set_exception(self._error)
                else:
                    self._src.set_result(self._outputs)

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        """Block until the last pycoll Work is done (and `post` ran); re-raise the first error. The
        pycoll Works' flight-recorder entries get this wait (the first that finds them done)."""
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        since = time.time()
        if not self._finished:
            last = self._works[-1]
            if seconds:
                try:
                    last.get_future().exception(seconds)  # waits; the error itself is raised below
                except concurrent.futures.TimeoutError:
                    raise TimeoutError(f"pycoll torch work was not complete after wait({seconds} s)") from None
            else:
                try:
                    last.wait()  # may run the queued call on this thread
                except BaseException:  # raised below, after the earlier works are checked
                    pass
            self._finish()
        if self._error is not None:
            raise self._error
        for w in self._works:
            w.waited(since)
        return True

    def is_completed(self) -> bool:
        if not self._finished and self._works[-1].is_completed():
            self._finish()
        return self._finished

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self) -> Optional[BaseException]:
        return self._error if self.is_completed() else None

    def result(self) -> List[torch.Tensor]:
        self.wait()
        return self._outputs

    def get_future(self) -> "torch.futures.Future[List[torch.Tensor]]":
        with self._lock:
            if self._fut is None:
                # errors at C++ level: a then() child of the future we complete, so that a failed
                # collective under DDP raises in backward (set_exception alone stores it as the value)
                self._src = torch.futures.Future()
                self._fut = self._src.then(_unwrap)
                if self._finished:
                    self._finish()
                else:
                    self._works[-1].get_future().add_done_callback(self._finish)
            return self._fut


def _unwrap(fut: "torch.futures.Future[Any]") -> Any:
    """The value of the future completed above, raising its error as an error (get_future)."""
    return fut.wait()


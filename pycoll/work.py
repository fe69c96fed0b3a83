"""Work handles for async_op=True, and the per-communicator progress thread that runs them.

Collectives on one communicator run in call order on its worker (like a CUDA stream);
different communicators progress concurrently, each on its own thread.
"""
from __future__ import annotations

import concurrent.futures
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, Optional

from .errors import TimeoutError


class Work:
    """A collective in flight: wait(timeout), is_completed(), exception(), result()."""

    def __init__(self, what: object, future: "Future[Any]") -> None:
        self.what, self._future = what, future

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until done; re-raise the collective's error; TimeoutError if `timeout` passes first."""
        try:
            self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            if self._future.done():  # the collective itself timed out: its error names the peers
                raise
            raise TimeoutError(f"{self.what} was not complete after wait(timeout={timeout})") from None
        return True

    def is_completed(self) -> bool:
        """True once the collective finished, successfully or not."""
        return self._future.done()

    def is_success(self) -> bool:
        """True once it finished without an error."""
        return self._future.done() and self._future.exception() is None

    def exception(self) -> Optional[BaseException]:
        """The error it failed with (waits for completion), or None."""
        return self._future.exception()

    def result(self) -> Any:
        """The collective's return value (its output buffer), after waiting."""
        return self._future.result()

    def get_future(self) -> "Future[Any]":
        """The concurrent.futures.Future behind this handle."""
        return self._future


class Worker:
    """A daemon thread executing one communicator's queued collectives in order."""

    def __init__(self, name: str) -> None:
        self._queue: "queue.SimpleQueue[Optional[tuple]]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, what: object, fn: Callable[[], Any]) -> Work:
        """Queue `fn` behind earlier work and return its handle."""
        future: "Future[Any]" = Future()
        self._queue.put((future, fn))
        return Work(what, future)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:  # the error belongs to whoever waits on the Work
                future.set_exception(e)

    def close(self) -> None:
        """Let queued work finish, then stop the thread."""
        self._queue.put(None)
        self._thread.join()

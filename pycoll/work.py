"""Work handles for async_op=True, and the per-communicator progress thread that runs them.

Collectives on one communicator run in call order on its worker (like a CUDA stream);
different communicators progress concurrently, each on its own thread. A thread that waits on
a Work whose call has not started yet runs the queue up to it itself (when the worker is idle):
the call then costs no hand-off between threads, and order still holds.

A Work made with its call's flight-recorder entry stamps in it when the caller's first wait that
found the call done (wait(), result(), exception(), or waited() for a Work that wraps this one)
began and returned: `pycoll predict --trace` replays the caller's compute up to that wait. Polling
is_completed() stamps nothing, nor does a wait(timeout) that ran out.
"""
from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Deque, Optional, Tuple

from .errors import TimeoutError
from .trace.recorder import WAIT_BEGIN, WAIT_END

_time = time.time  # the recorder's clock


class Work:
    """A collective in flight: wait(timeout), is_completed(), exception(), result()."""

    def __init__(self, what: object, future: "Future[Any]", worker: Optional["Worker"] = None,
                 entry: Optional[list] = None) -> None:
        """`entry`: the call's flight-recorder entry, where the first wait that finds it done is stamped."""
        self.what, self._future, self._worker, self._entry = what, future, worker, entry
        if entry is not None:
            entry[WAIT_BEGIN] = entry[WAIT_END] = 0.0  # an async call, not waited for yet

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until done; re-raise the collective's error; TimeoutError if `timeout` passes first."""
        e = self._entry
        t = _time() if e is not None and not e[WAIT_END] else 0.0
        if timeout is None and self._worker is not None:
            self._worker.run_until(self._future)
        try:
            self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            if self._future.done():  # the collective itself timed out: its error names the peers
                raise
            raise TimeoutError(f"{self.what} was not complete after wait(timeout={timeout})") from None
        if t:
            e[WAIT_BEGIN], e[WAIT_END] = t, _time()  # type: ignore[index]
        return True

    def waited(self, since: float) -> None:
        """Record that the caller waited on this call from `since` (its clock, time.time()) until now,
        if it is done and no wait was recorded yet: for a Work that wraps this one (torch's)."""
        e = self._entry
        if e is not None and not e[WAIT_END] and self._future.done():
            e[WAIT_BEGIN], e[WAIT_END] = since, _time()

    def is_completed(self) -> bool:
        """True once the collective finished, successfully or not."""
        return self._future.done()

    def is_success(self) -> bool:
        """True once it finished without an error."""
        return self._future.done() and self._future.exception() is None

    def exception(self) -> Optional[BaseException]:
        """The error it failed with (waits for completion), or None."""
        t = _time()
        error = self._future.exception()
        self.waited(t)
        return error

    def result(self) -> Any:
        """The collective's return value (its output buffer), after waiting."""
        e = self._entry
        t = _time() if e is not None and not e[WAIT_END] else 0.0
        if self._worker is not None:
            self._worker.run_until(self._future)
        value = self._future.result()
        if t:
            e[WAIT_BEGIN], e[WAIT_END] = t, _time()  # type: ignore[index]
        return value

    def get_future(self) -> "Future[Any]":
        """The concurrent.futures.Future behind this handle."""
        return self._future


Item = Tuple["Future[Any]", Callable[[], Any]]


class Worker:
    """A daemon thread executing one communicator's queued collectives in order; a waiter may run
    them instead while the thread is idle (run_until). One item runs at a time, in queue order."""

    def __init__(self, name: str) -> None:
        self._cv = threading.Condition(threading.Lock())
        self._items: Deque[Item] = collections.deque()
        self._running = False  # an item is executing (on the thread or on a waiter)
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, what: object, fn: Callable[[], Any], entry: Optional[list] = None) -> Work:
        """Queue `fn` behind earlier work and return its handle (`entry`: its flight-recorder entry)."""
        future: "Future[Any]" = Future()
        with self._cv:
            self._items.append((future, fn))
            if not self._running:  # else whoever runs hands on to the thread when done
                self._cv.notify()
        return Work(what, future, self, entry)

    def _take(self) -> Optional[Item]:
        """The next item, now marked running (call with the lock held); None if busy or empty."""
        if self._running or not self._items:
            return None
        self._running = True
        return self._items.popleft()

    def _execute(self, item: Item) -> None:
        future, fn = item
        try:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:  # the error belongs to whoever waits on the Work
                    future.set_exception(e)
        finally:
            with self._cv:
                self._running = False
                if self._items or self._closing:
                    self._cv.notify()

    def _loop(self) -> None:
        while True:
            with self._cv:
                item = self._take()
                while item is None:
                    if self._closing and not self._items and not self._running:
                        return
                    self._cv.wait()
                    item = self._take()
            self._execute(item)

    def run_until(self, future: "Future[Any]") -> None:
        """Run queued items on the calling thread, in order, until `future` is done or the worker
        thread is busy with one (then the caller just waits on `future`)."""
        while not future.done():
            with self._cv:
                item = self._take()
            if item is None:
                return
            self._execute(item)

    def close(self) -> None:
        """Let queued work finish, then stop the thread."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._thread.join()

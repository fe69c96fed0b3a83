"""pycoll's logging conventions: warnings always reach the application's logging (rate-limited where
a stranger hammering a port could flood the job's logs); what pycoll decides on its own (the tuner's
calibration, each algorithm choice) only when PYCOLL_DEBUG asks for it, as NCCL prints its choices
only under NCCL_DEBUG=INFO, whatever level the application sets its own loggers to."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from . import config


def asked_for_info() -> bool:
    """Whether PYCOLL_DEBUG asks for pycoll's INFO lines (INFO or TRACE)."""
    return config.get("PYCOLL_DEBUG") in ("INFO", "TRACE")


class _OnlyWhenAsked(logging.Filter):
    """Drops a logger's records below WARNING unless PYCOLL_DEBUG asks for them (read per record:
    such records are rare, and a job may set the variable after import)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or asked_for_info()


_ONLY_WHEN_ASKED = _OnlyWhenAsked()
# the registry's "NAME=value (default: ...)" lines (config.load), below this module's layer
logging.getLogger("pycoll.config").addFilter(_ONLY_WHEN_ASKED)


def quiet_unless_asked(logger: logging.Logger) -> logging.Logger:
    """`logger`, its INFO and DEBUG records let through only under PYCOLL_DEBUG=INFO/TRACE: an
    application that sets the root logger to INFO (Ray Train's workers, many scripts) sees pycoll's
    warnings, not a line per algorithm choice. Idempotent."""
    if _ONLY_WHEN_ASKED not in logger.filters:
        logger.addFilter(_ONLY_WHEN_ASKED)
    return logger


class RateLimitedLog:
    """Logs the first `burst` warnings of each `interval` seconds and counts the rest; the count is
    reported with the next warning let through, or by flush() (e.g. when the port closes)."""

    def __init__(self, logger: logging.Logger, what: str, burst: int = 5, interval: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.what, self.burst, self.interval, self._clock = logger, what, burst, interval, clock
        self._lock = threading.Lock()
        self._start = clock()
        self._logged = 0
        self.suppressed = 0  # warnings not logged since the last summary
        self.total = 0       # every warning ever offered

    def warning(self, msg: str, *args: Any) -> None:
        """Log `msg % args` unless this interval's burst is used up (then only count it)."""
        with self._lock:
            self.total += 1
            now = self._clock()
            if now - self._start >= self.interval:
                self._summarize(now)
                self._start, self._logged = now, 0
            if self._logged >= self.burst:
                self.suppressed += 1
                return
            self._logged += 1
        self.logger.warning(msg, *args)

    def flush(self) -> None:
        """Report what was suppressed so far, if anything."""
        with self._lock:
            self._summarize(self._clock())

    def _summarize(self, now: float) -> None:
        if self.suppressed:
            self.logger.warning("%s: %d more suppressed in the last %.0f s (%d in all)", self.what,
                                self.suppressed, now - self._start, self.total)
            self.suppressed = 0

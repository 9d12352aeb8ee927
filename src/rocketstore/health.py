"""Why a store refuses writes (RocketMQ's ``RunningFlags``), shared by the flusher, the dispatcher and puts.

Two kinds of failure, treated differently on purpose:

* a failed flush of the commit log is permanent for this process: the dirty pages may already be
  gone, so a later msync that "succeeds" proves nothing. Every put fails until the store is
  reopened and recovery has re-validated the log against the disk;
* a failed dispatch (consume queue or index write, too many open files, a full disk) stops puts only
  while it lasts: queues and index are derived data, and the next round that succeeds clears it.
"""

from __future__ import annotations

import errno
import logging
import threading
import time

from .errors import DispatchFailedError, RocketStoreError, StoreFailedError


class StoreHealth:
    """The first fatal flush error and the current dispatch error of one open store."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.flush_error: BaseException | None = None
        self.dispatch_error: BaseException | None = None

    def fail_flush(self, exc: BaseException) -> None:
        with self._lock:
            if self.flush_error is None:
                self.flush_error = exc

    def fail_dispatch(self, exc: BaseException) -> None:
        with self._lock:
            self.dispatch_error = exc

    def clear_dispatch(self) -> None:
        if self.dispatch_error is not None:
            with self._lock:
                self.dispatch_error = None

    @property
    def healthy(self) -> bool:
        return self.flush_error is None and self.dispatch_error is None

    def check_writable(self) -> None:
        """Raise the typed error that explains why a put must not be acknowledged now."""
        flush_error, dispatch_error = self.flush_error, self.dispatch_error
        if flush_error is not None:
            raise StoreFailedError(getattr(flush_error, "errno", None) or errno.EIO,
                                   f"the store stopped accepting writes after a failed flush ({flush_error}); "
                                   f"close and reopen it so that recovery re-validates the log")
        if dispatch_error is not None:
            raise DispatchFailedError(getattr(dispatch_error, "errno", None) or errno.EIO,
                                      f"consume queues or index cannot be written ({dispatch_error}); "
                                      f"puts are refused until dispatch succeeds again")

    def describe(self) -> str:
        if self.flush_error is not None:
            return f"failed: flush error {self.flush_error}"
        if self.dispatch_error is not None:
            return f"degraded: dispatch error {self.dispatch_error}"
        return "healthy"


class RepeatedErrorLog:
    """One log line for an error a background thread meets again and again (a full disk, no descriptors left): the
    first time, then the same error once every ``every`` seconds with how often it came, and one line when it
    passes. The dispatcher retrying every 50 ms logged an error line each time, and maintenance a traceback each
    pass, while the disk was full (the schedule review): logs that fill the disk further. A traceback is logged only
    for an error that is no ``RocketStoreError`` (a bug, not the disk)."""

    def __init__(self, logger: logging.Logger, what: str, passed: str, every: float = 60.0,
                 clock=time.monotonic) -> None:
        self.logger, self.what, self.passed, self.every, self.clock = logger, what, passed, every, clock
        self._text: str | None = None
        self._since = 0.0
        self._repeats = 0

    def failed(self, exc: BaseException) -> None:
        text, now = str(exc), self.clock()
        if text == self._text and now - self._since < self.every:
            self._repeats += 1
            return
        again = f" ({self._repeats + 1} times in {now - self._since:.0f} s)" if text == self._text else ""
        self._text, self._since, self._repeats = text, now, 0
        self.logger.error("%s%s: %s", self.what, again, exc,
                          exc_info=None if isinstance(exc, RocketStoreError | OSError) else exc)

    def recovered(self) -> None:
        if self._text is not None:
            self.logger.warning("%s", self.passed)
            self._text, self._repeats = None, 0


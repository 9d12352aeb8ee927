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
import threading

from .errors import DispatchFailedError, StoreFailedError


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

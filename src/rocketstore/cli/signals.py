"""SIGTERM and SIGINT for a command that runs until stopped (``serve``), seen whichever thread the kernel picks.

A Python signal handler runs in the main thread only, and only when that thread runs Python. The kernel delivers a
process-directed signal to any thread that does not block it: delivered to another thread (one of grpc's, numpy's
or the store's), the handler waited until something woke the main thread from its wait, and a serve so signalled
did not stop (a CI run waited 30 s for one; reproduced with ``tgkill`` to a non-main thread: it stopped only when
a SIGUSR1 interrupted the main thread). Blocking the signals in every thread cannot be done from here (imports
start threads first), so the signal's C handler writes its number to a pipe (``signal.set_wakeup_fd``) from any
thread, and the main thread waits on that pipe.
"""

from __future__ import annotations

import os
import select
import signal
import threading

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """Enter in the main thread; ``wait`` for the first stop signal, ``exit_on_next`` for what a second one does."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._unread: list[int] = []
        self._done = False
        self._watcher: threading.Thread | None = None

    def __enter__(self) -> StopSignals:
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)  # the C handler must never block
        self._handlers = {sig: signal.signal(sig, _noted) for sig in STOP_SIGNALS}
        self._wakeup = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        return self

    def _next(self, timeout: float | None) -> int | None:
        """The next stop signal's number written to the pipe within ``timeout`` seconds (None: without end); one
        read may bring several (SIGTERM and SIGINT at once: the second must still end the process)."""
        while not self._unread:
            if not select.select([self._read], [], [], timeout)[0]:
                return None
            self._unread += [n for n in os.read(self._read, 64) if n == 0 or n in STOP_SIGNALS]  # 0: __exit__
        return self._unread.pop(0)

    def wait(self, timeout: float) -> int | None:
        """The stop signal that came within ``timeout`` seconds (0: one already came), or None."""
        signo = self._next(timeout)
        if signo:
            self.received.append(signo)
        return signo or None

    def exit_on_next(self, message: str) -> None:
        """From now on a second stop signal writes ``message`` and ends the process at once (the stop hangs)."""
        def watch() -> None:
            signo = self._next(None)
            if self._done or not signo:
                return
            os.write(2, f"rocketstore serve: {signal.Signals(signo).name} again, {message}\n".encode())
            os._exit(128 + signo)

        self._watcher = threading.Thread(target=watch, name="rocketstore-second-signal", daemon=True)
        self._watcher.start()

    def __exit__(self, *exc_info: object) -> None:
        self._done = True
        if self._watcher is not None:
            os.write(self._write, b"\0")
            self._watcher.join(5)
        signal.set_wakeup_fd(self._wakeup)
        for sig, handler in self._handlers.items():
            signal.signal(sig, handler)
        os.close(self._read)
        os.close(self._write)


def _noted(signum, frame) -> None:
    """The Python-level handler: nothing to do (the C handler has written the signal to the pipe)."""

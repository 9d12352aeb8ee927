"""Taking a lock by giving the GIL away, so producer threads do not convoy on it.

Under the GIL, a thread blocked on a held ``threading.Lock`` is woken owning it and must then wait for the
GIL, which the releasing thread keeps while it encodes its next put; that thread then blocks on the lock in
its turn, and from then on every put costs two kernel hand-offs: four threads calling ``put_message`` stored
8,000-10,000 msg/s where one thread stores 27,000 (``./dev bench append``). A waiter that gives the GIL away
instead (``time.sleep(0)``) and tries again lets the holder run to its release, and the lock is free when the
next thread comes for it: four threads then store what one does. (Waiting until the lock looks free and then
taking it with ``with lock`` does not work: the GIL changes hands right after the check, at the end of the C
call, and three puts in four still blocked in the kernel.)

Taking a lock in Python code has a cost: a signal handler that raises (Ctrl-C) can run between the C call that
took it and the ``with`` block that would release it, leaving it held by nobody (every later put and ``close``
hang). Python runs signal handlers in the main thread only, so the main thread takes the plain lock with
``with`` (acquire and release in C, nothing can come between) and only other threads wait by yielding:
``with guard.held():``.

A hold that gives the GIL away itself (a pwrite of a large append, a segment roll) says so in ``io``, which
stays set until the next holder says otherwise: then waiters block in the kernel at once, as on a plain lock
(yielding there took the GIL from the thread the kernel had just handed the lock to: -15% for 35 KB
appends). Waiters also stop yielding after ``SPIN_SECONDS``, so a long hold never keeps a core busy.
"""

from __future__ import annotations

import threading
import time

SPIN_SECONDS = 0.002  # a holder the GIL switched away from gets it back within microseconds of a yield
_MAIN_THREAD = threading.main_thread().ident


class YieldingLock:
    """A ``threading.Lock`` (``lock``) held with ``with guard.held():``, waited for by yielding the GIL."""

    __slots__ = ("io", "lock")

    def __init__(self, lock: threading.Lock | None = None) -> None:
        self.lock = threading.Lock() if lock is None else lock
        self.io = False  # set by a holder whose hold gives the GIL away: waiters sleep in the kernel

    def held(self) -> threading.Lock | YieldingLock:
        """What this thread holds the lock with: the plain lock in the main thread (where signal handlers run),
        this yielding wrapper in any other."""
        return self.lock if threading.get_ident() == _MAIN_THREAD else self

    def __enter__(self) -> None:
        lock = self.lock
        if lock.acquire(False):
            return
        if not self.io:
            spin_until = time.monotonic() + SPIN_SECONDS
            while True:
                time.sleep(0)  # the GIL goes to whoever wants it: the holder, if it was switched away mid-hold
                if lock.acquire(False):
                    return
                if self.io or time.monotonic() >= spin_until:
                    break
        lock.acquire()

    def __exit__(self, *exc_info: object) -> None:
        self.lock.release()

    def locked(self) -> bool:
        return self.lock.locked()

"""A mutex that producer threads do not convoy on.

Under the GIL, a thread blocked on a held ``threading.Lock`` is woken owning it and must then wait for the
GIL, which the releasing thread keeps while it encodes its next put; that thread then blocks on the lock in
its turn, and from then on every put costs two kernel hand-offs: four threads calling ``put_message`` stored
8,000-10,000 msg/s where one thread stores 27,000 (``./dev bench append``). A waiter that gives the GIL away
instead (``time.sleep(0)``) lets the holder run to its release, and the lock is free again when the next
thread comes for it: four threads then store what one does.

A hold that gives the GIL away itself (a pwrite of a large append, a segment roll) says so in ``io``, which
stays set until the next holder says otherwise: then waiters block in the kernel at once, as on a plain lock
(yielding there took the GIL from the thread the kernel had just handed the lock to: -15% for 35 KB
appends). Waiters also block after ``SPIN_SECONDS`` of yielding, so a long hold never burns a core.
"""

from __future__ import annotations

import threading
import time

SPIN_SECONDS = 0.002  # a holder the GIL switched away from gets it back within microseconds of a yield


class YieldingLock:
    """``threading.Lock``'s interface (``acquire``, ``release``, ``locked``, ``with``), waiting by yielding."""

    __slots__ = ("_lock", "io")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.io = False  # set by a holder whose hold gives the GIL away: waiters sleep in the kernel

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        lock = self._lock
        if lock.acquire(False):
            return True
        if not blocking:
            return False
        if not self.io:
            started = time.monotonic()
            spin_until = started + (SPIN_SECONDS if timeout < 0 else min(SPIN_SECONDS, timeout))
            while True:
                time.sleep(0)  # the GIL goes to whoever wants it: the holder, if it was switched away mid-hold
                if lock.acquire(False):
                    return True
                now = time.monotonic()
                if self.io or now >= spin_until:
                    break
            if timeout >= 0:
                timeout = max(0.0, timeout - (now - started))
        return lock.acquire(True, timeout)

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc_info: object) -> None:
        self._lock.release()

    def __repr__(self) -> str:
        return f"<YieldingLock {'locked' if self._lock.locked() else 'unlocked'}>"

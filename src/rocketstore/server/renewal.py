"""Receipt handles the server keeps alive for push consumers (``auto_renew``), as RocketMQ's proxy does.

A push consumer receives ahead into a local cache and runs a listener that may take minutes, so it asks the
server to renew what it holds (``ReceiveMessageRequest.auto_renew``): such a receive hides its messages for
``invisible_ms`` (the proxy's ``defaultInvisibleTimeMills``, 60 s), and a thread makes each one invisible for
longer (1, 3, 5, 10, 30 min, then every hour: ``RenewStrategyPolicy``) when it is within ``ahead_ms`` of
visible again, for up to ``max_ms`` (3 h; then it is given back with the group's retry delay, as a nack). While
its client is away (no telemetry stream) a renewed message is made visible again ``clear_ms`` (1 s) later, so
another consumer gets it. Without this, every message a push consumer held longer than the fixed invisible
time was delivered a second time, and a FIFO group's message to a second consumer while the first still ran it.

Renewing changes the message's receipt handle, and the client still holds the first one: an ack, a change of
invisible duration or a forward to the DLQ names it, and ``take`` answers the current handle (the proxy's
``removeReceiptHandle``). The renewals are the server's memory only; after a restart the messages come back once
their last deadline passes, as the proxy's do.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from ..errors import RocketStoreError

log = logging.getLogger("rocketstore.server")

# the proxy's retry delays for consumers that fail a message (CustomizedRetryPolicy): attempt n waits RETRY_MS[n - 1]
RETRY_MS = tuple(s * 1000 for s in (1, 5, 10, 30, 60, 120, 180, 240, 300, 360, 420, 480, 540, 600, 1200, 1800,
                                    3600, 7200))


@dataclasses.dataclass(frozen=True)
class RenewPolicy:
    """The proxy's renewal settings (``ProxyConfig``), in its defaults."""

    invisible_ms: int = 60_000  # defaultInvisibleTimeMills: what an auto-renewed receive hides its messages for
    ahead_ms: int = 10_000  # renewAheadTimeMillis: renew once this close to visible again
    period_s: float = 5.0  # renewSchedulePeriodMillis
    max_ms: int = 3 * 3600 * 1000  # renewMaxTimeMillis: then the message is given back (a nack)
    clear_ms: int = 1_000  # invisibleTimeMillisWhenClear: its client went away
    steps_ms: tuple[int, ...] = (60_000, 180_000, 300_000, 600_000, 1_800_000, 3_600_000)  # RenewStrategyPolicy


@dataclasses.dataclass
class Renewal:
    """One held message: its current handle and when it is visible again."""

    group: str
    topic: str
    handle: str
    deadline_ms: int
    received_ms: int
    attempt: int
    renewals: int = 0
    done: bool = False  # taken by the client's ack/change/forward, or given up: never renewed again
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class ReceiptRenewals:
    """The messages each (client, group) holds with ``auto_renew``; ``run`` renews them in a thread of its own.

    ``change_invisible(group, topic, handle, ms) -> new handle`` is the pop state's (it raises a
    ``RocketStoreError`` for a handle no longer in flight: the message was acknowledged or delivered again, and is
    dropped); ``online(client_id)`` says whether the client's telemetry stream is open."""

    def __init__(self, change_invisible: Callable[[str, str, str, int], str], online: Callable[[str], bool],
                 policy: RenewPolicy | None = None, clock: Callable[[], int] = _now_ms) -> None:
        self.policy = policy or RenewPolicy()
        self._change = change_invisible
        self._online = online
        self._clock = clock
        self._held: dict[tuple[str, str], dict[str, Renewal]] = {}  # (client, group) -> first handle -> renewal
        self._lock = threading.Lock()
        self.renewed = 0
        self.cleared = 0

    def __len__(self) -> int:
        with self._lock:
            return sum(map(len, self._held.values()))

    def add(self, client_id: str, group: str, topic: str, handle: str, invisible_ms: int, attempt: int) -> None:
        now = self._clock()
        with self._lock:
            self._held.setdefault((client_id, group), {})[handle] = Renewal(group, topic, handle, now + invisible_ms,
                                                                            now, attempt)

    def take(self, client_id: str, group: str, handle: str) -> str:
        """The current handle of the message the client knows by ``handle`` (itself if it is not renewed here), and
        no more renewals of it. Waits for a renewal of it that is running."""
        with self._lock:
            held = self._held.get((client_id, group))
            renewal = held.pop(handle, None) if held is not None else None
            if held is not None and not held:
                del self._held[(client_id, group)]
        if renewal is None:
            return handle
        with renewal.lock:
            renewal.done = True
            return renewal.handle

    def run_once(self) -> None:
        """One scan (``scheduleRenewTask``): clear what offline clients hold, renew what is due."""
        with self._lock:
            entries = list(self._held.items())
        for (client_id, group), held in entries:
            if not self._online(client_id):
                with self._lock:
                    if self._held.get((client_id, group)) is held:
                        del self._held[(client_id, group)]
                for renewal in list(held.values()):
                    self._give_back(renewal, self.policy.clear_ms, "its client went away")
                continue
            for first, renewal in list(held.items()):
                if renewal.deadline_ms - self._clock() > self.policy.ahead_ms:
                    continue
                if not self._renew(renewal):
                    with self._lock:
                        if held.get(first) is renewal:
                            del held[first]

    def clear_all(self) -> None:
        """Every held message visible again soon (a stopping server: the proxy's ``clearAllHandle``)."""
        with self._lock:  # kept: an ack that runs on through the stop still finds the current handle
            entries = list(self._held.values())
        for held in entries:
            for renewal in held.values():
                self._give_back(renewal, self.policy.clear_ms, "the server is stopping")

    def _renew(self, renewal: Renewal) -> bool:
        """Renew one message, or give it back past ``max_ms``; False once it is no longer to be renewed."""
        with renewal.lock:
            if renewal.done:
                return False
            now = self._clock()
            if now - renewal.received_ms >= self.policy.max_ms:
                retry = RETRY_MS[min(max(renewal.attempt - 1, 0), len(RETRY_MS) - 1)]
                self._change_quietly(renewal, retry, "held past the longest renewal")
                renewal.done = True
                return False
            steps = self.policy.steps_ms
            step = steps[min(renewal.renewals, len(steps) - 1)]
            try:
                renewal.handle = self._change(renewal.group, renewal.topic, renewal.handle, step)
            except RocketStoreError as exc:  # acknowledged meanwhile, or delivered again: nothing to renew
                log.debug("renewal of a message of %s stopped: %s", renewal.group, exc)
                renewal.done = True
                return False
            renewal.deadline_ms = now + step
            renewal.renewals += 1
            self.renewed += 1
            return True

    def _give_back(self, renewal: Renewal, invisible_ms: int, why: str) -> None:
        with renewal.lock:
            if renewal.done:
                return
            renewal.done = True
            if self._change_quietly(renewal, invisible_ms, why):
                self.cleared += 1

    def _change_quietly(self, renewal: Renewal, invisible_ms: int, why: str) -> bool:
        try:
            renewal.handle = self._change(renewal.group, renewal.topic, renewal.handle, invisible_ms)
        except RocketStoreError as exc:
            log.debug("a held message of %s not given back (%s): %s", renewal.group, why, exc)
            return False
        log.debug("a held message of %s visible again in %d ms: %s", renewal.group, invisible_ms, why)
        return True

    def run(self, stop: threading.Event) -> None:
        """Scan every ``period_s`` until ``stop`` is set; a failure is logged and the next scan goes on."""
        while not stop.wait(self.policy.period_s):
            try:
                self.run_once()
            except Exception:
                log.exception("renewing the push consumers' messages failed (tried again in %.0f s)",
                              self.policy.period_s)

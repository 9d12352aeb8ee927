"""Messages the server keeps invisible for push consumers (``auto_renew``), and which clients are still there.

A push consumer receives ahead into a local cache and runs a listener that may take minutes, so it asks the
server to renew what it holds (``ReceiveMessageRequest.auto_renew``), as RocketMQ's proxy does
(``DefaultReceiptHandleManager``): such a receive hides its messages for ``invisible_ms`` (the proxy's
``defaultInvisibleTimeMills``, 60 s), and every ``period_s`` the server makes each one invisible for longer (1, 3,
5, 10, 30 min, then every hour: ``RenewStrategyPolicy``) once it is within ``ahead_ms`` of visible again, for up to
``max_ms`` (3 h; then it is given back with the group's retry delay, as a nack). Once its client is gone (it said
so, or sent nothing for ``CLIENT_EXPIRY_MS``) it is visible again ``clear_ms`` (1 s) later, for another consumer.
Without this, every message a push consumer held longer than a fixed invisible time was delivered a second time,
and a FIFO group's message to a second consumer while the first still ran it.

Unlike the proxy, a renewal keeps the receipt handle (the proxy's changes it and maps the client's first handle to
the newest in memory): the client's ack is good across renewals and restarts, and the renewals are part of the pop
state saved in ``popState.json`` (``PopGroups.renew``), so a restarted server goes on renewing.
"""

from __future__ import annotations

import dataclasses
import threading
import time

# the proxy's retry delays for consumers that fail a message (CustomizedRetryPolicy): attempt n waits RETRY_MS[n - 1]
RETRY_MS = tuple(s * 1000 for s in (1, 5, 10, 30, 60, 120, 180, 240, 300, 360, 420, 480, 540, 600, 1200, 1800,
                                    3600, 7200))
# a client that sent nothing (heartbeat, telemetry, receive) for this long is gone: the proxy's channelExpiredTimeout
CLIENT_EXPIRY_MS = 120_000


@dataclasses.dataclass(frozen=True)
class RenewPolicy:
    """The proxy's renewal settings (``ProxyConfig``), in its defaults."""

    invisible_ms: int = 60_000  # defaultInvisibleTimeMills: what an auto-renewed receive hides its messages for
    ahead_ms: int = 10_000  # renewAheadTimeMillis: renew once this close to visible again
    period_s: float = 5.0  # renewSchedulePeriodMillis
    max_ms: int = 3 * 3600 * 1000  # renewMaxTimeMillis: then the message is given back (a nack)
    clear_ms: int = 1_000  # invisibleTimeMillisWhenClear: its client went away
    steps_ms: tuple[int, ...] = (60_000, 180_000, 300_000, 600_000, 1_800_000, 3_600_000)  # RenewStrategyPolicy
    client_expiry_ms: int = CLIENT_EXPIRY_MS

    def step(self, renewals: int) -> int:
        """How long the ``renewals``-th renewal (from 0) hides the message."""
        return self.steps_ms[min(renewals, len(self.steps_ms) - 1)]


def retry_delay(attempt: int) -> int:
    """The group's retry delay after delivery ``attempt`` (from 1) failed."""
    return RETRY_MS[min(max(attempt - 1, 0), len(RETRY_MS) - 1)]


def _now_ms() -> int:
    return time.monotonic_ns() // 1_000_000


class Clients:
    """When each client was last heard from: a heartbeat, its telemetry stream, a receive. A client unknown since
    the server started counts as heard at the start (after a restart its messages go on being renewed until it has
    had ``expiry_ms`` to come back); one that ended with NotifyClientTermination is gone at once."""

    def __init__(self, expiry_ms: int = CLIENT_EXPIRY_MS, clock=_now_ms) -> None:
        self.expiry_ms = expiry_ms
        self._clock = clock
        self._started = clock()
        self._seen: dict[str, int] = {}
        self._gone: set[str] = set()
        self._lock = threading.Lock()

    def touch(self, client_id: str) -> None:
        now = self._clock()
        with self._lock:
            self._seen[client_id] = now
            self._gone.discard(client_id)
            if len(self._seen) > 4096:  # forget clients long gone
                self._seen = {c: t for c, t in self._seen.items() if now - t < 10 * self.expiry_ms}

    def terminated(self, client_id: str) -> None:
        with self._lock:
            self._seen.pop(client_id, None)
            self._gone.add(client_id)
            if len(self._gone) > 4096:
                self._gone.clear()  # then they expire as unheard clients do

    def online(self, client_id: str) -> bool:
        with self._lock:
            if client_id in self._gone:
                return False
            return self._clock() - self._seen.get(client_id, self._started) < self.expiry_ms

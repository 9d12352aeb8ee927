"""Long-polling receives wait here for their topic's next messages: on the server's event loop, no thread each.

A ReceiveMessage that finds nothing waits up to its long-polling timeout (20 s by default) for new messages. A
thread per waiting call would make a thousand idle consumers a thousand threads; here a waiting receive is a
future on the event loop, and one watcher thread follows the store's dispatcher: after each dispatch round (and
every ``CHECK_S`` besides, which also catches what no round announces) it reads the end of every topic a receive
waits on, and when a topic grew by k messages wakes up to k waiters of each group, oldest first, as RocketMQ's
``PopLongPollingService`` wakes one waiting request per arrival. A woken receive that finds nothing (another
took the messages) waits again. A waiter also wakes by its own timeout: its poll's end, or the moment a message
it could be given again becomes visible, or ``RECHECK_S``.

A message that goes into flight, or whose invisible time is changed, after the waiters of its group looked gets
no timeout of theirs: its deadline is told to ``due``, and once it has passed the watcher asks the group's
in-flight state (``next_due``, in the watcher's thread) whether a message is visible again, and if so wakes a
waiter, within ``CHECK_S``.

A receive registers (``watch``) *before* it looks at the queues and waits (``wait``) after: messages dispatched
in between wake it, never fall between the look and the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ..store import MessageStore

log = logging.getLogger("rocketstore.server")

CHECK_S = 0.25  # the watcher looks at the waited-on topics at least this often
RECHECK_S = 5.0  # a waiting receive looks again at least this often, whatever wakes or does not wake it


@dataclass(eq=False, slots=True)
class Ticket:
    """One receive's place in the line of its (topic, group)."""

    topic: str
    group: str
    future: asyncio.Future = field(repr=False)
    woken: bool = False  # taken out of its line by a wake-up (under LongPolls._lock)
    left: bool = False  # its receive is done with it


class LongPolls:
    """The receives waiting for messages, by (topic, group), and the thread that wakes them.

    Every ticket ``watch`` makes is ``leave``-d once (``wait`` leaves it; a receive leaves its last ticket when it
    ends, however it ends): a line with no ticket and a topic with no line are dropped. A ticket woken and then left
    by a receive that does not look again (cancelled by its client, or answering with what it had already taken)
    passes its wake-up on to the next ticket of its line, so no wake-up is spent on a receive that is gone."""

    def __init__(self, store: MessageStore,
                 next_due: Callable[[str, str, list[int]], int | None] | None = None) -> None:
        """``next_due(group, topic, queue_ids)``: when (epoch ms) the first message of those queues in flight becomes
        visible again, if any; it may raise when it cannot tell now (asked again a round later)."""
        self.store = store
        self._next_due = next_due
        self._lock = threading.Lock()
        self._waiting: dict[str, dict[str, deque[Ticket]]] = {}  # topic -> group -> its line, oldest first
        self._ends: dict[str, int] = {}  # topic -> messages in its read queues, when last looked at
        self._due: dict[tuple[str, str], int] = {}  # (topic, group) with waiters -> when to ask next_due (epoch ms)
        self._closing = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="rocketstore-long-poll", daemon=True)

    def start(self) -> None:
        self._watcher.start()

    def close(self) -> None:
        """Wake every waiting receive (it answers at once) and stop the watcher."""
        self._closing.set()
        with self._lock:
            tickets = [t for lines in self._waiting.values() for line in lines.values() for t in line]
        for ticket in tickets:
            _wake(ticket)
        if self._watcher.is_alive():
            self._watcher.join()

    # --- on the event loop -------------------------------------------------------------------------------

    def watch(self, topic: str, group: str) -> Ticket:
        """Join the line of (topic, group): from now on, new messages of ``topic`` can wake this receive."""
        ticket = Ticket(topic, group, asyncio.get_running_loop().create_future())
        with self._lock:
            if topic not in self._ends:
                self._ends[topic] = self._end(topic)
            self._waiting.setdefault(topic, {}).setdefault(group, deque()).append(ticket)
        if self._closing.is_set():
            _wake(ticket)
        return ticket

    async def wait(self, ticket: Ticket, timeout: float) -> bool:
        """Until woken (True) or ``timeout`` seconds (False); the ticket is spent either way (the caller looks
        again). Cancelled here, the receive passes on a wake-up it got."""
        try:
            await asyncio.wait_for(asyncio.shield(ticket.future), max(0.0, min(timeout, RECHECK_S)))
            woken = True
        except TimeoutError:
            woken = False
        except BaseException:
            self.leave(ticket)
            raise
        self.leave(ticket, looks_again=True)
        return woken

    def leave(self, ticket: Ticket, *, looks_again: bool = False) -> None:
        """Done with ``ticket`` (a second leave does nothing). Unless its receive ``looks_again`` at the queues, a
        wake-up the ticket got goes to the next ticket of its line: the receive may not have seen that message."""
        passed: list[Ticket] = []
        with self._lock:
            if ticket.left:
                return
            ticket.left = True
            line = self._waiting.get(ticket.topic, {}).get(ticket.group)
            if line is None:
                return
            if not ticket.woken:
                with contextlib.suppress(ValueError):  # woken by close(): still in line
                    line.remove(ticket)
            elif not looks_again:
                passed = self._take(line, 1)
            self._drop_if_empty(ticket.topic, ticket.group)
        for other in passed:
            _wake(other)

    # --- from any thread -----------------------------------------------------------------------------------

    def wake(self, topic: str, group: str, count: int = 1) -> None:
        """Wake up to ``count`` receives of (topic, group), oldest first: messages became available to them
        that no dispatch announces (a FIFO group's next message, once the one before it is acknowledged)."""
        with self._lock:
            line = self._waiting.get(topic, {}).get(group)
            woken = self._take(line, count) if line else []
            if line is not None:
                self._drop_if_empty(topic, group)
        for ticket in woken:
            _wake(ticket)

    def due(self, topic: str, group: str, at_ms: int) -> None:
        """A message of (topic, group) may become visible again at ``at_ms`` (epoch ms): it went into flight or its
        invisible time changed. If receives wait there now, the watcher wakes one once it is visible. (A receive
        that starts waiting later sees the deadline in its own look.)"""
        with self._lock:
            if group in self._waiting.get(topic, ()):
                key = (topic, group)
                self._due[key] = min(self._due.get(key, at_ms), at_ms)

    @staticmethod
    def _take(line: deque[Ticket], count: int) -> list[Ticket]:
        """Up to ``count`` tickets out of ``line``, oldest first, marked woken; hold ``_lock``."""
        woken = [line.popleft() for _ in range(min(count, len(line)))]
        for ticket in woken:
            ticket.woken = True
        return woken

    def _drop_if_empty(self, topic: str, group: str) -> None:
        """Forget the line of (topic, group) if no ticket is left in it, and ``topic`` if no line is; hold ``_lock``."""
        lines = self._waiting.get(topic)
        if lines is None or lines.get(group, True):
            return
        del lines[group]
        self._due.pop((topic, group), None)
        if not lines:
            del self._waiting[topic]
            self._ends.pop(topic, None)

    def _end(self, topic: str) -> int:
        config = self.store.topic_config.get(topic)
        if config is None:
            return 0
        return sum(self.store.get_max_offset_in_queue(topic, q) for q in range(config.read_queue_nums))

    def _watch(self) -> None:
        dispatcher = self.store.dispatcher
        rounds = 0
        while not self._closing.is_set():
            try:
                rounds = dispatcher.wait_for_round(rounds, CHECK_S) if dispatcher is not None \
                    else self._closing.wait(CHECK_S) or 0
                with self._lock:
                    topics = list(self._ends)
                for topic in topics:
                    end = self._end(topic)
                    with self._lock:
                        before = self._ends.get(topic)
                        if before is None or end <= before:
                            if before is not None:
                                self._ends[topic] = end
                            continue
                        self._ends[topic] = end
                        woken = []
                        for group, line in list(self._waiting.get(topic, {}).items()):
                            woken += self._take(line, end - before)
                            self._drop_if_empty(topic, group)
                    for ticket in woken:
                        _wake(ticket)
                self._wake_due()
            except Exception as exc:  # a store closing under us, a topic deleted mid-look: look again later
                log.debug("long-poll watcher: %s", exc)
                self._closing.wait(CHECK_S)

    def _wake_due(self) -> None:
        """Wake a waiter of each (topic, group) whose told deadline passed and which has a message visible again."""
        now = _now_ms()
        with self._lock:
            passed = [key for key, at_ms in self._due.items() if at_ms <= now]
            for key in passed:
                del self._due[key]
        for topic, group in passed:
            config = self.store.topic_config.get(topic)
            try:
                next_ms = self._next_due(group, topic, list(range(config.read_queue_nums)) if config else []) \
                    if self._next_due is not None else None
            except Exception as exc:  # busy (an operation on the queue holds it): ask again next round
                log.debug("long-poll watcher: next due of %s on %s: %s", group, topic, exc)
                next_ms = now + int(CHECK_S * 1000)
            else:
                if next_ms is not None and next_ms <= now:
                    self.wake(topic, group)
                    next_ms = now + int(CHECK_S * 1000)  # more may be visible than that receive takes: ask again
            if next_ms is not None:
                self.due(topic, group, next_ms)


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _wake(ticket: Ticket) -> None:
    """Resolve the ticket's future on its loop (from any thread); once the loop is closed nobody waits on it."""
    call_soon(ticket.future.get_loop(), _resolve, ticket.future)


def call_soon(loop: asyncio.AbstractEventLoop, callback, *args) -> None:
    """``loop.call_soon_threadsafe``, from any thread, and nothing once the loop is closed: a check of
    ``is_closed()`` before the call would leave a window for the server's stop to close it in between
    (RuntimeError in the thread that wakes)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback, *args)


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)

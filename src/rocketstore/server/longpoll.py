"""Long-polling receives wait here for their topic's next messages: on the server's event loop, no thread each.

A ReceiveMessage that finds nothing waits up to its long-polling timeout (20 s by default) for new messages. A
thread per waiting call would make a thousand idle consumers a thousand threads; here a waiting receive is a
future on the event loop, and one watcher thread follows the store's dispatcher: after each dispatch round (and
every ``CHECK_S`` besides, which also catches what no round announces) it reads the end of every topic a receive
waits on, and when a topic grew by k messages wakes up to k waiters of each group, oldest first, as RocketMQ's
``PopLongPollingService`` wakes one waiting request per arrival. A woken receive that finds nothing (another
took the messages) waits again. A waiter also wakes by its own timeout: its poll's end, or the moment a message
it could be given again becomes visible, or ``RECHECK_S``.

A receive registers (``watch``) *before* it looks at the queues and waits (``wait``) after: messages dispatched
in between wake it, never fall between the look and the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import deque
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


class LongPolls:
    """The receives waiting for messages, by (topic, group), and the thread that wakes them."""

    def __init__(self, store: MessageStore) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._waiting: dict[tuple[str, str], deque[Ticket]] = {}
        self._ends: dict[str, int] = {}  # topic -> messages in its read queues, when last looked at
        self._closing = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="rocketstore-long-poll", daemon=True)

    def start(self) -> None:
        self._watcher.start()

    def close(self) -> None:
        """Wake every waiting receive (it answers at once) and stop the watcher."""
        self._closing.set()
        with self._lock:
            tickets = [t for line in self._waiting.values() for t in line]
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
            self._waiting.setdefault((topic, group), deque()).append(ticket)
        if self._closing.is_set():
            _wake(ticket)
        return ticket

    async def wait(self, ticket: Ticket, timeout: float) -> bool:
        """Until woken (True) or ``timeout`` seconds (False); the ticket is spent either way."""
        try:
            await asyncio.wait_for(asyncio.shield(ticket.future), max(0.0, min(timeout, RECHECK_S)))
            return True
        except TimeoutError:
            return False
        finally:
            self.leave(ticket)

    def leave(self, ticket: Ticket) -> None:
        with self._lock:
            line = self._waiting.get((ticket.topic, ticket.group))
            if line is not None:
                with contextlib.suppress(ValueError):  # woken: already out of the line
                    line.remove(ticket)
                if not line:
                    del self._waiting[(ticket.topic, ticket.group)]
                    if not any(topic == ticket.topic for topic, _group in self._waiting):
                        self._ends.pop(ticket.topic, None)

    # --- from any thread -----------------------------------------------------------------------------------

    def wake(self, topic: str, group: str, count: int = 1) -> None:
        """Wake up to ``count`` receives of (topic, group), oldest first: messages became available to them
        that no dispatch announces (a FIFO group's next message, once the one before it is acknowledged)."""
        with self._lock:
            line = self._waiting.get((topic, group))
            woken = [line.popleft() for _ in range(min(count, len(line)))] if line else []
        for ticket in woken:
            _wake(ticket)

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
                        for (waited, _group), line in self._waiting.items():
                            if waited == topic:
                                woken += [line.popleft() for _ in range(min(end - before, len(line)))]
                    for ticket in woken:
                        _wake(ticket)
            except Exception as exc:  # a store closing under us, a topic deleted mid-look: look again later
                log.debug("long-poll watcher: %s", exc)
                self._closing.wait(CHECK_S)


def _wake(ticket: Ticket) -> None:
    loop = ticket.future.get_loop()
    if loop.is_closed():
        return
    loop.call_soon_threadsafe(_resolve, ticket.future)


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)

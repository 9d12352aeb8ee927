"""Consuming a topic from Python: ``store.consumer(group, topic)``, resuming where the group left off.

A consumer reads every queue of the topic in order per queue, starting at the group's committed
offset (else at ``start``: "earliest", "latest" or an epoch-ms timestamp), and waits on the
dispatcher, not in a busy loop, when there is nothing new. With ``auto_commit`` the offsets of
what one ``poll`` returned are committed at the next ``poll`` (or ``commit``/``close``): a crash in
between delivers those messages again, never loses them (at least once). Iterating hands out one
message at a time: a message counts as processed once the loop asks for the next one, or when the
consumer is closed after a ``break``; a ``with`` block left by an exception commits only what was
processed, so the message whose handler raised, and everything after it, is delivered again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator

from .brokerconfig import checked, group_name
from .encoder import validate_topic
from .errors import InvalidQueryError, ReadOnlyStoreError, RocketStoreError, StoreClosedError
from .message import MessageExt
from .reads import GetMessageStatus, parse_tags
from .sqlfilter import subscription_filter

log = logging.getLogger(__name__)


class Consumer:
    def __init__(self, store, group: str, topic: str, *, tags: str | Iterable[str] | None = None,
                 sql: str | None = None, start: str | int = "earliest", auto_commit: bool = True,
                 batch_size: int = 32) -> None:
        # every argument checked before anything is written (the group goes to subscriptionGroup.json)
        checked(group_name, group, "group")
        validate_topic(topic)
        if start not in ("earliest", "latest") and (type(start) is not int or start < 0):
            raise InvalidQueryError(f"start is 'earliest', 'latest' or an epoch-ms timestamp, not {start!r}")
        if type(batch_size) is not int or batch_size < 1:
            raise InvalidQueryError(f"batch_size is a positive int, not {batch_size!r}")
        parsed = parse_tags(tags)  # kept parsed: a generator given as tags is read once
        self.sql = subscription_filter(parsed, sql)  # compiled once; an invalid expression writes nothing
        self.store = store
        self.group = group
        self.topic = topic
        self.tags = None if parsed is None else tuple(sorted(parsed))
        self.start = start
        self.auto_commit = auto_commit and not store.read_only
        self.batch_size = batch_size
        self._positions: dict[int, int] = {}
        self._processed: dict[int, int] = {}  # queue id -> offset after what the caller is done with
        self._in_hand: dict[int, int] = {}  # ... after what the caller holds and may still be handling
        self._next_queue = 0
        self._resets = store.offset_resets(group, topic)
        self.unreadable: list[int] = []  # commit-log offsets of records skipped as unreadable (each logged)
        self.closed = False
        # polls, commits and seeks from several threads take turns: unguarded, two threads polling one consumer got
        # the same messages (272 of 2,000 twice) and committed offsets that went back (49 -> 31)
        self._lock = threading.RLock()
        if not store.read_only:
            store.subscription_groups.ensure(group)
        self._latest_at_start: dict[int, int] = {}
        if start == "latest":  # "latest" means when the consumer was created; newer queues start at 0
            self._latest_at_start = {q: store.get_max_offset_in_queue(topic, q) for q in self._queue_ids()}

    def _queue_ids(self) -> list[int]:
        ids = set(self.store.queue_ids(self.topic))
        config = self.store.topic_config.get(self.topic)
        if config is not None:
            ids.update(range(config.read_queue_nums))
        return sorted(ids)

    def _position(self, queue_id: int) -> int:
        if queue_id not in self._positions:
            committed = self.store.consumer_offsets.query(self.group, self.topic, queue_id)
            if committed >= 0:
                position = committed
            elif self.start == "earliest":
                position = self.store.get_min_offset_in_queue(self.topic, queue_id)
            elif self.start == "latest":
                position = self._latest_at_start.get(queue_id, self.store.get_min_offset_in_queue(self.topic,
                                                                                                    queue_id))
            else:
                position = self.store.get_offset_in_queue_by_time(self.topic, queue_id, int(self.start))
            self._positions[queue_id] = position
        return self._positions[queue_id]

    def poll(self, timeout: float = 1.0, max_msgs: int | None = None) -> list[MessageExt]:
        """The next messages (across queues, in order within each), waiting up to ``timeout`` seconds.

        Asking again means the previous batch is processed (committed now with ``auto_commit``), whichever thread
        asks: a consumer shared by threads hands each message out once, but commits a batch when any thread polls
        next, not when the thread that got it is done (a consumer per thread, of the same group, does not)."""
        with self._lock:
            out, ends = self._fetch(timeout, max_msgs)
            self._in_hand = ends
            return out

    def _fetch(self, timeout: float, max_msgs: int | None) -> tuple[list[MessageExt], dict[int, int]]:
        """(the next messages, each queue's offset after them); what the caller held before is processed."""
        if self.closed:
            raise StoreClosedError("consumer is closed")
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout >= 0:
            raise InvalidQueryError(f"timeout is a number of seconds, not {timeout!r}")
        if max_msgs is not None and (type(max_msgs) is not int or max_msgs < 1):
            raise InvalidQueryError(f"max_msgs is a positive int or None, not {max_msgs!r}")
        self._follow_reset()
        self._processed.update(self._in_hand)
        self._in_hand = {}
        if self.auto_commit:
            self.commit()
        limit = max_msgs or self.batch_size
        ends: dict[int, int] = {}
        deadline = time.monotonic() + timeout
        dispatcher = self.store.dispatcher
        while True:
            seen = dispatcher.rounds if dispatcher is not None else 0
            out: list[MessageExt] = []
            moved = False  # a queue's position went on without a message (filtered out, a file's end, retention)
            queues = self._queue_ids()
            for i in range(len(queues)):
                queue_id = queues[(self._next_queue + i) % len(queues)]
                position = self._position(queue_id)
                result = self.store.get_message(self.topic, queue_id, position, limit - len(out), self.tags,
                                                sql=self.sql)
                if result.status in (GetMessageStatus.OFFSET_TOO_SMALL, GetMessageStatus.OFFSET_OVERFLOW_BADLY,
                                     GetMessageStatus.OFFSET_FOUND_NULL, GetMessageStatus.FOUND,
                                     GetMessageStatus.NO_MATCHED_MESSAGE, GetMessageStatus.MESSAGE_WAS_REMOVING):
                    self._positions[queue_id] = result.next_begin_offset
                    if result.next_begin_offset > position:
                        # committed with what is handed out next: RocketMQ's client commits a pull's next offset
                        # after NO_MATCHED_MSG too (a filtering group's progress was never committed, its lag
                        # never fell, and a reopen scanned everything again)
                        ends[queue_id] = result.next_begin_offset
                        moved = moved or not result.messages
                if result.unreadable:
                    self.unreadable.extend(result.unreadable)
                if result.messages:
                    out.extend(result.messages)
                if len(out) >= limit:
                    break
            self._next_queue += 1
            if out:
                return out, ends
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return [], ends
            if moved:  # more units are there to read: at once, not after a dispatch round (~1 s per 800 units
                continue  # a filter skipped, on a quiet store)
            if dispatcher is None:
                return [], ends
            dispatcher.wait_for_round(seen, min(remaining, 1.0))  # woken by the dispatcher

    def __iter__(self) -> Iterator[MessageExt]:
        """Messages one at a time; each is processed once the loop comes back for the next."""
        while not self.closed:
            with self._lock:
                batch, ends = self._fetch(1.0, None)
            for msg in batch:
                with self._lock:
                    self._in_hand = {msg.queue_id: msg.queue_offset + 1}
                yield msg
                with self._lock:
                    self._processed.update(self._in_hand)
            with self._lock:
                self._in_hand = ends  # the whole batch is processed: on past what the filters skipped

    def _follow_reset(self) -> None:
        """After ``store.reset_offset`` of this group and topic, forget what was handed out and read on from the
        new committed offsets: committing the old positions would undo the operator's reset."""
        resets = self.store.offset_resets(self.group, self.topic)
        if resets != self._resets:
            self._resets = resets
            self._processed.clear()
            self._in_hand.clear()
            self._positions.clear()

    def commit(self) -> None:
        """Commit the offsets after everything handed out so far (``commitOffset``): the caller says it is done.

        Raises ``StoreClosedError`` once the store is closed (its offsets file may belong to another writer by
        then), ``ReadOnlyStoreError`` on a read-only store."""
        with self._lock:
            self._processed.update(self._in_hand)
            self._in_hand = {}
            self._commit_processed()

    def _commit_processed(self) -> None:
        if self.store.read_only:
            raise ReadOnlyStoreError("a read-only store cannot commit consumer offsets")
        with self.store.offsets_lock:  # no reset between the check and the commit
            self._follow_reset()
            if not self._processed:
                return
            self.store._check_open(write=True)
            for queue_id, offset in self._processed.items():
                self.store.consumer_offsets.commit(self.group, self.topic, queue_id, offset)
        self._processed.clear()

    def seek(self, queue_id: int, offset: int) -> None:
        if type(queue_id) is not int or type(offset) is not int or offset < 0:
            raise InvalidQueryError(f"seek takes a queue id and a non-negative offset, not {queue_id!r}, {offset!r}")
        with self._lock:
            self._positions[queue_id] = offset

    def close(self, *, commit_in_hand: bool = True) -> None:
        """Commit (with ``auto_commit``) and persist the offsets. A consumer closed after its store commits
        nothing and raises ``StoreClosedError`` if it had offsets left to commit (they are delivered again).

        ``commit_in_hand=False`` commits only what is known processed: the messages of the last ``poll``, or
        the last one iterated, are delivered again (a ``with`` block left by an exception closes so)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            if not commit_in_hand:
                self._in_hand = {}
            if self.auto_commit:
                self.commit()
                if not self.store.closed:  # the store's close persisted everything committed before it
                    self.store.consumer_offsets.persist()

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # the block's own exception is the one to see; what it was handling is delivered again
            self.close(commit_in_hand=False)
        except RocketStoreError as failure:
            log.warning("consumer %s of %s closed without committing its offsets: %s", self.group, self.topic,
                        failure)

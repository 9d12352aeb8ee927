"""Delivering delayed messages (RocketMQ's ``ScheduleMessageService`` and timer wheel).

A DELAY message waits in ``SCHEDULE_TOPIC_XXXX``, queue level-1, its unit's tags code being its
delivery time. A thread walks each level's queue from the offset in ``delayOffset.json``; every
unit that is due is copied to its real topic and queue (DELAY, REAL_TOPIC and REAL_QID removed,
UNIQ_KEY and keys kept) and the offset moves on. A crash between the copy and the offset write
delivers it again: at least once, as in RocketMQ.

A timer message (any delivery time, TIMER_DELIVER_MS) waits in ``rmq_sys_wheel_timer`` queue 0; its unit's
tags code is its TAGS hash, as RocketMQ's dispatch writes it (only the delay levels' units carry a due time), so
the due time is read from the record. Times in one queue are not in order, so the same thread keeps the waiting
units in a heap (read from the queue as they arrive) and delivers each when due; the offset in
``timerOffset.json`` is the one below which everything has been delivered, and a restart reads the queue again
from there (again at least once). The delivered copy carries its due time as TIMER_OUT_MS.

A broker's store keeps its timer progress elsewhere (``config/timercheck``: the queue offset below which its timer
took the units into ``timerlog/``, delivered or still waiting there). Handed such a store, the wheel reads the
queue from its start and passes over each unit below that offset whose message is already in its topic (the
broker's delivered copy, found by UNIQ_KEY): the rest are delivered, none twice.

A due message the store refuses for good (its topic deleted with auto-create off, its queue gone after the
topic shrank) is logged, listed in ``undeliverable`` and passed over: it stays readable where it was parked
(by id or key), and the messages after it are not held up. A refusal that may pass (a full disk, a failed
store) stops only its own level, or the timers, until a later tick; the other levels go on.
"""

from __future__ import annotations

import heapq
import logging
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

from .brokerconfig import DelayOffsetManager, TimerOffsetManager
from .codec.properties import PropertyName
from .encoder import SCHEDULE_TOPIC, TIMER_TOPIC, java_integer
from .errors import MessageIllegalError, RocketStoreError, StoreClosedError
from .lifecycle import start_thread
from .message import Message, MessageExt, SysFlag

log = logging.getLogger(__name__)
_DROPPED = (PropertyName.DELAY, PropertyName.REAL_TOPIC, PropertyName.REAL_QUEUE_ID, PropertyName.TIMER_DELIVER_MS,
            PropertyName.TIMER_DELAY_SEC, PropertyName.TIMER_DELAY_MS)
TIMER_CHECK_FILE = "timercheck"  # BrokerPathConfigHelper.getTimerCheckPath
_KEPT_SYS_FLAGS = SysFlag.COMPRESSED | SysFlag.MULTI_TAGS | SysFlag.COMPRESSION_TYPE_MASK


def delivered_copy(msg: MessageExt) -> Message | None:
    """The message to store in the real topic, or None if the scheduled record names none."""
    topic = msg.properties.get(PropertyName.REAL_TOPIC)
    try:
        queue_id = int(msg.properties.get(PropertyName.REAL_QUEUE_ID, "0"))
    except ValueError:
        return None
    if not topic:
        return None
    properties = {k: v for k, v in msg.properties.items() if k not in _DROPPED}
    if PropertyName.TIMER_DELIVER_MS in msg.properties:  # the time it was due, as RocketMQ's timer records it
        properties[PropertyName.TIMER_OUT_MS] = msg.properties[PropertyName.TIMER_DELIVER_MS]
    return Message(topic, msg.body, properties=properties, queue_id=queue_id, flag=msg.flag,
                   sys_flag=msg.sys_flag & _KEPT_SYS_FLAGS, born_timestamp=msg.born_timestamp,
                   born_host=msg.born_host, reconsume_times=msg.reconsume_times)


class Deliveries:
    """What one service delivered, passed over and failed on; a failure that repeats is logged once."""

    def __init__(self) -> None:
        self.delivered = 0
        self.undeliverable: list[int] = []  # commit-log offsets of parked records the store refused for good
        self.last_error: RocketStoreError | None = None
        self._logged: str | None = None

    def put(self, store, copy: Message, phy_offset: int) -> None:
        """Store the delivered copy; raises a refusal that may pass, records one that will not."""
        try:
            store._put_delivered(copy)  # into a read-only topic too, as RocketMQ's schedule service puts
        except MessageIllegalError as exc:
            self.undeliverable.append(phy_offset)
            log.error("delayed message at %d cannot be delivered to %s queue %d, passed over (it stays readable "
                      "where it was parked): %s", phy_offset, copy.topic, copy.queue_id, exc)
            return
        self.delivered += 1

    def failed(self, what: str, exc: RocketStoreError) -> None:
        self.last_error = exc
        if str(exc) != self._logged:
            self._logged = str(exc)
            log.error("delivering %s stopped until a later tick: %s", what, exc)

    def recovered(self) -> None:
        self._logged = None


def broker_timer_offset(config_dir: Path) -> int:
    """``lastTimerQueueOffset`` of a broker's ``config/timercheck`` (``TimerCheckpoint``: big-endian longs,
    the third), or 0 when there is none."""
    try:
        with open(config_dir / TIMER_CHECK_FILE, "rb") as f:
            head = f.read(24)
    except OSError:
        return 0
    return max(0, struct.unpack_from(">q", head, 16)[0]) if len(head) == 24 else 0


def _exists(path: Path) -> bool:
    return path.exists() or path.with_name(path.name + ".bak").exists()


def _delivered_by_broker(store, properties: dict[str, str]) -> bool:
    """Whether the timer message with these properties is in its real topic already (the broker's timer keeps
    the UNIQ_KEY in the copy it delivers)."""
    topic, uniq_key = properties.get(PropertyName.REAL_TOPIC), properties.get(PropertyName.UNIQ_KEY)
    if not topic or not uniq_key:
        return False
    try:
        return any(found.topic == topic for found in store.query_message_by_uniq_key(topic, uniq_key))
    except RocketStoreError:
        return False


def readable_copy(store, phy_offset: int) -> Message | None:
    """The delivered copy of the parked record at ``phy_offset``; None (logged) if it cannot be read (gone,
    damaged, an I/O error: passed over, as RocketMQ's delivery passes over a message it cannot look up, so one bad
    record never holds up its level or every timer). A store closing is raised: the message waits for the next
    open. Skipped, a close that overtook a delivery backlog marked thousands of messages delivered that never were
    (the schedule review)."""
    try:
        return delivered_copy(store.look_message_by_offset(phy_offset))
    except StoreClosedError:
        raise
    except RocketStoreError as exc:
        log.error("skipping the delayed message at %d: %s", phy_offset, exc)
        return None


class TimerWheel:
    """Timer messages waiting in rmq_sys_wheel_timer queue 0, delivered when due."""

    def __init__(self, store, offsets: TimerOffsetManager, deliveries: Deliveries | None = None) -> None:
        self.store = store
        self.offsets = offsets
        self.deliveries = deliveries or Deliveries()
        self._waiting: list[tuple[int, int, int]] = []  # (deliver ms, queue offset, commit-log offset)
        self._read_to: int | None = None  # next queue offset to read into the heap
        self._committed = 0
        self._done: set[int] = set()  # delivered above _committed
        # a broker's store handed over (no timerOffset.json yet): below this offset its timer took the units
        self._broker_below = 0 if _exists(offsets.path) else broker_timer_offset(offsets.path.parent)
        if self._broker_below:
            log.info("timer wheel: the broker's timercheck says its timer took the units below offset %d; those it "
                     "delivered (found in their topic by UNIQ_KEY) are not delivered again", self._broker_below)

    def pending(self) -> int:
        return len(self._waiting)

    def deliver_due(self, now: int, stopping: Callable[[], bool] | None = None) -> int:
        """Deliver the due timer messages until ``stopping`` says so; a refusal that may pass puts the entry back
        and raises."""
        queue = self.store.queues.get(TIMER_TOPIC, 0)
        if queue is None:
            return 0
        if self._read_to is None or self._read_to < queue.min_offset_in_queue:
            self._committed = self._read_to = max(self.offsets.get(0), queue.min_offset_in_queue)
            # read again from there (after retention, from the queue's new start): what waits is read again too
            self._waiting = []
            self._done = {offset for offset in self._done | self.offsets.delivered_above() if offset >= self._committed}
            self._advance()
        while self._read_to < queue.max_offset_in_queue:
            unit = queue.get_unit(self._read_to)
            if unit is None:
                break
            if self._read_to not in self._done:  # delivered before a restart, out of queue order
                due = self._due(unit[0], self._read_to < self._broker_below)
                if due is None:
                    self._done.add(self._read_to)
                else:
                    heapq.heappush(self._waiting, (due, self._read_to, unit[0]))
            self._read_to += 1
        self._advance()
        count = self.deliveries.delivered
        while self._waiting and self._waiting[0][0] <= now and not (stopping is not None and stopping()):
            entry = heapq.heappop(self._waiting)
            try:
                copy = readable_copy(self.store, entry[2])
                if copy is not None:
                    self.deliveries.put(self.store, copy, entry[2])
            except BaseException:
                heapq.heappush(self._waiting, entry)  # delivered on a later tick
                raise
            self._done.add(entry[1])
            self._advance()
        return self.deliveries.delivered - count

    def _due(self, phy_offset: int, broker_took: bool) -> int | None:
        """When the parked record at ``phy_offset`` is due (0, now, when it cannot be read: its delivery says
        why), or None when the broker that ``broker_took`` it already delivered it."""
        try:
            msg = self.store.commit_log.get_message(phy_offset, read_body=False)
        except RocketStoreError:
            return 0
        properties = msg.properties
        if broker_took and _delivered_by_broker(self.store, properties):
            return None
        return java_integer(properties.get(PropertyName.TIMER_DELIVER_MS, ""), 64) or 0

    def _advance(self) -> None:
        """Commit up to the first offset not delivered; the ones delivered above it are kept in the file too."""
        while self._committed in self._done:
            self._done.discard(self._committed)
            self._committed += 1
        self.offsets.set_progress(self._committed, self._done)


class ScheduleMessageService:
    def __init__(self, store, offsets: DelayOffsetManager, interval: float = 0.1,
                 timer_offsets: TimerOffsetManager | None = None) -> None:
        self.store = store
        self.offsets = offsets
        self.deliveries = Deliveries()
        self.timers = TimerWheel(store, timer_offsets, self.deliveries) if timer_offsets is not None else None
        self.interval = interval
        self._lock = threading.Lock()  # the thread and direct callers (tests, tools) take turns
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = start_thread(self._run, "rocketstore-schedule")

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.deliver_due()
            except RocketStoreError as exc:  # e.g. a full disk: try again on the next tick
                log.error("delivering delayed messages failed: %s", exc)

    def deliver_due(self, now_ms: int | None = None) -> int:
        """Deliver every due message of every level and every due timer message; returns how many."""
        now = time.time_ns() // 1_000_000 if now_ms is None else now_ms
        with self._lock:
            return self._deliver_due(now)

    @property
    def delivered(self) -> int:
        return self.deliveries.delivered

    @property
    def undeliverable(self) -> list[int]:
        return self.deliveries.undeliverable

    def _deliver_due(self, now: int) -> int:
        before = self.deliveries.delivered
        failed = False
        for level in range(1, len(self.store.config.delay_levels_ms) + 1):
            queue = self.store.queues.get(SCHEDULE_TOPIC, level - 1)
            if queue is None:
                continue
            offset = max(self.offsets.get(level), queue.min_offset_in_queue)
            while offset < queue.max_offset_in_queue and not self._stop.is_set():  # a close waits for one delivery
                unit = queue.get_unit(offset)
                if unit is None or unit[2] > now:
                    break  # units of one level are in delivery-time order
                try:
                    copy = readable_copy(self.store, unit[0])
                    if copy is not None:
                        self.deliveries.put(self.store, copy, unit[0])
                except RocketStoreError as exc:  # this level waits for a later tick, the others go on
                    self.deliveries.failed(f"delay level {level}", exc)
                    failed = True
                    break
                offset += 1
                self.offsets.set(level, offset)
        if self.timers is not None:
            try:
                self.timers.deliver_due(now, self._stop.is_set)
            except RocketStoreError as exc:
                self.deliveries.failed("timer messages", exc)
                failed = True
        if not failed:
            self.deliveries.recovered()
        return self.deliveries.delivered - before

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    halt = shutdown  # nothing is left to write after the thread stops

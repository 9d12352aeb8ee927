"""Delivering delayed messages (RocketMQ's ``ScheduleMessageService`` and timer wheel).

A DELAY message waits in ``SCHEDULE_TOPIC_XXXX``, queue level-1, its unit's tags code being its
delivery time. A thread walks each level's queue from the offset in ``delayOffset.json``; every
unit that is due is copied to its real topic and queue (DELAY, REAL_TOPIC and REAL_QID removed,
UNIQ_KEY and keys kept) and the offset moves on. A crash between the copy and the offset write
delivers it again: at least once, as in RocketMQ.

A timer message (any delivery time, TIMER_DELIVER_MS) waits in ``rmq_sys_wheel_timer`` queue 0, its
unit's tags code being its delivery time. Times in one queue are not in order, so the same thread keeps
the waiting units in a heap (read from the queue as they arrive) and delivers each when due; the offset
in ``timerOffset.json`` is the one below which everything has been delivered, and a restart reads the
queue again from there (again at least once). The delivered copy carries its due time as TIMER_OUT_MS.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time

from .brokerconfig import DelayOffsetManager, TimerOffsetManager
from .codec.properties import PropertyName
from .encoder import SCHEDULE_TOPIC, TIMER_TOPIC
from .errors import RocketStoreError
from .message import Message, MessageExt, SysFlag

log = logging.getLogger(__name__)
_DROPPED = (PropertyName.DELAY, PropertyName.REAL_TOPIC, PropertyName.REAL_QUEUE_ID, PropertyName.TIMER_DELIVER_MS,
            PropertyName.TIMER_DELAY_SEC, PropertyName.TIMER_DELAY_MS)
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


def readable_copy(store, phy_offset: int) -> Message | None:
    """The delivered copy of the parked record at ``phy_offset``; None (logged) if it cannot be read."""
    try:
        return delivered_copy(store.look_message_by_offset(phy_offset))
    except RocketStoreError as exc:
        log.error("skipping the delayed message at %d: %s", phy_offset, exc)
        return None


class TimerWheel:
    """Timer messages waiting in rmq_sys_wheel_timer queue 0, delivered when due."""

    def __init__(self, store, offsets: TimerOffsetManager) -> None:
        self.store = store
        self.offsets = offsets
        self._waiting: list[tuple[int, int, int]] = []  # (deliver ms, queue offset, commit-log offset)
        self._read_to: int | None = None  # next queue offset to read into the heap
        self._committed = 0
        self._done: set[int] = set()  # delivered above _committed

    def pending(self) -> int:
        return len(self._waiting)

    def deliver_due(self, now: int) -> int:
        queue = self.store.queues.get(TIMER_TOPIC, 0)
        if queue is None:
            return 0
        if self._read_to is None or self._read_to < queue.min_offset_in_queue:
            self._committed = self._read_to = max(self.offsets.get(0), queue.min_offset_in_queue)
        while self._read_to < queue.max_offset_in_queue:
            unit = queue.get_unit(self._read_to)
            if unit is None:
                break
            heapq.heappush(self._waiting, (unit[2], self._read_to, unit[0]))
            self._read_to += 1
        count = 0
        while self._waiting and self._waiting[0][0] <= now:
            entry = heapq.heappop(self._waiting)
            copy = readable_copy(self.store, entry[2])
            if copy is not None:
                try:
                    self.store.put_message(copy)
                except BaseException:
                    heapq.heappush(self._waiting, entry)  # delivered on a later tick
                    raise
                count += 1
            self._done.add(entry[1])
            while self._committed in self._done:
                self._done.discard(self._committed)
                self._committed += 1
            self.offsets.set(0, self._committed)
        return count


class ScheduleMessageService:
    def __init__(self, store, offsets: DelayOffsetManager, interval: float = 0.1,
                 timer_offsets: TimerOffsetManager | None = None) -> None:
        self.store = store
        self.offsets = offsets
        self.timers = TimerWheel(store, timer_offsets) if timer_offsets is not None else None
        self.interval = interval
        self._lock = threading.Lock()  # the thread and direct callers (tests, tools) take turns
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.delivered = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="rocketstore-schedule", daemon=True)
        self._thread.start()

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

    def _deliver_due(self, now: int) -> int:
        count = 0
        for level in range(1, len(self.store.config.delay_levels_ms) + 1):
            queue = self.store.queues.get(SCHEDULE_TOPIC, level - 1)
            if queue is None:
                continue
            offset = max(self.offsets.get(level), queue.min_offset_in_queue)
            while offset < queue.max_offset_in_queue:
                unit = queue.get_unit(offset)
                if unit is None or unit[2] > now:
                    break  # units of one level are in delivery-time order
                copy = readable_copy(self.store, unit[0])
                if copy is not None:
                    self.store.put_message(copy)
                    count += 1
                offset += 1
                self.offsets.set(level, offset)
        if self.timers is not None:
            count += self.timers.deliver_due(now)
        self.delivered += count
        return count

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

"""Delivering delayed messages (RocketMQ's ``ScheduleMessageService``).

A DELAY message waits in ``SCHEDULE_TOPIC_XXXX``, queue level-1, its unit's tags code being its
delivery time. A thread walks each level's queue from the offset in ``delayOffset.json``; every
unit that is due is copied to its real topic and queue (DELAY, REAL_TOPIC and REAL_QID removed,
UNIQ_KEY and keys kept) and the offset moves on. A crash between the copy and the offset write
delivers it again: at least once, as in RocketMQ.
"""

from __future__ import annotations

import logging
import threading
import time

from .brokerconfig import DelayOffsetManager
from .codec.properties import PropertyName
from .encoder import SCHEDULE_TOPIC
from .errors import RocketStoreError
from .message import Message, MessageExt, SysFlag

log = logging.getLogger(__name__)
_DROPPED = (PropertyName.DELAY, PropertyName.REAL_TOPIC, PropertyName.REAL_QUEUE_ID)
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
    return Message(topic, msg.body, properties=properties, queue_id=queue_id, flag=msg.flag,
                   sys_flag=msg.sys_flag & _KEPT_SYS_FLAGS, born_timestamp=msg.born_timestamp,
                   born_host=msg.born_host, reconsume_times=msg.reconsume_times)


class ScheduleMessageService:
    def __init__(self, store, offsets: DelayOffsetManager, interval: float = 0.1) -> None:
        self.store = store
        self.offsets = offsets
        self.interval = interval
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
        """Deliver every due message of every level; returns how many."""
        now = time.time_ns() // 1_000_000 if now_ms is None else now_ms
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
                try:
                    copy = delivered_copy(self.store.look_message_by_offset(unit[0]))
                except RocketStoreError as exc:
                    log.error("skipping scheduled message at %d: %s", unit[0], exc)
                    copy = None
                if copy is not None:
                    self.store.put_message(copy)
                    count += 1
                offset += 1
                self.offsets.set(level, offset)
        self.delivered += count
        return count

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

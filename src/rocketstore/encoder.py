"""Turning a user's ``Message`` into a record ready to append (RocketMQ's ``MessageExtEncoder``).

Every check that can reject a message happens here, before the put lock is taken, so a
rejected message never touches the log. The three fields only known under the lock (queue
offset, physical offset, store time) are left zero and filled in by the commit log.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from .codec.hashing import body_crc
from .codec.hosts import Host
from .codec.msgid import UniqKeyGenerator
from .codec.properties import KEY_SEPARATOR, PropertyName, check_property, encode_properties
from .codec.record import (
    BLANK_RECORD_LEN,
    CRC32_RESERVED_LEN,
    MAGIC_V1,
    MAGIC_V2,
    MAX_PROPERTIES_LEN,
    MAX_TOPIC_LEN_V1,
    encode_record,
    record_length,
)
from .config import StoreConfig
from .errors import (
    IllegalDeliveryTimeError,
    InvalidFlagError,
    InvalidPropertyError,
    InvalidTopicError,
    MessageIllegalError,
    MessageTooLargeError,
    PropertiesTooLargeError,
)
from .message import Message, SysFlag

TOPIC_MAX_LENGTH = 127  # TopicValidator.TOPIC_MAX_LENGTH
SCHEDULE_TOPIC = "SCHEDULE_TOPIC_XXXX"
TIMER_TOPIC = "rmq_sys_wheel_timer"
# where a message waits until it is due, its real topic and queue in REAL_TOPIC/REAL_QID
PARKED_TOPICS = frozenset({SCHEDULE_TOPIC, TIMER_TOPIC})
RETRY_TOPIC_MAX_LENGTH = 255
RETRY_GROUP_TOPIC_PREFIX = "%RETRY%"
_TOPIC_CHARS = re.compile(r"[%|a-zA-Z0-9_-]+")
_INT32 = (-(1 << 31), (1 << 31) - 1)
_INT64 = (-(1 << 63), (1 << 63) - 1)
_USER_SYS_FLAGS = (SysFlag.COMPRESSED | SysFlag.MULTI_TAGS | SysFlag.TRANSACTION_MASK
                   | SysFlag.COMPRESSION_TYPE_MASK)


def validate_topic(topic: object) -> str:
    """RocketMQ's ``TopicValidator``: letters, digits, ``%|_-``; at most 127 chars (255 for %RETRY%).

    The allowed characters also guarantee that a topic used as a directory name can never leave
    the store root (no ``/``, no ``.``).
    """
    if not isinstance(topic, str) or not topic:
        raise InvalidTopicError(f"topic must be a non-empty string, not {topic!r}")
    if not _TOPIC_CHARS.fullmatch(topic):
        raise InvalidTopicError(f"topic {topic!r} may contain only letters, digits and the characters %|_-")
    limit = RETRY_TOPIC_MAX_LENGTH if topic.startswith(RETRY_GROUP_TOPIC_PREFIX) else TOPIC_MAX_LENGTH
    if len(topic) > limit:
        raise InvalidTopicError(f"topic is {len(topic)} characters long; the limit is {limit}")
    return topic


def _check_int(name: str, value: object, bounds: tuple[int, int]) -> int:
    if type(value) is int and bounds[0] <= value <= bounds[1]:  # the fast path of every put
        return value
    if not isinstance(value, int) or isinstance(value, bool) or not bounds[0] <= value <= bounds[1]:
        raise InvalidFlagError(f"{name} must be an integer in [{bounds[0]}, {bounds[1]}], not {value!r}")
    return value


@dataclass(slots=True)
class PendingRecord:
    """An encoded record waiting for the put lock."""

    data: bytearray
    topic: str
    queue_id: int
    sys_flag: int
    uniq_key: str | None
    wait_store: bool  # WAIT != false: a SYNC_FLUSH put waits for the disk

    @property
    def size(self) -> int:
        return len(self.data)

    @property
    def takes_queue_offset(self) -> bool:
        """PREPARED and ROLLBACK records get no queue offset (0 is written)."""
        return SysFlag.transaction_type(self.sys_flag) in (SysFlag.TRANSACTION_NOT_TYPE,
                                                           SysFlag.TRANSACTION_COMMIT_TYPE)


class MessageEncoder:
    """Validates and encodes messages for one store."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.store_host = Host.parse(config.store_host)
        self.store_host_raw = self.store_host.to_bytes()
        self.uniq_keys = UniqKeyGenerator(self.store_host.ip)
        self._valid_topics: set[str] = set()  # topics that passed validate_topic
        # The largest record one segment can take: it must leave room for the closing BLANK record.
        self.max_record_len = min(config.max_message_size + 65536,
                                  config.mapped_file_size_commit_log - BLANK_RECORD_LEN)

    def encode(self, msg: Message) -> PendingRecord:
        """Check ``msg`` and encode it; raises a ``MessageIllegalError`` subclass when it is not storable."""
        if not isinstance(msg, Message):
            raise MessageIllegalError(f"expected a rocketstore.Message, got {type(msg).__name__}")
        topic = msg.topic
        if topic not in self._valid_topics:
            validate_topic(topic)
            if len(self._valid_topics) < 65536:
                self._valid_topics.add(topic)
        body = msg.body
        if isinstance(body, str):
            body = body.encode("utf-8")
        if body is None or not isinstance(body, bytes | bytearray | memoryview):
            raise MessageIllegalError(f"body must be bytes, not {type(body).__name__}")
        body = bytes(body)
        if len(body) > self.config.max_message_size:
            raise MessageTooLargeError(
                f"body is {len(body)} bytes; max_message_size is {self.config.max_message_size}")
        queue_id = _check_int("queue_id", msg.queue_id, (0, _INT32[1]))
        flag = _check_int("flag", msg.flag, _INT32)
        sys_flag = _check_int("sys_flag", msg.sys_flag, _INT32)
        if sys_flag & ~_USER_SYS_FLAGS:
            raise InvalidFlagError(
                f"sys_flag 0x{sys_flag:X} sets bits a message may not set (allowed: 0x{_USER_SYS_FLAGS:X})")
        reconsume = _check_int("reconsume_times", msg.reconsume_times, _INT32)
        prepared = _check_int("prepared_transaction_offset", msg.prepared_transaction_offset, _INT64)
        born_ts = msg.born_timestamp
        if born_ts is None:
            born_ts = time.time_ns() // 1_000_000
        born_ts = _check_int("born_timestamp", born_ts, _INT64)
        born_host = self.store_host if msg.born_host is None else Host.parse(msg.born_host)
        if born_host.is_ipv6:
            sys_flag |= SysFlag.BORNHOST_V6
        if self.store_host.is_ipv6:
            sys_flag |= SysFlag.STOREHOST_V6

        properties = self.properties_for(msg.properties or {}, msg.tags, msg.key_list())
        topic, queue_id = self.schedule(topic, queue_id, properties)
        uniq_key = properties[PropertyName.UNIQ_KEY]
        wait_store = properties.get(PropertyName.WAIT, "true").lower() != "false"
        props = encode_properties(properties, checked=True).encode("utf-8")
        if self.config.enabled_append_prop_crc:
            props += b"\0" * CRC32_RESERVED_LEN
        if len(props) > MAX_PROPERTIES_LEN:
            raise PropertiesTooLargeError(f"properties are {len(props)} bytes encoded; the limit is 32767")

        topic_bytes = topic.encode("utf-8")
        version = MAGIC_V1
        if self.config.auto_message_version_on_topic_len and len(topic) > MAX_TOPIC_LEN_V1:
            version = MAGIC_V2
        elif len(topic_bytes) > MAX_TOPIC_LEN_V1:
            raise InvalidTopicError("topic longer than 127 bytes needs auto_message_version_on_topic_len")
        size = record_length(len(body), len(topic_bytes), len(props), sys_flag, version)
        if size > self.max_record_len:
            raise MessageTooLargeError(f"record is {size} bytes; at most {self.max_record_len} fit")
        data = encode_record(
            topic=topic_bytes, body=body, properties=props, queue_id=queue_id, flag=flag, sys_flag=sys_flag,
            born_timestamp=born_ts, born_host=born_host.to_bytes(), store_host=self.store_host_raw,
            reconsume_times=reconsume, prepared_transaction_offset=prepared, version=version,
            crc=body_crc(body),
        )
        return PendingRecord(data, topic, queue_id, sys_flag, uniq_key, wait_store)

    def schedule(self, topic: str, queue_id: int, properties: dict[str, str]) -> tuple[str, int]:
        """Where a delayed message waits (``CommitLog.asyncPutMessage``, ``HookUtils.handleScheduleMessage``):
        a DELAY level sends it to SCHEDULE_TOPIC_XXXX, queue level-1 (a level past the last is the last); a
        TIMER_DELIVER_MS (or TIMER_DELAY_SEC/MS) in the future to rmq_sys_wheel_timer, queue 0. Its real
        topic and queue are kept in REAL_TOPIC/REAL_QID. A delivery time already past stores it as it is."""
        if topic in PARKED_TOPICS:
            return topic, queue_id
        raw = properties.get(PropertyName.DELAY)
        if raw is not None:
            try:
                level = int(raw)
            except ValueError:
                raise InvalidPropertyError(f"DELAY must be a delay level (an integer), not {raw!r}") from None
            if level > 0:
                level = min(level, len(self.config.delay_levels_ms))
                properties[PropertyName.DELAY] = str(level)
                for name in (PropertyName.TIMER_DELIVER_MS, PropertyName.TIMER_DELAY_SEC, PropertyName.TIMER_DELAY_MS):
                    properties.pop(name, None)  # a delay level wins, as in RocketMQ
                return self._park(topic, queue_id, properties, SCHEDULE_TOPIC, level - 1)
        deliver_ms = self._timer_deliver_ms(properties)
        if deliver_ms is None:
            return topic, queue_id
        properties[PropertyName.TIMER_DELIVER_MS] = str(deliver_ms)
        return self._park(topic, queue_id, properties, TIMER_TOPIC, 0)

    def _timer_deliver_ms(self, properties: dict[str, str]) -> int | None:
        """The delivery time of a timer message when it is in the future, else None."""
        now = time.time_ns() // 1_000_000
        for name, scale, relative in ((PropertyName.TIMER_DELIVER_MS, 1, False),
                                      (PropertyName.TIMER_DELAY_SEC, 1000, True),
                                      (PropertyName.TIMER_DELAY_MS, 1, True)):
            raw = properties.get(name)
            if raw is None:
                continue
            try:
                value = int(raw)
            except ValueError:
                raise IllegalDeliveryTimeError(f"{name} must be an integer, not {raw!r}") from None
            deliver = now + value * scale if relative else value
            if deliver <= now:
                return None
            if deliver - now > self.config.timer_max_delay_sec * 1000:
                raise IllegalDeliveryTimeError(f"{name}={raw} is more than timer_max_delay_sec "
                                               f"({self.config.timer_max_delay_sec} s) ahead")
            return deliver
        return None

    @staticmethod
    def _park(topic: str, queue_id: int, properties: dict[str, str], parked: str, parked_queue: int) -> tuple[str, int]:
        properties[PropertyName.REAL_TOPIC] = topic
        properties[PropertyName.REAL_QUEUE_ID] = str(queue_id)
        return parked, parked_queue

    def properties_for(self, user: dict[str, str], tags: str | None, keys: list[str],
                       uniq_key: str | None = None) -> dict[str, str]:
        """User properties plus TAGS, KEYS and a UNIQ_KEY (``uniq_key``, or generated, when the message has
        none). Shared by the per-message and the batch encoder, so their properties strings agree."""
        if not isinstance(user, dict):
            raise InvalidPropertyError("properties must be a dict of str to str")
        properties: dict[str, str] = {}
        for name, value in user.items():
            check_property(name, value)
            properties[name] = value
        properties.pop(PropertyName.CRC32, None)  # the store owns the record CRC
        if tags is not None and tags != "":
            check_property(PropertyName.TAGS, tags)
            if properties.get(PropertyName.TAGS, tags) != tags:
                raise InvalidPropertyError("TAGS given both as tags= and in properties, with different values")
            properties[PropertyName.TAGS] = tags
        if keys:
            for key in keys:
                if not isinstance(key, str) or not key or KEY_SEPARATOR in key:
                    raise InvalidPropertyError(f"key {key!r} is empty or contains a space (the KEYS separator)")
            joined = KEY_SEPARATOR.join(keys)
            check_property(PropertyName.KEYS, joined)
            if properties.get(PropertyName.KEYS, joined) != joined:
                raise InvalidPropertyError("KEYS given both as keys= and in properties, with different values")
            properties[PropertyName.KEYS] = joined
        if PropertyName.UNIQ_KEY not in properties:
            properties[PropertyName.UNIQ_KEY] = uniq_key or self.uniq_keys.next()
        return properties

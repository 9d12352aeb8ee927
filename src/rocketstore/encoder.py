"""Turning a user's ``Message`` into a record ready to append (RocketMQ's ``MessageExtEncoder``).

Every check that can reject a message happens here, before the put lock is taken, so a
rejected message never touches the log. The three fields only known under the lock (queue
offset, physical offset, store time) are left zero and filled in by the commit log.
"""

from __future__ import annotations

import functools
import itertools
import re
import struct
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .brokerlayout import is_lmq
from .codec.hashing import body_crc
from .codec.hosts import Host
from .codec.msgid import UniqKeyGenerator, UniqKeyRun
from .codec.properties import (
    KEY_SEPARATOR,
    PropertyName,
    _cached_order,
    check_property,
    encode_properties,
    split_keys,
)
from .codec.record import (
    BLANK_RECORD_LEN,
    BORN_HOST_POS,
    CRC32_RESERVED_LEN,
    FIXED_PART_LEN,
    MAGIC_V1,
    MAGIC_V2,
    MAX_PROPERTIES_LEN,
    MAX_TIME_MS,
    MAX_TOPIC_LEN_V1,
    encode_record,
    encode_v4_record,
    record_length,
    store_timestamp_pos,
)
from .codec.scratch import scratch
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

_PLAIN_FIXED_LEN = FIXED_PART_LEN + 1 + 2  # two IPv4 hosts, a one-byte topic length, the properties length
_PLAIN_STORE_TS_POS = BORN_HOST_POS + 8
# a plain row's properties string (``encode_plain_v1`` writes it): UNIQ_KEY\x01, the id's head, 4 counter digits
# and \x02; then "TAGS\x01" or "KEYS\x01", the value and \x02 for each present
_PLAIN_PROPS_FIXED = len(f"{PropertyName.UNIQ_KEY}\x01") + 4 + 1
_PLAIN_PROP_OVERHEAD = len(f"{PropertyName.TAGS}\x01") + 1
_UNIQ_KEY_PREFIX = f"{PropertyName.UNIQ_KEY}\x01"
_UNIQ_KEY_FIELD_LEN = len(_UNIQ_KEY_PREFIX) + 4 + 1  # and the id's head (``head_hex_len``): its 4 counter digits, \x02
_TAGS_PREFIX = f"{PropertyName.TAGS}\x01"
_KEYS_PREFIX = f"{PropertyName.KEYS}\x01"
_MESSAGE_TYPE = {Message}
_INT_TYPE = {int}
_STR_TYPE = {str}
_BYTES_TYPE = {bytes}
_TAG_TYPES = {str, type(None)}
_KEY_TYPES = {list, tuple, type(None)}
_join = "".join
# Below this many messages the batch pass's fixed cost (~15 us: column checks, packing, the compiled call)
# outweighs what it saves per message (~4.5 us): measured at stop 36, 2 messages 23.7 against 14.3 us, 3 even,
# 4 20.7 against 26.6 us.
BATCH_PASS_MIN = 4
TOPIC_MAX_LENGTH = 127  # TopicValidator.TOPIC_MAX_LENGTH
SCHEDULE_TOPIC = "SCHEDULE_TOPIC_XXXX"
TIMER_TOPIC = "rmq_sys_wheel_timer"
# where a message waits until it is due, its real topic and queue in REAL_TOPIC/REAL_QID
PARKED_TOPICS = frozenset({SCHEDULE_TOPIC, TIMER_TOPIC})
# Topics only the store itself writes, where and as its services expect (RocketMQ's TopicValidator refuses
# sends to all but the timer's, whose records a stray send would put out of order just the same)
NOT_SENDABLE_TOPICS = frozenset({SCHEDULE_TOPIC, TIMER_TOPIC, "RMQ_SYS_TRANS_HALF_TOPIC", "RMQ_SYS_TRANS_OP_HALF_TOPIC",
                                 "TRANS_CHECK_MAX_TIME_TOPIC", "SELF_TEST_TOPIC", "OFFSET_MOVED_EVENT"})
# TopicValidator's system topics (and its rmq_sys_ prefix; RMQ_SYS_ too: every RocketMQ topic so named is one):
# nobody creates them but the store (``create_topic`` refuses them; a client's queue count on SCHEDULE_TOPIC_XXXX
# refused every later delay), and ``serve`` refuses any call naming one
SYSTEM_TOPICS = NOT_SENDABLE_TOPICS | {"TBW102", "BenchmarkTest", "RMQ_SYS_TRACE_TOPIC", "CHECKPOINT_TOPIC"}
SYSTEM_TOPIC_PREFIXES = ("rmq_sys_", "RMQ_SYS_")
RETRY_TOPIC_MAX_LENGTH = 255  # TopicValidator.RETRY_OR_DLQ_TOPIC_MAX_LENGTH
RETRY_GROUP_TOPIC_PREFIX = "%RETRY%"
DLQ_GROUP_TOPIC_PREFIX = "%DLQ%"
_TOPIC_CHARS = re.compile(r"[%|a-zA-Z0-9_-]+")
_INT32 = (-(1 << 31), (1 << 31) - 1)
_INT64 = (-(1 << 63), (1 << 63) - 1)
_BORN_TIME = (-MAX_TIME_MS, MAX_TIME_MS)
_CRC_RESERVE = b"\0" * CRC32_RESERVED_LEN
_USER_SYS_FLAGS = (SysFlag.COMPRESSED | SysFlag.MULTI_TAGS | SysFlag.TRANSACTION_MASK
                   | SysFlag.COMPRESSION_TYPE_MASK)


@functools.lru_cache(maxsize=256)
def _int64s(count: int) -> struct.Struct:
    """A packer of ``count`` native int64s: numbers from Python lists into an array at half ``np.array``'s cost."""
    return struct.Struct(f"={count}q")


@functools.lru_cache(maxsize=256)
def _plain_ts_pos(count: int) -> np.ndarray:
    """Where the store time goes in each of ``count`` plain records (read-only: shared between puts)."""
    positions = np.full(count, _PLAIN_STORE_TS_POS, dtype=np.int64)
    positions.flags.writeable = False
    return positions


def _utf8_run(text: str, items: list[str]) -> tuple[bytes, list[int]] | None:
    """``items`` (whose concatenation is ``text``) as UTF-8 back to back and each one's byte length, or None when
    one cannot be encoded (a lone surrogate: ``encode`` names it)."""
    if text.isascii():
        return text.encode("ascii"), list(map(len, items))
    try:
        encoded = [item.encode("utf-8") for item in items]
    except UnicodeEncodeError:
        return None
    return b"".join(encoded), list(map(len, encoded))


def _has_separator(text: str) -> bool:
    """Whether a property value holds one of the properties string's separators."""
    return "\x01" in text or "\x02" in text


def validate_topic(topic: object) -> str:
    """RocketMQ's ``TopicValidator``: letters, digits, ``%|_-``; at most 127 chars (255 for a %RETRY% or %DLQ%
    topic, ``RETRY_OR_DLQ_TOPIC_MAX_LENGTH``: they are a prefix plus a group name, which may be long).

    The allowed characters also guarantee that a topic used as a directory name can never leave
    the store root (no ``/``, no ``.``).
    """
    if not isinstance(topic, str) or not topic:
        raise InvalidTopicError(f"topic must be a non-empty string, not {topic!r}")
    if not _TOPIC_CHARS.fullmatch(topic):
        raise InvalidTopicError(f"topic {topic!r} may contain only letters, digits and the characters %|_-")
    limit = RETRY_TOPIC_MAX_LENGTH if topic.startswith((RETRY_GROUP_TOPIC_PREFIX, DLQ_GROUP_TOPIC_PREFIX)) \
        else TOPIC_MAX_LENGTH
    if len(topic) > limit:
        raise InvalidTopicError(f"topic is {len(topic)} characters long; the limit is {limit}")
    return topic


_MULTI_DISPATCH = frozenset({PropertyName.INNER_MULTI_DISPATCH, PropertyName.INNER_MULTI_QUEUE_OFFSET})
_JAVA_INTEGER = re.compile(r"[+-]?[0-9]+")


def java_integer(text: str, bits: int) -> int | None:
    """``Integer.parseInt`` / ``Long.parseLong`` of a property, or None where Java throws: Python's int() also takes
    " 3", "1_0", other scripts' digits and any size, which a broker would refuse."""
    if not _JAVA_INTEGER.fullmatch(text):
        return None
    value = int(text)
    return value if -(1 << (bits - 1)) <= value < 1 << (bits - 1) else None


def key_list(keys: object) -> list:
    """A message's KEYS as a list: a space-separated string split, any other iterable listed (each key is checked
    where it is used); anything else is an ``InvalidPropertyError``, not the TypeError of iterating it."""
    if isinstance(keys, str):
        return split_keys(keys)
    try:
        return list(keys)  # type: ignore[call-overload]
    except TypeError:
        raise InvalidPropertyError(f"keys must be a string or a list of strings, not {keys!r}") from None


def is_system_topic(topic: str) -> bool:
    return topic in SYSTEM_TOPICS or topic.startswith(SYSTEM_TOPIC_PREFIXES)


def check_sendable(topic: str) -> None:
    """Refuse a message sent straight to a system topic (``TopicValidator.isNotAllowedSendTopic``) or to an LMQ
    queue (a broker's multi-dispatch writes those; ``brokerlayout``)."""
    if topic in NOT_SENDABLE_TOPICS:
        raise InvalidTopicError(f"{topic} is a system topic: messages cannot be sent to it")
    if is_lmq(topic):
        raise InvalidTopicError(f"{topic} is an LMQ queue, written by a broker's multi-dispatch: messages cannot be "
                                "sent to it")


def _as_body(body: object) -> bytes:
    if isinstance(body, str):
        try:
            return body.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate
            raise MessageIllegalError(f"body is a str UTF-8 cannot encode: {exc.reason} at character {exc.start}"
                                      ) from None
    if body is None or not isinstance(body, bytes | bytearray | memoryview):
        raise MessageIllegalError(f"body must be bytes, not {type(body).__name__}")
    return bytes(body)


def _unencodable_property(properties: dict[str, str]) -> None:
    """``InvalidPropertyError`` naming the property (tags, keys or a user property) UTF-8 cannot encode."""
    fields = {PropertyName.TAGS: "tags", PropertyName.KEYS: "keys"}
    for name, value in properties.items():
        for part, text in (("name", name), ("value", value)):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                what = fields.get(name, f"property {name!r} {part}") if part == "value" else f"property name {name!r}"
                raise InvalidPropertyError(f"{what} is not encodable as UTF-8: {exc.reason} at character "
                                           f"{exc.start}") from None
    raise AssertionError("a properties string UTF-8 cannot encode, of properties it can")


def _check_numbers(queue_id: object, flag: object, sys_flag: object, reconsume: object, prepared: object) -> None:
    _check_int("queue_id", queue_id, (0, _INT32[1]))
    _check_int("flag", flag, _INT32)
    _check_int("sys_flag", sys_flag, _INT32)
    if sys_flag & ~_USER_SYS_FLAGS:  # type: ignore[operator]
        raise InvalidFlagError(
            f"sys_flag 0x{sys_flag:X} sets bits a message may not set (allowed: 0x{_USER_SYS_FLAGS:X})")
    _check_int("reconsume_times", reconsume, _INT32)
    _check_int("prepared_transaction_offset", prepared, _INT64)


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
    store_ts_pos: int  # where STORETIMESTAMP goes (after a 4- or 16-byte born host)
    takes_queue_offset: bool  # PREPARED and ROLLBACK records get no queue offset (0 is written)

    @property
    def size(self) -> int:
        return len(self.data)


@dataclass(slots=True)
class PendingRecords:
    """The encoded records of one put, back to back in ``data``, waiting for the put lock."""

    data: bytearray | memoryview  # a plain put's records sit in the thread's scratch buffer
    sizes: Sequence[int]
    topics: Sequence[str]  # stored topic per record (a delayed message's schedule topic)
    queue_ids: Sequence[int]  # stored queue per record
    store_ts_pos: Sequence[int]  # where STORETIMESTAMP goes in each record
    takes_queue_offset: Sequence[bool]  # PREPARED and ROLLBACK records get no queue offset (0 is written)
    uniq_keys: Sequence[str | None]
    wait_store: bool  # some record waits for the disk under SYNC_FLUSH
    queue_checks: list[tuple[str, int]]  # (topic, highest queue id): the topic rules the put must pass
    size_array: np.ndarray | None = None  # ``sizes`` as int64, when the encoder made them so

    def __len__(self) -> int:
        return len(self.sizes)

    @classmethod
    def of(cls, msgs: list[Message], records: list[PendingRecord]) -> PendingRecords:
        checks: dict[str, int] = {}
        for msg, rec in zip(msgs, records, strict=True):
            checks[msg.topic] = max(checks.get(msg.topic, 0), msg.queue_id)
            checks[rec.topic] = max(checks.get(rec.topic, 0), rec.queue_id)
        if len(records) == 1:  # put_message: no copy
            rec = records[0]
            return cls(rec.data, (len(rec.data),), (rec.topic,), (rec.queue_id,), (rec.store_ts_pos,),
                       (rec.takes_queue_offset,), (rec.uniq_key,), rec.wait_store, list(checks.items()))
        return cls(bytearray(b"".join([rec.data for rec in records])), [len(rec.data) for rec in records],
                   [rec.topic for rec in records], [rec.queue_id for rec in records],
                   [rec.store_ts_pos for rec in records], [rec.takes_queue_offset for rec in records],
                   [rec.uniq_key for rec in records], any(rec.wait_store for rec in records), list(checks.items()))


class MessageEncoder:
    """Validates and encodes messages for one store."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.store_host = Host.parse(config.store_host)
        self.store_host_raw = self.store_host.to_bytes()
        self.uniq_keys = UniqKeyGenerator(self.store_host.ip)
        self._topics: dict[str, tuple[bytes, int]] = {}  # validated topics: UTF-8 bytes, record version
        self._born_hosts: dict[object, tuple[bytes, int]] = {}
        self._store_host_pair = (self.store_host_raw, SysFlag.BORNHOST_V6 if self.store_host.is_ipv6 else 0)
        self._store_host_flag = SysFlag.STOREHOST_V6 if self.store_host.is_ipv6 else 0
        self._encode_plain_v1 = None
        self._v1_topics: dict[str, bytes] = {}  # the validated topics a version-1 record can hold: their UTF-8
        # the batch path writes UNIQ_KEY, TAGS, KEYS in that order: the HashMap order of every subset of them
        self._plain_layout = not self.store_host.is_ipv6 and all(
            _cached_order(names)[0] == PropertyName.UNIQ_KEY and list(_cached_order(names)[1:]) == [
                name for name in (PropertyName.TAGS, PropertyName.KEYS) if name in names]
            for names in ((PropertyName.TAGS, PropertyName.KEYS, PropertyName.UNIQ_KEY),
                          (PropertyName.TAGS, PropertyName.UNIQ_KEY), (PropertyName.KEYS, PropertyName.UNIQ_KEY)))
        # The largest record one segment can take: it must leave room for the closing BLANK record.
        self.max_record_len = min(config.max_message_size + 65536,
                                  config.mapped_file_size_commit_log - BLANK_RECORD_LEN)

    def encode(self, msg: Message, system: bool = False) -> PendingRecord:
        """Check ``msg`` and encode it; raises a ``MessageIllegalError`` subclass when it is not storable.

        Every put goes through here, so the common case (known topic, bytes body, default numbers and
        hosts, no user properties) costs a few dictionary lookups and one struct pack; anything else
        takes the same checks the long way. Only the store's own services (``system``) write system topics.
        """
        if type(msg) is not Message and not isinstance(msg, Message):
            raise MessageIllegalError(f"expected a rocketstore.Message, got {type(msg).__name__}")
        topic = msg.topic
        known = self._topics.get(topic) or self._learn_topic(topic, system)
        body = msg.body
        if type(body) is not bytes:
            body = _as_body(body)
        if len(body) > self.config.max_message_size:
            raise MessageTooLargeError(
                f"body is {len(body)} bytes; max_message_size is {self.config.max_message_size}")
        queue_id, flag, sys_flag = msg.queue_id, msg.flag, msg.sys_flag
        reconsume, prepared = msg.reconsume_times, msg.prepared_transaction_offset
        if not (type(queue_id) is int and 0 <= queue_id <= _INT32[1] and type(flag) is int
                and _INT32[0] <= flag <= _INT32[1] and type(sys_flag) is int and not sys_flag & ~_USER_SYS_FLAGS
                and type(reconsume) is int and _INT32[0] <= reconsume <= _INT32[1]
                and type(prepared) is int and _INT64[0] <= prepared <= _INT64[1]):
            _check_numbers(queue_id, flag, sys_flag, reconsume, prepared)  # raises, naming the field
        born_ts = msg.born_timestamp
        if born_ts is None:
            born_ts = time.time_ns() // 1_000_000
        elif not (type(born_ts) is int and _BORN_TIME[0] <= born_ts <= _BORN_TIME[1]):
            _check_int("born_timestamp", born_ts, _BORN_TIME)
        born_host = self._store_host_pair if msg.born_host is None else self._born_host(msg.born_host)
        sys_flag |= born_host[1] | self._store_host_flag

        user = msg.properties
        if user:
            properties = self.properties_for(user, msg.tags, key_list(msg.keys), system=system)
            topic, queue_id = self.schedule(topic, queue_id, properties, sys_flag)
            wait_store = properties.get(PropertyName.WAIT, "true").lower() != "false"
        else:
            properties = self._plain_properties(msg.tags, msg.keys)
            wait_store = True
        uniq_key = properties[PropertyName.UNIQ_KEY]
        try:
            props = encode_properties(properties, checked=True).encode("utf-8")
        except UnicodeEncodeError:
            _unencodable_property(properties)  # raises, naming it
        if self.config.enabled_append_prop_crc:
            props += _CRC_RESERVE
        if len(props) > MAX_PROPERTIES_LEN:
            raise PropertiesTooLargeError(f"properties are {len(props)} bytes encoded; the limit is 32767")

        if topic != msg.topic:  # parked until due
            known = self._topics.get(topic) or self._learn_topic(topic, system=True)
        topic_bytes, version = known
        size = record_length(len(body), len(topic_bytes), len(props), sys_flag, version)
        if size > self.max_record_len:
            raise MessageTooLargeError(f"record is {size} bytes; at most {self.max_record_len} fit")
        data = encode_record(
            topic=topic_bytes, body=body, properties=props, queue_id=queue_id, flag=flag, sys_flag=sys_flag,
            born_timestamp=born_ts, born_host=born_host[0], store_host=self.store_host_raw,
            reconsume_times=reconsume, prepared_transaction_offset=prepared, version=version,
            crc=body_crc(body),
        )
        return PendingRecord(data, topic, queue_id, sys_flag, uniq_key, wait_store, store_timestamp_pos(sys_flag),
                             not sys_flag & SysFlag.TRANSACTION_PREPARED_TYPE)  # the bit PREPARED and ROLLBACK share

    def encode_many(self, msgs: list[Message], system: bool = False) -> PendingRecords:
        """Check and encode the messages of one put, back to back; raises as ``encode`` does.

        The usual put of ``BATCH_PASS_MIN`` or more messages (known short topics, bytes bodies, tags and
        keys, no user properties, IPv4 hosts) is checked in one pass and written by the compiled record loop
        ``put_batch`` uses; a smaller put, or one with anything else, goes through ``encode`` message by
        message, which also names what is wrong."""
        pending = None
        if self._plain_layout:
            if len(msgs) >= BATCH_PASS_MIN:
                pending = self._encode_plain(msgs)
            elif not system:
                pending = self._encode_plain_few(msgs)
        if pending is None:
            if len(msgs) == 1:
                return PendingRecords.of(msgs, [self.encode(msgs[0], system)])
            records = []
            for i, msg in enumerate(msgs):
                try:
                    records.append(self.encode(msg, system))
                except MessageIllegalError as exc:  # which message of the put: as put_batch names its row
                    raise type(exc)(f"message {i}: {exc}") from None
            pending = PendingRecords.of(msgs, records)
        return pending

    def _encode_plain_few(self, msgs: list[Message]) -> PendingRecords | None:
        """``encode_many`` of fewer than ``BATCH_PASS_MIN`` plain messages (``put_message`` above all), or None
        (nothing taken): ``encode``'s checks for that case and each record in one pass, without the property
        dictionary, the general properties writer and the per-record bookkeeping (a fifth of a put). Every message
        is checked before any takes its UNIQ_KEY, so a put sent the long way takes the ids it would have."""
        if len(msgs) == 1:
            msg = msgs[0]
            part = self._plain_parts(msg)
            if part is None:
                return None
            data, uniq_key = self._plain_record(*part)
            return PendingRecords(data, (len(data),), (msg.topic,), (msg.queue_id,), (_PLAIN_STORE_TS_POS,), (True,),
                                  (uniq_key,), True, [(msg.topic, msg.queue_id)])
        parts = list(map(self._plain_parts, msgs))
        if None in parts:
            return None
        records = [self._plain_record(*part) for part in parts]
        checks: dict[str, int] = {}
        for msg in msgs:
            checks[msg.topic] = max(checks.get(msg.topic, 0), msg.queue_id)
        n = len(msgs)
        return PendingRecords(bytearray(b"".join([data for data, _ in records])), [len(data) for data, _ in records],
                              [m.topic for m in msgs], [m.queue_id for m in msgs], [_PLAIN_STORE_TS_POS] * n,
                              [True] * n, [uniq_key for _, uniq_key in records], True, list(checks.items()))

    def _plain_record(self, size: int, body: bytes, topic_bytes: bytes, queue_id: int, flag: int, born_ts: int,
                      born_host: bytes, tail: bytes) -> tuple[bytearray, str]:
        """The record of ``_plain_parts``' answer, with the next UNIQ_KEY: (record, UNIQ_KEY)."""
        uniq_key = self.uniq_keys.next()
        data = encode_v4_record(size, zlib.crc32(body) & 0x7FFFFFFF, queue_id, flag, 0, born_ts, born_host,
                                self.store_host_raw, body, topic_bytes,
                                f"{_UNIQ_KEY_PREFIX}{uniq_key}\x02".encode("ascii") + tail)
        if len(data) != size:  # the id's length disagrees with head_hex_len: a bug, never a wrong TOTALSIZE
            raise AssertionError(f"a {len(data)}-byte record sized {size}")
        return data, uniq_key

    def _plain_parts(self, msg: Message) -> tuple | None:
        """What ``_encode_plain_few`` needs of a plain message, checked as ``encode`` checks it (size, body,
        topic bytes, queue id, flag, born time, born host, the properties after UNIQ_KEY), or None."""
        if type(msg) is not Message or msg.properties:
            return None
        topic, body, queue_id, flag = msg.topic, msg.body, msg.queue_id, msg.flag
        sys_flag, reconsume, prepared = msg.sys_flag, msg.reconsume_times, msg.prepared_transaction_offset
        if not (type(topic) is str and type(body) is bytes and type(queue_id) is int and type(flag) is int
                and type(sys_flag) is int and type(reconsume) is int and type(prepared) is int
                and not (sys_flag or reconsume or prepared) and 0 <= queue_id <= _INT32[1]
                and _INT32[0] <= flag <= _INT32[1] and len(body) <= self.config.max_message_size):
            return None
        topic_bytes = self._v1_topics.get(topic)
        if topic_bytes is None or self.config.enabled_append_prop_crc:
            return None
        born_ts, host = msg.born_timestamp, msg.born_host
        if born_ts is None:
            born_ts = time.time_ns() // 1_000_000
        elif not (type(born_ts) is int and _BORN_TIME[0] <= born_ts <= _BORN_TIME[1]):
            return None
        if host is None:
            born_host = self.store_host_raw
        else:
            known = self._born_hosts.get(host) if type(host) is str else None
            if known is None or known[1]:  # not seen yet, or IPv6: ``encode`` parses it
                return None
            born_host = known[0]
        tags, keys = msg.tags, msg.keys
        text = ""
        if tags:
            if type(tags) is not str or "\x01" in tags or "\x02" in tags:
                return None
            text = f"{_TAGS_PREFIX}{tags}\x02"
        elif tags is not None and tags != "":
            return None
        if keys:
            if type(keys) is not list or len(keys) != 1:
                return None
            key = keys[0]
            if type(key) is not str or not key or KEY_SEPARATOR in key or "\x01" in key or "\x02" in key:
                return None
            text += f"{_KEYS_PREFIX}{key}\x02"
        elif type(keys) not in _KEY_TYPES:
            return None
        try:
            tail = text.encode("utf-8")
        except UnicodeEncodeError:
            return None
        props_len = _UNIQ_KEY_FIELD_LEN + self.uniq_keys.head_hex_len + len(tail)
        size = _PLAIN_FIXED_LEN + len(body) + len(topic_bytes) + props_len
        if props_len > MAX_PROPERTIES_LEN or size > self.max_record_len:
            return None
        return size, body, topic_bytes, queue_id, flag, born_ts, born_host, tail

    def _encode_plain(self, msgs: list[Message]) -> PendingRecords | None:
        """``encode_many`` for puts that need none of ``encode``'s rarer rules, or None (nothing taken).

        The messages are read column by column and every check is a C loop over a column (``map``, ``set``,
        ``min``/``max``, ``in`` on a joined text): a per-message Python loop of the same checks was half of
        ``put_messages(32)``."""
        encode_plain = self._encode_plain_v1
        if encode_plain is None:  # numba loads on the first put, not when the CLI imports the store
            from .codec._kernels import encode_plain_v1 as encode_plain

            self._encode_plain_v1 = encode_plain
        n = len(msgs)
        if set(map(type, msgs)) != _MESSAGE_TYPE:
            return None
        # a comprehension reads the fields 2.4x faster than ``operator.attrgetter`` (specialised attribute loads)
        (topics, bodies, queue_ids, flags, borns, hosts, tags, keys, user, sys_flags, reconsumes,
         prepareds) = zip(*[(m.topic, m.body, m.queue_id, m.flag, m.born_timestamp, m.born_host, m.tags, m.keys,
                             m.properties, m.sys_flag, m.reconsume_times, m.prepared_transaction_offset) for m in msgs],
                          strict=True)
        if any(user) or any(sys_flags) or any(reconsumes) or any(prepareds) \
                or set(map(type, queue_ids + flags + sys_flags + reconsumes + prepareds)) != _INT_TYPE:
            return None
        if min(queue_ids) < 0 or max(queue_ids) > _INT32[1] or min(flags) < _INT32[0] or max(flags) > _INT32[1]:
            return None
        if set(map(type, topics)) != _STR_TYPE:
            return None
        row_topics = list(map(self._v1_topics.get, topics))
        if None in row_topics or set(map(type, bodies)) != _BYTES_TYPE:
            return None
        body_len = list(map(len, bodies))
        if max(body_len) > self.config.max_message_size:
            return None
        now = time.time_ns() // 1_000_000
        if borns.count(None) == n:
            borns = [now] * n
        else:
            borns = [now if born is None else born for born in borns]
            if set(map(type, borns)) != _INT_TYPE or min(borns) < _BORN_TIME[0] or max(borns) > _BORN_TIME[1]:
                return None
        if hosts.count(None) == n:
            host_data = self.store_host_raw * n
        else:
            raw_hosts = []
            for host in hosts:
                known = self._store_host_pair if host is None else \
                    self._born_hosts.get(host) if type(host) is str else None
                if known is None or known[1]:  # not seen yet, or IPv6: ``encode`` parses it
                    return None
                raw_hosts.append(known[0])
            host_data = b"".join(raw_hosts)
        # TAGS and KEYS as ``encode`` checks them: a text property without \x01 or \x02; keys non-empty, no space
        tag_types = set(map(type, tags))
        if not tag_types <= _TAG_TYPES:
            return None
        if type(None) in tag_types:
            tags = [tag or "" for tag in tags]
        tags_text = _join(tags)
        if _has_separator(tags_text) or (tags_run := _utf8_run(tags_text, tags)) is None:
            return None
        tags_data, tag_len = tags_run
        key_types = set(map(type, keys))
        if not key_types <= _KEY_TYPES:
            return None
        if type(None) in key_types:
            keys = [key or () for key in keys]
        every_key = list(itertools.chain.from_iterable(keys))
        if every_key and (set(map(type, every_key)) != _STR_TYPE or "" in every_key
                          or _has_separator(key_text := _join(every_key)) or KEY_SEPARATOR in key_text):
            return None
        joined = list(map(KEY_SEPARATOR.join, keys))
        if (keys_run := _utf8_run(_join(joined), joined)) is None:
            return None
        keys_data, key_len = keys_run
        reserve = CRC32_RESERVED_LEN if self.config.enabled_append_prop_crc else 0
        head_len = self.uniq_keys.head_hex_len
        props_most = _PLAIN_PROPS_FIXED + head_len + reserve + 2 * _PLAIN_PROP_OVERHEAD + max(tag_len) + max(key_len)
        if props_most > MAX_PROPERTIES_LEN:
            return None  # some properties string may be too long: ``encode`` names it

        codes = dict.fromkeys(topics)
        topic_bytes = [self._v1_topics[topic] for topic in codes]
        topic_len = list(map(len, topic_bytes))
        if _PLAIN_FIXED_LEN + max(body_len) + max(topic_len) + props_most > self.max_record_len:
            return None  # some record may be too large: ``encode`` names it
        k = len(codes)
        row_codes = [0] * n if k == 1 else list(map(dict(zip(codes, range(k), strict=True)).__getitem__, topics))
        block = self.uniq_keys.hex_block(n, now)
        if block is None:  # the ids' counter wraps within this put: ``encode`` times each id (rare)
            return None
        head, first = block
        head_data = head.encode("ascii")
        if len(head_data) != head_len:
            raise AssertionError(f"a UNIQ_KEY head of {len(head_data)} characters, not {head_len}")
        props_total = (n * (_PLAIN_PROPS_FIXED + head_len + reserve) + len(tags_data) + len(keys_data)
                       + _PLAIN_PROP_OVERHEAD * (2 * n - tag_len.count(0) - key_len.count(0)))
        total = _PLAIN_FIXED_LEN * n + sum(body_len) + sum(map(len, row_topics)) + props_total
        out = scratch(total)  # this thread's buffer: the records live until the append copies them
        meta = np.empty(8 * n + 2 * k + 3, dtype=np.int64)
        _int64s(7 * n + k + 3).pack_into(meta, 0, *body_len, *tag_len, *key_len, *row_codes, *queue_ids, *flags,
                                         *borns, *topic_len, first, reserve, head_len)
        blob = b"".join([*bodies, tags_data, keys_data, *topic_bytes, host_data, self.store_host_raw, head_data])
        written = encode_plain(np.frombuffer(out, dtype=np.uint8), meta, np.frombuffer(blob, dtype=np.uint8), n, k)
        if written != total:  # the lengths above disagree with the pieces: a bug, never a torn record
            raise AssertionError(f"encoded {written} bytes for records whose pieces add up to {total}")
        sizes = meta[7 * n + k + 3 : 8 * n + k + 3]
        return PendingRecords(out, sizes.tolist(), topics, queue_ids, _plain_ts_pos(n), [True] * n,
                              UniqKeyRun(head, first, n), True,
                              list(zip(codes, meta[8 * n + k + 3 :].tolist(), strict=True)), size_array=sizes)

    def _learn_topic(self, topic: str, system: bool = False) -> tuple[bytes, int]:
        """Validate a topic once: its UTF-8 bytes and the record version it needs. System topics are never
        remembered: the store's services name them each time, and a send to one is refused each time."""
        validate_topic(topic)
        if not system:
            check_sendable(topic)
        topic_bytes = topic.encode("utf-8")
        version = MAGIC_V1
        if self.config.auto_message_version_on_topic_len and len(topic) > MAX_TOPIC_LEN_V1:
            version = MAGIC_V2
        elif len(topic_bytes) > MAX_TOPIC_LEN_V1:
            raise InvalidTopicError("topic longer than 127 bytes needs auto_message_version_on_topic_len")
        if len(self._topics) < 65536 and topic not in NOT_SENDABLE_TOPICS:
            self._topics[topic] = (topic_bytes, version)
            if version == MAGIC_V1:
                self._v1_topics[topic] = topic_bytes
        return topic_bytes, version

    def _born_host(self, host: object) -> tuple[bytes, int]:
        """(raw bytes, sysflag bit) of a born host, parsed once per distinct value."""
        known = self._born_hosts.get(host)
        if known is None:
            parsed = Host.parse(host)
            known = parsed.to_bytes(), SysFlag.BORNHOST_V6 if parsed.is_ipv6 else 0
            if len(self._born_hosts) < 4096:
                self._born_hosts[host] = known
        return known

    def _plain_properties(self, tags: object, keys: object) -> dict[str, str]:
        """TAGS, KEYS and a new UNIQ_KEY for a message without user properties."""
        properties: dict[str, str] = {}
        if tags is not None and tags != "":
            if type(tags) is not str or "\x01" in tags or "\x02" in tags:
                check_property(PropertyName.TAGS, tags)  # raises
            properties[PropertyName.TAGS] = tags  # type: ignore[assignment]
        if keys:
            if type(keys) is list and len(keys) == 1 and type(keys[0]) is str:
                joined = keys[0]
                if not joined or KEY_SEPARATOR in joined or "\x01" in joined or "\x02" in joined:
                    joined = self._joined_keys(keys)
            else:
                joined = self._joined_keys(key_list(keys))
            if joined:
                properties[PropertyName.KEYS] = joined
        properties[PropertyName.UNIQ_KEY] = self.uniq_keys.next()
        return properties

    @staticmethod
    def _joined_keys(keys: list[str]) -> str:
        for key in keys:
            if not isinstance(key, str) or not key or KEY_SEPARATOR in key:
                raise InvalidPropertyError(f"key {key!r} is empty or contains a space (the KEYS separator)")
        joined = KEY_SEPARATOR.join(keys)
        if joined:
            check_property(PropertyName.KEYS, joined)
        return joined

    def schedule(self, topic: str, queue_id: int, properties: dict[str, str], sys_flag: int = 0
                 ) -> tuple[str, int]:
        """Where a delayed message waits (``CommitLog.asyncPutMessage``, ``HookUtils.handleScheduleMessage``):
        a DELAY level sends it to SCHEDULE_TOPIC_XXXX, queue level-1 (a level past the last is the last); a
        TIMER_DELIVER_MS (or TIMER_DELAY_SEC/MS) in the future to rmq_sys_wheel_timer, queue 0. Its real
        topic and queue are kept in REAL_TOPIC/REAL_QID. A delivery time already past stores it as it is. A
        prepared or rolled-back transaction record is never parked (RocketMQ parks only the NOT and COMMIT types)."""
        if topic in PARKED_TOPICS or sys_flag & SysFlag.TRANSACTION_PREPARED_TYPE:  # PREPARED's and ROLLBACK's bit
            return topic, queue_id
        raw = properties.get(PropertyName.DELAY)
        if raw is not None:
            level = java_integer(raw, 32)
            if level is None:
                raise InvalidPropertyError(f"DELAY must be a delay level (an integer), not {raw!r}")
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
            value = java_integer(raw, 64)
            if value is None:
                raise IllegalDeliveryTimeError(f"{name} must be an integer, not {raw!r}")
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
                       uniq_key: str | None = None, *, system: bool = False) -> dict[str, str]:
        """User properties plus TAGS, KEYS and a UNIQ_KEY (``uniq_key``, or generated, when the message has
        none). Shared by the per-message and the batch encoder, so their properties strings agree."""
        if not isinstance(user, dict):
            raise InvalidPropertyError("properties must be a dict of str to str")
        if not system and not _MULTI_DISPATCH.isdisjoint(user):  # a broker's own delivery may carry them
            raise InvalidPropertyError("INNER_MULTI_DISPATCH/INNER_MULTI_QUEUE_OFFSET ask for LMQ multi-dispatch, "
                                       "which rocketstore does not do: the message would reach none of its LMQ "
                                       "queues")
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
            joined = self._joined_keys(keys)
            if properties.get(PropertyName.KEYS, joined) != joined:
                raise InvalidPropertyError("KEYS given both as keys= and in properties, with different values")
            properties[PropertyName.KEYS] = joined
        if PropertyName.UNIQ_KEY not in properties:
            properties[PropertyName.UNIQ_KEY] = uniq_key or self.uniq_keys.next()
        return properties


"""Messages as users see them: ``Message`` going in, ``MessageExt`` coming out, and put results."""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .codec.hosts import Host
from .codec.properties import (
    KEY_SEPARATOR,
    NAME_VALUE_SEPARATOR,
    PROPERTY_SEPARATOR,
    PropertyName,
    decode_properties,
    property_value,
    split_keys,
)

_KEYS_FIRST = f"{PropertyName.KEYS}{NAME_VALUE_SEPARATOR}"  # KEYS as the first pair of a properties text
_KEYS_MARKER = PROPERTY_SEPARATOR + _KEYS_FIRST  # ... or a later one

class SysFlag:
    """Bits of the record's SYSFLAG field (``MessageSysFlag``)."""

    COMPRESSED = 0x1
    MULTI_TAGS = 0x2
    TRANSACTION_NOT_TYPE = 0x0
    TRANSACTION_PREPARED_TYPE = 0x4
    TRANSACTION_COMMIT_TYPE = 0x8
    TRANSACTION_ROLLBACK_TYPE = 0xC
    TRANSACTION_MASK = 0xC
    BORNHOST_V6 = 0x10
    STOREHOST_V6 = 0x20
    NEED_UNWRAP = 0x40
    INNER_BATCH = 0x80
    COMPRESSION_TYPE_MASK = 0x700
    COMPRESSION_LZ4 = 0x100
    COMPRESSION_ZSTD = 0x200
    COMPRESSION_ZLIB = 0x300
    KNOWN_BITS = 0x7FF

    @staticmethod
    def transaction_type(sys_flag: int) -> int:
        return sys_flag & SysFlag.TRANSACTION_MASK


@dataclass(slots=True)
class Message:
    """A message to put. ``keys`` is a list of keys, or one string of space-separated keys as in RocketMQ.

    ``properties`` are user properties; ``tags`` and ``keys`` become the TAGS and KEYS properties.
    The remaining fields default to what a producer on this host would send.
    """

    topic: str
    body: bytes
    tags: str | None = None
    keys: Sequence[str] | str = ()
    properties: dict[str, str] | None = None
    queue_id: int = 0
    flag: int = 0
    sys_flag: int = 0
    born_timestamp: int | None = None  # default: the store time
    born_host: Host | str | None = None  # default: the store host
    reconsume_times: int = 0
    prepared_transaction_offset: int = 0

    def key_list(self) -> list[str]:
        if isinstance(self.keys, str):
            return split_keys(self.keys)
        return list(self.keys)


_EXT_FIELDS = ("topic", "body", "queue_id", "flag", "queue_offset", "commit_log_offset", "sys_flag", "born_timestamp",
               "born_host", "store_timestamp", "store_host", "reconsume_times", "prepared_transaction_offset",
               "body_crc", "properties", "store_size", "msg_id")


class MessageExt:
    """A stored message, decoded. Field names follow RocketMQ's ``MessageExt`` in snake_case.

    ``msg_id`` is the offset message id (store host + commit-log offset), as ``MessageDecoder``
    sets it (made from those two when first read if given as None: a key query builds messages whose id
    nobody reads); ``uniq_key`` is the producer's id (what consumers call msgId).

    ``properties`` may be given as the record's properties text: it is parsed on first use, and ``keys``,
    ``tags`` and ``uniq_key`` read their one value from the text until then (a key query checks KEYS of every
    candidate; building the map was a tenth of its time). Otherwise a plain record: equality over every field,
    ``replace`` for a changed copy (as ``dataclasses.replace``).
    """

    __slots__ = ("_msg_id", "_properties", "body", "body_crc", "born_host", "born_timestamp", "commit_log_offset",
                 "flag", "magic_code", "prepared_transaction_offset", "queue_id", "queue_offset", "reconsume_times",
                 "store_host", "store_size", "store_timestamp", "sys_flag", "topic")
    __match_args__ = _EXT_FIELDS
    __hash__ = None  # type: ignore[assignment]  # mutable, compared by value

    def __init__(self, topic: str, body: bytes, queue_id: int, flag: int, queue_offset: int, commit_log_offset: int,
                 sys_flag: int, born_timestamp: int, born_host: Host, store_timestamp: int, store_host: Host,
                 reconsume_times: int, prepared_transaction_offset: int, body_crc: int,
                 properties: dict[str, str] | str, store_size: int, msg_id: str | None, magic_code: int = 0) -> None:
        self.topic = topic
        self.body = body
        self.queue_id = queue_id
        self.flag = flag
        self.queue_offset = queue_offset
        self.commit_log_offset = commit_log_offset
        self.sys_flag = sys_flag
        self.born_timestamp = born_timestamp
        self.born_host = born_host
        self.store_timestamp = store_timestamp
        self.store_host = store_host
        self.reconsume_times = reconsume_times
        self.prepared_transaction_offset = prepared_transaction_offset
        self.body_crc = body_crc
        self._properties = properties
        self.store_size = store_size
        self._msg_id = msg_id
        self.magic_code = magic_code

    @property
    def msg_id(self) -> str:
        msg_id = self._msg_id
        if msg_id is None:
            raw = self.store_host.to_bytes() + self.commit_log_offset.to_bytes(8, "big", signed=True)
            msg_id = self._msg_id = raw.hex().upper()
        return msg_id

    @msg_id.setter
    def msg_id(self, value: str) -> None:
        self._msg_id = value

    @property
    def properties(self) -> dict[str, str]:
        props = self._properties
        if type(props) is str:
            props = self._properties = decode_properties(props)
        return props

    @properties.setter
    def properties(self, value: dict[str, str]) -> None:
        self._properties = value

    def get_property(self, name: str) -> str | None:
        """One property's value (Java's ``getProperty``), read from the text if the map is not built yet."""
        props = self._properties
        return property_value(props, name) if type(props) is str else props.get(name)

    def has_key(self, key: str) -> bool:
        """Whether ``key`` is one of the KEYS tokens (``key in keys``, without the list for a single key)."""
        props = self._properties  # property_value, inline: a key query asks this of every candidate
        if type(props) is str:
            at = props.rfind(_KEYS_MARKER)  # the last KEYS pair's value, as the map keeps the last
            if at >= 0:
                start = at + len(_KEYS_MARKER)
            elif props.startswith(_KEYS_FIRST):
                start = len(_KEYS_FIRST)
            else:
                return False
            end = props.find(PROPERTY_SEPARATOR, start)
            keys = props[start:] if end < 0 else props[start:end]
            if not keys:  # an empty last value: the map's answer (an earlier pair's, or none)
                keys = decode_properties(props).get(PropertyName.KEYS)
        else:
            keys = props.get(PropertyName.KEYS)
        if keys is None:
            return False
        return (keys == key and KEY_SEPARATOR not in key) or key in split_keys(keys)

    @property
    def keys(self) -> list[str]:
        return split_keys(self.get_property(PropertyName.KEYS))

    @property
    def tags(self) -> str | None:
        return self.get_property(PropertyName.TAGS)

    @property
    def uniq_key(self) -> str | None:
        return self.get_property(PropertyName.UNIQ_KEY)

    def replace(self, **changes: Any) -> MessageExt:
        """A copy with ``changes`` (``dataclasses.replace``)."""
        unknown = set(changes) - set(_EXT_FIELDS) - {"magic_code"}
        if unknown:
            raise TypeError(f"MessageExt has no field {sorted(unknown)[0]!r}")
        values = {name: getattr(self, name) for name in (*_EXT_FIELDS, "magic_code")}
        values.update(changes)
        return MessageExt(**values)

    def _values(self) -> tuple:
        return (*(getattr(self, name) for name in _EXT_FIELDS), self.magic_code)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._values() == other._values()  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return f"MessageExt({', '.join(f'{name}={getattr(self, name)!r}' for name in _EXT_FIELDS)})"

    def __getstate__(self) -> tuple:
        return self._values()

    def __setstate__(self, state: tuple) -> None:
        MessageExt.__init__(self, *state)


class PutMessageStatus(enum.Enum):
    """RocketMQ's ``PutMessageStatus`` values that an embedded store can return.

    Illegal messages raise instead (see ``rocketstore.errors``): nothing is written for them.
    """

    PUT_OK = "PUT_OK"
    FLUSH_DISK_TIMEOUT = "FLUSH_DISK_TIMEOUT"


class PutMessageResult(NamedTuple):
    """The outcome of one put: where the message went. ``msg_id`` is the offset msgId.

    A tuple rather than a frozen dataclass: every put builds one per message, and a frozen
    dataclass's ``__init__`` costs an ``object.__setattr__`` per field (3x the whole construction)."""

    status: PutMessageStatus
    msg_id: str
    uniq_key: str | None
    commit_log_offset: int
    queue_offset: int
    store_timestamp: int
    store_size: int

    @property
    def ok(self) -> bool:
        return self.status is PutMessageStatus.PUT_OK


class PutResults(Sequence[PutMessageResult]):
    """The results of one ``put_messages``: a ``PutMessageResult`` per message, in order, made on first read.

    Building them (an offset msgId's hex and a tuple per message) was a sixth of a put of 32 messages whose
    results nobody read (``put_messages(32)`` 1.18-1.20x faster without it). Compares equal to the list."""

    __slots__ = ("_count", "_items", "_make")

    def __init__(self, count: int, make: Callable[[], list[PutMessageResult]]) -> None:
        self._count = count
        self._make = make  # kept: two threads reading a fresh result may both build it, with the same outcome
        self._items: list[PutMessageResult] | None = None

    def _list(self) -> list[PutMessageResult]:
        items = self._items
        if items is None:
            items = self._items = self._make()
        return items

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index):
        return self._list()[index]

    def __iter__(self) -> Iterator[PutMessageResult]:
        return iter(self._list())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PutResults):
            other = other._list()
        return self._list() == other if isinstance(other, list) else NotImplemented

    __hash__ = None  # type: ignore[assignment]  # like the list it stands for

    def __add__(self, other: object) -> list[PutMessageResult]:
        if isinstance(other, PutResults | list):
            return [*self._list(), *other]
        return NotImplemented

    def __radd__(self, other: object) -> list[PutMessageResult]:
        if isinstance(other, list):
            return [*other, *self._list()]
        return NotImplemented

    def __repr__(self) -> str:
        return repr(self._list())


@dataclass(frozen=True)
class PutBatchResult:
    """The outcome of ``put_batch``: one status for the table, and per row (in row order) where it went.

    Columns are numpy arrays (offsets, sizes) and Arrow string arrays (ids); ``to_arrow`` gives a table.
    The ids are hex-encoded on first use (it cost ~15% of a put of plain rows that nobody looked at).
    """

    status: PutMessageStatus
    commit_log_offsets: Any  # np.ndarray[int64]
    queue_offsets: Any  # np.ndarray[int64]
    store_sizes: Any  # np.ndarray[int64]
    store_timestamp: int
    make_msg_ids: Callable[[], Any] = field(repr=False, compare=False)
    make_uniq_keys: Callable[[], Any] = field(repr=False, compare=False)

    @functools.cached_property
    def msg_ids(self) -> Any:
        """pyarrow.StringArray: the offset msgIds (store host + commit-log offset)."""
        return self.make_msg_ids()

    @functools.cached_property
    def uniq_keys(self) -> Any:
        """pyarrow.StringArray: the UNIQ_KEYs (what consumers call msgId)."""
        return self.make_uniq_keys()

    def __len__(self) -> int:
        return len(self.commit_log_offsets)

    @property
    def ok(self) -> bool:
        return self.status is PutMessageStatus.PUT_OK

    def to_arrow(self):
        import pyarrow as pa

        return pa.table({"msgId": self.msg_ids, "uniqKey": self.uniq_keys,
                         "commitLogOffset": self.commit_log_offsets, "queueOffset": self.queue_offsets,
                         "storeSize": self.store_sizes})


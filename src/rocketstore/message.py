"""Messages as users see them: ``Message`` going in, ``MessageExt`` coming out, and put results."""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .codec.hosts import Host
from .codec.properties import PropertyName, split_keys


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


@dataclass(slots=True)
class MessageExt:
    """A stored message, decoded. Field names follow RocketMQ's ``MessageExt`` in snake_case.

    ``msg_id`` is the offset message id (store host + commit-log offset), as ``MessageDecoder``
    sets it; ``uniq_key`` is the producer's id (what consumers call msgId).
    """

    topic: str
    body: bytes
    queue_id: int
    flag: int
    queue_offset: int
    commit_log_offset: int
    sys_flag: int
    born_timestamp: int
    born_host: Host
    store_timestamp: int
    store_host: Host
    reconsume_times: int
    prepared_transaction_offset: int
    body_crc: int
    properties: dict[str, str]
    store_size: int
    msg_id: str
    magic_code: int = field(default=0, repr=False)

    @property
    def keys(self) -> list[str]:
        return split_keys(self.properties.get(PropertyName.KEYS))

    @property
    def tags(self) -> str | None:
        return self.properties.get(PropertyName.TAGS)

    @property
    def uniq_key(self) -> str | None:
        return self.properties.get(PropertyName.UNIQ_KEY)


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


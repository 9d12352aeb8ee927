"""The exception tree: every failure rocketstore reports is one of these.

Bad input raises before anything is written, so catching a ``RocketStoreError`` from a put
means the store is unchanged. Errors about stored data carry the file and the byte offset,
because an operator has to be able to go and look.
"""

from __future__ import annotations


class RocketStoreError(Exception):
    """Base of all rocketstore errors."""


class ConfigError(RocketStoreError, ValueError):
    """A ``StoreConfig`` value is out of range or inconsistent with the files on disk."""


class ConfigFileError(ConfigError):
    """A file of ``config/`` (topics.json, consumerOffset.json, ...) cannot be used: unreadable bytes, bad JSON,
    or a field that is not what RocketMQ writes there. ``path`` names the file, ``field`` the dotted field
    (empty when the whole document is bad) and ``reason`` what was found."""

    def __init__(self, reason: str, path: str | None = None, field: str = "") -> None:
        self.reason = reason
        self.path = path
        self.field = field
        where = f"{path}: " if path is not None else ""
        super().__init__(f"{where}{field} {reason}" if field else f"{where}{reason}")


class StoreLockedError(RocketStoreError):
    """Another writer (a rocketstore process or a RocketMQ broker) holds the store's lock file."""


class StoreClosedError(RocketStoreError):
    """The store was used after ``close()``."""


class ReadOnlyStoreError(RocketStoreError):
    """A write was attempted on a store opened with ``read_only=True``."""


class UnsupportedLayoutError(RocketStoreError):
    """The store holds what a RocketMQ broker feature keeps and rocketstore does not manage (LMQ queues, BatchCQ
    topics, consume queues in RocksDB; see ``brokerlayout``): refused before anything is changed."""


class StoreIOError(RocketStoreError, OSError):
    """The operating system refused an operation (disk full, permissions, read-only file system).

    Raised after the store has put itself back into a consistent state: nothing partial is visible (one
    exception says what was stored: ``TablePartlyStoredError``).
    """


class TablePartlyStoredError(StoreIOError):
    """The operating system failed a table larger than a segment after its first parts were written (an EIO, a
    failed roll): rows ``0..stored-1`` are in the log, visible and dispatched, as a crash there would leave them;
    the rest were not written. ``result`` is the ``PutBatchResult`` of the stored rows: put ``table[stored:]``
    to store the rest once, never the whole table again."""

    def __init__(self, code: int, message: str, stored: int, result: object = None) -> None:
        super().__init__(code, message)
        self.stored = stored
        self.result = result


class StoreNotVisibleError(StoreIOError):
    """A Spark executor cannot see a store the driver planned over: it is not mounted at the same path there."""


class FlushError(StoreIOError):
    """An msync or fsync failed: bytes the store wrote may never reach the disk, whatever a retry reports."""


class StoreFailedError(StoreIOError):
    """The store has stopped accepting writes because a write it had already made could not be made durable.

    After a failed msync/fsync the kernel may have dropped the dirty pages (PostgreSQL's "fsyncgate"):
    retrying the flush would report success for bytes that never reached the disk. The store therefore
    fails stop: every later put raises this until the store is closed and reopened, so that recovery
    re-validates the log from what is really on disk.
    """


class DispatchFailedError(StoreIOError):
    """Consume queues or the index could not be written (RocketMQ's LOGIC_QUEUE_ERROR / INDEX_ERROR).

    Puts are refused while the dispatcher fails, so nothing is acknowledged that consumers cannot see;
    writes resume once a dispatch round succeeds again.
    """


# --- bad messages -----------------------------------------------------------------------------

class StoredButNotClosedError(StoreIOError):
    """Work that writes (an import) stored all it had to and only closing the store failed: doing it again would
    store it twice. ``done`` is the work's report; the store's next open recovers."""

    def __init__(self, message: str, done: object = None) -> None:
        super().__init__(message)
        self.done = done


class MessageIllegalError(RocketStoreError, ValueError):
    """A message RocketMQ would reject with MESSAGE_ILLEGAL; nothing was written."""


class MessageTooLargeError(MessageIllegalError):
    """The body or the whole record exceeds ``max_message_size`` or does not fit a segment."""


class PropertiesTooLargeError(MessageIllegalError):
    """The encoded properties exceed 32767 bytes (RocketMQ's PROPERTIES_SIZE_EXCEEDED)."""


class InvalidTopicError(MessageIllegalError):
    """The topic name is empty, too long, has characters RocketMQ forbids, or names a system topic."""


class InvalidPropertyError(MessageIllegalError):
    """A property name or value is empty or contains a separator (\\x01 or \\x02)."""


class IllegalDeliveryTimeError(InvalidPropertyError):
    """A timer message's TIMER_DELIVER_MS (or TIMER_DELAY_SEC/MS) is not a number or lies further ahead than
    ``timer_max_delay_sec`` (RocketMQ's WHEEL_TIMER_MSG_ILLEGAL)."""


class TopicNotExistError(MessageIllegalError):
    """The topic is not configured and ``auto_create_topic_enable`` is off (RocketMQ's TOPIC_NOT_EXIST)."""


class InvalidQueueError(MessageIllegalError):
    """The queue id is not below the topic's write queue count, or the topic is not writable."""


class TopicNotWritableError(InvalidQueueError):
    """The topic's perm forbids writes now (an operator's setting, which may change: not a refusal for good)."""


class InvalidFlagError(MessageIllegalError):
    """A flag, sysflag or numeric field does not fit its on-disk width or sets unknown bits."""


# --- lookups ------------------------------------------------------------------------------------

class MessageNotFoundError(RocketStoreError, LookupError):
    """No message exists where one was asked for."""


class OffsetOutOfRangeError(MessageNotFoundError):
    """A commit-log offset lies outside the store's ``[min_phy_offset, max_phy_offset)``."""


class SegmentDeletedError(OffsetOutOfRangeError):
    """Retention deleted the file a read was using while it read: the message is gone, not damaged."""


class InvalidQueryError(RocketStoreError, ValueError):
    """A lookup asked with arguments that do not form a query (e.g. a pair that is not two strings)."""


class InvalidMessageIdError(RocketStoreError, ValueError):
    """A message id or UNIQ_KEY string is not of RocketMQ's form."""


# --- damaged data -------------------------------------------------------------------------------

class CorruptDataError(RocketStoreError):
    """Stored bytes do not decode; ``path`` and ``offset`` say where, ``reason`` says what was found."""

    def __init__(self, reason: str, path: str | None = None, offset: int | None = None) -> None:
        self.reason = reason
        self.path = path
        self.offset = offset
        where = ""
        if path is not None:
            where += f" in {path}"
        if offset is not None:
            where += f" at offset {offset}"
        super().__init__(f"{reason}{where}")


class BadMagicError(CorruptDataError):
    """The record's magic code is none of V1, V2 or BLANK."""


class ChecksumError(CorruptDataError):
    """A body CRC or a record CRC (``__CRC32#``) does not match the stored bytes."""


class TruncatedRecordError(CorruptDataError):
    """A length field points past the end of the available bytes, or disagrees with the others."""


class MisplacedRecordError(CorruptDataError):
    """A well-formed record whose PHYSICALOFFSET field names another place in the log: a stale or copied
    record, not one written here (every reader refuses it, so recovery ends the log before it)."""


class DamagedLogError(CorruptDataError):
    """A scan's read-only recovery ended a commit log at damage with intact records after it: reading the log to
    that end would silently leave them out (``onCorrupt=skip`` does, and says how much)."""


class UnsupportedFormatError(CorruptDataError):
    """Well-formed data this build cannot read (for example an LZ4 body without the lz4 package)."""

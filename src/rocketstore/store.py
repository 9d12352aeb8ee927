"""``MessageStore``: the embedded store's public face (RocketMQ's ``DefaultMessageStore``).

It only wires the parts together: lock and abort files, commit log, checkpoint, recovery and
flushing. Opening read-only takes no lock and writes nothing, so it is safe on a live broker's
files; it sees the log as it was when opened.
"""

from __future__ import annotations

import logging
import struct
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

from .checkpoint import StoreCheckpoint
from .codec.record import RecordLayout
from .commitlog import CommitLog
from .config import FlushDiskType, StoreConfig
from .encoder import MessageEncoder, PendingRecord
from .errors import ReadOnlyStoreError, RocketStoreError, StoreClosedError, StoreIOError
from .flush import CommitLogFlusher
from .lifecycle import AbortFile, StoreLock
from .mapped.file import MappedFile
from .message import Message, MessageExt, PutMessageResult, PutMessageStatus, SysFlag
from .recovery import RecoveryReport, recover_commit_log

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint"
_QUEUE_FIELDS = struct.Struct(">iiq")  # queue id, flag, queue offset at record position 12


class StoreNotFoundError(RocketStoreError, FileNotFoundError):
    """A read-only open of a directory that holds no store."""


class MessageStore:
    """A RocketMQ-format message store in a directory. Use ``MessageStore.open``."""

    def __init__(self, root: Path, config: StoreConfig, read_only: bool) -> None:
        self.root = root
        self.config = config
        self.read_only = read_only
        self._closed = False
        self._lock: StoreLock | None = None
        self._abort = AbortFile(root)
        self.encoder = MessageEncoder(config)
        self.commit_log = CommitLog(root, config, read_only=read_only)
        self.checkpoint = StoreCheckpoint(root / CHECKPOINT_FILE, read_only=read_only)
        self.flusher: CommitLogFlusher | None = None
        self.recovery: RecoveryReport | None = None
        self._close_lock = threading.Lock()

    # --- lifecycle ---------------------------------------------------------------------------

    @classmethod
    def open(cls, root: str | Path, config: StoreConfig | None = None, read_only: bool = False) -> MessageStore:
        """Open (creating if needed) the store rooted at ``root``.

        A writer takes the ``lock`` file (``StoreLockedError`` if another writer has it), runs
        recovery (abnormal if an ``abort`` file says the last run crashed) and starts flushing.
        """
        root = Path(root).expanduser()
        store = cls(root, config or StoreConfig(), read_only)
        try:
            store._start()
        except BaseException:
            store._release()
            raise
        return store

    def _start(self) -> None:
        if self.read_only:
            if not (self.root / "commitlog").is_dir():
                raise StoreNotFoundError(f"{self.root} holds no store (no commitlog directory)")
        else:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StoreIOError(exc.errno, f"cannot create store root {self.root}: {exc.strerror}") from exc
            self._lock = StoreLock(self.root)
            self._lock.acquire()
        abnormal = self._abort.exists()
        self.commit_log.load()
        self.checkpoint = StoreCheckpoint.load(self.root / CHECKPOINT_FILE, read_only=self.read_only)
        table: dict[tuple[str, int], int] = {}
        self.recovery = recover_commit_log(self.commit_log, self.checkpoint, self.root, abnormal=abnormal,
                                           visit=_queue_offset_visitor(table))
        self.commit_log.queue_offsets = table
        self.commit_log.last_store_timestamp = self._last_store_timestamp()
        if not self.read_only:
            self._abort.create()
            self.flusher = CommitLogFlusher(self.commit_log, self.checkpoint, self.config)
            self.flusher.start()

    def _last_store_timestamp(self) -> int:
        end = self.commit_log.max_offset
        if end <= self.commit_log.min_offset:
            return 0
        last = None
        mapped = self.commit_log.mapped_files.last
        if mapped is not None:
            for last in self.commit_log.iter_layouts(mapped.file_from_offset, check_crc=False):  # noqa: B007
                pass
        if last is None:
            return 0
        mapped, pos, layout = last
        ts_pos = pos + 48 + (20 if layout.sys_flag & SysFlag.BORNHOST_V6 else 8)
        return int.from_bytes(mapped.buffer[ts_pos : ts_pos + 8], "big", signed=True)

    def close(self) -> None:
        """Flush everything, delete the abort file and release the lock. Safe to call twice."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            try:
                if not self.read_only and self.flusher is not None:
                    self.flusher.shutdown()
                    self.checkpoint.flush()
                    self._abort.delete()
            finally:
                self._release()

    def _release(self) -> None:
        self.commit_log.close()
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def __enter__(self) -> MessageStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self, write: bool = False) -> None:
        if self._closed:
            raise StoreClosedError(f"store {self.root} is closed")
        if write and self.read_only:
            raise ReadOnlyStoreError(f"store {self.root} was opened read-only")

    # --- writes ------------------------------------------------------------------------------

    def put_message(self, msg: Message) -> PutMessageResult:
        """Store one message (``putMessage``). Illegal messages raise and write nothing."""
        return self.put_messages([msg])[0]

    def put_messages(self, msgs: Iterable[Message]) -> list[PutMessageResult]:
        """Store messages as one contiguous, all-or-nothing append (``putMessages``).

        Unlike a RocketMQ batch, the messages may go to different topics and queues; they share
        one store timestamp, one segment and, under SYNC_FLUSH, one disk flush.
        """
        self._check_open(write=True)
        records = [self.encoder.encode(m) for m in msgs]
        if not records:
            return []
        appended = self.commit_log.append(records)
        status = PutMessageStatus.PUT_OK
        if self.config.flush_disk_type is FlushDiskType.SYNC_FLUSH and any(r.wait_store for r in records):
            end = appended[-1].phy_offset + appended[-1].size
            assert self.flusher is not None
            if not self.flusher.wait_flushed(end):
                status = PutMessageStatus.FLUSH_DISK_TIMEOUT
        return [_result(status, rec, res, self.encoder.store_host_raw) for rec, res in zip(records, appended,
                                                                                              strict=True)]

    def flush(self) -> int:
        """Force everything written so far to disk; returns the flushed commit-log offset."""
        self._check_open(write=True)
        assert self.flusher is not None
        return self.flusher.flush(0)

    # --- reads -------------------------------------------------------------------------------

    def look_message_by_offset(self, phy_offset: int, *, decompress: bool = False) -> MessageExt:
        """The message whose record starts at ``phy_offset`` (``lookMessageByOffset``).

        Raises ``OffsetOutOfRangeError`` outside the log, ``MessageNotFoundError`` when no record
        starts there, and ``ChecksumError`` when its body fails the CRC.
        """
        self._check_open()
        return self.commit_log.get_message(phy_offset, decompress=decompress)

    def iter_messages(self, from_offset: int | None = None, to_offset: int | None = None) -> Iterator[MessageExt]:
        """Every message in log order, from a record start (default: the oldest)."""
        self._check_open()
        return self.commit_log.iter_messages(from_offset, to_offset)

    @property
    def min_phy_offset(self) -> int:
        return self.commit_log.min_offset

    @property
    def max_phy_offset(self) -> int:
        return self.commit_log.max_offset

    @property
    def flushed_phy_offset(self) -> int:
        return self.commit_log.flushed_offset

    def next_queue_offset(self, topic: str, queue_id: int) -> int:
        """The queue offset the next message to (topic, queue_id) will get."""
        return self.commit_log.queue_offsets.get((topic, queue_id), 0)

    def __repr__(self) -> str:
        mode = "read-only" if self.read_only else "read-write"
        return f"MessageStore({str(self.root)!r}, {mode}, log=[{self.min_phy_offset}, {self.max_phy_offset}))"


def _result(status: PutMessageStatus, rec: PendingRecord, res, store_host_raw: bytes) -> PutMessageResult:
    msg_id = (store_host_raw + res.phy_offset.to_bytes(8, "big")).hex().upper()
    return PutMessageResult(status=status, msg_id=msg_id, uniq_key=rec.uniq_key, commit_log_offset=res.phy_offset,
                            queue_offset=res.queue_offset, store_timestamp=res.store_timestamp, store_size=res.size)


def _queue_offset_visitor(table: dict[tuple[str, int], int]):
    """Recovery visitor that rebuilds the next queue offset of each (topic, queue id)."""

    def visit(mapped: MappedFile, pos: int, layout: RecordLayout) -> None:
        if SysFlag.transaction_type(layout.sys_flag) in (SysFlag.TRANSACTION_PREPARED_TYPE,
                                                          SysFlag.TRANSACTION_ROLLBACK_TYPE):
            return
        buf = mapped.buffer
        queue_id, _flag, queue_offset = _QUEUE_FIELDS.unpack_from(buf, pos + 12)
        topic = bytes(buf[layout.topic_pos : layout.topic_pos + layout.topic_len]).decode("utf-8", "replace")
        table[(topic, queue_id)] = queue_offset + 1

    return visit

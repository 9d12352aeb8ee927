"""``MessageStore``: the embedded store's public face (RocketMQ's ``DefaultMessageStore``).

It only wires the parts together: lock and abort files, commit log, checkpoint, recovery and
flushing. Opening read-only takes no lock and writes nothing, so it is safe on a live broker's
files; it sees the log as it was when opened.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import logging
import os
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

from .brokerconfig import (
    MAX_QUEUE_NUMS,
    ConsumerOffsetManager,
    DelayOffsetManager,
    SubscriptionGroupManager,
    TimerOffsetManager,
    TopicConfigManager,
    checked,
    group_name,
)
from .brokerlayout import batch_cq_topics, check_not_dledger, check_writer_layout
from .checkpoint import StoreCheckpoint
from .codec.batch import validate_records
from .codec.msgid import create_offset_msg_id
from .codec.record import read_layout
from .commitlog import CommitLog
from .config import FlushDiskType, StoreConfig, detect_config
from .consumequeue import PRE_BLANK_SIZE, ConsumeQueue, ConsumeQueueTable
from .consumer import Consumer
from .dispatch import Dispatcher, dispatch_request
from .encoder import (
    PARKED_TOPICS,
    SCHEDULE_TOPIC,
    TIMER_TOPIC,
    MessageEncoder,
    PendingRecords,
    is_system_topic,
    validate_topic,
)
from .errors import (
    ConfigError,
    CorruptDataError,
    InvalidQueryError,
    InvalidQueueError,
    InvalidTopicError,
    MessageIllegalError,
    MessageNotFoundError,
    OffsetOutOfRangeError,
    ReadOnlyStoreError,
    RocketStoreError,
    SegmentDeletedError,
    StoreClosedError,
    StoreIOError,
    TablePartlyStoredError,
    TopicNotExistError,
    TopicNotWritableError,
)
from .flush import CommitLogFlusher
from .health import RepeatedErrorLog, StoreHealth
from .index.service import IndexService, check_geometry
from .lifecycle import AbortFile, RedispatchMarker, StoreLock, is_locked, start_thread
from .mapped.file import STAGING_DIR
from .message import Message, MessageExt, PutBatchResult, PutMessageResult, PutMessageStatus, PutResults, SysFlag
from .reads import GetMessageResult, StoreReader, check_int, check_str
from .recovery import RecoveryReport, recover_commit_log
from .retention import RetentionReport, delete_expired_files
from .schedule import ScheduleMessageService
from .sqlfilter import SqlFilter
from .swap import finish_staged, pending_swap

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint"


class StoreNotFoundError(RocketStoreError, FileNotFoundError):
    """A read-only open of a directory that holds no store."""


def _check_log_directory(root: Path, writer: bool = False) -> None:
    """Refuse a store whose ``commitlog`` is not there as a directory while the rest of the store is: a writer
    would take the log for empty and delete every consume queue and index file, and move every consumer group
    back to 0 (a symlinked log whose disk is not mounted, a file in its place). An empty ``commitlog``
    directory is a log that lost its segments, recovered as such; a root with no ``commitlog`` and nothing
    derived from one is a new store."""
    log_dir = root / "commitlog"
    if log_dir.is_symlink() and not log_dir.exists():
        raise StoreNotFoundError(errno.ENOENT, f"{log_dir} is a symlink to {os.readlink(log_dir)}, which does not "
                                 "exist (a disk not mounted?): refusing to open the store")
    if log_dir.exists() and not log_dir.is_dir():
        raise StoreNotFoundError(errno.ENOTDIR, f"{log_dir} is not a directory: refusing to open the store")
    if not log_dir.exists():
        check_not_dledger(root)  # its log is elsewhere: "create an empty commitlog" would be the wrong advice
    if writer and not log_dir.exists():
        derived = [name for name in ("consumequeue", "index") if _holds_files(root / name)]
        if derived:
            raise StoreNotFoundError(errno.ENOENT, f"{root} has no commitlog directory but has {' and '.join(derived)} "
                                     "files made from one (a log on a disk not mounted, a directory moved, a "
                                     "broker.conf's storePathCommitLog elsewhere?): refusing to open the store. "
                                     "Only to start it over with an empty log, dropping those queues and index "
                                     "files, create an empty commitlog directory")


def _entries_of_last_record(files: list, phy: int) -> int:
    """How many entries the record at ``phy``, the last one indexed, has at the end of the index files (its keys
    may span a file roll)."""
    count = 0
    for index in reversed(files[-2:]):
        n = index.index_count - 1
        while n >= 1 and index.entry(n)[1] == phy:
            count += 1
            n -= 1
        if n >= 1:
            break
    return count


def _holds_files(path: Path) -> bool:
    try:
        return any(files for _dir, _subdirs, files in os.walk(path))
    except OSError:
        return True  # unreadable: not known to be empty


def _closed_under(read: Callable) -> Callable:
    """A read racing ``close()`` meets unmapped files ("mmap closed or invalid") or none at all (a closed index
    holds no file: "no message"). Either way its answer cannot be trusted: once the store is closed, the read
    raises ``StoreClosedError``, as a call after ``close()`` does."""

    @functools.wraps(read)
    def guarded(self, *args, **kwargs):
        try:
            answer = read(self, *args, **kwargs)
        except Exception as exc:
            if self._closed and not isinstance(exc, StoreClosedError):
                raise StoreClosedError(f"store {self.root} was closed while {read.__name__} ran") from exc
            raise
        if self._closed:
            raise StoreClosedError(f"store {self.root} was closed while {read.__name__} ran")
        return answer

    return guarded


class MessageStore:
    """A RocketMQ-format message store in a directory. Use ``MessageStore.open``."""

    def __init__(self, root: Path, config: StoreConfig, read_only: bool,
                 index_clock: Callable[[], int] | None = None) -> None:
        self.root = root
        self._index_clock = index_clock
        self.config = config
        self.read_only = read_only
        self._closed = False
        self._lock: StoreLock | None = None
        self._abort = AbortFile(root)
        self.encoder = MessageEncoder(config)
        self._store_host_hex = self.encoder.store_host_raw.hex().upper()  # offset msgIds: this + the offset
        self._batch = None  # the column-wise encoder, made on the first put_batch (it imports pyarrow)
        self._scans: weakref.WeakSet = weakref.WeakSet()  # open scan_arrow iterators: their read-ahead holds views
        self._scans_lock = threading.Lock()
        self.health = StoreHealth()  # why puts are refused, if they are (RocketMQ's RunningFlags)
        self.commit_log = CommitLog(root, config, read_only=read_only, health=self.health)
        self.checkpoint = StoreCheckpoint(root / CHECKPOINT_FILE, read_only=read_only)
        self.queues = ConsumeQueueTable(root, config, read_only=read_only)
        self.topic_config = TopicConfigManager(root, read_only=read_only)
        self.consumer_offsets = ConsumerOffsetManager(root, read_only=read_only)
        self.delay_offsets = DelayOffsetManager(root, read_only=read_only)
        self.timer_offsets = TimerOffsetManager(root, read_only=read_only)
        self.subscription_groups = SubscriptionGroupManager(root, read_only=read_only)
        self.schedule: ScheduleMessageService | None = None
        self._topic_lock = threading.Lock()
        self._offset_resets: dict[tuple[str, str], int] = {}
        # a reset and a consumer's commit, each whole: a commit that checked for resets before one and wrote after it
        # undid the reset for good
        self.offsets_lock = threading.Lock()
        self.index: IndexService | None = None
        self.flusher: CommitLogFlusher | None = None
        self.dispatcher: Dispatcher | None = None
        self.reader: StoreReader | None = None
        self.recovery: RecoveryReport | None = None
        self.index_entries_repaired = 0
        self._close_lock = threading.Lock()
        self._stop = threading.Event()
        self._maintenance: threading.Thread | None = None
        self._logics_timestamp = 0
        self._derived_flush_failed = False  # a queue/index flush failed: the checkpoint no longer vouches
        self._queue_restart = -1  # where re-dispatch must start to rewrite queue tails found damaged
        self.queue_units_repaired = 0

    # --- lifecycle ---------------------------------------------------------------------------

    @classmethod
    def open(cls, root: str | Path, config: StoreConfig | None = None, read_only: bool = False, *,
             index_clock: Callable[[], int] | None = None) -> MessageStore:
        """Open (creating if needed) the store rooted at ``root``.

        A writer takes the ``lock`` file (``StoreLockedError`` if another writer has it), runs
        recovery (abnormal if an ``abort`` file says the last run crashed) and starts flushing.
        Without ``config``, an existing store opens with the geometry its files have (segment, queue file and
        index sizes, as the command line reads them: a broker's store need not use the defaults), else with
        ``StoreConfig()``'s. ``index_clock`` (ms) names new index files; it exists so that tests and rebuilds
        can produce reproducible names.
        """
        if not isinstance(root, str | os.PathLike):
            raise ConfigError(f"root must be a path (str or os.PathLike), not {root!r}")
        if config is not None and not isinstance(config, StoreConfig):
            raise ConfigError(f"config must be a StoreConfig, not {type(config).__name__}")
        root = Path(root).expanduser()
        if config is None:
            config = detect_config(root) if root.is_dir() else StoreConfig()
        for attempt in range(3):
            store = cls(root, config, read_only, index_clock)
            try:
                store._start()
            except SegmentDeletedError:
                store._abandon()
                if not read_only or attempt == 2:
                    raise
                continue  # a live writer's retention deleted a file this view was reading: open it as it is now
            except RocketStoreError:
                store._abandon()
                raise
            except OSError as exc:  # a file the open could not read (a symlink loop, no permission): typed
                store._abandon()
                what = f"{exc.strerror}: {exc.filename}" if exc.strerror and exc.filename else str(exc)
                raise StoreIOError(exc.errno, f"cannot open the store {root}: {what}") from exc
            except BaseException:
                store._abandon()
                raise
            return store
        raise AssertionError("unreachable")

    def _start(self) -> None:
        if self.read_only:
            _check_log_directory(self.root)
            if not (self.root / "commitlog").is_dir():
                raise StoreNotFoundError(f"{self.root} holds no store (no commitlog directory)")
            check_geometry(self.root / "index", self.config.max_hash_slot_num, self.config.max_index_num)
            staged = pending_swap(self.root / STAGING_DIR)
            if staged is not None:
                log.warning("a rebuild stopped while swapping its new consume queues and index in (%s): the next "
                            "writer's open finishes the swap; until then this read-only view serves the files as "
                            "they are (queues or index may be missing)", staged)
        else:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except FileExistsError as exc:  # mkdir's "File exists" for a file in the way named nothing useful
                raise StoreIOError(exc.errno, f"cannot create store root {self.root}: it exists and is not a "
                                              "directory") from exc
            except OSError as exc:
                raise StoreIOError(exc.errno, f"cannot create store root {self.root}: {exc.strerror}") from exc
            self._lock = StoreLock(self.root)
            self._lock.acquire()
            _check_log_directory(self.root, writer=True)
            _clear_staging(self.root / STAGING_DIR)
            finish_staged(self.root / STAGING_DIR, self.root)  # a rebuild killed mid-swap: its new set goes in
            check_geometry(self.root / "index", self.config.max_hash_slot_num, self.config.max_index_num)
            self._abort.check_writable()
        abnormal = self._abort.exists()
        for config_file in (self.topic_config, self.consumer_offsets, self.delay_offsets, self.timer_offsets,
                            self.subscription_groups):
            config_file.load(empty_if_bad=self.read_only)  # a reader still serves the messages
        self.queues.batch_topics = frozenset(batch_cq_topics(self.root, self.topic_config))
        if not self.read_only:
            check_writer_layout(self.root, self.topic_config)  # before the first change to the directory
        # the checkpoint before the log: beside a live writer, a checkpoint read after the log could vouch for
        # flushes past the log this reader loaded, and report them as lost
        self.checkpoint = StoreCheckpoint.load(self.root / CHECKPOINT_FILE, read_only=self.read_only)
        self.commit_log.load()
        if self.commit_log.mapped_files.foreign:
            log.warning("%s holds %s, which %s no segment name (20 digits): not read", self.root / "commitlog",
                        ", ".join(sorted(self.commit_log.mapped_files.foreign)[:5]),
                        "is" if len(self.commit_log.mapped_files.foreign) == 1 else "are")
        self.queues.load()
        if self.queues.rocksdb:
            log.warning("%s keeps its consume queues in RocksDB (storeType=defaultRocksDB), which rocketstore does "
                        "not read: queue reads and consumer lag are refused; the log and the index are served",
                        self.root)
        self.index = IndexService(self.root, self.config, self.checkpoint, read_only=self.read_only,
                                  clock=self._index_clock)
        self.index.load()
        dispatch_from = self.queues.recover()
        # A read-only open validates the log's structure, not its bodies' CRCs: every read checks those
        # (check_crc_on_read), naming and skipping a damaged record, and the walk of up to three 1 GiB segments
        # took ~1 s of every query command on a broker's store (0.9 -> 0.1 s here)
        self.recovery = recover_commit_log(self.commit_log, self.checkpoint, self.root, abnormal=abnormal,
                                           dispatch_from=dispatch_from,
                                           check_crc=False if self.read_only else None)
        end = self.recovery.end_offset
        if self.read_only:
            # the queues were loaded after the log: a live writer's units for records past this reader's log end
            # are forgotten (in memory only: a read-only queue never writes or deletes), not served as unreadable
            self.queues.truncate_dirty(end)
            for (topic, queue_id), recorded in self.queues.saved_ends().items():  # (not `end`: used below)
                queue = self.queues.get(topic, queue_id)
                if (topic, queue_id) in self.queues.damaged:
                    continue  # said already, with the reason
                if (queue.max_offset_in_queue if queue is not None else 0) < recorded:
                    log.warning("consume queue %s-%d ended at offset %d when the store was last closed and ends "
                                "before it now (files lost): this read-only open serves what is left, a writer's "
                                "open re-dispatches the rest", topic, queue_id, recorded)
            live = is_locked(self.root)  # a live writer's run of units is written sizes last: not damage
            for (topic, queue_id), queue in self.queues.queues.items():
                if queue.hole_at >= 0 and not live:
                    log.warning("consume queue %s-%d: an invalid unit at offset %d has units after it (damage); this "
                                "read-only open serves the queue up to it, a writer's open re-dispatches the rest",
                                topic, queue_id, queue.hole_at)
        elif not self.commit_log.mapped_files.files:
            self.queues.destroy_all()
        else:
            self.queues.truncate_dirty(end)
            report = self.recovery
            if self.queues.lmq_dirs and (report.abnormal or report.stop_reason or report.cut_bytes or report.salvaged
                                         or report.missing_flushed_until):
                self.queues.truncate_lmq(end)  # only when the log may have lost its tail: they are many
            holes = self._queue_holes()
            lost = self._queues_short_of_their_ends()  # before the tails are checked: a cut tail is not a lost file
            tails = self._check_queue_tails()
            self._queue_restart = min((r for r in (holes, tails, lost) if r >= 0), default=-1)
        self.index_entries_repaired = self.index.repair(end, self.commit_log.store_time)
        self.index.check_chains()  # a damaged newest file is set aside; _reput_start then re-indexes the log
        self.index.check_times(self.commit_log.record_store_time)
        if self.read_only and self.config.message_index_enable:
            self._index_tail()
        self.dispatcher = Dispatcher(self.commit_log, self.queues, self.index, self.config, self._note_logics,
                                     self.health)
        self.dispatcher.reput_from_offset = self._reput_start(abnormal, dispatch_from)
        if not self.read_only:
            self._catch_up()
        elif 0 <= dispatch_from < self.recovery.end_offset and not is_locked(self.root) and not self.queues.damaged:
            # a dead writer's store whose dispatch lagged (up to MAX_DISPATCH_LAG): a reader cannot dispatch
            log.warning("%s: the consume queues and the index end at commit-log offset %d of %d (the writer stopped "
                        "before dispatching the rest): those messages are in the log (scan_arrow, iter_messages, "
                        "dump-log) and found by key (this view indexes them in memory), not by queue offset until "
                        "a writer opens the store", self.root,
                        dispatch_from, self.recovery.end_offset)
        for (topic, queue_id), queue in self.queues.queues.items():
            queue.correct_min_offset(self.commit_log.min_offset)
            self.commit_log.queue_offsets[(topic, queue_id)] = queue.max_offset_in_queue
        self.commit_log.last_store_timestamp = self._last_store_timestamp()
        self._check_flushed_present()
        self.reader = StoreReader(self.commit_log, self.queues, self.index, self.config)
        self.reader.known_topics = lambda: list(self.topic_config.topics)
        if not self.read_only:
            self.reader.repair_unit = self._repair_unit
        if not self.read_only:
            self._abort.create()
            self.flusher = CommitLogFlusher(self.commit_log, self.checkpoint, self.config, self.health)
            self.flusher.start()
            self.dispatcher.start()
            if self.config.preallocate:  # sparse segments are never warmed (a fault in a hole may meet a full disk)
                self.commit_log.start_warming(self.config.warm_ahead_commit_log)
            if self.config.enable_schedule_message:
                self.schedule = ScheduleMessageService(self, self.delay_offsets, timer_offsets=self.timer_offsets)
                self.schedule.start()
            self._maintenance = start_thread(self._maintain, "rocketstore-maintenance")

    TAIL_INDEX_MAX = 64 << 20  # bytes of log a read-only open indexes in memory at most

    def _index_tail(self) -> None:
        """Read-only: the keys of the records after the index files' last entry, up to this view's log end, in
        memory (``IndexService.add_tail``): a writer puts a batch's queue units before its index entries, so a
        view opened between the two answered key queries with nothing for messages its queues served."""
        assert self.index is not None and self.recovery is not None
        import numpy as np

        from .codec.batch import scan_dispatch
        from .codec.properties import PropertyName
        from .dispatch import index_topic_of
        from .index.bulk import index_key_hashes
        from .index.service import build_key, index_keys

        # the last counted entry's record (not the header's endPhyOffset: a writer sets that before the count), in
        # the newest file that has entries (a new file has none until its first batch; a killed broker's newest
        # file may read as empty: its header is written when flushed)
        with_entries = [index for index in self.index.files if index.index_count > 1]
        start = with_entries[-1].entry(with_entries[-1].index_count - 1)[1] if with_entries \
            else self.commit_log.min_offset
        start = max(start, self.commit_log.min_offset)
        end = self.recovery.end_offset
        if not start < end <= start + self.TAIL_INDEX_MAX:
            return  # nothing past the files, or more than a live writer's lag (a dead writer's: warned of)
        hashes, phys, stamps = [], [], []
        try:
            for batch in scan_dispatch(self.commit_log, start, end):
                owners = batch.entry_owner
                kept = (batch.sys_flag[owners] & SysFlag.TRANSACTION_MASK) != SysFlag.TRANSACTION_ROLLBACK_TYPE
                hashes.append(batch.entry_hash[kept])
                phys.append(batch.phy[owners][kept])
                stamps.append(batch.store_ts[owners][kept])
                for row in np.flatnonzero(batch.slow).tolist():  # delayed messages, text that is not UTF-8
                    msg = self.commit_log.get_message(int(batch.phy[row]))
                    if SysFlag.transaction_type(msg.sys_flag) == SysFlag.TRANSACTION_ROLLBACK_TYPE:
                        continue
                    props = msg.properties
                    keys = [build_key(index_topic_of(msg.topic, props), key)
                            for key in index_keys(props.get(PropertyName.UNIQ_KEY), props.get(PropertyName.KEYS))]
                    hashes.append(index_key_hashes(keys))
                    phys.append(np.full(len(keys), batch.phy[row], dtype=np.int64))
                    stamps.append(np.full(len(keys), batch.store_ts[row], dtype=np.int64))
        except RocketStoreError as exc:  # damage or retention under this read: what was read is kept
            log.warning("%s: the keys of the messages after the index's last entry could not all be read (%s)",
                        self.root, exc)
        if not hashes:
            return
        hash_all, phy_all, stamp_all = np.concatenate(hashes), np.concatenate(phys), np.concatenate(stamps)
        first = phy_all == start
        if with_entries and int(first.sum()) <= _entries_of_last_record(with_entries, start):
            hash_all, phy_all, stamp_all = hash_all[~first], phy_all[~first], stamp_all[~first]  # all in the files
        if len(hash_all):  # usually none: a query then pays nothing for the tail
            self.index.add_tail(hash_all, phy_all, stamp_all)

    def _check_flushed_present(self) -> None:
        """The checkpoint names the store time of the last flushed message: a log that ends before it lost
        flushed messages (a segment deleted by hand, a device that lied about a flush), said loudly. And on a
        writer open that may have lost the log's or a queue's tail, consumers' offsets past their queue's end are
        brought back to it, as a broker corrects an offset past a queue at the next pull: left there, they would
        skip as many new messages (queues cut by that loss, or a consumer offsets file that survived a power loss
        the log's tail did not)."""
        assert self.recovery is not None and self.checkpoint is not None
        newest, flushed = self.commit_log.last_store_timestamp, self.checkpoint.physic_msg_timestamp
        lost = flushed > newest  # with no segment at all, newest is 0: a checkpoint that saw a flush says loss
        if lost:
            self.recovery.missing_flushed_until = flushed
            log.error("the commit log ends at a message stored at %d ms but the checkpoint says messages up to %d "
                      "ms were flushed: flushed messages are missing (a segment deleted or damaged outside "
                      "rocketstore?)", newest, flushed)
        if self.read_only:
            return
        self._correct_delivery_offsets()
        report = self.recovery
        if not (lost or report.abnormal or report.stop_reason or report.cut_bytes or report.salvaged
                or self._queue_restart >= 0):
            # a clean open lost nothing: an offset past a queue's end was put there (an operator, a broker) and is
            # left as it is, as a broker leaves it until a pull corrects it (a refused reset-offset rewrote it)
            return
        corrected = False
        for topic, group in self.consumer_offsets.groups():
            if self.queues.unmanaged(topic) is not None:
                continue  # a broker's LMQ queue: its offsets are the broker's to keep
            for queue_id, offset in self.consumer_offsets.offsets(group, topic).items():
                queue = self.queues.get(topic, queue_id)
                if queue is None and not lost and self.topic_config.get(topic) is None and \
                        not any(t == topic for t, _q in self.queues.queues):
                    continue  # a topic this store never had (a broker's offsets file brought in): left alone
                end = 0 if queue is None else queue.max_offset_in_queue  # a queue lost whole restarts at 0
                if offset > end:
                    log.warning("%s@%s queue %d: committed offset %d is past the queue's end %d; moved back to it",
                                topic, group, queue_id, offset, end)
                    self.consumer_offsets.commit(group, topic, queue_id, end)
                    corrected = True
        if corrected:
            self.consumer_offsets.persist()

    def _correct_delivery_offsets(self) -> None:
        """The delay levels' and the timer wheel's offsets, past their queue's end, back to it (RocketMQ's
        ``correctDelayOffset``): their files are saved every few seconds, the log's tail under ASYNC_FLUSH up to
        ~10 s later, so after a power loss they can be ahead of the queues; left there, the messages put after
        the restart below them would never be delivered."""
        for level, offset in sorted(self.delay_offsets.table.items()):
            queue = self.queues.get(SCHEDULE_TOPIC, int(level) - 1)  # none: what it delivered is lost whole
            end = 0 if queue is None else queue.max_offset_in_queue
            if offset > end:
                log.warning("delay level %s: delivered up to offset %d, past its queue's end %d; moved back to it",
                            level, offset, end)
                self.delay_offsets.set(level, end)
                self.delay_offsets.persist()
        queue = self.queues.get(TIMER_TOPIC, 0)
        offset = self.timer_offsets.get(0)
        end = 0 if queue is None else queue.max_offset_in_queue
        if offset > end:
            log.warning("timer wheel: delivered up to offset %d, past its queue's end %d; moved back to it", offset,
                        end)
            self.timer_offsets.set_progress(end, set())
            self.timer_offsets.persist()

    def _catch_up(self) -> None:
        """Dispatch what the queues and index lack before the first put or read, under a durable marker of where
        it started (``RedispatchMarker``) that goes only once what it wrote is flushed."""
        assert self.dispatcher is not None and self.recovery is not None and self.index is not None
        marker = RedispatchMarker(self.root)
        unfinished = marker.load()
        dispatcher = self.dispatcher
        if unfinished is not None:
            unfinished = self._marker_start(unfinished)
            log.warning("an earlier open's catch-up dispatch from %d did not finish: dispatching from there again",
                        unfinished)
            dispatcher.reput_from_offset = max(min(dispatcher.reput_from_offset, unfinished),
                                               self.commit_log.min_offset)
        if dispatcher.reput_from_offset < self.recovery.end_offset:
            marker.save(dispatcher.reput_from_offset)
            dispatcher.dispatch_available()
            self.queues.flush(0)
            self.index.flush()
        marker.delete()

    def _reput_start(self, abnormal: bool, dispatch_from: int) -> int:
        """Where dispatch resumes: after the consume queues, or, after a crash, from the point recovery
        trusted and from the newest index entry, whichever is older (duplicates are absorbed)."""
        log_min = self.commit_log.min_offset
        start = dispatch_from if dispatch_from >= 0 else log_min
        if abnormal:
            start = min(start, self.recovery.start_offset)
            if self.index is not None and self.index.files and self.config.message_index_enable:
                newest = self.index.files[-1]
                start = min(start, newest.end_phy_offset if newest.index_count > 1 else newest.begin_phy_offset)
        if self.config.message_index_enable and self.index is not None and not self.index.files:
            start = log_min  # no index at all (deleted, damaged, or never built): index the whole log
        elif self.config.message_index_enable and self.index is not None and not abnormal:
            covered = self._index_covers()
            if covered < start:
                # the index ends before the queues (its newest files lost after a clean close): dispatch, resuming
                # after the queues, never indexed those records again (2 keys of 600 lost, silently). From the
                # newest file's last record itself: its keys may have gone on in the lost file (the record's
                # entries already there are put again: duplicates, which answers never show twice)
                newest = self.index.files[-1]  # type: ignore[union-attr]
                again = newest.end_phy_offset if newest.index_count > 1 else covered
                log.warning("the index ends at commit-log offset %d, before the consume queues (%d): its newest "
                            "files were lost (or the log ends in records without keys); indexed again from %d",
                            covered, start, again)
                start = max(min(start, again), log_min)
        if self._queue_restart >= 0:
            start = min(start, self._queue_restart)  # a queue's tail pointed at the wrong records
        if self.queues.set_aside:
            start = log_min  # a damaged queue was set aside: re-dispatch rebuilds it
        # never past the recovered end: queues that pointed into a segment lost since would have the dispatcher
        # wait there, reading the middle of the records new puts write from the end
        return min(max(start, log_min), self.recovery.end_offset)

    def _index_covers(self) -> int:
        """Where the newest index file's records end: after the last record it indexed (its begin when empty)."""
        assert self.index is not None
        newest = self.index.files[-1]
        if newest.index_count <= 1:
            return newest.begin_phy_offset
        try:
            _mapped, _pos, layout = self.commit_log.locate(newest.end_phy_offset)
        except RocketStoreError:  # that record is gone (retention, a cut log): nothing to say
            return self.commit_log.min_offset if newest.end_phy_offset < self.commit_log.min_offset \
                else newest.end_phy_offset
        return newest.end_phy_offset + layout.size

    def _marker_start(self, phy: int) -> int:
        """Where a catch-up that ``redispatch`` says did not finish starts again: ``phy`` when a record or a
        segment's closing blank starts there, else (inside a record, at or past the log's end) the start of the log.

        ``redispatch`` is written only with record boundaries, but a file edited or damaged into another number
        had dispatch decode the middle of a record: the open failed with "bad magic" until the file was deleted
        by hand. Such a number proves nothing about where the unfinished catch-up began (a kill mid catch-up
        leaves queues and index complete up to the log's end but with holes before it), so the whole log is
        dispatched again, as for a marker that does not parse; its duplicates are absorbed."""
        log_min, log_end = self.commit_log.min_offset, self.recovery.end_offset if self.recovery else 0
        if phy <= log_min:
            return phy  # raised to the log's start by the caller: the whole log
        if phy < log_end:  # a catch-up is saved only from below the end, and no put runs before it finishes
            try:
                self.commit_log.locate(phy, check_crc=True)
                return phy
            except (MessageNotFoundError, CorruptDataError):
                pass
        mapped = self.commit_log.mapped_files.find(phy) if phy < log_end else None
        if mapped is not None:
            with contextlib.suppress(CorruptDataError):  # the blank that closes a segment: dispatch steps over it
                if read_layout(mapped.buffer, phy - mapped.file_from_offset, mapped.wrote_position) is None:
                    return phy
        log.warning("redispatch names offset %d, where no record starts: dispatching the whole log from %d",
                    phy, log_min)
        return log_min

    # --- consume-queue units that point at the wrong record -----------------------------------------------

    def _unit_identity(self, phy: int) -> tuple[str, int, int] | None:
        """(topic, queue id, queue offset) of the record at ``phy``, or None when no valid record starts there."""
        try:
            mapped, pos, layout = self.commit_log.locate(phy, check_crc=False)
        except (MessageNotFoundError, CorruptDataError):
            return None
        req = dispatch_request(mapped.buffer, pos, layout, self.config)
        return req.topic, req.queue_id, req.queue_offset

    def _queues_short_of_their_ends(self) -> int:
        """Where re-dispatch must start for queues that end before the end the last clean close recorded (their last
        files or their directory lost): after the last unit they kept, or the log's start. A queue cut short was
        taken for one ending there, the next put reused its queue offsets, and re-dispatch, which starts after the
        longest queue, never wrote the lost units again. -1 when every queue reaches its recorded end."""
        restart = -1
        for (topic, queue_id), end in self.queues.saved_ends().items():
            queue = self.queues.get(topic, queue_id)
            have = queue.max_offset_in_queue if queue is not None else 0
            if have >= end or (queue is None and self.topic_config.get(topic) is None):
                continue  # reaches its end; or gone with its topic (a broker's deleteTopic): not brought back
            resume = queue.max_physic_offset if queue is not None and queue.max_physic_offset >= 0 \
                else self.commit_log.min_offset
            log.error("consume queue %s-%d ends at offset %d, but it ended at %d when the store was last closed (its "
                      "last files are gone): re-dispatched from commit-log offset %d", topic, queue_id, have, end,
                      resume)
            self.queue_units_repaired += end - have
            restart = resume if restart < 0 else min(restart, resume)
        return restart

    def _queue_holes(self) -> int:
        """Where re-dispatch must start to write again the units of queues that recovery found a hole in (units after
        an invalid one: the queue was cut there, and a put would have reused the hole's queue offsets): the end of
        the last good unit's record, or the log's start. -1 when no queue has a hole."""
        restart = -1
        for (topic, queue_id), queue in list(self.queues.queues.items()):
            if queue.hole_at < 0:
                continue
            resume = queue.max_physic_offset if queue.max_physic_offset >= 0 else self.commit_log.min_offset
            log.error("consume queue %s-%d: units after offset %d follow an invalid one (damage); the queue is cut "
                      "there and re-dispatched from commit-log offset %d", topic, queue_id, queue.hole_at, resume)
            self.queue_units_repaired += 1
            restart = resume if restart < 0 else min(restart, resume)
        return restart

    def _check_queue_tails(self, depth: int = 64) -> int:
        """Every queue's last unit must point at its own record. A tail that points elsewhere (damage, or a
        foreign tool) would make re-dispatch skip the real record as a duplicate and serve the foreign one,
        so the bad units are cut and re-dispatch starts before them. Returns that offset, or -1."""
        restart = -1
        for (topic, queue_id), queue in list(self.queues.queues.items()):
            first_bad = None
            offset = queue.max_offset_in_queue - 1
            while offset >= queue.min_offset_in_queue and queue.max_offset_in_queue - offset <= depth:
                unit = queue.get_unit(offset)
                if unit is None or unit[1] == PRE_BLANK_SIZE or unit[0] < self.commit_log.min_offset:
                    break  # retention deleted this record and the older ones: nothing left to compare
                if self._unit_identity(unit[0]) == (topic, queue_id, offset):
                    break
                first_bad = offset
                offset -= 1
            if first_bad is None:
                continue
            good = queue.get_unit(first_bad - 1) if first_bad > queue.min_offset_in_queue else None
            resume = good[0] + good[1] if good and good[1] != PRE_BLANK_SIZE else self.commit_log.min_offset
            log.error("consume queue %s-%d: units from offset %d point at records of other queues; cut, and "
                      "re-dispatched from commit-log offset %d", topic, queue_id, first_bad, resume)
            self.queue_units_repaired += queue.max_offset_in_queue - first_bad
            queue.truncate_to(first_bad)
            restart = resume if restart < 0 else min(restart, resume)
        return restart

    def _repair_unit(self, topic: str, queue_id: int, queue_offset: int) -> MessageExt | None:
        """Find the record that belongs at (topic, queue, offset) between its neighbours' records, restore its
        unit and return it (None when it cannot be found: the read then skips the unit)."""
        queue = self.queues.get(topic, queue_id)
        if queue is None or self.dispatcher is None:
            return None
        low, high = self.commit_log.min_offset, self.dispatcher.reput_from_offset
        before = queue.get_unit(queue_offset - 1) if queue_offset > queue.min_offset_in_queue else None
        if before is not None and 0 < before[1] != PRE_BLANK_SIZE:
            low = max(low, before[0] + before[1])
        after = queue.get_unit(queue_offset + 1)
        if after is not None and 0 < after[1] != PRE_BLANK_SIZE and low < after[0] < high:
            high = after[0]
        try:
            for mapped, pos, layout in self.commit_log.iter_layouts(low, high, check_crc=False):
                req = dispatch_request(mapped.buffer, pos, layout, self.config)
                if (req.topic, req.queue_id, req.queue_offset) == (topic, queue_id, queue_offset) and \
                        SysFlag.transaction_type(req.sys_flag) in (SysFlag.TRANSACTION_NOT_TYPE,
                                                                   SysFlag.TRANSACTION_COMMIT_TYPE):
                    queue.rewrite_unit(queue_offset, req.commit_log_offset, req.size, req.tags_code)
                    self.queue_units_repaired += 1
                    log.warning("consume queue %s-%d: unit %d restored to commit-log offset %d", topic, queue_id,
                                queue_offset, req.commit_log_offset)
                    return self.commit_log.get_message(req.commit_log_offset)
        except (CorruptDataError, MessageNotFoundError) as exc:
            log.error("consume queue %s-%d: cannot repair unit %d: %s", topic, queue_id, queue_offset, exc)
        return None

    def _note_logics(self, store_timestamp: int) -> None:
        self._logics_timestamp = store_timestamp

    def _maintain(self) -> None:
        """Consume-queue and index flushing, checkpointing, offsets and retention (RocketMQ's other
        services), each on its own interval."""
        every = {
            "flush": self.config.flush_interval_consume_queue / 1000,
            "checkpoint": self.config.flush_consume_queue_thorough_interval / 1000,
            "offsets": self.config.flush_consumer_offset_interval / 1000,
            "retention": 10.0,
        }
        last = dict.fromkeys(every, time.monotonic())
        failures = {task: RepeatedErrorLog(log, f"store maintenance ({task}) failed, the next pass retries",
                                           f"store maintenance ({task}) works again") for task in every}
        while not self._stop.wait(min(every.values())):
            now = time.monotonic()
            due = {task for task, interval in every.items() if now - last[task] >= interval}
            for task in ("checkpoint", "flush", "offsets", "retention"):
                if task not in due or (task == "flush" and "checkpoint" in due):  # a checkpoint flushes them itself
                    continue
                try:
                    self._maintenance_task(task)
                except StoreClosedError:  # close() came while a pass ran: it does that work itself
                    return
                except Exception as exc:  # never let housekeeping kill the store; the next pass retries
                    failures[task].failed(exc)
                else:
                    failures[task].recovered()  # said only after this task failed and now did its work
            for task in due:
                last[task] = now

    def _maintenance_task(self, task: str) -> None:
        if task == "checkpoint":
            self.checkpoint_now()
        elif task == "flush":
            self.queues.flush(self.config.flush_consume_queue_least_pages)
            if self.index is not None:
                self.index.flush()
        elif task == "offsets":
            self.consumer_offsets.persist()
            self.delay_offsets.persist()
            self.timer_offsets.persist()
        else:
            self.delete_expired_files()

    def checkpoint_now(self) -> None:
        """Flush consume queues and index fully, then record how far they are durable."""
        self._check_open(write=True)
        self._flush_queues_and_index()

    def _flush_queues_and_index(self) -> None:
        """Flush consume queues and index, then record in the checkpoint how far each is durable.

        After a failed queue or index flush the checkpoint's logics and index times never advance
        again in this process (a retried flush proves nothing), and the abort file stays at close,
        so the next open re-dispatches from where the files were last known durable.
        """
        logics = self._logics_timestamp
        durable = 0
        try:
            self.queues.flush(0)
            if self.index is not None:
                durable = self.index.flush()
        except StoreIOError:
            self._derived_flush_failed = True
            raise
        if self.queues.budget.flush_error is not None:  # a queue file given back after a failed flush
            self._derived_flush_failed = True
        if not self._derived_flush_failed:
            self.checkpoint.index_msg_timestamp = max(self.checkpoint.index_msg_timestamp, durable)
            if logics:
                self.checkpoint.logics_msg_timestamp = logics
        self.checkpoint.flush()

    def _last_store_timestamp(self) -> int:
        """Store time of the newest record: one compiled pass over the newest segment finds where it starts."""
        if self.commit_log.max_offset <= self.commit_log.min_offset:
            return 0
        for mapped in reversed(self.commit_log.mapped_files.files):
            _stop, _count, last = validate_records(mapped.buffer, 0, mapped.wrote_position, check_crc=False)
            if last >= 0:
                return self.commit_log.store_time(mapped.file_from_offset + last)
        return 0

    def close(self) -> None:
        """Flush everything, delete the abort file and release the lock. Safe to call twice.

        Every step runs even when an earlier one fails; the lock is always released. If anything
        failed (a flush, a dispatch, a config write), the abort file stays, so the next open runs
        crash recovery, and the first error is raised.
        """
        with self._close_lock:
            if self._closed:
                return
            errors: list[BaseException] = []
            # the schedule stops first, while reads still answer: stopped after the close began, its delivery loop
            # found every due message unreadable and marked thousands delivered that never were (schedule review)
            if self.schedule is not None:
                try:
                    self.schedule.shutdown()
                except Exception as exc:
                    errors.append(exc)
            self._closed = True
            self._end_scans()

            def step(action: Callable[[], object]) -> None:
                try:
                    action()
                except Exception as exc:
                    errors.append(exc)

            try:
                self._stop.set()
                if self._maintenance is not None:
                    self._maintenance.join()
                if not self.read_only:
                    step(self.consumer_offsets.persist)
                    step(self.delay_offsets.persist)
                    step(self.timer_offsets.persist)
                if not self.read_only and self.flusher is not None and self.dispatcher is not None:
                    step(self.flusher.shutdown)
                    step(self.dispatcher.shutdown)
                    step(self._flush_queues_and_index)
                    clean = not errors and self.health.healthy and not self._derived_flush_failed
                    if clean and self.dispatcher.behind_bytes() == 0:  # else the next open re-dispatches
                        step(self.queues.save_ends)
                        if not errors:  # the queue ends unsaved: the next open checks the queues as after a crash
                            step(self._abort.delete)
            finally:
                self._release()
            if errors:
                log.error("store %s closed with errors (the next open runs crash recovery): %s", self.root,
                          "; ".join(str(e) for e in errors))
                raise errors[0]

    def _abandon(self) -> None:
        """A failed open: stop the threads ``_start`` had started, writing nothing more (the abort file stays, so the
        next open recovers), then release the files and the lock. A thread left running held the half-open store's
        mappings, and an exception here left the lock held for the rest of the process."""
        self._closed = True
        self._stop.set()
        try:
            if self._maintenance is not None:
                self._maintenance.join()
            for service in (self.schedule, self.flusher, self.dispatcher):
                if service is not None:
                    try:
                        service.halt()
                    except Exception:  # the open's own error is the one to raise
                        log.exception("stopping %s after a failed open", type(service).__name__)
        finally:
            self._release()

    def _release(self) -> None:
        """Unmap everything and release the lock; the lock goes even when closing a file fails."""
        try:
            try:
                if self.index is not None:
                    self.index.close()
            finally:
                try:
                    self.queues.close()
                finally:
                    self.commit_log.close()
        finally:
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    def __enter__(self) -> MessageStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self, write: bool = False) -> None:
        if self._closed:
            raise StoreClosedError(f"store {self.root} is closed")
        if write and self.read_only:
            raise ReadOnlyStoreError(f"store {self.root} was opened read-only")

    # --- writes ------------------------------------------------------------------------------

    def put_message(self, msg: Message) -> PutMessageResult:
        """Store one message (``putMessage``). Illegal messages raise and write nothing."""
        status, phy, pending, queue_offsets, store_ts = self._put([msg])
        # put_results' C loops pay off from a few records on; for one, a tuple (a seventh of a put otherwise)
        return PutMessageResult(status, create_offset_msg_id(self.encoder.store_host_raw, phy), pending.uniq_keys[0],
                                phy, queue_offsets[0], store_ts, pending.sizes[0])

    def _put_system(self, msg: Message) -> PutMessageResult:
        """``put_message`` for the store's own services: the only writers of system topics (half messages,
        transaction ops, parked checks)."""
        status, phy, pending, queue_offsets, store_ts = self._put([msg], system=True)
        return PutMessageResult(status, create_offset_msg_id(self.encoder.store_host_raw, phy), pending.uniq_keys[0],
                                phy, queue_offsets[0], store_ts, pending.sizes[0])

    def _put_delivered(self, msg: Message) -> PutMessageResult:
        """``put_message`` of a message a producer had sent and the store held back (a delay, a timer, a
        transaction's commit): as RocketMQ's schedule service and end-transaction processor put straight into the
        store, the topic's perm is not checked again; an operator's read-only topic would otherwise hold every
        message of the same delay level behind it (units of a level are delivered in order)."""
        status, phy, pending, queue_offsets, store_ts = self._put([msg], delivered=True)
        return PutMessageResult(status, create_offset_msg_id(self.encoder.store_host_raw, phy), pending.uniq_keys[0],
                                phy, queue_offsets[0], store_ts, pending.sizes[0])

    def put_messages(self, msgs: Iterable[Message]) -> PutResults:
        """Store messages as one contiguous, all-or-nothing append (``putMessages``).

        Unlike a RocketMQ batch, the messages may go to different topics and queues; they share
        one store timestamp, one segment and, under SYNC_FLUSH, one disk flush. The result is a
        sequence of ``PutMessageResult``, in order, made when first read.
        """
        try:
            msgs = list(msgs)
        except TypeError:
            raise MessageIllegalError(f"put_messages takes a list of messages, not {msgs!r}") from None
        if not msgs:
            self._check_open(write=True)
            self.health.check_writable()
            return PutResults(0, list)
        status, phy, pending, queue_offsets, store_ts = self._put(msgs)
        return PutResults(len(msgs), functools.partial(put_results, status, self._store_host_hex, phy,
                                                       pending.uniq_keys, queue_offsets, store_ts, pending.sizes))

    def _put(self, msgs: list[Message], system: bool = False, delivered: bool = False
             ) -> tuple[PutMessageStatus, int, PendingRecords, list[int], int]:
        self._check_open(write=True)
        self.health.check_writable()
        pending = self.encoder.encode_many(msgs, system)
        missing = self._check_topics(pending.queue_checks, any_perm=delivered)
        self.commit_log.check_fits(len(pending.data))
        # only once the whole put passed: a put validation refuses creates no topic. One the disk refuses after keeps
        # it, as a broker keeps a topic it auto-created: taking it back raced a put into it that had found it
        if missing is not None:
            self._create_topics(missing)
        phy, queue_offsets, store_ts = self.commit_log.append(pending)
        assert self.dispatcher is not None
        self.dispatcher.wake()
        status = PutMessageStatus.PUT_OK
        if self.config.flush_disk_type is FlushDiskType.SYNC_FLUSH and pending.wait_store:
            assert self.flusher is not None
            if not self.flusher.wait_flushed(phy + len(pending.data)):
                status = PutMessageStatus.FLUSH_DISK_TIMEOUT
            self.dispatcher.wake()
        self.dispatcher.keep_up()
        return status, phy, pending, queue_offsets, store_ts

    def put_batch(self, table, *, copied: bool = False) -> PutBatchResult:
        """Store a ``pyarrow.Table``/``RecordBatch`` of messages, encoded column-wise (the fast way in).

        Columns: ``topic`` and ``body`` (required), ``keys`` (list<string>), ``tags``, ``properties``
        (map<string, string>), ``queue_id``, ``flag``, ``born_timestamp``, ``born_host``, and what copied messages
        carry: ``sys_flag`` (a compressed body and its type, MULTI_TAGS, a committed transaction), ``reconsume_times``,
        ``prepared_transaction_offset``. Validation is the
        per-message encoder's and happens before anything is written: a bad row is named in a typed
        error. Rows keep their order in the log and in every queue; one store time, and under SYNC_FLUSH one
        wait for the disk. A table larger than the room left in the current segment is written as one
        crash-atomic append per segment, so a crash keeps a prefix of whole rows. ``copied``: the rows are messages
        a store held (an import), so properties a broker sets (INNER_MULTI_DISPATCH) are kept, not refused.
        """
        self._check_open(write=True)
        self.health.check_writable()
        batch = self._batch_encoder().encode(table, copied=copied)
        try:
            missing = self._check_topics(batch.queue_checks)
        except RocketStoreError as exc:  # named by its first row, as the encoder's own refusals are
            row = self._first_refused_row(batch)
            if row is None:
                raise
            raise type(exc)(f"row {row}: {exc}") from None
        if missing is not None:  # only once every row passed: a refused table creates no topic (see _put)
            self._create_topics(missing)
        try:
            phys, queue_offsets, store_ts = self.commit_log.append_batch(batch)
        except TablePartlyStoredError as exc:  # the stored rows' result, as durable as a whole table's would be
            phys, queue_offsets, store_ts = exc.result
            try:
                exc.result = self._batch_stored(batch, phys, queue_offsets, store_ts)
            except StoreIOError as flush_error:  # SYNC_FLUSH's wait failed too: the count must not be lost with it
                exc.result = self._batch_stored(batch, phys, queue_offsets, store_ts, flushed=False)
                exc.strerror = f"{exc.strerror}; flushing the stored rows failed too: {flush_error}"
            raise
        return self._batch_stored(batch, phys, queue_offsets, store_ts)

    def _batch_stored(self, batch, phys, queue_offsets, store_ts: int, *, flushed: bool = True) -> PutBatchResult:
        """Dispatch, and under SYNC_FLUSH wait for, the first ``len(phys)`` rows of ``batch`` (all of them, or the
        prefix a failed table in parts left); their result. ``flushed=False``: no wait, FLUSH_DISK_TIMEOUT (the
        flush failed)."""
        assert self.dispatcher is not None and self.flusher is not None
        self.dispatcher.wake()
        status = PutMessageStatus.PUT_OK
        sizes = batch.sizes[: len(phys)]
        if len(phys) and self.config.flush_disk_type is FlushDiskType.SYNC_FLUSH and batch.wait_store:
            if not flushed or not self.flusher.wait_flushed(int(phys[-1] + sizes[-1])):
                status = PutMessageStatus.FLUSH_DISK_TIMEOUT
            self.dispatcher.wake()
        if flushed:
            self.dispatcher.keep_up()
        from .codec.batch_encode import offset_msg_ids, uniq_key_strings

        # the ids are made on first read from what they need, not from the batch (its records stay unreferenced)
        n = len(phys)
        texts = batch.uniq_texts if batch.uniq_texts is None or n == len(batch) else batch.uniq_texts[:n]
        return PutBatchResult(status, phys, queue_offsets, sizes, store_ts,
                              functools.partial(offset_msg_ids, self.encoder.store_host_raw, phys),
                              functools.partial(uniq_key_strings, batch.uniq_raw[:n], texts))

    def _batch_encoder(self):
        if self._batch is None:
            from .codec.batch_encode import BatchEncoder

            self._batch = BatchEncoder(self.encoder)
        return self._batch

    def _first_refused_row(self, batch) -> int | None:
        """The first row of ``batch`` whose (topic, queue) the topic rules refuse: each distinct pair checked alone,
        in the order of its first row."""
        import numpy as np

        pairs = batch.topic_index.astype(np.int64) << 32 | batch.queue_ids.astype(np.int64)
        _unique, first = np.unique(pairs, return_index=True)
        for row in np.sort(first).tolist():
            try:
                self._check_topics([(batch.topics[int(batch.topic_index[row])], int(batch.queue_ids[row]))])
            except RocketStoreError:
                return row
        return None

    def _check_topics(self, checks: Iterable[tuple[str, int]], any_perm: bool = False
                      ) -> list[tuple[str, int]] | None:
        """RocketMQ's topic rules for every topic of a put: an unknown topic is to be created
        (``auto_create_topic_enable``, with ``default_topic_queue_nums`` queues, or as many as the queue id needs)
        or refused; a queue id must be below the topic's write queue count and the topic writable (unless
        ``any_perm``: ``_put_delivered``). Creates nothing: returns the topics ``_create_topics`` must create once
        the whole put has passed every check (None if there are none)."""
        missing = None
        get = self.topic_config.get
        for topic, queue_id in checks:
            config = get(topic)
            if config is not None:
                if queue_id >= config.write_queue_nums or not (config.writable or any_perm):
                    _refuse_queue(topic, queue_id, config.write_queue_nums, config.perm)
                continue
            if not self.config.auto_create_topic_enable and topic not in PARKED_TOPICS:
                raise TopicNotExistError(f"topic {topic} does not exist and auto_create_topic_enable is off")
            queues = self._auto_queues(topic, queue_id)
            if queue_id >= queues:
                _refuse_queue(topic, queue_id, queues, None)
            if queues > MAX_QUEUE_NUMS:  # checked with the rest: a topic created before this one stays uncreated
                raise InvalidQueueError(f"queue {queue_id} of new topic {topic} cannot be created: a topic has at "
                                        f"most {MAX_QUEUE_NUMS} queues")
            if missing is None:
                missing = []
            missing.append((topic, queue_id))
        return missing

    def _auto_queues(self, topic: str, queue_id: int) -> int:
        """How many queues an auto-created topic gets."""
        if topic == SCHEDULE_TOPIC:
            return len(self.config.delay_levels_ms)
        if topic in PARKED_TOPICS:
            return 1
        return max(self.config.default_topic_queue_nums, queue_id + 1)

    def _create_topics(self, missing: list[tuple[str, int]]) -> None:
        """Auto-create the topics ``_check_topics`` found missing, after checking them again under the topic lock
        (another put or ``create_topic`` may have created one since): all checks pass before the first is made."""
        with self._topic_lock:
            todo = self._check_topics(missing)
            for topic, queue_id in todo or ():  # never replaces a config (create_topic also holds the topic lock)
                self.topic_config.create_if_absent(topic, self._auto_queues(topic, queue_id))

    # --- topics and consumers ---------------------------------------------------------------------

    def create_topic(self, topic: str, queues: int = 8, *, read_queues: int | None = None) -> None:
        """Create or update a topic in config/topics.json (``updateTopic``); atomic against a put auto-creating it
        (under the topic lock), so a put's defaults never replace what this set."""
        self._check_open(write=True)
        if is_system_topic(validate_topic(topic)):  # TopicValidator.isSystemTopic, as updateAndCreateTopic asks
            raise InvalidTopicError(f"{topic} is a system topic: the store creates it itself, as it needs it")
        with self._topic_lock:
            self.topic_config.create_or_update(topic, write_queue_nums=queues, read_queue_nums=read_queues)

    def _create_system_topic(self, topic: str, queues: int) -> None:
        """A system topic the store's own services need (transactions' half and op topics)."""
        with self._topic_lock:
            self.topic_config.create_if_absent(topic, queues)

    def delete_topic(self, topic: str) -> bool:
        """Remove a topic from config/topics.json (its messages stay until retention removes them)."""
        self._check_open(write=True)
        with self._topic_lock:
            return self.topic_config.delete(topic)

    def consumer(self, group: str, topic: str, **options) -> Consumer:
        """A consumer of ``topic`` for consumer group ``group``; see ``rocketstore.consumer.Consumer``."""
        self._check_open()
        return Consumer(self, group, topic, **options)

    def commit_offset(self, group: str, topic: str, queue_id: int, offset: int) -> None:
        self._check_open(write=True)
        self.consumer_offsets.commit(group, topic, queue_id, offset)

    def query_offset(self, group: str, topic: str, queue_id: int) -> int:
        """The group's committed offset in a queue, or -1 (``queryOffset``)."""
        self._check_open()
        checked(group_name, group, "group")  # as commit_offset: True answered queue 1's offset, [1] a TypeError
        validate_topic(topic)
        if type(queue_id) is not int:
            raise InvalidQueryError(f"queue_id must be an integer, not {queue_id!r}")
        return self.consumer_offsets.query(group, topic, queue_id)

    def offset_resets(self, group: str, topic: str) -> int:
        """How many times ``reset_offset`` moved this group on this topic (consumers of it follow a reset)."""
        return self._offset_resets.get((group, topic), 0)

    def reset_offset(self, group: str, topic: str, to: str | int) -> dict[int, int]:
        """Point a group at "earliest", "latest" or the first message at or after an epoch-ms time in every
        queue (``resetOffsetByTime``); returns the new offsets and persists them at once. ``-1`` is "latest", as
        the broker's resetOffset takes it (an operator's habit; as a time it would mean each queue's start). This
        process's open consumers of the group read on from there (what they handed out before is not committed)."""
        self._check_open(write=True)
        if to not in ("earliest", "latest") and type(to) is not int:  # before any message: each queue's start
            raise InvalidQueryError(f"reset to 'earliest', 'latest' or an epoch-ms timestamp, not {to!r}")
        if to == -1:
            to = "latest"
        checked(group_name, group, "group")  # before anything moves, even for a topic with no queue
        validate_topic(topic)
        queue_ids = set(self.queue_ids(topic))
        config = self.topic_config.get(topic)
        if config is not None:
            queue_ids.update(range(config.read_queue_nums))
        offsets = {}
        with self.offsets_lock:  # a consumer's commit lands wholly before the reset (overwritten) or after (follows)
            self._offset_resets[(group, topic)] = self._offset_resets.get((group, topic), 0) + 1
            for queue_id in sorted(queue_ids):
                if to == "earliest":
                    offsets[queue_id] = self.get_min_offset_in_queue(topic, queue_id)
                elif to == "latest":
                    offsets[queue_id] = self.get_max_offset_in_queue(topic, queue_id)
                else:
                    offsets[queue_id] = self.get_offset_in_queue_by_time(topic, queue_id, int(to))
            self.consumer_offsets.reset(group, topic, offsets)
            self._offset_resets[(group, topic)] += 1  # again: a consumer that followed the first saw the old offsets
        return offsets

    def flush(self) -> int:
        """Force everything written so far to disk; returns the flushed commit-log offset."""
        self._check_open(write=True)
        assert self.flusher is not None
        return self.flusher.flush(0)

    # --- reads -------------------------------------------------------------------------------

    def wait_for_dispatch(self, timeout: float = 5.0) -> bool:
        """Block until consume queues and index cover everything written so far (False on timeout).

        Dispatch runs in the background as in RocketMQ; call this to read your own writes.
        """
        self._check_open()
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout >= 0:
            raise InvalidQueryError(f"timeout must be a number of seconds, not {timeout!r}")
        if self.read_only or self.dispatcher is None:
            return True
        target = self.commit_log.flushed_offset if self.config.flush_disk_type is FlushDiskType.SYNC_FLUSH \
            else self.commit_log.max_offset
        return self.dispatcher.wait_dispatched(target, timeout)

    @_closed_under
    def get_message(self, topic: str, queue_id: int, offset: int, max_msgs: int = 32,
                    tags: str | Iterable[str] | None = None, *, sql: str | SqlFilter | None = None
                    ) -> GetMessageResult:
        """Messages of one queue from a queue offset (``getMessage``), with RocketMQ's statuses.

        ``tags`` is a subscription such as ``"TagA || TagB"`` (None, ``""`` or exactly ``"*"``: all; see
        ``reads.parse_tags``); ``sql`` instead an SQL92
        expression over the messages' properties, as RocketMQ's ``MessageSelector.bySql`` (see ``sqlfilter``).
        """
        self._check_open()
        return self._reader().get_message(topic, queue_id, offset, max_msgs, tags, sql=sql)

    @_closed_under
    def get_offset_in_queue_by_time(self, topic: str, queue_id: int, timestamp: int,
                                    boundary: str = "lower") -> int:
        """The queue offset of the first ("lower") or last ("upper") message stored at ``timestamp``,
        or of its neighbour when none was (``getOffsetInQueueByTime``)."""
        self._check_open()
        return self._reader().offset_by_time(topic, queue_id, timestamp, boundary)

    def get_min_offset_in_queue(self, topic: str, queue_id: int) -> int:
        self._check_open()
        if type(queue_id) is not int or type(topic) is not str:
            check_str("topic", topic)
            queue_id = check_int("queue_id", queue_id)
        self.queues.check_managed(topic)
        queue = self.queues.get(topic, queue_id)
        return queue.min_offset_in_queue if queue else 0

    def get_max_offset_in_queue(self, topic: str, queue_id: int) -> int:
        """The next queue offset to be dispatched (0 for an unknown queue)."""
        self._check_open()
        if type(queue_id) is not int or type(topic) is not str:
            check_str("topic", topic)
            queue_id = check_int("queue_id", queue_id)
        self.queues.check_managed(topic)
        queue = self.queues.get(topic, queue_id)
        return queue.max_offset_in_queue if queue else 0

    def get_message_total_in_queue(self, topic: str, queue_id: int) -> int:
        """Messages a queue holds (its max offset less its min), -1 for a queue that does not exist
        (``getMessageTotalInQueue``)."""
        queue = self._queue(topic, queue_id)
        return -1 if queue is None else queue.max_offset_in_queue - queue.min_offset_in_queue

    @_closed_under
    def get_commit_log_offset_in_queue(self, topic: str, queue_id: int, offset: int) -> int:
        """Commit-log offset of the message at a queue offset, 0 when the queue holds none there (below its min
        offset, at or past its max: ``getCommitLogOffsetInQueue``)."""
        unit = self._unit(topic, queue_id, offset)
        return 0 if unit is None else unit[0]

    @_closed_under
    def get_message_store_timestamp(self, topic: str, queue_id: int, offset: int) -> int:
        """Store time (ms) of the message at a queue offset, -1 when there is none or its segment is gone
        (``getMessageStoreTimeStamp``)."""
        unit = self._unit(topic, queue_id, offset)
        return -1 if unit is None else self.commit_log.store_time(unit[0], unit[1])

    def _queue(self, topic: str, queue_id: int) -> ConsumeQueue | None:
        self._check_open()
        check_str("topic", topic)
        queue_id = check_int("queue_id", queue_id)
        self.queues.check_managed(topic)
        return self.queues.get(topic, queue_id)

    def _unit(self, topic: str, queue_id: int, offset: int) -> tuple[int, int, int] | None:
        queue = self._queue(topic, queue_id)
        offset = check_int("offset", offset)
        if queue is None or offset < queue.min_offset_in_queue:  # below it: expired, as ConsumeQueue.get answers
            return None
        return queue.get_unit(offset)

    @_closed_under
    def get_earliest_message_time(self, topic: str | None = None, queue_id: int | None = None) -> int:
        """Store time of the oldest message of a queue, of a topic (its queues' oldest), or of the whole store; -1 if
        there is none. A queue id needs its topic (it answered the whole store's time); a topic alone answered its
        queue 0's."""
        self._check_open()
        if topic is not None:
            check_str("topic", topic)
        if queue_id is not None:
            queue_id = check_int("queue_id", queue_id)
            if topic is None:
                raise InvalidQueryError("a queue id needs its topic: get_earliest_message_time(topic, queue_id)")
        reader = self._reader()
        if topic is not None and queue_id is None:
            times = [reader.earliest_message_time(topic, q) for q in self.queue_ids(topic)]
            return min((t for t in times if t >= 0), default=-1)
        return reader.earliest_message_time(topic, queue_id)

    @_closed_under  # measured: within the noise of a 3.7 µs lookup
    def query_message(self, topic: str, key: str, max_num: int = 64, begin: int = 0,
                      end: int | None = None) -> list[MessageExt]:
        """Messages of ``topic`` carrying ``key`` in their KEYS, stored in [begin, end] (ms).

        Exact, unlike RocketMQ's store: colliding keys never match. The newest ``max_num``
        (at most ``max_msgs_num_batch``) are returned, oldest first.
        """
        if self._closed:  # _check_open, inline: a key lookup is a few microseconds
            self._check_open()
        return self.reader.query_message(topic, key, max_num, begin, end)  # type: ignore[union-attr]

    @_closed_under
    def query_messages_arrow(self, queries: Sequence[tuple[str, str]], max_num: int = 64, begin: int = 0,
                             end: int | None = None, *, include_body: bool = True, broker_name: str | None = None):
        """``query_message`` for many ``(topic, key)`` pairs in one call, as a ``pyarrow.RecordBatch`` (the
        ``scan_arrow`` columns plus ``queryTopic`` and ``queryKey``): each query's messages oldest first, in
        query order, exactly what one ``query_message`` per pair returns, found and checked in batches."""
        self._check_open()
        if broker_name is not None:
            check_str("broker_name", broker_name)
        return self._reader().query_many(queries, max_num, begin, end, include_body=include_body,
                                         broker_name=broker_name)

    @_closed_under
    def query_message_by_uniq_key(self, topic: str, uniq_key: str) -> list[MessageExt]:
        """Messages of ``topic`` whose UNIQ_KEY (the producer's msgId) is ``uniq_key``; a producer
        retry can store one twice."""
        self._check_open()
        return self._reader().query_by_uniq_key(topic, uniq_key)

    @_closed_under
    def view_message_by_id(self, msg_id: str, topic: str | None = None) -> MessageExt:
        """The message with this offset msgId, or UNIQ_KEY (then its oldest copy, in ``topic`` when given, as
        mqadmin's ``queryMsgById``). Raises ``MessageNotFoundError`` or ``InvalidMessageIdError``."""
        self._check_open()
        return self._reader().view_message_by_id(msg_id, topic)

    def topics(self) -> list[str]:
        """Topics that have consume queues."""
        self._check_open()
        return self.queues.topics()

    def queue_ids(self, topic: str) -> list[int]:
        self._check_open()
        return sorted(q for t, q in self.queues.queues if t == topic)

    def _reader(self) -> StoreReader:
        assert self.reader is not None
        return self.reader

    def delete_expired_files(self, *, now_ms: int | None = None, immediately: bool = False) -> RetentionReport:
        """Apply retention now (the maintenance thread also does every 10 s)."""
        self._check_open(write=True)
        if now_ms is not None:
            now_ms = check_int("now_ms", now_ms)
            if not 0 <= now_ms < 1 << 63:  # a long, as RocketMQ's; past it the file times overflowed (EOVERFLOW)
                raise InvalidQueryError(f"now_ms must be an epoch-ms time from 0 to 2**63-1, not {now_ms}")
        dispatcher = self.dispatcher
        with dispatcher.paused() if dispatcher is not None else contextlib.nullcontext():
            return delete_expired_files(self.commit_log, self.queues, self.index, self.config, now_ms=now_ms,
                                        immediately=immediately,
                                        dispatched=None if dispatcher is None else dispatcher.reput_from_offset)

    @_closed_under
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
        if from_offset is not None:
            from_offset = check_int("from_offset", from_offset, error=OffsetOutOfRangeError)
        if to_offset is not None:
            to_offset = check_int("to_offset", to_offset, error=OffsetOutOfRangeError)
        if from_offset is not None and self.commit_log.min_offset <= from_offset < self.commit_log.max_offset:
            self.commit_log.check_record_start(from_offset)  # else the walk decodes the middle of a record
        return self._while_open(self.commit_log.iter_messages(from_offset, to_offset))

    def _while_open(self, iterator: Iterator):
        """``iterator``'s items; used after ``close()`` (its mappings unmapped), ``StoreClosedError``, even where
        the iterator had items made ahead (``scan_arrow``'s)."""
        try:
            for item in iterator:
                if self._closed:
                    break
                yield item
        except (ValueError, StoreIOError):  # "mmap closed or invalid", "segment ... is closed"
            if self._closed:
                raise StoreClosedError(f"store {self.root} was closed while this iterator was in use") from None
            raise
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()
        if self._closed:
            raise StoreClosedError(f"store {self.root} was closed while this iterator was in use")

    def _end_scans(self) -> None:
        """Close the scans left open (paused between batches): their read-ahead holds views of the segments,
        which kept a mapping alive past ``close()`` (the session review). One running in another thread right
        now is left to end itself: it raises ``StoreClosedError`` at its next batch."""
        with self._scans_lock:
            scans = list(self._scans)
        for scan in scans:
            scan.close()

    def scan_arrow(self, topics=None, begin: int | None = None, end: int | None = None, check_crc: bool = True,
                   include_body: bool = True, *, max_rows: int = 8192, columns: Iterable[str] | None = None,
                   threads: int = 2):
        """Every message in log order as ``pyarrow.RecordBatch``es (the Spark source's columns, or ``columns``
        only: the others are never built), decoded by the compiled batch codec; read-only opens too. Raises
        the first ``CorruptDataError`` after yielding everything before it. The log is what the open recovered:
        a read-only open of a log damaged before intact records ends it at the damage (``recovery.resumes_at``
        says where they resume; ``StoreConfig.cut_damaged_log=False`` refuses such a log at the open). The store
        must stay open while the iterator is used. ``threads`` build batches while the caller's thread walks
        the log on (1.15-1.5x on two cores with 400-byte records); 0 does everything in the caller's thread."""
        self._check_open()
        from .codec.batch import message_columns, scan_arrow

        # every argument checked here, not at the first batch (a float offset reached the compiled walk)
        names = message_columns(columns)
        max_rows = _check_max_rows(max_rows)
        if not isinstance(threads, int) or isinstance(threads, bool) or not 0 <= threads <= 64:
            raise InvalidQueryError(f"threads must be an integer from 0 to 64, not {threads!r}")
        if topics is not None and not isinstance(topics, str):
            try:
                topics = list(topics)
            except TypeError:
                raise InvalidQueryError(f"topics must be a topic or a collection of topics, not {topics!r}") from None
            for topic in topics:
                check_str("topic", topic)
        if begin is not None:
            begin = check_int("begin", begin, error=OffsetOutOfRangeError)
            if self.commit_log.min_offset <= begin < self.commit_log.max_offset:
                self.commit_log.check_record_start(begin)  # as iter_messages: not a record start is no damage
        if end is not None:
            end = check_int("end", end, error=OffsetOutOfRangeError)
        scan = _Scan(self, self._while_open(scan_arrow(self.commit_log, topics, begin, end, check_crc, include_body,
                                                       max_rows=max_rows, columns=names, threads=threads)))
        with self._scans_lock:
            self._scans.add(scan)
        return scan

    def queue_arrow(self, topic: str, queue_id: int, begin: int | None = None, end: int | None = None,
                    tags: str | Iterable[str] | None = None, *, include_body: bool = True, max_rows: int = 8192):
        """The messages of one queue from queue offset ``begin`` up to ``end`` as ``pyarrow.RecordBatch``es
        (``scan_arrow``'s columns), queue order: ``get_message``'s answers without a message object each."""
        self._check_open()
        max_rows = _check_max_rows(max_rows)
        check_str("topic", topic)
        queue_id = check_int("queue_id", queue_id)
        begin = None if begin is None else check_int("begin", begin)
        end = None if end is None else check_int("end", end)
        return self._while_open(self._reader().queue_arrow(topic, queue_id, begin, end, tags,
                                                           include_body=include_body, max_rows=max_rows))

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
        self._check_open()
        return self.commit_log.queue_offsets.get((topic, queue_id), 0)

    def __repr__(self) -> str:
        mode = "read-only" if self.read_only else "read-write"
        return f"MessageStore({str(self.root)!r}, {mode}, log=[{self.min_phy_offset}, {self.max_phy_offset}))"


MAX_BATCH_ROWS = 1 << 24  # rows a scan's batch may be asked to hold (its buffers are sized by it)


class _Scan:
    """``scan_arrow``'s iterator: the store's ``close()`` closes it (its read-ahead holds views of the segments,
    which would keep a mapping alive), and it raises ``StoreClosedError`` when used after that."""

    def __init__(self, store: MessageStore, batches: Iterator) -> None:
        self._store = store
        self._batches = batches
        self._done = False

    def __iter__(self) -> _Scan:
        return self

    def __next__(self):
        if self._store._closed and not self._done:
            self.close()
            raise StoreClosedError(f"store {self._store.root} was closed while this iterator was in use")
        try:
            return next(self._batches)
        except BaseException:
            self._done = not self._store._closed
            raise

    def throw(self, *args):  # a generator's, as scan_arrow returned before
        return self._batches.throw(*args)

    def close(self) -> None:
        with contextlib.suppress(ValueError):  # "generator already executing": it ends at its next batch
            self._batches.close()


def _check_max_rows(max_rows: object) -> int:
    if not isinstance(max_rows, int) or isinstance(max_rows, bool) or not 1 <= max_rows <= MAX_BATCH_ROWS:
        raise InvalidQueryError(f"max_rows must be an integer from 1 to {MAX_BATCH_ROWS}, not {max_rows!r}")
    return max_rows


def _refuse_queue(topic: str, queue_id: int, queues: int, perm: int | None) -> None:
    if queue_id >= queues:
        raise InvalidQueueError(f"queue {queue_id} does not exist: topic {topic} has {queues} write queues")
    raise TopicNotWritableError(f"topic {topic} is not writable (perm {perm})")


def _clear_staging(staging: Path) -> None:
    """Remove files a killed writer left half-prepared (only used where O_TMPFILE is not available)."""
    try:
        entries = list(os.scandir(staging))
    except FileNotFoundError:
        return
    except OSError as exc:
        raise StoreIOError(exc.errno, f"cannot list {staging}: {exc.strerror}") from exc
    for entry in entries:
        if entry.is_file(follow_symlinks=False) and entry.name.endswith(".tmp"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)


_new_put_result = functools.partial(tuple.__new__, PutMessageResult)


def put_results(status: PutMessageStatus, host_hex: str, first: int, uniq_keys: Sequence[str | None],
                queue_offsets: Sequence[int], store_ts: int, sizes: Sequence[int]) -> list[PutMessageResult]:
    """One ``PutMessageResult`` per record of a put, built by C loops: the offsets' hex in one pass and the tuples
    made from ``zip`` (a Python loop with an f-string and the named tuple's ``__new__`` per record was 0.5-0.9
    us a message, a sixth of ``put_messages(32)``)."""
    n = len(sizes)
    phys = list(itertools.accumulate(sizes[: n - 1], initial=first))
    hexes = struct.pack(f">{n}q", *phys).hex().upper()
    ids = [host_hex + hexes[i : i + 16] for i in range(0, 16 * n, 16)]
    return list(map(_new_put_result, zip(itertools.repeat(status, n), ids, uniq_keys, phys, queue_offsets,
                                          itertools.repeat(store_ts, n), sizes, strict=True)))

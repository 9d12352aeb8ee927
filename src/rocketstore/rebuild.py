"""Rebuilding consume queues and index files from the commit log: the steps every rebuild shares.

``rebuild_from_log`` takes the store's lock, recovers the log, and writes new ``consumequeue/`` and ``index/``
in a staging directory from the dispatch columns a decoder hands it in log order; only when they are complete
are the old ones moved aside and the new ones renamed into place (crash-safely: ``swap``). A failed rebuild
leaves the old ones where they were. ``rebuild`` decodes in this process with the batch codec's dispatch walk
(no JVM: on one machine the fastest way); ``rocketstore.spark.jobs.rebuild`` decodes on Spark, window by window.
Both feed ``RebuildWriter``, which makes the calls the store's own dispatch makes, so the files are
byte-identical to it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import shutil
import time
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .brokerconfig import TopicConfigManager
from .brokerlayout import check_writer_layout, is_lmq
from .checkpoint import StoreCheckpoint
from .commitlog import COMMITLOG_DIR, CommitLog
from .config import StoreConfig, detect_config
from .consumequeue import CONSUMEQUEUE_DIR, ConsumeQueueTable
from .index.service import INDEX_DIR, IndexService
from .lifecycle import ABORT_FILE, StoreLock
from .mapped.file import STAGING_DIR, copy_sparse, unused_path
from .message import SysFlag
from .recovery import RECOVERY_DIR, recover_commit_log
from .spark.partitions import DEFAULT_MAX_BYTES_PER_PARTITION, ScanOptions, plan_ranges, read_range  # no pyspark
from .store import StoreNotFoundError
from .swap import REBUILD_PREFIX, finish_staged, mark_complete, swap_in

Progress = Callable[[str, int, int], None]  # (stage description, tasks done, tasks total)
# (root, config, low, end) -> (table, tasks it took) in log order
Decoder = Callable[[Path, StoreConfig, int, int], Generator[tuple[pa.Table, int], None, None]]


@dataclass(slots=True)
class RebuildReport:
    """What a rebuild wrote, from how many records, in how many tasks and windows, and where the old files went."""

    records: int = 0
    queues: int = 0
    queue_units: int = 0
    index_keys: int = 0
    index_files: int = 0
    partitions: int = 0
    windows: int = 0  # decoded pieces of the log written one after another (Spark: one job each)
    moved_aside: list[str] = field(default_factory=list)
    seconds: float = 0.0



DISPATCH_COLUMNS = ["topic", "queueId", "queueOffset", "commitLogOffset", "storeSize", "tagsCode",
                     "storeTimestamp", "sysFlag", "indexKeyHashes"]
DISPATCH_SCHEMA = ScanOptions(columns=tuple(DISPATCH_COLUMNS)).output_schema

class RebuildWriter:
    """Consume queues and index files from a rebuild's columns, fed in log order one table at a time: the
    same calls the store's dispatch makes, so the files are byte-identical to it."""

    def __init__(self, root: Path, config: StoreConfig, checkpoint: StoreCheckpoint,
                 clock: Callable[[], int] | None, consume_queues: bool, index: bool) -> None:
        self.root, self.config, self.checkpoint = root, config, checkpoint
        self.consume_queues = consume_queues
        self.queues: ConsumeQueueTable | None = None  # made at the first unit: an empty log makes no directory
        self.index = IndexService(root, config, checkpoint, clock=clock) if index else None
        self.records = self.units = self.keys = 0
        self.logics_ms = 0
        self.last_offset = -1

    def add(self, table: pa.Table) -> None:
        if not table.num_rows:
            return
        table = table.sort_by("commitLogOffset")
        offsets = table["commitLogOffset"].to_numpy()
        if offsets[0] <= self.last_offset:  # pragma: no cover - Spark returned partitions out of order: a bug
            raise RuntimeError(f"rebuild: records at {offsets[0]} arrived after {self.last_offset}")
        self.last_offset = int(offsets[-1])
        self.records += table.num_rows
        if self.consume_queues:
            self._put_queue_units(table)
        if self.index is not None:
            self._put_index_entries(table)

    def _put_queue_units(self, table: pa.Table) -> None:
        sys_flags = table["sysFlag"].to_numpy()
        tran = sys_flags & SysFlag.TRANSACTION_MASK
        keep = (tran == SysFlag.TRANSACTION_NOT_TYPE) | (tran == SysFlag.TRANSACTION_COMMIT_TYPE)
        rows = table.filter(pa.array(keep))
        if rows.num_rows == 0:
            return
        if self.queues is None:
            self.queues = ConsumeQueueTable(self.root, self.config)
        topics = rows["topic"].combine_chunks().dictionary_encode()
        topic_ids = topics.indices.to_numpy().astype(np.int64)
        queue_ids = rows["queueId"].to_numpy().astype(np.int64)
        group = topic_ids * (1 << 32) + queue_ids
        order = np.argsort(group, kind="stable")  # log order within each queue
        group_sorted = group[order]
        bounds = np.flatnonzero(np.diff(group_sorted)) + 1
        queue_offsets = rows["queueOffset"].to_numpy()[order]
        phys = rows["commitLogOffset"].to_numpy()[order]
        sizes = rows["storeSize"].to_numpy()[order]
        tags = rows["tagsCode"].to_numpy()[order]
        names = topics.dictionary.to_pylist()
        for lo, hi in zip(np.concatenate([[0], bounds]), np.concatenate([bounds, [len(order)]]), strict=True):
            g = int(group_sorted[lo])
            queue = self.queues.find_or_create(names[g >> 32], g & 0xFFFFFFFF)
            self.units += queue.put_positions(queue_offsets[lo:hi], phys[lo:hi], sizes[lo:hi], tags[lo:hi])
        self.logics_ms = int(_epoch_ms(rows["storeTimestamp"])[-1])

    def _put_index_entries(self, table: pa.Table) -> None:
        assert self.index is not None
        hashes_list = table["indexKeyHashes"].combine_chunks()
        counts = pc.list_value_length(hashes_list).to_numpy(zero_copy_only=False)
        hashes = pc.list_flatten(hashes_list).to_numpy()
        phys = np.repeat(table["commitLogOffset"].to_numpy(), counts)
        stamps = np.repeat(_epoch_ms(table["storeTimestamp"]), counts)
        last_with_keys = np.flatnonzero(counts)
        records_follow = not len(last_with_keys) or last_with_keys[-1] < len(counts) - 1
        # a table's first record rolls a full file as its own buildIndex call would (in build_index_hashes)
        self.index.build_index_hashes(hashes, phys, stamps, records_follow=bool(records_follow))
        self.keys += len(hashes)

    def finish(self, report: RebuildReport) -> None:
        report.records = self.records
        if self.queues is not None:
            self.queues.flush(0)
            report.queues, report.queue_units = len(self.queues.queues), self.units
            if self.logics_ms:
                self.checkpoint.logics_msg_timestamp = self.logics_ms
        if self.index is not None:
            report.index_files, report.index_keys = len(self.index.files), self.keys
            durable = self.index.flush()
            self.checkpoint.index_msg_timestamp = max(self.checkpoint.index_msg_timestamp, durable)

    def close(self) -> None:
        if self.queues is not None:
            self.queues.close()
        if self.index is not None:
            self.index.close()


def _epoch_ms(column: pa.ChunkedArray) -> np.ndarray:
    return column.cast(pa.int64()).to_numpy() // 1000


def _carry_lmq_queues(root: Path, build: Path, config: StoreConfig, log_end: int) -> None:
    """Copy a broker's LMQ queues into the rebuilt ``consumequeue/``: no record names them (their units come from
    the broker's multi-dispatch), so a rebuild cannot write them again (``brokerlayout``). Copied with their holes
    (a broker's 6 MB file of one unit costs a page), not moved (the old set stays whole until the swap, which a
    kill before it must find untouched), and cut where the recovered log ends, as every queue is."""
    old, new = root / CONSUMEQUEUE_DIR, build / CONSUMEQUEUE_DIR
    try:
        topics = [entry.name for entry in os.scandir(old) if entry.is_dir() and is_lmq(entry.name)]
    except FileNotFoundError:
        return
    for topic in topics:
        for directory, _dirs, files in os.walk(old / topic):
            target = new / Path(directory).relative_to(old)
            target.mkdir(parents=True, exist_ok=True)
            for name in files:
                copy_sparse(Path(directory) / name, target / name)
    carried = ConsumeQueueTable(build, config)
    carried.lmq_dirs = topics
    carried.truncate_lmq(log_end)


def rebuild_from_log(root: str | Path, config: StoreConfig | None, decode: Decoder, *, consume_queues: bool = True,
                     index: bool = True, clock: Callable[[], int] | None = None,
                     explicit: Iterable[str] | None = None) -> RebuildReport:
    """Rebuild ``consumequeue/`` and ``index/`` from the tables ``decode(root, config, low, end)`` yields for the
    log's ``[low, end)`` (dispatch columns, log order; each with the tasks it took).

    The store must not be open for writing (the lock is taken). The new directories are built aside and swapped
    in only when complete (``swap``): a rebuild that fails leaves the old ones in place. The old directories are
    then moved to ``recovery/rebuild-<time>/``, not deleted. ``clock`` names index files (default: now).
    ``explicit``: the geometry settings of ``config`` that the files must not replace (``detect_config``'s;
    default: those that differ from RocketMQ's defaults).
    """
    started = time.monotonic()
    root = Path(os.path.abspath(root))
    if not (root / COMMITLOG_DIR).is_dir():  # before the lock: a wrong path must not become an empty store
        raise StoreNotFoundError(f"{root} holds no store (no {COMMITLOG_DIR} directory)")
    config = detect_config(root, config, explicit=explicit)
    report = RebuildReport()
    lock = StoreLock(root)
    lock.acquire()
    try:
        finish_staged(root / STAGING_DIR, root)  # an earlier rebuild killed mid-swap is finished first
        topics = TopicConfigManager(root, read_only=True)
        topics.load(empty_if_bad=True)  # a rebuild needs no topic, only to know a broker's BatchCQ ones
        check_writer_layout(root, topics)
        commit_log = CommitLog(root, config)
        commit_log.load()
        checkpoint = StoreCheckpoint.load(root / "checkpoint")
        recovery = recover_commit_log(commit_log, checkpoint, root, abnormal=(root / ABORT_FILE).exists())
        log_end, low = recovery.end_offset, commit_log.min_offset
        commit_log.close()
        stamp = time.strftime("%Y%m%d%H%M%S")
        names = [name for name, wanted in ((CONSUMEQUEUE_DIR, consume_queues), (INDEX_DIR, index)) if wanted]
        # Built aside while the old directories stay in place: a rebuild that fails (damage in the log, a full
        # disk, a cancelled job) or is killed leaves the store as it was. Once complete and durable, a marker
        # makes the swap final; a kill during it is finished by the next open or rebuild (``swap``).
        build = unused_path(root / STAGING_DIR, f"{REBUILD_PREFIX}{stamp}")
        build.mkdir(parents=True)
        try:
            writer = RebuildWriter(build, config, checkpoint, clock, consume_queues,
                                   index and config.message_index_enable)
            try:
                # closed on a writer's error too: a decoder with work in flight (a Spark job) ends it at once
                with contextlib.closing(decode(root, config, low, log_end)) as tables:
                    for table, tasks in tables:
                        writer.add(table)
                        report.partitions += tasks
                        report.windows += 1
                writer.finish(report)
            finally:
                writer.close()
            if consume_queues:
                _carry_lmq_queues(root, build, config, log_end)
            # one directory per rebuild, never one an earlier rebuild this second used
            aside = unused_path(root / RECOVERY_DIR, f"{REBUILD_PREFIX}{stamp}")
            mark_complete(build, root, names, aside)
        except BaseException:
            shutil.rmtree(build, ignore_errors=True)  # the old set is untouched
            raise
        report.moved_aside = swap_in(build, root)
        checkpoint.flush()
    finally:
        lock.release()
    report.seconds = time.monotonic() - started
    return report


def rebuild(root: str | Path, *, config: StoreConfig | None = None, consume_queues: bool = True, index: bool = True,
            max_bytes_per_task: int = DEFAULT_MAX_BYTES_PER_PARTITION, clock: Callable[[], int] | None = None,
            progress: Progress | None = None, explicit: Iterable[str] | None = None) -> RebuildReport:
    """``rebuild_from_log`` decoding in this process (``local_decoder``)."""
    return rebuild_from_log(root, config, local_decoder(max_bytes_per_task, progress), consume_queues=consume_queues,
                            index=index, clock=clock, explicit=explicit)


def local_decoder(max_bytes_per_task: int = DEFAULT_MAX_BYTES_PER_PARTITION,
                  progress: Progress | None = None) -> Decoder:
    """The log in ranges of ``max_bytes_per_task``, each walked by the batch codec's dispatch walk (CRCs unchecked,
    bodies unread, as the store's dispatch reads them), the next one decoded while one is written: memory holds
    two ranges' columns."""

    def decode(root: Path, config: StoreConfig, low: int, end: int) -> Generator[tuple[pa.Table, int], None, None]:
        options = ScanOptions(columns=tuple(DISPATCH_COLUMNS), include_body=False, check_crc=False,
                              starting_offset=low, ending_offset=end, validated_log_end=end,
                              max_bytes_per_partition=max_bytes_per_task,
                              commit_log_file_size=config.mapped_file_size_commit_log,
                              delay_levels_ms=config.delay_levels_ms)  # a parked message's tags code is its due time
        tasks = plan_ranges([root], options)

        def decoded(task) -> pa.Table:
            return pa.Table.from_batches([b for piece in task for b in read_range(piece, options)], DISPATCH_SCHEMA)

        # the next range is decoded in a thread while this one is written (the walk's kernels release the GIL)
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rocketstore-rebuild") as pool:
            ahead = [pool.submit(decoded, task) for task in tasks[:1]]
            for done in range(1, len(tasks) + 1):
                table = ahead.pop().result()
                if done < len(tasks):
                    ahead.append(pool.submit(decoded, tasks[done]))
                if progress is not None:
                    progress("decoding the commit log", done, len(tasks))
                yield table, 1

    return decode

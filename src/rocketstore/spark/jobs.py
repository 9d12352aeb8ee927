"""The pipeline's jobs: read, rebuild, export, import, find keys. Each takes a SparkSession (or a master URL).

* ``rebuild``: consume queues and index files from the commit log. Spark tasks decode byte
  ranges of the log and hash every index key in parallel; the driver writes the queues and
  index files with numpy, byte-identical to what the store's own dispatch writes.
* ``export_parquet``: messages to Parquet, partitioned by topic and date.
* ``import_messages``: a DataFrame of messages appended through the store's single writer.
* ``find_keys``: many (topic, key) pairs in many stores, through their indexes, verified exactly.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..checkpoint import StoreCheckpoint
from ..commitlog import CommitLog
from ..config import StoreConfig, detect_config
from ..consumequeue import CONSUMEQUEUE_DIR, ConsumeQueueTable
from ..errors import ConfigError, RocketStoreError
from ..index.service import INDEX_DIR, IndexService
from ..lifecycle import ABORT_FILE, StoreLock
from ..mapped.file import STAGING_DIR, fsync_dir
from ..message import Message, SysFlag
from ..recovery import RECOVERY_DIR, recover_commit_log
from ..store import MessageStore
from .failures import in_task
from .partitions import (
    ARROW_FIELDS,
    MESSAGE_DDL,
    MessageColumns,
    ScanOptions,
    append_message,
    broker_name_of,
    require_visible,
    resolve_roots,
)
from .session import spark_session

log = logging.getLogger(__name__)

Progress = Callable[[str, int, int], None]  # (stage description, tasks done, tasks total)


def session(spark=None, master: str | None = None):
    return spark if spark is not None else spark_session(master)


def read_store(spark, paths: str | Path | Iterable[str | Path], **options: object):
    """``spark.read.format("rocketmq")`` with options given as keyword arguments (see ``source``).

    Paths (and globs) are made absolute here, in the driver's working directory: Spark plans in a
    worker process of the JVM, whose directory need not be this one.
    """
    items = str(paths).split(",") if isinstance(paths, str | Path) else [str(p) for p in paths]
    path = ",".join(os.path.abspath(os.path.expanduser(item.strip())) for item in items if item.strip())
    reader = spark.read.format("rocketmq")
    for key, value in options.items():
        if value is not None:
            reader = reader.option(key, str(value).lower() if isinstance(value, bool) else str(value))
    return reader.load(path)


@contextlib.contextmanager
def report_progress(spark, progress: Progress | None, description: str, every: float = 0.2) -> Iterator[None]:
    """Poll Spark's status tracker and report task counts of the running stages."""
    if progress is None:
        yield
        return
    tracker = spark.sparkContext.statusTracker()
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(every):
            done = total = 0
            for stage_id in tracker.getActiveStageIds():
                info = tracker.getStageInfo(stage_id)
                if info is not None:
                    done += info.numCompletedTasks
                    total += info.numTasks
            if total:
                progress(description, done, total)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


# --- rebuild ------------------------------------------------------------------------------------

@dataclass(slots=True)
class RebuildReport:
    records: int = 0
    queues: int = 0
    queue_units: int = 0
    index_keys: int = 0
    index_files: int = 0
    partitions: int = 0
    moved_aside: list[str] = field(default_factory=list)
    seconds: float = 0.0


_DISPATCH_COLUMNS = ["topic", "queueId", "queueOffset", "commitLogOffset", "storeSize", "tagsCode",
                     "storeTimestamp", "sysFlag", "indexKeyHashes"]


def rebuild(root: str | Path, *, spark=None, master: str | None = None, config: StoreConfig | None = None,
            consume_queues: bool = True, index: bool = True, max_bytes_per_partition: int | None = None,
            clock: Callable[[], int] | None = None, progress: Progress | None = None) -> RebuildReport:
    """Rebuild ``consumequeue/`` and ``index/`` of a store from its commit log, in parallel.

    The store must not be open for writing (the lock is taken). The old directories are moved to
    ``recovery/rebuild-<time>/``, not deleted. ``clock`` names index files (default: now).
    """
    started = time.monotonic()
    root = Path(os.path.abspath(root))
    config = detect_config(root, config)
    report = RebuildReport()
    lock = StoreLock(root)
    lock.acquire()
    try:
        commit_log = CommitLog(root, config)
        commit_log.load()
        checkpoint = StoreCheckpoint.load(root / "checkpoint")
        recovery = recover_commit_log(commit_log, checkpoint, root, abnormal=(root / ABORT_FILE).exists())
        log_end = recovery.end_offset
        commit_log.close()
        stamp = time.strftime("%Y%m%d%H%M%S")
        for name, wanted in ((CONSUMEQUEUE_DIR, consume_queues), (INDEX_DIR, index)):
            if wanted and (root / name).exists():
                target = root / RECOVERY_DIR / f"rebuild-{stamp}" / name
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(str(root / name), str(target))
                report.moved_aside.append(str(target))
        spark = session(spark, master)
        df = read_store(spark, root, dispatchInfo=True, includeBody=False, checkCRC=False,
                        endingOffset=log_end, maxBytesPerPartition=max_bytes_per_partition,
                        mappedFileSizeCommitLog=config.mapped_file_size_commit_log)
        with report_progress(spark, progress, "decoding the commit log"):
            table = df.select(*_DISPATCH_COLUMNS).toArrow()
        report.partitions = df.rdd.getNumPartitions() if hasattr(df, "rdd") else 0
        table = table.sort_by("commitLogOffset")
        report.records = table.num_rows
        # Built aside and renamed into place when complete: a kill mid-build leaves the directories missing,
        # and a store open rebuilds missing ones from the whole log (a half-written one would be trusted).
        build = root / STAGING_DIR / f"rebuild-{stamp}"
        shutil.rmtree(build, ignore_errors=True)
        build.mkdir(parents=True)
        if consume_queues:
            report.queues, report.queue_units, logics = _write_queues(build, config, table)
            if logics:
                checkpoint.logics_msg_timestamp = logics
        if index and config.message_index_enable:
            report.index_keys, report.index_files, durable = _write_index(build, config, checkpoint, table, clock)
            checkpoint.index_msg_timestamp = max(checkpoint.index_msg_timestamp, durable)
        for name in (CONSUMEQUEUE_DIR, INDEX_DIR):
            if (build / name).exists():
                os.replace(build / name, root / name)
        fsync_dir(root)
        shutil.rmtree(build, ignore_errors=True)
        checkpoint.flush()
    finally:
        lock.release()
    report.seconds = time.monotonic() - started
    return report


def _epoch_ms(column: pa.ChunkedArray) -> np.ndarray:
    return column.cast(pa.int64()).to_numpy() // 1000


def _write_queues(root: Path, config: StoreConfig, table: pa.Table) -> tuple[int, int, int]:
    sys_flags = table["sysFlag"].to_numpy()
    tran = sys_flags & SysFlag.TRANSACTION_MASK
    keep = (tran == SysFlag.TRANSACTION_NOT_TYPE) | (tran == SysFlag.TRANSACTION_COMMIT_TYPE)
    rows = table.filter(pa.array(keep))
    if rows.num_rows == 0:
        return 0, 0, 0
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
    table_of_queues = ConsumeQueueTable(root, config)
    units = 0
    try:
        for lo, hi in zip(np.concatenate([[0], bounds]), np.concatenate([bounds, [len(order)]]), strict=True):
            g = int(group_sorted[lo])
            queue = table_of_queues.find_or_create(names[g >> 32], g & 0xFFFFFFFF)
            units += queue.put_positions(queue_offsets[lo:hi], phys[lo:hi], sizes[lo:hi], tags[lo:hi])
        table_of_queues.flush(0)
        count = len(table_of_queues.queues)
    finally:
        table_of_queues.close()
    return count, units, int(_epoch_ms(rows["storeTimestamp"])[-1])


def _write_index(root: Path, config: StoreConfig, checkpoint: StoreCheckpoint, table: pa.Table,
                 clock: Callable[[], int] | None) -> tuple[int, int, int]:
    hashes_list = table["indexKeyHashes"].combine_chunks()
    counts = pc.list_value_length(hashes_list).to_numpy(zero_copy_only=False)
    hashes = pc.list_flatten(hashes_list).to_numpy()
    phys = np.repeat(table["commitLogOffset"].to_numpy(), counts)
    stamps = np.repeat(_epoch_ms(table["storeTimestamp"]), counts)
    last_with_keys = np.flatnonzero(counts)
    records_follow = bool(len(counts)) and (not len(last_with_keys) or last_with_keys[-1] < len(counts) - 1)
    service = IndexService(root, config, checkpoint, clock=clock)
    try:
        if table.num_rows:
            service.build_index_hashes(hashes, phys, stamps, records_follow=records_follow)
        files = len(service.files)
        durable = service.flush()
    finally:
        service.close()
    return len(hashes), files, durable


# --- export and import ----------------------------------------------------------------------------

def export_parquet(paths, out: str | Path, *, spark=None, master: str | None = None,
                   topics: Iterable[str] | None = None, begin: int | None = None, end: int | None = None,
                   mode: str = "overwrite", progress: Progress | None = None, **options: object) -> int:
    """Write messages to Parquet under ``out``, partitioned by topic and (UTC) date; returns the row count."""
    from pyspark.sql import functions as F

    spark = session(spark, master)
    out = str(out) if "://" in str(out) else os.path.abspath(out)  # a local path means the same on every host
    df = read_store(spark, paths, topics=",".join(topics) if topics else None, startingTimestamp=begin,
                    endingTimestamp=end, **options)
    df = df.withColumn("date", F.to_date("storeTimestamp"))
    with report_progress(spark, progress, "exporting to Parquet"):
        df.write.mode(mode).partitionBy("topic", "date").parquet(out)
    return spark.read.parquet(out).count()


@dataclass(slots=True)
class ImportReport:
    rows: int = 0
    batches: int = 0
    first_offset: int | None = None
    last_offset: int | None = None


def import_messages(df, root: str | Path, *, config: StoreConfig | None = None, batch_size: int = 256,
                    progress: Progress | None = None) -> ImportReport:
    """Append every row of ``df`` to the store through its single writer, each exactly once.

    Columns: ``topic`` and ``body`` (binary or string) are required; ``keys`` (array or
    space-separated string), ``tags``, ``properties`` (map) and ``queueId`` are optional. Rows
    stream to the driver in partition order; each batch is one all-or-nothing append. A bad row
    stops the import with an error naming it; the rows before it stay stored (the report says how many).
    """
    columns = set(df.columns)
    missing = {"topic", "body"} - columns
    if missing:
        raise ConfigError(f"import needs columns topic and body; missing {sorted(missing)}")
    report = ImportReport()
    root = Path(root)
    config = detect_config(root, config) if (root / "commitlog").is_dir() else (config or StoreConfig())
    with MessageStore.open(root, config) as store:
        batch: list[Message] = []
        for row in df.toLocalIterator(prefetchPartitions=True):
            batch.append(_row_message(row.asDict(), report.rows + len(batch)))
            if len(batch) >= batch_size:
                _put(store, batch, report, progress)
        _put(store, batch, report, progress)
    return report


def _row_message(row: dict, index: int) -> Message:
    body = row.get("body")
    if isinstance(body, bytearray | memoryview):
        body = bytes(body)
    keys = row.get("keys") or ()
    try:
        return Message(topic=row["topic"], body=body, tags=row.get("tags"), keys=keys,
                       properties=dict(row["properties"]) if row.get("properties") else None,
                       queue_id=int(row.get("queueId") or 0))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"row {index} is not a message: {exc}") from None


def _put(store: MessageStore, batch: list[Message], report: ImportReport, progress: Progress | None) -> None:
    if not batch:
        return
    try:
        results = store.put_messages(batch)
    except RocketStoreError as exc:
        raise type(exc)(f"row {report.rows}..{report.rows + len(batch) - 1} rejected ({report.rows} rows "
                        f"stored before it): {exc}") from exc
    report.rows += len(batch)
    report.batches += 1
    report.first_offset = results[0].commit_log_offset if report.first_offset is None else report.first_offset
    report.last_offset = results[-1].commit_log_offset
    batch.clear()
    if progress is not None:
        progress("importing", report.rows, 0)


# --- keys at scale ---------------------------------------------------------------------------------

QUERY_FIELDS = [("queryTopic", pa.string()), ("queryKey", pa.string())]


def find_keys(paths, keys, *, spark=None, master: str | None = None, begin: int = 0, end: int | None = None,
              max_num: int = 64, config: StoreConfig | None = None, partitions: int | None = None):
    """Messages matching many ``(topic, key)`` pairs across many stores, found through their indexes.

    ``keys`` is a list of (topic, key) tuples or a DataFrame with columns ``topic`` and ``key``.
    Matching is exact (topic and key verified on the record). Returns a DataFrame with the
    message columns plus ``queryTopic`` and ``queryKey``.
    """
    spark = session(spark, master)
    roots = [str(r) for r in resolve_roots(paths if isinstance(paths, str) else ",".join(map(str, paths)))]
    if isinstance(keys, list | tuple):
        keys_df = spark.createDataFrame([(str(t), str(k)) for t, k in keys], "topic string, key string")
    else:
        keys_df = keys.select("topic", "key")
    stores = spark.createDataFrame([(r,) for r in roots], "root string")
    pairs = stores.crossJoin(keys_df).repartition(partitions or max(2, spark.sparkContext.defaultParallelism))
    base = config or StoreConfig()
    schema = pa.schema(ARROW_FIELDS + QUERY_FIELDS)

    def lookup(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        stores_open: dict[str, MessageStore] = {}
        with in_task():
            try:
                for batch in batches:
                    out = MessageColumns(False)
                    query_topics, query_keys = [], []
                    for root, topic, key in zip(*(batch.column(i).to_pylist() for i in range(3)), strict=True):
                        store = stores_open.get(root)
                        if store is None:
                            require_visible(root)
                            store = stores_open[root] = MessageStore.open(
                                root, detect_config(root, base.replace(check_crc_on_recover=False)), read_only=True)
                        for msg in store.query_message(topic, key, max_num, begin, end):
                            append_message(out, msg, broker_name_of(Path(root)), ScanOptions())
                            query_topics.append(topic)
                            query_keys.append(key)
                    if len(out):
                        found = out.batch()
                        yield pa.RecordBatch.from_arrays(
                            [*found.columns, pa.array(query_topics), pa.array(query_keys)], schema=schema)
            finally:
                for store in stores_open.values():
                    store.close()

    schema_ddl = MESSAGE_DDL + ", queryTopic string, queryKey string"
    return pairs.select("root", "topic", "key").mapInArrow(lookup, schema_ddl)


def messages_per_topic_and_minute(df):
    """The demo's summary: message counts by topic and by minute of store time."""
    from pyspark.sql import functions as F

    per_topic = df.groupBy("topic").count().orderBy("topic")
    per_minute = df.groupBy(F.date_trunc("minute", "storeTimestamp").alias("minute")).count().orderBy("minute")
    return per_topic, per_minute

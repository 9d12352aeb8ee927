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
import hashlib
import logging
import os
import re
import shutil
import threading
import uuid
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..codec.properties import split_keys
from ..config import StoreConfig, detect_config
from ..errors import ConfigError, RocketStoreError, StoreIOError
from ..importjournal import ImportJournal, ImportProgress, describe_source, rows_stored
from ..rebuild import DISPATCH_COLUMNS, DISPATCH_SCHEMA, RebuildReport, rebuild_from_log
from ..store import MessageStore
from .failures import in_task
from .heap import settle_after_task
from .partitions import (
    DEFAULT_MAX_BYTES_PER_PARTITION,
    DISPATCH_DDL,
    MESSAGE_DDL,
    ScanOptions,
    broker_name_of,
    check_log_ends,
    ddl_fields,
    require_visible,
    resolve_roots,
    unpacked,
)
from .session import spark_session

log = logging.getLogger(__name__)

Progress = Callable[[str, int, int], None]  # (stage description, tasks done, tasks total)
Item = TypeVar("Item")


def session(spark=None, master: str | None = None):
    return spark if spark is not None else spark_session(master)


def read_store(spark, paths: str | Path | Iterable[str | Path], *, columns: Iterable[str] | None = None,
               packed: bool = False, **options: object):
    """``spark.read.format("rocketmq")`` with options given as keyword arguments (see ``source``).

    ``columns`` names the columns wanted (the others are never decoded: the source cannot see a later
    ``select``). ``packed`` returns them as rows of Arrow IPC (source option ``packArrow``; read them with
    ``partitions.unpacked``). ``minPartitions`` defaults to the session's parallelism, so every core gets a task of the
    same size. Paths (and globs) are made absolute here, in the driver's working directory: Spark plans in
    a worker process of the JVM, whose directory need not be this one.
    """
    path = ",".join(_path_list(paths))
    reader = spark.read.format("rocketmq")
    if columns is not None:
        names = [columns] if isinstance(columns, str) else list(columns)
        types = dict(ddl_fields(MESSAGE_DDL + DISPATCH_DDL))
        ScanOptions().with_schema([(name, types.get(name, "")) for name in names])  # the source's checks, here
        if packed:
            options["columns"] = ",".join(names)
        else:
            reader = reader.schema(", ".join(f"{name} {types[name]}" for name in names))
    if packed:
        options["packArrow"] = True
    if not any(key.lower() == "minpartitions" for key in options):
        options["minPartitions"] = _parallelism(spark)
    for key, value in _option_strings(options).items():
        reader = reader.option(key, value)
    return reader.load(path)


def _path_list(paths: str | Path | Iterable[str | Path]) -> list[str]:
    """Store paths (a comma-separated string or an iterable, globs kept), absolute in this process."""
    items = str(paths).split(",") if isinstance(paths, str | Path) else [str(p) for p in paths]
    return [os.path.abspath(os.path.expanduser(item.strip())) for item in items if item.strip()]


def _option_strings(options: dict) -> dict[str, str]:
    """Keyword options as the source's strings (booleans lower case); None means not given."""
    return {key: str(value).lower() if isinstance(value, bool) else str(value)
            for key, value in options.items() if value is not None}


def _parallelism(spark) -> int:
    """The session's default parallelism (its cores); 1 where it cannot be read (a Spark Connect session)."""
    try:
        return max(1, int(spark.sparkContext.defaultParallelism))
    except Exception:  # Spark Connect has no SparkContext: one task per 64 MiB is then the plan
        return 1


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

REBUILD_WINDOW_BYTES = 1 << 30  # of log per rebuild job at least (the driver holds two windows' columns)


def rebuild(root: str | Path, *, spark=None, master: str | None = None, config: StoreConfig | None = None,
            consume_queues: bool = True, index: bool = True, max_bytes_per_partition: int | None = None,
            clock: Callable[[], int] | None = None, progress: Progress | None = None,
            explicit: Iterable[str] | None = None) -> RebuildReport:
    """Rebuild ``consumequeue/`` and ``index/`` of a store from its commit log, decoded by Spark tasks.

    The store must not be open for writing (the lock is taken). The new directories replace the old ones only
    when complete (a failed rebuild leaves the old ones in place); the old directories are then moved to
    ``recovery/rebuild-<time>/``, not deleted. ``clock`` names index files (default: now).
    ``rocketstore.rebuild.rebuild`` does the same in this process (no JVM: faster on one machine). ``explicit``:
    the geometry settings of ``config`` the files must not replace (``detect_config``'s).
    """

    def decode(root: Path, config: StoreConfig, low: int, end: int) -> Generator[tuple[pa.Table, int], None, None]:
        running = session(spark, master)  # started once the store is locked: a locked store is refused first
        with report_progress(running, progress, "decoding the commit log"):
            windows = _dispatch_windows(running, root, low, end, config, max_bytes_per_partition)
            yield from read_ahead(running, windows, "rocketstore rebuild")

    return rebuild_from_log(root, config, decode, consume_queues=consume_queues, index=index, clock=clock,
                            explicit=explicit)


_DONE = object()


def read_ahead(spark, items: Iterator[Item], description: str) -> Iterator[Item]:
    """``items``, each next one made in a thread while the caller works on the current one: a rebuild's
    driver writes window k while the cluster decodes window k+1 (two windows' columns on the driver at most).
    Its jobs run in a job group of their own; if the caller stops early (an error while writing), the job in
    flight is cancelled and waited for, so nothing outlives the call."""
    import concurrent.futures

    context = spark.sparkContext
    group = f"rocketstore-{uuid.uuid4().hex}"

    def step():
        context.setJobGroup(group, description)  # a thread-local property: only this thread's jobs
        return next(items, _DONE)

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rocketstore-read-ahead") as pool:
        pending = pool.submit(step)
        try:
            while (item := pending.result()) is not _DONE:
                pending = pool.submit(step)
                yield item
        finally:
            if not pending.done():
                context.cancelJobGroup(group)
            concurrent.futures.wait([pending])


def _dispatch_windows(spark, root: Path, low: int, end: int, config: StoreConfig,
                      max_bytes_per_partition: int | None) -> Iterator[tuple[pa.Table, int]]:
    """The rebuild's columns of the log ``[low, end)``, one window of the log per Spark job (its tasks as
    parallel as the cluster), with the job's task count. The driver holds two windows' columns at most (the
    one being written and the next, ``read_ahead``), never the whole log's (~80 bytes a record: 80 GB for a
    billion). Packed: they reach the driver as Arrow IPC, never
    as JVM rows (1 M records on local[2]: the rebuild 2.7-3.4 -> 2.3-2.5 s)."""
    per_task = max_bytes_per_partition or DEFAULT_MAX_BYTES_PER_PARTITION
    window = max(REBUILD_WINDOW_BYTES, 4 * _parallelism(spark) * per_task)
    for start in range(low, end, window):
        df = read_store(spark, root, columns=DISPATCH_COLUMNS, packed=True, includeBody=False, checkCRC=False,
                        startingOffset=start, endingOffset=min(end, start + window), validatedLogEnd=end,
                        maxBytesPerPartition=max_bytes_per_partition,
                        mappedFileSizeCommitLog=config.mapped_file_size_commit_log)
        yield unpacked(df.toArrow().column(0), DISPATCH_SCHEMA), df.rdd.getNumPartitions()


# --- export and import ----------------------------------------------------------------------------

EXPORT_DDL = MESSAGE_DDL + ", date date"  # what export writes: the message columns and the date partition column


def read_export(spark, path: str | Path):
    """An export (``export_parquet``'s output) as a DataFrame with its own column types. Spark would infer the
    partition columns' types from the directory names: topic ``007`` came back as the integer 7 (and was
    imported as topic ``7``)."""
    path = str(path) if "://" in str(path) else os.path.abspath(path)
    return spark.read.schema(EXPORT_DDL).parquet(path)


PARTITION_TYPE_INFERENCE = "spark.sql.sources.partitionColumnTypeInference.enabled"


def read_parquet(spark, path: str | Path):
    """A Parquet dataset (an export, or any with topic and body columns) with partition columns read as the
    strings their directory names are: Spark's type inference made ``topic=007`` the integer 7 and ``topic=1e3``
    a double, so an export -> import round trip renamed such topics."""
    path = str(path) if "://" in str(path) else os.path.abspath(path)
    before = spark.conf.get(PARTITION_TYPE_INFERENCE, None)
    spark.conf.set(PARTITION_TYPE_INFERENCE, "false")
    try:
        return spark.read.parquet(path)  # the partition schema is fixed here, when the files are listed
    finally:
        if before is None:
            spark.conf.unset(PARTITION_TYPE_INFERENCE)
        else:
            spark.conf.set(PARTITION_TYPE_INFERENCE, before)


def export_parquet(paths, out: str | Path, *, spark=None, master: str | None = None,
                   topics: Iterable[str] | None = None, begin: int | None = None, end: int | None = None,
                   overwrite: bool = False, progress: Progress | None = None, **options: object) -> int:
    """Write messages to Parquet under ``out``, partitioned by topic and (UTC) date; returns the row count.

    ``out`` must be missing or empty unless ``overwrite``; the export is written to a hidden sibling directory and
    renamed to ``out`` only when complete, so a failed export leaves ``out`` as it was (an earlier export
    included). An export matching nothing writes one empty Parquet file with the columns."""
    from pyspark.sql import functions as F

    spark = session(spark, master)
    out = str(out) if "://" in str(out) else os.path.abspath(out)  # a local path means the same on every host
    target = _OutputDir(spark, out)
    if target.holds_something() and not overwrite:
        raise ConfigError(f"{out} is not empty: pass --overwrite (overwrite=True) to replace what it holds")
    scan = {"topics": ",".join(topics) if topics else None, "startingTimestamp": begin, "endingTimestamp": end,
            **options}
    # a log ending at damage fails here, typed (the planner's own check would reach us wrapped in Spark's error)
    check_log_ends(_path_list(paths), ScanOptions.from_options(_option_strings(scan)))
    df = read_store(spark, paths, **scan).withColumn("date", F.to_date("storeTimestamp"))
    staging = target.sibling()
    try:
        with report_progress(spark, progress, "exporting to Parquet"):
            df.write.mode("errorifexists").partitionBy("topic", "date").parquet(staging)
        count = read_export(spark, staging).count()
        if not count:  # partitionBy writes no file for no rows: one empty file says what the columns are
            spark.createDataFrame([], df.schema).coalesce(1).write.mode("overwrite").parquet(staging)
        target.replace_with(staging)
    except BaseException:
        with contextlib.suppress(Exception):
            target.delete(staging)
        raise
    return count


class _OutputDir:
    """An output directory, local or a Hadoop file system's (``hdfs://``, ``s3a://``...), replaced by renames."""

    def __init__(self, spark, path: str) -> None:
        self.path = path
        self.remote = "://" in path
        if self.remote:
            self.jvm = spark._jvm
            self.fs = self.jvm.org.apache.hadoop.fs.Path(path).getFileSystem(spark._jsc.hadoopConfiguration())

    def _hadoop(self, path: str):
        return self.jvm.org.apache.hadoop.fs.Path(path)

    def holds_something(self) -> bool:
        if self.remote:
            where = self._hadoop(self.path)
            return bool(self.fs.exists(where) and (not self.fs.getFileStatus(where).isDirectory()
                                                   or len(self.fs.listStatus(where))))
        if os.path.isdir(self.path):
            with os.scandir(self.path) as entries:
                return any(True for _ in entries)
        return os.path.lexists(self.path)

    def sibling(self) -> str:
        parent, _, name = self.path.rstrip("/").rpartition("/")
        return f"{parent}/.{name}.export-{uuid.uuid4().hex[:12]}"

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(self._hadoop(path))) if self.remote else os.path.lexists(path)

    def rename(self, source: str, target: str) -> None:
        if not self.remote:
            os.rename(source, target)
        elif not self.fs.rename(self._hadoop(source), self._hadoop(target)):
            raise StoreIOError(5, f"cannot rename {source} to {target}")

    def delete(self, path: str) -> None:
        if self.remote:
            self.fs.delete(self._hadoop(path), True)
        elif os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.unlink(path)

    def replace_with(self, staging: str) -> None:
        """``staging`` becomes ``path``; what ``path`` held goes (after the rename: never before it)."""
        old = None
        if self.exists(self.path):
            old = self.sibling() + ".old"
            self.rename(self.path, old)
        try:
            self.rename(staging, self.path)
        except BaseException:
            if old is not None:
                self.rename(old, self.path)
            raise
        if old is not None:
            self.delete(old)


@dataclass(slots=True)
class ImportReport:
    rows: int = 0  # stored by this import
    batches: int = 0
    skipped: int = 0  # rows not stored by this import: named by ``skip_rows``, or held from an unfinished one
    first_offset: int | None = None
    last_offset: int | None = None


IMPORT_COLUMNS = ("topic", "body", "keys", "tags", "properties", "queueId", "flag", "bornTimestamp", "bornHost")
IMPORT_CHUNK_BYTES = 64 << 20  # one Arrow chunk sent to the driver holds at most about this much
_ROW = re.compile(r"row (\d+): ")  # how put_batch names the first bad row of its table


def import_messages(df, root: str | Path, *, config: StoreConfig | None = None, progress: Progress | None = None,
                    explicit: Iterable[str] | None = None, skip_rows: int | None = None) -> ImportReport:
    """Append every row of ``df`` to the store through its single writer, each exactly once.

    Columns: ``topic`` and ``body`` (binary or string) are required; ``keys`` (array or
    space-separated string), ``tags``, ``properties`` (map), ``queueId``, ``flag``, ``bornTimestamp`` (a
    timestamp or epoch ms) and ``bornHost`` (``host:port``) are optional (null: the store's defaults), others
    are not read. Rows reach the driver as Arrow batches (Spark's Arrow batch size, at most
    ``IMPORT_CHUNK_BYTES`` each), one partition ahead, in partition order; each batch is one
    ``put_batch`` (all or nothing). One Spark pass first checks what needs no store (null topics and
    bodies, topic rules, sizes, negative queue ids): a bad row found there stores nothing, and a new store's
    directory is not left behind. A bad row only ``put_batch`` finds stops the import with an error naming its
    place in the DataFrame; the batches before it stay stored, and the error says how many rows that is and
    from which row to resume. The store keeps a journal of the import while it runs (``importjournal``): the same
    import run again after a crash or a refused row goes on from the first row the store does not hold, and an
    import of another dataset is refused while one is unfinished. ``skip_rows`` names the first row to store
    instead; the rows before it are read and checked but not stored (the same dataset read the same way comes in
    the same order, as a Parquet dataset does; a shuffle without a sort may not). ``explicit``: the geometry
    settings of ``config`` the files must not replace (``detect_config``'s).
    """
    if skip_rows is not None and (type(skip_rows) is not int or skip_rows < 0):
        raise ConfigError(f"skip_rows must be a non-negative integer, not {skip_rows!r}")
    present = set(df.columns)
    columns = [c for c in IMPORT_COLUMNS if c in present]
    missing = {"topic", "body"} - present
    if missing:
        raise ConfigError(f"import needs columns topic and body; missing {sorted(missing)}")
    report = ImportReport()
    root = Path(root)
    journal = ImportJournal(root)
    fresh = not (root / "commitlog").is_dir()
    config = (config or StoreConfig()) if fresh else detect_config(root, config, explicit=explicit)
    rows = df.select(*columns)
    total = _check_rows(rows, config)  # a pass over the rows before the first is stored: most bad rows store nothing
    if skip_rows is not None and skip_rows > total:
        raise ConfigError(f"cannot import from row {skip_rows} on: the dataset has {total} rows")
    source = _source_of(df, total)
    unfinished = None if fresh or skip_rows is not None else journal.load()  # a named row replaces it
    report.skipped = skip_rows or 0
    if unfinished is not None:  # decided on a read-only view first: a refusal changes nothing
        if unfinished.source != source:
            raise ConfigError(
                f"{root} holds an unfinished import of {describe_source(unfinished.source)} "
                f"({unfinished.rows_done} rows or more stored): run that import again to finish it, or name the "
                "row to start this one from (--from-row) to leave it unfinished")
        with MessageStore.open(root, config, read_only=True) as view:
            report.skipped = rows_stored(view, unfinished)
    before = set(os.listdir(root)) if root.is_dir() else None
    try:
        with MessageStore.open(root, config) as store:
            skip = report.skipped  # rows reach the driver in the same order every time: the first skip go by
            for chunk in _arrow_chunks(rows):
                dropped = min(skip, chunk.num_rows)
                skip -= dropped
                if chunk.num_rows > dropped:
                    table = _batch_columns(chunk.slice(dropped))
                    store.flush()  # the rows the journal counts are on the disk before it says so (power loss)
                    journal.record(ImportProgress(
                        source, report.skipped + report.rows, store.commit_log.max_offset, table.num_rows,
                        table.column("topic")[0].as_py(), ImportProgress.body_crc(table.column("body")[0].as_py())))
                    _put(store, table, report, progress)
            journal.clear()
    except BaseException:
        if fresh and not report.rows:  # an import into a new path that stored nothing leaves no store skeleton
            if before is None:
                shutil.rmtree(root, ignore_errors=True)
            else:
                for name in set(os.listdir(root)) - before:
                    with contextlib.suppress(OSError):
                        (shutil.rmtree if (root / name).is_dir() else os.unlink)(root / name)
        raise
    return report


def _source_of(df, rows: int) -> dict:
    """What an import reads, as its journal names it: the dataset's files (their number, a digest of their names
    and the first) and row count, or for a DataFrame without files the hash of its plan."""
    files = sorted(df.inputFiles())
    if not files:
        return {"plan": df.semanticHash(), "rows": rows}
    digest = hashlib.sha256("\n".join(files).encode()).hexdigest()[:32]
    return {"first": files[0], "files": len(files), "digest": digest, "rows": rows}


_RECORD_FIXED_BYTES = 91  # a record's bytes besides body, topic and properties (IPv4 hosts): a lower bound


def _check_rows(df, config: StoreConfig) -> int:
    """What can be checked without the store, in one Spark pass before anything is stored: null topics and
    bodies, topic rules, bodies over max_message_size, records that cannot fit a commit-log segment, negative
    queue ids. The first bad row (by its place in the DataFrame, as the import reads it) is a typed error; else the
    number of rows."""
    from ..encoder import check_sendable, validate_topic
    from ..errors import InvalidQueueError, InvalidTopicError, MessageIllegalError, MessageTooLargeError

    max_body, segment = config.max_message_size, config.mapped_file_size_commit_log
    max_record = min(max_body + 65536, segment - 8)
    kinds = {"topic": InvalidTopicError, "body": MessageIllegalError, "size": MessageTooLargeError,
             "queue": InvalidQueueError}

    def first_bad(table: pa.Table) -> tuple[int, str, str] | None:
        topic, body = table.column("topic"), table.column("body")
        found: list[tuple[int, str, str]] = []
        for column, name in ((topic, "topic"), (body, "body")):
            if column.null_count:
                found.append((int(pc.index(pc.is_null(column), True).as_py()), name, f"{name} is null"))
        topics = pc.unique(pc.drop_null(topic.cast(pa.string()))).to_pylist()
        for name in topics:
            try:
                validate_topic(name)
                check_sendable(name)
            except InvalidTopicError as exc:
                found.append((int(pc.index(topic.cast(pa.string()), name).as_py()), "topic", str(exc)))
        bodies = pc.fill_null(pc.binary_length(body.cast(pa.binary())), 0).to_numpy(zero_copy_only=False)
        over = np.flatnonzero(bodies > max_body)
        if len(over):
            found.append((int(over[0]), "size", f"body is {bodies[over[0]]} bytes; max_message_size is {max_body}"))
        names = pc.fill_null(pc.binary_length(topic.cast(pa.binary())), 0).to_numpy(zero_copy_only=False)
        big = np.flatnonzero(bodies + names + _RECORD_FIXED_BYTES > max_record)
        if len(big):
            found.append((int(big[0]), "size", f"a record of at least {bodies[big[0]] + names[big[0]] + 91} bytes "
                                               f"does not fit a commit-log segment of {segment} bytes"))
        if "queueId" in table.column_names:
            queues = pc.fill_null(table.column("queueId").cast(pa.int64()), 0).to_numpy(zero_copy_only=False)
            negative = np.flatnonzero(queues < 0)
            if len(negative):
                found.append((int(negative[0]), "queue", f"queueId {queues[negative[0]]} is negative"))
        return min(found) if found else None

    def check(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        rows, bad = 0, None
        for batch in batches:
            if bad is None:
                found = first_bad(pa.Table.from_batches([batch]))
                if found is not None:
                    bad = (rows + found[0], found[1], found[2])
            rows += batch.num_rows
        context = TaskContext.get()
        yield pa.RecordBatch.from_pydict({
            "part": [context.partitionId() if context else 0], "rows": [rows], "bad": [-1 if bad is None else bad[0]],
            "kind": [bad[1] if bad else ""], "reason": [bad[2] if bad else ""]})
        settle_after_task()

    columns = [c for c in ("topic", "body", "queueId") if c in df.columns]
    parts = sorted(df.select(*columns).mapInArrow(check, "part bigint, rows bigint, bad bigint, kind string, "
                                                         "reason string").collect())
    before = 0
    for part in parts:
        if part.bad >= 0:
            raise kinds[part.kind](f"row {before + part.bad}: {part.reason} (nothing imported: the rows are checked "
                                   "before the first is stored)")
        before += part.rows
    return before


def _arrow_chunks(df) -> Iterator[pa.Table]:
    """``df`` on the driver as Arrow tables, in order, holding one partition at a time: each executor batch
    travels as one binary cell of Arrow IPC (``toLocalIterator`` of plain rows moved ~20,000 rows/s)."""
    limit = IMPORT_CHUNK_BYTES

    def to_ipc(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            parts = max(1, -(-batch.nbytes // limit))
            step = max(1, -(-batch.num_rows // parts))
            for start in range(0, batch.num_rows, step):
                sink = pa.BufferOutputStream()
                piece = batch.slice(start, step)
                with pa.ipc.new_stream(sink, piece.schema) as writer:
                    writer.write_batch(piece)
                yield pa.RecordBatch.from_arrays([pa.array([sink.getvalue().to_pybytes()], pa.binary())], ["ipc"])
        settle_after_task()

    for row in df.mapInArrow(to_ipc, "ipc binary").toLocalIterator(prefetchPartitions=True):
        yield pa.ipc.open_stream(pa.py_buffer(row.ipc)).read_all()


def _batch_columns(chunk: pa.Table) -> pa.Table:
    """A chunk of the import's columns as the columns ``put_batch`` takes."""
    try:
        data = {"topic": chunk.column("topic").cast(pa.string()), "body": chunk.column("body").cast(pa.binary())}
        names = set(chunk.column_names)
        if "keys" in names:
            keys = chunk.column("keys")
            if pa.types.is_string(keys.type) or pa.types.is_large_string(keys.type):
                keys = pa.array([split_keys(k) for k in keys.to_pylist()], pa.list_(pa.string()))
            data["keys"] = keys.cast(pa.list_(pa.string()))
        if "tags" in names:
            data["tags"] = chunk.column("tags").cast(pa.string())
        if "properties" in names:
            data["properties"] = chunk.column("properties").cast(pa.map_(pa.string(), pa.string()))
        if "queueId" in names:
            data["queue_id"] = pc.fill_null(chunk.column("queueId").cast(pa.int32()), 0)
        if "flag" in names:
            data["flag"] = chunk.column("flag").cast(pa.int32())
        if "bornTimestamp" in names:  # a timestamp (what export writes) or epoch ms
            born = chunk.column("bornTimestamp")
            if pa.types.is_timestamp(born.type):
                born = pc.divide(born.cast(pa.timestamp("us", born.type.tz)).cast(pa.int64()), 1000)
            data["born_timestamp"] = born.cast(pa.int64())
        if "bornHost" in names:
            data["born_host"] = chunk.column("bornHost").cast(pa.string())
    except (pa.ArrowException, TypeError, ValueError) as exc:
        raise ConfigError(f"import columns cannot be read as messages: {exc}") from None
    return pa.table(data)


def _put(store: MessageStore, table: pa.Table, report: ImportReport, progress: Progress | None) -> None:
    try:
        result = store.put_batch(table)
    except RocketStoreError as exc:
        text = str(exc)
        found = _ROW.match(text)
        first = report.skipped + report.rows  # rows are named by their place in the DataFrame
        where = (f"row {first + int(found[1])}: {text[found.end():]}" if found else
                 f"rows {first}..{first + table.num_rows - 1}: {text}")
        raise type(exc)(f"{where} (nothing of rows {first}..{first + table.num_rows - 1} stored; "
                        f"the {first} rows before them are: to finish, import from row {first} on, "
                        f"--from-row {first})") from exc
    report.rows += table.num_rows
    report.batches += 1
    offsets = result.commit_log_offsets
    report.first_offset = int(offsets[0]) if report.first_offset is None else report.first_offset
    report.last_offset = int(offsets[-1])
    if progress is not None:
        progress("importing", report.rows, 0)


# --- keys at scale ---------------------------------------------------------------------------------



def find_keys(paths, keys, *, spark=None, master: str | None = None, begin: int = 0, end: int | None = None,
              max_num: int = 64, config: StoreConfig | None = None, partitions: int | None = None):
    """Messages matching many ``(topic, key)`` pairs across many stores, found through their indexes.

    ``keys`` is a list of (topic, key) tuples or a DataFrame with columns ``topic`` and ``key``.
    Matching is exact (topic and key verified on the record). Returns a DataFrame with the
    message columns plus ``queryTopic`` and ``queryKey``. A store named twice (by a glob and its path, through a
    symbolic link) is searched once, and a pair given twice is looked up once.
    """
    spark = session(spark, master)
    # each store and each pair once: a store named twice (a glob and its path) or a key given twice answered twice
    unique = {os.path.realpath(r): str(r) for r in reversed(
        resolve_roots(paths if isinstance(paths, str) else ",".join(map(str, paths))))}
    roots = list(reversed(unique.values()))  # the first name of each, in order
    if isinstance(keys, list | tuple):
        pairs_given = list(dict.fromkeys((str(t), str(k)) for t, k in keys))
        keys_df = spark.createDataFrame(pairs_given, "topic string, key string")
    else:
        keys_df = keys.select("topic", "key").distinct()
    stores = spark.createDataFrame([(r,) for r in roots], "root string")
    pairs = stores.crossJoin(keys_df).repartition(partitions or max(2, spark.sparkContext.defaultParallelism))
    base = config or StoreConfig()

    def lookup(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        stores_open: dict[str, MessageStore] = {}
        with in_task():
            try:
                for batch in batches:
                    pairs_of: dict[str, list[tuple[str, str]]] = {}
                    for root, topic, key in zip(*(batch.column(i).to_pylist() for i in range(3)), strict=True):
                        pairs_of.setdefault(root, []).append((topic, key))
                    for root, pairs in pairs_of.items():
                        store = stores_open.get(root)
                        if store is None:
                            require_visible(root)
                            store = stores_open[root] = MessageStore.open(
                                root, detect_config(root, base.replace(check_crc_on_recover=False)), read_only=True)
                        found = store.query_messages_arrow(pairs, max_num, begin, end,
                                                           broker_name=broker_name_of(Path(root)))
                        if found.num_rows:
                            yield found
            finally:
                for store in stores_open.values():
                    store.close()
        settle_after_task()

    schema_ddl = MESSAGE_DDL + ", queryTopic string, queryKey string"
    return pairs.select("root", "topic", "key").mapInArrow(lookup, schema_ddl)


def messages_per_topic_and_minute(df):
    """The demo's summary: message counts by topic and by minute of store time."""
    from pyspark.sql import functions as F

    per_topic = df.groupBy("topic").count().orderBy("topic")
    per_minute = df.groupBy(F.date_trunc("minute", "storeTimestamp").alias("minute")).count().orderBy("minute")
    return per_topic, per_minute

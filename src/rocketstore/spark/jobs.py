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
import socket
import threading
import uuid
from collections.abc import Callable, Generator, Iterable, Iterator
from pathlib import Path
from typing import TypeVar

import pyarrow as pa
import pyarrow.compute as pc

from ..config import StoreConfig, detect_config
from ..errors import ConfigError, StoreIOError
from ..importing import (
    CHECKED_COLUMNS,
    IMPORT_CHUNK_BYTES,
    IMPORT_COLUMNS,
    ImportReport,
    bad_row_error,
    existing_queues,
    first_bad_row,
    import_config,
    importable,
    store_tables,
)
from ..mapped.file import exchange_paths
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
                        mappedFileSizeCommitLog=config.mapped_file_size_commit_log,
                        messageDelayLevel=config.message_delay_level)  # parked messages' tags codes: due times
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
    from pyspark.sql import Observation
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
    for left in target.sweep():
        log.info("removed %s, left by an export that was killed", left)
    staging = target.sibling()
    written = Observation("rocketstore-export")
    try:
        with report_progress(spark, progress, "exporting to Parquet"):
            # Spark sorts each task's rows by the partition columns before writing; a sort that spills merges
            # its runs in no set order for equal keys: the log offset makes the order total, so every part file
            # holds its topic and day in log order (what an import's name order relies on)
            df.observe(written, F.count(F.lit(1)).alias("rows")) \
                .sortWithinPartitions("topic", "date", "commitLogOffset").write.mode("errorifexists") \
                .partitionBy("topic", "date").parquet(staging)
        count = read_export(spark, staging).count()
        if count != written.get["rows"]:
            # the executors wrote rows the driver does not see: an --out on their own disks, not shared (the job
            # committed what it could list: "exported 0 messages", or only the driver host's executor's share,
            # with exit 0). The rows written are counted in the same pass (an observed metric)
            raise StoreIOError(2, f"the executors wrote {written.get['rows']} rows under {out}, of which this "
                                  f"driver sees {count}: --out must be a path every executor and the driver share "
                                  "(a shared mount, hdfs://, s3a://)")
        if not count:  # partitionBy writes no file for no rows: one empty file says what the columns are
            spark.createDataFrame([], df.schema).coalesce(1).write.mode("overwrite").parquet(staging)
        target.replace_with(staging)
    except BaseException:
        with contextlib.suppress(Exception):
            target.delete(staging)
        raise
    return count


_HOST = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"  # names this host in export siblings


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's: alive
        return True
    return True


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
        """A hidden name beside ``path`` for a new export, naming this process: a killed export's is swept by the
        next one (``sweep``)."""
        parent, _, name = self.path.rstrip("/").rpartition("/")
        return f"{parent}/.{name}.export-{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:12]}"

    def sweep(self) -> list[str]:
        """Remove what killed exports to this path left beside it (their process, on this host, is gone): each held
        a part or all of an export, up to its full size, for good. Local paths only; another host's are left alone
        (its process cannot be asked, and a shared --out may be written by it now)."""
        if self.remote:
            return []
        parent, _, name = self.path.rstrip("/").rpartition("/")
        pattern = re.compile(rf"\.{re.escape(name)}\.export-{re.escape(_HOST)}-(\d{{1,9}})-[0-9a-f]{{12}}(?:\.old)?")
        swept = []
        try:
            entries = list(os.scandir(parent or "/"))
        except OSError:
            return []
        for entry in entries:
            match = pattern.fullmatch(entry.name)
            if match is None or _alive(int(match.group(1))):
                continue
            with contextlib.suppress(OSError):
                self.delete(entry.path)
                swept.append(entry.path)
        return swept

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
        """``staging`` becomes ``path``; what ``path`` held goes (after the rename: never before it). Locally the two
        are exchanged in one step: with two renames, a kill between them left ``path`` missing and both exports
        hidden beside it (the Spark kill review)."""
        if not self.remote and os.path.lexists(self.path) and exchange_paths(staging, self.path):
            self.delete(staging)  # the previous export, now under the staging name
            return
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


# --- import ----------------------------------------------------------------------------------------------------

_FILE, _ROW_INDEX = "__rocketstore_file", "__rocketstore_row"  # a row's file and place in it, while importing
IMPORT_PARTITION_BYTES = 64 << 20  # of rows per partition the driver receives whole (two at a time)


def import_messages(df, root: str | Path, *, config: StoreConfig | None = None, progress: Progress | None = None,
                    explicit: Iterable[str] | None = None, skip_rows: int | None = None,
                    skip_system: bool = False) -> ImportReport:
    """Append every row of ``df`` to the store through its single writer, each exactly once.

    Columns: ``topic`` and ``body`` (binary or string) are required; ``keys`` (array or
    space-separated string), ``tags``, ``properties`` (map), ``queueId``, ``flag``, ``bornTimestamp`` (a
    timestamp or epoch ms) and ``bornHost`` (``host:port``) are optional (null: the store's defaults), others
    are not read. A DataFrame that reads files is stored in file name order, each file's rows in order (an
    export's queues keep their order: Spark's own order lists larger files first); any other in its partitions'
    order. Rows reach the driver as Arrow batches (Spark's Arrow batch size, at most ``IMPORT_CHUNK_BYTES``
    each), in partitions of about ``IMPORT_PARTITION_BYTES``, one partition ahead; each batch is one
    ``put_batch`` (all or nothing). One Spark pass first checks what needs no store (null topics and
    bodies, topic rules, sizes, negative queue ids): a bad row found there stores nothing, and a new store's
    directory is not left behind. A bad row only ``put_batch`` finds stops the import with an error naming its
    place in the DataFrame; the batches before it stay stored, and the error says how many rows that is and
    from which row to resume. The store keeps a journal of the import while it runs (``importjournal``): the same
    import run again after a crash or a refused row goes on from the first row the store does not hold, and an
    import of another dataset (or of this one read another way: ``import_parquet``) is refused while one is
    unfinished. ``skip_rows`` names the first row to store instead; the rows before it are read and checked but not
    stored. ``explicit``: the geometry settings of ``config`` the files must not replace (``detect_config``'s).
    ``skip_system``: rows of the broker's own queues (delays, timers, transactions: ``importable``) are passed over
    and counted in the report instead of refusing the import.
    """
    if skip_rows is not None and (type(skip_rows) is not int or skip_rows < 0):
        raise ConfigError(f"skip_rows must be a non-negative integer, not {skip_rows!r}")
    present = set(df.columns)
    columns = [c for c in IMPORT_COLUMNS if c in present]
    missing = {"topic", "body"} - present
    if missing:
        raise ConfigError(f"import needs columns topic and body; missing {sorted(missing)}")
    root = Path(root)
    fresh, config = import_config(root, config, explicit)
    system_rows: dict[str, int] = {}
    if skip_system:  # one pass over the topic column: which topics, how many rows each
        from pyspark.sql import functions as F

        counts = {r["topic"]: r["count"] for r in df.groupBy("topic").count().collect() if r["topic"] is not None}
        system_rows = {topic: n for topic, n in counts.items() if not importable(topic)}
        if system_rows:
            df = df.filter(~F.col("topic").isin(list(system_rows)))
    rows = _with_file_places(df.select(*columns))
    by_file = rows is not None
    if rows is None:
        rows = df.select(*columns)
    total, size = _check_rows(rows, config, by_file, existing_queues(root))  # before the first row is stored
    queue_max = _queue_max(rows)
    if skip_rows is not None and skip_rows > total:
        raise ConfigError(f"cannot import from row {skip_rows} on: the dataset has {total} rows")
    if by_file:  # one range of (file, row) per partition, partitions in order: the rows in name order
        parts = max(1, -(-size // IMPORT_PARTITION_BYTES))
        rows = rows.repartitionByRange(parts, _FILE, _ROW_INDEX).sortWithinPartitions(_FILE, _ROW_INDEX) \
            .drop(_FILE, _ROW_INDEX)
    source = {**_source_of(df, total), "reader": "spark", "order": "files" if by_file else "partitions",
              **({"skipSystemTopics": True} if skip_system else {})}
    report = store_tables(_arrow_chunks(rows), root, config, fresh=fresh, source=source, skip_rows=skip_rows,
                          progress=progress, queue_max=queue_max)
    report.system_rows = system_rows
    return report


def _queue_max(df) -> dict[str, int]:
    """Each topic's highest queue id (0 without a queueId column): the import makes its topics with them."""
    from pyspark.sql import functions as F

    if "queueId" not in df.columns:
        return {r["topic"]: 0 for r in df.select("topic").distinct().collect()}
    rows = df.groupBy("topic").agg(F.max(F.coalesce(F.col("queueId").cast("long"), F.lit(0))).alias("q")).collect()
    return {r["topic"]: int(r["q"]) for r in rows}


def _with_file_places(df):
    """``df`` with each row's file and its place in that file (Spark's ``_metadata``), or None when its rows do not
    come from files (a DataFrame made in memory, a union: nothing names their order but the partitions)."""
    from pyspark.errors import AnalysisException
    from pyspark.logger import PySparkLogger
    from pyspark.sql import functions as F

    if not df.inputFiles():
        return None
    quiet = PySparkLogger.getLogger("DataFrameQueryContextLogger")  # logs every AnalysisException with a trace
    was = quiet.disabled
    quiet.disabled = True
    try:
        placed = df.select("*", F.col("_metadata.file_path").alias(_FILE),
                           F.col("_metadata.row_index").alias(_ROW_INDEX))
        _ = placed.schema  # resolves the plan: AnalysisException here when _metadata is not the files' (a union)
    except AnalysisException:  # or they have no row index (JSON, CSV)
        return None
    finally:
        quiet.disabled = was
    return placed


def _source_of(df, rows: int) -> dict:
    """What an import reads, as its journal names it: the dataset's files (their number, a digest of their names
    and the first) and row count, or for a DataFrame without files the hash of its plan."""
    files = sorted(df.inputFiles())
    if not files:
        return {"plan": df.semanticHash(), "rows": rows}
    from ..importing import STAMPS, file_stamp

    digest = hashlib.sha256("\n".join(files).encode()).hexdigest()[:32]
    return {"first": files[0], "files": len(files), "digest": digest, "rows": rows,
            STAMPS: sorted(file_stamp(name) for name in files)}


def _check_rows(df, config: StoreConfig, by_file: bool, queues: dict[str, int] | None = None) -> tuple[int, int]:
    """``first_bad_row`` over every row in one Spark pass, before the first is stored: the first bad row (by its
    place in the order the import stores the rows: name order of files with ``by_file``, else partition order) is
    a typed error; else (the number of rows, their checked columns' bytes)."""
    def check(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        # per file (by_file) or for the whole partition: rows seen, the first bad row's place, kind and reason
        seen: dict[str, list] = {}
        size = 0
        for batch in batches:
            if not batch.num_rows:
                continue
            size += batch.nbytes
            table = pa.Table.from_batches([batch])
            if by_file:
                files = table.column(_FILE)
                names = pc.unique(files).to_pylist()
                groups = [(names[0], None)] if len(names) == 1 else [(name, pc.equal(files, name)) for name in names]
            else:
                groups = [("", None)]
            for name, mask in groups:
                part = table if mask is None else table.filter(mask)
                entry = seen.setdefault(name, [0, -1, "", ""])
                if entry[1] < 0:
                    found = first_bad_row(part, config, queues)
                    if found is not None:
                        place = int(part.column(_ROW_INDEX)[found[0]].as_py()) if by_file else entry[0] + found[0]
                        entry[1:] = [place, found[1], found[2]]
                entry[0] += part.num_rows
        context = TaskContext.get()
        part_id = context.partitionId() if context else 0
        if not seen:  # an empty partition
            seen[""] = [0, -1, "", ""]
        yield pa.RecordBatch.from_pydict({
            "part": [part_id] * len(seen), "file": list(seen), "rows": [e[0] for e in seen.values()],
            "bad": [e[1] for e in seen.values()], "kind": [e[2] for e in seen.values()],
            "reason": [e[3] for e in seen.values()], "bytes": [size] + [0] * (len(seen) - 1)})
        settle_after_task()

    checked = [c for c in CHECKED_COLUMNS if c in df.columns] + ([_FILE, _ROW_INDEX] if by_file else [])
    results = df.select(*checked).mapInArrow(
        check, "part bigint, file string, rows bigint, bad bigint, kind string, reason string, bytes bigint").collect()
    size = sum(r.bytes for r in results)
    if by_file:  # a file's rows may lie in several partitions: its place is its rows' order in the file
        counts: dict[str, int] = {}
        bad: dict[str, tuple[int, str, str]] = {}
        for r in results:
            counts[r.file] = counts.get(r.file, 0) + r.rows
            if r.bad >= 0 and (r.file not in bad or r.bad < bad[r.file][0]):
                bad[r.file] = (r.bad, r.kind, r.reason)
        before = 0
        for name in sorted(counts):
            if name in bad:
                raise bad_row_error(before + bad[name][0], bad[name][1], bad[name][2])
            before += counts[name]
        return before, size
    before = 0
    for r in sorted(results, key=lambda r: r.part):
        if r.bad >= 0:
            raise bad_row_error(before + r.bad, r.kind, r.reason)
        before += r.rows
    return before, size


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


# --- keys at scale ---------------------------------------------------------------------------------



def find_keys(paths, keys, *, spark=None, master: str | None = None, begin: int = 0, end: int | None = None,
              max_num: int = 64, config: StoreConfig | None = None, partitions: int | None = None,
              allow_damage: bool = False):
    """Messages matching many ``(topic, key)`` pairs across many stores, found through their indexes.

    ``keys`` is a list of (topic, key) tuples or a DataFrame with columns ``topic`` and ``key``.
    Matching is exact (topic and key verified on the record). Returns a DataFrame with the
    message columns plus ``queryTopic`` and ``queryKey``. A store named twice (by a glob and its path, through a
    symbolic link) is searched once, and a pair given twice is looked up once. A store whose commit log is damaged
    with intact records after the damage is refused (``DamagedLogError``) unless ``allow_damage``: its answers
    would leave those records out without a word.
    """
    # each store and each pair once: a store named twice (a glob and its path) or a key given twice answered twice
    unique = {os.path.realpath(r): str(r) for r in reversed(
        resolve_roots(paths if isinstance(paths, str) else ",".join(map(str, paths))))}
    roots = list(reversed(unique.values()))  # the first name of each, in order
    if not allow_damage:
        check_log_ends(roots, ScanOptions())
    spark = session(spark, master)
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

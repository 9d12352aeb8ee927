"""Importing messages through the store's single writer, each row once: the part both readers share.

Rows come as Arrow tables from one of two readers, in one order that the same dataset always comes in:
``import_parquet`` reads a Parquet dataset in this process (``rocketstore import --no-spark``: files in name order,
rows in file order, partition directories as string columns), ``spark.jobs.import_messages`` gets a DataFrame's rows
from Spark. Both check every row with ``first_bad_row`` before the first is stored, then ``store_tables`` keeps the
journal (``importjournal``) and stores each table with one ``put_batch``.

Name order matters: an export writes each topic and date in part files numbered in log order, so reading the
files by name keeps every queue's messages in their original order (Spark lists a dataset's files largest
first: an export -> import round trip through its plain order reordered queues).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .codec.properties import split_keys
from .config import StoreConfig, detect_config
from .encoder import check_sendable, validate_topic
from .errors import (
    ConfigError,
    InvalidQueueError,
    InvalidTopicError,
    MessageIllegalError,
    MessageTooLargeError,
    RocketStoreError,
    StoredButNotClosedError,
    StoreIOError,
    TablePartlyStoredError,
)
from .importjournal import ImportJournal, ImportProgress, describe_source, rows_stored
from .message import SysFlag
from .store import MessageStore

Progress = Callable[[str, int, int], None]  # (stage description, done, total)

IMPORT_COLUMNS = ("topic", "body", "keys", "tags", "properties", "queueId", "flag", "bornTimestamp", "bornHost",
                  "sysFlag", "reconsumeTimes", "preparedTransactionOffset")
_HOST_FLAGS = SysFlag.BORNHOST_V6 | SysFlag.STOREHOST_V6  # the importing store sets these from the hosts
CHECKED_COLUMNS = ("topic", "body", "queueId")  # what ``first_bad_row`` reads
IMPORT_CHUNK_BYTES = 64 << 20  # one table handed to put_batch holds at most about this much
IMPORT_CHUNK_ROWS = 10_000  # and at most this many rows (Spark's Arrow batch size)
BAD_ROW_ERRORS = {"topic": InvalidTopicError, "body": MessageIllegalError, "size": MessageTooLargeError,
                  "queue": InvalidQueueError}
_RECORD_FIXED_BYTES = 91  # a record's bytes besides body, topic and properties (IPv4 hosts): a lower bound
_ROW = re.compile(r"row (\d+): ")  # how put_batch names the first bad row of its table


@dataclass(slots=True)
class ImportReport:
    rows: int = 0  # stored by this import
    batches: int = 0
    skipped: int = 0  # rows not stored by this import: named by ``skip_rows``, or held from an unfinished one
    already_imported: bool = False  # the store's journal says this very import finished before: nothing stored
    first_offset: int | None = None
    last_offset: int | None = None
    system_rows: dict[str, int] = field(default_factory=dict)  # rows of the broker's own topics passed over


def _note_queue_max(table: pa.Table, queue_max: dict[str, int]) -> None:
    """Raise ``queue_max`` to each topic's highest queue id in ``table`` (a checked one: no null topic)."""
    if "queueId" not in table.column_names:
        topics = pc.unique(table.column("topic").cast(pa.string())).to_pylist()
        for topic in topics:
            queue_max.setdefault(topic, 0)
        return
    grouped = pa.table({"topic": table.column("topic").cast(pa.string()),
                        "queue": pc.fill_null(table.column("queueId").cast(pa.int64()), 0)}) \
        .group_by("topic").aggregate([("queue", "max")])
    for topic, queue in zip(grouped.column("topic").to_pylist(), grouped.column("queue_max").to_pylist(),
                            strict=True):
        queue_max[topic] = max(queue_max.get(topic, 0), queue)


def importable(topic: str) -> bool:
    """Whether rows of ``topic`` can be stored: not one of the broker's own queues (``check_sendable``)."""
    try:
        check_sendable(topic)
    except InvalidTopicError:
        return False
    return True


SYSTEM_ROWS_HINT = ("pass --skip-system-topics (skip_system=True) to import the other rows: the broker's own delay, "
                    "timer and transaction queues are not imported, so a delayed message still waiting there is not "
                    "carried over; or export only the topics you need (export -t)")


def system_rows_of(table: pa.Table) -> tuple[pa.Table, dict[str, int]]:
    """``table`` without the rows of topics ``importable`` refuses, and how many each of those had."""
    topic = table.column("topic").cast(pa.string())
    system = [t for t in pc.unique(pc.drop_null(topic)).to_pylist() if not importable(t)]
    if not system:
        return table, {}
    mask = pc.is_in(topic, value_set=pa.array(system, pa.string()))
    counts = pc.value_counts(pc.filter(topic, mask)).to_pylist()
    return table.filter(pc.invert(pc.fill_null(mask, False))), {c["values"]: c["counts"] for c in counts}

def import_config(root: Path, config: StoreConfig | None, explicit: Iterable[str] | None) -> tuple[bool, StoreConfig]:
    """(whether ``root`` holds no store yet, the config to import with: a store's own geometry when it has one)."""
    fresh = not (root / "commitlog").is_dir()
    return fresh, (config or StoreConfig()) if fresh else detect_config(root, config, explicit=explicit)


def first_bad_row(table: pa.Table, config: StoreConfig, queues: dict[str, int] | None = None
                  ) -> tuple[int, str, str] | None:
    """What can be checked without the store: null topics and bodies, topic rules, bodies over max_message_size,
    records that cannot fit a commit-log segment, negative queue ids, and with ``queues`` (the write queues of
    the topics the store has: ``existing_queues``) queue ids past them. The first bad row of ``table`` as (its place
    in the table, its kind (a key of ``BAD_ROW_ERRORS``), why), or None."""
    max_body, segment = config.max_message_size, config.mapped_file_size_commit_log
    max_record = min(max_body + 65536, segment - 8)
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
            why = str(exc) if importable(name) else f"{exc}; {SYSTEM_ROWS_HINT}"
            found.append((int(pc.index(topic.cast(pa.string()), name).as_py()), "topic", why))
    bodies = pc.fill_null(pc.binary_length(body.cast(pa.binary())), 0).to_numpy(zero_copy_only=False)
    over = np.flatnonzero(bodies > max_body)
    if len(over):
        found.append((int(over[0]), "size", f"body is {bodies[over[0]]} bytes; max_message_size is {max_body}"))
    names = pc.fill_null(pc.binary_length(topic.cast(pa.binary())), 0).to_numpy(zero_copy_only=False)
    big = np.flatnonzero(bodies + names + _RECORD_FIXED_BYTES > max_record)
    if len(big):
        found.append((int(big[0]), "size", f"a record of at least {bodies[big[0]] + names[big[0]] + 91} bytes "
                                           f"does not fit a commit-log segment of {segment} bytes"))
    existing = queues or {}
    if "queueId" in table.column_names:
        queues = pc.fill_null(table.column("queueId").cast(pa.int64()), 0).to_numpy(zero_copy_only=False)
        negative = np.flatnonzero(queues < 0)
        if len(negative):
            found.append((int(negative[0]), "queue", f"queueId {queues[negative[0]]} is negative"))
        for name in topics if existing else ():
            if name in existing:
                rows = pc.fill_null(pc.equal(topic.cast(pa.string()), name), False).to_numpy(zero_copy_only=False)
                past = np.flatnonzero(rows & (queues >= existing[name]))
                if len(past):
                    found.append((int(past[0]), "queue", f"queue {queues[past[0]]} does not exist: topic {name} has "
                                                         f"{existing[name]} write queues in the store"))
    return min(found) if found else None


def existing_queues(root: Path) -> dict[str, int]:
    """The write queue count of each topic the store at ``root`` has (none for a new store): rows past them are
    refused before the first row is stored (a topic the import makes gets the queues its rows use)."""
    from .brokerconfig import TopicConfigManager

    if not (root / "config").is_dir():
        return {}
    manager = TopicConfigManager(root, read_only=True)
    manager.load()
    return {name: manager.get(name).write_queue_nums for name in manager.topics}


def bad_row_error(row: int, kind: str, reason: str) -> RocketStoreError:
    return BAD_ROW_ERRORS[kind](f"row {row}: {reason} (nothing imported: the rows are checked before the first is "
                                "stored)")


def batch_columns(chunk: pa.Table) -> pa.Table:
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
            if "keys" in data:  # a KEYS property is the stored keys as they were (spacing too): it wins
                stored = pc.is_valid(pc.map_lookup(data["properties"], "KEYS", "first"))
                data["keys"] = pc.if_else(stored, pa.scalar(None, data["keys"].type), data["keys"])
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
        # what else a stored message carries: a compressed body's flag (its bytes are stored compressed), a retry's
        # count, a committed transaction's type and half offset
        if "sysFlag" in names:
            data["sys_flag"] = pc.bit_wise_and(pc.fill_null(chunk.column("sysFlag").cast(pa.int32()), 0),
                                               pa.scalar(~_HOST_FLAGS, pa.int32()))
        if "reconsumeTimes" in names:
            data["reconsume_times"] = pc.fill_null(chunk.column("reconsumeTimes").cast(pa.int32()), 0)
        if "preparedTransactionOffset" in names:
            data["prepared_transaction_offset"] = pc.fill_null(
                chunk.column("preparedTransactionOffset").cast(pa.int64()), 0)
    except (pa.ArrowException, TypeError, ValueError) as exc:
        raise ConfigError(f"import columns cannot be read as messages: {exc}") from None
    return pa.table(data)


def store_tables(chunks: Iterable[pa.Table], root: Path, config: StoreConfig, *, fresh: bool, source: dict,
                 skip_rows: int | None, progress: Progress | None = None,
                 queue_max: dict[str, int] | None = None) -> ImportReport:
    """Store the checked rows of ``source`` (arriving as ``chunks``, in its one order) into the store at ``root``.

    The journal decides where to begin unless ``skip_rows`` names it: an unfinished import of the same source goes
    on from the first row the store does not hold; one of another source is refused. Refusals are decided on a
    read-only open, before the writer's: they change no file. A new store's directory is not left behind by an
    import that stored nothing. ``queue_max``: each topic's highest queue id in the whole dataset: a topic the
    store lacks is made with the queues they need before the first row is stored (one made from the first table's
    rows alone refused a later table's higher queue part-way, and a resumed import could not grow it). A finished
    import of other files replaces the journal, but one that shares files with this one, unchanged, refuses it
    unless ``skip_rows`` names where to begin: their rows are stored already."""
    report = ImportReport()
    journal = ImportJournal(root)
    unfinished = None if fresh or skip_rows is not None else journal.load()  # a named row replaces it
    if unfinished is not None and STAMPS not in unfinished.source \
            and unfinished.source == {k: v for k, v in source.items() if k != STAMPS}:
        unfinished = replace(unfinished, source=source)  # a journal an earlier version wrote, of these files
    if unfinished is not None and unfinished.complete and unfinished.source != source:
        shared = len(set(unfinished.source.get(STAMPS, ())) & set(source.get(STAMPS, ())))
        if shared:  # a dataset grown by a file (an incremental export), or read by the other reader: taken for
            # another import, every row the finished one stored was stored a second time
            raise ConfigError(
                f"{root} finished an import of {describe_source(unfinished.source)}; {shared} of these "
                f"{source.get('files', '?')} files are files it imported, unchanged (a file was added or removed "
                "since, or the dataset is read the other way): run, it would store their rows a second time. "
                "Import only the new files, or give --from-row 0 to store every row of these files again")
        unfinished = None  # another import finished before (or these files changed since): this one replaces it
    elif unfinished is not None and not unfinished.complete and _by_name(unfinished.source) == _by_name(source):
        unfinished = replace(unfinished, source=source)  # a file fixed since it stopped goes on
    report.skipped = skip_rows or 0
    report.already_imported = unfinished is not None and unfinished.complete
    if unfinished is not None:
        if unfinished.source != source:
            raise ConfigError(
                f"{root} holds an unfinished import of {describe_source(unfinished.source)}: run that import again "
                "(read the same way) to finish it, or name the row to start this one from (--from-row) to leave it "
                "unfinished")
        with MessageStore.open(root, config, read_only=True) as view:
            report.skipped = rows_stored(view, unfinished)
    before = set(os.listdir(root)) if root.is_dir() else None
    try:
        store = MessageStore.open(root, config)
        try:
            if queue_max:  # every topic the dataset needs, as many queues as its rows use, before any row is stored
                try:
                    store._create_topics(sorted(queue_max.items()))
                except RocketStoreError as exc:
                    raise type(exc)(f"{exc} (nothing imported: the topics are made before the first row is stored; "
                                    "give the topic the queues its rows use: topic create -t TOPIC -w N)") from None
            skip = report.skipped  # rows come in the same order every time: the first skip go by
            pending = {k: v for k, v in source.items() if k != STAMPS}
            for chunk in _stopping_with_the_count(chunks, report):
                dropped = min(skip, chunk.num_rows)
                skip -= dropped
                if chunk.num_rows > dropped:
                    try:
                        table = batch_columns(chunk.slice(dropped))
                    except RocketStoreError as exc:
                        raise _with_the_count(exc, report) from exc
                    store.flush()  # the rows the journal counts are on the disk before it says so (power loss)
                    log_end = store.commit_log.max_offset
                    journal.record(ImportProgress(  # the files' stamps only once complete: a journal of 10,000
                        pending, report.skipped + report.rows, log_end, table.num_rows,  # files is written often
                        table.column("topic")[0].as_py(), ImportProgress.body_crc(table.column("body")[0].as_py())))
                    try:
                        _put(store, table, report, progress)
                    except RocketStoreError:
                        if not report.skipped + report.rows and store.commit_log.max_offset == log_end:
                            journal.clear()  # refused before any of its rows was stored: nothing to go on from
                        raise
            if report.rows or not report.already_imported:
                store.flush()  # the last batch on the disk before the journal says the import is over
                journal.record(ImportProgress(source, report.skipped + report.rows, store.commit_log.max_offset,
                                              complete=True))
        except BaseException:
            with contextlib.suppress(Exception):  # the import's own error is the one to report
                store.close()
            raise
        try:
            store.close()
        except RocketStoreError as exc:
            if report.rows:  # stored, and the journal says complete: running it again would store nothing
                raise StoredButNotClosedError(f"closing {root} failed after the import stored its rows: {exc}",
                                              report) from exc
            raise
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


CONTENT = "content"  # a source's digest of its files' sizes and times: whether a finished import is this one
STAMPS = "stamps"  # a short hash of each file's name, size and time: which files a finished import read


def file_stamp(name: str) -> str:
    """A dataset file's stamp, the same from either reader (Spark names a local file by a ``file:`` URI): a hash
    of its path, size and modification time (its name alone when it cannot be read here)."""
    if name.startswith("file:"):
        name = urllib.parse.unquote(urllib.parse.urlparse(name).path)
    if "://" not in name:  # one local file however it was named (relative, absolute, through a symlink)
        name = os.path.realpath(name)
    try:
        info = os.stat(name)
        text = f"{name}\t{info.st_size}\t{info.st_mtime_ns}"
    except OSError:
        text = name
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _by_name(source: dict) -> dict:
    """A source without its content digest: an unfinished import goes on after a file was fixed (rewritten)."""
    return {k: v for k, v in source.items() if k not in (CONTENT, STAMPS)}


def _stopping_with_the_count(chunks: Iterable[pa.Table], report: ImportReport) -> Iterator[pa.Table]:
    """``chunks``; a read that fails after some rows were stored (a file unreadable past its checked columns)
    says how many are and where the import goes on from, as a refused batch does."""
    iterator = iter(chunks)
    while True:
        try:
            chunk = next(iterator)
        except StopIteration:
            return
        except RocketStoreError as exc:
            raise _with_the_count(exc, report) from exc
        yield chunk


def _with_the_count(exc: RocketStoreError, report: ImportReport) -> RocketStoreError:
    first = report.skipped + report.rows
    if not first:
        return type(exc)(f"{exc} (nothing imported)")
    return type(exc)(f"{exc} (rows from {first} on not stored; the {first} rows before them are: the same import "
                     f"run again goes on from row {first}, or name it: --from-row {first})")


def _put(store: MessageStore, table: pa.Table, report: ImportReport, progress: Progress | None) -> None:
    try:
        result = store.put_batch(table, copied=True)  # stored messages: a broker's properties kept as they are
    except RocketStoreError as exc:
        text = str(exc)
        found = _ROW.match(text)
        first = report.skipped + report.rows  # rows are named by their place in the dataset
        where = (f"row {first + int(found[1])}: {text[found.end():]}" if found else
                 f"rows {first}..{first + table.num_rows - 1}: {text}")
        if isinstance(exc, TablePartlyStoredError):  # the disk failed a table in parts: exactly what is stored
            report.rows += exc.stored
            done, cause = first + exc.stored, exc.__cause__
            reason = getattr(cause, "strerror", None) or cause or text
            raise StoreIOError(exc.errno or errno.EIO, f"rows {done}..{first + table.num_rows - 1} not stored: "
                               f"{reason} (the {done} rows before them are: run the same import again, without "
                               f"--from-row, and it goes on from row {done})") from exc
        if isinstance(exc, StoreIOError) and not isinstance(exc, StoredButNotClosedError):  # the disk, not a row: a
            # table over several segments may have kept a prefix
            where = f"rows {first}..{first + table.num_rows - 1}: {exc.strerror or text}"
            raise type(exc)(exc.errno or errno.EIO, f"{where} (some of these rows may be stored: run the same import "
                            "again, without --from-row, and it goes on from the first row the store does not "
                            "hold)") from exc
        if not first:
            raise type(exc)(f"{where} (nothing imported)") from exc
        raise type(exc)(f"{where} (rows {first}..{first + table.num_rows - 1} not stored, the {first} before them "
                        f"are: once the data is fixed, import from row {first} on: --from-row {first})") from exc
    report.rows += table.num_rows
    report.batches += 1
    offsets = result.commit_log_offsets
    report.first_offset = int(offsets[0]) if report.first_offset is None else report.first_offset
    report.last_offset = int(offsets[-1])
    if progress is not None:
        progress("importing", report.rows, 0)


# --- a Parquet dataset read in this process -------------------------------------------------------------------


def one_line(exc: BaseException) -> str:
    """Arrow's messages span lines ("...\nDeserializing page header failed.\n"): a CLI error is one line."""
    return " ".join(str(exc).split())


def _hidden(name: str) -> bool:
    """Names a dataset reader passes over, as Spark's file index does: ``_SUCCESS``, ``.crc`` files, staging."""
    return (name.startswith("_") and "=" not in name) or name.startswith(".") or name.endswith("._COPYING_")


_NULL_PARTITION = "__HIVE_DEFAULT_PARTITION__"


class ParquetDataset:
    """A Parquet file, or a directory of them (``topic=.../date=...`` directories as string columns, as
    ``spark.jobs.read_parquet`` reads them), its files in name order."""

    def __init__(self, path: str | Path, *, skip_system: bool = False) -> None:
        import pyarrow.parquet as pq

        self.skip_system = skip_system
        self.system_rows: dict[str, int] = {}  # counted by ``first_bad_row``
        self.queue_max: dict[str, int] = {}  # each topic's highest queue id, found by ``first_bad_row``
        self.checked_rows = 0  # the rows ``first_bad_row`` read (without the skipped system rows)
        self.path = Path(path)
        if not self.path.exists():
            raise ConfigError(f"{path} does not exist")
        if self.path.is_dir():
            files = []
            for directory, dirs, names in os.walk(self.path):
                dirs[:] = sorted(d for d in dirs if not _hidden(d))
                files += [Path(directory) / name for name in names if not _hidden(name)]
            self.files = sorted(files, key=lambda f: f.relative_to(self.path).parts)
        else:
            self.files = [self.path]
        if not self.files:
            raise ConfigError(f"{path} holds no Parquet file")
        self._meta = []
        for file in self.files:
            try:
                # INT96 timestamps (what Spark writes by default) in microseconds: read as nanoseconds, born times
                # outside 1677-2262 wrapped around, stored wrong or refused after part of the import was stored
                self._meta.append(pq.ParquetFile(file, coerce_int96_timestamp_unit="us"))
            except (OSError, pa.ArrowException) as exc:
                raise ConfigError(f"{file} is not a readable Parquet file: {one_line(exc)}") from None
        self.partitions = [self._partition_values(file) for file in self.files]
        names = {name for values in self.partitions for name in values}
        for meta in self._meta:
            names.update(meta.schema_arrow.names)
        self.columns = [c for c in IMPORT_COLUMNS if c in names]
        missing = {"topic", "body"} - set(self.columns)
        if missing:
            raise ConfigError(f"import needs columns topic and body; missing {sorted(missing)}")
        self.rows = sum(meta.metadata.num_rows for meta in self._meta)

    def _partition_values(self, file: Path) -> dict[str, str | None]:
        values: dict[str, str | None] = {}
        if file == self.path:
            return values
        for part in file.relative_to(self.path).parts[:-1]:
            name, eq, value = part.partition("=")
            if eq and name:
                text = urllib.parse.unquote(value)
                values[urllib.parse.unquote(name)] = None if text == _NULL_PARTITION else text
        return values

    def source(self) -> dict:
        """What the import's journal names it by: its files (number, first, a digest of the names, sizes and
        modification times), row count, and the reader (its order is name order; Spark's is its own). A file
        rewritten with other rows of the same count is another import: named by its names alone, it was taken for
        the import that had finished, and its rows were never stored."""
        names = [str(file) for file in self.files]
        stamps = []
        for name in names:
            try:
                info = os.stat(name)
                stamps.append(f"{name}\t{info.st_size}\t{info.st_mtime_ns}")
            except OSError:  # not a local file (Spark reads it): its name
                stamps.append(name)
        digest = hashlib.sha256("\n".join(names).encode()).hexdigest()[:32]
        content = hashlib.sha256("\n".join(stamps).encode()).hexdigest()[:32]
        return {"reader": "arrow", "first": names[0], "files": len(names), "digest": digest, "rows": self.rows,
                CONTENT: content, STAMPS: sorted(file_stamp(name) for name in names),
                **({"skipSystemTopics": True} if self.skip_system else {})}

    def tables(self, columns: Iterable[str] | None = None) -> Iterator[pa.Table]:
        """The rows in order as tables of at most ``IMPORT_CHUNK_ROWS`` rows and about ``IMPORT_CHUNK_BYTES``."""
        wanted = [c for c in (columns or self.columns) if c in self.columns]
        for file, meta, values in zip(self.files, self._meta, self.partitions, strict=True):
            if not meta.metadata.num_rows:
                continue
            if self.skip_system and values.get("topic") is not None and not importable(values["topic"]):
                continue  # a topic=... directory of the broker's own queue
            in_file = [c for c in wanted if c in meta.schema_arrow.names and c not in values]
            size = sum(meta.metadata.row_group(g).total_byte_size for g in range(meta.num_row_groups))
            rows = max(1, min(IMPORT_CHUNK_ROWS, IMPORT_CHUNK_BYTES * meta.metadata.num_rows // max(size, 1)))
            try:
                for batch in meta.iter_batches(batch_size=rows, columns=in_file, use_threads=True):
                    table = pa.Table.from_batches([batch])
                    table = pa.table({c: table.column(c) if c in in_file  # a directory's value: one per row
                                      else pa.repeat(pa.scalar(values.get(c), pa.string()), table.num_rows)
                                      for c in wanted})
                    if self.skip_system:
                        table, _counts = system_rows_of(table)
                    if table.num_rows:
                        yield table
            except (OSError, pa.ArrowException) as exc:
                raise ConfigError(f"cannot read {file}: {one_line(exc)}") from None

    def _count_system_rows(self) -> dict[str, int]:
        """How many rows of each topic ``importable`` refuses the dataset holds (``skip_system`` passes them over)."""
        counts: dict[str, int] = {}
        for file, meta, values in zip(self.files, self._meta, self.partitions, strict=True):
            topic = values.get("topic")
            if "topic" in values:
                if topic is not None and not importable(topic):
                    counts[topic] = counts.get(topic, 0) + meta.metadata.num_rows
                continue
            try:
                for batch in meta.iter_batches(batch_size=IMPORT_CHUNK_ROWS * 10, columns=["topic"]):
                    for name, n in system_rows_of(pa.Table.from_batches([batch]))[1].items():
                        counts[name] = counts.get(name, 0) + n
            except (OSError, pa.ArrowException) as exc:
                raise ConfigError(f"cannot read {file}: {one_line(exc)}") from None
        return counts

    def first_bad_row(self, config: StoreConfig, queues: dict[str, int] | None = None
                      ) -> tuple[int, str, str] | None:
        """``first_bad_row`` over the whole dataset, its place counted from the dataset's first row."""
        before = 0
        if self.skip_system:
            self.system_rows = self._count_system_rows()
        for table in self.tables(CHECKED_COLUMNS):
            found = first_bad_row(table, config, queues)
            if found is not None:
                return (before + found[0], found[1], found[2])
            before += table.num_rows
            _note_queue_max(table, self.queue_max)
        self.checked_rows = before
        return None


def import_parquet(path: str | Path, root: str | Path, *, config: StoreConfig | None = None,
                   progress: Progress | None = None, explicit: Iterable[str] | None = None,
                   skip_rows: int | None = None, skip_system: bool = False) -> ImportReport:
    """``spark.jobs.import_messages`` for a Parquet dataset this process can read, without Spark: the files in name
    order (an export's queues keep their order), each table one ``put_batch``; the same checks before anything is
    stored, the same journal and resumption. On one machine the fast way: the single writer, not the reading,
    bounds an import."""
    if skip_rows is not None and (type(skip_rows) is not int or skip_rows < 0):
        raise ConfigError(f"skip_rows must be a non-negative integer, not {skip_rows!r}")
    root = Path(root)
    dataset = ParquetDataset(path, skip_system=skip_system)
    fresh, config = import_config(root, config, explicit)
    bad = dataset.first_bad_row(config, existing_queues(root))
    if bad is not None:
        raise bad_row_error(*bad)
    if skip_rows is not None and skip_rows > dataset.checked_rows:
        raise ConfigError(f"cannot import from row {skip_rows} on: the dataset has {dataset.checked_rows} rows"
                          + (" besides the system topics' it passes over" if skip_system else ""))
    report = store_tables(dataset.tables(), root, config, fresh=fresh, source=dataset.source(), skip_rows=skip_rows,
                          progress=progress, queue_max=dataset.queue_max)
    report.system_rows = dataset.system_rows
    return report

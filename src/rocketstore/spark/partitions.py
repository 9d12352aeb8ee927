"""Splitting commit logs into byte ranges and reading a range into Arrow record batches.

Planning needs no scan of the data: a range is just ``[start, stop)`` inside one segment. A
reader finds its first record by syncing: the first position at or after ``start`` holding a
V1/V2 magic whose record validates and whose PHYSICALOFFSET field equals its own position (a
broker writes every record's position into it), then reads every record that *starts* before
``stop``. Each record therefore belongs to exactly one range, and ranges can be read in any
order by any number of tasks. The end of each log is fixed at planning time by a read-only
recovery, so a store that is still being written is read as a consistent prefix.

Records are decoded by the store's batch codec (``rocketstore.codec.batch``): one numba walk per
batch of up to ``BATCH_ROWS`` records, straight into Arrow buffers.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import mmap
import os
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pyarrow as pa

from ..checkpoint import StoreCheckpoint
from ..codec.batch import (
    MESSAGE_COLUMNS,
    MESSAGE_FIELDS,
    DispatchBatch,
    StopKind,
    decode_dispatch,
    decode_range,
    message_row,
)
from ..codec.properties import PropertyName
from ..codec.record import MAX_TIME_MS, find_record_start, message_from_layout, read_layout
from ..commitlog import COMMITLOG_DIR, CommitLog
from ..config import StoreConfig, detect_segment_size
from ..dispatch import index_topic_of, tags_code_of
from ..errors import ConfigError, CorruptDataError, DamagedLogError, StoreIOError, StoreNotVisibleError
from ..index.bulk import index_key_hashes
from ..index.service import build_key, index_keys
from ..lifecycle import ABORT_FILE
from ..message import MessageExt, SysFlag
from ..recovery import follow_log_end, recover_commit_log

log = logging.getLogger(__name__)

MESSAGE_DDL = (
    "topic string, queueId int, queueOffset bigint, commitLogOffset bigint, msgId string, uniqKey string, "
    "keys array<string>, tags string, body binary, properties map<string,string>, bornTimestamp timestamp, "
    "storeTimestamp timestamp, bornHost string, storeHost string, sysFlag int, flag int, reconsumeTimes int, "
    "preparedTransactionOffset bigint, storeSize int, bodyCRC int, brokerName string"
)
DISPATCH_DDL = ", tagsCode bigint, indexKeyHashes array<bigint>"
PACKED_COLUMN = "arrow"  # option packArrow: each row one Arrow IPC stream of decoded batches
PACKED_DDL = f"{PACKED_COLUMN} binary"
PACKED_BYTES = 8 << 20  # Arrow bytes per packed row at most (one batch may exceed it)

ARROW_FIELDS = MESSAGE_FIELDS  # the MessageExt columns, defined by the codec
STORE_TIME_TYPE = dict(MESSAGE_FIELDS)["storeTimestamp"]
DISPATCH_FIELDS = [("tagsCode", pa.int64()), ("indexKeyHashes", pa.list_(pa.int64()))]
DISPATCH_COLUMNS = tuple(name for name, _ in DISPATCH_FIELDS)
BATCH_ROWS = 8192
DEFAULT_MAX_BYTES_PER_PARTITION = 64 << 20


SOURCE_OPTIONS = ("topics", "startingTimestamp", "endingTimestamp", "startingOffset", "endingOffset",
                  "validatedLogEnd", "maxBytesPerPartition", "minPartitions", "checkCRC", "onCorrupt", "corruptLog",
                  "includeBody", "brokerName", "mappedFileSizeCommitLog", "dispatchInfo", "columns", "packArrow",
                  "messageDelayLevel", "path", "paths")


@dataclass(frozen=True, slots=True)
class ScanOptions:
    """Reader options, parsed and checked once on the driver."""

    topics: frozenset[str] | None = None
    starting_timestamp: int | None = None  # inclusive, ms
    ending_timestamp: int | None = None  # exclusive, ms
    starting_offset: int | None = None  # commit-log offset, inclusive
    ending_offset: int | None = None  # exclusive
    validated_log_end: int | None = None  # the log's end as a recovery under the store's lock found it
    max_bytes_per_partition: int = DEFAULT_MAX_BYTES_PER_PARTITION
    check_crc: bool = True
    include_body: bool = True
    on_corrupt: str = "fail"  # or "skip"
    broker_name: str | None = None
    commit_log_file_size: int | None = None  # default: the size of the segments found
    dispatch_info: bool = False  # add tagsCode and indexKeyHashes (for rebuilds)
    corrupt_log: str | None = None  # directory where each task lists what onCorrupt=skip skipped
    min_partitions: int = 1  # at least this many tasks, of equal bytes (Kafka's source has the same option)
    columns: tuple[str, ...] | None = None  # the columns a task returns (a schema given to the reader); None: all
    packed: bool = False  # one row per Arrow batch, its columns as an IPC stream (``PACKED_DDL``)
    delay_levels_ms: tuple[int, ...] = field(default_factory=lambda: StoreConfig().delay_levels_ms)

    @classmethod
    def from_options(cls, raw: dict[str, str]) -> ScanOptions:
        """Parse reader options; names are case-insensitive, as Spark's are. A name the source does not know is
        refused (a misspelt filter was silently a scan of everything), with the nearest known one."""
        options = _Caseless(raw)
        known = {name.lower(): name for name in SOURCE_OPTIONS}
        for name in raw:
            if str(name).lower() not in known:
                import difflib

                near = difflib.get_close_matches(str(name).lower(), known, n=1, cutoff=0.6)
                hint = f" (did you mean {known[near[0]]!r}?)" if near else ""
                raise ConfigError(f"the rocketmq source has no option {name!r}{hint}; its options are "
                                  f"{', '.join(o for o in SOURCE_OPTIONS if o not in ('path', 'paths'))}")

        def flag(name: str, default: bool) -> bool:
            value = options.get(name)
            if value is None:
                return default
            if value.lower() not in ("true", "false"):
                raise ConfigError(f"option {name} must be true or false, not {value!r}")
            return value.lower() == "true"

        def number(name: str) -> int | None:
            value = options.get(name)
            if value is None or value == "":
                return None
            try:
                return int(value)
            except ValueError:
                raise ConfigError(f"option {name} must be an integer (epoch ms or an offset), not {value!r}") from None

        topics = options.get("topics")
        on_corrupt = options.get("onCorrupt", "fail").lower()
        if on_corrupt not in ("fail", "skip"):
            raise ConfigError(f"option onCorrupt must be fail or skip, not {on_corrupt!r}")
        max_bytes = number("maxBytesPerPartition")
        max_bytes = DEFAULT_MAX_BYTES_PER_PARTITION if max_bytes is None else max_bytes
        if max_bytes < 1024:
            raise ConfigError(f"option maxBytesPerPartition must be at least 1024, not {max_bytes}")
        segment_size = number("mappedFileSizeCommitLog")
        if segment_size is not None and segment_size < 1024:
            raise ConfigError(f"option mappedFileSizeCommitLog must be at least 1024, not {segment_size}")
        min_partitions = number("minPartitions")
        min_partitions = 1 if min_partitions is None else min_partitions
        if min_partitions < 1:
            raise ConfigError(f"option minPartitions must be at least 1, not {min_partitions}")
        delay_levels = options.get("messageDelayLevel")
        if delay_levels is not None:
            from ..config import parse_delay_levels

            try:
                levels = parse_delay_levels(delay_levels)
            except ValueError as exc:
                raise ConfigError(f"option messageDelayLevel: {exc}") from None
        else:
            levels = StoreConfig().delay_levels_ms
        return cls(
            delay_levels_ms=levels,
            topics=frozenset(t.strip() for t in topics.split(",") if t.strip()) if topics else None,
            starting_timestamp=number("startingTimestamp"), ending_timestamp=number("endingTimestamp"),
            starting_offset=number("startingOffset"), ending_offset=number("endingOffset"),
            validated_log_end=number("validatedLogEnd"),
            max_bytes_per_partition=max_bytes, check_crc=flag("checkCRC", True),
            include_body=flag("includeBody", True), on_corrupt=on_corrupt, broker_name=options.get("brokerName"),
            commit_log_file_size=segment_size, dispatch_info=flag("dispatchInfo", False),
            corrupt_log=options.get("corruptLog"), min_partitions=min_partitions,
            packed=flag("packArrow", False),
        )._with_column_option(options.get("columns"))

    def _with_column_option(self, text: str | None) -> ScanOptions:
        """The ``columns`` option: a comma-separated list, as a schema naming them would pick."""
        if text is None:
            return self
        known = dict(ddl_fields(MESSAGE_DDL + DISPATCH_DDL))
        names = [name.strip() for name in text.split(",")]
        return self.with_schema([(name, known.get(name, "")) for name in names if name])

    def with_schema(self, fields: list[tuple[str, str]]) -> ScanOptions:
        """These options returning only ``fields`` ((name, Spark type name) pairs, the schema a user gave the
        reader) in that order; a name this source does not have, or a different type, is a ``ConfigError``."""
        known = dict(ddl_fields(MESSAGE_DDL + DISPATCH_DDL))
        names = tuple(name for name, _ in fields)
        if not names:
            raise ConfigError("no column asked for the rocketmq source")
        if names == tuple(name for name, _ in ddl_fields(MESSAGE_DDL + (DISPATCH_DDL if self.dispatch_info
                                                                           else ""))):
            return self
        for name, kind in fields:
            if name not in known:
                raise ConfigError(f"the rocketmq source has no column {name!r}; its columns are "
                                  f"{', '.join(known)}")
            if kind != known[name]:
                raise ConfigError(f"column {name} is {known[name]} in the rocketmq source, not {kind}")
        if len(set(names)) != len(names):
            raise ConfigError("a schema given to the rocketmq source names a column twice")
        return replace(self, columns=names)

    @property
    def output_columns(self) -> tuple[str, ...]:
        return self.columns or MESSAGE_COLUMNS + (DISPATCH_COLUMNS if self.dispatch_info else ())

    @property
    def output_schema(self) -> pa.Schema:
        """The Arrow schema of the batches a task decodes (inside the IPC streams when packed)."""
        types = dict(ARROW_FIELDS + DISPATCH_FIELDS)
        return pa.schema([(name, types[name]) for name in self.output_columns])


def ddl_fields(ddl: str) -> list[tuple[str, str]]:
    """(name, type) pairs of a flat DDL string such as ``MESSAGE_DDL`` (types may hold commas: ``map<a,b>``)."""
    fields, depth, start = [], 0, 0
    for i, c in enumerate(ddl + ","):
        depth += (c == "<") - (c == ">")
        if c == "," and depth == 0:
            name, kind = ddl[start:i].strip().split(" ", 1)
            fields.append((name, kind.replace(" ", "")))
            start = i + 1
    return fields


class _Caseless(dict):
    def __init__(self, raw: dict[str, str]) -> None:
        super().__init__((str(k).lower(), v) for k, v in raw.items())

    def get(self, key: str, default=None):  # type: ignore[override]
        return super().get(key.lower(), default)


@dataclass(frozen=True, slots=True)
class LogRange:
    """Records starting in ``[start, stop)`` of one segment; bytes past ``data_end`` are not the log's."""

    root: str
    broker_name: str
    segment: str
    segment_start: int
    segment_size: int
    start: int
    stop: int
    data_end: int


def resolve_roots(paths: str | list[str]) -> list[Path]:
    """Absolute store roots from a path, a comma-separated list or globs; each must hold a commitlog directory.
    A store named twice (listed twice, matched by a glob and named too, reached through a symlink) is one root, the
    first: read twice, every row came twice (and an export imported stored each message twice)."""
    items = paths.split(",") if isinstance(paths, str) else list(paths)
    roots: list[Path] = []
    seen: set[str] = set()
    for item in (i.strip() for i in items):
        if not item:
            continue
        path = os.path.expanduser(item)
        # a store whose name holds glob characters (broker[c]/store) is itself, not a pattern: a resolved root passed
        # on (find_keys, the source's options) was globbed again, matched nothing and was skipped without a word
        literal = not glob.has_magic(item) or os.path.isdir(os.path.join(path, COMMITLOG_DIR))
        matches = [path] if literal else sorted(glob.glob(path))
        for match in matches:
            root = Path(os.path.abspath(match))  # executors resolve paths in their own working directories
            if not (root / COMMITLOG_DIR).is_dir():
                if not literal:
                    continue
                raise StoreIOError(2, f"{root} holds no store (no {COMMITLOG_DIR} directory)")
            real = os.path.realpath(root)
            if real not in seen:
                seen.add(real)
                roots.append(root)
    if not roots:
        raise StoreIOError(2, f"no store found at {paths!r}")
    return roots


def require_visible(root: str | Path) -> None:
    """Fail with the operator's fix when this host (a Spark executor) does not see the store the driver saw."""
    if not os.path.isdir(os.path.join(root, COMMITLOG_DIR)):
        raise StoreNotVisibleError(f"store {root} is not visible from the executor on host "
                                   f"{socket.gethostname()}: mount it at the same path on every worker")


def broker_name_of(root: Path) -> str:
    """The directory name; for RocketMQ's usual ``.../<broker>/store`` layout, the parent's."""
    resolved = root.resolve()
    return resolved.parent.name if resolved.name == "store" and resolved.parent.name else resolved.name


def log_bounds(root: Path, segment_size: int, validated_end: int | None = None,
               follow_from: int | None = None, options: ScanOptions | None = None) -> tuple[CommitLog, int, int]:
    """Open a commit log read-only and recover its end in memory: (log, min offset, end offset). With
    ``validated_end`` (a rebuild's, from its recovery under the store's lock) that is the end: no second
    recovery, which walks the last segments again (~100 ms a window for a 392 MB log, seconds for 1 GiB ones).
    With ``follow_from`` (an end found before: a stream's last) only the records after it are validated.
    A recovery that ends the log at damage with intact records after it fails with ``DamagedLogError`` (the
    scan would silently leave them out), or with ``options.on_corrupt == "skip"`` says how much is left out."""
    config = StoreConfig(mapped_file_size_commit_log=segment_size)
    commit_log = CommitLog(root, config, read_only=True)
    commit_log.load()
    if follow_from is not None and validated_end is None:
        end = follow_log_end(commit_log, follow_from)
        if end is not None:
            return commit_log, commit_log.min_offset, end
    if validated_end is not None:
        last = commit_log.mapped_files.last
        if last is None or not commit_log.min_offset <= validated_end <= last.file_end_offset:
            commit_log.close()
            raise ConfigError(f"validatedLogEnd {validated_end} is outside the log's files in {root}")
        return commit_log, commit_log.min_offset, validated_end
    checkpoint = StoreCheckpoint.load(root / "checkpoint", read_only=True)
    report = recover_commit_log(commit_log, checkpoint, root, abnormal=(root / ABORT_FILE).exists())
    if report.resumes_at is not None:
        try:
            _damaged_end(root, segment_size, report, options or ScanOptions())
        except BaseException:
            commit_log.close()
            raise
    return commit_log, commit_log.min_offset, report.end_offset


def _damaged_end(root: Path, segment_size: int, report, options: ScanOptions) -> None:
    """The log's end is damage with intact records after it: fail, or (skip) log and note what is left out."""
    text = (f"the commit log of {root} ends at damage at offset {report.end_offset} ({report.stop_reason}); "
            f"{report.bytes_after_end} bytes after it, with intact records from offset {report.resumes_at} on,")
    if options.on_corrupt == "fail":
        error = DamagedLogError(f"{text} would be left out (onCorrupt=skip reads up to the damage)")
        error.offset = report.end_offset
        raise error
    log.warning("%s are left out (onCorrupt=skip)", text)
    if options.corrupt_log:
        segment = root / COMMITLOG_DIR / f"{report.end_offset // segment_size * segment_size:020d}"
        r = LogRange(str(root), "", str(segment), 0, segment_size, report.end_offset, report.end_offset,
                     report.end_offset)
        _write_corrupt_log(options.corrupt_log, r, [{"segment": str(segment), "offset": report.end_offset,
                                                     "bytes": report.bytes_after_end,
                                                     "reason": f"the log ends here: {report.stop_reason}"}])


def check_log_ends(paths: str | list[str], options: ScanOptions) -> None:
    """On the driver, before a job: the check ``log_bounds`` makes when Spark plans, raised here as the typed
    ``DamagedLogError`` (a planner's error reaches the driver wrapped in Spark's)."""
    if options.validated_log_end is not None:
        return
    recovery_log = logging.getLogger("rocketstore.recovery")
    quiet = logging.Filter("-")  # recovery's own warning about the end: the error (or skip's warning) says it
    recovery_log.addFilter(quiet)
    try:
        for root in resolve_roots(paths):
            size = options.commit_log_file_size or detect_segment_size(root)
            if size is not None:
                log_bounds(root, size, options=options)[0].close()
    finally:
        recovery_log.removeFilter(quiet)


def plan_ranges(roots: list[Path], options: ScanOptions) -> list[list[LogRange]]:
    """The tasks of a scan: each a list of byte ranges (one per segment it touches), together covering every
    store's log. There are ``max(min_partitions, ceil(log bytes / max_bytes_per_partition))`` of them, of equal
    bytes: a task's fixed cost (~40-60 ms here) is paid once per task, so tasks are few and even rather than
    one per segment piece (a 107 MB log in 64 MiB segments and 8 MiB pieces was 14 tasks, two of them short)."""
    if options.broker_name and len(roots) > 1:
        raise ConfigError("option brokerName names one store; with several, names come from their directories")
    if options.validated_log_end is not None and len(roots) > 1:
        raise ConfigError("option validatedLogEnd is one store's; with several, each is recovered")
    pieces: list[LogRange] = []
    for root in roots:
        size = options.commit_log_file_size or detect_segment_size(root)
        if size is None:
            continue  # an empty store
        commit_log, low, log_end = log_bounds(root, size, options.validated_log_end, options=options)
        try:
            low = max(low, options.starting_offset or 0)
            end = log_end if options.ending_offset is None else min(log_end, options.ending_offset)
            name = options.broker_name or broker_name_of(root)
            for mapped in commit_log.mapped_files.files:
                seg_start, seg_end = mapped.file_from_offset, mapped.file_end_offset
                start, stop = max(seg_start, low), min(seg_end, end)
                if start < stop:
                    pieces.append(LogRange(str(root), name, str(mapped.path), seg_start, mapped.file_size, start, stop,
                                           min(seg_end, log_end)))
        finally:
            commit_log.close()
    return even_tasks(pieces, options.min_partitions, options.max_bytes_per_partition)


def even_tasks(pieces: list[LogRange], min_tasks: int, max_bytes: int) -> list[list[LogRange]]:
    """``pieces`` (in log order) cut into ``max(min_tasks, ceil(bytes / max_bytes))`` tasks of equal bytes (to
    one byte), each a run of consecutive pieces or parts of them; no task is empty."""
    total = sum(p.stop - p.start for p in pieces)
    if not total:
        return []
    count = min(total, max(min_tasks, -(-total // max_bytes)))
    tasks: list[list[LogRange]] = [[] for _ in range(count)]
    done, task = 0, 0  # bytes planned so far; task i takes the bytes [total * i // count, total * (i + 1) // count)
    for piece in pieces:
        at = piece.start
        while at < piece.stop:
            while done >= total * (task + 1) // count:
                task += 1
            upto = min(piece.stop, at + total * (task + 1) // count - done)
            tasks[task].append(replace(piece, start=at, stop=upto))
            done += upto - at
            at = upto
    return [task for task in tasks if task]


class MessageColumns:
    """Column lists for one Arrow batch."""

    def __init__(self, dispatch_info: bool) -> None:
        self.names = [name for name, _ in ARROW_FIELDS] + ([n for n, _ in DISPATCH_FIELDS] if dispatch_info else [])
        self.types = [t for _, t in ARROW_FIELDS] + ([t for _, t in DISPATCH_FIELDS] if dispatch_info else [])
        self.data: list[list] = [[] for _ in self.names]

    def __len__(self) -> int:
        return len(self.data[0])

    def batch(self) -> pa.RecordBatch:
        if len(self.names) > len(ARROW_FIELDS):  # dispatch info: hash every index key of the batch at once
            keys = self.data[-1]
            lengths = np.fromiter(map(len, keys), dtype=np.int32, count=len(keys))
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            hashes = index_key_hashes([k for row in keys for k in row])
            self.data[-1] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(hashes, type=pa.int64()))
        arrays = [values if isinstance(values, pa.Array) else pa.array(values, type=t)
                  for values, t in zip(self.data, self.types, strict=True)]
        self.data = [[] for _ in self.names]
        return pa.RecordBatch.from_arrays(arrays, names=self.names)


def read_range(r: LogRange, options: ScanOptions) -> Iterator[pa.RecordBatch]:
    """Decode the records of one range into Arrow batches (filters applied, corrupt records never returned)."""
    try:
        fd = os.open(r.segment, os.O_RDONLY)
    except OSError as exc:
        require_visible(r.root)
        raise StoreIOError(exc.errno, f"cannot open segment {r.segment}: {exc.strerror}") from exc
    try:
        actual = os.fstat(fd).st_size
        if actual < r.segment_size:  # cut short since the plan was made: mmap's own error named no file
            raise CorruptDataError(f"segment is {actual} bytes, expected {r.segment_size} (cut short since the job "
                                   "was planned)", r.segment)
        with mmap.mmap(fd, r.segment_size, access=mmap.ACCESS_READ) as buf:
            yield from _read(buf, r, options)
    finally:
        os.close(fd)


def packed(batches: Iterator[pa.RecordBatch], schema: pa.Schema,
           limit: int = PACKED_BYTES) -> Iterator[pa.RecordBatch]:
    """Batches as rows of one binary column, each an Arrow IPC stream of up to ``limit`` bytes of them.

    For jobs that collect decoded columns to the driver (rebuild): the JVM then moves a few large values
    instead of turning every record into a row and back into Arrow."""
    pending: list[pa.RecordBatch] = []
    size = 0

    def flush() -> pa.RecordBatch:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, schema) as writer:
            for batch in pending:
                writer.write_batch(batch)
        pending.clear()
        data = sink.getvalue()
        offsets = pa.py_buffer(np.array([0, data.size], dtype=np.int32))
        return pa.RecordBatch.from_arrays([pa.Array.from_buffers(pa.binary(), 1, [None, offsets, data])],
                                          [PACKED_COLUMN])

    for batch in batches:
        pending.append(batch)
        size += batch.nbytes
        if size >= limit:
            yield flush()
            size = 0
    if pending:
        yield flush()


def unpacked(blobs: pa.ChunkedArray | pa.Array, schema: pa.Schema) -> pa.Table:
    """The table that ``packed`` rows hold, in their order (no copy of the Arrow data)."""
    chunks = blobs.chunks if isinstance(blobs, pa.ChunkedArray) else [blobs]
    batches = [batch for chunk in chunks for i in range(len(chunk))
               for batch in pa.ipc.open_stream(chunk[i].as_buffer())]
    return pa.Table.from_batches(batches, schema)


# a record starting at the range's last byte has its magic (bytes 4..8) 7 bytes past the end: the search for the
# first record of a range looks that far (+4 missed records starting 1-3 bytes before the end) and no further (a
# record starting at the end is the next range's)
_LAST_START = 7


def _read(buf, r: LogRange, options: ScanOptions) -> Iterator[pa.RecordBatch]:
    limit = r.data_end - r.segment_start
    stop = r.stop - r.segment_start
    pos = r.start - r.segment_start
    if pos > 0:
        # a record starting in this range may end far past it (a 4 MB body in a 1 MB task): validated to the data's
        # end, or this task and the one before both passed it over
        found = find_record_start(buf, pos, min(limit, stop + _LAST_START), r.segment_start, r.segment_size,
                                  record_limit=limit)
        pos = found if found is not None else limit
    end = min(limit, stop)
    skipped: list[dict] = []
    output = list(options.output_columns)
    dispatch_info = bool(set(output) & set(DISPATCH_COLUMNS))
    decoded = [name for name in output if name in MESSAGE_COLUMNS]  # what the batch codec builds ...
    for needed, wanted in (("commitLogOffset", dispatch_info),  # ... and what matching and filtering read
                           ("storeTimestamp", options.starting_timestamp is not None
                            or options.ending_timestamp is not None)):
        if wanted and needed not in decoded:
            decoded.append(needed)
    if not decoded:
        decoded = ["commitLogOffset"]
    segment_limit = min(limit, r.segment_size)

    def message_at(at: int):  # one record through the record codec (dispatch info's slow rows)
        layout = read_layout(buf, at, segment_limit, check_crc=False, path=r.segment, base=r.segment_start)
        assert layout is not None  # validated by the walk that found it
        return message_from_layout(buf, at, layout, read_body=False, path=r.segment, base=r.segment_start)

    # a rebuild's columns all come from the dispatcher's walk: one walk, not decode_range's and then that one
    # (without dispatch info decode_range alone is one walk already, and the cheaper one)
    dispatch_only = dispatch_info and options.topics is None and set(output) <= DISPATCH_ONLY_COLUMNS
    while pos < end:
        batch = None
        if dispatch_only:
            dispatch, halt = decode_dispatch(buf, pos, end, base=r.segment_start, limit=segment_limit,
                                             path=r.segment, max_rows=BATCH_ROWS, check_crc=options.check_crc)
            batch = _dispatch_only_batch(dispatch, options, message_at)
        if batch is None:
            batch, halt = decode_range(buf, pos, end, base=r.segment_start, limit=segment_limit,
                                       check_crc=options.check_crc, include_body=options.include_body,
                                       topics=options.topics, broker_name=r.broker_name, path=r.segment,
                                       max_rows=BATCH_ROWS, columns=decoded)
            if batch.num_rows and dispatch_info:  # the dispatcher's own kernels over the same records
                dispatch, _ = decode_dispatch(buf, pos, halt.pos, base=r.segment_start, limit=segment_limit,
                                              path=r.segment, max_rows=2 * BATCH_ROWS)
                batch = with_dispatch_info(batch, dispatch, options, message_at)
        batch = _in_time_window(batch, options)
        if batch.num_rows:
            yield batch.select(output)
        if halt.kind is StopKind.LIMIT:
            pos = halt.pos
            continue
        if halt.kind is not StopKind.DAMAGE:
            break  # the range's end, or the segment's BLANK record
        assert halt.error is not None
        if options.on_corrupt == "fail":
            raise halt.error
        found = find_record_start(buf, halt.pos + 1, min(limit, stop + _LAST_START), r.segment_start, r.segment_size,
                                  record_limit=limit)
        resume = limit if found is None else found
        log.warning("skipping %d bytes of corrupt data: %s", resume - halt.pos, halt.error)
        skipped.append({"segment": r.segment, "offset": halt.offset, "bytes": resume - halt.pos,
                        "reason": halt.error.reason})
        if found is None:
            break
        pos = found
    if skipped and options.corrupt_log:
        _write_corrupt_log(options.corrupt_log, r, skipped)


DISPATCH_ONLY_COLUMNS = frozenset({"topic", "queueId", "queueOffset", "commitLogOffset", "storeSize", "sysFlag",
                                   "storeTimestamp", *DISPATCH_COLUMNS})


def _dispatch_only_batch(dispatch: DispatchBatch, options: ScanOptions,
                         message_at: Callable[[int], MessageExt]) -> pa.RecordBatch | None:
    """``DISPATCH_ONLY_COLUMNS`` of the records the dispatcher's walk decoded, or None where a record needs the
    record codec (scheduled messages, text that is not UTF-8, a store time out of range): ``decode_range``
    then takes the same records, as it would have without this path."""
    if dispatch.slow_count or (len(dispatch) and int(np.abs(dispatch.store_ts).max()) > MAX_TIME_MS):
        return None
    columns = {
        "topic": pa.array(dispatch.topics, pa.string()).take(pa.array(dispatch.topic_code)),
        "queueId": pa.array(dispatch.queue_id.astype(np.int32)),
        "queueOffset": pa.array(dispatch.queue_offset.astype(np.int64)),
        "commitLogOffset": pa.array(dispatch.phy.astype(np.int64)),
        "storeSize": pa.array(dispatch.size.astype(np.int32)),
        "sysFlag": pa.array(dispatch.sys_flag.astype(np.int32)),
        "storeTimestamp": pa.array(dispatch.store_ts.astype(np.int64) * 1000, pa.int64()).view(STORE_TIME_TYPE),
    }
    batch = pa.RecordBatch.from_arrays(list(columns.values()), names=list(columns))
    return with_dispatch_info(batch, dispatch, options, message_at)


def _in_time_window(batch: pa.RecordBatch, options: ScanOptions) -> pa.RecordBatch:
    """The rows whose store time lies in ``[starting_timestamp, ending_timestamp)`` (ms)."""
    if options.starting_timestamp is None and options.ending_timestamp is None:
        return batch
    micros = batch.column("storeTimestamp").cast(pa.int64()).to_numpy()
    keep = np.ones(len(micros), dtype=bool)
    if options.starting_timestamp is not None:
        keep &= micros >= options.starting_timestamp * 1000
    if options.ending_timestamp is not None:
        keep &= micros < options.ending_timestamp * 1000
    return batch if keep.all() else batch.filter(pa.array(keep))


def with_dispatch_info(batch: pa.RecordBatch, dispatch: DispatchBatch, options: ScanOptions,
                       message_at: Callable[[int], MessageExt]) -> pa.RecordBatch:
    """Add tagsCode and indexKeyHashes, what the dispatcher derives from each record (for rebuilds): taken from
    ``dispatch``, the same records through the dispatcher's compiled decode; its ``slow`` rows (scheduled
    messages, text that is not UTF-8) one at a time, as the dispatcher takes them: ``message_at`` decodes the
    record at a buffer position (so the batch needs no properties column)."""
    n = batch.num_rows
    at = np.searchsorted(dispatch.phy, batch.column("commitLogOffset").to_numpy())
    assert np.array_equal(dispatch.phy[np.minimum(at, len(dispatch.phy) - 1)], batch.column("commitLogOffset")
                          .to_numpy()), "the dispatch decode must see every record of the batch"
    tags_codes = dispatch.tags_code[at]
    row_of = np.full(len(dispatch.phy), -1, dtype=np.int64)
    row_of[at] = np.arange(n)
    entry_row = row_of[dispatch.entry_owner]
    rollback = (dispatch.sys_flag & SysFlag.TRANSACTION_MASK) == SysFlag.TRANSACTION_ROLLBACK_TYPE
    keep = (entry_row >= 0) & ~rollback[dispatch.entry_owner]
    rows, hashes = entry_row[keep], dispatch.entry_hash[keep]
    slow = np.flatnonzero(dispatch.slow[at])
    if len(slow):
        slow_rows, slow_keys = [], []
        for row, record_pos in zip(slow.tolist(), dispatch.pos[at[slow]].tolist(), strict=True):
            msg = message_at(record_pos)
            tags_codes[row], keys = _dispatch_info_of(msg.topic, msg.properties, msg.store_timestamp, msg.sys_flag,
                                                      options)
            slow_rows += [row] * len(keys)
            slow_keys += keys
        rows = np.concatenate([rows, np.array(slow_rows, dtype=np.int64)])
        hashes = np.concatenate([hashes, index_key_hashes(slow_keys)])
        order = np.argsort(rows, kind="stable")
        rows, hashes = rows[order], hashes[order]
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(np.bincount(rows, minlength=n), out=offsets[1:])
    columns = [*batch.columns, pa.array(tags_codes, pa.int64()),
               pa.ListArray.from_arrays(pa.array(offsets), pa.array(hashes, type=pa.int64()))]
    return pa.RecordBatch.from_arrays(columns, names=[*batch.schema.names, *(n for n, _ in DISPATCH_FIELDS)])


def _dispatch_info_of(topic: str, props: dict[str, str], store_timestamp: int, sys_flag: int,
                      options: ScanOptions) -> tuple[int, list[str]]:
    """One record's tags code and index keys (``topic#key``), the dispatcher's rules one at a time."""
    tags_code = tags_code_of(topic, props, store_timestamp, options.delay_levels_ms)
    if SysFlag.transaction_type(sys_flag) == SysFlag.TRANSACTION_ROLLBACK_TYPE:
        return tags_code, []
    index_topic = index_topic_of(topic, props)
    return tags_code, [build_key(index_topic, k) for k in index_keys(props.get(PropertyName.UNIQ_KEY),
                                                                     props.get(PropertyName.KEYS))]


def _write_corrupt_log(directory: str, r: LogRange, skipped: list[dict]) -> None:
    """One JSON-lines file per range (rewritten if the task is retried): what a skip scan left out. Named by the
    store's whole path too: brokers' stores are all ``<broker>/store``, and one's report replaced another's."""
    os.makedirs(directory, exist_ok=True)
    root = hashlib.sha256(os.path.abspath(r.root).encode("utf-8", "surrogateescape")).hexdigest()[:12]
    name = f"{Path(r.root).name}-{root}-{Path(r.segment).name}-{r.start:020d}.jsonl"
    tmp = os.path.join(directory, f".{name}.tmp")
    with open(tmp, "w", encoding="utf-8") as out:
        out.writelines(json.dumps(item) + "\n" for item in skipped)
    os.replace(tmp, os.path.join(directory, name))


def corrupt_report(directory: str | Path) -> list[dict]:
    """Everything a scan with ``onCorrupt=skip`` and ``corruptLog=directory`` skipped, by offset."""
    items: list[dict] = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        items.extend(json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line)
    return sorted(items, key=lambda item: (item["segment"], item["offset"]))


def append_message(columns: MessageColumns, msg, broker: str, options: ScanOptions) -> None:
    """Add one decoded message to ``columns`` (the record-at-a-time reference the tests hold ``read_range`` to)."""
    values = message_row(msg, options.include_body, broker)
    if options.dispatch_info:
        tags_code, keys = _dispatch_info_of(msg.topic, msg.properties, msg.store_timestamp, msg.sys_flag, options)
        values += [tags_code, keys]  # hashed per batch in MessageColumns.batch
    for column, value in zip(columns.data, values, strict=True):
        column.append(value)

"""A full offline check of a store: every record, every queue unit, every index entry.

RocketMQ ships no such tool. ``verify_store`` opens nothing for writing and changes no byte. It
reports each problem with the file and the offset where it is:

* commit log: records whose CRC, magic or lengths fail, in every segment (recovery only looks at
  the newest ones), records whose PHYSICALOFFSET disagrees with their position, segments that do
  not end with a BLANK record, bytes after the end of the log that are not zero;
* consume queues: files that are not ``mappedFileSizeConsumeQueue`` bytes (RocketMQ's load refuses them); units
  that do not point at a record start of their topic and queue, with the record's size and queue offset and the
  right tags code; records missing from their queue;
* index: files it cannot read; chains that do not run strictly backwards (a self-loop, a forward or
  out-of-range link: a key lookup would stop short); entries pointing at no record or at a record
  none of whose keys has the entry's hash;
  keys of records that no entry covers (messages that could not be found by key).

The log is read in compiled batches, body CRCs included (the dispatch decoder); queue units and
index entries are checked as whole numpy arrays against the records sorted by offset, so the cost
stays O(n log n) however many of them dangle, and ``Problem`` objects are built only for the ``max_problems`` reported.

A store locked by a writer is *live*: it is checked as a snapshot. Its end is the read-only
recovered end taken first; records the dispatcher had not reached when verify started (past the
newest index entry seen then, or in or after the dispatch batch of the newest queue unit, as a batch
writes its units queue by queue) are not missing, units and entries written after the
snapshot are ignored, and the bytes past its end are the writer's, not garbage.
"""

from __future__ import annotations

import collections
import os
import struct
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .brokerconfig import TopicConfigManager
from .brokerlayout import batch_cq_topics, is_lmq
from .checkpoint import StoreCheckpoint
from .codec.batch import DispatchBatch, StopKind, as_array, decode_dispatch, store_ts_at
from .codec.properties import PropertyName
from .codec.record import find_record_start, message_from_layout, read_layout
from .commitlog import CommitLog
from .config import StoreConfig
from .consumequeue import (
    CONSUMEQUEUE_DIR,
    CQ_UNIT_SIZE,
    EXT_ADDR_MAX,
    PRE_BLANK_SIZE,
    UNIT_DTYPE,
    ConsumeQueueTable,
)
from .dispatch import DISPATCH_ROWS, index_topic_of, tags_code_of
from .encoder import PARKED_TOPICS, SCHEDULE_TOPIC, TIMER_TOPIC, java_integer
from .errors import ConfigError, CorruptDataError
from .index import _kernels as _ik
from .index.bulk import index_key_hashes
from .index.file import INDEX_ENTRY_SIZE, INDEX_HEADER_SIZE
from .index.service import IndexService, build_key, chain_problem_at, index_keys
from .lifecycle import ABORT_FILE, is_locked
from .mapped.file import STAGING_DIR, MappedFile, parse_segment_name
from .message import SysFlag
from .recovery import last_nonzero_end, recovered_log_end
from .swap import pending_swap

Progress = Callable[[str, int, int], None]
_NOT_LIVE = 1 << 62  # a frontier past any offset: on a dead store every record must be in place


@dataclass(frozen=True, slots=True)
class Problem:
    kind: str  # commitlog | consumequeue | index
    path: str
    offset: int  # byte offset in ``path`` (for the commit log: the global commit-log offset)
    detail: str

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return f"{self.kind}: {self.path} @ {self.offset}: {self.detail}"


@dataclass(slots=True)
class VerifyReport:
    problems: list[Problem] = field(default_factory=list)  # the first ``max_problems`` found
    records: int = 0
    queue_units: int = 0
    index_entries: int = 0
    log_end: int = 0  # the recovered end of the log; on a live store, the end of the snapshot checked
    live: bool = False  # a writer held the store's lock: a snapshot was checked
    # no writer, but an abort file: the writer died (kill -9, a crash). The records after the newest queue unit
    # and index entry were not dispatched yet: a writer's next open dispatches them, as a broker's restart does,
    # so they are counted here and are no problem
    unclean: bool = False
    not_dispatched: int = 0  # records past the queues' frontier missing from their queue
    not_indexed: int = 0  # records past the index's newest entry with keys not indexed
    unfinished_bytes: int = 0  # unclean: bytes of an append the dead writer did not finish, after the log's end
    pending_swap: str | None = None  # a rebuild whose swap was interrupted: the queues and index checked are the old
    problem_count: int = 0  # every problem found, also those past ``max_problems``
    not_checked: list[str] = field(default_factory=list)  # a broker's data this store leaves alone (brokerlayout)
    max_problems: int = field(default=10_000, repr=False)

    @property
    def clean(self) -> bool:
        return self.problem_count == 0

    @property
    def snapshot_end(self) -> int:
        return self.log_end

    def add(self, problem: Problem) -> None:
        self.problem_count += 1
        if len(self.problems) < self.max_problems:
            self.problems.append(problem)

    def add_many(self, failures: np.ndarray, make: Callable[[int], Problem]) -> None:
        """Count every failure, but build a ``Problem`` (per-item Python work) only for those kept."""
        self.problem_count += len(failures)
        room = max(0, self.max_problems - len(self.problems))
        self.problems.extend(make(int(i)) for i in failures[:room])


@dataclass(slots=True)
class _Records:
    """The valid records of the log as parallel arrays, in log order (``phy`` ascending)."""

    phy: np.ndarray
    size: np.ndarray
    queue_offset: np.ndarray
    tags_code: np.ndarray
    sys_flag: np.ndarray
    queue: np.ndarray  # number of the record's (topic, queue id) in ``queues``
    store_ts: np.ndarray
    queues: list[tuple[str, int]]
    key_pairs: np.ndarray  # sorted, unique: record number << 32 | index key hash (hashes are < 2**31)
    # timer records (ascending) and their due times: the tags code earlier rocketstore versions gave their units
    legacy_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    legacy_tags: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def find(self, phys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(record number, found) for each offset: whether a record starts exactly there."""
        if not len(self.phy):
            return np.zeros(len(phys), np.int64), np.zeros(len(phys), bool)
        at = np.minimum(np.searchsorted(self.phy, phys), len(self.phy) - 1)
        return at, self.phy[at] == phys


@dataclass(slots=True)
class _Snapshot:
    """What a live store is checked against, fixed before anything else is read."""

    end: int  # the commit log is read up to here
    queue_frontier: int  # records from here on may not have been dispatched to their queues yet


def verify_store(root: str | Path, config: StoreConfig, *, progress: Progress | None = None,
                 max_problems: int = 10_000) -> VerifyReport:
    """Check the whole store read-only; see the module docstring for what is checked."""
    if max_problems < 0:
        raise ConfigError(f"max_problems must be 0 or more, not {max_problems}")
    root = Path(root)
    report = VerifyReport(max_problems=max_problems)
    report.live = is_locked(root)
    _low, report.log_end = recovered_log_end(root, config)  # first: the snapshot ends here
    snapshot = None
    if report.live:
        snapshot = _Snapshot(report.log_end, min(report.log_end, _queue_frontier(root, config)))
    report.unclean = not report.live and (root / ABORT_FILE).exists()
    staged = pending_swap(root / STAGING_DIR)
    report.pending_swap = None if staged is None else str(staged)
    commit_log = CommitLog(root, config, read_only=True)
    commit_log.load()  # every segment, in full: verify looks past the recovered end too
    try:
        records = _check_log(commit_log, config, report, progress, snapshot)
        log_min = commit_log.min_offset
    finally:
        commit_log.close()
    _check_queues(root, config, records, report, progress, snapshot, log_min)
    _check_index(root, config, records, report, progress, snapshot)
    return report


def _check_log(commit_log: CommitLog, config: StoreConfig, report: VerifyReport, progress: Progress | None,
               snapshot: _Snapshot | None) -> _Records:
    """Scan every segment in full (a live store: up to the snapshot's end) and collect the records, a
    compiled batch at a time (the dispatch decoder with body CRCs on). Segments decode on a thread per
    core (the kernels release the GIL) and are collected in log order."""
    collected = _Collector(config)
    files = commit_log.mapped_files.files
    for name in sorted(commit_log.mapped_files.foreign):
        report.add(Problem("commitlog", str(commit_log.mapped_files.directory / name), 0,
                           "not a segment (a segment's name is its 20-digit start offset): rocketstore does not read "
                           "it; RocketMQ would take a numeric name for a segment, or refuse to start"))
    stop_at = snapshot.end if snapshot else None
    # segments after the last one holding data are a broker's next segments, created ahead (AllocateMappedFile-
    # Service): the log ends before them, and they are neither damage nor read
    while len(files) > 1 and last_nonzero_end(files[-1], 0) == 0:
        files = files[:-1]
    total = sum(f.file_size for f in files)
    done = 0
    workers = max(1, min(os.cpu_count() or 1, len(files)))
    with ThreadPoolExecutor(workers, thread_name_prefix="rocketstore-verify") as pool:
        pending: collections.deque = collections.deque()
        for n, mapped in enumerate(files):
            size = mapped.file_size if stop_at is None else min(mapped.file_size,
                                                                  max(0, stop_at - mapped.file_from_offset))
            pending.append((mapped, pool.submit(_scan_segment, mapped, size, n == len(files) - 1, report.unclean)))
            while pending and (len(pending) > workers or n == len(files) - 1):
                segment, future = pending.popleft()
                batches, problems, unfinished = future.result()
                report.unfinished_bytes += unfinished
                for batch in batches:
                    collected.add(batch, segment, report)
                for problem in problems:
                    report.add(problem)
                done += segment.file_size
                if progress:
                    progress("commit log", done, total)
    return collected.records(report)


def _scan_segment(mapped: MappedFile, size: int, last: bool, unclean: bool = False
                  ) -> tuple[list[DispatchBatch], list[Problem], int]:
    """One segment's records up to ``size``, what is wrong with its bytes, and (``unclean``: the writer died) the
    bytes after the end of the log in the last segment: an append it had not finished (it writes a record's
    first 8 bytes last), which a writer's open zeroes, not damage. Runs on a worker thread."""
    buf, pos, path = mapped.buffer, 0, str(mapped.path)
    batches: list[DispatchBatch] = []
    problems: list[Problem] = []
    unfinished = 0
    while pos < size:
        batch, stop = decode_dispatch(buf, pos, size, base=mapped.file_from_offset, limit=mapped.file_size,
                                      path=path, check_crc=True, max_rows=VERIFY_ROWS, slow_topics=PARKED_TOPICS)
        if len(batch):
            batches.append(batch)
        if stop.kind is StopKind.LIMIT:
            pos = stop.pos
            continue
        if stop.kind is StopKind.BLANK:  # nothing may follow it in this segment
            tail = last_nonzero_end(mapped, stop.pos + 8) - (stop.pos + 8)  # holes skipped, not read
            if tail:
                problems.append(Problem("commitlog", path, stop.offset + 8 + tail - 1,
                                        "non-zero bytes after the segment's BLANK record"))
        elif stop.kind is StopKind.DAMAGE:
            assert stop.error is not None
            if bytes(buf[stop.pos : stop.pos + 8]) == bytes(8):
                tail = last_nonzero_end(mapped, stop.pos) - stop.pos
                if tail and last and unclean and _one_append(buf, stop.pos, stop.pos + tail, mapped.file_from_offset):
                    unfinished = tail
                elif tail:
                    problems.append(Problem("commitlog", path, stop.offset + tail - 1,
                                            "non-zero bytes after the end of the log"))
                if not last:
                    problems.append(Problem("commitlog", path, stop.offset,
                                            "segment is followed by another but has no BLANK record"))
            else:  # damage: said, then the records after it are read too (a second damage is found, and the
                # units and index entries of intact records after it are not reported as pointing at nothing)
                problems.append(Problem("commitlog", path, stop.offset, stop.error.reason))
                resume = find_record_start(buf, stop.pos + 1, size, mapped.file_from_offset, mapped.file_size,
                                           record_limit=mapped.file_size)
                if resume is not None:
                    pos = resume
                    continue
        break
    return batches, problems, unfinished


def _one_append(buf, pos: int, end: int, base: int) -> bool:
    """Whether the bytes from ``pos`` (a zero size) to ``end`` can be one append its writer did not finish: it
    writes an append's first 8 bytes last, and every record of one append has the same store time. Records
    after it stored at other times were acknowledged one by one, and the zeros before them are damage."""
    stamps: set[int] = set()
    at = find_record_start(buf, pos + 1, end, base, len(buf), record_limit=len(buf))
    while at is not None and at < end:
        try:
            layout = read_layout(buf, at, len(buf))
        except CorruptDataError:
            return False
        if layout is None:
            break
        stamps.add(store_ts_at(buf, at))
        if len(stamps) > 1:
            return False
        at += layout.size
    return True


def _sorted_unique(values: np.ndarray) -> np.ndarray:
    """``np.unique`` for int64 arrays made of sorted runs: a stable sort (timsort: linear on runs) and a
    neighbour test; numpy's hash-based unique took ~1 s per 10M values here."""
    values = np.sort(values, kind="stable")
    if len(values) < 2:
        return values
    keep = np.empty(len(values), dtype=bool)
    keep[0] = True
    np.not_equal(values[1:], values[:-1], out=keep[1:])
    return values[keep]


VERIFY_ROWS = 65536  # records per compiled batch: verify keeps every record's fields anyway


class _Collector:
    """Decoded batches -> ``_Records``: per-record arrays concatenated once, (topic, queue id) numbered in
    order of first appearance, keys as (record number << 32 | hash) pairs."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.count = 0
        self.columns: list[tuple[np.ndarray, ...]] = []
        self.pairs: list[np.ndarray] = []
        self.legacy: list[tuple[int, int]] = []  # (record number, due time) of timer records
        self.queue_numbers: dict[tuple[str, int], int] = {}

    def add(self, batch: DispatchBatch, mapped: MappedFile, report: VerifyReport) -> None:
        path = str(mapped.path)
        expected = batch.pos + mapped.file_from_offset
        for i in np.flatnonzero(batch.phy != expected):
            report.add(Problem("commitlog", path, int(expected[i]), f"PHYSICALOFFSET field says {int(batch.phy[i])}"))
        group = batch.topic_code.astype(np.int64) << 32 | (batch.queue_id & 0xFFFFFFFF)
        distinct, first, inverse = np.unique(group, return_index=True, return_inverse=True)
        numbers = np.array([self.queue_numbers.setdefault((batch.topics[batch.topic_code[i]], int(batch.queue_id[i])),
                                                          len(self.queue_numbers)) for i in first.tolist()],
                           dtype=np.int64)
        queue = numbers[inverse.reshape(-1)] if len(distinct) else np.zeros(0, np.int64)
        tags = batch.tags_code.copy()
        self.pairs.append((batch.entry_owner.astype(np.int64) + self.count) << 32 | batch.entry_hash)
        for row in np.flatnonzero(batch.slow).tolist():  # scheduled messages, text that is not UTF-8
            pos = int(batch.pos[row])
            layout = read_layout(mapped.buffer, pos, mapped.file_size, path=path, base=mapped.file_from_offset)
            assert layout is not None  # the walk accepted it
            msg = message_from_layout(mapped.buffer, pos, layout, read_body=False)
            props = msg.properties
            tags[row] = tags_code_of(msg.topic, props, msg.store_timestamp, self.config.delay_levels_ms)
            if msg.topic == TIMER_TOPIC:
                self.legacy.append((self.count + row, java_integer(props.get(PropertyName.TIMER_DELIVER_MS, ""),
                                                                   64) or 0))
            keys = [build_key(index_topic_of(msg.topic, props), key)
                    for key in index_keys(props.get(PropertyName.UNIQ_KEY), props.get(PropertyName.KEYS))]
            if keys:
                self.pairs.append((np.int64(self.count + row) << 32) | index_key_hashes(keys))
        self.columns.append((expected, batch.size, batch.queue_offset, tags, batch.sys_flag, queue, batch.store_ts))
        self.count += len(batch)

    def records(self, report: VerifyReport) -> _Records:
        report.records = self.count
        cols = [np.concatenate(c).astype(np.int64) if c else np.zeros(0, np.int64) for c in zip(*self.columns,
                                                                                                 strict=True)]
        if not cols:
            cols = [np.zeros(0, np.int64) for _ in range(7)]
        pairs = _sorted_unique(np.concatenate(self.pairs)) if self.pairs else np.zeros(0, np.int64)
        legacy = np.array(self.legacy, dtype=np.int64).reshape(-1, 2)
        return _Records(*cols, list(self.queue_numbers), pairs, legacy[:, 0].copy(), legacy[:, 1].copy())


def _queue_frontier(root: Path, config: StoreConfig) -> int:
    """End of the newest record in any consume queue now. The dispatcher follows the log in order,
    so every record before it is already in its queue (read before the units are)."""
    table = ConsumeQueueTable(root, config, read_only=True)
    table.load()
    frontier = 0
    try:
        for queue in table.queues.values():
            for mapped in reversed(queue.mapped_files.files):
                units = np.frombuffer(mapped.buffer, dtype=UNIT_DTYPE, count=mapped.file_size // CQ_UNIT_SIZE)
                real = units[(units["size"] > 0) & (units["size"] != PRE_BLANK_SIZE) & (units["phy"] >= 0)]
                del units
                if len(real):
                    frontier = max(frontier, int((real["phy"].astype(np.int64) + real["size"]).max()))
                    break
    finally:
        table.close()
    return frontier


def _log_start_now(root: Path) -> int:
    """Where a live store's log starts now (its first segment's name), read after the queues or index were: a
    record verify read below it was deleted by the writer's retention since, with its units and index entries
    (read after the log, they are gone and are not missing)."""
    try:
        starts = [parse_segment_name(e.name) for e in os.scandir(root / "commitlog")]
    except OSError:
        return 0
    return min((s for s in starts if s is not None), default=0)


def _check_queues(root: Path, config: StoreConfig, records: _Records, report: VerifyReport,
                  progress: Progress | None, snapshot: _Snapshot | None, log_min: int = 0) -> None:
    table = ConsumeQueueTable(root, config, read_only=True)
    table.load()
    if table.rocksdb:
        table.close()
        report.not_checked.append("consume queues: kept in RocksDB (storeType=defaultRocksDB), which rocketstore "
                                  "does not read")
        return
    _check_queue_file_sizes(root, config.mapped_file_size_consume_queue, report)
    if table.lmq_dirs:
        report.not_checked.append(f"{len(table.lmq_dirs)} LMQ queue{'s' * (len(table.lmq_dirs) > 1)} (a broker's "
                                  "multi-dispatch; left as they are)")
    topics = TopicConfigManager(root, read_only=True)
    topics.load(empty_if_bad=True)
    batch = set(batch_cq_topics(root, topics))
    if batch:
        report.not_checked.append(f"the queues of BatchCQ topics ({', '.join(sorted(batch)[:5])}), kept in "
                                  "batchconsumequeue/")
    seen = np.zeros(len(records.phy), dtype=bool)
    numbers = {key: n for n, key in enumerate(records.queues)}
    seen[np.isin(records.queue, [n for n, (topic, _q) in enumerate(records.queues) if topic in batch])] = True
    try:
        for n, ((topic, queue_id), queue) in enumerate(sorted(table.queues.items())):
            below = log_min  # units below the log's start, before the queue's first unit at or past it
            for mapped in queue.mapped_files.files:
                below = _check_queue_file(mapped, numbers.get((topic, queue_id), -1), records, seen, report,
                                          snapshot, below)
            if progress:
                progress("consume queues", n + 1, len(table.queues))
    finally:
        table.close()
    tran = records.sys_flag & SysFlag.TRANSACTION_MASK
    missing = ~seen & ((tran == SysFlag.TRANSACTION_NOT_TYPE) | (tran == SysFlag.TRANSACTION_COMMIT_TYPE))
    if snapshot:
        missing &= records.phy < _settled(records.phy, snapshot.queue_frontier)
        missing &= records.phy >= _log_start_now(root)  # retention ran since the log was read: its units went too
    elif report.unclean:  # a dead writer's dispatch lag at the log's end: the next writer's open dispatches it
        lagging = missing & (records.phy >= _settled(records.phy, _queue_frontier(root, config)))
        report.not_dispatched = int(np.count_nonzero(lagging))
        missing &= ~lagging

    def make(i: int) -> Problem:
        topic, queue_id = records.queues[records.queue[i]]
        return Problem("consumequeue", str(root / "consumequeue" / topic / str(queue_id)),
                       int(records.queue_offset[i]) * CQ_UNIT_SIZE,
                       f"record at commit-log offset {records.phy[i]} is missing from its queue")

    report.add_many(np.flatnonzero(missing), make)


def _check_queue_file_sizes(root: Path, expected: int, report: VerifyReport) -> None:
    """Every consume-queue file must be ``mappedFileSizeConsumeQueue`` bytes, the last one of its queue too:
    RocketMQ's load refuses a store with any other ("length not matched message store config value, please
    check it manually"; only an empty last file, a crash while creating it, is deleted instead). The load here
    skips the queue (a writer's sets it aside and rebuilds it from the commit log), which left only its records
    reported as missing, never the file that was the cause."""
    base = root / CONSUMEQUEUE_DIR
    for topic_dir in _subdirectories(base):
        for queue_dir in _subdirectories(topic_dir):
            if not queue_dir.name.isdigit():
                continue  # ConsumeQueueTable.load reads no such directory either
            files = []
            for entry in _entries(queue_dir):
                try:
                    if parse_segment_name(entry.name) is not None and entry.is_file():
                        files.append((entry.name, entry.stat().st_size))
                except OSError:  # gone meanwhile (a live store's retention)
                    continue
            files.sort()
            for n, (name, size) in enumerate(files):
                if size == expected or (size == 0 and n == len(files) - 1):
                    continue
                units = "" if size % CQ_UNIT_SIZE == 0 else f" (not a whole number of {CQ_UNIT_SIZE}-byte units)"
                after = "rocketstore leaves this LMQ queue as it is" if is_lmq(topic_dir.name) else \
                    "readers skip this queue, a writer's open sets it aside and rebuilds it"
                report.add(Problem("consumequeue", str(queue_dir / name), min(size, expected),
                                   f"file is {size} bytes{units}, expected {expected} (mappedFileSizeConsumeQueue): "
                                   "RocketMQ refuses to load a store with it (length not matched message store config "
                                   f"value); {after}"))


def _subdirectories(directory: Path) -> list[Path]:
    return sorted(Path(entry.path) for entry in _entries(directory) if _is_dir(entry))


def _entries(directory: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(directory) as entries:
            return list(entries)
    except OSError:
        return []


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False


def _settled(phys: np.ndarray, frontier: int) -> int:
    """Below which offset every record is in its queue, given the newest unit seen ends at ``frontier``.
    The dispatcher finishes its batches in log order but writes a batch's units queue by queue, so only
    the records before the batch that holds the frontier (at most ``DISPATCH_ROWS`` of them) are certain."""
    before = int(np.searchsorted(phys, frontier))
    return int(phys[before - DISPATCH_ROWS]) if before > DISPATCH_ROWS else 0


def _check_queue_file(mapped: MappedFile, queue_number: int, records: _Records, seen: np.ndarray, report: VerifyReport,
                      snapshot: _Snapshot | None, log_min: int = 0) -> int:
    """Check one consume-queue file's units against the records, all at once. The queue's first units may
    point below the log's first offset ``log_min``, at records retention deleted (a queue file goes only once
    all its units are below it): they are skipped. Returns the ``log_min`` for the queue's next file: 0 once
    a unit at or past it was seen (a unit below the log's start after that is damage)."""
    path = str(mapped.path)
    units = np.frombuffer(mapped.buffer, dtype=UNIT_DTYPE, count=mapped.file_size // CQ_UNIT_SIZE)
    if snapshot:
        units, end = written_units(units)
    else:
        end = _first((units["phy"] == 0) & (units["size"] == 0))
        if end < len(units) and np.frombuffer(mapped.buffer, dtype=np.uint8, offset=end * CQ_UNIT_SIZE).any():
            report.add(Problem("consumequeue", path, end * CQ_UNIT_SIZE, "unit after the queue's end"))
    positions = np.arange(end, dtype=np.int64)
    units = units[:end]
    keep = units["size"] != PRE_BLANK_SIZE
    removed = _first(units["phy"] >= log_min) if log_min else 0
    keep[:removed] = False
    if removed < len(units):
        log_min = 0
    if snapshot:
        keep &= units["phy"] < snapshot.end  # written after the snapshot
    positions, units = positions[keep], units[keep]
    del keep
    report.queue_units += len(units)
    phys = units["phy"].astype(np.int64)
    sizes = units["size"].astype(np.int64)
    tags = units["tags"].astype(np.int64)
    queue_offsets = (mapped.file_from_offset + positions * CQ_UNIT_SIZE) // CQ_UNIT_SIZE
    del units
    at, found = records.find(phys)
    if len(records.phy):
        placed = found & (records.queue[at] == queue_number) & (records.size[at] == sizes) \
            & (records.queue_offset[at] == queue_offsets)
        mismatch = placed & (records.tags_code[at] != tags) & (tags > EXT_ADDR_MAX)  # an ext address: unchecked
    else:  # no record in the log (an emptied segment): every unit points where none starts
        placed = mismatch = np.zeros(len(phys), dtype=bool)
    if len(records.legacy_rows) and mismatch.any():  # a timer unit an earlier version wrote with its due time: sound
        rows = np.flatnonzero(mismatch)
        j = np.minimum(np.searchsorted(records.legacy_rows, at[rows]), len(records.legacy_rows) - 1)
        mismatch[rows[(records.legacy_rows[j] == at[rows]) & (records.legacy_tags[j] == tags[rows])]] = False
    bad = ~placed | mismatch
    seen[at[placed]] = True  # a wrong tags code is that unit's problem, not also a record missing from its queue

    def make(i: int) -> Problem:
        return Problem("consumequeue", path, int(positions[i]) * CQ_UNIT_SIZE,
                       _unit_problem(records, int(at[i]) if found[i] else -1, queue_number, int(phys[i]),
                                     int(sizes[i]), int(tags[i]), int(queue_offsets[i])))

    report.add_many(np.flatnonzero(bad), make)
    return log_min


_LOAD_FENCE = threading.Lock()


def written_units(units: np.ndarray) -> tuple[np.ndarray, int]:
    """A copy of the units a live writer has finished, and how many: those before the first without a size.

    The writer puts a unit's offset and tags code first and its size last, so a reader must load the sizes
    *before* the rest: one copy of the whole array reads each unit front to back and can take a unit's old
    offset (zero, the log's first record) beside its new size. Sizes first, then the units below the first
    zero size, each of which was whole when its size was read (a lock's acquire orders the two reads on
    machines that reorder loads)."""
    end = _first(units["size"] == 0)
    with _LOAD_FENCE:
        pass
    return units[:end].copy(), end


def _first(mask: np.ndarray) -> int:
    """Index of the first True in ``mask``, or its length when there is none."""
    hits = np.flatnonzero(mask)
    return int(hits[0]) if len(hits) else len(mask)


def _unit_problem(records: _Records, i: int, queue_number: int, phy: int, size: int, tags: int,
                  queue_offset: int) -> str:
    """What is wrong with a unit pointing at record number ``i`` (-1: no record starts at ``phy``)."""
    if i < 0:
        return f"points at commit-log offset {phy}, where no record starts"
    if records.queue[i] != queue_number:
        topic, queue_id = records.queues[records.queue[i]]
        return f"points at a record of {topic}-{queue_id}"
    if records.size[i] != size:
        return f"size {size} but the record is {records.size[i]} bytes"
    if records.queue_offset[i] != queue_offset:
        return f"is queue offset {queue_offset} but the record says {records.queue_offset[i]}"
    detail = f"tags code {tags} but the record's is {records.tags_code[i]}"
    if records.queues[records.queue[i]][0] == SCHEDULE_TOPIC:  # a due time: from the broker's messageDelayLevel
        detail += " (a delayed message's due time by the delay levels assumed; a broker with other levels: give " \
                  "its messageDelayLevel, --broker-conf)"
    return detail


def _entry(index, entries_at: int, number: int) -> tuple[int, int]:
    """(key hash, commit-log offset) of entry ``number`` of an index file."""
    return struct.unpack_from(">iq", index.buffer, entries_at + number * INDEX_ENTRY_SIZE)


def _check_header_times(index, path: str, first_phy: int, last_phy: int, last_status: int, records: _Records,
                        report: VerifyReport) -> None:
    """A file's beginTimestamp is its first entry's record's store time and its endTimestamp its last one's
    (``putKey`` sets them so): lookups skip a file, and stop at entries, by these times, so a wrong one hides keys
    from a time-bounded query."""
    found, ok = records.find(np.array([first_phy, last_phy], dtype=np.int64))
    if ok[0] and index.begin_timestamp != records.store_ts[found[0]]:
        report.add(Problem("index", path, 0, f"beginTimestamp {index.begin_timestamp} but the first entry's record "
                                             f"was stored at {int(records.store_ts[found[0]])}"))
    if ok[1] and last_status != _ik.ENTRY_AFTER_SNAPSHOT and index.end_timestamp != records.store_ts[found[1]]:
        report.add(Problem("index", path, 8, f"endTimestamp {index.end_timestamp} but the last entry's record was "
                                             f"stored at {int(records.store_ts[found[1]])}"))


def _check_index(root: Path, config: StoreConfig, records: _Records, report: VerifyReport,
                 progress: Progress | None, snapshot: _Snapshot | None) -> None:
    service = IndexService(root, config, StoreCheckpoint(root / "checkpoint", read_only=True), read_only=True)
    try:
        service.load()
    except CorruptDataError as exc:
        report.add(Problem("index", exc.path or str(root / "index"), exc.offset or 0, exc.reason))
        return
    for name, exc in service.load_errors.items():  # skipped by the read-only load: a problem all the same
        report.add(Problem("index", exc.path or str(service.directory / name), exc.offset or 0, exc.reason))
    # keys of records an unreadable file older than every readable one covered are checked too
    damaged_first = bool(service.load_errors) and (
        not service.files or min(service.load_errors) < service.files[0].path.name)
    covered = np.zeros(len(records.key_pairs), dtype=bool)  # key pairs some entry was found for
    pair_start = np.zeros(len(records.phy) + 1, dtype=np.int64)  # each record's run in key_pairs
    np.cumsum(np.bincount(records.key_pairs >> 32, minlength=len(records.phy)), out=pair_start[1:])
    index_min = None
    index_frontier = _NOT_LIVE  # a live store: records from here on may not be indexed yet
    log_min = int(records.phy[0]) if len(records.phy) else 0
    end = snapshot.end if snapshot else _NOT_LIVE
    try:
        for n, index in enumerate(service.files):
            entries_at = INDEX_HEADER_SIZE + index.hash_slot_num * 4
            buf = as_array(index.buffer)
            count = max(0, min(index.index_count - 1, (len(buf) - entries_at) // INDEX_ENTRY_SIZE - 1))  # in bounds
            try:
                status = _ik.check_entries(buf, entries_at, count, end, log_min, records.phy, pair_start,
                                           records.key_pairs, covered, index.begin_timestamp, records.store_ts)
            finally:
                del buf
            path = str(index.path)
            if count:
                first, last = _entry(index, entries_at, 1), _entry(index, entries_at, count)
                index_min = first[1] if index_min is None else index_min
                if snapshot or report.unclean:  # live: the count was read when the file was opened, after the
                    index_frontier = last[1]  # snapshot; unclean: the newest entry the dead writer made
                _check_header_times(index, path, first[1], last[1], status[count - 1], records, report)
            report.index_entries += count - int(np.count_nonzero(status == _ik.ENTRY_AFTER_SNAPSHOT))

            def make(i: int, path=path, entries_at=entries_at, status=status, index=index) -> Problem:
                number = i + 1
                key_hash, phy = _entry(index, entries_at, number)
                detail = (f"entry hash {key_hash} matches no key of the record at {phy}"
                          if status[i] == _ik.ENTRY_WRONG_KEY else
                          f"entry's time diff is not the store time of the record at {phy} less beginTimestamp "
                          f"{index.begin_timestamp} (a lookup's time window would pass it by)"
                          if status[i] == _ik.ENTRY_WRONG_TIME else
                          f"entry points at commit-log offset {phy}, where no record starts")
                return Problem("index", path, entries_at + number * INDEX_ENTRY_SIZE, detail)

            report.add_many(np.flatnonzero((status == _ik.ENTRY_WRONG_KEY) | (status == _ik.ENTRY_NO_RECORD)
                                           | (status == _ik.ENTRY_WRONG_TIME)), make)
            # a key lookup would stop short, loop, or find nothing
            broken = chain_problem_at(index, live=snapshot is not None, thorough=True)
            if broken is not None:
                report.add(Problem("index", path, broken[0], f"broken chain: {broken[1]}"))
            if progress:
                progress("index", n + 1, len(service.files))
    finally:
        service.close()
    if damaged_first:
        index_min = log_min if index_min is None else min(index_min, log_min)
    if not config.message_index_enable or index_min is None:
        return
    uncovered = records.key_pairs[~covered]
    missing_keys = np.bincount(uncovered >> 32, minlength=len(records.phy))
    rollback = (records.sys_flag & SysFlag.TRANSACTION_MASK) == SysFlag.TRANSACTION_ROLLBACK_TYPE
    # every record of the log: index files go only once the log's start passed their last entry (RocketMQ's
    # deleteExpiredFile), so records before the oldest file's first entry mean index files lost (checked from
    # the oldest file on, a lost oldest file went unnoticed: verify exited 0 and those keys were never found)
    want = (missing_keys > 0) & (records.phy >= log_min) & ~rollback & (records.phy < index_frontier)
    if report.unclean:
        report.not_indexed = int(np.count_nonzero((missing_keys > 0) & (records.phy >= index_min) & ~rollback
                                                  & (records.phy >= index_frontier)))
    if snapshot:  # retention ran since the log was read: the index files of what it deleted went too
        want &= records.phy >= _log_start_now(root)
    lost = want & (records.phy < index_min)
    if lost.any():  # one problem for them all, not one per record
        report.add(Problem("index", str(root / "index"), index_min,
                           f"{int(np.count_nonzero(lost))} record(s) with keys from commit-log offset {log_min} on "
                           f"are older than the oldest index file's first entry ({index_min}): no index file covers "
                           "them (lost, or never written: indexing off then), so no query finds their keys "
                           "(rocketstore rebuild indexes them)"))
        want &= ~lost

    def make(i: int) -> Problem:
        phy = int(records.phy[i])
        topic = records.queues[records.queue[i]][0]
        return Problem("index", str(root / "index"), phy, f"{missing_keys[i]} key(s) of the record at commit-log "
                                                         f"offset {phy} ({topic}) have no index entry")

    report.add_many(np.flatnonzero(want), make)

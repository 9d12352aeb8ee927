"""A full offline check of a store: every record, every queue unit, every index entry.

RocketMQ ships no such tool. ``verify_store`` opens nothing for writing and changes no byte. It
reports each problem with the file and the offset where it is:

* commit log: records whose CRC, magic or lengths fail, in every segment (recovery only looks at
  the newest ones), records whose PHYSICALOFFSET disagrees with their position, segments that do
  not end with a BLANK record, bytes after the end of the log that are not zero;
* consume queues: units that do not point at a record start of their topic and queue, with the
  record's size and queue offset and the right tags code; records missing from their queue;
* index: entries pointing at no record or at a record none of whose keys has the entry's hash;
  keys of records that no entry covers (messages that could not be found by key).

The log is read record by record (CRCs need it); queue units and index entries are checked as
whole numpy arrays against the records sorted by offset, so the cost stays O(n log n) however
many of them dangle, and ``Problem`` objects are built only for the ``max_problems`` reported.

A store locked by a writer is *live*: it is checked as a snapshot. Its end is the read-only
recovered end taken first; records the dispatcher had not reached when verify started (past the
newest queue unit or index entry seen then) are not missing, units and entries written after the
snapshot are ignored, and the bytes past its end are the writer's, not garbage.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .checkpoint import StoreCheckpoint
from .codec.properties import PropertyName
from .codec.record import message_from_layout, read_layout
from .commitlog import CommitLog
from .config import StoreConfig
from .consumequeue import CQ_UNIT_SIZE, PRE_BLANK_SIZE, ConsumeQueueTable
from .dispatch import index_topic_of, tags_code_of
from .errors import ConfigError, CorruptDataError
from .index.bulk import ENTRY_DTYPE, index_key_hashes
from .index.file import INDEX_ENTRY_SIZE, INDEX_HEADER_SIZE
from .index.service import IndexService, build_key, index_keys
from .lifecycle import is_locked
from .mapped.file import MappedFile
from .message import SysFlag
from .recovery import recovered_log_end

Progress = Callable[[str, int, int], None]
UNIT_DTYPE = np.dtype([("phy", ">i8"), ("size", ">i4"), ("tags", ">i8")])  # consumequeue.UNIT_FMT as numpy
assert UNIT_DTYPE.itemsize == CQ_UNIT_SIZE
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
    problem_count: int = 0  # every problem found, also those past ``max_problems``
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
    queues: list[tuple[str, int]]
    key_pairs: np.ndarray  # sorted, unique: record number << 32 | index key hash (hashes are < 2**31)

    def find(self, phys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(record number, found) for each offset: whether a record starts exactly there."""
        if not len(self.phy):
            return np.zeros(len(phys), np.int64), np.zeros(len(phys), bool)
        at = np.minimum(np.searchsorted(self.phy, phys), len(self.phy) - 1)
        return at, self.phy[at] == phys

    def has_key_pairs(self, pairs: np.ndarray) -> np.ndarray:
        """Whether each (record number << 32 | hash) is a key of that record: a binary search per pair,
        not ``np.isin``, which would sort every key of the store again for each index file."""
        if not len(self.key_pairs):
            return np.zeros(len(pairs), bool)
        at = np.minimum(np.searchsorted(self.key_pairs, pairs), len(self.key_pairs) - 1)
        return self.key_pairs[at] == pairs


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
    commit_log = CommitLog(root, config, read_only=True)
    commit_log.load()  # every segment, in full: verify looks past the recovered end too
    try:
        records = _check_log(commit_log, config, report, progress, snapshot)
    finally:
        commit_log.close()
    _check_queues(root, config, records, report, progress, snapshot)
    _check_index(root, config, records, report, progress, snapshot)
    return report


def _check_log(commit_log: CommitLog, config: StoreConfig, report: VerifyReport, progress: Progress | None,
               snapshot: _Snapshot | None) -> _Records:
    """Scan every segment in full (a live store: up to the snapshot's end) and collect the records."""
    phys: list[int] = []
    rows: list[tuple[int, int, int, int, int]] = []  # size, queue offset, tags code, sys flag, queue number
    queue_numbers: dict[tuple[str, int], int] = {}
    keys: list[str] = []
    key_owners: list[int] = []
    files = commit_log.mapped_files.files
    stop = snapshot.end if snapshot else None
    total = sum(f.file_size for f in files)
    done = 0
    for mapped in files:
        buf, size, pos = mapped.buffer, mapped.file_size, 0
        path = str(mapped.path)
        if stop is not None:
            size = min(size, max(0, stop - mapped.file_from_offset))
        while pos < size:
            try:
                layout = read_layout(buf, pos, mapped.file_size, check_crc=True, path=path,
                                     base=mapped.file_from_offset)
            except CorruptDataError as exc:
                if bytes(buf[pos : pos + 8]) == bytes(8):
                    tail = bytes(buf[pos:]).rstrip(b"\0")
                    if tail:
                        report.add(Problem("commitlog", path, mapped.file_from_offset + pos + len(tail) - 1,
                                           "non-zero bytes after the end of the log"))
                    if mapped is not files[-1]:
                        report.add(Problem("commitlog", path, mapped.file_from_offset + pos,
                                           "segment is followed by another but has no BLANK record"))
                else:
                    report.add(Problem("commitlog", path, mapped.file_from_offset + pos, exc.reason))
                break
            if layout is None:  # BLANK: nothing may follow it in this segment
                tail = bytes(buf[pos + 8 :]).rstrip(b"\0")
                if tail:
                    report.add(Problem("commitlog", path, mapped.file_from_offset + pos + 8 + len(tail) - 1,
                                       "non-zero bytes after the segment's BLANK record"))
                break
            phy = mapped.file_from_offset + pos
            msg = message_from_layout(buf, pos, layout, read_body=False)
            if msg.commit_log_offset != phy:
                report.add(Problem("commitlog", path, phy, f"PHYSICALOFFSET field says {msg.commit_log_offset}"))
            props = msg.properties
            number = len(phys)
            for key in index_keys(props.get(PropertyName.UNIQ_KEY), props.get(PropertyName.KEYS)):
                keys.append(build_key(index_topic_of(msg.topic, props), key))
                key_owners.append(number)
            phys.append(phy)
            rows.append((layout.size, msg.queue_offset,
                         tags_code_of(msg.topic, props, msg.store_timestamp, config.delay_levels_ms), msg.sys_flag,
                         queue_numbers.setdefault((msg.topic, msg.queue_id), len(queue_numbers))))
            pos += layout.size
        done += mapped.file_size
        if progress:
            progress("commit log", done, total)
    report.records = len(phys)
    table = np.array(rows, dtype=np.int64).reshape(len(rows), 5)
    pairs = (np.array(key_owners, dtype=np.int64) << 32) | index_key_hashes(keys)
    return _Records(np.array(phys, dtype=np.int64), table[:, 0], table[:, 1], table[:, 2], table[:, 3], table[:, 4],
                    list(queue_numbers), np.unique(pairs))


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


def _check_queues(root: Path, config: StoreConfig, records: _Records, report: VerifyReport,
                  progress: Progress | None, snapshot: _Snapshot | None) -> None:
    table = ConsumeQueueTable(root, config, read_only=True)
    table.load()
    seen = np.zeros(len(records.phy), dtype=bool)
    numbers = {key: n for n, key in enumerate(records.queues)}
    try:
        for n, ((topic, queue_id), queue) in enumerate(sorted(table.queues.items())):
            for mapped in queue.mapped_files.files:
                _check_queue_file(mapped, numbers.get((topic, queue_id), -1), records, seen, report, snapshot)
            if progress:
                progress("consume queues", n + 1, len(table.queues))
    finally:
        table.close()
    tran = records.sys_flag & SysFlag.TRANSACTION_MASK
    missing = ~seen & ((tran == SysFlag.TRANSACTION_NOT_TYPE) | (tran == SysFlag.TRANSACTION_COMMIT_TYPE))
    if snapshot:
        missing &= records.phy < snapshot.queue_frontier

    def make(i: int) -> Problem:
        topic, queue_id = records.queues[records.queue[i]]
        return Problem("consumequeue", str(root / "consumequeue" / topic / str(queue_id)),
                       int(records.queue_offset[i]) * CQ_UNIT_SIZE,
                       f"record at commit-log offset {records.phy[i]} is missing from its queue")

    report.add_many(np.flatnonzero(missing), make)


def _check_queue_file(mapped: MappedFile, queue_number: int, records: _Records, seen: np.ndarray, report: VerifyReport,
                      snapshot: _Snapshot | None) -> None:
    """Check one consume-queue file's units against the records, all at once."""
    path = str(mapped.path)
    units = np.frombuffer(mapped.buffer, dtype=UNIT_DTYPE, count=mapped.file_size // CQ_UNIT_SIZE)
    if snapshot:
        units = units.copy()  # the writer goes on appending: look at one copy
        # a unit's size is written last: the first without one is where the writer was
        end = _first(units["size"] == 0)
    else:
        end = _first((units["phy"] == 0) & (units["size"] == 0))
        if end < len(units) and np.frombuffer(mapped.buffer, dtype=np.uint8, offset=end * CQ_UNIT_SIZE).any():
            report.add(Problem("consumequeue", path, end * CQ_UNIT_SIZE, "unit after the queue's end"))
    positions = np.arange(end, dtype=np.int64)
    units = units[:end]
    keep = units["size"] != PRE_BLANK_SIZE
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
    bad = (~found | (records.queue[at] != queue_number) | (records.size[at] != sizes)
           | (records.queue_offset[at] != queue_offsets) | (records.tags_code[at] != tags))
    seen[at[~bad]] = True

    def make(i: int) -> Problem:
        return Problem("consumequeue", path, int(positions[i]) * CQ_UNIT_SIZE,
                       _unit_problem(records, int(at[i]) if found[i] else -1, queue_number, int(phys[i]),
                                     int(sizes[i]), int(tags[i]), int(queue_offsets[i])))

    report.add_many(np.flatnonzero(bad), make)


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
    return f"tags code {tags} but the record's is {records.tags_code[i]}"


def _check_index(root: Path, config: StoreConfig, records: _Records, report: VerifyReport,
                 progress: Progress | None, snapshot: _Snapshot | None) -> None:
    service = IndexService(root, config, StoreCheckpoint(root / "checkpoint", read_only=True), read_only=True)
    try:
        service.load()
    except CorruptDataError as exc:
        report.add(Problem("index", exc.path or str(root / "index"), exc.offset or 0, exc.reason))
        return
    covered: list[np.ndarray] = []
    index_min = None
    index_frontier = _NOT_LIVE  # a live store: records from here on may not be indexed yet
    log_min = int(records.phy[0]) if len(records.phy) else 0
    try:
        for n, index in enumerate(service.files):
            entries_at = INDEX_HEADER_SIZE + index.hash_slot_num * 4
            count = index.index_count - 1
            entries = np.frombuffer(index.buffer, dtype=ENTRY_DTYPE, count=count,
                                    offset=entries_at + INDEX_ENTRY_SIZE)
            hashes, phys = entries["hash"].astype(np.int64), entries["phy"].astype(np.int64)
            del entries
            if count and index_min is None:
                index_min = int(phys[0])
            if count and snapshot:
                index_frontier = int(phys[-1])  # the count was read when the file was opened, after the snapshot
            numbers = np.arange(1, count + 1, dtype=np.int64)
            if snapshot:
                keep = phys < snapshot.end  # entries of records written after the snapshot
                hashes, phys, numbers = hashes[keep], phys[keep], numbers[keep]
            report.index_entries += len(phys)
            at, found = records.find(phys)
            pairs = (at << 32) | hashes
            matches = found & records.has_key_pairs(pairs)
            covered.append(pairs[matches])
            bad = (~found & (phys >= log_min)) | (found & ~matches)
            path = str(index.path)

            def make(i: int, path=path, entries_at=entries_at, found=found, phys=phys, hashes=hashes,
                     numbers=numbers) -> Problem:
                phy = int(phys[i])
                detail = (f"entry hash {int(hashes[i])} matches no key of the record at {phy}" if found[i] else
                          f"entry points at commit-log offset {phy}, where no record starts")
                return Problem("index", path, entries_at + int(numbers[i]) * INDEX_ENTRY_SIZE, detail)

            report.add_many(np.flatnonzero(bad), make)
            if progress:
                progress("index", n + 1, len(service.files))
    finally:
        service.close()
    if not config.message_index_enable or index_min is None:
        return
    done = np.unique(np.concatenate(covered))
    uncovered = records.key_pairs[~np.isin(records.key_pairs, done, assume_unique=True)]
    missing_keys = np.bincount(uncovered >> 32, minlength=len(records.phy))
    rollback = (records.sys_flag & SysFlag.TRANSACTION_MASK) == SysFlag.TRANSACTION_ROLLBACK_TYPE
    want = (missing_keys > 0) & (records.phy >= index_min) & ~rollback & (records.phy < index_frontier)

    def make(i: int) -> Problem:
        phy = int(records.phy[i])
        topic = records.queues[records.queue[i]][0]
        return Problem("index", str(root / "index"), phy, f"{missing_keys[i]} key(s) of the record at commit-log "
                                                         f"offset {phy} ({topic}) have no index entry")

    report.add_many(np.flatnonzero(want), make)

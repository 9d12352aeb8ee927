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
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .checkpoint import StoreCheckpoint
from .codec.hashing import index_key_hash
from .codec.properties import PropertyName
from .codec.record import message_from_layout, read_layout
from .commitlog import CommitLog
from .config import StoreConfig
from .consumequeue import CQ_UNIT_SIZE, ConsumeQueueTable
from .dispatch import index_topic_of, tags_code_of
from .errors import CorruptDataError
from .index.bulk import ENTRY_DTYPE
from .index.file import INDEX_HEADER_SIZE
from .index.service import IndexService, build_key, index_keys
from .message import SysFlag
from .recovery import recovered_log_end

Progress = Callable[[str, int, int], None]
_UNIT = struct.Struct(">qiq")


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
    problems: list[Problem] = field(default_factory=list)
    records: int = 0
    queue_units: int = 0
    index_entries: int = 0
    log_end: int = 0

    @property
    def clean(self) -> bool:
        return not self.problems


@dataclass(slots=True)
class _Record:
    topic: str
    queue_id: int
    queue_offset: int
    size: int
    sys_flag: int
    tags_code: int
    key_hashes: frozenset[int]


def verify_store(root: str | Path, config: StoreConfig, *, progress: Progress | None = None,
                 max_problems: int = 10_000) -> VerifyReport:
    """Check the whole store read-only; see the module docstring for what is checked."""
    root = Path(root)
    report = VerifyReport()
    _low, report.log_end = recovered_log_end(root, config)
    commit_log = CommitLog(root, config, read_only=True)
    commit_log.load()  # every segment, in full: verify looks past the recovered end too
    try:
        records = _check_log(root, commit_log, config, report, progress)
    finally:
        commit_log.close()
    _check_queues(root, config, records, report, progress)
    _check_index(root, config, records, report, progress)
    del report.problems[max_problems:]
    return report


def _check_log(root: Path, commit_log: CommitLog, config: StoreConfig, report: VerifyReport,
               progress: Progress | None) -> dict[int, _Record]:
    """Scan every segment in full (not only up to the recovered end) and collect the records."""
    records: dict[int, _Record] = {}
    files = commit_log.mapped_files.files
    total = sum(f.file_size for f in files)
    done = 0
    for mapped in files:
        buf, size, pos = mapped.buffer, mapped.file_size, 0
        path = str(mapped.path)
        while pos < size:
            try:
                layout = read_layout(buf, pos, size, check_crc=True, path=path, base=mapped.file_from_offset)
            except CorruptDataError as exc:
                if bytes(buf[pos : pos + 8]) == bytes(8):
                    tail = bytes(buf[pos:]).rstrip(b"\0")
                    if tail:
                        report.problems.append(Problem("commitlog", path, mapped.file_from_offset + pos + len(tail) - 1,
                                                       "non-zero bytes after the end of the log"))
                    if mapped is not files[-1]:
                        report.problems.append(Problem("commitlog", path, mapped.file_from_offset + pos,
                                                       "segment is followed by another but has no BLANK record"))
                else:
                    report.problems.append(Problem("commitlog", path, mapped.file_from_offset + pos, exc.reason))
                break
            if layout is None:  # BLANK: nothing may follow it in this segment
                tail = bytes(buf[pos + 8 :]).rstrip(b"\0")
                if tail:
                    report.problems.append(Problem("commitlog", path, mapped.file_from_offset + pos + 8 + len(tail) - 1,
                                                   "non-zero bytes after the segment's BLANK record"))
                break
            phy = mapped.file_from_offset + pos
            msg = message_from_layout(buf, pos, layout, read_body=False)
            if msg.commit_log_offset != phy:
                report.problems.append(Problem("commitlog", path, phy,
                                               f"PHYSICALOFFSET field says {msg.commit_log_offset}"))
            props = msg.properties
            keys = index_keys(props.get(PropertyName.UNIQ_KEY), props.get(PropertyName.KEYS))
            records[phy] = _Record(msg.topic, msg.queue_id, msg.queue_offset, layout.size, msg.sys_flag,
                                   tags_code_of(msg.topic, props, msg.store_timestamp, config.delay_levels_ms),
                                   frozenset(index_key_hash(build_key(index_topic_of(msg.topic, props), k))
                                             for k in keys))
            report.records += 1
            pos += layout.size
        done += mapped.file_size
        if progress:
            progress("commit log", done, total)
    return records


def _check_queues(root: Path, config: StoreConfig, records: dict[int, _Record], report: VerifyReport,
                  progress: Progress | None) -> None:
    table = ConsumeQueueTable(root, config, read_only=True)
    table.load()
    seen: set[int] = set()
    try:
        for n, ((topic, queue_id), queue) in enumerate(sorted(table.queues.items())):
            for mapped in queue.mapped_files.files:
                buf, path = mapped.buffer, str(mapped.path)
                for pos in range(0, mapped.file_size, CQ_UNIT_SIZE):
                    phy, size, tags = _UNIT.unpack_from(buf, pos)
                    if size == 0 and phy == 0:
                        if bytes(buf[pos:]).strip(b"\0"):
                            report.problems.append(Problem("consumequeue", path, pos, "unit after the queue's end"))
                        break
                    if size == 0x7FFFFFFF:
                        continue  # pre-blank padding
                    report.queue_units += 1
                    problem = _unit_problem(records.get(phy), topic, queue_id, phy, size, tags,
                                            (mapped.file_from_offset + pos) // CQ_UNIT_SIZE)
                    if problem:
                        report.problems.append(Problem("consumequeue", path, pos, problem))
                    else:
                        seen.add(phy)
            if progress:
                progress("consume queues", n + 1, len(table.queues))
    finally:
        table.close()
    log_min = min(records, default=0)
    for phy, rec in records.items():
        tran = SysFlag.transaction_type(rec.sys_flag)
        in_queue = tran in (SysFlag.TRANSACTION_NOT_TYPE, SysFlag.TRANSACTION_COMMIT_TYPE)
        if in_queue and phy not in seen and phy >= log_min:
            report.problems.append(Problem("consumequeue", str(root / "consumequeue" / rec.topic / str(rec.queue_id)),
                                           rec.queue_offset * CQ_UNIT_SIZE,
                                           f"record at commit-log offset {phy} is missing from its queue"))


def _unit_problem(rec: _Record | None, topic: str, queue_id: int, phy: int, size: int, tags: int,
                  queue_offset: int) -> str | None:
    if rec is None:
        return f"points at commit-log offset {phy}, where no record starts"
    if (rec.topic, rec.queue_id) != (topic, queue_id):
        return f"points at a record of {rec.topic}-{rec.queue_id}"
    if rec.size != size:
        return f"size {size} but the record is {rec.size} bytes"
    if rec.queue_offset != queue_offset:
        return f"is queue offset {queue_offset} but the record says {rec.queue_offset}"
    if rec.tags_code != tags:
        return f"tags code {tags} but the record's is {rec.tags_code}"
    return None


def _check_index(root: Path, config: StoreConfig, records: dict[int, _Record], report: VerifyReport,
                 progress: Progress | None) -> None:
    service = IndexService(root, config, StoreCheckpoint(root / "checkpoint", read_only=True), read_only=True)
    try:
        service.load()
    except CorruptDataError as exc:
        report.problems.append(Problem("index", exc.path or str(root / "index"), exc.offset or 0, exc.reason))
        return
    covered: set[tuple[int, int]] = set()
    index_min = None
    try:
        for n, index in enumerate(service.files):
            entries_at = INDEX_HEADER_SIZE + index.hash_slot_num * 4
            count = index.index_count - 1
            entries = np.frombuffer(index.buffer, dtype=ENTRY_DTYPE, count=count, offset=entries_at + 20)
            hashes, phys = entries["hash"].astype(np.int64), entries["phy"].astype(np.int64)
            del entries
            report.index_entries += count
            for i in range(count):
                phy, key_hash = int(phys[i]), int(hashes[i])
                rec = records.get(phy)
                if rec is None:
                    if phy >= min(records, default=0):
                        report.problems.append(Problem("index", str(index.path), entries_at + (i + 1) * 20,
                                                       f"entry points at commit-log offset {phy}, where no record "
                                                       f"starts"))
                elif key_hash not in rec.key_hashes:
                    report.problems.append(Problem("index", str(index.path), entries_at + (i + 1) * 20,
                                                   f"entry hash {key_hash} matches no key of the record at {phy}"))
                else:
                    covered.add((key_hash, phy))
            if index_min is None and count:
                index_min = int(phys[0])
            if progress:
                progress("index", n + 1, len(service.files))
    finally:
        service.close()
    if not config.message_index_enable or index_min is None:
        return
    for phy, rec in records.items():
        if phy < index_min or SysFlag.transaction_type(rec.sys_flag) == SysFlag.TRANSACTION_ROLLBACK_TYPE:
            continue
        missing = [h for h in rec.key_hashes if (h, phy) not in covered]
        if missing:
            report.problems.append(Problem("index", str(root / "index"), phy,
                                           f"{len(missing)} key(s) of the record at commit-log offset {phy} "
                                           f"({rec.topic}) have no index entry"))

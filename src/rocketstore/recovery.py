"""Finding the end of the commit log again after a clean shutdown or a crash.

The scan validates records (with CRCs) from a start segment chosen as RocketMQ does, stops at
the first record that does not validate, and makes that point the end of the log. Unlike
RocketMQ, the cut destroys nothing and leaves nothing behind:

* the torn tail is zeroed, so it can never be decoded as a message later, after its bytes
  have been copied to ``recovery/`` (up to ``recovery_salvage_max_bytes``);
* segments past the cut are moved to ``recovery/`` instead of being deleted;
* a damaged record in a segment the checkpoint vouches for does not cut the log there: those
  segments are not re-validated (as in RocketMQ), only read for their headers.

A read-only store recovers in memory only and never writes a byte.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .checkpoint import StoreCheckpoint
from .codec.batch import record_after_blank, store_ts_at, validate_records
from .codec.record import BLANK_MAGIC, BLANK_RECORD_LEN, RecordLayout, find_record_start, read_layout
from .commitlog import CommitLog
from .errors import CorruptDataError, DamagedLogError, FlushError, StoreIOError
from .mapped.file import MappedFile, data_regions, fsync_dir, unused_path

log = logging.getLogger(__name__)

RECOVERY_DIR = "recovery"
_ZERO_CHUNK = bytes(1 << 20)

# Called for every valid record in log order: (segment, position in it, layout).
RecordVisitor = Callable[[MappedFile, int, RecordLayout], None]


@dataclass(slots=True)
class RecoveryReport:
    """What recovery found and did; kept on the store for operators and tests."""

    abnormal: bool
    start_offset: int = 0  # where CRC-checked scanning began
    end_offset: int = 0  # the recovered end of the log
    records_checked: int = 0
    stop_reason: str | None = None  # the error that ended the scan, None at a clean end
    cut_bytes: int = 0  # torn-tail bytes zeroed after the end
    salvaged: list[str] = field(default_factory=list)  # files written or moved to recovery/
    seconds: float = 0.0
    # the checkpoint's last flushed store time when the recovered log ends before it (0: nothing flushed is
    # missing): messages a SYNC_FLUSH put acknowledged are gone, by a deleted segment or outside damage
    missing_flushed_until: int = 0
    # read-only recoveries that stopped at damage (``stop_reason``): where the first intact record after it starts
    # (None: none, a torn tail) and how many non-zero bytes follow the end (all left out of the log)
    resumes_at: int | None = None
    bytes_after_end: int = 0


def choose_start_index(commit_log: CommitLog, checkpoint: StoreCheckpoint, *, abnormal: bool,
                       dispatch_from: int = -1) -> int:
    """The segment to start validating from (``recoverNormally`` / ``recoverAbnormally``).

    Normal: the newest segment whose first record is valid and already dispatched
    (``dispatch_from``), else the third-last (RocketMQ 5.0-5.3.1). Abnormal: the newest segment
    whose first record is valid and stored before the checkpoint's safe time; else the first.
    """
    files = commit_log.mapped_files.files
    if not files:
        return 0
    if not abnormal:
        if dispatch_from >= 0:
            for i in range(len(files) - 1, 0, -1):
                first = _first_record(files[i], commit_log)
                if first is not None and first[1] != 0 and first[0] <= dispatch_from:
                    return i
            return 0
        return max(0, len(files) - 3)
    if not checkpoint.trusted:
        return 0
    safe = checkpoint.min_timestamp
    if commit_log.config.message_index_enable and commit_log.config.message_index_safe:
        safe = checkpoint.min_timestamp_index
    for i in range(len(files) - 1, -1, -1):
        first = _first_record(files[i], commit_log)
        if first is not None and first[1] != 0 and first[1] <= safe:
            return i
    return 0


def _first_record(mapped: MappedFile, commit_log: CommitLog) -> tuple[int, int] | None:
    """(PHYSICALOFFSET, STORETIMESTAMP) of a segment's first record if it validates, else None."""
    try:
        layout = read_layout(mapped.buffer, 0, mapped.file_size, check_crc=commit_log.config.check_crc_on_recover,
                             base=mapped.file_from_offset, check_offset=True)
    except CorruptDataError:
        return None
    if layout is None:
        return None
    buf = mapped.buffer
    phy = int.from_bytes(buf[28:36], "big", signed=True)
    ts_pos = 48 + (20 if layout.sys_flag & 0x10 else 8)
    return phy, int.from_bytes(buf[ts_pos : ts_pos + 8], "big", signed=True)


def recover_commit_log(commit_log: CommitLog, checkpoint: StoreCheckpoint, root: Path, *, abnormal: bool,
                       visit: RecordVisitor | None = None, dispatch_from: int = -1,
                       visit_from_index: int = 0, check_crc: bool | None = None) -> RecoveryReport:
    """Validate the log, fix its end, and call ``visit`` for each record from segment ``visit_from_index``.
    ``check_crc``: body CRCs too (default ``check_crc_on_recover``).

    Segments before the start segment are only read (headers, no CRC) when ``visit`` needs them.
    """
    started = time.monotonic()
    report = RecoveryReport(abnormal=abnormal)
    files = commit_log.mapped_files.files
    if not files:
        report.seconds = time.monotonic() - started
        return report
    start = choose_start_index(commit_log, checkpoint, abnormal=abnormal, dispatch_from=dispatch_from)
    report.start_offset = files[start].file_from_offset
    if visit is not None:
        for mapped in files[visit_from_index:start]:
            _visit_trusted(mapped, visit)

    end_file, end_pos, blank = _walk_segments(commit_log, start, 0, report, visit, check_crc)
    report.end_offset = end_file.file_from_offset + end_pos
    if commit_log.read_only:
        if report.stop_reason:
            _measure_after_end(commit_log, end_file, end_pos, report)
            if report.resumes_at is not None and not commit_log.config.cut_damaged_log:
                raise damaged_log_error(root, report, "would be left out of every answer of this read-only open "
                                        "(cut_damaged_log=True answers from the log up to the damage)")
        _truncate_in_memory(commit_log, report.end_offset)
    else:
        if report.stop_reason and not commit_log.config.cut_damaged_log:
            _measure_after_end(commit_log, end_file, end_pos, report)
            if report.resumes_at is not None:
                raise damaged_log_error(root, report, "would be cut off by this writer's open (RocketMQ's recovery "
                                        "cuts there too, the cut bytes kept in recovery/); nothing was changed")
        _cut(commit_log, end_file, end_pos, root, report, at_blank=blank)
    commit_log.mapped_files.flushed_where = report.end_offset
    report.seconds = time.monotonic() - started
    if commit_log.read_only and report.stop_reason:
        log.warning("the commit log ends at %d for this read-only open: %s (nothing changed)", report.end_offset,
                    report.stop_reason)
    elif report.stop_reason or report.cut_bytes or report.salvaged:
        log.warning("recovery ended the commit log at %d: %s (zeroed %d bytes, kept %s)", report.end_offset,
                    report.stop_reason or "torn tail", report.cut_bytes, report.salvaged)
    return report


def damaged_log_error(root: Path, report: RecoveryReport, what: str) -> DamagedLogError:
    """The typed error for a log whose recovery stopped at damage with intact records after it."""
    error = DamagedLogError(f"the commit log of {root} is damaged at offset {report.end_offset} ({report.stop_reason})"
                            f"; {report.bytes_after_end} bytes after it, with intact records from offset "
                            f"{report.resumes_at} on, {what}")
    error.offset = report.end_offset
    return error


def _walk_segments(commit_log: CommitLog, index: int, pos: int, report: RecoveryReport,
                   visit: RecordVisitor | None = None, check_crc: bool | None = None) -> tuple[MappedFile, int, bool]:
    """Validate records from segment ``index`` at ``pos`` on, into the next segments past each closing blank:
    (the segment where the valid records end, the position after the last, whether a blank ended them)."""
    files = commit_log.mapped_files.files
    check_crc = commit_log.config.check_crc_on_recover if check_crc is None else check_crc
    verify_prop = check_crc and commit_log.config.force_verify_prop_crc
    end_file, end_pos, blank = files[index], pos, False
    for i in range(index, len(files)):
        mapped = files[i]
        buf, size = mapped.buffer, mapped.file_size
        if i > index:
            pos = 0
        end_file, end_pos, blank = mapped, pos, False
        last = -1  # the start of the segment's last valid record seen
        while True:
            if visit is None and not verify_prop:  # the fast path: validate runs of records in one loop
                pos, valid, run_last = validate_records(buf, pos, size, check_crc=check_crc,
                                                        base=mapped.file_from_offset)
                report.records_checked += valid
                end_pos = pos
                last = run_last if run_last >= 0 else last
            try:
                layout = read_layout(buf, pos, size, check_crc=check_crc, verify_prop_crc=verify_prop,
                                     path=str(mapped.path), base=mapped.file_from_offset, check_offset=True)
            except CorruptDataError as exc:
                report.stop_reason = None if _is_zero_tail(buf, pos) else str(exc)
                break
            if layout is None:
                hidden = record_after_blank(buf, pos, size, mapped.file_from_offset,
                                            store_ts_at(buf, last) if last >= 0 else None)
                if hidden is not None:  # 8 bytes that read as a BLANK, hiding the segment's records after them
                    report.stop_reason = (f"a BLANK record with an intact record after it (at "
                                          f"{mapped.file_from_offset + hidden}) in {mapped.path}")
                    break
                blank = True
                break
            if visit is not None:
                visit(mapped, pos, layout)
            report.records_checked += 1
            last = pos
            pos += layout.size
            end_pos = pos
        if not blank or i == len(files) - 1:
            break  # stopped inside this segment, or it was the last one
    return end_file, end_pos, blank


def follow_log_end(commit_log: CommitLog, known_end: int) -> int | None:
    """Where a loaded (read-only) log ends now, validating only what follows ``known_end``, an end an earlier
    recovery or follow found (valid records stay valid): a tail follower's next end without a recovery each
    time. None when ``known_end`` is not inside the log's segments any more (retention, another log): recover."""
    files = commit_log.mapped_files.files
    index = next((i for i, mapped in enumerate(files)
                  if mapped.file_from_offset <= known_end < mapped.file_end_offset), None)
    if index is None:
        return None
    end_file, end_pos, _blank = _walk_segments(commit_log, index, known_end - files[index].file_from_offset,
                                               RecoveryReport(abnormal=False))
    return end_file.file_from_offset + end_pos


def _visit_trusted(mapped: MappedFile, visit: RecordVisitor) -> None:
    """Read a segment the checkpoint vouches for; damage ends this segment's reading, not the log."""
    buf, size, pos = mapped.buffer, mapped.file_size, 0
    while pos < size:
        try:
            layout = read_layout(buf, pos, size, path=str(mapped.path), base=mapped.file_from_offset)
        except CorruptDataError as exc:
            log.error("skipping the rest of trusted segment %s: %s", mapped.path.name, exc)
            return
        if layout is None:
            return
        visit(mapped, pos, layout)
        pos += layout.size


def _measure_after_end(commit_log: CommitLog, end_file: MappedFile, end_pos: int, report: RecoveryReport) -> None:
    """What a read-only recovery that stopped at damage leaves out: the non-zero bytes after the end, and where
    the first intact record after it starts. A record a live writer was still writing is no damage: if the
    record at the end validates now (its writer finished it), nothing is reported."""
    files = commit_log.mapped_files.files
    later = files[files.index(end_file) + 1:]
    report.bytes_after_end = (last_nonzero_end(end_file, end_pos) - end_pos
                              + sum(last_nonzero_end(mapped, 0) for mapped in later))
    for mapped, pos in [(end_file, end_pos + 1), *((m, 0) for m in later)]:
        at = find_record_start(mapped.buffer, pos, mapped.file_size, mapped.file_from_offset, mapped.file_size)
        if at is not None and int.from_bytes(mapped.buffer[at + 4: at + 8], "big", signed=True) != BLANK_MAGIC:
            report.resumes_at = mapped.file_from_offset + at
            break
    if report.resumes_at is not None:
        with contextlib.suppress(CorruptDataError):
            if read_layout(end_file.buffer, end_pos, end_file.file_size, check_crc=True, check_offset=True,
                           base=end_file.file_from_offset) is not None:
                report.resumes_at, report.bytes_after_end = None, 0  # a live append, complete by now


def _is_zero_tail(buf, pos: int) -> bool:
    """Whether the scan simply reached the zeroes after the last record (a clean end)."""
    return buf[pos : pos + 8] == b"\0" * 8 or len(buf) - pos < 8


def _truncate_in_memory(commit_log: CommitLog, end: int) -> None:
    commit_log.mapped_files.truncate_dirty_files(end, discard=lambda mapped: None)


def _cut(commit_log: CommitLog, mapped: MappedFile, pos: int, root: Path, report: RecoveryReport, *,
         at_blank: bool = False) -> None:
    """Zero the torn tail of ``mapped`` after ``pos`` (salvaging it) and move later segments away.

    A BLANK record closing the last segment is not data: the log simply continues in its place,
    as RocketMQ does, so it is zeroed without being salvaged.
    """
    tail_end = last_nonzero_end(mapped, pos + BLANK_RECORD_LEN if at_blank else pos)
    if at_blank and tail_end == pos + BLANK_RECORD_LEN:
        mapped.buffer[pos:tail_end] = bytes(BLANK_RECORD_LEN)
        _sync_cut(mapped)
        tail_end = pos
    stamp = time.strftime("%Y%m%d%H%M%S")
    if tail_end > pos:
        keep = min(tail_end - pos, commit_log.config.recovery_salvage_max_bytes)
        target = unused_path(root / RECOVERY_DIR, f"commitlog-{mapped.file_from_offset + pos:020d}-{stamp}", ".tail")
        try:
            with open(target, "xb") as out:
                out.write(mapped.buffer[pos : pos + keep])
                out.flush()
                os.fsync(out.fileno())
        except OSError as exc:
            raise StoreIOError(exc.errno, f"cannot salvage the torn tail to {target}: {exc.strerror}") from exc
        fsync_dir(target.parent)  # the salvage's name, and the directory's own, before the bytes are zeroed
        fsync_dir(root)
        report.salvaged.append(str(target))
        buf = mapped.buffer
        for start in range(pos, tail_end, len(_ZERO_CHUNK)):
            stop = min(start + len(_ZERO_CHUNK), tail_end)
            buf[start:stop] = _ZERO_CHUNK[: stop - start]
        _sync_cut(mapped)
        report.cut_bytes = tail_end - pos

    def move_away(dropped: MappedFile) -> None:
        if not _holds_data(dropped.path, dropped.file_size):  # a broker's next segment, made ahead, never written:
            with contextlib.suppress(FileNotFoundError):  # deleted, as RocketMQ's recovery does (not 1 GiB kept)
                os.unlink(dropped.path)
            return
        target = unused_path(root / RECOVERY_DIR, f"commitlog-{dropped.path.name}-{stamp}", ".segment")
        with contextlib.suppress(FileNotFoundError):
            os.replace(dropped.path, target)
            report.salvaged.append(str(target))

    commit_log.mapped_files.truncate_dirty_files(mapped.file_from_offset + pos, discard=move_away)


def _sync_cut(mapped: MappedFile) -> None:
    try:
        mapped.buffer.flush()
    except OSError as exc:  # the open fails; the next one cuts again (the tail is salvaged already)
        raise FlushError(exc.errno, f"msync of {mapped.path} failed while cutting its torn tail: {exc.strerror}"
                         ) from exc


def last_nonzero_end(mapped: MappedFile, start: int) -> int:
    """One past the last non-zero byte of ``mapped`` at or after ``start`` (``start`` if none).

    Holes are skipped with SEEK_DATA/SEEK_HOLE where the file system supports them, so a mostly
    empty pre-allocated segment is not read page by page.
    """
    buf, size = mapped.buffer, mapped.file_size
    regions = data_regions(mapped.path, start, size)
    last = start
    for region_start, region_end in regions:
        for chunk_start in range(region_start, region_end, len(_ZERO_CHUNK)):
            chunk_end = min(chunk_start + len(_ZERO_CHUNK), region_end)
            chunk = buf[chunk_start:chunk_end]
            if chunk != _ZERO_CHUNK[: len(chunk)]:
                last = chunk_start + len(chunk.rstrip(b"\0"))
    return last


def _holds_data(path: Path, size: int) -> bool:
    """Whether the file has a non-zero byte (holes skipped; its mapping may be closed already)."""
    try:
        with open(path, "rb") as f:
            for region_start, region_end in data_regions(path, 0, size):
                f.seek(region_start)
                left = region_end - region_start
                while left > 0:
                    chunk = f.read(min(left, len(_ZERO_CHUNK)))
                    if not chunk:
                        break
                    if chunk != _ZERO_CHUNK[: len(chunk)]:
                        return True
                    left -= len(chunk)
    except OSError:
        return True  # unreadable: kept, as data would be
    return False


def recovered_log_end(root: Path, config) -> tuple[int, int]:
    """(min offset, recovered end) of a store's commit log, computed read-only and in memory (at damage too: the
    caller reports it)."""
    from .commitlog import CommitLog
    from .lifecycle import ABORT_FILE

    commit_log = CommitLog(root, config.replace(cut_damaged_log=True), read_only=True)
    commit_log.load()
    try:
        checkpoint = StoreCheckpoint.load(root / "checkpoint", read_only=True)
        report = recover_commit_log(commit_log, checkpoint, root, abnormal=(root / ABORT_FILE).exists())
        return commit_log.min_offset, report.end_offset
    finally:
        commit_log.close()

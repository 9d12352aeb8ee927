"""Retention: deleting expired commit-log segments with the queue and index files that only cover them.

A segment expires ``file_reserved_time`` hours after its last modification, and is deleted at
the hour ``delete_when`` names (RocketMQ's ``deleteWhen``, default 04) or at once when the disk
holding the log is fuller than ``disk_max_used_space_ratio`` percent (then the oldest go first,
expired or not). The segment being written is never deleted, nor one the dispatcher has not read to its end:
its messages would reach no consume queue and no index (RocketMQ deletes it anyway).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

from .commitlog import CommitLog
from .config import StoreConfig
from .consumequeue import ConsumeQueueTable
from .errors import StoreIOError
from .index.service import IndexService

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RetentionReport:
    commit_log_files: list[str] = field(default_factory=list)
    consume_queue_files: int = 0
    index_files: int = 0
    disk_used_ratio: float = 0.0


def disk_used_ratio(path: str | os.PathLike) -> float:
    """Percent of the disk in use as ``df`` shows it: blocks in use over blocks in use plus those still available.

    Blocks reserved for root are neither. ``shutil.disk_usage``'s free is the available count, so (total - free) /
    total counted the reserve as used: 80% on a disk ``df`` shows half full (this VM reserves 60% of it), and
    retention, past ``disk_max_used_space_ratio``, deleted an unexpired segment on every pass."""
    st = os.statvfs(path)
    used = st.f_blocks - st.f_bfree
    usable = used + st.f_bavail
    return 100.0 * used / usable if usable > 0 else 0.0


def _retry_undeleted(commit_log: CommitLog, queues: ConsumeQueueTable, index: IndexService | None) -> None:
    """Unlink again the files earlier passes gave up on but could not delete: segments, queue files, index files.
    A failure again is said and the pass goes on (the files it deletes now are others)."""
    retries = [commit_log.mapped_files.retry_undeleted]
    retries += [queue.mapped_files.retry_undeleted for queue in list(queues.queues.values())
                if queue.mapped_files.undeleted]
    if index is not None:
        retries.append(index.retry_undeleted)
    for retry in retries:
        still = retry()
        if still is not None:
            log.error("retention could not delete a file it had given up on, again: %s", still)


def delete_expired_files(commit_log: CommitLog, queues: ConsumeQueueTable, index: IndexService | None,
                         config: StoreConfig, *, now_ms: int | None = None, immediately: bool = False,
                         used_ratio: float | None = None, dispatched: int | None = None) -> RetentionReport:
    """``deleteExpiredFiles`` for the whole store; ``immediately`` ignores ``delete_when``. Segments that end
    past ``dispatched`` (the dispatcher's read position; the caller holds dispatch paused) are kept."""
    now = time.time_ns() // 1_000_000 if now_ms is None else now_ms
    report = RetentionReport()
    _retry_undeleted(commit_log, queues, index)
    if not commit_log.mapped_files.files:
        return report
    ratio = disk_used_ratio(commit_log.directory) if used_ratio is None else used_ratio
    report.disk_used_ratio = ratio
    disk_full = ratio >= config.disk_max_used_space_ratio
    at_delete_hour = immediately or time.localtime(now / 1000).tm_hour in config.delete_hours
    reserved_ms = config.file_reserved_time * 3_600_000
    with commit_log.put_lock.held():
        commit_log.put_lock.io = True  # stats and unlinks: producers wait asleep
        files = commit_log.mapped_files.files
        doomed = 0
        for mapped in files[:-1]:
            expired = os.stat(mapped.path).st_mtime * 1000 + reserved_ms <= now
            if (expired and at_delete_hour) or disk_full:
                if dispatched is not None and mapped.file_from_offset + mapped.file_size > dispatched:
                    log.warning("retention keeps %s and later: dispatch has read only to offset %d",
                                mapped.path.name, dispatched)
                    break
                doomed += 1
                if disk_full and not expired:
                    break  # under disk pressure, one unexpired segment per pass
            else:
                break
        if not doomed:
            return report
        report.commit_log_files = [m.path.name for m in files[:doomed]]
        try:
            commit_log.mapped_files.delete_first(doomed)
        except StoreIOError as exc:  # the log starts after them all the same: queues and index follow, then it says
            failed = exc
        else:
            failed = None
    new_min = commit_log.min_offset
    for queue in list(queues.queues.values()):  # one queue's file that cannot go does not keep the others
        try:
            with queue.lock:
                report.consume_queue_files += queue.delete_files_before(new_min)
        except StoreIOError as exc:
            failed = failed or exc
    if index is not None:
        try:
            report.index_files = index.delete_expired(new_min)
        except StoreIOError as exc:
            failed = failed or exc
    log.info("retention deleted %s (disk %.0f%% used)", report.commit_log_files, ratio)
    if failed is not None:
        raise failed
    return report

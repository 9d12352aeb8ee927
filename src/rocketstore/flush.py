"""Getting the commit log onto the disk: ASYNC_FLUSH and SYNC_FLUSH with group commit.

ASYNC_FLUSH (``FlushRealTimeService``): a thread msyncs every ``flush_interval_commit_log`` ms
when at least ``flush_commit_log_least_pages`` pages are dirty, and everything every
``flush_commit_log_thorough_interval`` ms. A put returns once its bytes are in the page cache.

SYNC_FLUSH (``GroupCommitService``): a put returns once its bytes are msynced. Instead of
handing requests to a flush thread, the first waiting writer becomes the leader and flushes
everything written so far; writers that arrive meanwhile wait and are covered by the next
flush, so concurrent puts share one msync without a thread hand-off per put.

A failed msync is final for this process (see ``health.py``): the failing flush raises, every later
flush raises ``StoreFailedError`` without touching the disk, so no put is acknowledged on the
strength of a retry that the kernel would report as a success for pages it has already dropped.
"""

from __future__ import annotations

import logging
import threading
import time

from .checkpoint import StoreCheckpoint
from .commitlog import CommitLog
from .config import FlushDiskType, StoreConfig
from .errors import StoreIOError
from .health import StoreHealth
from .lifecycle import start_thread

log = logging.getLogger(__name__)


class CommitLogFlusher:
    """Owns every msync of the commit log and the checkpoint's ``physicMsgTimestamp``."""

    def __init__(self, commit_log: CommitLog, checkpoint: StoreCheckpoint, config: StoreConfig,
                 health: StoreHealth | None = None) -> None:
        self.commit_log = commit_log
        self.health = health or StoreHealth()
        self.checkpoint = checkpoint
        self.config = config
        self.sync = config.flush_disk_type is FlushDiskType.SYNC_FLUSH
        self._flush_lock = threading.Lock()  # one msync pass at a time
        self._cond = threading.Condition()
        self._leader_active = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.flush_count = 0
        self.last_error: BaseException | None = None

    # --- the one flush routine -----------------------------------------------------------------

    def flush(self, least_pages: int = 0) -> int:
        """msync what has been written; returns the flushed offset. After one failure, always raises."""
        end, store_ts = self.commit_log.last_append
        with self._flush_lock:
            if self.health.flush_error is not None:
                self.health.check_writable()
            try:
                flushed = self.commit_log.mapped_files.flush(least_pages)
            except StoreIOError as exc:
                self.last_error = exc
                self.health.fail_flush(exc)
                log.error("commit-log flush failed, the store stops accepting writes: %s", exc)
                raise
            self.flush_count += 1
        if store_ts and flushed >= end:
            self.checkpoint.physic_msg_timestamp = max(self.checkpoint.physic_msg_timestamp, store_ts)
        return flushed

    # --- SYNC_FLUSH --------------------------------------------------------------------------

    def wait_flushed(self, offset: int, timeout_ms: int | None = None) -> bool:
        """Block until the log is flushed up to ``offset``; False on timeout (FLUSH_DISK_TIMEOUT)."""
        deadline = time.monotonic() + (self.config.sync_flush_timeout if timeout_ms is None else timeout_ms) / 1000
        with self._cond:
            while self.commit_log.flushed_offset < offset:
                if not self._leader_active:
                    self._leader_active = True
                    self._cond.release()
                    try:
                        self.flush(0)
                    finally:
                        self._cond.acquire()
                        self._leader_active = False
                        self._cond.notify_all()
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    # --- background thread -------------------------------------------------------------------

    def start(self) -> None:
        if self.sync:
            return  # SYNC_FLUSH writers flush themselves (group commit)
        self._thread = start_thread(self._run, "rocketstore-flush")

    def _run(self) -> None:
        interval = self.config.flush_interval_commit_log / 1000
        thorough_every = self.config.flush_commit_log_thorough_interval / 1000
        last_thorough = time.monotonic()
        while not self._stop.wait(interval):
            now = time.monotonic()
            thorough = now - last_thorough >= thorough_every
            try:
                self.flush(0 if thorough else self.config.flush_commit_log_least_pages)
            except StoreIOError:  # recorded in health: the next put, flush() and close() raise it
                return
            except Exception as exc:  # a bug, not the disk: the same fail-stop
                self.last_error = exc
                self.health.fail_flush(exc)
                log.exception("background flush failed")
                return
            if thorough:
                last_thorough = now

    def halt(self) -> None:
        """Stop the thread without a last flush (an open that failed: the next open recovers)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def shutdown(self) -> None:
        """Stop the thread and flush everything (clean shutdown); raises if any flush ever failed."""
        self.halt()
        self.flush(0)

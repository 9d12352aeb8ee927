"""Pages ahead of the commit log's write position, faulted in before the appends that fill them.

An append copies its records into the mapping, and the first touch of each page of a fresh segment is a page
fault taken with the GIL held (allocate, zero, map): ~10 us of every 7 KB ``put_messages(32)``. This thread
asks the kernel to fault the next ``ahead`` bytes in, writable, beforehand (MADV_POPULATE_WRITE, no byte
changed, no GIL held), so the producer's copy finds them mapped: +9% for ``put_messages(32)``. RocketMQ's
``warmMappedFile`` writes zeros over a whole new segment for the same reason; this touches only what the next
appends need.

While it runs, appends of up to ``WARMED_COPY_LIMIT`` bytes (and at most half the lead) copy into the mapping
instead of pwriting (the copy finds its pages mapped; see ``MappedFile.write``); once it stops, the ordinary
limit is back.

It is an optimization and nothing more: a segment without allocated blocks is skipped, a kernel without the advice
or any unexpected error stops it (logged once), and the store goes on exactly as without it. The pages it
faults in are dirty zeros until appends fill them: a producer slower than ``ahead`` bytes per ~30 s (the
kernel's writeback age) has some of them written twice, zeros first.
"""

from __future__ import annotations

import errno
import logging
import threading

from ..lifecycle import start_thread
from .file import COPY_LIMIT, WARMED_COPY_LIMIT
from .file_queue import MappedFileQueue

log = logging.getLogger(__name__)

STEP = 2 << 20  # bytes per madvise: ~0.5 ms of kernel work, so a stop never waits long


class WriteAheadWarmer:
    """Keeps ``[write position, write position + ahead)`` of the newest segment faulted in."""

    def __init__(self, files: MappedFileQueue, ahead: int) -> None:
        self.files = files
        self.ahead = ahead
        self.warmed_until = 0  # log offset: everything below it in the newest segment was warmed
        self.warmed_bytes = 0
        self.stopped_by: str | None = None  # why warming stopped for good (unsupported, an error)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.ahead > 0 and self._thread is None:
            # a copy larger than half the lead would reach pages the warmer may not have faulted in yet
            self.files.set_copy_limit(max(COPY_LIMIT, min(WARMED_COPY_LIMIT, self.ahead // 2)))
            self._thread = start_thread(self._run, "rocketstore-warm")

    def nudge(self, end: int) -> None:
        """An append ended at log offset ``end``: wake the thread once half the warmed lead is used up."""
        if end + (self.ahead >> 1) > self.warmed_until and not self._wake.is_set():
            self._wake.set()

    def stop(self) -> None:
        """Stop and join: the caller may unmap the segments afterwards."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.files.set_copy_limit(COPY_LIMIT)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._wake.wait(0.5):
                continue  # only appends wake it: a store that writes nothing gets nothing faulted in
            self._wake.clear()
            try:
                self.warm_once()
            except Exception as exc:  # an optimization never fails the store
                self._give_up(f"{type(exc).__name__}: {exc}")
            if self.stopped_by is not None:
                return

    def warm_once(self) -> None:
        """Warm the newest segment up to ``ahead`` bytes past its write position (or its end)."""
        files = self.files
        mapped = files.last
        if mapped is None:
            return
        base = mapped.file_from_offset
        written = base + mapped.wrote_position
        target = min(written + self.ahead, base + mapped.file_size)
        start = max(self.warmed_until, written)
        while start < target and not self._stop.is_set():
            if mapped is not files.last or not mapped.warmable:
                return  # rolled, deleted, or a segment without allocated blocks: the next round looks again
            length = min(STEP, target - start)
            try:
                supported = mapped.warm(start - base, length)
            except ValueError:  # unmapped under us (retention under disk pressure): the next round starts over
                return
            except OSError as exc:
                if exc.errno in (errno.ENOMEM, errno.EAGAIN):  # no memory to spare now: not a reason to stop
                    return
                raise
            if not supported:
                self._give_up("this kernel cannot fault pages in ahead (MADV_POPULATE_WRITE)")
                return
            start += length
            self.warmed_until = start
            self.warmed_bytes += length

    def _give_up(self, why: str) -> None:
        self.stopped_by = why
        self.files.set_copy_limit(COPY_LIMIT)  # the copies would take the page faults again, with the GIL
        log.info("commit-log pages are no longer faulted in ahead of appends: %s", why)

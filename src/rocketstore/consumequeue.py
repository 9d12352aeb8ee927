"""Consume queues: per topic-queue arrays of 20-byte units pointing into the commit log.

Unit (big-endian)::

    0 commit-log offset i64 | 8 record size i32 (TOTALSIZE) | 12 tags code i64

Queue offset q lives at logical byte 20q, in ``consumequeue/<topic>/<queueId>/%020d`` of
``20q - 20q mod fileSize``. A unit is valid while offset >= 0 and size > 0, and the size is
written last, so a unit torn by a crash is never valid. A queue whose first file starts past
0 is padded with pre-blank units ``(0, 0x7FFFFFFF, 0)`` up to its first real unit.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .brokerlayout import is_lmq, rocksdb_queues, unmanaged_reason
from .codec._kernels import put_queue_units
from .config import StoreConfig
from .errors import CorruptDataError, UnsupportedLayoutError
from .mapped.file import (
    STAGING_DIR,
    FileBudget,
    MappedFile,
    reading,
    replace_file,
    retry_evicted,
    unused_path,
)
from .mapped.file_queue import MappedFileQueue

CQ_UNIT_SIZE = 20
# tags codes at or below this are addresses in consumequeue_ext/ (``ConsumeQueueExt.isExtAddr``, a broker with
# enableConsumeQueueExt): the real tags code is there, so a unit with one passes any tags-code test and its
# record's TAGS decide
EXT_ADDR_MAX = -(1 << 31) - 1
CONSUMEQUEUE_DIR = "consumequeue"
QUEUE_ENDS_FILE = "queueEnds.json"  # rocketstore's: every queue's end at the last clean close (RocketMQ ignores it)
UNIT_FMT = ">qiq"
_UNIT = struct.Struct(UNIT_FMT)
_HEAD = struct.Struct(">q")  # offset
_SIZE = struct.Struct(">i")
_TAGS = struct.Struct(">q")
PRE_BLANK_SIZE = 0x7FFFFFFF
PRE_BLANK_UNIT = _UNIT.pack(0, PRE_BLANK_SIZE, 0)
assert _UNIT.size == CQ_UNIT_SIZE
UNIT_DTYPE = np.dtype([("phy", ">i8"), ("size", ">i4"), ("tags", ">i8")])
SMALL_RUN = 4  # units of one queue in a round below which put_run writes them one by one

log = logging.getLogger(__name__)

# store time of the record at a commit-log offset, or -1 when it is not readable (``getStoreTime``)
StoreTimeLookup = Callable[[int, int], int]


HOLE_LOOKAHEAD = 64 << 10  # bytes after a queue's first invalid unit searched for more units (a damaged page)


def _units_follow(buf, start: int, limit: int) -> bool:
    """Whether a unit with a size is written in the ``HOLE_LOOKAHEAD`` after ``start``: units past an invalid one.
    Not any non-zero byte: ``put_queue_units`` writes a run's offsets and tags first and its sizes after, in order,
    so a writer killed in between leaves units with offsets and no size after the first invalid one, and every
    such open called the queue damaged (an ERROR, and a re-dispatch it did not need beyond the queue's end)."""
    end = min(limit, start + HOLE_LOOKAHEAD)
    count = (end - start) // CQ_UNIT_SIZE if start < end else 0
    if count == 0:
        return False
    units = np.frombuffer(buf, dtype=UNIT_DTYPE, count=count, offset=start)
    try:
        return bool(np.any(units["size"] != 0))
    finally:
        del units  # no export may outlive the call: the mapping may close


def _valid_run(buf, count: int) -> tuple[int, int | None]:
    """How many units from the start of ``buf`` are valid (offset >= 0, size > 0), and where the record of the
    last of them that is not a pre-blank ends (None if none is): numpy over chunks of the file's units, up to the
    chunk where they end (a Python loop over a broker's 300,000-unit files was most of a read-only open, 1.1 s for
    1M units; the whole file at once touched its unused pages too)."""
    valid, last_end = count, None
    for first in range(0, count, _RUN_CHUNK):
        units = np.frombuffer(buf, dtype=UNIT_DTYPE, count=min(_RUN_CHUNK, count - first),
                              offset=first * CQ_UNIT_SIZE)
        try:
            phy, size = units["phy"], units["size"]
            invalid = np.flatnonzero((phy < 0) | (size <= 0))
            stop = int(invalid[0]) if len(invalid) else len(units)
            real = np.flatnonzero(size[:stop] != PRE_BLANK_SIZE)
            if len(real):
                last_end = int(phy[real[-1]]) + int(size[real[-1]])
            del phy, size
        finally:
            del units  # no export may outlive the call: the mapping may close
        if stop < min(_RUN_CHUNK, count - first):
            valid = first + stop
            break
    return valid, last_end


_RUN_CHUNK = 16_384  # units (320 KB) a step of _valid_run


class ConsumeQueue:
    """One topic-queue's units (RocketMQ's ``ConsumeQueue``)."""

    def __init__(self, root: Path, topic: str, queue_id: int, config: StoreConfig, *, read_only: bool = False,
                 budget: FileBudget | None = None):
        self.topic = topic
        self.queue_id = queue_id
        self.directory = root / CONSUMEQUEUE_DIR / topic / str(queue_id)
        self.file_size = config.mapped_file_size_consume_queue
        # preallocated like segments (or, with preallocate off, reserved a step ahead of the units written): a
        # store into a sparse mapped page on a full disk is a SIGBUS
        self.mapped_files = MappedFileQueue(self.directory, self.file_size, read_only=read_only,
                                            preallocate=config.preallocate, staging=root / STAGING_DIR,
                                            budget=budget)
        self.max_physic_offset = -1  # end (offset + size) of the last unit's record
        self.min_logic_offset = 0  # bytes
        self.hole_at = -1  # queue offset where recover found units after an invalid one (damage), else -1
        self.lock = threading.Lock()

    # --- load and recovery -------------------------------------------------------------------

    def load(self, keep_prefix: bool = False) -> CorruptDataError | None:
        """Map the queue's files; ``keep_prefix``: a damaged file ends the queue before it (returned), else
        raises."""
        return self.mapped_files.load(keep_prefix)

    @retry_evicted
    def recover(self) -> None:
        """``recover()``: trust all but the last three files; end the queue at the first invalid unit."""
        files = self.mapped_files.files
        if not files:
            return
        start = max(0, len(files) - 3)
        end = files[start].file_from_offset
        max_physic = -1
        for mapped in files[start:]:
            buf = mapped.buffer
            count, last_real = _valid_run(buf, mapped.file_size // CQ_UNIT_SIZE)
            if last_real is not None:
                max_physic = last_real
            pos = count * CQ_UNIT_SIZE
            end = mapped.file_from_offset + pos
            if pos < mapped.file_size:
                if mapped is not files[-1] or _units_follow(buf, pos + CQ_UNIT_SIZE, mapped.file_size):
                    # not the queue's end: a hole (a unit zeroed or overwritten). RocketMQ ends the queue here
                    # and its next put reuses the hole's queue offset; the store re-dispatches from the last
                    # good unit's record instead (``hole_at``), which writes the lost units again
                    self.hole_at = end // CQ_UNIT_SIZE
                break
        self.max_physic_offset = max_physic
        if max_physic < 0 and start > 0:  # only pre-blank units in the scanned files: look further back
            self.max_physic_offset = self._last_real_unit_end(files[:start])
        self.mapped_files.truncate_dirty_files(end)
        self.min_logic_offset = max(self.min_logic_offset, self.mapped_files.min_offset())

    def _last_real_unit_end(self, files: list[MappedFile]) -> int:
        for mapped in reversed(files):
            for pos in range(mapped.wrote_position - CQ_UNIT_SIZE, -1, -CQ_UNIT_SIZE):
                offset, size, _ = _UNIT.unpack_from(mapped.buffer, pos)
                if offset >= 0 and 0 < size != 0x7FFFFFFF:
                    return offset + size
        return -1

    @retry_evicted
    def truncate_dirty(self, phy_offset: int) -> None:
        """``truncateDirtyLogicFiles``: drop units whose record starts at or after ``phy_offset``."""
        files = self.mapped_files.files
        cut = self.mapped_files.max_offset()
        for mapped in reversed(files):
            offset, size, _ = _UNIT.unpack_from(mapped.buffer, 0)
            if offset >= phy_offset and size != 0x7FFFFFFF:
                cut = mapped.file_from_offset  # the whole file is dirty
                continue
            pos = 0
            while pos + CQ_UNIT_SIZE <= mapped.wrote_position:
                offset, size, _ = _UNIT.unpack_from(mapped.buffer, pos)
                if offset < 0 or size <= 0 or (offset >= phy_offset and size != 0x7FFFFFFF):
                    break
                pos += CQ_UNIT_SIZE
            cut = mapped.file_from_offset + pos
            self._zero_after(mapped, pos)
            break
        else:  # every file dirty: the first is kept, empty; its units would come back at the next load
            if files:
                self._zero_after(files[0], 0)
        self.mapped_files.truncate_dirty_files(cut)
        self.max_physic_offset = self._last_real_unit_end(self.mapped_files.files)

    @staticmethod
    def _zero_after(mapped: MappedFile, pos: int) -> None:
        if not mapped.read_only and pos < mapped.wrote_position:
            end = mapped.wrote_position
            mapped.buffer[pos:end] = bytes(end - pos)

    @retry_evicted
    def correct_min_offset(self, log_min_offset: int) -> None:
        """``correctMinOffset``: the first unit whose record still exists in the commit log. Whole files can be
        stale (a kill between retention's segment deletion and its queue-file deletion), so the search starts
        in the first file whose last unit is still live, not in the first file."""
        files = self.mapped_files.files
        for mapped in files:
            buf = mapped.buffer
            count = (mapped.wrote_position if mapped is files[-1] else mapped.file_size) // CQ_UNIT_SIZE
            if count == 0:
                continue
            offset, size, _ = _UNIT.unpack_from(buf, (count - 1) * CQ_UNIT_SIZE)
            if size == 0x7FFFFFFF or offset < log_min_offset:
                continue  # every unit of this file points below the log
            lo, hi, found = 0, count - 1, count - 1
            while lo <= hi:
                mid = (lo + hi) // 2
                offset, size, _ = _UNIT.unpack_from(buf, mid * CQ_UNIT_SIZE)
                if size != 0x7FFFFFFF and offset >= log_min_offset:
                    found, hi = mid, mid - 1
                else:
                    lo = mid + 1
            self.min_logic_offset = mapped.file_from_offset + found * CQ_UNIT_SIZE
            return
        if files:
            self.min_logic_offset = self.max_offset_in_queue * CQ_UNIT_SIZE

    # --- append ------------------------------------------------------------------------------

    @retry_evicted
    def put_position(self, phy_offset: int, size: int, tags_code: int, queue_offset: int) -> bool:
        """``putMessagePositionInfo``: append a unit; False if it was already there (a re-dispatch)."""
        if phy_offset + size <= self.max_physic_offset:
            return False
        expected = queue_offset * CQ_UNIT_SIZE
        mapped = self.mapped_files.last
        if mapped is None or mapped.is_full():
            start = expected - expected % self.file_size if mapped is None else mapped.file_end_offset
            mapped = self.mapped_files.create_file(start)
            if mapped is self.mapped_files.first and expected != start and queue_offset != 0:
                for pos in range(0, expected - start, CQ_UNIT_SIZE):  # pre-blank up to the first unit
                    mapped.write(pos, PRE_BLANK_UNIT)
                mapped.wrote_position = expected - start
                self.min_logic_offset = expected
        current = mapped.file_from_offset + mapped.wrote_position
        if queue_offset != 0 and expected < current:
            return False  # duplicate
        if expected > current:
            log.error("consume queue %s-%d: unit for offset %d written at %d (a gap)", self.topic,
                      self.queue_id, queue_offset, current // CQ_UNIT_SIZE)
        pos = mapped.wrote_position
        mapped.reserve(pos + CQ_UNIT_SIZE)  # a sparse file (a broker's, or preallocate off): blocks before the store
        buf = mapped.buffer
        _HEAD.pack_into(buf, pos, phy_offset)
        _TAGS.pack_into(buf, pos + 12, tags_code)
        _SIZE.pack_into(buf, pos + 8, size)  # last: a torn unit keeps size 0 and is invalid
        mapped.wrote_position = pos + CQ_UNIT_SIZE
        self.max_physic_offset = phy_offset + size
        return True

    @retry_evicted
    def put_run(self, queue_offsets: np.ndarray, phy_offsets: np.ndarray, sizes: np.ndarray,
                tags_codes: np.ndarray) -> int:
        """``put_position`` for one dispatch round's units of this queue, in log order; returns how many were
        written. Where the queue continues densely (the common case) whole runs are written at once: units
        with size 0 first, then the sizes, so a unit torn by a kill is still never valid. Re-dispatched
        units are skipped; anything unusual (a new file, a gap, a duplicate offset) goes through
        ``put_position``. Re-running it after an eviction under it writes the same bytes again."""
        n = len(queue_offsets)
        if n <= SMALL_RUN:  # a few units (a round of single puts): numpy's per-call costs would be most of it
            return sum(self.put_position(int(p), int(z), int(t), int(o))
                       for o, p, z, t in zip(queue_offsets.tolist(), phy_offsets.tolist(), sizes.tolist(),
                                             tags_codes.tolist(), strict=True))
        i, written = 0, 0
        if int(phy_offsets[0]) + int(sizes[0]) <= self.max_physic_offset:  # a re-dispatch: skip what is there
            i = int(np.searchsorted(phy_offsets + sizes, self.max_physic_offset, side="right"))
        while i < n:
            mapped = self.mapped_files.last
            expected = int(queue_offsets[i]) * CQ_UNIT_SIZE
            if mapped is None or mapped.is_full() or expected != mapped.file_from_offset + mapped.wrote_position:
                written += self.put_position(int(phy_offsets[i]), int(sizes[i]), int(tags_codes[i]),
                                             int(queue_offsets[i]))
                i += 1
                continue
            room = (mapped.file_size - mapped.wrote_position) // CQ_UNIT_SIZE
            pos = mapped.wrote_position
            mapped.reserve(pos + min(room, n - i) * CQ_UNIT_SIZE)  # a store into a hole on a full disk: SIGBUS
            target = np.frombuffer(mapped.buffer, dtype=np.uint8)
            try:
                count = put_queue_units(target, pos, room, queue_offsets, phy_offsets, sizes, tags_codes, i)
            finally:
                del target  # an exported view would keep the mapping from ever closing
            stop = i + count
            mapped.wrote_position = pos + count * CQ_UNIT_SIZE
            self.max_physic_offset = int(phy_offsets[stop - 1]) + int(sizes[stop - 1])
            written += count
            i = stop
        return written

    def put_positions(self, queue_offsets, phy_offsets, sizes, tags_codes) -> int:
        """Append many units in log order, as ``put_position`` calls would; returns how many were written.

        A fresh queue whose offsets run densely is written as whole arrays (a rebuild's first window); a queue
        that has units already continues through ``put_run``'s compiled runs (a rebuild's later windows: unit
        by unit they took 6 us each, most of a multi-window rebuild's time on the driver).
        """
        q = np.asarray(queue_offsets, dtype=np.int64)
        if len(q) == 0:
            return 0
        dense = self.mapped_files.last is None and bool(np.all(np.diff(q) == 1))
        if not dense:
            return self.put_run(q, np.asarray(phy_offsets, dtype=np.int64), np.asarray(sizes, dtype=np.int64),
                                np.asarray(tags_codes, dtype=np.int64))
        units = np.empty(len(q), dtype=UNIT_DTYPE)
        units["phy"], units["size"], units["tags"] = phy_offsets, sizes, tags_codes
        first = int(q[0]) * CQ_UNIT_SIZE
        file_start = first - first % self.file_size
        data = PRE_BLANK_UNIT * ((first - file_start) // CQ_UNIT_SIZE) if q[0] != 0 else b""
        data += units.tobytes()
        for at in range(0, len(data), self.file_size):
            mapped = self.mapped_files.create_file(file_start + at)
            chunk = data[at : at + self.file_size]
            mapped.write(0, chunk)
            mapped.wrote_position = len(chunk)
        if q[0] != 0:
            self.min_logic_offset = first
        self.max_physic_offset = int(phy_offsets[-1]) + int(sizes[-1])
        return len(q)

    # --- reads -------------------------------------------------------------------------------

    def forget_deleted(self) -> None:
        """A read-only view found a file a live writer's retention deleted (mapped again after an eviction: gone):
        it and every older file are forgotten, so the queue starts after them, as the writer's does (readers
        then answer OFFSET_TOO_SMALL and read on, instead of failing on that file at every read)."""
        files = self.mapped_files.files
        gone = max((i for i, f in enumerate(files[:-1]) if f.deleted), default=-1)  # the last file always stays
        if not self.mapped_files.read_only or gone < 0:
            return
        for mapped in files[: gone + 1]:
            mapped.close()
        self.mapped_files.files = files[gone + 1 :]
        self.mapped_files._starts = [f.file_from_offset for f in self.mapped_files.files]
        self.min_logic_offset = max(self.min_logic_offset, self.mapped_files.files[0].file_from_offset)

    @property
    def max_offset_in_queue(self) -> int:
        return self.mapped_files.max_offset() // CQ_UNIT_SIZE

    @property
    def min_offset_in_queue(self) -> int:
        return self.min_logic_offset // CQ_UNIT_SIZE

    @retry_evicted
    def get_unit(self, queue_offset: int) -> tuple[int, int, int] | None:
        """(commit-log offset, size, tags code) at a queue offset, or None."""
        logical = queue_offset * CQ_UNIT_SIZE
        if queue_offset < 0 or logical >= self.mapped_files.max_offset():
            return None
        mapped = self.mapped_files.find(logical)
        if mapped is None:
            return None
        with reading(mapped):
            return _UNIT.unpack_from(mapped.buffer, logical - mapped.file_from_offset)

    @retry_evicted
    def units_from(self, queue_offset: int, max_units: int) -> tuple[list[tuple[int, int, int]], int | None]:
        """Up to ``max_units`` units from ``queue_offset`` within one file, plus the next file's start
        offset when ``queue_offset``'s file is missing (``OFFSET_FOUND_NULL``)."""
        logical = queue_offset * CQ_UNIT_SIZE
        mapped = self.mapped_files.find(logical)
        if mapped is None:
            nxt = logical - logical % self.file_size + self.file_size
            return [], nxt // CQ_UNIT_SIZE
        pos = logical - mapped.file_from_offset
        end = min(mapped.wrote_position, pos + max_units * CQ_UNIT_SIZE)
        with reading(mapped):
            buf = mapped.buffer
            return [_UNIT.unpack_from(buf, p) for p in range(pos, end, CQ_UNIT_SIZE)], None

    @retry_evicted
    def units_array(self, queue_offset: int, max_units: int) -> tuple[np.ndarray, int | None]:
        """``units_from`` as one ``UNIT_DTYPE`` array (a copy: it outlives the mapping), for batch reads."""
        logical = queue_offset * CQ_UNIT_SIZE
        mapped = self.mapped_files.find(logical)
        if mapped is None:
            nxt = logical - logical % self.file_size + self.file_size
            return np.zeros(0, dtype=UNIT_DTYPE), nxt // CQ_UNIT_SIZE
        pos = logical - mapped.file_from_offset
        count = max(0, min(mapped.wrote_position - pos, max_units * CQ_UNIT_SIZE) // CQ_UNIT_SIZE)
        with reading(mapped):
            return np.frombuffer(mapped.buffer, dtype=UNIT_DTYPE, count=count, offset=pos).copy(), None

    @retry_evicted
    def offset_by_time(self, timestamp: int, upper: bool, store_time: StoreTimeLookup, log_min: int) -> int:
        """``getOffsetInQueueByTime`` (spec 4.5); the caller clamps to [min, max]."""
        files = self.mapped_files.files
        if not files:
            return 0
        last = files[-1]
        chosen: MappedFile | None = None
        if upper:
            for mapped in reversed(files):
                if self._first_time(mapped, store_time) <= timestamp:
                    chosen = mapped
                    break
            if chosen is None:
                return 0
        else:
            for mapped in files[:-1]:
                if self._last_time(mapped, store_time) >= timestamp:
                    chosen = mapped
                    break
            chosen = chosen or last
        start = chosen.file_from_offset
        floor = low = max(0, self.min_logic_offset - start)
        data_range = chosen.wrote_position if chosen is last else chosen.file_size
        ceiling = high = data_range - CQ_UNIT_SIZE
        if ceiling < floor:
            return (start + floor) // CQ_UNIT_SIZE
        buf = chosen.buffer

        def t(pos: int) -> int:
            offset, size, _ = _UNIT.unpack_from(buf, pos)
            return store_time(offset, size)

        if t(ceiling) < timestamp:
            return (start + ceiling + (0 if upper else CQ_UNIT_SIZE)) // CQ_UNIT_SIZE
        if t(floor) > timestamp:
            return 0 if upper else start // CQ_UNIT_SIZE
        left_mid = right_mid = -1
        while high >= low:
            mid = (low + high) // (2 * CQ_UNIT_SIZE) * CQ_UNIT_SIZE
            offset, size, _ = _UNIT.unpack_from(buf, mid)
            if offset < log_min:
                low = mid + CQ_UNIT_SIZE
                left_mid = mid
                continue
            mid_time = store_time(offset, size)
            if mid_time < 0:
                return 0
            if mid_time == timestamp:
                pos = mid
                if upper:
                    while pos + CQ_UNIT_SIZE <= ceiling and t(pos + CQ_UNIT_SIZE) == timestamp:
                        pos += CQ_UNIT_SIZE
                else:
                    while pos - CQ_UNIT_SIZE >= floor and t(pos - CQ_UNIT_SIZE) == timestamp:
                        pos -= CQ_UNIT_SIZE
                return (start + pos) // CQ_UNIT_SIZE
            if mid_time > timestamp:
                high = mid - CQ_UNIT_SIZE
                right_mid = mid
            else:
                low = mid + CQ_UNIT_SIZE
                left_mid = mid
        pos = left_mid if upper else right_mid
        return (start + pos) // CQ_UNIT_SIZE if pos >= 0 else (0 if upper else start // CQ_UNIT_SIZE)

    @staticmethod
    def _first_time(mapped: MappedFile, store_time: StoreTimeLookup) -> int:
        offset, size, _ = _UNIT.unpack_from(mapped.buffer, 0)
        return store_time(offset, size) if mapped.wrote_position else -1

    @staticmethod
    def _last_time(mapped: MappedFile, store_time: StoreTimeLookup) -> int:
        offset, size, _ = _UNIT.unpack_from(mapped.buffer, mapped.file_size - CQ_UNIT_SIZE)
        return store_time(offset, size)

    # --- repair -------------------------------------------------------------------------------

    @retry_evicted
    def rewrite_unit(self, queue_offset: int, phy_offset: int, size: int, tags_code: int) -> bool:
        """Put the right unit back at ``queue_offset`` (one found pointing at another queue's record)."""
        logical = queue_offset * CQ_UNIT_SIZE
        mapped = self.mapped_files.find(logical)
        if mapped is None or mapped.read_only or logical - mapped.file_from_offset >= mapped.wrote_position:
            return False
        pos = logical - mapped.file_from_offset
        buf = mapped.buffer
        _HEAD.pack_into(buf, pos, phy_offset)
        _TAGS.pack_into(buf, pos + 12, tags_code)
        _SIZE.pack_into(buf, pos + 8, size)
        return True

    @retry_evicted
    def truncate_to(self, queue_offset: int) -> None:
        """Drop the units from ``queue_offset`` on; re-dispatch writes them again from the commit log."""
        logical = max(queue_offset * CQ_UNIT_SIZE, self.min_logic_offset)
        mapped = self.mapped_files.find(logical)
        if mapped is not None:
            self._zero_after(mapped, logical - mapped.file_from_offset)
        self.mapped_files.truncate_dirty_files(logical)
        self.max_physic_offset = self._last_real_unit_end(self.mapped_files.files)

    # --- durability and retention ------------------------------------------------------------

    @retry_evicted
    def flush(self, least_pages: int = 0) -> None:
        self.mapped_files.flush(least_pages)

    @retry_evicted
    def delete_files_before(self, log_min_offset: int) -> int:
        """Delete leading files whose units all point below ``log_min_offset``; returns how many."""
        doomed = 0
        files = self.mapped_files.files
        for mapped in files[:-1]:
            offset, size, _ = _UNIT.unpack_from(mapped.buffer, mapped.file_size - CQ_UNIT_SIZE)
            if offset >= 0 and offset + size <= log_min_offset:
                doomed += 1
            else:
                break
        if doomed:  # readers move past the files before they go: one that meets a deleted file finds a new minimum
            self.min_logic_offset = max(self.min_logic_offset, files[doomed].file_from_offset)
            self.mapped_files.delete_first(doomed)
        self.correct_min_offset(log_min_offset)
        return doomed

    def close(self) -> None:
        self.mapped_files.close()

    def destroy(self) -> None:
        self.mapped_files.destroy()
        for directory in (self.directory, self.directory.parent):
            try:
                directory.rmdir()
            except OSError:
                break


def queue_file_budget(configured: int) -> int:
    """``max_open_consume_queue_files``, or a quarter of the process's descriptor limit where that is less: under a
    low ``ulimit -n`` the default of 256 took every descriptor, and the store refused puts until it was reopened
    with a smaller setting (the fd review). Segments and index files need theirs too."""
    try:
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):  # pragma: no cover - no limit to read
        return configured
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return configured
    return max(4, min(configured, soft // 4))


class ConsumeQueueTable:
    """All consume queues of a store, created on first use (``consumeQueueTable``)."""

    def __init__(self, root: Path, config: StoreConfig, *, read_only: bool = False) -> None:
        self.root = root
        self.config = config
        self.read_only = read_only
        self.queues: dict[tuple[str, int], ConsumeQueue] = {}
        self._lock = threading.Lock()
        self.budget = FileBudget(queue_file_budget(config.max_open_consume_queue_files))  # descriptors stay bounded
        self.set_aside: list[str] = []  # damaged queues moved to recovery/ (rebuilt by re-dispatch)
        self.damaged: list[tuple[str, int]] = []  # read-only: queues served up to a damaged file
        # a broker's queues this store leaves alone (``brokerlayout``): LMQ directories, BatchCQ topics, RocksDB
        self.lmq_dirs: list[str] = []
        self.batch_topics: frozenset[str] = frozenset()
        self.rocksdb = False

    def load(self) -> None:
        """Map every ``consumequeue/<topic>/<queueId>`` directory (names RocketMQ could have written) but a broker's
        LMQ queues, whose units point at other topics' records by design: never loaded, so never checked or cut."""
        base = self.root / CONSUMEQUEUE_DIR
        if not base.is_dir():
            return
        self.rocksdb = rocksdb_queues(self.root)
        for topic_entry in sorted(os.scandir(base), key=lambda e: e.name):
            if not topic_entry.is_dir():
                continue
            if is_lmq(topic_entry.name):
                self.lmq_dirs.append(topic_entry.name)
                continue
            for queue_entry in sorted(os.scandir(topic_entry.path), key=lambda e: e.name):
                if not queue_entry.is_dir() or not queue_entry.name.isdigit():
                    continue
                queue = ConsumeQueue(self.root, topic_entry.name, int(queue_entry.name), self.config,
                                     read_only=self.read_only, budget=self.budget)
                try:
                    damage = queue.load(keep_prefix=self.read_only)
                except CorruptDataError as exc:  # derived data: rebuilt from the commit log
                    queue.close()
                    log.error("consume queue %s-%s is damaged: %s", topic_entry.name, queue_entry.name, exc)
                    self._set_aside(Path(queue_entry.path), topic_entry.name, queue_entry.name)
                    continue
                if damage is not None:  # read-only: the files before the damaged one are served
                    log.error("consume queue %s-%s is damaged: %s; this read-only open serves its units before "
                              "that file (queue offsets below %d), a writer's open re-dispatches it",
                              topic_entry.name, queue_entry.name, damage,
                              queue.mapped_files.max_offset() // CQ_UNIT_SIZE)
                    self.damaged.append((topic_entry.name, int(queue_entry.name)))
                self.queues[(topic_entry.name, int(queue_entry.name))] = queue

    def _set_aside(self, directory: Path, topic: str, queue_id: str) -> None:
        target = unused_path(self.root / "recovery", f"consumequeue-{topic}-{queue_id}-{time.strftime('%Y%m%d%H%M%S')}")
        os.replace(directory, target)
        self.set_aside.append(str(target))

    def get(self, topic: str, queue_id: int) -> ConsumeQueue | None:
        return self.queues.get((topic, queue_id))

    def unmanaged(self, topic: str) -> str | None:
        """Why ``topic``'s queues are not this store's to answer for (``brokerlayout``), or None."""
        return unmanaged_reason(topic, self.batch_topics, self.rocksdb)

    def check_managed(self, topic: str) -> None:
        """A read of a queue this store does not manage raises instead of answering "empty"."""
        reason = unmanaged_reason(topic, self.batch_topics, self.rocksdb)
        if reason is not None:
            raise UnsupportedLayoutError(reason)

    def find_or_create(self, topic: str, queue_id: int) -> ConsumeQueue:
        queue = self.queues.get((topic, queue_id))
        if queue is None:
            with self._lock:
                queue = self.queues.get((topic, queue_id))
                if queue is None:
                    queue = ConsumeQueue(self.root, topic, queue_id, self.config, read_only=self.read_only,
                                         budget=self.budget)
                    self.queues[(topic, queue_id)] = queue
        return queue

    def recover(self) -> int:
        """Recover every queue; returns the largest ``max_physic_offset`` (-1 when there is none)."""
        best = -1
        for queue in self.queues.values():
            queue.recover()
            best = max(best, queue.max_physic_offset)
        return best

    def truncate_dirty(self, phy_offset: int) -> None:
        for queue in self.queues.values():
            if queue.max_physic_offset > phy_offset:
                queue.truncate_dirty(phy_offset)

    def truncate_lmq(self, phy_offset: int) -> None:
        """Cut a broker's LMQ queues where the log was cut, as RocketMQ's ``truncateDirtyLogicFiles`` cuts every
        queue: they are otherwise left alone, and units past the new end pointed at the records put there next
        (another topic's message, served to the LMQ's consumers by the broker). A damaged one is left as it is."""
        base = self.root / CONSUMEQUEUE_DIR
        for name in self.lmq_dirs:
            try:
                queue_ids = sorted(int(e.name) for e in os.scandir(base / name) if e.name.isdigit() and e.is_dir())
            except OSError:
                continue
            for queue_id in queue_ids:
                queue = ConsumeQueue(self.root, name, queue_id, self.config, budget=self.budget)
                try:
                    queue.load()
                    queue.recover()
                    if queue.max_physic_offset > phy_offset:
                        queue.truncate_dirty(phy_offset)
                        log.warning("LMQ queue %s-%d: units past the commit log's end %d cut", name, queue_id,
                                    phy_offset)
                except CorruptDataError as exc:
                    log.error("LMQ queue %s-%d is damaged (%s): left as it is", name, queue_id, exc)
                finally:
                    queue.close()

    def topics(self) -> list[str]:
        return sorted({topic for topic, _ in self.queues})

    # --- the queues' ends at a clean close ----------------------------------------------------

    def save_ends(self) -> None:
        """Write every queue's end (``QUEUE_ENDS_FILE``) at a clean close: the next open can then tell a queue that
        lost its last files (a deleted file or directory) from one that ends there, which the files alone cannot."""
        ends: dict[str, dict[str, int]] = {}
        for (topic, queue_id), queue in sorted(self.queues.items()):
            ends.setdefault(topic, {})[str(queue_id)] = queue.max_offset_in_queue
        replace_file(self.root / QUEUE_ENDS_FILE, json.dumps({"version": 1, "ends": ends}).encode())

    def saved_ends(self) -> dict[tuple[str, int], int]:
        """The ends the last clean close wrote; empty when there are none or they do not read (they only help)."""
        try:
            data = json.loads((self.root / QUEUE_ENDS_FILE).read_bytes())
            return {(topic, int(queue_id)): int(end) for topic, queues in data["ends"].items()
                    for queue_id, end in queues.items()}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("%s does not read (%s): queues that lost their last files are not found", QUEUE_ENDS_FILE,
                        exc)
            return {}

    def flush(self, least_pages: int = 0) -> None:
        for queue in list(self.queues.values()):
            queue.flush(least_pages)

    def close(self) -> None:
        for queue in self.queues.values():
            queue.close()

    def destroy_all(self) -> None:
        for queue in self.queues.values():
            queue.destroy()
        self.queues.clear()


"""The commit log: every message of every topic, appended to one run of segments.

Appends happen under one put lock, which assigns the physical offset, the per topic-queue
queue offset and the store timestamp together, so queue offsets grow with physical offsets.
A write is made crash-atomic by ordering: all bytes of a record (or a whole batch) except the
first 8 are copied first, then the first record's size and magic. The space past the write
position is always zero (segments are created zeroed and recovery zeroes torn tails), so a
process killed at any instant leaves either the complete append or nothing that decodes.
"""

from __future__ import annotations

import errno
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .codec.record import (
    BLANK_RECORD_LEN,
    MAGIC_V1,
    MAGIC_V2,
    PHY_OFFSET_POS,
    QUEUE_OFFSET_POS,
    RecordLayout,
    blank_record,
    decode_v4_at,
    message_from_layout,
    read_layout,
    seal_property_crc,
)
from .config import StoreConfig
from .encoder import PendingRecords
from .errors import (
    CorruptDataError,
    FlushError,
    MessageNotFoundError,
    MessageTooLargeError,
    OffsetOutOfRangeError,
    SegmentDeletedError,
    StoreIOError,
    TablePartlyStoredError,
)
from .health import StoreHealth
from .locks import YieldingLock
from .mapped.file import STAGING_DIR, MappedFile, deleted_under, reading
from .mapped.file_queue import MappedFileQueue
from .mapped.warm import WriteAheadWarmer
from .message import MessageExt

_I64 = struct.Struct(">q")
# From this many records an append stamps them with one compiled call (~2 us of array set-up) instead of
# three ``pack_into`` per record (~0.5 us each record).
_STAMP_MIN = 4


if TYPE_CHECKING:
    from .codec.batch_encode import EncodedBatch

COMMITLOG_DIR = "commitlog"


def now_ms() -> int:
    return time.time_ns() // 1_000_000


CLOCK_HORIZON_MS = 86_400_000  # a store time further ahead of the clock came from a wrong clock (as checkpoints)


def next_store_time(last: int) -> int:
    """The store time of the next put: never before the last one (time lookups bisect), unless the last one is
    more than ``CLOCK_HORIZON_MS`` ahead of the clock. Then the clock was wrong once and is right again: held to
    that time, every later message (after restarts too) was stamped with it until the clock caught up (one reading
    in 2100 pinned them for 76 years), found by no time-bounded query. RocketMQ stamps the clock as it is."""
    now = now_ms()
    return now if now >= last or last - now > CLOCK_HORIZON_MS else last


class CommitLog:
    """Append, read and scan the commit log of one store."""

    def __init__(self, root: Path, config: StoreConfig, *, read_only: bool = False,
                 health: StoreHealth | None = None) -> None:
        self.config = config
        self.read_only = read_only
        self.health = health or StoreHealth()
        self.directory = root / COMMITLOG_DIR
        self.mapped_files = MappedFileQueue(self.directory, config.mapped_file_size_commit_log,
                                            read_only=read_only, preallocate=config.preallocate,
                                            staging=root / STAGING_DIR)
        self.check_crc = config.check_crc_on_read  # get_message's, read once (the config is frozen)
        self.one_pass_reads = not (config.check_crc_on_read and config.force_verify_prop_crc)
        self.warmer: WriteAheadWarmer | None = None  # started by a writable store (start_warming)
        self.put_lock = YieldingLock()  # with put_lock.held(): producer threads wait by yielding the GIL (locks.py)
        # next queue offset of each (topic, queue id); rebuilt by recovery
        self.queue_offsets: dict[tuple[str, int], int] = {}
        self.last_store_timestamp = 0
        self.last_append: tuple[int, int] = (0, 0)  # (end offset, store time) of the newest record
        self._batch_limit = config.mapped_file_size_commit_log - BLANK_RECORD_LEN
        self._stamp_kernel = None

    def load(self) -> None:
        self.mapped_files.load()

    # --- offsets -----------------------------------------------------------------------------

    @property
    def min_offset(self) -> int:
        return self.mapped_files.min_offset()

    @property
    def max_offset(self) -> int:
        """The end of the readable log: every byte below it belongs to a complete record."""
        return self.mapped_files.max_offset()

    @property
    def flushed_offset(self) -> int:
        return self.mapped_files.flushed_where

    def roll_next_file_offset(self, phy_offset: int) -> int:
        size = self.config.mapped_file_size_commit_log
        return phy_offset + size - phy_offset % size

    # --- append ------------------------------------------------------------------------------

    def check_fits(self, total: int) -> None:
        """``MessageTooLargeError`` unless ``total`` bytes of records fit one segment (with its closing blank), as
        ``append`` needs: a put checks this before it creates any topic."""
        if total > self._batch_limit:
            raise MessageTooLargeError(
                f"batch of {total} bytes does not fit one {self.config.mapped_file_size_commit_log}-byte segment")

    def append(self, pending: PendingRecords) -> tuple[int, list[int], int]:
        """Append one put's records contiguously in one segment (``putMessage`` / ``putMessages``).

        Returns (physical offset of the first record, queue offset of each record, store time)."""
        data = pending.data
        total = len(data)
        if total > self._batch_limit:
            self.check_fits(total)
        seal = self.config.enabled_append_prop_crc
        with self.put_lock.held():
            store_ts = next_store_time(self.last_store_timestamp)
            try:
                mapped = self.mapped_files.last_for_write()
                if total + BLANK_RECORD_LEN > mapped.remaining:
                    mapped = self._roll(mapped)
            except FlushError as exc:  # a new segment whose name may not survive: nothing after it would
                self.health.fail_flush(exc)
                raise
            self.put_lock.io = mapped.writes_by_syscall(total)  # a pwrite gives the GIL away: waiters sleep
            pos = mapped.wrote_position
            first = mapped.file_from_offset + pos
            offsets = self.queue_offsets
            if len(pending.sizes) == 1:  # put_message: no bookkeeping of several records
                key = (pending.topics[0], pending.queue_ids[0])
                queue_offset = offsets.get(key, 0) if pending.takes_queue_offset[0] else 0
                pack = _I64.pack_into
                pack(data, QUEUE_OFFSET_POS, queue_offset)
                pack(data, PHY_OFFSET_POS, first)
                pack(data, pending.store_ts_pos[0], store_ts)
                if seal:
                    seal_property_crc(data, 0, total)
                self._commit(mapped, pos, data)
                if pending.takes_queue_offset[0]:
                    offsets[key] = queue_offset + 1
                self._appended(first + total, store_ts)
                return first, [queue_offset], store_ts
            assigned: dict[tuple[str, int], int] = {}
            queue_offsets = []
            for key, takes in zip(zip(pending.topics, pending.queue_ids, strict=True), pending.takes_queue_offset,
                                  strict=True):
                queue_offset = 0
                if takes:
                    queue_offset = assigned.get(key)
                    if queue_offset is None:
                        queue_offset = offsets.get(key, 0)
                    assigned[key] = queue_offset + 1
                queue_offsets.append(queue_offset)
            if len(queue_offsets) >= _STAMP_MIN and not seal:
                sizes = pending.size_array
                ts_pos = pending.store_ts_pos
                stamped = self._stamp(np.frombuffer(data, dtype=np.uint8),
                                      np.array(pending.sizes, dtype=np.int64) if sizes is None else sizes,
                                      ts_pos if isinstance(ts_pos, np.ndarray) else np.array(ts_pos, dtype=np.int64),
                                      np.array(queue_offsets, dtype=np.int64), first, store_ts)
                if stamped != total:  # sizes that do not add up to the data: a bug, never a torn record
                    raise AssertionError(f"stamped {stamped} bytes of a {total}-byte append")
            else:
                start = 0
                phy = first
                pack = _I64.pack_into
                for queue_offset, ts_pos, size in zip(queue_offsets, pending.store_ts_pos, pending.sizes, strict=True):
                    pack(data, start + QUEUE_OFFSET_POS, queue_offset)
                    pack(data, start + PHY_OFFSET_POS, phy)
                    pack(data, start + ts_pos, store_ts)
                    if seal:
                        seal_property_crc(data, start, size)
                    phy += size
                    start += size
            self._commit(mapped, pos, data)
            offsets.update(assigned)
            self._appended(first + total, store_ts)
        return first, queue_offsets, store_ts

    @staticmethod
    def _commit(mapped, pos: int, data: bytearray) -> None:
        """Everything but the first 8 bytes, then those 8 bytes: the commit point (a process killed between the
        two leaves a zero size, the end of the log, never half a record)."""
        view = memoryview(data)
        mapped.write(pos + 8, view[8:])
        mapped.write(pos, view[:8])
        mapped.wrote_position = pos + len(data)

    def _appended(self, end: int, store_ts: int) -> None:
        self.last_store_timestamp = store_ts
        self.last_append = (end, store_ts)
        if self.warmer is not None:
            self.warmer.nudge(end)

    def _stamp(self, data, sizes, store_ts_pos, queue_offsets, phy: int, store_ts: int) -> int:
        stamp = self._stamp_kernel
        if stamp is None:  # numba loads with the first put of several records, not with the CLI
            from .codec._kernels import stamp_records as stamp

            self._stamp_kernel = stamp
        return stamp(data, sizes, store_ts_pos, queue_offsets, phy, store_ts)

    def append_batch(self, batch: EncodedBatch) -> tuple[np.ndarray, np.ndarray, int]:
        """Append a table's records in row order (``put_batch``); returns (phy offsets, queue offsets, store time).

        A table that fits one segment is one crash-atomic append (first 8 bytes last), all or nothing, as
        ``append``; a larger one is one such append per segment, so a kill keeps a prefix of whole rows,
        never part of a record, and takes the blocks of all its segments first (a full disk refuses it whole,
        ``_reserve_for_parts``). Queue offsets come from one compiled grouping of the rows by queue; they, the
        physical offsets and the store time are stamped into the encoded bytes by one compiled pass per segment.
        """
        from .codec._kernels import queue_groups, stamp_records  # numba loads with the first batch, not the CLI

        n = len(batch)
        sizes = batch.sizes
        ends = np.cumsum(sizes)
        starts = ends - sizes
        data = np.frombuffer(batch.data, dtype=np.uint8)
        keys = (batch.topic_index.astype(np.int64) << 32) | batch.queue_ids.astype(np.int64)
        taking = None if batch.no_offset is None else ~batch.no_offset  # prepared/rolled-back rows take none
        group, rank, group_keys, counts = queue_groups(keys if taking is None else keys[taking])
        queues = [(batch.topics[key >> 32], key & 0xFFFFFFFF) for key in group_keys.tolist()]
        phys = np.empty(n, dtype=np.int64)
        with self.put_lock.held():
            self.put_lock.io = True  # tables of rows: pwrites (and rolls) that give the GIL away
            store_ts = next_store_time(self.last_store_timestamp)
            bases = np.array([self.queue_offsets.get(queue, 0) for queue in queues], dtype=np.int64)
            queue_offsets = bases[group] + rank  # consecutive per queue in row order, continuing each queue
            if taking is not None:
                taken, queue_offsets = queue_offsets, np.zeros(n, dtype=np.int64)
                queue_offsets[taking] = taken
            if int(ends[-1]) > self._batch_limit:  # written in parts: every block it needs first (all or nothing)
                self._reserve_for_parts(starts, ends)
            i = 0
            try:
                while i < n:
                    try:
                        mapped = self.mapped_files.last_for_write()
                    except FlushError as exc:
                        self.health.fail_flush(exc)
                        raise
                    base = int(starts[i])
                    rest = int(ends[-1]) - base
                    if rest + BLANK_RECORD_LEN <= mapped.remaining:
                        j = n  # everything left fits here: one append, all or nothing
                    elif rest <= self._batch_limit:
                        j = i  # it fits a fresh segment whole: roll rather than split it
                    else:
                        j = int(np.searchsorted(ends, base + mapped.remaining - BLANK_RECORD_LEN, side="right"))
                    if j <= i:  # close this segment
                        try:
                            self._roll(mapped)
                        except FlushError as exc:
                            self.health.fail_flush(exc)
                            raise
                        continue
                    pos = mapped.wrote_position
                    phys[i:j] = mapped.file_from_offset + pos + (starts[i:j] - base)
                    end = int(ends[j - 1])
                    stamped = stamp_records(data[base:end], sizes[i:j], batch.store_ts_pos[i:j], queue_offsets[i:j],
                                            mapped.file_from_offset + pos, store_ts)
                    if stamped != end - base:  # sizes that do not add up to the data: a bug, never a torn record
                        raise AssertionError(f"stamped {stamped} bytes of a {end - base}-byte append")
                    if self.config.enabled_append_prop_crc:
                        for k in range(i, j):
                            seal_property_crc(batch.data, int(starts[k]), int(sizes[k]))
                    chunk = memoryview(batch.data)
                    mapped.write(pos + 8, chunk[base + 8 : end])
                    mapped.write(pos, chunk[base : base + 8])  # the commit point
                    mapped.wrote_position = pos + end - base
                    if i == 0 and j == n:
                        self.queue_offsets.update(zip(queues, (bases + counts).tolist(), strict=True))
                    elif taking is None:  # one segment's rows of a split table
                        self._advance_queues(keys[i:j], queue_offsets[i:j], batch.topics)
                    else:
                        part = taking[i:j]
                        self._advance_queues(keys[i:j][part], queue_offsets[i:j][part], batch.topics)
                    self.last_store_timestamp = store_ts
                    self.last_append = (int(phys[j - 1] + sizes[j - 1]), store_ts)
                    i = j
            except StoreIOError as exc:
                if not i:
                    raise
                raise TablePartlyStoredError(
                    exc.errno or errno.EIO,
                    f"{exc.strerror or exc}; rows 0-{i - 1} of {n} are stored (written in parts, as a crash there "
                    f"would leave them) and the rest are not: put only rows {i}- again", i,
                    (phys[:i].copy(), queue_offsets[:i].copy(), store_ts)) from exc
            finally:
                self.mapped_files.discard_spares()
            if self.warmer is not None:
                self.warmer.nudge(self.last_append[0])
        return phys, queue_offsets, store_ts

    def _reserve_for_parts(self, starts: np.ndarray, ends: np.ndarray) -> None:
        """Reserve the blocks of the rest of the current segment and of every segment a table larger than one
        segment rolls into, before its first row: a full disk after a segment's worth of rows raised with those
        rows stored and visible, and a caller that put the table again stored them twice."""
        size = self.mapped_files.mapped_file_size
        last = self.mapped_files.last
        remaining = last.remaining if last is not None and not last.is_full() else 0
        rolls = 0 if remaining else 1
        remaining = remaining or size
        i, n = 0, len(ends)
        while i < n:  # the loop of ``append_batch``, without writing
            base = int(starts[i])
            rest = int(ends[-1]) - base
            if rest + BLANK_RECORD_LEN <= remaining:
                break
            j = i if rest <= self._batch_limit else int(
                np.searchsorted(ends, base + remaining - BLANK_RECORD_LEN, side="right"))
            if j <= i:
                rolls += 1
                remaining = size
                continue
            remaining -= int(ends[j - 1]) - base
            i = j
        if last is not None and not last.is_full():
            last.reserve(last.file_size)  # a sparse segment (preallocate off, or a broker's)
        self.mapped_files.reserve_spares(rolls)

    def _advance_queues(self, keys: np.ndarray, queue_offsets: np.ndarray, topics: list[str]) -> None:
        last_keys, last_rows = np.unique(keys[::-1], return_index=True)
        for key, row in zip(last_keys.tolist(), (len(keys) - 1 - last_rows).tolist(), strict=True):
            self.queue_offsets[(topics[key >> 32], key & 0xFFFFFFFF)] = int(queue_offsets[row]) + 1

    def _roll(self, mapped: MappedFile) -> MappedFile:
        """Close ``mapped`` with a BLANK record and start the next segment.

        The new segment is created first, so a failure (disk full) leaves the log unchanged; a BLANK that cannot
        be written takes it back (a segment after an unclosed one is a torn tail to recovery: every message put
        into it after the failure was set aside at the next open).
        """
        self.put_lock.io = True  # creating and fsyncing a segment: waiters sleep
        nxt = self.mapped_files.create_file(mapped.file_end_offset)
        pos = mapped.wrote_position
        try:
            mapped.write(pos, blank_record(mapped.file_size - pos))
        except BaseException:
            self.mapped_files.drop_last(nxt)
            raise
        mapped.wrote_position = mapped.file_size
        mapped.seal()
        return nxt

    # --- read --------------------------------------------------------------------------------

    def locate(self, phy_offset: int, *, check_crc: bool | None = None) -> tuple[MappedFile, int, RecordLayout]:
        """Find and validate the record starting at ``phy_offset``.

        Unlike RocketMQ, the offset must be a record start (its PHYSICALOFFSET field must agree),
        so a wrong offset is an error rather than garbage. Raises ``OffsetOutOfRangeError``,
        ``MessageNotFoundError`` or a ``CorruptDataError``.
        """
        if not isinstance(phy_offset, int) or isinstance(phy_offset, bool):
            raise OffsetOutOfRangeError(f"commit-log offset must be an integer, not {phy_offset!r}")
        low, high = self.min_offset, self.max_offset
        if not low <= phy_offset < high:
            raise OffsetOutOfRangeError(f"commit-log offset {phy_offset} is outside [{low}, {high})")
        mapped = self.mapped_files.find(phy_offset)
        if mapped is None:
            raise OffsetOutOfRangeError(f"no segment holds commit-log offset {phy_offset}")
        pos = phy_offset - mapped.file_from_offset
        check = self.config.check_crc_on_read if check_crc is None else check_crc
        try:
            return self._validated(mapped, pos, phy_offset, check)
        except ValueError as exc:
            raise deleted_under(mapped, exc) from None

    def _validated(self, mapped: MappedFile, pos: int, phy_offset: int,
                   check: bool) -> tuple[MappedFile, int, RecordLayout]:
        try:
            layout = read_layout(mapped.buffer, pos, mapped.wrote_position, check_crc=check,
                                 verify_prop_crc=check and self.config.force_verify_prop_crc,
                                 path=mapped.path_text, base=mapped.file_from_offset)
        except CorruptDataError:
            if self._stored_phy_offset(mapped, pos) == phy_offset:
                raise  # a record starts here and it is damaged
            raise MessageNotFoundError(f"commit-log offset {phy_offset} is not the start of a message") from None
        if layout is None:
            raise MessageNotFoundError(f"commit-log offset {phy_offset} is the end-of-segment blank record")
        stored = self._stored_phy_offset(mapped, pos)
        if stored != phy_offset:
            raise MessageNotFoundError(
                f"commit-log offset {phy_offset} is not the start of a message (the record there says {stored})")
        return mapped, pos, layout

    @staticmethod
    def _stored_phy_offset(mapped: MappedFile, pos: int) -> int | None:
        raw = mapped.buffer[pos + PHY_OFFSET_POS : pos + PHY_OFFSET_POS + 8]
        return int.from_bytes(raw, "big", signed=True) if len(raw) == 8 else None

    def record_store_time(self, phy_offset: int) -> int:
        """``store_time`` of a record known to start at ``phy_offset`` (its magic code and PHYSICALOFFSET field
        say so), or -1: what a damaged header is corrected from must not be bytes from the middle of a record."""
        return self.store_time(phy_offset, checked=True)

    def store_time(self, phy_offset: int, size: int = 0, *, checked: bool = False) -> int:
        """Store timestamp of the record at ``phy_offset``, or -1 if it is outside the log (``getStoreTime``)."""
        if phy_offset < self.min_offset or phy_offset + max(size, 0) > self.max_offset:
            return -1
        mapped = self.mapped_files.find(phy_offset)
        if mapped is None:
            return -1
        pos = phy_offset - mapped.file_from_offset
        if pos + 64 > mapped.file_size:
            return -1
        try:
            with reading(mapped):
                buf = mapped.buffer
                if checked and (int.from_bytes(buf[pos + 4 : pos + 8], "big", signed=True) not in (MAGIC_V1, MAGIC_V2)
                                or int.from_bytes(buf[pos + PHY_OFFSET_POS : pos + PHY_OFFSET_POS + 8], "big",
                                                  signed=True) != phy_offset):
                    return -1
                sys_flag = int.from_bytes(buf[pos + 36 : pos + 40], "big", signed=True)
                ts_pos = pos + 48 + (20 if sys_flag & 0x10 else 8)
                return int.from_bytes(buf[ts_pos : ts_pos + 8], "big", signed=True)
        except SegmentDeletedError:
            return -1

    def get_message(self, phy_offset: int, *, decompress: bool = False, read_body: bool = True) -> MessageExt:
        mapped = self.mapped_files.find(phy_offset) if type(phy_offset) is int else None
        if mapped is not None and not decompress and self.one_pass_reads:
            try:  # the common record in one pass; anything else (and every error) goes through locate
                msg = decode_v4_at(mapped.buffer, phy_offset - mapped.file_from_offset, mapped.wrote_position,
                                   phy_offset, check_crc=self.check_crc, read_body=read_body)
            except ValueError as exc:
                raise deleted_under(mapped, exc) from None
            if msg is not None:
                return msg
        mapped, pos, layout = self.locate(phy_offset)
        try:
            return message_from_layout(mapped.buffer, pos, layout, read_body=read_body, decompress=decompress,
                                       max_body_size=max(self.config.max_message_size, 64 << 20),
                                       path=mapped.path_text, base=mapped.file_from_offset)
        except ValueError as exc:  # a try costs nothing on the hot path; a context manager ~1 us
            raise deleted_under(mapped, exc) from None

    def get_record_bytes(self, phy_offset: int) -> bytes:
        """The raw record (``selectOneMessageByOffset``)."""
        mapped, pos, layout = self.locate(phy_offset)
        with reading(mapped):
            return mapped.read(pos, layout.size)

    def check_record_start(self, phy_offset: int) -> None:
        """``MessageNotFoundError`` unless a record (sound or damaged) or a segment's closing blank starts at
        ``phy_offset``, an offset inside the log: where a walk such as ``iter_messages`` may begin."""
        mapped = self.mapped_files.find(phy_offset)
        if mapped is None:
            raise OffsetOutOfRangeError(f"no segment holds commit-log offset {phy_offset}")
        pos = phy_offset - mapped.file_from_offset
        try:
            with reading(mapped):
                try:
                    if read_layout(mapped.buffer, pos, mapped.wrote_position) is None:
                        return  # the blank that closes a segment: a walk steps over it
                except CorruptDataError:
                    pass  # a damaged record starts here (the walk names the damage), or none does
                if self._stored_phy_offset(mapped, pos) == phy_offset:
                    return
        except ValueError as exc:
            raise deleted_under(mapped, exc) from None
        raise MessageNotFoundError(f"commit-log offset {phy_offset} is not the start of a record (it lies inside "
                                   f"one): a walk of the log begins at a record start")

    def iter_messages(self, from_offset: int | None = None, to_offset: int | None = None, *,
                      check_crc: bool | None = None, read_body: bool = True) -> Iterator[MessageExt]:
        """Decode records in log order from ``from_offset`` (a record start) to ``to_offset``.

        Raises ``CorruptDataError`` on a record that does not decode, instead of ending silently, after
        yielding every record before it. The batch codec's compiled walk finds and checks the records (CRCs
        included) a few thousand at a time; each message is then built from one unpack of its fixed bytes
        (IPv6 hosts: the record codec's general form). ``iter_layouts`` is the record-at-a-time walk.
        """
        from .codec.batch import scan_records

        check = self.config.check_crc_on_read if check_crc is None else check_crc
        for run in scan_records(self, from_offset, to_offset, check_crc=check):
            mapped, limit = run.mapped, run.limit
            buf = mapped.buffer
            for pos, phy in zip(run.starts, run.phy_offsets, strict=True):
                try:
                    msg = decode_v4_at(buf, pos, limit, phy, check_crc=False, read_body=read_body)
                    if msg is None:  # not two IPv4 hosts
                        path, base = str(mapped.path), mapped.file_from_offset
                        layout = read_layout(buf, pos, limit, path=path, base=base)
                        assert layout is not None  # the walk accepted a record here
                        msg = message_from_layout(buf, pos, layout, read_body=read_body, path=path, base=base)
                except ValueError as exc:  # "mmap closed": retention deleted the segment between two records
                    raise deleted_under(mapped, exc) from None
                yield msg

    def iter_layouts(self, from_offset: int | None = None, to_offset: int | None = None, *,
                     check_crc: bool | None = None) -> Iterator[tuple[MappedFile, int, RecordLayout]]:
        check = self.config.check_crc_on_read if check_crc is None else check_crc
        end = self.max_offset if to_offset is None else min(to_offset, self.max_offset)
        offset = self.min_offset if from_offset is None else max(from_offset, self.min_offset)
        while offset < end:
            mapped = self.mapped_files.find(offset)
            if mapped is None:
                return
            pos = offset - mapped.file_from_offset
            limit = mapped.wrote_position
            buf = mapped.buffer
            while pos < limit and mapped.file_from_offset + pos < end:
                layout = read_layout(buf, pos, limit if limit < mapped.file_size else mapped.file_size,
                                     check_crc=check, path=str(mapped.path), base=mapped.file_from_offset)
                if layout is None:
                    break
                yield mapped, pos, layout
                pos += layout.size
            offset = mapped.file_end_offset

    def start_warming(self, ahead: int) -> None:
        """Fault the pages ahead of the write position in from a background thread (``mapped/warm.py``)."""
        if ahead > 0 and not self.read_only and self.warmer is None:
            self.warmer = WriteAheadWarmer(self.mapped_files, ahead)  # the first append wakes it: an open that
            self.warmer.start()  # writes nothing faults nothing in

    def close(self) -> None:
        if self.warmer is not None:  # it uses the newest mapping: stopped before anything is unmapped
            self.warmer.stop()
        with self.put_lock.held():  # no append is inside a segment while its descriptor closes
            self.put_lock.io = True
            self.mapped_files.close()

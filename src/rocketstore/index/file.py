"""One hash-index file (RocketMQ's ``IndexFile`` + ``IndexHeader``), byte-identical to RocketMQ's.

Layout (big-endian; S = hash slots, N = index entries; 420,000,040 bytes with the defaults)::

    header   0 beginTimestamp i64   8 endTimestamp i64   16 beginPhyOffset i64   24 endPhyOffset i64
             32 hashSlotCount i32 (slots in use)         36 indexCount i32 (next entry number)
    slots    40 + slot*4, slot in [0, S): i32 number of the newest entry in the slot (0 = empty)
    entries  40 + S*4 + n*20, n in [1, N): keyHash i32 | phyOffset i64 | timeDiff i32 (s) | prevIndex i32

Entry 0 is never used: the in-memory index count starts at 1, so a file holds N-1 entries.
``keyHash`` is ``|String.hashCode(topic#key)|`` (MIN_VALUE -> 0); ``timeDiff`` is seconds since
``beginTimestamp``, truncated. Only the 32-bit hash is stored, so a lookup returns the offsets of
every key sharing that hash: callers that need exact answers must read the records and compare
keys (``MessageStore.query_message`` does).

RocketMQ's quirks are reproduced on purpose: a file created by rollover inherits the previous
file's end offset and time, its first entry's timeDiff is computed against that inherited
begin time before begin is overwritten, and a walk stops at the first entry older than
``begin``. Header writes go straight to the mapping as in Java; ``flush`` rewrites all six.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

from ..codec.hashing import index_key_hash
from ..errors import CorruptDataError, FlushError, StoreIOError
from ..mapped.file import RESERVE_STEP, close_mapping, create_file_atomically, msync, reserve_blocks, unlink_path

INDEX_HEADER_SIZE = 40
HASH_SLOT_SIZE = 4
INDEX_ENTRY_SIZE = 20
INVALID_INDEX = 0
INT_MAX = (1 << 31) - 1

HEADER_FMT = ">qqqqii"
ENTRY_FMT = ">iqii"  # keyHash, phyOffset, timeDiff, prevIndex
_HEADER = struct.Struct(HEADER_FMT)
# madvise(MADV_POPULATE_WRITE), Linux 5.14+ (Python 3.11's mmap module has no name for it)
_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_ENTRY = struct.Struct(ENTRY_FMT)
_I32 = struct.Struct(">i")
_I64 = struct.Struct(">q")
assert _HEADER.size == INDEX_HEADER_SIZE and _ENTRY.size == INDEX_ENTRY_SIZE

_BEGIN_TS, _END_TS, _BEGIN_PHY, _END_PHY, _SLOT_COUNT, _INDEX_COUNT = 0, 8, 16, 24, 32, 36


def index_file_size(hash_slot_num: int, index_num: int) -> int:
    return INDEX_HEADER_SIZE + hash_slot_num * HASH_SLOT_SIZE + index_num * INDEX_ENTRY_SIZE


class IndexFile:
    """A mapped index file. Create with ``IndexFile.create``, reopen with ``IndexFile.open``."""

    def __init__(self, path: Path, hash_slot_num: int, index_num: int, mm: mmap.mmap, read_only: bool) -> None:
        self.path = Path(path)
        self.hash_slot_num = hash_slot_num
        self.index_num = index_num
        self.read_only = read_only
        self._mm: mmap.mmap | None = mm
        self._array = None  # the mapping as a read-only numpy array, made on the first compiled walk
        self._entries_at = INDEX_HEADER_SIZE + hash_slot_num * HASH_SLOT_SIZE
        self.reserved_to = 0  # blocks known allocated below this (``reserve``)
        (self.begin_timestamp, self.end_timestamp, self.begin_phy_offset, self.end_phy_offset,
         self.hash_slot_count, self.index_count) = _HEADER.unpack_from(mm, 0)
        if self.index_count <= 0:
            self.index_count = 1
        if self.index_count > index_num or self.hash_slot_count < 0:
            self.close()
            raise CorruptDataError(f"index header holds impossible counts (indexCount {self.index_count}, "
                                   f"hashSlotCount {self.hash_slot_count}, {index_num} entries)", str(path))

    @staticmethod
    def _check_geometry(hash_slot_num: int, index_num: int) -> None:
        if not (0 < hash_slot_num <= INT_MAX // HASH_SLOT_SIZE and 1 < index_num <= INT_MAX // INDEX_ENTRY_SIZE):
            raise ValueError(f"bad index geometry: {hash_slot_num} slots, {index_num} entries")

    @classmethod
    def create(cls, path: str | Path, hash_slot_num: int, index_num: int, end_phy_offset: int = 0,
               end_timestamp: int = 0, *, preallocate: bool = False, staging: Path | None = None) -> IndexFile:
        """A new zero-filled file; a file that continues a full one inherits its end offset and time, written
        before the file gets its name: a roll killed before the header was written left a newest file that said it
        started at offset 0, and the next open indexed the whole log into it again (every key twice).

        ``preallocate`` reserves the blocks up front, so a full disk fails here and not later as a
        SIGBUS on a write into the mapping.
        """
        cls._check_geometry(hash_slot_num, index_num)
        path = Path(path)
        size = index_file_size(hash_slot_num, index_num)
        begin_phy, begin_ts = max(0, end_phy_offset), max(0, end_timestamp)
        head = _HEADER.pack(begin_ts, begin_ts, begin_phy, begin_phy, 0, 0) if begin_phy or begin_ts else b""
        try:
            create_file_atomically(path, size, preallocate=preallocate, staging=staging, head=head)
        except OSError as exc:
            raise StoreIOError(exc.errno, f"cannot create index file {path}: {exc.strerror}") from exc
        try:
            fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
            try:
                mm = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE)
            finally:
                os.close(fd)  # the mapping holds its own descriptor: one per index file, not two
        except OSError as exc:
            # made but not mapped (no descriptor left, no address space): it goes again. Left, the dispatcher's
            # retries each made another full-size file beside it, 14 (561 MB) in a second (the fd review)
            with contextlib.suppress(OSError):
                path.unlink()
            raise StoreIOError(exc.errno, f"cannot map index file {path}: {exc.strerror}") from exc
        created = cls(path, hash_slot_num, index_num, mm, read_only=False)
        if preallocate:
            created.reserved_to = size
            _populate(mm, INDEX_HEADER_SIZE + hash_slot_num * HASH_SLOT_SIZE)
        else:  # sparse: the slots now (keys land anywhere in them), the entries as they are appended
            try:
                created.reserve(created._entries_at)
            except StoreIOError:
                created.destroy()
                raise
        return created

    def reserve(self, end: int) -> None:
        """Blocks for the file below ``end`` before a store into its mapping there (``RESERVE_STEP`` of entries at a
        time): a store into a hole of a sparse file (a broker's, or made with preallocate off) on a full disk is a
        SIGBUS that kills the process; reserved first, it is a ``StoreIOError`` (ENOSPC) instead."""
        if end <= self.reserved_to:
            return
        size = len(self.buffer)
        stop = min(size, max(end, self.reserved_to + RESERVE_STEP))
        self.reserved_to = size if reserve_blocks(self.path, stop, self.reserved_to) else stop

    def reserve_entries(self, count: int) -> None:
        """``reserve`` for the header, the slots and the first ``count`` entries."""
        self.reserve(self._entries_at + count * INDEX_ENTRY_SIZE)

    @classmethod
    def open(cls, path: str | Path, hash_slot_num: int, index_num: int, *, read_only: bool = False) -> IndexFile:
        """Map an existing file; its size must match the geometry (else ``CorruptDataError``)."""
        cls._check_geometry(hash_slot_num, index_num)
        path = Path(path)
        size = index_file_size(hash_slot_num, index_num)
        try:
            fd = os.open(path, (os.O_RDONLY if read_only else os.O_RDWR) | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise StoreIOError(exc.errno, f"cannot open index file {path}: {exc.strerror}") from exc
        try:
            actual = os.fstat(fd).st_size
            if actual != size:
                raise CorruptDataError(f"index file is {actual} bytes; {hash_slot_num} slots and {index_num} "
                                       f"entries need {size}", str(path))
            mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ if read_only else mmap.ACCESS_WRITE)
        finally:
            os.close(fd)  # the mapping holds its own descriptor: one per index file, not two
        return cls(path, hash_slot_num, index_num, mm, read_only)

    # --- header -------------------------------------------------------------------------------

    @property
    def buffer(self) -> mmap.mmap:
        if self._mm is None:
            raise StoreIOError(9, f"index file {self.path} is closed")
        return self._mm

    @property
    def array(self):
        """The mapping as one read-only ``uint8`` array for the compiled walks, kept across calls (making one
        is a third of a single-key lookup) and dropped by ``close``. A walk running while the file closes
        keeps its own reference: the mapping then goes when that walk ends."""
        array = self._array
        if array is None:
            from ..codec.batch import as_array

            array = self._array = as_array(self.buffer)
        return array

    _FIELD_NAMES: ClassVar[dict[int, str]] = {_BEGIN_TS: "begin_timestamp", _END_TS: "end_timestamp",
                                              _BEGIN_PHY: "begin_phy_offset", _END_PHY: "end_phy_offset"}

    def _set_i64(self, pos: int, value: int) -> None:
        setattr(self, self._FIELD_NAMES[pos], value)
        _I64.pack_into(self.buffer, pos, value)

    def is_write_full(self) -> bool:
        return self.index_count >= self.index_num

    def is_time_matched(self, begin: int, end: int) -> bool:
        """Whether [begin, end] overlaps the file's [beginTimestamp, endTimestamp] (``isTimeMatched``)."""
        b, e = self.begin_timestamp, self.end_timestamp
        return (begin < b and end > e) or (b <= begin <= e) or (b <= end <= e)

    # --- put and select ----------------------------------------------------------------------

    def slot_of(self, key: str) -> tuple[int, int]:
        key_hash = index_key_hash(key)
        return key_hash, key_hash % self.hash_slot_num

    def put_key(self, key: str, phy_offset: int, store_timestamp: int) -> bool:
        """Add one entry (``putKey``); False when the file is full."""
        key_hash, slot = self.slot_of(key)
        return self.put_hash(key_hash, slot, phy_offset, store_timestamp)

    def put_hash(self, key_hash: int, slot: int, phy_offset: int, store_timestamp: int) -> bool:
        count = self.index_count
        if count >= self.index_num:
            return False
        self.reserve_entries(count + 1)
        buf = self.buffer
        slot_pos = INDEX_HEADER_SIZE + slot * HASH_SLOT_SIZE
        slot_value = _I32.unpack_from(buf, slot_pos)[0]
        if slot_value <= INVALID_INDEX or slot_value > count:
            slot_value = INVALID_INDEX
        time_diff = 0
        if self.begin_timestamp > 0:
            diff = store_timestamp - self.begin_timestamp
            time_diff = 0 if diff < 0 else min(diff // 1000, INT_MAX)
        _ENTRY.pack_into(buf, self._entries_at + count * INDEX_ENTRY_SIZE, key_hash, phy_offset, time_diff, slot_value)
        _I32.pack_into(buf, slot_pos, count)
        if count <= 1:
            self._set_i64(_BEGIN_PHY, phy_offset)
            self._set_i64(_BEGIN_TS, store_timestamp)
        if slot_value == INVALID_INDEX:
            self.hash_slot_count += 1
            _I32.pack_into(buf, _SLOT_COUNT, self.hash_slot_count)
        self._set_i64(_END_PHY, phy_offset)  # before the count: a reader that sees the entry sees its time
        self._set_i64(_END_TS, store_timestamp)
        self.index_count = count + 1
        _I32.pack_into(buf, _INDEX_COUNT, self.index_count)
        return True

    def select_phy_offsets(self, key: str, max_num: int, begin: int, end: int,
                           into: list[int] | None = None) -> list[int]:
        """Offsets of entries whose hash equals the key's, newest first (``selectPhyOffset``).

        ``into`` is the list shared across files by a multi-file query; ``max_num`` caps its length.
        """
        result = [] if into is None else into
        if len(result) >= max_num:
            return result
        key_hash, slot = self.slot_of(key)
        for hash_read, phy, time_read in self._walk(slot, begin):
            if hash_read == key_hash and begin <= time_read <= end:
                result.append(phy)
            if len(result) >= max_num:
                break
        return result

    def _walk(self, slot: int, begin: int) -> Iterator[tuple[int, int, int]]:
        """(keyHash, phyOffset, decoded time) of each entry of a slot's chain, with RocketMQ's stop rules."""
        buf = self.buffer
        count = self.index_count
        n = _I32.unpack_from(buf, INDEX_HEADER_SIZE + slot * HASH_SLOT_SIZE)[0]
        while count < n < self.index_num:  # a live writer's newer entry (or a torn one): back to what count covers
            prev = _ENTRY.unpack_from(buf, self._entries_at + n * INDEX_ENTRY_SIZE)[3]  # (the kernels' _chain_head)
            if prev <= INVALID_INDEX or prev >= n:
                return
            n = prev
        if n <= INVALID_INDEX or n > count or count <= 1:
            return
        begin_ts = self.begin_timestamp
        for _ in range(count):  # a chain visits each entry at most once; the bound survives a corrupt file
            if n >= self.index_num:
                return
            hash_read, phy_read, time_diff, prev = _ENTRY.unpack_from(buf, self._entries_at + n * INDEX_ENTRY_SIZE)
            if time_diff < 0:
                return
            time_read = begin_ts + time_diff * 1000
            yield hash_read, phy_read, time_read
            if prev <= INVALID_INDEX or prev > count or prev == n or time_read < begin:
                return
            n = prev

    def entry(self, n: int) -> tuple[int, int, int, int]:
        """Entry ``n`` as (keyHash, phyOffset, timeDiff, prevIndex)."""
        return _ENTRY.unpack_from(self.buffer, self._entries_at + n * INDEX_ENTRY_SIZE)

    # --- durability --------------------------------------------------------------------------

    def write_header(self) -> None:
        """``IndexHeader.updateByteBuffer``: all six fields from memory."""
        _HEADER.pack_into(self.buffer, 0, self.begin_timestamp, self.end_timestamp, self.begin_phy_offset,
                          self.end_phy_offset, self.hash_slot_count, self.index_count)

    def flush(self) -> None:
        if self.read_only or self._mm is None:
            return
        self.write_header()
        try:
            msync(self._mm, 0, len(self._mm))  # the GIL is released: puts go on while 420 MB are synced
        except OSError as exc:
            raise FlushError(exc.errno, f"msync of {self.path} failed: {exc.strerror}") from exc

    def close(self) -> None:
        self._array = None  # the view would keep the mapping from closing
        close_mapping(self._mm, -1)
        self._mm = None

    def destroy(self) -> None:
        self.close()
        unlink_path(self.path)

    def __repr__(self) -> str:
        return (f"IndexFile({self.path.name}, entries={self.index_count - 1}/{self.index_num - 1}, "
                f"time=[{self.begin_timestamp}, {self.end_timestamp}], phy=[{self.begin_phy_offset}, "
                f"{self.end_phy_offset}])")


def _populate(mm: mmap.mmap, length: int) -> None:
    """Map in the header and hash slots of a new file now. Keys land in random slots, so the first ~5,000
    entries of a file each took a page fault of its own in dispatch (a fifth of the index's share of the first
    200,000 messages); populating the 20 MB at once, with the blocks already reserved, is one call here.
    Where the kernel does not know the advice, the faults happen as before."""
    with contextlib.suppress(OSError, ValueError):
        mm.madvise(_POPULATE_WRITE, 0, min(len(mm), length))

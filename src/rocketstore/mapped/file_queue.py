"""An ordered run of segments forming one log (RocketMQ's ``MappedFileQueue``).

Used by the commit log and by each consume queue. Segment ``k`` starts where segment ``k-1``
ends; offsets are global byte positions in the log.
"""

from __future__ import annotations

import bisect
import errno
import logging
import os
from collections.abc import Callable
from pathlib import Path

from ..errors import CorruptDataError, FlushError, StoreIOError
from .file import (
    COPY_LIMIT,
    FileBudget,
    MappedFile,
    SpareFile,
    destroy_all,
    fsync_dir,
    parse_segment_name,
    segment_name,
    unlink_again,
)

log = logging.getLogger(__name__)


class MappedFileQueue:
    """The segments of one log directory, sorted by start offset."""

    def __init__(self, directory: Path, mapped_file_size: int, *, read_only: bool = False,
                 preallocate: bool = True, staging: Path | None = None, budget: FileBudget | None = None) -> None:
        self.directory = directory
        self.staging = staging  # where new segments are prepared if the file system lacks O_TMPFILE
        self.budget = budget  # bounds how many of these files (with others) stay mapped
        self.mapped_file_size = mapped_file_size
        self.read_only = read_only
        self.preallocate = preallocate
        self.files: list[MappedFile] = []
        self.foreign: list[str] = []  # names in the directory that are not segments (not loaded)
        self._starts: list[int] = []
        self.flushed_where = 0
        self.undeleted: list[Path] = []  # segments retention gave up but could not unlink: tried again
        self.spares: list[SpareFile] = []  # blocks reserved for the next segments (``reserve_spares``)
        self.copy_limit = COPY_LIMIT  # each file's (MappedFile.write): raised while a warmer works ahead

    def set_copy_limit(self, limit: int) -> None:
        """The largest write copied into a mapping rather than pwritten, for every file now and to come."""
        self.copy_limit = limit
        for mapped in self.files:
            mapped.copy_limit = limit

    def load(self, keep_prefix: bool = False) -> CorruptDataError | None:
        """Map every segment. A zero-length *last* file (a crash during creation) is removed.

        Any other size mismatch or a gap between segments is corruption: raised, or with ``keep_prefix``
        returned, the segments before it kept (a read-only queue serves what is intact)."""
        try:
            self._load()
        except CorruptDataError as exc:
            if not keep_prefix:
                raise
            self._starts = [f.file_from_offset for f in self.files]
            return exc
        return None

    def _load(self) -> None:
        self.foreign = []
        if not self.directory.is_dir():
            return
        names = []
        for entry in os.scandir(self.directory):
            if entry.name.endswith(".tmp"):  # an allocation interrupted by a crash (rocketstore before O_TMPFILE)
                if not self.read_only:
                    os.unlink(entry.path)
                continue
            if parse_segment_name(entry.name) is None or entry.is_dir():
                self.foreign.append(entry.name)  # left alone, but said: RocketMQ would load a number as a segment
                continue
            names.append(entry.name)
        names.sort()
        for i, name in enumerate(names):
            path = self.directory / name
            try:
                size = path.stat().st_size
                if size == 0 and i == len(names) - 1:
                    if not self.read_only:
                        path.unlink()
                    continue
                if size != self.mapped_file_size:
                    raise CorruptDataError(
                        f"segment is {size} bytes but the configured size is {self.mapped_file_size}", str(path))
                mapped = MappedFile(path, self.mapped_file_size, read_only=self.read_only, budget=self.budget)
            except (FileNotFoundError, StoreIOError) as exc:
                if not self.read_only or exc.errno != errno.ENOENT:
                    if isinstance(exc, StoreIOError):
                        raise
                    raise StoreIOError(exc.errno, f"cannot read segment {path}: {exc.strerror}") from exc
                # a live writer's retention deleted it since the listing, and every older one before it: what was
                # mapped of those is dropped too (the log starts after them now)
                for gone in self.files:
                    gone.close()
                self.files = []
                continue
            if self.files and mapped.file_from_offset != self.files[-1].file_end_offset:
                mapped.close()
                raise CorruptDataError(
                    f"segment does not start where {self.files[-1].path.name} ends (a segment is missing)",
                    str(path))
            mapped.wrote_position = mapped.flushed_position = self.mapped_file_size
            mapped.copy_limit = self.copy_limit
            if self.files:
                self.files[-1].seal()  # only the last is written: one descriptor for each of the others
            self.files.append(mapped)
        self._starts = [f.file_from_offset for f in self.files]

    # --- lookup ------------------------------------------------------------------------------

    @property
    def last(self) -> MappedFile | None:
        return self.files[-1] if self.files else None

    @property
    def first(self) -> MappedFile | None:
        return self.files[0] if self.files else None

    def min_offset(self) -> int:
        return self.files[0].file_from_offset if self.files else 0

    def max_offset(self) -> int:
        last = self.last
        return last.file_from_offset + last.wrote_position if last else 0

    def find(self, offset: int) -> MappedFile | None:
        """The segment holding ``offset``, or None.

        ``_starts`` and ``files`` are replaced one after the other when segments go (retention, truncation): a
        read between the two found a later segment for an offset, or none past the list's end. A file that does
        not hold ``offset`` means the lists moved under this read: the files alone then answer."""
        i = bisect.bisect_right(self._starts, offset) - 1
        if i < 0:
            return None
        files = self.files
        if i < len(files):
            mapped = files[i]
            if mapped.file_from_offset <= offset < mapped.file_end_offset:
                return mapped
        starts = [mapped.file_from_offset for mapped in files]
        i = bisect.bisect_right(starts, offset) - 1
        return files[i] if i >= 0 and offset < files[i].file_end_offset else None

    def index_of(self, mapped: MappedFile) -> int:
        return bisect.bisect_left(self._starts, mapped.file_from_offset)

    # --- growth ------------------------------------------------------------------------------

    def create_file(self, start_offset: int) -> MappedFile:
        """Append a new segment starting at ``start_offset`` (which must continue the log)."""
        if self.read_only:
            raise StoreIOError(30, f"cannot create a segment in read-only {self.directory}")
        if start_offset % self.mapped_file_size:
            raise CorruptDataError(f"segment start {start_offset} is not a multiple of the segment size",
                                   str(self.directory))
        if self.files and start_offset != self.files[-1].file_end_offset:
            raise CorruptDataError(f"segment start {start_offset} does not continue the log", str(self.directory))
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a file where the directory (or one above it) should be
            what = "it or a directory above it is not a directory" if isinstance(
                exc, FileExistsError | NotADirectoryError) else exc.strerror
            raise StoreIOError(exc.errno, f"cannot create {self.directory}: {what}") from exc
        spare = self.spares.pop(0) if self.spares else None
        mapped = MappedFile.create(self.directory / segment_name(start_offset), self.mapped_file_size,
                                   preallocate=self.preallocate, staging=self.staging, budget=self.budget,
                                   spare=spare)
        mapped.copy_limit = self.copy_limit
        self.files.append(mapped)
        self._starts.append(start_offset)
        return mapped

    def drop_last(self, mapped: MappedFile) -> None:
        """Take back the segment ``create_file`` just appended (nothing written in it) when the roll that made it
        failed: a segment after one that is not closed by a BLANK is a torn tail to recovery, which sets it and
        every later one aside, acknowledged messages included."""
        assert self.files and self.files[-1] is mapped, "only the newest, empty segment can be taken back"
        self.files.pop()
        self._starts.pop()
        try:
            mapped.destroy()
            fsync_dir(self.directory)
        except OSError as exc:  # left on disk: empty, after the log's end, the next roll's own name again
            log.error("could not remove %s, made by a roll that failed: %s", mapped.path, exc)

    def reserve_spares(self, count: int) -> None:
        """Reserve the blocks of the next ``count`` segments now (``SpareFile``); the rolls that follow take them.
        A full disk raises ``StoreIOError`` here with nothing reserved and nothing in the log changed."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            while len(self.spares) < count:
                self.spares.append(SpareFile(self.directory, self.mapped_file_size, self.staging))
        except OSError as exc:
            self.discard_spares()
            if isinstance(exc, StoreIOError):
                raise
            raise StoreIOError(exc.errno, f"cannot create {self.directory}: {exc.strerror}") from exc

    def discard_spares(self) -> None:
        for spare in self.spares:
            spare.discard()
        self.spares = []

    def last_for_write(self, start_if_empty: int = 0) -> MappedFile:
        """The segment to append to: the last one, or a new one if there is none or it is full."""
        last = self.last
        if last is None:
            return self.create_file(start_if_empty - start_if_empty % self.mapped_file_size)
        if last.is_full():
            last.seal()
            return self.create_file(last.file_end_offset)
        return last

    # --- durability --------------------------------------------------------------------------

    def flush(self, least_pages: int = 0) -> int:
        """Flush from ``flushed_where`` on; returns the new flushed offset.

        Retention may delete a segment before it was flushed (``immediately``, a full disk) or while this
        flushes it: its bytes need no flush any more, so the flush goes on after it instead of stalling
        below the log start or failing on the closed mapping (which would fail-stop the store).
        """
        while True:
            mapped = self.find(self.flushed_where)
            if mapped is None:
                files = self.files
                if files and self.flushed_where < files[0].file_from_offset:
                    self.flushed_where = files[0].file_from_offset
                    continue
                return self.flushed_where
            try:
                mapped.flush(least_pages)
            except (ValueError, FlushError):  # "mmap closed or invalid", or ENOMEM: unmapped during the msync
                if not mapped.deleted:
                    raise
            if mapped.deleted:
                self.flushed_where = max(self.flushed_where, mapped.file_end_offset)
                continue
            self.flushed_where = mapped.file_from_offset + mapped.flushed_position
            if mapped.flushed_position < mapped.file_size or mapped is self.last:
                return self.flushed_where

    # --- truncation and deletion -------------------------------------------------------------

    def truncate_dirty_files(self, offset: int, discard: Callable[[MappedFile], None] | None = None) -> None:
        """Make ``offset`` the end of the log: set positions there, drop every later segment.

        ``discard`` decides what happens to a dropped segment (default: delete it, unless read-only).
        """
        keep: list[MappedFile] = []
        for mapped in self.files:
            if mapped.file_from_offset + mapped.file_size <= offset:
                keep.append(mapped)
            elif mapped.file_from_offset <= offset:
                pos = offset - mapped.file_from_offset
                mapped.wrote_position = mapped.flushed_position = pos
                keep.append(mapped)
            else:
                mapped.close()
                if discard is not None:
                    discard(mapped)
                elif not self.read_only:  # a read-only queue never deletes: it only forgets
                    mapped.destroy()
        if len(keep) != len(self.files):
            self.files = keep
            self._starts = [f.file_from_offset for f in keep]
            if not self.read_only:
                fsync_dir(self.directory)
        self.flushed_where = min(self.flushed_where, offset) if self.flushed_where else offset

    def delete_first(self, count: int) -> list[MappedFile]:
        """Remove the ``count`` oldest segments (retention); never the last one. A segment whose unlink fails stays
        out of the log (readers find it being removed, as in RocketMQ) and is unlinked again by the next pass
        (``retry_undeleted``); the others go all the same, and the first failure is raised after them."""
        count = min(count, len(self.files) - 1)
        gone = self.files[:count]
        self.files = self.files[count:]  # out of the lists first: a read that starts now never meets them
        self._starts = self._starts[count:]
        destroy_all(gone, self.undeleted, "files", lambda: fsync_dir(self.directory))
        return gone

    def retry_undeleted(self) -> StoreIOError | None:
        """Unlink the segments an earlier retention pass could not; the error of one that still fails, if any."""
        self.undeleted, error = unlink_again(self.undeleted, self.directory)
        return error

    def destroy(self) -> None:
        for mapped in self.files:
            mapped.destroy()
        self.files = []
        self._starts = []
        self.flushed_where = 0

    def close(self) -> None:
        for mapped in self.files:
            mapped.close()

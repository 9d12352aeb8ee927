"""One pre-allocated, memory-mapped segment file (RocketMQ's ``MappedFile``).

A segment is named ``%020d`` of the byte offset where it starts in its log and always has its
full configured size. New segments are allocated under a temporary name and renamed into
place, so a crash never leaves a short file with a real name. The write position lives in
memory only; recovery finds it again by scanning.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
from pathlib import Path

from ..errors import CorruptDataError, StoreIOError

PAGE_SIZE = mmap.PAGESIZE
NAME_DIGITS = 20


def segment_name(start_offset: int) -> str:
    return f"{start_offset:0{NAME_DIGITS}d}"


def parse_segment_name(name: str) -> int | None:
    """The start offset a segment file name encodes, or None if it is not a segment name."""
    if len(name) != NAME_DIGITS or not name.isdigit() or not name.isascii():
        return None
    return int(name)


class MappedFile:
    """A fixed-size file mapped into memory, with RocketMQ's write/flush positions."""

    __slots__ = ("_fd", "_mm", "file_from_offset", "file_size", "flushed_position", "path", "read_only",
                 "wrote_position")

    def __init__(self, path: Path, file_size: int, *, read_only: bool = False) -> None:
        start = parse_segment_name(path.name)
        if start is None:
            raise CorruptDataError("not a segment file name (20 digits expected)", str(path))
        self.path = path
        self.file_size = file_size
        self.file_from_offset = start
        self.read_only = read_only
        self.wrote_position = 0
        self.flushed_position = 0
        flags = os.O_RDONLY if read_only else os.O_RDWR
        try:
            self._fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise StoreIOError(exc.errno, f"cannot open segment {path}: {exc.strerror}") from exc
        try:
            actual = os.fstat(self._fd).st_size
            if actual != file_size:
                raise CorruptDataError(f"segment is {actual} bytes, expected {file_size}", str(path))
            access = mmap.ACCESS_READ if read_only else mmap.ACCESS_WRITE
            self._mm: mmap.mmap | None = mmap.mmap(self._fd, file_size, access=access)
        except BaseException:
            os.close(self._fd)
            raise

    @classmethod
    def create(cls, path: Path, file_size: int, *, preallocate: bool = True) -> MappedFile:
        """Create a zero-filled segment of ``file_size`` bytes atomically (temp name, then rename)."""
        tmp = path.with_name(path.name + ".tmp")
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
            try:
                allocate(fd, file_size, preallocate)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, path)
            fsync_dir(path.parent)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise StoreIOError(exc.errno, f"cannot create segment {path}: {exc.strerror}") from exc
        return cls(path, file_size)

    # --- access -----------------------------------------------------------------------------

    @property
    def buffer(self) -> mmap.mmap:
        """The mapping itself, for struct.unpack_from and slicing without copies of the whole file."""
        if self._mm is None:
            raise StoreIOError(errno.EBADF, f"segment {self.path} is closed")
        return self._mm

    @property
    def file_end_offset(self) -> int:
        return self.file_from_offset + self.file_size

    @property
    def remaining(self) -> int:
        return self.file_size - self.wrote_position

    def is_full(self) -> bool:
        return self.wrote_position >= self.file_size

    def read(self, pos: int, size: int) -> bytes:
        return self.buffer[pos : pos + size]

    def write(self, pos: int, data: bytes | bytearray | memoryview) -> None:
        """Copy ``data`` to ``pos``; the caller advances ``wrote_position`` once the bytes are complete."""
        try:
            self.buffer[pos : pos + len(data)] = data
        except (OSError, ValueError) as exc:  # pragma: no cover - mapping errors are rare
            raise StoreIOError(errno.EIO, f"write to {self.path} at {pos} failed: {exc}") from exc

    # --- durability -------------------------------------------------------------------------

    def flush(self, least_pages: int = 0) -> int:
        """msync the bytes written since the last flush if at least ``least_pages`` pages are dirty.

        Returns the new flushed position.
        """
        written = self.wrote_position
        if written <= self.flushed_position or self._mm is None or self.read_only:
            return self.flushed_position
        if least_pages > 0 and (written // PAGE_SIZE - self.flushed_position // PAGE_SIZE) < least_pages:
            return self.flushed_position
        start = self.flushed_position - self.flushed_position % PAGE_SIZE
        try:
            self._mm.flush(start, written - start)
        except OSError as exc:
            raise StoreIOError(exc.errno, f"msync of {self.path} failed: {exc.strerror}") from exc
        self.flushed_position = written
        return written

    def close(self) -> None:
        close_mapping(self._mm, self._fd)
        self._mm, self._fd = None, -1

    def destroy(self) -> None:
        self.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def __repr__(self) -> str:
        return f"MappedFile({self.path.name}, wrote={self.wrote_position}, flushed={self.flushed_position})"


def close_mapping(mm: mmap.mmap | None, fd: int) -> None:
    """Unmap and close. A reader may still hold a view of the mapping: the kernel unmaps it when that goes."""
    if mm is not None:
        with contextlib.suppress(BufferError):
            mm.close()
    if fd >= 0:
        os.close(fd)


def allocate(fd: int, size: int, preallocate: bool) -> None:
    """Give a new file its full size: reserved blocks (fallocate) or, where unsupported or not wanted, sparse."""
    if preallocate:
        try:
            os.posix_fallocate(fd, 0, size)
            return
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
    os.ftruncate(fd, size)


def fsync_dir(directory: Path) -> None:
    """Make a rename or unlink in ``directory`` durable."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

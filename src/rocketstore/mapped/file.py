"""One pre-allocated, memory-mapped segment file (RocketMQ's ``MappedFile``).

A segment is named ``%020d`` of the byte offset where it starts in its log and always has its
full configured size. New segments are allocated under a temporary name and renamed into
place, so a crash never leaves a short file with a real name. The write position lives in
memory only; recovery finds it again by scanning.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import mmap
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from ..errors import CorruptDataError, FlushError, SegmentDeletedError, StoreIOError

STAGING_DIR = ".staging"  # in the store root: where files are prepared when O_TMPFILE is not available

PAGE_SIZE = mmap.PAGESIZE
NAME_DIGITS = 20


def segment_name(start_offset: int) -> str:
    return f"{start_offset:0{NAME_DIGITS}d}"


def parse_segment_name(name: str) -> int | None:
    """The start offset a segment file name encodes, or None if it is not a segment name."""
    if len(name) != NAME_DIGITS or not name.isdigit() or not name.isascii():
        return None
    return int(name)


COPY_LIMIT = 16384  # bytes; see MappedFile.write
RESERVE_STEP = 1 << 20  # bytes of a sparse file's blocks ``MappedFile.reserve`` allocates at a time
WARMED_COPY_LIMIT = 1 << 20  # the same, for a file whose pages a WriteAheadWarmer faults in ahead of the writes


class MappedFile:
    """A fixed-size file mapped into memory, with RocketMQ's write/flush positions.

    With a ``FileBudget`` the mapping may be closed when the file has not been used for a while (a
    store with thousands of consume queues would otherwise hold thousands of descriptors) and is
    mapped again on the next access; the positions stay in memory, and dirty pages are msynced first.
    """

    __slots__ = ("_budget", "_deleted", "_evicted", "_fd", "_mm", "_reserved", "_sealed", "copy_limit",
                 "file_from_offset", "file_size", "flushed_position", "path", "path_text", "read_only", "reserved_to",
                 "wrote_position")

    def __init__(self, path: Path, file_size: int, *, read_only: bool = False,
                 budget: FileBudget | None = None) -> None:
        start = parse_segment_name(path.name)
        if start is None:
            raise CorruptDataError("not a segment file name (20 digits expected)", str(path))
        self.path = path
        self.path_text = str(path)  # for error messages, made once: hot read paths pass it along
        self.file_size = file_size
        self.file_from_offset = start
        self.read_only = read_only
        self.wrote_position = 0
        self.flushed_position = 0
        self._budget = budget
        self._evicted = False
        self._deleted = False
        self._mm: mmap.mmap | None = None
        self._fd = -1  # kept for pwrite by a writable file that is never evicted (see write)
        self._sealed = False  # its pwrite descriptor given back (``seal``): opened again by a write
        self._reserved = False  # every block allocated: a store into the mapping cannot meet a full disk
        self.reserved_to = 0  # blocks known allocated below this (``reserve``)
        self.copy_limit = COPY_LIMIT  # the largest write copied into the mapping (see write)
        self._map()

    def _map(self) -> mmap.mmap:
        """Map the file and return the mapping. Only the mapping is kept: CPython's mmap holds its own duplicate of
        the descriptor."""
        flags = os.O_RDONLY if self.read_only else os.O_RDWR
        try:
            fd = os.open(self.path, flags | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise StoreIOError(exc.errno, f"cannot open segment {self.path}: {exc.strerror}") from exc
        try:
            actual = os.fstat(fd).st_size
            if actual != self.file_size:
                raise CorruptDataError(f"segment is {actual} bytes, expected {self.file_size}", str(self.path))
            access = mmap.ACCESS_READ if self.read_only else mmap.ACCESS_WRITE
            try:
                self._mm = mmap.mmap(fd, self.file_size, access=access)
            except OSError as exc:
                raise StoreIOError(exc.errno, f"cannot map segment {self.path}: {exc.strerror}") from exc
            if not self.read_only and self._budget is None:
                blocks = os.fstat(fd).st_blocks
                self._reserved = blocks * 512 >= self.file_size
                self._fd, fd = fd, -1
        finally:
            if fd >= 0:
                os.close(fd)
        mm = self._mm
        assert mm is not None
        self._evicted = False
        if self._budget is not None:
            self._budget.opened(self)  # may evict this very file again (other threads map too): mm stays valid
        return mm

    def _map_again(self) -> mmap.mmap:
        """``buffer`` of a file without its mapping: mapped again if a ``FileBudget`` evicted it. Under the budget's
        ``map_lock``, as evictions are: two threads mapping at once, or an eviction between a mapping and its
        bookkeeping, left a file with no mapping and not marked evicted, "closed" for good (acknowledged messages
        unreadable, and dispatch into it failing until a reopen)."""
        if self._budget is None:
            return self._gone()
        with self._budget.map_lock:
            mm = self._mm
            if mm is not None:
                return mm
            if not self._evicted or self._deleted:
                return self._gone()
            try:
                return self._map()
            except StoreIOError as exc:
                if not self.read_only or exc.errno != errno.ENOENT:
                    raise
                self._deleted = True  # a live writer's retention took it while it was evicted here
                return self._gone()

    def _gone(self) -> mmap.mmap:
        if self._deleted:
            raise SegmentDeletedError(f"{self.path.name} was deleted by retention while it was read")
        raise StoreIOError(errno.EBADF, f"segment {self.path} is closed")

    def evict(self) -> None:
        """Give the mapping back (``FileBudget``): flush what was written and drop this file's reference; the next
        access maps again. The mapping is not closed here: a thread reading or writing it (it took it from
        ``buffer`` a moment before) keeps it valid until it lets it go, and then it is unmapped. Closing it under
        that thread raised ``ValueError``/``TypeError``/``AssertionError`` from reads and dispatch alike."""
        if self._budget is None:
            return
        with self._budget.map_lock:
            if self._mm is None:
                return
            try:
                self.flush()
            finally:
                self._mm, self._evicted = None, True

    @classmethod
    def create(cls, path: Path, file_size: int, *, preallocate: bool = True, staging: Path | None = None,
               budget: FileBudget | None = None, spare: SpareFile | None = None) -> MappedFile:
        """Create a zero-filled segment of ``file_size`` bytes that appears under its name only when complete
        (from ``spare``'s reserved blocks when given)."""
        try:
            if spare is not None:
                spare.install(path)
                preallocate = True
            else:
                create_file_atomically(path, file_size, preallocate=preallocate, staging=staging)
        except StoreIOError:
            raise
        except OSError as exc:
            raise StoreIOError(exc.errno, f"cannot create segment {path}: {exc.strerror}") from exc
        mapped = cls(path, file_size, budget=budget)
        if preallocate:
            mapped.reserved_to = file_size
        return mapped

    def reserve(self, end: int) -> None:
        """Blocks for the file up to ``end`` before a store into its mapping below it, ``RESERVE_STEP`` at a time. A
        broker leaves its queue files sparse, and a store into a hole of a mapping on a full disk is a SIGBUS that
        kills the process: this makes it a ``StoreIOError`` (ENOSPC) first, and allocates only what is written."""
        if end <= self.reserved_to:
            return
        stop = min(self.file_size, max(end, self.reserved_to + RESERVE_STEP))
        self.reserved_to = self.file_size if reserve_blocks(self.path, stop, self.reserved_to) else stop

    # --- access -----------------------------------------------------------------------------

    @property
    def buffer(self) -> mmap.mmap:
        """The mapping itself, for struct.unpack_from and slicing without copies of the whole file."""
        mm = self._mm
        if mm is None:
            return self._map_again()
        if self._budget is not None:
            self._budget.used(self)
        return mm

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

    def writes_by_syscall(self, size: int) -> bool:
        """Whether ``write`` of ``size`` bytes is a pwrite, which gives the GIL away, rather than a copy."""
        return (self._fd >= 0 or self._sealed) and not (size <= self.copy_limit and self._reserved)

    def seal(self) -> None:
        """Give back the pwrite descriptor of a segment the log has moved past (the mapping keeps its own): a writer
        held two descriptors a segment, and met its descriptor limit at half the segments a reader opens (the fd
        review). A later write (recovery cutting the log back into it) opens it again."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self._sealed = True

    def _unseal(self) -> int:
        try:
            self._fd = os.open(self.path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise StoreIOError(exc.errno, f"cannot open segment {self.path}: {exc.strerror}") from exc
        self._sealed = False
        return self._fd

    @property
    def warmable(self) -> bool:
        """Whether ``warm`` may fault pages in: mapped, writable, and every block allocated (a fault in a hole
        could meet a full disk)."""
        return self._mm is not None and not self.read_only and self._reserved and not self._deleted

    def write(self, pos: int, data: bytes | bytearray | memoryview) -> None:
        """Copy ``data`` to ``pos``; the caller advances ``wrote_position`` once the bytes are complete.

        A file that is never evicted (the commit log's) writes with pwrite(2) into the page cache its mapping
        shares: a copy into the mapping takes a page fault per fresh page while holding the GIL (ingest ran 30%
        slower) and stalls every thread while the page is under a SYNC_FLUSH writer's msync; pwrite does
        neither, and reports a full disk as ENOSPC. Writes of at most ``COPY_LIMIT`` bytes to a file whose
        blocks are all allocated (preallocated segments; a sparse one could SIGBUS on a full disk) copy into
        the mapping all the same: a system call releases the GIL, and getting it back from the dispatcher
        thread cost a single put more than the copy's rare page fault. Where a ``WriteAheadWarmer`` faults the
        pages in ahead of the writes, the copy has no faults to take and the limit is ``WARMED_COPY_LIMIT``:
        four threads putting 16 KiB messages each gave the GIL away in every pwrite and waited for it back,
        half the rate of one thread (6,500-7,100 msg/s against 13,700); copied, 14,400-15,100. A file that
        may be evicted always copies into its mapping: its descriptor could be closed and its number reused
        by another file between two writes.
        """
        fd = self._fd
        if fd < 0 and self._sealed:
            fd = self._unseal()
        if fd < 0 or (len(data) <= self.copy_limit and self._reserved):
            try:
                self.buffer[pos : pos + len(data)] = data
            except (OSError, ValueError) as exc:  # pragma: no cover - mapping errors are rare
                raise StoreIOError(errno.EIO, f"write to {self.path} at {pos} failed: {exc}") from exc
            return
        view = memoryview(data).cast("B")
        try:
            while view:
                done = os.pwrite(fd, view, pos)
                view, pos = view[done:], pos + done
        except OSError as exc:
            raise StoreIOError(exc.errno, f"write to {self.path} at {pos} failed: {exc.strerror}") from exc

    # --- durability -------------------------------------------------------------------------

    def flush(self, least_pages: int = 0) -> int:
        """msync the bytes written since the last flush if at least ``least_pages`` pages are dirty.

        Returns the new flushed position.
        """
        written = self.wrote_position
        if written <= self.flushed_position or self.read_only:
            return self.flushed_position
        if least_pages > 0 and (written // PAGE_SIZE - self.flushed_position // PAGE_SIZE) < least_pages:
            return self.flushed_position
        mm = self._mm
        if mm is None:  # evicted, and written since through a mapping a thread still held: map it to sync
            if not self._evicted or self._deleted:
                return self.flushed_position
            mm = self._map_again()
        start = self.flushed_position - self.flushed_position % PAGE_SIZE
        try:
            msync(mm, start, written - start)
        except OSError as exc:
            raise FlushError(exc.errno, f"msync of {self.path} failed: {exc.strerror}") from exc
        self.flushed_position = written
        return written

    def warm(self, start: int, length: int) -> bool:
        """Fault ``length`` bytes from ``start`` in, writable, ahead of the appends that will fill them
        (``populate_write``; ask ``warmable`` first). False when the kernel cannot."""
        mm = self._mm
        if mm is None:
            raise ValueError("mmap closed or invalid")
        start -= start % PAGE_SIZE
        length = min(length, self.file_size - start)
        return length <= 0 or populate_write(mm, start, length)

    def close(self) -> None:
        # under the budget's map lock: a re-map running meanwhile (its file open, not yet mapped) would map a file
        # this close (or ``destroy``) is giving up, and keep a deleted segment's blocks mapped in the budget
        with self._budget.map_lock if self._budget is not None else contextlib.nullcontext():
            close_mapping(self._mm, self._fd)
            self._mm, self._fd, self._sealed = None, -1, False
            self._evicted = False
        if self._budget is not None:
            self._budget.forget(self)

    @property
    def deleted(self) -> bool:
        return self._deleted

    def destroy(self) -> None:
        with self._budget.map_lock if self._budget is not None else contextlib.nullcontext():
            self._deleted = True  # before the unmap: a reader that fails on the closed mapping learns why
            self.close()
        unlink_path(self.path)

    def __repr__(self) -> str:
        return f"MappedFile({self.path.name}, wrote={self.wrote_position}, flushed={self.flushed_position})"


_MS_SYNC = 4


class FileBudget:
    """At most ``limit`` mapped files of one kind open at once, least recently used given back first.

    Mapping a file past the limit gives back the least recently used one (``MappedFile.evict``): the file drops
    its mapping, which a thread inside it at that moment keeps valid until it is done; the file is mapped again
    by its next use. (``retry_evicted`` still retries a read that meets a mapping closed by ``close``.)
    """

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self._open: dict[int, MappedFile] = {}  # insertion order = least recently used first
        self._newest: int | None = None  # the last key of _open, read without the lock
        self._lock = threading.Lock()
        # held to map a file again and to evict one (``MappedFile._map_again``); reentrant: a mapping's
        # ``opened`` trims, and an eviction's flush may map
        self.map_lock = threading.RLock()
        self.flush_error: StoreIOError | None = None  # an eviction whose flush failed (the store stops vouching)

    def opened(self, mapped: MappedFile) -> None:
        with self._lock:
            self._open[id(mapped)] = mapped
            self._newest = id(mapped)
            over = len(self._open) > self.limit
        if over:
            self.trim()

    def used(self, mapped: MappedFile) -> None:
        key = id(mapped)
        # already the newest: nothing to do (the common case). Not next(reversed(self._open)): another thread's
        # open or close between making that iterator and reading it raised "dictionary changed size"
        if self._newest != key:
            with self._lock:
                if key in self._open:
                    self._open[key] = self._open.pop(key)
                    self._newest = key

    def forget(self, mapped: MappedFile) -> None:
        with self._lock:
            self._open.pop(id(mapped), None)
            self._renewed()

    def _renewed(self) -> None:
        """Set ``_newest`` again after keys left ``_open`` (the lock is held)."""
        self._newest = next(reversed(self._open), None)

    @property
    def open_count(self) -> int:
        return len(self._open)

    def trim(self, keep: int | None = None) -> int:
        """Evict the least recently used files beyond ``keep`` (default: the limit); returns how many."""
        target = self.limit if keep is None else keep
        with self._lock:
            excess = len(self._open) - target
            victims = [self._open.pop(k) for k in list(self._open)[:max(0, excess)]]
            self._renewed()
        for victim in victims:
            try:
                victim.evict()
            except StoreIOError as exc:  # dropped all the same; the store learns it through flush_error
                self.flush_error = exc
        return len(victims)


@contextlib.contextmanager
def reading(mapped: MappedFile) -> Iterator[None]:
    """A read of ``mapped`` that retention may race: a mapping closed under it becomes ``SegmentDeletedError``."""
    try:
        yield
    except ValueError as exc:
        raise deleted_under(mapped, exc) from None


def deleted_under(mapped: MappedFile, exc: ValueError) -> Exception:
    """What a ValueError from reading ``mapped`` means: retention deleted it under the read, or itself."""
    if mapped.deleted and "closed" in str(exc):
        return SegmentDeletedError(f"{mapped.path.name} was deleted by retention while it was read")
    return exc


def retry_evicted(method):
    """Run a consume-queue method again once if a mapping it used was evicted under it by another thread; when
    retention deleted a file it used, let the queue forget that file before the error goes on."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except ValueError as exc:
            if "closed" not in str(exc):
                raise
            return method(self, *args, **kwargs)
        except SegmentDeletedError:  # a reader's view: the queue starts after the file now (callers read it again)
            self.forget_deleted()
            raise

    return wrapper


def msync(mm: mmap.mmap, start: int, length: int) -> None:
    """msync(MS_SYNC) of a range: the one call every mapped write's durability goes through (a test seam too).

    ``mmap.flush`` holds the GIL for the whole system call, so no other thread can even append while
    the disk works and SYNC_FLUSH group commit has nothing to group. Through ctypes the GIL is released.
    """
    address = mapping_address(mm)
    if _libc().msync(ctypes.c_void_p(address + start), ctypes.c_size_t(length), _MS_SYNC):
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


_MADV_POPULATE_WRITE = 23  # Linux 5.14+


def populate_write(mm: mmap.mmap, start: int, length: int) -> bool:
    """Fault ``[start, start + length)`` of a shared mapping in, writable, changing no byte (MADV_POPULATE_WRITE,
    through ctypes: the GIL is released). False where the kernel cannot (not Linux, or before 5.14).

    A copy into a page of a fresh segment otherwise takes the page fault itself, with the GIL held: ~10 us per
    7 KB append here, a tenth of ``put_messages(32)``. The pages become dirty (zeros) until the appends fill
    them. The buffer export is held across the call, so the mapping cannot be unmapped and its addresses given
    to another under it (``close_mapping`` then leaves the unmap to the last reference). Raises ``OSError`` for
    anything else (EFAULT: the file has no blocks there, a write would have raised SIGBUS)."""
    if not sys.platform.startswith("linux"):  # the advice number is Linux's
        return False
    view = ctypes.c_char.from_buffer(mm)
    try:
        failed = _libc().madvise(ctypes.c_void_p(ctypes.addressof(view) + start), ctypes.c_size_t(length),
                                 _MADV_POPULATE_WRITE)
        err = ctypes.get_errno() if failed else 0
    finally:
        del view
    if err in (errno.EINVAL, errno.ENOSYS):
        return False
    if err:
        raise OSError(err, os.strerror(err))
    return True


def mapping_address(mm: mmap.mmap) -> int:
    """Where ``mm`` is mapped (the buffer export is dropped at once, so ``mm.close()`` stays possible)."""
    view = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(view)
    finally:
        del view


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


def reserve_blocks(path: Path, end: int, start: int = 0) -> bool:
    """Give an existing file its blocks in ``[start, end)`` if it has holes (``posix_fallocate``, data unchanged);
    True when every block of the file is allocated. A broker leaves its index and consume-queue files sparse, and a
    store into a hole of a mapping on a full disk is a SIGBUS that kills the process: reserved first, a full disk is
    this ``StoreIOError`` (ENOSPC) instead. Where the file system cannot reserve, nothing is done."""
    try:
        fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise StoreIOError(exc.errno, f"cannot open {path}: {exc.strerror}") from exc
    try:
        stat = os.fstat(fd)
        if stat.st_blocks * 512 >= stat.st_size:
            return True
        if end > start:
            os.posix_fallocate(fd, start, end - start)
        return False
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            return True  # nothing to be done here: not asked again
        raise StoreIOError(exc.errno, f"cannot reserve the blocks of {path} (a sparse file, as a broker leaves "
                                      f"it: a write into a hole on a full disk would stop the process with "
                                      f"SIGBUS): {exc.strerror}") from exc
    finally:
        os.close(fd)


def data_regions(path: Path, start: int, end: int) -> list[tuple[int, int]]:
    """The ``(start, end)`` ranges of ``[start, end)`` that hold data (SEEK_DATA/SEEK_HOLE); the whole range where the
    file system cannot tell."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return [(start, end)]
    regions = []
    try:
        pos = start
        while pos < end:
            try:
                data = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:
                break  # ENXIO: no data after pos
            if data >= end:
                break
            hole = min(os.lseek(fd, data, os.SEEK_HOLE), end)
            regions.append((max(data, start), hole))
            pos = hole
    except OSError:
        return [(start, end)]
    finally:
        os.close(fd)
    return regions


def copy_sparse(source: Path, target: Path) -> None:
    """Copy a file with its holes (``shutil.copyfile`` fills them in: a broker's sparse 6 MB queue files, one
    unit each, cost 6 MB apiece), fsynced."""
    size = source.stat().st_size
    with open(source, "rb") as src, open(target, "xb") as out:
        for start, end in data_regions(source, 0, size):
            src.seek(start)
            out.seek(start)
            left = end - start
            while left > 0:
                chunk = src.read(min(left, 1 << 20))
                if not chunk:
                    break
                out.write(chunk)
                left -= len(chunk)
        out.truncate(size)
        out.flush()
        os.fsync(out.fileno())


def pwrite_all(fd: int, data: bytes, pos: int = 0) -> None:
    """pwrite(2) until every byte is written: a short write (a full disk, a signal) is not success. Raises
    ``OSError`` (ENOSPC for a write that makes no progress), for the caller to type."""
    view = memoryview(data).cast("B")
    while view:
        done = os.pwrite(fd, view, pos)
        if done <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view, pos = view[done:], pos + done


def fsync_dir(directory: Path) -> None:
    """Make a rename, link or unlink in ``directory`` durable; a failure raises (it is a lost durability promise)."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise StoreIOError(exc.errno, f"cannot open directory {directory} to fsync it: {exc.strerror}") from exc
    try:
        os.fsync(fd)
    except OSError as exc:
        raise FlushError(exc.errno, f"fsync of directory {directory} failed: {exc.strerror}") from exc
    finally:
        os.close(fd)


def unlink_path(path: Path) -> None:
    """Unlink a store file; a failure is a ``StoreIOError`` naming it (gone already is fine)."""
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise StoreIOError(exc.errno, f"cannot delete {path}: {exc.strerror}") from exc


def destroy_all(files: Sequence, undeleted: list[Path], what: str, then: Callable[[], None] | None = None) -> None:
    """Destroy every one of ``files`` (retention: mapped or index files out of their lists already), then run
    ``then``. One whose unlink fails is added to ``undeleted`` for the next pass to unlink again, the others go all
    the same, and the first failure is raised after them: one failed unlink used to stop the loop, leaving every
    later file mapped and on disk, never deleted again."""
    failed: list[StoreIOError] = []
    for file in files:
        try:
            file.destroy()
        except StoreIOError as exc:
            undeleted.append(file.path)
            failed.append(exc)
    if then is not None and files:
        then()
    if failed:
        raise StoreIOError(failed[0].errno, f"{failed[0]} ({len(failed)} of {len(files)} {what}; retention deletes "
                                            "them again on its next pass)")


def unlink_again(paths: list[Path], directory: Path) -> tuple[list[Path], StoreIOError | None]:
    """Unlink the files an earlier retention pass gave up on but could not delete: those still left, and the first
    error. Each kind of file keeps such a list; without it a file whose unlink failed once stayed on disk until the
    next open loaded it again."""
    left: list[Path] = []
    error = None
    for path in paths:
        try:
            unlink_path(path)
        except StoreIOError as exc:
            left.append(path)
            error = error or exc
    if len(left) < len(paths):
        fsync_dir(directory)
    return left, error


def replace_file(path: Path, data: bytes, *, private: bool = False) -> None:
    """Make ``data`` the content of ``path`` so that a crash leaves the old content or the new: a temporary file,
    fsync, rename, directory fsync. A failure is a ``StoreIOError`` and leaves no temporary file. ``private``: the
    owner alone may read it (it holds a secret)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0),
                     0o600 if private else 0o644)
        try:
            if private:  # a temporary file left by a crash keeps its mode through O_TRUNC
                os.fchmod(fd, 0o600)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise StoreIOError(exc.errno, f"cannot write {path}: {exc.strerror}") from exc
    fsync_dir(path.parent)


def remove_file(path: Path) -> None:
    """Delete ``path`` durably (directory fsync); a missing file is fine."""
    unlink_path(path)
    fsync_dir(path.parent)


def unused_path(parent: Path, stem: str, suffix: str = "") -> Path:
    """``parent/<stem><suffix>``, or ``<stem>-2<suffix>``, ``-3``...: the first name not taken (``parent`` is made).

    What is set aside is named by the second it happened in; two in one second (a rebuild after a rebuild, a
    crash during the recovery of a crash) must neither overwrite nor nest inside each other. Callers hold the
    store's lock, so nobody else takes the name between this check and their rename."""
    parent.mkdir(parents=True, exist_ok=True)
    path = parent / f"{stem}{suffix}"
    copy = 1
    while os.path.lexists(path):
        copy += 1
        path = parent / f"{stem}-{copy}{suffix}"
    return path


_AT_FDCWD, _AT_SYMLINK_FOLLOW = -100, 0x400
_NO_LINK = (errno.EXDEV, errno.ENOENT, errno.EPERM, errno.EOPNOTSUPP, errno.EACCES)  # e.g. no /proc


def _link_open_file(fd: int, path: Path) -> None:
    """linkat(2) of an O_TMPFILE descriptor through /proc (``os.link`` would link the /proc symlink itself)."""
    libc = _libc()
    if libc.linkat(_AT_FDCWD, f"/proc/self/fd/{fd}".encode(), _AT_FDCWD, os.fsencode(path), _AT_SYMLINK_FOLLOW):
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(path))


_RENAME_EXCHANGE = 2


def exchange_paths(first: Path | str, second: Path | str) -> bool:
    """Swap two existing names in one step (renameat2 RENAME_EXCHANGE); False, with nothing changed, where the
    kernel, libc or file system cannot. Two renames leave a moment with neither name in place (a kill there lost
    the name for good)."""
    libc = _libc()
    call = getattr(libc, "renameat2", None)
    if call is None:
        return False
    if call(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE):
        err = ctypes.get_errno()
        if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
            return False
        raise OSError(err, os.strerror(err), str(first))
    return True


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def fsync_file(fd: int, path: Path) -> None:
    try:
        os.fsync(fd)
    except OSError as exc:
        raise FlushError(exc.errno, f"fsync of {path} failed: {exc.strerror}") from exc


_NO_TMPFILE = (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT, errno.EACCES, errno.EPERM)


def _create_unnamed(path: Path, size: int, preallocate: bool, flags: int, head: bytes) -> bool:
    """The O_TMPFILE way; False (and nothing created) where the file system or /proc cannot do it."""
    tmpfile = getattr(os, "O_TMPFILE", 0)
    if not tmpfile:
        return False
    try:
        fd = os.open(path.parent, flags | tmpfile, 0o644)
    except OSError as exc:
        if exc.errno in _NO_TMPFILE:
            return False
        raise
    try:
        allocate(fd, size, preallocate)
        if head:
            pwrite_all(fd, head)
        fsync_file(fd, path)
        try:
            _link_open_file(fd, path)
        except FileExistsError:  # left by a creation whose directory fsync failed: never part of the log
            os.unlink(path)
            _link_open_file(fd, path)
    except OSError as exc:
        if exc.errno in _NO_LINK and not isinstance(exc, StoreIOError):
            return False
        raise
    finally:
        os.close(fd)
    return True


class SpareFile:
    """A segment's blocks, reserved and zero-filled before the segment has a name: an unnamed file (O_TMPFILE) in
    its directory, linked in when the log rolls into it; where the file system cannot, a ``.tmp`` file in ``staging``
    renamed in (the next writer's open clears one a kill left). A table larger than a segment takes all its
    segments' blocks this way before its first row is written, so a full disk refuses it whole instead of after
    a segment's worth of rows. A kill leaves no segment behind."""

    def __init__(self, directory: Path, size: int, staging: Path | None) -> None:
        self.size = size
        self._fd = -1
        self._tmp: Path | None = None
        self._staging = staging
        flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0)
        try:
            tmpfile = getattr(os, "O_TMPFILE", 0)
            if tmpfile and os.path.isdir("/proc/self/fd"):  # an unnamed file is linked in through /proc
                try:
                    self._fd = os.open(directory, flags | tmpfile, 0o644)
                except OSError as exc:
                    if exc.errno not in _NO_TMPFILE:
                        raise
            if self._fd < 0:
                where = staging if staging is not None else directory
                where.mkdir(parents=True, exist_ok=True)
                self._tmp = where / f".spare.{os.getpid()}.{threading.get_ident()}.{id(self)}.tmp"
                self._fd = os.open(self._tmp, flags | os.O_CREAT | os.O_EXCL, 0o644)
            allocate(self._fd, size, True)
        except OSError as exc:
            self.discard()
            raise StoreIOError(exc.errno, f"cannot reserve {size} bytes for a new segment in {directory}: "
                                          f"{exc.strerror}") from exc

    def install(self, path: Path) -> None:
        """Give the spare its name: fsynced, linked (or renamed) into place, the directory fsynced."""
        try:
            fsync_file(self._fd, path)
            if self._tmp is None:
                try:
                    _link_open_file(self._fd, path)
                except OSError as exc:
                    if exc.errno not in _NO_LINK:
                        raise
                    # made the usual way, its blocks given back first (the disk may hold only one of the two), its
                    # temporary file in staging (never a .tmp name in the segments' directory)
                    self.discard()
                    create_file_atomically(path, self.size, preallocate=True, staging=self._staging)
            else:
                os.rename(self._tmp, path)
                self._tmp = None
        except StoreIOError:
            raise
        except OSError as exc:
            raise StoreIOError(exc.errno, f"cannot create segment {path}: {exc.strerror}") from exc
        finally:
            self.discard()
        fsync_dir(path.parent)

    def discard(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._tmp is not None:
            with contextlib.suppress(OSError):
                self._tmp.unlink()
            self._tmp = None


def create_file_atomically(path: Path, size: int, *, preallocate: bool, staging: Path | None = None,
                           head: bytes = b"") -> None:
    """Create ``path`` zero-filled with ``size`` bytes (``head`` at its start), fsynced, so that no other name ever
    appears beside it, and no process killed or machine stopped ever leaves it without its ``head``.

    RocketMQ parses every name in ``commitlog/``, ``consumequeue/<topic>/<queue>/`` and ``index/`` as a
    number or an index file, so a ``<name>.tmp`` left there by a kill stops a broker from loading the
    store. The file is therefore made nameless (``O_TMPFILE``) and linked into place when complete; where
    the file system cannot do that, it is prepared in ``staging`` (a directory outside those, on the same
    file system) and renamed. The directory entry is fsynced either way.
    """
    flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0)
    if _create_unnamed(path, size, preallocate, flags, head):
        fsync_dir(path.parent)
        return
    where = staging if staging is not None else path.parent
    where.mkdir(parents=True, exist_ok=True)
    tmp = where / f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        fd = os.open(tmp, flags | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            allocate(fd, size, preallocate)
            if head:
                pwrite_all(fd, head)
            fsync_file(fd, path)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)

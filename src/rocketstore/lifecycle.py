"""The files that say a store is in use: ``lock`` (one writer), ``abort`` (running, or crashed) and
``redispatch`` (an open's catch-up of the consume queues and index was under way); and starting the store's
threads.

``lock`` holds an exclusive POSIX record lock on byte 0, the lock a RocketMQ broker takes with
``FileChannel.tryLock``, so rocketstore and a broker keep each other out. POSIX locks belong to
the process and vanish when *any* descriptor of the file is closed, so a BSD ``flock`` is taken
as well and an in-process registry refuses a second writer in the same process.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import struct
import threading
from collections.abc import Callable
from pathlib import Path

from .errors import StoreIOError, StoreLockedError
from .mapped.file import pwrite_all

LOCK_FILE = "lock"
ABORT_FILE = "abort"
REDISPATCH_FILE = "redispatch"

_held: set[tuple[int, int]] = set()
_held_guard = threading.Lock()


class StoreLock:
    """The writer's lock on a store root."""

    def __init__(self, root: Path) -> None:
        self.path = root / LOCK_FILE
        self._fd = -1
        self._key: tuple[int, int] | None = None

    def acquire(self) -> None:
        with contextlib.suppress(OSError), _held_guard:
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) in _held:  # before opening it: closing a descriptor of the file would drop
                raise StoreLockedError(  # the POSIX lock this process's writer holds (all a broker checks)
                    f"{self.path.parent} is already open for writing in this process")
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as exc:
            raise StoreIOError(exc.errno, f"cannot open {self.path}: {exc.strerror}") from exc
        key = None
        try:
            st = os.fstat(fd)
            key = (st.st_dev, st.st_ino)
            with _held_guard:
                if key in _held:
                    key = None  # another StoreLock's: not ours to release
                    raise StoreLockedError(f"{self.path.parent} is already open for writing in this process")
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0)
                except OSError as exc:
                    key = None
                    if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                        raise StoreLockedError(
                            f"{self.path.parent} is locked by another writer (a rocketstore process or a "
                            f"RocketMQ broker); it can still be read: the query commands, or MessageStore.open(..., "
                            f"read_only=True)") from None
                    raise
                _held.add(key)
            if st.st_size == 0:
                pwrite_all(fd, b"lock", 0)
        except BaseException as exc:
            os.close(fd)
            if key is not None:  # a failure after the lock was taken must not keep this process out for good
                with _held_guard:
                    _held.discard(key)
            if isinstance(exc, OSError) and not isinstance(exc, StoreIOError):  # ENOLCK, ENOSPC, EIO...
                raise StoreIOError(exc.errno, f"cannot lock {self.path}: {exc.strerror}") from exc
            raise
        self._fd, self._key = fd, key

    def release(self) -> None:
        if self._fd < 0:
            return
        with _held_guard:
            _held.discard(self._key)  # type: ignore[arg-type]
        with contextlib.suppress(OSError):
            fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, 0)
        os.close(self._fd)  # also drops the flock
        self._fd = -1


def is_locked(root: Path) -> bool:
    """Whether some writer holds ``root/lock`` right now (probed with a shared flock, released at once)."""
    path = root / LOCK_FILE
    try:
        st = os.stat(path)
    except OSError:
        return False
    with _held_guard:
        if (st.st_dev, st.st_ino) in _held:
            # Never open the file here: closing any descriptor would drop this process's POSIX lock.
            return True
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return True
        return _record_locked(fd)
    finally:
        os.close(fd)


_FLOCK = struct.Struct("hhqqi4x")  # Linux's struct flock: type, whence, start, len, pid (native alignment)


def _record_locked(fd: int) -> bool:
    """Whether another process holds a POSIX record lock on byte 0, as a RocketMQ broker does (it takes no
    flock): asked with F_GETLK, which takes nothing, so closing ``fd`` afterwards drops nothing of ours."""
    try:
        answer = fcntl.fcntl(fd, fcntl.F_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0))
    except OSError:
        return False
    return _FLOCK.unpack(answer)[0] != fcntl.F_UNLCK


class AbortFile:
    """``abort`` exists from start-up to clean shutdown; finding it at open means the last run crashed."""

    def __init__(self, root: Path) -> None:
        self.path = root / ABORT_FILE

    def exists(self) -> bool:
        return self.path.exists()

    def check_writable(self) -> None:
        """Before a writer's recovery: an ``abort`` that is no regular file (a directory, a dangling link) cannot be
        written at the end of the open, which then failed after recovery had re-indexed records (a refused open
        that changed the index)."""
        if (self.path.exists() or self.path.is_symlink()) and not self.path.is_file():
            raise StoreIOError(errno.EISDIR if self.path.is_dir() else errno.EINVAL,
                               f"cannot write {self.path}: it is not a regular file")

    def create(self) -> None:
        """Keep the old content as ``abort.bak`` and write this process's PID. One this call created and could not
        write is removed again: left empty by an open refused for a full disk, it made the next open of a cleanly
        closed store take the crash path (and ``verify`` say it was not closed). One that was there stays: it is a
        crash's, whatever its content."""
        existed = self.path.exists()
        try:
            if existed:
                shutil.copyfile(self.path, self.path.with_name(ABORT_FILE + ".bak"))
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
            try:
                pwrite_all(fd, str(os.getpid()).encode(), 0)
                os.fsync(fd)
            except OSError:
                if not existed:
                    with contextlib.suppress(OSError):
                        self.path.unlink()
                raise
            finally:
                os.close(fd)
            _fsync_dir(self.path.parent)
        except OSError as exc:
            raise StoreIOError(exc.errno, f"cannot write {self.path}: {exc.strerror}") from exc

    def delete(self) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:  # the next open then takes the exit for a crash: safe, but say why
            raise StoreIOError(exc.errno, f"cannot remove {self.path}: {exc.strerror}") from exc
        _fsync_dir(self.path.parent)


class RedispatchMarker:
    """``redispatch`` holds the log offset an open's catch-up dispatch started from, until the queues and index it
    wrote are flushed. A kill before that leaves it, and the next open starts there again: without it, the next
    open resumed at the largest queue end, past everything a set-aside queue or a deleted index still lacked
    (and a kill before ``abort`` was created even looked like a clean exit). RocketMQ ignores the file."""

    def __init__(self, root: Path) -> None:
        self.path = root / REDISPATCH_FILE

    def load(self) -> int | None:
        """The offset a catch-up that did not finish started from; 0 (the whole log) if the file is torn."""
        try:
            text = self.path.read_text(encoding="ascii", errors="replace")
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreIOError(exc.errno, f"cannot read {self.path}: {exc.strerror}") from exc
        try:
            return max(0, int(text.strip()))
        except ValueError:
            return 0

    def save(self, offset: int) -> None:
        """Durably, before the catch-up writes anything: a temporary file, fsync, rename, directory fsync."""
        from .mapped.file import replace_file

        replace_file(self.path, str(offset).encode())

    def delete(self) -> None:
        from .mapped.file import remove_file

        remove_file(self.path)


def _fsync_dir(directory: Path) -> None:
    from .mapped.file import fsync_dir

    fsync_dir(directory)


def start_thread(target: Callable[[], object], name: str) -> threading.Thread:
    """A started daemon thread of the store. CPython's "can't start new thread" (EAGAIN: a thread or memory limit)
    becomes a ``StoreIOError``, so an open that cannot start its services fails typed (and then stops the ones it
    did start)."""
    thread = threading.Thread(target=target, name=name, daemon=True)
    try:
        thread.start()
    except RuntimeError as exc:
        raise StoreIOError(errno.EAGAIN, f"cannot start the {name} thread: {exc}") from exc
    return thread

"""A stable numba cache for the kernels when rocketstore is imported from a zip (as Spark ships it).

numba caches functions from a zip under a directory named after the zip's absolute path. Spark
puts the package zip in a new directory for every application, so every cluster job compiled the
kernels again in every Python worker (~20 s on two cores). This locator keys the cache by the
path inside the zip instead; the stamp stays numba's hash of the source text, so a different
version of the package never loads another's machine code.
"""

from __future__ import annotations

import os
import stat
import tempfile

PACKAGE = "rocketstore/"


def install() -> None:
    """Put the locator first in numba's list (before any ``cache=True`` function is defined)."""
    try:
        from numba.core import caching
    except ImportError:  # pragma: no cover - numba is a dependency
        return
    base = getattr(caching, "ZipCacheLocator", None)
    locators = getattr(caching.CacheImpl, "_locator_classes", None)
    if base is None or not isinstance(locators, list):  # another numba: its own behaviour is still correct
        return
    if any(getattr(c, "rocketstore", False) for c in locators):
        return

    class ShippedPackageLocator(base):
        rocketstore = True

        def __init__(self, py_func, py_file) -> None:
            super().__init__(py_func, py_file)
            inside = os.path.dirname(self._internal_path).replace("/", "-")
            self._cache_path = os.path.join(os.path.dirname(self._cache_path), f"shipped-{inside}")

        @classmethod
        def from_function(cls, py_func, py_file):
            if ".zip" not in py_file:
                return None
            try:
                _zip, inside = base._split_zip_path(py_file)
            except ValueError:
                return None
            return cls(py_func, py_file) if inside.startswith(PACKAGE) else None

    locators.insert(0, ShippedPackageLocator)
    user = getattr(caching, "UserProvidedCacheLocator", None)
    if user is not None:
        locators.append(_fallback_locator(user))


def _fallback_locator(user: type) -> type:
    """The last locator: a private directory under the temporary one, for a user who can write neither the
    package's ``__pycache__`` nor a home cache (a service account with no home). Without it every ``cache=True``
    kernel raised "no locator available" at import: each command, ``--help`` too, died with a traceback."""

    class TemporaryDirectoryLocator(user):
        rocketstore = True

        def __init__(self, py_func, py_file) -> None:
            self._py_file = py_file
            self._lineno = py_func.__code__.co_firstlineno
            self._cache_path = os.path.join(self.directory, self.get_suitable_cache_subpath(py_file))

        directory = ""

        @classmethod
        def from_function(cls, py_func, py_file):
            cls.directory = cls.directory or _private_directory()
            if not cls.directory:
                return None
            return super(user, cls).from_function(py_func, py_file)  # numba's checks, without CACHE_DIR's

    return TemporaryDirectoryLocator


def _private_directory() -> str:
    """``$TMPDIR/rocketstore-numba-<uid>``, made 0700; when that name is taken by a directory this user does not own
    alone (another user's could hand this process machine code), a new private one for this process; "" when no
    directory can be made."""
    path = os.path.join(tempfile.gettempdir(), f"rocketstore-numba-{os.getuid()}")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        info = os.lstat(path)
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o077:
            return path
        # taken by someone else (or a link, or open to others): a fresh one of this process, compiled again
        return tempfile.mkdtemp(prefix="rocketstore-numba-")
    except OSError:
        return ""

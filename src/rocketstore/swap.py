"""Swapping a rebuild's new ``consumequeue/`` and ``index/`` into a store, crash-safely.

A rebuild writes the new directories in ``.staging/rebuild-<time>/`` while the old ones stay in place, so a
rebuild that fails (damage in the log, a full disk, a cancelled Spark job) leaves the store as it was. Once the
new set is complete and durable, a marker file ``swap`` is written into the staging directory, naming the
directories to replace and where the old ones go (``recovery/rebuild-<time>/``). Only then are they renamed:
old aside, new into place, one directory at a time, each step a rename. A kill anywhere leaves either

* no marker: the build is incomplete and the old set is untouched; the staging directory is removed, or
* the marker: the swap is finished by whoever takes the store's lock next (a writer's open, the next rebuild),
  ``finish_staged``; each step is skipped once done, so a kill during that is harmless too.

A store therefore holds the old set or the new one, never neither nor a mix, once its lock has been taken.
RocketMQ ignores ``.staging``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from pathlib import Path

from .errors import StoreIOError
from .mapped.file import fsync_dir, unused_path

SWAP_FILE = "swap"
REBUILD_PREFIX = "rebuild-"


def fsync_tree(directory: Path) -> None:
    """fsync every directory under ``directory`` (the files' own contents are the writers' to flush)."""
    for current, _dirs, _files in os.walk(directory):
        fsync_dir(Path(current))


def mark_complete(build: Path, root: Path, names: list[str], aside: Path) -> None:
    """Durably say ``build`` holds the complete new ``names``: from here on the swap is finished, never undone.
    Each name gets a directory in ``build`` (an empty one if the rebuild wrote nothing there: the old one still
    goes aside), so that a name missing from ``build`` later means it was swapped in already."""
    for name in names:
        (build / name).mkdir(exist_ok=True)
    fsync_tree(build)
    tmp = build / f".{SWAP_FILE}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"names": names, "aside": os.path.relpath(aside, root)}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, build / SWAP_FILE)
    except OSError as exc:
        raise StoreIOError(exc.errno, f"cannot write {build / SWAP_FILE}: {exc.strerror}") from exc
    fsync_dir(build)


def swap_in(build: Path, root: Path) -> list[str]:
    """Finish the swap ``build``'s marker describes (idempotent); returns where old directories went. The staging
    directory goes last. A rename or marker that fails is a ``StoreIOError``; the marker stays, so the next writer's
    open (or rebuild) finishes the swap."""
    try:
        return _swap_in(build, root)
    except StoreIOError:
        raise
    except (OSError, ValueError, KeyError) as exc:
        raise StoreIOError(getattr(exc, "errno", None) or errno.EIO,
                           f"cannot finish the rebuild swap of {build}: {exc}; the rebuilt set is complete, and the "
                           "next writer's open (or rebuild) finishes the swap") from exc


def pending_swap(staging: Path) -> Path | None:
    """A complete rebuild whose swap a kill or a failure interrupted (its marker written), if any. Until a writer's
    open finishes it, the store's queues or index may be missing: read-only views and verify say why."""
    try:
        builds = sorted(e.path for e in os.scandir(staging) if e.name.startswith(REBUILD_PREFIX)
                        and e.is_dir(follow_symlinks=False))
    except OSError:
        return None
    return next((Path(b) for b in builds if os.path.exists(os.path.join(b, SWAP_FILE))), None)


def _swap_in(build: Path, root: Path) -> list[str]:
    names, aside_name = _read_marker(build / SWAP_FILE)
    aside = root / aside_name
    moved = []
    for name in names:
        staged = build / name
        if not staged.exists():
            continue  # swapped in before a kill
        if (root / name).exists():
            target = aside / name
            if os.path.lexists(target):  # pragma: no cover - a name taken since the marker was written
                target = unused_path(aside.parent, aside.name) / name
            target.parent.mkdir(parents=True, exist_ok=True)
            os.rename(root / name, target)
            fsync_dir(target.parent)
            fsync_dir(root)
            moved.append(str(target))
        if any(staged.iterdir()):
            os.rename(staged, root / name)
            fsync_dir(root)
        else:
            staged.rmdir()  # the rebuild wrote nothing there (no consumable record): no directory, as before
    (build / SWAP_FILE).unlink()
    fsync_dir(build)
    shutil.rmtree(build, ignore_errors=True)
    return moved


def _read_marker(path: Path) -> tuple[list[str], str]:
    """The marker's names and aside directory; ``ValueError`` for one a rebuild did not write. Its names become
    paths under the store root: a damaged or planted marker naming ``../`` must not move anything outside it."""
    try:
        marker = json.loads(path.read_text(encoding="utf-8"))
    except RecursionError:
        raise ValueError(f"{path} is not a swap marker (nesting past the recursion limit)") from None
    names = marker.get("names") if isinstance(marker, dict) else None
    aside = marker.get("aside") if isinstance(marker, dict) else None
    plain = isinstance(names, list) and all(isinstance(n, str) and n and n not in (".", "..") and "/" not in n
                                            and os.sep not in n and "\0" not in n for n in names)
    inside = isinstance(aside, str) and aside and "\0" not in aside and not os.path.isabs(aside) \
        and not os.path.normpath(aside).startswith(("..", "."))
    if not (plain and inside):
        raise ValueError(f"{path} is not a swap marker a rebuild wrote: {str(marker)[:200]}")
    return names, aside


def finish_staged(staging: Path, root: Path) -> None:
    """Under the store's lock: finish every rebuild swap a kill interrupted, and remove rebuilds killed before
    they were complete."""
    try:
        entries = sorted((e for e in os.scandir(staging) if e.name.startswith(REBUILD_PREFIX)
                          and e.is_dir(follow_symlinks=False)), key=lambda e: e.name)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise StoreIOError(exc.errno, f"cannot list {staging}: {exc.strerror}") from exc
    for entry in entries:
        build = Path(entry.path)
        if (build / SWAP_FILE).exists():
            swap_in(build, root)
        else:
            with contextlib.suppress(OSError):
                shutil.rmtree(build)

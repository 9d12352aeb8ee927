"""A class-data-sharing archive of the classes a Spark driver loads: its JVM starts in about half the time.

A Spark driver spends most of its first ten seconds loading and verifying ~10,000 classes from
Spark's jars (measured here: session 10.1 s -> 5.4 s, first job 4.1 s -> 2.1 s with the archive). Java's
dynamic CDS (``-XX:ArchiveClassesAtExit``, JDK 13+) records them when a JVM exits; later JVMs map
the archive (``-XX:SharedArchiveFile``) instead of parsing the jars again.

The archive is only valid for the JVM build and the class path that made it, so its name is a key over
both (the JVM's library and base archive, Spark's jars with their sizes and times, and their directory).
``record`` makes it: a separate process runs a short job through the ``rocketmq`` source with
``-XX:ArchiveClassesAtExit`` into a name of its own, which becomes the archive only after that JVM exited
cleanly (``./dev`` does this once, ~60 s here; ``python -m rocketstore.spark.classcache`` does it for an
installed package). Every new driver then uses it; a JVM that cannot (another build, a torn file) runs
without it, silently (``-Xshare:auto``, CDS logging off), and ``check_mapped`` then drops the archive so the
next ``record`` makes a good one. Only the driver uses it: a cluster's executors run on other hosts.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ENV_SWITCH = "ROCKETSTORE_SPARK_CDS"  # "0": use no archive; "record": the recording process
QUIET = "-Xshare:auto -Xlog:cds=off -Xlog:cds+dynamic=off"
RECORD_TIMEOUT_S = 600
KEEP_ARCHIVES = 3
STALE_RECORDING_S = 3600  # a recording left by a process that died is removed after this
_recording: list[tuple[Path, Path]] = []  # (being written, final name) of this process's JVM
_offered: list[tuple[Path, int]] = []  # (archive, inode) handed to the JVM being launched


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rocketstore"


def _java_library() -> Path | None:
    """The JVM's own library: its size and time identify the build a recording belongs to."""
    home = os.environ.get("JAVA_HOME")
    java = Path(home) / "bin" / "java" if home else (Path(p) if (p := shutil.which("java")) else None)
    if java is None or not java.exists():
        return None
    root = java.resolve().parent.parent
    for candidate in (root / "lib" / "server" / "libjvm.so", root / "jre" / "lib" / "server" / "libjvm.so"):
        if candidate.exists():
            return candidate
    return None


def _spark_jars() -> Path | None:
    spec = importlib.util.find_spec("pyspark")
    if spec is None or not spec.origin:
        return None
    jars = Path(spec.origin).parent / "jars"
    return jars if jars.is_dir() else None


def archive_path() -> Path | None:
    """Where the archive for this JVM and this Spark lives (whether or not it exists), or None when there is
    no JVM or Spark to key it by."""
    library, jars = _java_library(), _spark_jars()
    if library is None or jars is None:
        return None
    digest = hashlib.sha256()
    base = library.parent / "classes.jsa"  # the JDK's own archive, which a dynamic one extends
    for jvm_file in (library, base) if base.exists() else (library,):
        stat = jvm_file.stat()
        digest.update(f"{jvm_file.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    digest.update(f"{jars.resolve()}\0".encode())
    for jar in sorted(jars.iterdir()):
        # The JVM refuses (silently, under -Xshare:auto) an archive whose jars changed size or time: a venv
        # reinstalled at the same path has the same jars with new times.
        stat = jar.stat()
        digest.update(f"{jar.name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    return cache_dir() / f"spark-classes-{digest.hexdigest()[:16]}.jsa"


def java_options() -> str:
    """JVM options for a new driver: use the archive when there is one; in the recording process, record it
    at exit (``finish`` moves it into place); else nothing."""
    _offered.clear()
    switch = os.environ.get(ENV_SWITCH)
    target = archive_path() if switch != "0" else None
    if target is None:
        return ""
    with contextlib.suppress(OSError):
        _offered.append((target, target.stat().st_ino))
        return f"-XX:SharedArchiveFile={target} {QUIET}"
    if switch != "record" or _recording:
        return ""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale(target.parent)
        fd, name = tempfile.mkstemp(prefix=f"{target.stem}.", suffix=".recording", dir=target.parent)
        os.close(fd)
        os.unlink(name)  # the JVM creates it at exit; the name stays this process's
    except OSError:  # a read-only home: run without
        return ""
    _recording.append((Path(name), target))
    return f"-XX:ArchiveClassesAtExit={name} {QUIET}"


def check_mapped(jvm_pid: int) -> bool | None:
    """After a launch with the archive: did the JVM map it? If not, the JVM refused it (a file this key did not
    foresee changed), so it is removed (unless already replaced) and the next ``record`` makes a good one.
    None when there was no archive offered or no /proc to look in."""
    if not _offered:
        return None
    target, inode = _offered.pop()
    try:
        maps = Path(f"/proc/{jvm_pid}/maps").read_text()
    except OSError:
        return None
    if str(target) in maps:
        return True
    with contextlib.suppress(OSError):
        if target.stat().st_ino == inode:
            target.unlink()
    return False


def _remove_stale(directory: Path) -> None:
    for old in directory.glob("spark-classes-*.recording"):
        with contextlib.suppress(OSError):
            if time.time() - old.stat().st_mtime > STALE_RECORDING_S:
                old.unlink()


def _keep_newest(directory: Path) -> None:
    """Archives of other venvs and JVM builds: ~190 MB each, so only the newest few stay (a removed one that is
    still wanted is recorded again)."""
    archives = sorted(directory.glob("spark-classes-*.jsa"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in archives[KEEP_ARCHIVES:]:
        with contextlib.suppress(OSError):
            old.unlink()


def watch(process) -> None:
    """Finish this process's recording at exit, once ``process`` (the driver JVM's launcher) has ended."""
    if _recording and process is not None:
        atexit.register(finish, process)


def finish(process, timeout: float = 120) -> Path | None:
    """End the driver JVM (closing its stdin, as the exit of this process would) and, if it exited cleanly,
    move the archive it wrote into place. Returns the archive, or None."""
    if not _recording:
        return None
    written, target = _recording.pop()
    with contextlib.suppress(OSError, ValueError):
        if process.stdin is not None:
            process.stdin.close()
    try:
        code = process.wait(timeout)
    except Exception:  # at exit: whatever happened, the recording is not trusted
        code = None
    try:
        if code == 0 and written.is_file() and written.stat().st_size > 0:
            os.replace(written, target)
            _keep_newest(target.parent)
            return target
        written.unlink(missing_ok=True)
    except OSError:
        pass
    return None


def record(*, progress: bool = False) -> Path | None:
    """Record the archive now, in a separate process running two short jobs (a scan through the ``rocketmq``
    source with an aggregation, and one into Arrow): what ``./dev`` does at install.
    Returns the archive (also when it was already there), or None when it could not be made."""
    import subprocess

    target = archive_path()
    if target is None or os.environ.get(ENV_SWITCH) == "0":
        return None
    if target.is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        lock = os.open(target.parent / "spark-classes.lock", os.O_CREAT | os.O_RDWR, 0o644)
    except OSError:
        return None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process recording: wait for its archive
        if not target.is_file():
            if progress:
                print("recording the Spark driver's class archive (once; about a minute)...", file=sys.stderr)
            with contextlib.suppress(subprocess.TimeoutExpired):  # a driver that never ends: no archive
                subprocess.run([sys.executable, "-m", "rocketstore.spark.classcache", "--workload"], check=False,
                               env=dict(os.environ, **{ENV_SWITCH: "record"}), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, timeout=RECORD_TIMEOUT_S)
    finally:
        os.close(lock)
    return target if target.is_file() else None


def _workload() -> None:
    """The recording run: one session, the jobs rocketstore's commands run, then the JVM's clean exit."""
    import pyarrow as pa

    from .. import MessageStore, StoreConfig
    from .jobs import read_store
    from .session import spark_session

    with tempfile.TemporaryDirectory(prefix="rocketstore-cds-") as tmp:
        root = Path(tmp) / "store"
        config = StoreConfig(mapped_file_size_commit_log=1 << 20, max_hash_slot_num=97, max_index_num=400)
        with MessageStore.open(root, config) as store:
            store.put_batch(pa.table({"topic": ["T"] * 100, "body": [b"x"] * 100, "keys": [["k"]] * 100}))
        spark = spark_session("local[2]", "rocketstore-cds", driver_memory="1g")
        df = read_store(spark, str(root))
        df.groupBy("topic").count().collect()
        df.select("topic", "queueId", "body").toArrow()
        from pyspark import SparkContext

        process = getattr(SparkContext._gateway, "proc", None)  # the JVM pyspark started
        spark.stop()
        finish(process)


if __name__ == "__main__":
    if "--workload" in sys.argv:
        _workload()
    elif record(progress=True) is None and "--quiet" not in sys.argv:
        print("no Spark driver class archive: no java or pyspark here, or ROCKETSTORE_SPARK_CDS=0", file=sys.stderr)

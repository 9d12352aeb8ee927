"""The Spark driver's class archive: keyed by JVM build and jars, used by new drivers, moved into place only whole."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pyspark")

from rocketstore.spark import classcache


@pytest.fixture
def fake_java(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """A JVM library and a jars directory of our own, and a cache under tmp_path."""
    library = tmp_path / "jdk" / "lib" / "server" / "libjvm.so"
    library.parent.mkdir(parents=True)
    library.write_bytes(b"jvm")
    jars = tmp_path / "pyspark" / "jars"
    jars.mkdir(parents=True)
    (jars / "spark-core.jar").write_bytes(b"core")
    monkeypatch.setattr(classcache, "_java_library", lambda: library)
    monkeypatch.setattr(classcache, "_spark_jars", lambda: jars)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(classcache.ENV_SWITCH, raising=False)
    monkeypatch.setattr(classcache, "_recording", [])
    monkeypatch.setattr(classcache, "_offered", [])
    return library, jars


def test_the_archive_name_changes_with_the_jvm_build_and_the_jars(fake_java):
    library, jars = fake_java
    first = classcache.archive_path()
    assert first is not None and first.parent == classcache.cache_dir() and classcache.archive_path() == first
    (jars / "extra.jar").write_bytes(b"x")
    second = classcache.archive_path()
    library.write_bytes(b"another jvm build")
    third = classcache.archive_path()
    assert len({first, second, third}) == 3


def test_the_archive_name_changes_when_a_jar_is_rewritten_with_the_same_size(fake_java):
    """A venv reinstalled at the same path: same jars, same sizes, new times. The JVM refuses an archive whose jars'
    times changed, so the name must change with them (CI once kept using such an archive, unmapped)."""
    import os

    library, jars = fake_java
    before = classcache.archive_path()
    jar = jars / "spark-core.jar"
    os.utime(jar, ns=(jar.stat().st_atime_ns, jar.stat().st_mtime_ns + 1_000_000_000))
    after_jar = classcache.archive_path()
    (library.parent / "classes.jsa").write_bytes(b"the JDK's base archive")
    after_base = classcache.archive_path()
    assert len({before, after_jar, after_base}) == 3


def test_an_archive_the_jvm_did_not_map_is_dropped_and_a_mapped_one_kept(fake_java, tmp_path):
    """``check_mapped`` reads the JVM's /proc maps; this process stands in for the JVM."""
    import mmap
    import os

    target = classcache.archive_path()
    target.parent.mkdir(parents=True)
    assert classcache.check_mapped(os.getpid()) is None  # nothing offered
    target.write_bytes(b"archive" * 1000)
    assert classcache.java_options().startswith("-XX:SharedArchiveFile=")
    with open(target, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ):
        assert classcache.check_mapped(os.getpid()) is True
    assert target.is_file()
    assert classcache.java_options().startswith("-XX:SharedArchiveFile=")
    assert classcache.check_mapped(os.getpid()) is False
    assert not target.exists(), "an archive the JVM refused must go, so the next record makes a good one"
    target.write_bytes(b"archive")
    classcache.java_options()
    replacement = tmp_path / "fresh.jsa"
    replacement.write_bytes(b"recorded by another process meanwhile")
    os.replace(replacement, target)
    assert classcache.check_mapped(os.getpid()) is False and target.is_file(), "a newer archive is not removed"


def test_options_use_the_archive_record_it_only_when_asked_and_never_when_switched_off(fake_java, monkeypatch):
    assert classcache.java_options() == ""  # no archive, not the recording process
    monkeypatch.setenv(classcache.ENV_SWITCH, "record")
    recording = classcache.java_options()
    assert recording.startswith("-XX:ArchiveClassesAtExit=") and classcache.QUIET in recording
    written, target = classcache._recording[0]
    assert str(written) in recording and written.parent == target.parent and not written.exists()
    assert classcache.java_options() == "", "one recording per process"
    target.write_bytes(b"archive")
    assert classcache.java_options() == f"-XX:SharedArchiveFile={target} {classcache.QUIET}"
    monkeypatch.setenv(classcache.ENV_SWITCH, "0")
    assert classcache.java_options() == ""


@pytest.mark.parametrize(("exit_code", "moved"), [(0, True), (1, False)])
def test_a_recording_becomes_the_archive_only_after_its_jvm_exits_cleanly(fake_java, monkeypatch, exit_code, moved):
    """``finish`` closes the JVM's stdin (its signal to exit) and waits: a stand-in JVM writes the recording at
    that moment, as ArchiveClassesAtExit does, and exits with ``exit_code``."""
    monkeypatch.setenv(classcache.ENV_SWITCH, "record")
    classcache.java_options()
    written, target = classcache._recording[0]
    jvm = subprocess.Popen(["sh", "-c", 'cat > /dev/null; printf archive > "$1"; exit "$2"', "sh", str(written),
                            str(exit_code)], stdin=subprocess.PIPE)
    assert not written.exists()  # still "running": nothing written yet
    assert classcache.finish(jvm) == (target if moved else None)
    assert target.exists() == moved and not written.exists()
    assert classcache.finish(jvm) is None  # once


def test_a_dead_recording_goes_after_an_hour_and_a_live_one_stays(fake_java, monkeypatch):
    import os

    cache = classcache.cache_dir()
    cache.mkdir(parents=True)
    dead, live = cache / "spark-classes-a.x.recording", cache / "spark-classes-b.y.recording"
    for path, age in ((dead, classcache.STALE_RECORDING_S + 60), (live, 60)):
        path.write_bytes(b"part")
        os.utime(path, (path.stat().st_mtime - age, path.stat().st_mtime - age))
    monkeypatch.setenv(classcache.ENV_SWITCH, "record")
    assert classcache.java_options().startswith("-XX:ArchiveClassesAtExit=")
    assert not dead.exists() and live.exists()


def test_only_the_newest_archives_stay(tmp_path):
    import os

    for age in range(5):
        archive = tmp_path / f"spark-classes-{age}.jsa"
        archive.write_bytes(b"a")
        os.utime(archive, (1_000_000 - age, 1_000_000 - age))
    (tmp_path / "other.jsa").write_bytes(b"not ours")
    classcache._keep_newest(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.jsa", "spark-classes-0.jsa", "spark-classes-1.jsa",
                                                          "spark-classes-2.jsa"]


def test_the_suites_driver_maps_the_archive(spark):
    """The fixture's JVM started with the archive ./dev (or the fixture) recorded, and the kernel mapped it."""
    archive = classcache.archive_path()
    assert archive is not None and archive.is_file()
    pid = spark._jvm.java.lang.ProcessHandle.current().pid()
    maps = Path(f"/proc/{pid}/maps").read_text()
    assert str(archive) in maps, f"the driver JVM {pid} has not mapped {archive}"


def test_recording_is_a_no_op_once_the_archive_exists(spark):
    archive = classcache.archive_path()
    done = subprocess.run([sys.executable, "-m", "rocketstore.spark.classcache"], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0 and done.stderr == "" and archive is not None and archive.is_file()

"""What a cluster run needs without a cluster: absolute paths, the visibility check, one-line failures,
the shipped package and its numba cache (the cluster itself: test_cluster.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("pyspark")

from rocketstore.errors import StoreIOError, StoreNotVisibleError
from rocketstore.spark.failures import NOTE_PREFIX, in_task, one_line
from rocketstore.spark.partitions import LogRange, ScanOptions, read_range, require_visible, resolve_roots
from rocketstore.spark.shipping import package_zip
from test_spark import CONFIG, build_store

EXECUTOR_FAILURE = """An exception was thrown from the Python worker:
Traceback (most recent call last):
  File "./rocketstore.zip/rocketstore/spark/source.py", line 106, in read
    yield from read_range(partition.range, partition.options)
  File "./rocketstore.zip/rocketstore/spark/partitions.py", line 165, in require_visible
    raise StoreNotVisibleError(f"store {root} is not visible ...")
rocketstore.errors.StoreNotVisibleError: store /data/a is not visible from the executor on host w1: mount it
rocketstore task: partition 3 of stage 1, attempt 2, on host w1
 SQLSTATE: 38000"""


def test_one_line_names_the_error_and_the_task():
    assert one_line(RuntimeError(EXECUTOR_FAILURE)) == (
        "StoreNotVisibleError: store /data/a is not visible from the executor on host w1: mount it "
        "(in partition 3 of stage 1, attempt 2, on host w1)")


def test_one_line_of_a_java_failure_is_its_first_named_error():
    text = ("An error occurred while calling o67.load.\n: java.io.IOException: Cannot run program \"x\": error=2\n"
            "\tat java.base/java.lang.ProcessBuilder.start(ProcessBuilder.java:1143)\n"
            "Caused by: java.io.IOException: error=2, No such file or directory")
    assert one_line(RuntimeError(text)) == ('IOException: Cannot run program "x": error=2 (caused by IOException: '
                                            'error=2, No such file or directory)')
    assert one_line(RuntimeError("")) == "RuntimeError('')"


def test_one_line_of_a_java_failure_says_its_root_cause():
    """An export onto a full disk said only TASK_WRITE_FAILED; why (No space left on device) was in -v's output
    alone (the full-disk review). This is the failure Spark raised there, cut to its lines that matter."""
    text = ("An error occurred while calling o94.parquet.\n: org.apache.spark.SparkException: [TASK_WRITE_FAILED] "
            "Task failed while writing rows to file:/d/.out.export-388d. SQLSTATE: 58030\n"
            "\tat org.apache.spark.sql.errors.QueryExecutionErrors$.taskFailedWhileWritingRowsError(Q.scala:1)\n"
            "Caused by: org.apache.parquet.util.AutoCloseables$ParquetCloseResourceException: Unable to close\n"
            "\tat org.apache.parquet.util.AutoCloseables.uncheckedClose(AutoCloseables.java:85)\n"
            "Caused by: org.apache.hadoop.fs.FSError: java.io.IOException: No space left on device\n"
            "Caused by: java.io.IOException: No space left on device\n\t... 20 more")
    assert one_line(RuntimeError(text)) == ("SparkException: [TASK_WRITE_FAILED] Task failed while writing rows to "
                                            "file:/d/.out.export-388d. (caused by IOException: No space left on "
                                            "device)")
    same = "An error occurred.\n: java.io.IOException: disk gone\nCaused by: java.io.IOException: disk gone"
    assert one_line(RuntimeError(same)) == "IOException: disk gone"  # a cause it already says is not said twice


def test_in_task_notes_nothing_outside_an_executor():
    with pytest.raises(KeyError) as raised, in_task():
        raise KeyError("x")
    assert not any(n.startswith(NOTE_PREFIX) for n in getattr(raised.value, "__notes__", ()))


def test_paths_are_resolved_on_the_driver(tmp_path, monkeypatch):
    build_store(tmp_path / "broker-a", 5)
    build_store(tmp_path / "broker-b", 5)
    monkeypatch.chdir(tmp_path)
    assert resolve_roots("broker-a") == [tmp_path / "broker-a"]
    assert resolve_roots("broker-*") == [tmp_path / "broker-a", tmp_path / "broker-b"]
    assert all(p.is_absolute() for p in resolve_roots("./broker-b,broker-a"))
    # a store named with glob characters is itself: resolved once, it was globbed again and skipped (find-keys
    # answered without it, exit 0; export refused it), as the cluster review found
    build_store(tmp_path / "broker[c]", 5)
    assert resolve_roots("broker[c]") == [tmp_path / "broker[c]"]
    assert resolve_roots(str(tmp_path / "broker[c]")) == [tmp_path / "broker[c]"]
    assert resolve_roots("broker*") == [tmp_path / n for n in ("broker-a", "broker-b", "broker[c]")]
    assert resolve_roots(",".join(map(str, resolve_roots("broker*")))) == resolve_roots("broker*")


def test_a_store_an_executor_cannot_see_is_named_with_the_fix(tmp_path):
    root = tmp_path / "store"
    build_store(root, 5)
    require_visible(root)  # seen: nothing to say
    segment = sorted((root / "commitlog").iterdir())[0]
    unseen = LogRange(str(tmp_path / "not-mounted"), "b", str(tmp_path / "not-mounted" / "commitlog" / segment.name),
                      0, CONFIG.mapped_file_size_commit_log, 0, 100, 100)
    with pytest.raises(StoreNotVisibleError, match=r"not-mounted is not visible from the executor on host .+: "
                       r"mount it at the same path on every worker"):
        list(read_range(unseen, ScanOptions()))
    gone = LogRange(str(root), "b", str(root / "commitlog" / "00000000000099999999"), 0,
                    CONFIG.mapped_file_size_commit_log, 0, 100, 100)
    with pytest.raises(StoreIOError, match="cannot open segment") as raised:  # the store is there, a file is not
        list(read_range(gone, ScanOptions()))
    assert not isinstance(raised.value, StoreNotVisibleError)


def test_the_shipped_package_imports_and_caches_its_kernels_across_directories(tmp_path):
    """Spark puts the zip in a new directory per application; the compiled kernels must still be found."""
    archive = package_zip(tmp_path)
    with zipfile.ZipFile(archive) as packed:
        names = packed.namelist()
    assert "rocketstore/codec/_kernels.py" in names and "rocketstore/spark/shipping.py" in names
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)
    script = ("import zlib, numpy as np; from rocketstore.codec import _kernels as k; assert '.zip' in k.__file__;"
              "data = np.frombuffer(b'rocketstore' * 64, np.uint8);"
              "assert k.crc32(data, 0, 11) == zlib.crc32(data[:11]);"
              "assert k.crc32(data, 0, len(data)) == zlib.crc32(data);"  # the table and, cached, zlib's
              "print(type(k.crc32._cache._impl.locator).__name__, len(k.crc32.stats.cache_hits),"
              " len(k.crc32.stats.cache_misses))")
    cache = tmp_path / "numba-cache"
    outputs = []
    for run in ("one", "two"):  # two "applications": the same zip in two directories
        app = tmp_path / run
        app.mkdir()
        (app / "rocketstore.zip").write_bytes(archive.read_bytes())
        env = dict(os.environ, PYTHONPATH="./rocketstore.zip", XDG_CACHE_HOME=str(cache))
        env.pop("NUMBA_CACHE_DIR", None)
        result = subprocess.run([sys.executable, "-c", script], cwd=app, env=env, capture_output=True, text=True,
                                check=False)
        assert result.returncode == 0, result.stderr
        outputs.append(result.stdout.split())
    assert outputs[0] == ["ShippedPackageLocator", "0", "1"]  # compiled once...
    assert outputs[1] == ["ShippedPackageLocator", "1", "0"]  # ...and found again from another directory
    shipped = [p for p in Path(cache).rglob("shipped-rocketstore-codec") if p.is_dir()]
    assert len(shipped) == 1 and any(shipped[0].glob("*.nbi"))


def test_ship_env_outside_a_virtual_environment_is_a_clear_error(tmp_path, monkeypatch):
    from rocketstore.errors import ConfigError
    from rocketstore.spark.shipping import packed_environment

    monkeypatch.setattr(sys, "base_prefix", sys.prefix)  # as if run by a system Python
    with pytest.raises(ConfigError, match="packs the driver's virtual environment, but this Python runs outside one"):
        packed_environment(tmp_path / "cache")
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.zip"))


_STOP_PROBE = """
import json, sys, time
from rocketstore.spark.jobs import read_store
from rocketstore.spark.session import end_python_daemons, spark_session, stop_quietly
spark = spark_session("local[1]", "stop-probe", driver_memory="1g")
read_store(spark, sys.argv[1]).count()  # the driver's daemon and a pooled worker now exist
def running(pid):
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
ended = end_python_daemons(spark)
deadline = time.monotonic() + 10
while any(map(running, ended)) and time.monotonic() < deadline:
    time.sleep(0.05)
alive = [pid for pid in ended if running(pid)]  # the session is not stopped yet: these ended on their own signal
stop_quietly(spark)
print(json.dumps({"daemons": ended, "alive": alive}))
"""


def test_stopping_quietly_ends_the_drivers_python_daemon_first(tmp_path):
    """``stop_quietly`` (what a Spark command does at exit) first ends the JVM's Python daemon, whose workers then
    end silently, and only then stops the session: it is the session's stop (or the JVM's death) closing an idle
    worker's Unix socket that made the worker print a BrokenPipeError traceback on stderr."""
    import json

    build_store(tmp_path / "s", 20)
    done = subprocess.run([sys.executable, "-c", _STOP_PROBE, str(tmp_path / "s")], capture_output=True, text=True,
                          timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["daemons"] and got["alive"] == []
    assert "Traceback" not in done.stderr and "Broken pipe" not in done.stderr


def _hang_up_on_a_daemon(module: str) -> str:
    """Start the daemon ``module`` as an executor does (Unix socket), connect and hang up five times as a task
    cancelled mid-request does, end it (stdin closed), and return its stderr."""
    import socket
    import struct
    import tempfile
    import time

    # not under tmp_path: a socket's path has at most 107 bytes, and an xdist worker's tmp_path + the daemon's
    # ".<uuid>.sock" is longer (the daemon then fails to bind and exits)
    sockets = tempfile.mkdtemp(prefix="rs-d-", dir="/tmp")
    env = dict(os.environ, PYTHON_UNIX_DOMAIN_ENABLED="true", PYTHON_WORKER_FACTORY_SOCK_DIR=sockets,
               PYTHON_WORKER_FACTORY_SECRET="s")
    daemon = subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=env)
    try:
        head = daemon.stdout.read(4)
        if len(head) < 4:
            raise AssertionError(f"{module} did not start: {daemon.communicate(timeout=30)[1].decode()[-2000:]}")
        size = struct.unpack(">i", head)[0]
        path = daemon.stdout.read(size).decode()
        for _ in range(5):
            with socket.socket(socket.AF_UNIX) as sock:
                sock.connect(path)
        time.sleep(1)  # the forked workers write their pid to a closed socket
        daemon.stdin.close()  # "Spark told us to exit by closing stdin"
        daemon.stdin = None
        _, err = daemon.communicate(timeout=30)
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
        import shutil

        shutil.rmtree(sockets, ignore_errors=True)
    return err.decode()


def test_the_local_daemon_is_silent_about_workers_the_jvm_hung_up_on(spark):
    """A failing export printed PySpark's ``BrokenPipeError`` traceback under its one-line error in one CI run
    of four: a task cancelled while the daemon forked its worker, whose pid then went to a closed socket.
    PySpark's own daemon prints it every time it is hung up on; the wrapper local sessions run prints nothing,
    and is the daemon of the suite's session's tasks (so every Spark test here goes through it; the planner's own
    data source lookups keep PySpark's, which Spark starts whatever the setting)."""
    from rocketstore.spark.session import QUIET_DAEMON, _python_daemons

    assert "BrokenPipeError" in _hang_up_on_a_daemon("pyspark.daemon")  # the test can fail
    assert _hang_up_on_a_daemon(QUIET_DAEMON) == ""
    spark.range(4).rdd.map(lambda n: n).count()  # a Python task: the daemon exists
    commands = [Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                for pid in _python_daemons(spark._jvm.java.lang.ProcessHandle.current().pid())]
    task_daemons = [command for command in commands if b"pyspark.worker" in command]  # not the planner's lookups
    assert task_daemons and all(QUIET_DAEMON.encode() in command for command in task_daemons)
    done = subprocess.run([sys.executable, "-c", f"import sys, {QUIET_DAEMON}; print(sorted(sys.modules))"],
                          capture_output=True, text=True, timeout=60, check=True)
    assert "'numpy'" not in done.stdout and "'rocketstore.store'" not in done.stdout  # it forks: no threads first


def test_quiet_logging_turns_off_task_failures_and_the_shutdown_race_but_verbose_keeps_them():
    """A failed cluster command's stderr is its one-line error: the loggers that repeat a task failure with a
    stack trace, and the driver's report of an executor message arriving after its scheduler stopped (it failed
    a CI-form run with a JVM stack trace under the error), are off unless ``--verbose``."""
    from rocketstore.spark.session import SHUTDOWN_RACE_LOGGERS, TASK_FAILURE_LOGGERS, log4j2_properties

    quiet, verbose = log4j2_properties(False), log4j2_properties(True)
    assert "org.apache.spark.network.server.TransportRequestHandler" in SHUTDOWN_RACE_LOGGERS
    for name in TASK_FAILURE_LOGGERS + SHUTDOWN_RACE_LOGGERS:
        lines = quiet.splitlines()
        key = next(line.split("=")[0].strip() for line in lines if line.endswith(f"= {name}"))
        assert f"{key.removesuffix('.name')}.level = off" in lines
        assert f"= {name}\n" not in verbose


def test_a_failed_export_prints_one_line_and_no_stack_trace(tmp_path):
    """A write task that fails is logged again by Spark's write path ("ERROR Utils: Aborting task", the output
    committer's cleanup) with Java stack traces: 129 lines on stderr before the error. Only the error is left."""
    results = build_store(tmp_path / "s", 700)
    segment = tmp_path / "s" / "commitlog" / f"{0:020d}"
    data = bytearray(segment.read_bytes())
    data[results[10].commit_log_offset + 100] ^= 0xFF  # a body byte of an old segment: the task fails (CRC)
    segment.write_bytes(bytes(data))
    done = subprocess.run([sys.executable, "-m", "rocketstore.cli.app", "export", "--store", str(tmp_path / "s"),
                           "--out", str(tmp_path / "out"), "--master", "local[1]", "--max-hash-slot-num", "97",
                           "--max-index-num", "300"], capture_output=True, text=True, timeout=180, check=False)
    lines = done.stderr.splitlines()  # Java's "WARNING: Using incubator modules" line dropped too
    assert done.returncode == 1 and len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith("error: ChecksumError: body CRC") and "(in partition 0 of stage" in lines[0]


def test_a_bad_master_is_one_line_naming_it_before_a_jvm_starts(tmp_path, monkeypatch):
    """An unknown scheme printed a Java stack trace and "Java gateway process exited"; a standalone master nobody
    answers failed after ~65 s with "Cannot call methods on a stopped SparkContext", not naming it; local[0], yarn
    without a Hadoop configuration and an unreachable Kubernetes API server printed 12-53 lines of Java."""
    import socket
    import time

    from rocketstore.errors import ConfigError
    from rocketstore.spark.session import check_master

    build_store(tmp_path / "s", 5)
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    check_master("local[2]")
    monkeypatch.delenv("HADOOP_CONF_DIR", raising=False)
    monkeypatch.delenv("YARN_CONF_DIR", raising=False)
    with pytest.raises(ConfigError, match="'yarn' needs HADOOP_CONF_DIR or YARN_CONF_DIR"):
        check_master("yarn")
    monkeypatch.setenv("YARN_CONF_DIR", str(tmp_path))
    check_master("yarn")
    for master, text in [("bogus://x", "'bogus://x' is not a master URL"),
                         ("local[0]", "'local[0]' is not a master URL"),
                         (f"k8s://https://127.0.0.1:{port}", "cannot reach the Spark master k8s://https://127.0.0.1:"),
                         (f"spark://127.0.0.1:{port}", f"cannot reach the Spark master spark://127.0.0.1:{port} ")]:
        with pytest.raises(ConfigError, match=re.escape(text)):
            check_master(master)
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "rocketstore.cli.app", "rebuild", "--store", str(tmp_path / "s"),
                               "--master", master, "--max-hash-slot-num", "97", "--max-index-num", "300"],
                              capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 1 and done.stderr.splitlines() == [f"error: {done.stderr[7:].strip()}"]
        assert text in done.stderr and time.monotonic() - started < 30
        assert (tmp_path / "s" / "consumequeue").is_dir() and (tmp_path / "s" / "index").is_dir()


class _Context:
    def __init__(self, stopped: bool, app_id: str) -> None:
        self.applicationId, self._stopped, self.stops = app_id, stopped, 0

        class _Jsc:
            def sc(inner):
                return inner

            def isStopped(inner) -> bool:
                return stopped

        self._jsc = _Jsc()


def test_a_spark_address_that_registers_nothing_is_named_in_one_line():
    """An address that accepts connections but is no master (the web UI's 8080, another service): Spark retried for
    ~60 s, logged "All masters are unresponsive" with requests outstanding, and the job failed with "Cannot call
    methods on a stopped SparkContext". The session's check names the master instead (the ~60 s are Spark's own,
    so the end-to-end run is the slow test below)."""
    from rocketstore.errors import ConfigError
    from rocketstore.spark.session import check_registered

    class Session:
        def __init__(self, context) -> None:
            self.sparkContext, self.stopped = context, 0

        def stop(self) -> None:
            self.stopped += 1

    check_registered(Session(_Context(False, "app-20261127020000-0000")), "spark://127.0.0.1:7077")
    check_registered(Session(_Context(True, "local-1")), "local[2]")  # only standalone masters register apps
    for context in (_Context(True, "app-20261127020000-0000"), _Context(False, "spark-application-1")):
        session = Session(context)
        with pytest.raises(ConfigError, match=re.escape("no Spark master answered at spark://127.0.0.1:8080")):
            check_registered(session, "spark://127.0.0.1:8080")
        assert session.stopped == 1


@pytest.mark.slow
def test_an_export_to_an_address_that_is_no_spark_master_fails_in_one_line(tmp_path, request):
    """The end-to-end form of the check above: Spark itself retries registering for ~60 s."""
    import socket
    import threading

    if "slow" not in request.config.getoption("markexpr"):
        pytest.skip("long form (Spark retries for ~60 s): run with -m slow")

    build_store(tmp_path / "s", 5)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted = []
    threading.Thread(target=lambda: accepted.extend(listener.accept() for _ in range(8)), daemon=True).start()
    master = f"spark://127.0.0.1:{listener.getsockname()[1]}"
    try:
        done = subprocess.run([sys.executable, "-m", "rocketstore.cli.app", "export", "--store", str(tmp_path / "s"),
                               "--out", str(tmp_path / "out"), "--master", master, "--max-hash-slot-num", "97",
                               "--max-index-num", "300"],
                              capture_output=True, text=True, timeout=300, check=False)
    finally:
        listener.close()
    lines = [line for line in done.stderr.splitlines() if "jdk.incubator.vector" not in line]
    assert done.returncode == 1 and len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith(f"error: no Spark master answered at {master}: ")
    assert accepted and not (tmp_path / "out").exists()


def test_a_job_waiting_for_executors_is_said_once_not_silent():
    """With every core of the cluster taken by other applications, a job waited in silence until killed (Spark's
    warning is below the level a command runs at; the cluster review). The watcher says it once, and again only
    after executors came and went."""
    import time as clock

    from rocketstore.spark.session import warn_while_starved

    state = {"stages": [1], "executors": 0}

    class Tracker:
        def getActiveStageIds(self):
            return state["stages"]

        def getExecutorInfos(self):
            return [object()] * (1 + state["executors"])  # the driver is listed too

    class Context:
        def statusTracker(self):
            return Tracker()

        class _jsc:
            @staticmethod
            def sc():
                class Sc:
                    def statusTracker(self):
                        return Tracker()
                return Sc()

    class Session:
        sparkContext = Context()

    said: list[str] = []
    stop = warn_while_starved(Session(), "spark://127.0.0.1:7077", after=0.2, every=0.02, say=said.append)
    try:
        clock.sleep(0.6)
        assert len(said) == 1 and "had no executor" in said[0] and "spark://127.0.0.1:7077" in said[0]
        assert "no live worker" in said[0]  # a worker killed mid-job was blamed on other applications' cores
        state["executors"] = 2  # they came: quiet
        clock.sleep(0.3)
        state["stages"] = []  # no job: quiet, whatever the executors
        state["executors"] = 0
        clock.sleep(0.3)
        assert len(said) == 1
        state["stages"] = [2]
        clock.sleep(0.6)
        assert len(said) == 2
    finally:
        stop.set()


def test_an_export_replaces_its_out_in_one_step_and_sweeps_what_killed_exports_left(tmp_path, monkeypatch):
    """``--overwrite`` moved the old export aside, then the new one in: a kill between left --out missing and both
    exports hidden beside it, for good; and each export killed while writing left its hidden sibling, up to a whole
    export, that nothing removed (the Spark kill review). The two are exchanged in one step, and the next export
    removes the siblings of exports whose process is gone."""
    import subprocess
    import sys

    from rocketstore.spark import jobs

    out = tmp_path / "out"
    out.mkdir()
    (out / "old.parquet").write_text("old")
    target = jobs._OutputDir(None, str(out))
    staging = Path(target.sibling())
    assert staging.name.startswith(f".out.export-{jobs._HOST}-{os.getpid()}-")
    staging.mkdir()
    (staging / "new.parquet").write_text("new")
    renames = []
    monkeypatch.setattr(jobs.os, "rename", lambda *a: renames.append(a))  # not the two-rename way
    target.replace_with(str(staging))
    assert [p.name for p in out.iterdir()] == ["new.parquet"] and not staging.exists() and renames == []
    monkeypatch.undo()

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()
    host = jobs._HOST
    left = [tmp_path / f".out.export-{host}-{dead}-0123456789ab",
            tmp_path / f".out.export-{host}-{dead}-0123456789ab.old"]
    kept = [tmp_path / f".out.export-{host}-{os.getpid()}-0123456789ab",  # a live export's
            tmp_path / f".other.export-{host}-{dead}-0123456789ab",  # another --out's
            tmp_path / f".out.export-elsewhere-{dead}-0123456789ab",  # another host's, maybe writing a shared --out now
            tmp_path / f".out.export-{host}-99999999999999999999-0123456789ab"]  # no pid (os.kill overflowed)
    for directory in (*left, *kept):
        directory.mkdir()
        (directory / "part.parquet").write_text("x")
    assert sorted(target.sweep()) == sorted(map(str, left))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*(k.name for k in kept), "out"])


JVM_STDERR = """
import os, subprocess, sys, time
from rocketstore.spark.session import _jvm_stderr_filtered
out = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
os.dup2(out, 2)
before = len(os.listdir("/proc/self/fd"))
with _jvm_stderr_filtered():  # as the driver JVM is started
    child = subprocess.Popen(["sh", "-c", "(printf 'WARNING: Using incubator modules: jdk.incubator.vector\\\\n';"
                              "printf 'a line\\\\n'; printf 'PARTIAL'; sleep 5; printf ' done\\\\n') >&2"])
deadline = time.monotonic() + 4
while "PARTIAL" not in open(sys.argv[1]).read() and time.monotonic() < deadline:
    time.sleep(0.05)
print(repr(open(sys.argv[1]).read()))  # before the child's newline, 5 s after its start
child.wait()
time.sleep(0.3)
print(repr(open(sys.argv[1]).read()))
print(len(os.listdir("/proc/self/fd")) - before)
"""


def test_the_jvms_stderr_loses_only_the_incubator_line_and_holds_nothing_back(tmp_path):
    """Java's "Using incubator modules" line stood above every Spark command's output (the Spark kill review); the
    filter held a line without its newline back until one came, and kept two descriptors for good (the final
    review)."""
    done = subprocess.run([sys.executable, "-c", JVM_STDERR, str(tmp_path / "err")], capture_output=True, text=True,
                          timeout=60, check=True)
    before_newline, at_end, descriptors = done.stdout.splitlines()
    assert before_newline == repr("a line\nPARTIAL")  # forwarded as it came, before its newline
    assert at_end == repr("a line\nPARTIAL done\n")
    assert descriptors == "0"

"""A SparkSession set up for rocketstore: local by default, quiet, and able to import the project.

Settings follow ../shared/notes/SPARK.md: local workers run this interpreter (so they import
rocketstore and pyarrow from the same venv), the log level is ERROR through a generated log4j2
file, the UI and console progress are off, and temporary files stay in one directory. On a
cluster the package (or the whole venv) is shipped to the executors: ``shipping``.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import functools
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

LOG4J2 = """\
rootLogger.level = {level}
rootLogger.appenderRef.stdout.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{{HH:mm:ss}} %p %c{{1}}: %m%n
logger.gateway.name = org.apache.spark.api.python.PythonGatewayServer
logger.gateway.level = error
logger.native.name = org.apache.hadoop.util.NativeCodeLoader
logger.native.level = error
"""
# Loggers that print an executor's failure with its stack trace; the failure reaches Python as an exception
# anyway, where the CLI turns it into one line (``failures.one_line``). Shown with --verbose.
TASK_FAILURE_LOGGERS = ("org.apache.spark.scheduler.TaskSetManager", "org.apache.spark.executor.Executor",
                        "org.apache.spark.scheduler.TaskSchedulerImpl", "org.apache.spark.api.python",
                        "org.apache.spark.sql.execution.datasources", "org.apache.spark.internal.io",
                        # a failed write task: "ERROR Utils: Aborting task" and the committer's cleanup, with traces
                        "org.apache.spark.util.Utils", "org.apache.hadoop.mapreduce.lib.output.FileOutputCommitter",
                        "org.apache.spark.mapred.SparkHadoopMapRedUtil", "org.apache.spark.sql.execution.python",
                        "org.apache.parquet.hadoop")
# An executor's status update reaching a driver whose scheduler just stopped (a failed command exiting) is logged
# at ERROR with a stack trace, "Could not find CoarseGrainedScheduler": a shutdown race, under the command's own
# one-line error (seen in one CI-form run in two of the cluster's failing export). ``--verbose`` still shows it.
SHUTDOWN_RACE_LOGGERS = ("org.apache.spark.network.server.TransportRequestHandler",
                         # and a registration with no master answering: "All masters are unresponsive! Giving up.",
                         # then requests left outstanding (``check_registered`` names the master in one line)
                         "org.apache.spark.scheduler.cluster.StandaloneSchedulerBackend",
                         "org.apache.spark.deploy.client.StandaloneAppClient",
                         "org.apache.spark.network.client.TransportResponseHandler")


def log4j2_properties(verbose: bool) -> str:
    text = LOG4J2.format(level="warn" if verbose else "error")
    if not verbose:
        for n, name in enumerate(TASK_FAILURE_LOGGERS + SHUTDOWN_RACE_LOGGERS):
            text += f"logger.quiet{n}.name = {name}\nlogger.quiet{n}.level = off\n"
    return text


DEFAULT_MASTER = "local[*]"
# Local masters start this wrapper of PySpark's worker daemon: it drops the tracebacks of replies to a JVM that hung up.
QUIET_DAEMON = "rocketstore.spark.daemon"


SCRATCH_PREFIX = "rocketstore-spark-"
OWNER_FILE = ".owner"  # flock-ed by the process that made the directory, for as long as it lives
LEGACY_AGE_S = 24 * 3600  # a directory with no owner file (an older version's) is stale after this
_owner_locks: list[int] = []  # the open, locked owner files of this process (closed only by its exit)


@functools.cache
def _scratch_dir() -> str:
    """One temporary directory per process for Spark's files and the log4j2 configuration.

    It goes at exit; a process that is killed cannot remove it, so each new one removes the directories
    whose owner is gone: the owner holds an flock on a file inside for its whole life, which the kernel
    drops when it dies (whatever pid namespace it ran in), so a lock this process can take is a dead owner's.
    """
    sweep_scratch_dirs()
    scratch = tempfile.mkdtemp(prefix=SCRATCH_PREFIX)
    fd = os.open(os.path.join(scratch, ".owner.tmp"), os.O_CREAT | os.O_WRONLY, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(os.path.join(scratch, ".owner.tmp"), os.path.join(scratch, OWNER_FILE))  # appears locked
    _owner_locks.append(fd)
    atexit.register(shutil.rmtree, scratch, True)
    return scratch


def sweep_scratch_dirs(parent: str | None = None) -> list[str]:
    """Remove the scratch directories under ``parent`` (default: the temp directory) of processes that are gone;
    returns them. A directory being made right now has no owner file yet and is left alone unless it is a day
    old (an older version made none)."""
    parent = parent or tempfile.gettempdir()
    removed = []
    try:
        names = [n for n in os.listdir(parent) if n.startswith(SCRATCH_PREFIX)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(parent, name)
        try:
            fd = os.open(os.path.join(path, OWNER_FILE), os.O_RDONLY)
        except FileNotFoundError:
            with contextlib.suppress(OSError):
                if time.time() - os.stat(path).st_mtime > LEGACY_AGE_S:
                    shutil.rmtree(path, ignore_errors=True)
                    removed.append(path)
            continue
        except OSError:  # not ours to judge (another user's, a file): leave it
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its owner is alive
        finally:
            os.close(fd)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def is_local(master: str) -> bool:
    return master.startswith("local")


_MASTER = re.compile(r"local(\[(\*|[1-9]\d*)(,\s*\d+)?\])?|local-cluster\[[1-9]\d*,\s*[1-9]\d*,\s*[1-9]\d*\]"
                     r"|spark://.+|yarn|k8s://.+")
MASTER_CONNECT_TIMEOUT_S = 5.0


def check_master(master: str, timeout: float = MASTER_CONNECT_TIMEOUT_S) -> None:
    """Refuse a master URL Spark cannot use, before a JVM starts, in one line naming it: Spark printed a Java stack
    trace and "Java gateway process exited" for an unknown scheme, and for a standalone master nobody answers
    retried for ~60 s (its registration timeout is not configurable) and then failed with "Cannot call methods on a
    stopped SparkContext". A ``spark://`` master (each of an HA list) gets a TCP connect first."""
    from ..errors import ConfigError

    if not _MASTER.fullmatch(master):
        raise ConfigError(f"Spark master {master!r} is not a master URL: use local[*], local[N] (N at least 1), "
                          "spark://HOST:PORT, yarn or k8s://HOST:PORT")
    if master == "yarn":  # else spark-submit prints its usage and a stack trace, and PySpark "gateway exited"
        if not (os.environ.get("HADOOP_CONF_DIR") or os.environ.get("YARN_CONF_DIR")):
            raise ConfigError("Spark master 'yarn' needs HADOOP_CONF_DIR or YARN_CONF_DIR set to the cluster's "
                              "Hadoop configuration directory")
        return
    if master.startswith("k8s://"):  # an API server nobody answers: a Kubernetes client's stack trace, 50 lines
        address = re.sub(r"^https?://", "", master[len("k8s://"):]).split("/")[0]
        scheme_port = "80" if master[len("k8s://"):].startswith("http://") else "443"
        addresses = [address if re.search(r":\d+$", address) else f"{address}:{scheme_port}"]
    elif master.startswith("spark://"):
        addresses = [address.strip() for address in master[len("spark://"):].split(",")]
    else:
        return
    errors = []
    for address in addresses:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"Spark master {master!r}: {address!r} is not HOST:PORT")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
            return
        except OSError as exc:
            errors.append(f"{address}: {exc.strerror or exc}")
    raise ConfigError(f"cannot reach the Spark master {master} ({'; '.join(errors)})")


def spark_session(master: str | None = None, app_name: str = "rocketstore", *, driver_memory: str = "2g",
                  shuffle_partitions: int | None = None, extra_conf: dict[str, str] | None = None,
                  ship_env: bool = False, verbose: bool = False):
    """Get or create the SparkSession, with the ``rocketmq`` data source registered.

    ``master`` defaults to ``local[*]``; pass ``spark://host:7077`` (or ``yarn``, ``k8s://...``) for a
    cluster. On a cluster the rocketstore package is shipped to the executors, whose Python is
    ``PYSPARK_PYTHON`` (default: this interpreter's path) and must have numpy, pyarrow and numba;
    ``ship_env`` ships this whole virtual environment instead (see ``shipping``). The stores must be
    at the same path on every worker. ``verbose`` lets Spark's warnings and executors' stack traces through.
    """
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    from . import classcache, shipping

    master = master or DEFAULT_MASTER
    local = is_local(master)
    if SparkContext._gateway is None or SparkContext._active_spark_context is None:
        check_master(master)  # a session to reuse has one already
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    if local:
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # a cluster's executors must reach the driver
    scratch = _scratch_dir()
    log_config = os.path.join(scratch, "log4j2-verbose.properties" if verbose else "log4j2.properties")
    with open(log_config, "w") as f:
        f.write(log4j2_properties(verbose))
    java_opts = f"-Dlog4j2.configurationFile=file:{log_config} -Djava.io.tmpdir={scratch}"
    launching = SparkContext._gateway is None  # else getOrCreate reuses a JVM already running
    driver_opts = f"{java_opts} {classcache.java_options()}".rstrip() if launching else java_opts
    cores = os.cpu_count() or 2
    builder = (
        SparkSession.builder.master(master).appName(app_name)
        .config("spark.driver.memory", driver_memory)
        .config("spark.driver.extraJavaOptions", driver_opts)
        .config("spark.executor.extraJavaOptions", java_opts if local else "")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", str(shuffle_partitions or max(2, cores)))
        .config("spark.sql.session.timeZone", "UTC")
        # exports keep born and store times as Parquet timestamps in microseconds, not INT96 (which readers that
        # take it for nanoseconds, pyarrow's default, wrap around outside 1677-2262)
        .config("spark.sql.parquet.outputTimestampType", "TIMESTAMP_MICROS")
        .config("spark.local.dir", scratch)
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        # An executor talks to its Python workers over a Unix socket instead of loopback TCP: each task's
        # small request/reply exchanges waited on delayed ACKs (47 tasks of 8 MiB: 5.1 -> 2.9 s, local[1]).
        .config("spark.python.unix.domain.socket.enabled", "true")
    )
    if local:
        builder = (builder.config("spark.default.parallelism", str(max(2, cores)))
                   .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
                   .config("spark.python.daemon.module", QUIET_DAEMON))
    python = os.environ.get("PYSPARK_PYTHON", sys.executable)
    jvm_directory = None
    if ship_env and not local:
        builder = builder.config("spark.archives", f"{shipping.packed_environment()}#{shipping.ENV_NAME}")
        python, jvm_directory = shipping.ENV_PYTHON, shipping.driver_directory(scratch)
    for key, value in (extra_conf or {}).items():
        builder = builder.config(key, value)
    # PySpark reads the executors' interpreter from the environment when the context is created.
    saved = os.environ.get("PYSPARK_PYTHON")
    os.environ["PYSPARK_PYTHON"] = python
    try:
        with shipping.working_directory(jvm_directory) if jvm_directory else contextlib.nullcontext(), \
                _jvm_stderr_filtered() if launching else contextlib.nullcontext():
            try:
                spark = builder.getOrCreate()
            except Exception as exc:
                if master.startswith("spark://") and "stopped SparkContext" in str(exc):
                    raise _unregistered(master) from None  # stopped while PySpark was still setting it up
                raise
    finally:
        if jvm_directory is not None:
            if saved is None:
                del os.environ["PYSPARK_PYTHON"]
            else:
                os.environ["PYSPARK_PYTHON"] = saved
    check_registered(spark, master)
    if launching:
        classcache.watch(getattr(SparkContext._gateway, "proc", None))
        classcache.check_mapped(spark._jvm.java.lang.ProcessHandle.current().pid())
    spark.sparkContext.setLogLevel("WARN" if verbose else "ERROR")
    if not local:
        # Before the source is registered: its planner on the driver takes the Python files known then.
        spark.sparkContext.addPyFile(str(shipping.package_zip(scratch)))
    register(spark)
    return spark


_JVM_NOISE = (b"WARNING: Using incubator modules: jdk.incubator.vector\n",)


@contextlib.contextmanager
def _jvm_stderr_filtered() -> Iterator[None]:
    """Start the driver JVM with its stderr through a pipe that drops the lines in ``_JVM_NOISE``: Spark's launcher
    adds ``--add-modules=jdk.incubator.vector`` to every JVM, and Java then says so on stderr, a line above every
    Spark command's output and its one-line error (the Spark kill review). Everything else the JVM (and the Python
    workers it starts) writes reaches this process's stderr unchanged, as it comes, for as long as this process runs
    (what the JVM writes after this process has exited is lost: nobody reads the pipe then)."""
    try:
        read_end, write_end = os.pipe()
    except OSError:  # no descriptors to spare: the line shows, nothing else changes
        yield
        return
    stderr = 2  # the descriptor the JVM inherits, whatever sys.stderr is (a test's capture)
    try:
        saved = os.dup(stderr)
    except OSError:
        os.close(read_end)
        os.close(write_end)
        yield
        return

    def write(data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(saved, view):]

    def forward() -> None:
        pending = b""
        try:
            while chunk := os.read(read_end, 65536):
                *lines, pending = (pending + chunk).split(b"\n")
                write(b"".join(line + b"\n" for line in lines if line + b"\n" not in _JVM_NOISE))
                if pending and not any(noise.startswith(pending) for noise in _JVM_NOISE):
                    write(pending)  # a line without its newline yet (a prompt, a crash): now, not at the newline
                    pending = b""
            write(pending)
        except OSError:
            pass
        finally:
            os.close(read_end)
            os.close(saved)

    threading.Thread(target=forward, name="rocketstore-jvm-stderr", daemon=True).start()
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    os.dup2(write_end, stderr)  # the JVM inherits this descriptor when it is started inside the block
    os.close(write_end)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os.dup2(saved, stderr)


def check_registered(spark, master: str) -> None:
    """A ``spark://`` address that accepts connections but is no master (its web UI's port, another service) passes
    ``check_master``; Spark then retries registering for ~60 s, gives up, stops the context and fails the first
    job with "Cannot call methods on a stopped SparkContext". Named here instead, in one line. A standalone
    master names the applications it registers ``app-...``; an unregistered context keeps Spark's fallback id."""
    if not master.startswith("spark://"):
        return
    context = spark.sparkContext
    if context._jsc.sc().isStopped() or not str(context.applicationId).startswith("app-"):
        with contextlib.suppress(Exception):
            spark.stop()
        raise _unregistered(master)


STARVED_AFTER_S = 30.0


def warn_while_starved(spark, master: str, *, after: float = STARVED_AFTER_S, every: float = 1.0,
                       say: Callable[[str], None] | None = None) -> threading.Event:
    """Say once on stderr when a job has waited ``after`` seconds with no executor: a cluster whose cores or memory
    other applications hold makes Spark wait for them, and its one warning ("Initial job has not accepted any
    resources") is below the log level a command runs at, so a job sat silent until killed (the cluster review).
    Returns the event that stops the watcher (it is a daemon thread: the process's exit ends it too)."""
    say = say or (lambda text: print(text, file=sys.stderr, flush=True))
    context = spark.sparkContext
    stop = threading.Event()

    def executors() -> int:  # the tracker lists the driver too
        return len(context._jsc.sc().statusTracker().getExecutorInfos()) - 1

    def watch() -> None:
        waited, said = 0.0, False
        while not stop.wait(every):
            with contextlib.suppress(Exception):  # a stopping context: nothing to say
                if context.statusTracker().getActiveStageIds() and executors() <= 0:
                    waited += every
                    if waited >= after and not said:
                        said = True
                        say(f"waiting: this application has had no executor on {master} for {int(waited)} s: "
                            "the cluster has no live worker (one running the job stopped?) or no free cores or "
                            "memory for it (other applications hold them, or --conf asks for more than a worker "
                            "has), and Spark waits (Ctrl-C stops)")
                else:
                    waited, said = 0.0, False

    threading.Thread(target=watch, name="rocketstore-starved", daemon=True).start()
    return stop


def _unregistered(master: str) -> Exception:
    from ..errors import ConfigError

    return ConfigError(f"no Spark master answered at {master}: something accepts connections there but did not "
                       "register this application (a standalone master's port is 7077 unless set otherwise; 8080 "
                       "is its web UI)")


def stop_quietly(spark) -> None:
    """Stop the session before this process exits, ending the driver JVM's Python daemons first.

    With executors reaching their Python workers over Unix sockets, a worker the JVM leaves idle in its pool
    answers the socket's close with a report that cannot be written, and the daemon prints that
    ``BrokenPipeError`` on the driver's stderr, under a command's one-line error (one run in two of a failing
    export here). A daemon told to stop (SIGTERM) hangs its workers up first, and they end silently."""
    with contextlib.suppress(Exception):
        end_python_daemons(spark)
    with contextlib.suppress(Exception):
        spark.stop()


def end_python_daemons(spark) -> list[int]:
    """SIGTERM to each Python worker daemon of the session's JVM; returns their pids."""
    daemons = _python_daemons(spark._jvm.java.lang.ProcessHandle.current().pid())
    for pid in daemons:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    return daemons


def _python_daemons(jvm_pid: int) -> list[int]:
    """The JVM's child processes running PySpark's worker daemon (its direct children only)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
            parent = int(stat[stat.rindex(b")") + 2 :].split()[1])
            if parent != jvm_pid:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read().split(b"\0")
                if b"pyspark.daemon" in command or QUIET_DAEMON.encode() in command:
                    found.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not ours to read
    return found


def register(spark) -> None:
    """Register the ``rocketmq`` format with a session (idempotent)."""
    from .source import RocketMQDataSource

    spark.dataSource.register(RocketMQDataSource)

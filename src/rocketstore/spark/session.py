"""A SparkSession set up for rocketstore: local by default, quiet, and able to import the project.

Settings follow ../shared/notes/SPARK.md: workers run this interpreter (so they import
rocketstore and pyarrow from the same venv), the log level is ERROR through a generated log4j2
file, the UI and console progress are off, and temporary files stay in one directory.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import sys
import tempfile

LOG4J2 = """\
rootLogger.level = error
rootLogger.appenderRef.stdout.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n
logger.gateway.name = org.apache.spark.api.python.PythonGatewayServer
logger.gateway.level = error
logger.native.name = org.apache.hadoop.util.NativeCodeLoader
logger.native.level = error
"""

DEFAULT_MASTER = "local[*]"


@functools.cache
def _scratch_dir() -> str:
    """One temporary directory per process for Spark's files and the log4j2 configuration."""
    scratch = tempfile.mkdtemp(prefix="rocketstore-spark-")
    atexit.register(shutil.rmtree, scratch, True)
    with open(os.path.join(scratch, "log4j2.properties"), "w") as f:
        f.write(LOG4J2)
    return scratch


def spark_session(master: str | None = None, app_name: str = "rocketstore", *, driver_memory: str = "2g",
                  shuffle_partitions: int | None = None, extra_conf: dict[str, str] | None = None):
    """Get or create the SparkSession, with the ``rocketmq`` data source registered.

    ``master`` defaults to ``local[*]``; pass ``spark://host:7077`` or ``yarn`` for a cluster (the
    workers then need rocketstore installed and the stores on a shared path).
    """
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    scratch = _scratch_dir()
    java_opts = f"-Dlog4j2.configurationFile=file:{scratch}/log4j2.properties -Djava.io.tmpdir={scratch}"
    cores = os.cpu_count() or 2
    builder = (
        SparkSession.builder.master(master or DEFAULT_MASTER).appName(app_name)
        .config("spark.driver.memory", driver_memory)
        .config("spark.driver.extraJavaOptions", java_opts)
        .config("spark.executor.extraJavaOptions", java_opts)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", str(shuffle_partitions or max(2, cores)))
        .config("spark.default.parallelism", str(max(2, cores)))
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.local.dir", scratch)
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
    )
    if (master or DEFAULT_MASTER).startswith("local"):
        builder = builder.config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
    for key, value in (extra_conf or {}).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark


def register(spark) -> None:
    """Register the ``rocketmq`` format with a session (idempotent)."""
    from .source import RocketMQDataSource

    spark.dataSource.register(RocketMQDataSource)

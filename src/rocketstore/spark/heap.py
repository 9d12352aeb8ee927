"""The Python worker's heap between tasks.

PySpark's daemon runs a full ``gc.collect()`` after every task of a reused Python worker. Once
numba, llvmlite, pyarrow and pyspark are loaded that walks every object they made: ~100 ms of a
core per task here, more than decoding a 64 MiB log range costs (47 tasks of 8 MiB: 4.96 s of
worker CPU, 1.2 s of it decoding). ``settle_after_task`` collects once at the end of a task and
moves what survives into the permanent generation, so the daemon's collection only walks what later
tasks allocate. Objects that survive stay collectable by reference counting; only a cycle among them
that becomes garbage later is never reclaimed, which long-lived module state does not do.
"""

from __future__ import annotations

import gc


def in_spark_task() -> bool:
    """True in an executor's Python worker while it runs a task."""
    try:
        from pyspark import TaskContext
    except ImportError:  # pragma: no cover - only called where pyspark runs
        return False
    return TaskContext.get() is not None


def settle_after_task() -> bool:
    """Collect and freeze the worker's heap; does nothing outside a Spark task (a user's own process keeps
    its collector as it was). Returns whether it froze."""
    if not in_spark_task():
        return False
    gc.collect()
    gc.freeze()
    return True

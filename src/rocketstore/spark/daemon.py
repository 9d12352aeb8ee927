"""PySpark's Python worker daemon, silent about workers whose JVM has hung up on them.

An executor asks the daemon for a worker over a Unix socket and may close the socket before the forked worker
answers (a task cancelled because another failed) or while an idle worker waits in its pool. The worker's
reply then fails with ``BrokenPipeError`` and PySpark prints the traceback on the executor's stderr, which in
local mode is the command's own stderr: a stack trace under a command's one-line error (one CI run in four of a
failing export). Nobody is left to read that reply, so nothing is printed; every other error still is.

Used for local masters only (``session.spark_session``): it must import before any shipped file is on the
path, and a cluster's executors log their stderr, away from the user. It imports nothing of rocketstore's
but this module (the package's ``__init__`` is lazy): the daemon forks workers, so it must start no thread.
"""

from __future__ import annotations

import builtins
import sys
import traceback
import types

from pyspark import daemon

_HUNG_UP = (BrokenPipeError, ConnectionResetError)


def _hung_up() -> bool:
    return isinstance(sys.exc_info()[1], _HUNG_UP)


def _print_exc(*args, **kwargs) -> None:
    if not _hung_up():
        traceback.print_exc(*args, **kwargs)


def _print(*args, **kwargs) -> None:
    """The daemon's only other report of a hang-up: "failed to flush the output to the worker process"."""
    if not _hung_up():
        builtins.print(*args, **kwargs)


# The daemon's module namespace, not the interpreter's: its workers' own reports are untouched.
_quiet_traceback = types.ModuleType("traceback")
_quiet_traceback.__dict__.update(traceback.__dict__, print_exc=_print_exc)
daemon.traceback = _quiet_traceback
daemon.print = _print

if __name__ == "__main__":
    daemon.manager()

"""Executor failures as one line: the rocketstore error and the task that raised it.

A failed task reaches the driver as a Python traceback inside a Java exception inside another,
several screens long. The executor knows what the operator needs (which error, which task, which
host); ``in_task`` writes that into the exception as a note, and ``one_line`` finds the error
line and the note again in whatever Spark raised on the driver.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from contextlib import contextmanager

NOTE_PREFIX = "rocketstore task: "
_CAUSED_BY = "Caused by: "
_ERROR_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?([A-Z]\w*(?:Error|Exception|Exit)): (.+)$")


def task_description() -> str | None:
    """This Spark task (on an executor), or None outside one."""
    try:
        from pyspark import TaskContext
    except ImportError:  # pragma: no cover - only called where pyspark runs
        return None
    context = TaskContext.get()
    if context is None:
        return None
    return (f"partition {context.partitionId()} of stage {context.stageId()}, attempt {context.attemptNumber()}, "
            f"on host {socket.gethostname()}")


@contextmanager
def in_task() -> Iterator[None]:
    """Note the task on any exception leaving the block (it travels to the driver in the traceback)."""
    try:
        yield
    except Exception as exc:
        where = task_description()
        if where is not None and not any(n.startswith(NOTE_PREFIX) for n in getattr(exc, "__notes__", ())):
            exc.add_note(NOTE_PREFIX + where)
        raise


def one_line(exc: BaseException) -> str:
    """The line an operator needs from a Spark failure: ``ErrorType: message (the task, the host)``."""
    text = str(exc)
    lines = [line.strip().lstrip(": ") for line in text.splitlines() if line.strip().lstrip(": ")]
    where = next((line[len(NOTE_PREFIX):] for line in lines if line.startswith(NOTE_PREFIX)), None)
    errors = [m for m in map(_ERROR_LINE.match, lines) if m]
    if errors:
        # Python's traceback puts the raised exception last; Java's summary puts its own first, and its root cause
        # last ("Caused by:"): a task that failed writing a file says why only there (No space left on device)
        python = "Traceback (most recent call last)" in text
        match = errors[-1] if python else errors[0]
        message = f"{match.group(1)}: {match.group(2)}"
        causes = [] if python else [m for m in map(_ERROR_LINE.match, (line[len(_CAUSED_BY):] for line in lines
                                                                         if line.startswith(_CAUSED_BY))) if m]
        if causes and causes[-1].group(2) not in message:
            message = re.sub(r"\s*SQLSTATE: \w+$", "", message)
            message += f" (caused by {causes[-1].group(1)}: {causes[-1].group(2)})"
    else:
        message = lines[0] if lines else repr(exc)
    message = re.sub(r"\s*SQLSTATE: \w+$", "", message)
    return f"{message} (in {where})" if where else message

"""Where an import into a store stands, so that one stopped by a crash finishes with each row stored once.

An import appends a dataset's rows in batches, one ``put_batch`` each. Before each batch it records, durably, how
many rows are stored, where the log ends and what the batch's first row is. A crash leaves none of a batch, all of
it or a prefix (it is one crash-atomic append per segment it spans; after an OS crash the page cache may have
reached the disk in part), all stamped with one store time. The journal and the log together then tell how many
rows are stored: the rows it records, plus those of the batch it was about to write found after the recorded end.
When the import has stored its last row and flushed the log, the journal says so (``complete``) and stays: the same
import run again (after a kill before it could report, or a close that failed) then stores nothing, where removing
the journal had it store every row a second time. Another import replaces a complete journal.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import ConfigError
from .mapped.file import remove_file, replace_file

if TYPE_CHECKING:
    from .store import MessageStore

JOURNAL_FILE = "importProgress.json"
_REAL_TOPIC = "REAL_TOPIC"  # a delayed or timer row is stored under a system topic, its own topic here


@dataclass(frozen=True, slots=True)
class ImportProgress:
    source: dict  # what is imported: its files and row count (or its plan's hash), as ``import_messages`` names it
    rows_done: int  # rows of the source stored before the pending batch
    log_end: int  # the commit log's end before the pending batch
    batch_rows: int = 0  # the pending batch (0: none)
    batch_topic: str = ""  # its first row's topic
    batch_body_crc: int = 0  # and body CRC, as the record's BODYCRC holds it
    complete: bool = False  # every row stored and flushed: the import is over

    @staticmethod
    def body_crc(body: bytes) -> int:
        return zlib.crc32(body) & 0x7FFFFFFF


class ImportJournal:
    """The journal file of one store (``importProgress.json`` in its root; a broker ignores it)."""

    def __init__(self, root: str | Path) -> None:
        self.path = Path(root) / JOURNAL_FILE

    def load(self) -> ImportProgress | None:
        """The recorded progress, None without a journal; a journal that does not parse is a ``ConfigError``."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read the import journal {self.path}: {exc}") from None
        damaged = (f"the import journal {self.path} is damaged ({{}}): import with --from-row set to the rows the "
                   "store holds (the journal is then replaced)")
        try:
            raw = json.loads(text)
            seal = raw.pop("crc", None) if isinstance(raw, dict) else None
            progress = ImportProgress(**raw)
        except (ValueError, TypeError, RecursionError) as exc:  # RecursionError: nesting past the limit
            raise ConfigError(damaged.format(exc)) from None
        if seal is not None and seal != _seal(raw):  # a journal of an earlier version has none
            raise ConfigError(damaged.format("its content does not match its crc"))
        numbers = (progress.rows_done, progress.log_end, progress.batch_rows, progress.batch_body_crc)
        if not isinstance(progress.source, dict) or not isinstance(progress.batch_topic, str) \
                or type(progress.complete) is not bool or any(type(n) is not int or n < 0 for n in numbers):
            raise ConfigError(damaged.format("a field of the wrong type"))
        rows = progress.source.get("rows")
        if type(rows) is int and progress.rows_done + progress.batch_rows > rows:
            raise ConfigError(damaged.format(f"{progress.rows_done} rows stored and {progress.batch_rows} pending "
                                             f"of a source of {rows}"))
        return progress

    def record(self, progress: ImportProgress) -> None:
        """Replace the journal durably (a crash leaves the old one or the new), sealed with a CRC of its fields:
        a journal damaged into other numbers that still parse would skip rows, or store them twice."""
        fields = asdict(progress)
        replace_file(self.path, json.dumps({**fields, "crc": _seal(fields)}, sort_keys=True).encode())

    def clear(self) -> None:
        remove_file(self.path)


def _seal(fields: dict) -> int:
    return zlib.crc32(json.dumps(fields, sort_keys=True).encode())


def describe_source(source: dict) -> str:
    """An import's source as an operator recognises it (``import_messages`` names it by its files)."""
    if "first" in source:
        what = f"{source.get('files')} file(s) from {source['first']} ({source.get('rows')} rows)"
    else:
        what = f"a DataFrame of {source.get('rows')} rows"
    how = {"arrow": "read in this process (--no-spark)", "spark": "read by Spark"}.get(
        source.get("reader"), "read by Spark in an earlier version's order")
    return f"{what}, {how}"


def rows_stored(store: MessageStore, progress: ImportProgress) -> int:
    """How many rows of the journal's source the store holds: those it records, and those of its pending batch
    found after the recorded end: from the first record with the batch's first topic and body CRC on, the records
    stored with it (one store time for the whole batch), at most the batch's rows. Records before that one are
    the store's own (a delayed message delivered meanwhile)."""
    log = store.commit_log
    if log.max_offset < progress.log_end:  # the import flushed the log before recording: damage, or a hand
        raise ConfigError(
            f"the store's log ends at {log.max_offset}, before the {progress.log_end} where the import's journal "
            f"counted {progress.rows_done} rows stored: some of them are gone. Count what the store holds and "
            "import with --from-row")
    if not progress.batch_rows:
        return progress.rows_done
    start = max(progress.log_end, log.min_offset)
    if start >= log.max_offset:
        return progress.rows_done
    found, stamp = 0, None
    for msg in store.iter_messages(start):
        if stamp is None:
            topic = msg.topic if msg.topic == progress.batch_topic else msg.get_property(_REAL_TOPIC)
            if topic == progress.batch_topic and msg.body_crc == progress.batch_body_crc:
                stamp, found = msg.store_timestamp, 1
        elif msg.store_timestamp == stamp and found < progress.batch_rows:
            found += 1
        else:
            break
        if found == progress.batch_rows:
            break
    return progress.rows_done + found


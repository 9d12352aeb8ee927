"""The list of index files of a store (RocketMQ's ``IndexService``).

What gets indexed for each dispatched record (except ROLLBACK): ``topic#UNIQ_KEY``, then
``topic#k`` for every non-empty space-separated KEYS token, into the newest file, rolling to a
new file (named by its local creation time, ``yyyyMMddHHmmssSSS``) when it is full.

Where rocketstore departs from RocketMQ, on purpose:

* after a crash RocketMQ deletes every index file newer than the checkpoint, so older messages
  stop being findable by key (apache/rocketmq #3868, #8007). Here the newest file is repaired
  instead: entries pointing past the recovered end of the commit log are unlinked from their
  chains, a slot torn by a kill between its write and the count update is re-linked, and the
  header is rewritten; re-dispatch then adds what is missing;
* index files are flushed periodically and at shutdown, not only when full (#4463);
* ``candidates`` walks chains without RocketMQ's ``maxNum`` cut-off and with a window
  widened by the one-second rounding, so an exact query can keep walking past colliding keys.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..checkpoint import StoreCheckpoint
from ..codec.hashing import index_key_hash
from ..config import StoreConfig
from ..errors import ConfigError, CorruptDataError, StoreIOError
from ..mapped.file import STAGING_DIR, destroy_all, unlink_again, unused_path
from ..message import SysFlag
from . import _kernels as _ik
from .bulk import key_candidates, put_hashes
from .file import INDEX_ENTRY_SIZE, INDEX_HEADER_SIZE, IndexFile, index_file_size

INDEX_DIR = "index"
_NAME = re.compile(r"\d{17}")

log = logging.getLogger(__name__)

StoreTimeLookup = Callable[[int], int]  # store time of the record at a commit-log offset, -1 if none


def index_file_name(now_ms: int) -> str:
    """``UtilAll.timeMillisToHumanString``: local time as yyyyMMddHHmmssSSS."""
    return time.strftime("%Y%m%d%H%M%S", time.localtime(now_ms // 1000)) + f"{now_ms % 1000:03d}"


def index_name_ms(name: str) -> int:
    """The epoch ms an ``index_file_name`` names (-1 when ``name`` is not one)."""
    try:
        return int(time.mktime(time.strptime(name[:14], "%Y%m%d%H%M%S"))) * 1000 + int(name[14:17])
    except (ValueError, OverflowError):
        return -1


def build_key(topic: str, key: str) -> str:
    return f"{topic}#{key}"


@dataclass(frozen=True, slots=True)
class IndexRequest:
    """What the index needs of one record."""

    topic: str
    phy_offset: int
    store_timestamp: int
    sys_flag: int
    uniq_key: str | None
    keys: str | None

    def index_keys(self) -> list[str]:
        return index_keys(self.uniq_key, self.keys)


def index_keys(uniq_key: str | None, keys: str | None) -> list[str]:
    """What ``buildIndex`` puts for a record: UNIQ_KEY first, then every non-empty KEYS token, in order,
    duplicates kept (as RocketMQ)."""
    out = [uniq_key] if uniq_key else []
    if keys:
        out.extend(k for k in keys.split(" ") if k)
    return out


def check_geometry(directory: Path, hash_slot_num: int, index_num: int) -> None:
    """Refuse an open whose index geometry is not the files': a file of RocketMQ's size for another geometry
    (40 + 84 * S bytes: S slots, 4 * S entries) is no damaged file, and taking it for one cost every key query of a
    read-only open (its file skipped: nothing found) or a writer's whole index (set aside, rebuilt at the wrong
    size). A damaged file is cut short or grown at any byte, almost never to such a size."""
    configured = index_file_size(hash_slot_num, index_num)
    try:
        entries = [e for e in os.scandir(directory) if _NAME.fullmatch(e.name) and e.is_file()]
    except FileNotFoundError:
        return
    except OSError as exc:
        raise StoreIOError(exc.errno, f"cannot list index directory {directory}: {exc.strerror}") from exc
    for entry in sorted(entries, key=lambda e: e.name):
        try:
            size = entry.stat().st_size
        except FileNotFoundError:
            continue  # a live writer's retention deleted it since the listing
        if size != configured and size > 40 and (size - 40) % 84 == 0:
            slots = (size - 40) // 84
            raise ConfigError(
                f"index file {directory / entry.name} is {size} bytes, the size of maxHashSlotNum={slots} and "
                f"maxIndexNum={4 * slots}, not of the configured max_hash_slot_num={hash_slot_num} and "
                f"max_index_num={index_num} ({configured} bytes): open with the store's index geometry")


def _empty(path: Path) -> bool:
    try:
        return path.stat().st_size == 0
    except OSError:
        return False


class IndexService:
    """Owns ``index/``: building, querying, repairing and expiring index files."""

    def __init__(self, root: Path, config: StoreConfig, checkpoint: StoreCheckpoint, *, read_only: bool = False,
                 clock: Callable[[], int] | None = None) -> None:
        self.directory = root / INDEX_DIR
        self.config = config
        self.checkpoint = checkpoint
        self.read_only = read_only
        self.hash_slot_num = config.max_hash_slot_num
        self.index_num = config.max_index_num
        self.files: tuple[IndexFile, ...] = ()  # replaced, never changed in place: queries read it unlocked
        self.lock = threading.RLock()
        self._clock = clock or (lambda: time.time_ns() // 1_000_000)
        self.dirty = False
        self.set_aside: str | None = None  # where a damaged index was moved
        self.damaged: list[str] = []  # files a read-only open found damaged and skips
        self.load_errors: dict[str, CorruptDataError] = {}  # of those, the ones ``load`` could not map, by name
        self.undeleted: list[Path] = []  # files retention gave up but could not unlink: tried again by the next pass
        # read-only: keys of the records past the files' last entry, held in memory (``add_tail``)
        self.tail: dict[int, list[tuple[int, int]]] = {}

    # --- load and repair ---------------------------------------------------------------------

    def load(self) -> None:
        """Map the index files. If one is damaged (wrong size, impossible header), a writer moves the
        whole ``index/`` directory to ``recovery/`` and starts afresh (the store then re-indexes the
        log); a read-only open skips the damaged file."""
        if not self.directory.is_dir():
            return
        names = sorted(e.name for e in os.scandir(self.directory) if _NAME.fullmatch(e.name) and e.is_file())
        if names and _empty(self.directory / names[-1]):
            # a broker killed between creating its newest file and mapping it (which gives it its size): nothing
            # was ever in it, so it goes, as an empty last commit-log or queue file does; taken for damage, the
            # whole index was set aside and the log indexed again
            if not self.read_only:
                (self.directory / names[-1]).unlink(missing_ok=True)
                log.info("deleted the empty newest index file %s (made, never written)", names[-1])
            names.pop()
        for name in names:
            try:
                self.files += (IndexFile.open(self.directory / name, self.hash_slot_num, self.index_num,
                                              read_only=self.read_only),)
            except StoreIOError as exc:
                if not self.read_only or exc.errno != errno.ENOENT:
                    raise
                continue  # a live writer's retention deleted it since the listing
            except CorruptDataError as exc:
                log.error("index file %s is damaged: %s", name, exc)
                if not self.read_only:
                    self._set_aside()
                    return
                self.damaged.append(name)
                self.load_errors[name] = exc
        if len(self.files) > 1 and self.files[-1].index_count <= 1 \
                and self.files[-1].end_phy_offset < self.files[-2].end_phy_offset:
            # a roll killed between linking its new file (zeros) and writing the offset and time it inherits: its
            # header says it starts at offset 0 and time 0, so an open's dispatch indexed the whole log again into
            # it (every key twice) and a time-bounded lookup stopped at it. Nothing was ever put in it: it goes, as
            # an empty newest file does (a reader only stops using it); the next put rolls again
            stale = self.files[-1]
            self.files = self.files[:-1]
            if self.read_only:
                stale.close()
            else:
                stale.destroy()
                log.info("deleted the newest index file %s: made by a roll, never written (its header is zero)",
                         stale.path.name)
        if not self.read_only and self.files and self.config.preallocate:  # the one file a writer stores into
            newest = self.files[-1]
            newest.reserve(index_file_size(self.hash_slot_num, self.index_num))

    def _set_aside(self) -> None:
        for index in self.files:
            index.close()
        self.files = ()
        target = unused_path(self.directory.parent / "recovery", f"index-{time.strftime('%Y%m%d%H%M%S')}")
        os.replace(self.directory, target)
        self.set_aside = str(target)
        log.warning("moved the damaged index to %s; it is rebuilt from the commit log", target)

    def repair(self, log_end: int, store_time: StoreTimeLookup) -> int:
        """Make the newest files consistent with a commit log that ends at ``log_end``.

        Returns how many entries were unlinked. Files holding nothing below ``log_end`` are deleted.
        """
        if self.read_only:
            return 0
        removed = 0
        with self.lock:
            while self.files:
                newest = self.files[-1]
                if newest.index_count > 1 and newest.begin_phy_offset >= log_end and len(self.files) > 1:
                    removed += newest.index_count - 1
                    newest.destroy()
                    self.files = self.files[:-1]
                    continue
                removed += _repair_file(newest, log_end, store_time)
                break
        return removed

    def check_chains(self, newest: int = 2) -> bool:
        """Every chain of the newest files must run strictly backwards (each entry's predecessor has a smaller
        number, every slot points at a counted entry), which is what every valid file satisfies and what rules
        out a cycle. A damaged file would silently cut a key's chain short (a key with 50 messages found
        once), so a writer sets the whole index aside and the store re-indexes the log (``_reput_start``
        starts at the log's beginning when no index file is left, so what any set-aside file covered,
        newest or not, is indexed again). A read-only open must not write: it only stops using the damaged
        files, with a warning, and names them in ``damaged``. Only the newest files are checked, to bound the
        cost of an open (one strided pass over each file's entries). Returns True if all is well."""
        with self.lock:
            for index in list(self.files[-newest:]):
                problem = chain_problem(index, live=self.read_only)
                if problem is None:
                    continue
                if not self.read_only:
                    log.error("index file %s is damaged: %s", index.path.name, problem)
                    self._set_aside()
                    return False
                log.warning("index file %s is damaged (%s); this read-only open skips it, so keys only it "
                            "holds are not found until a writer opens the store and rebuilds it",
                            index.path.name, problem)
                self.damaged.append(index.path.name)
                self.files = tuple(f for f in self.files if f is not index)
                index.close()
            return not self.damaged

    def check_times(self, store_time: StoreTimeLookup, newest: int = 2) -> list[str]:
        """Hold the newest files' header times to their entries' records: beginTimestamp is the first entry's
        record's store time and endTimestamp the last one's (``putKey`` sets them so). A lookup skips a file, and
        stops at entries, by these times, so a damaged one hid keys from every time-bounded query. A wrong time
        is taken from the log: in memory for a read-only open, in the file for a writer (a live writer's reader
        checks the begin only: its end moves with every put). Returns the names of the files corrected."""
        corrected = []
        with self.lock:
            for index in self.files[-newest:]:
                count = index.index_count
                if count <= 1:
                    continue
                begin = store_time(index.entry(1)[1])
                end = index.end_timestamp if self.read_only else store_time(index.entry(count - 1)[1])
                if begin <= 0 or end <= 0 or (begin, end) == (index.begin_timestamp, index.end_timestamp):
                    continue  # a record the log no longer holds (or not yet, for a reader): nothing to hold it to
                log.warning("index file %s says its keys were stored in [%d, %d] ms, its entries' records in [%d, "
                            "%d]: the header is damaged; %s", index.path.name, index.begin_timestamp,
                            index.end_timestamp, begin, end,
                            "this read-only open uses the records' times" if self.read_only else "rewritten")
                if self.read_only:
                    index.begin_timestamp = begin
                else:
                    index._set_i64(0, begin)
                    index._set_i64(8, end)
                    index.flush()
                corrected.append(index.path.name)
        return corrected

    # --- build -------------------------------------------------------------------------------

    def _last_file_for_write(self) -> IndexFile:
        """``getAndCreateLastIndexFile``: the newest file, or a new one continuing a full one."""
        last = self.files[-1] if self.files else None
        if last is not None and not last.is_write_full():
            return last
        end_phy = end_ts = 0
        if last is not None:
            end_phy, end_ts = last.end_phy_offset, last.end_timestamp
            last.flush()  # RocketMQ flushes a full file in the background; it is one msync, done here
            self.checkpoint.index_msg_timestamp = last.end_timestamp
            self.checkpoint.flush()
        self.directory.mkdir(parents=True, exist_ok=True)
        now = self._clock()
        # later than the newest file's name: files are ordered by name, and after the clock stepped back (NTP) a new
        # file named by it sorted before the older ones, so every open took the index for damaged and indexed the
        # log since the step again (its entries growing with each open)
        newest = self.files[-1].path.name if self.files else ""
        if index_file_name(now) <= newest:
            now = max(now, index_name_ms(newest) + 1)
        step = 1
        while (self.directory / (name := index_file_name(now))).exists() or name <= newest:
            now += step  # two files in one millisecond; or a local time the clock's DST change repeats
            step *= 2
        created = IndexFile.create(self.directory / name, self.hash_slot_num, self.index_num,
                                   end_phy, end_ts, preallocate=self.config.preallocate,
                                   staging=self.directory.parent / STAGING_DIR)
        self.files += (created,)
        return created

    def end_phy_offset(self) -> int:
        """Commit-log offset of the newest indexed record: dispatch skips records below it (a re-dispatch)."""
        with self.lock:
            return self.files[-1].end_phy_offset if self.files else 0

    def build_index(self, topic: str, phy_offset: int, store_timestamp: int, sys_flag: int,
                    uniq_key: str | None, keys: str | None) -> None:
        """``buildIndex`` for one dispatched record."""
        self.build_index_batch([IndexRequest(topic, phy_offset, store_timestamp, sys_flag, uniq_key, keys)])

    def build_index_batch(self, requests: Sequence[IndexRequest]) -> int:
        """``buildIndex`` for many records in log order, vectorised; returns the number of keys put.

        Files roll exactly where one-at-a-time ``buildIndex`` calls would roll them: a full file is
        replaced at the start of the next record or in the middle of a record's keys.
        """
        if not requests:
            return 0
        put = 0
        with self.lock:
            index = self._last_file_for_write()
            room = index.index_num - index.index_count
            end_phy = index.end_phy_offset
            hashes: list[int] = []
            phys: list[int] = []
            stamps: list[int] = []

            def write_pending() -> None:
                if hashes:
                    written = put_hashes(index, np.array(hashes, dtype=np.int64), np.array(phys, dtype=np.int64),
                                         np.array(stamps, dtype=np.int64))
                    assert written == len(hashes)
                    hashes.clear()
                    phys.clear()
                    stamps.clear()

            for req in requests:
                if room == 0:  # the previous record filled the file: buildIndex starts a new one
                    write_pending()
                    index = self._last_file_for_write()
                    room = index.index_num - index.index_count
                if req.phy_offset < end_phy:
                    continue  # already indexed (a re-dispatch)
                indexed = _trailing_hashes(self.files, end_phy) if req.phy_offset == end_phy else None
                if SysFlag.transaction_type(req.sys_flag) == SysFlag.TRANSACTION_ROLLBACK_TYPE:
                    continue
                for key in req.index_keys():
                    key_hash = index_key_hash(build_key(req.topic, key))
                    if indexed and indexed.get(key_hash, 0) > 0:
                        indexed[key_hash] -= 1
                        continue
                    if room == 0:  # full in the middle of a record: its remaining keys go to a new file
                        write_pending()
                        index = self._last_file_for_write()
                        room = index.index_num - index.index_count
                    hashes.append(key_hash)
                    phys.append(req.phy_offset)
                    stamps.append(req.store_timestamp)
                    room -= 1
                    put += 1
                    end_phy = req.phy_offset
            write_pending()
            if put:
                self.dirty = True
        return put

    def build_index_hashes(self, key_hashes, phy_offsets, timestamps, *, records_follow: bool = False) -> int:
        """Put pre-hashed entries of records in log order (nothing skipped), rolling files as
        ``buildIndex`` would; ``records_follow`` says records without entries came after the last one
        (a full file is then replaced, as the next ``buildIndex`` call would)."""
        with self.lock:
            index = self._last_file_for_write()
            if len(key_hashes) and int(phy_offsets[0]) == index.end_phy_offset:  # the newest indexed record again
                key_hashes, phy_offsets, timestamps = _without_indexed(self.files, key_hashes, phy_offsets,
                                                                       timestamps)
            total = len(key_hashes)
            done = 0
            while done < total:
                if index.is_write_full():
                    index = self._last_file_for_write()
                done += put_hashes(index, key_hashes[done:], phy_offsets[done:], timestamps[done:])
            if records_follow and index.is_write_full():
                self._last_file_for_write()
            self.dirty = self.dirty or total > 0
        return total

    # --- a reader's tail ------------------------------------------------------------------------

    def add_tail(self, key_hashes: np.ndarray, phy_offsets: np.ndarray, timestamps: np.ndarray) -> None:
        """Read-only: index records in memory, in log order. A live writer puts a batch's queue units before its
        index entries, so a view opened between the two holds the batch in its queues and not in its files (5%
        of opens beside a busy writer answered its keys with nothing); a dead writer's dispatch can lag the
        same way. The store gives the records past the files' last entry here, once, at open."""
        for key_hash, phy, stamp in zip(key_hashes.tolist(), phy_offsets.tolist(), timestamps.tolist(), strict=True):
            self.tail.setdefault(key_hash, []).append((phy, stamp))

    def tail_candidates(self, key_hash: int, low: int) -> list[int]:
        """The in-memory tail's offsets for a key hash, newest first, stored at or after ``low``."""
        entries = self.tail.get(key_hash)
        return [phy for phy, stamp in reversed(entries) if stamp >= low] if entries else []

    # --- query -------------------------------------------------------------------------------

    def query_offset(self, topic: str, key: str, max_num: int, begin: int, end: int) -> tuple[list[int], int, int]:
        """RocketMQ's ``queryOffset``: raw, hash-only offsets plus the newest file's end time and offset."""
        max_num = min(max_num, self.config.max_msgs_num_batch)
        offsets: list[int] = []
        last_ts = last_phy = 0
        full_key = build_key(topic, key)
        if self.tail:  # newest first, as the files' entries follow
            offsets += [phy for phy, stamp in reversed(self.tail.get(index_key_hash(full_key), ()))
                        if begin <= stamp <= end][:max_num]
        with self.lock:
            files = list(self.files)
        for i in range(len(files) - 1, -1, -1):
            index = files[i]
            if i == len(files) - 1:
                last_ts, last_phy = index.end_timestamp, index.end_phy_offset
            if index.is_time_matched(begin, end):
                try:
                    index.select_phy_offsets(full_key, max_num, begin, end, into=offsets)
                except (ValueError, StoreIOError):
                    if index in self.files:
                        raise
                    continue  # retention deleted it under this query: its messages are gone with their segments
            if index.begin_timestamp < begin or len(offsets) >= max_num:
                break
        return list(dict.fromkeys(offsets)), last_ts, last_phy  # the tail starts at the files' last record

    def candidates(self, topic: str, key: str, begin: int, end: int) -> list[int]:
        """Every offset whose entry hash matches ``topic#key``, newest first, without a count limit.

        The time window is widened by the index's one-second rounding; callers check the real
        store time and the real key. A list, not a generator: a query reads every chain anyway.
        """
        key_utf8 = f"{topic}#{key}".encode("utf-8", "surrogatepass")  # build_key, inline
        low = begin - 1000 if begin > 1000 else 0
        high = end + 1000
        found: list[int] = self.tail_candidates(index_key_hash(build_key(topic, key)), low) if self.tail else []
        for index in reversed(self.files):  # a tuple replaced, never changed: this is a snapshot
            try:
                b, e = index.begin_timestamp, index.end_timestamp  # is_time_matched(low, high), inline
                if index.index_count > 1 and ((low < b and high > e) or b <= low <= e or b <= high <= e):
                    found += key_candidates(index, key_utf8, low)
                if index.begin_timestamp < low:
                    break
            except (ValueError, StoreIOError):
                if index in self.files:
                    raise
                continue  # retention deleted it under this query: its messages are gone with their segments
        return found

    # --- durability and retention ------------------------------------------------------------

    def flush(self) -> int:
        """Flush the newest file (older ones were flushed when they filled up).

        Returns the store time up to which the index is now durable (0 if there is no index).
        """
        with self.lock:
            if not self.files:
                return 0
            newest = self.files[-1]
            durable = newest.end_timestamp
            if self.dirty:
                newest.flush()
                self.dirty = False
            return durable

    def delete_expired(self, min_log_offset: int) -> int:
        """``deleteExpiredFile``: drop the oldest files whose entries all point below the log start. A file whose
        unlink fails stays out of the index and is unlinked again by the next pass (``retry_undeleted``); the
        others go all the same, and the first failure is raised after them."""
        with self.lock:
            doomed = 0
            for index in self.files[:-1]:
                if index.end_phy_offset < min_log_offset:
                    doomed += 1
                else:
                    break
            gone, self.files = self.files[:doomed], self.files[doomed:]  # out of the tuple first: a query that
            destroy_all(gone, self.undeleted, "index files")  # meets a closed file it took then finds it gone
            return doomed

    def retry_undeleted(self) -> StoreIOError | None:
        """Unlink the files an earlier pass could not; the error of one that still fails, if any."""
        with self.lock:
            self.undeleted, error = unlink_again(self.undeleted, self.directory)
            return error

    def close(self) -> None:
        with self.lock:
            if not self.read_only:
                for index in self.files[-1:]:
                    index.flush()
            for index in self.files:
                index.close()
            self.files = ()


def _trailing_hashes(files: Sequence[IndexFile], phy: int) -> dict[int, int]:
    """How many entries of each key hash the newest entries of the index hold for the record at ``phy``: those of
    the newest file, and where they reach its start (the file filled up at or inside that record), the file's before
    it."""
    found: dict[int, int] = {}
    for index in reversed(files[-2:]):
        n = index.index_count - 1
        while n >= 1:
            key_hash, entry_phy, _diff, _prev = index.entry(n)
            if entry_phy != phy:
                return found
            found[key_hash] = found.get(key_hash, 0) + 1
            n -= 1
    return found


def _without_indexed(files: Sequence[IndexFile], key_hashes, phy_offsets, timestamps):
    """The entries less those of the newest indexed record that the index holds already. Dispatch after a crash
    starts again at that record (a record's keys may be split across two files, so it is not skipped whole): each
    abnormal open put its keys in the index once more, as RocketMQ's does."""
    indexed = _trailing_hashes(files, int(phy_offsets[0]))
    if not indexed:
        return key_hashes, phy_offsets, timestamps
    keep = np.ones(len(key_hashes), dtype=bool)
    for i in range(len(key_hashes)):
        if int(phy_offsets[i]) != int(phy_offsets[0]):
            break
        key_hash = int(key_hashes[i])
        if indexed.get(key_hash, 0) > 0:
            indexed[key_hash] -= 1
            keep[i] = False
    return key_hashes[keep], phy_offsets[keep], timestamps[keep]


def _repair_file(index: IndexFile, log_end: int, store_time: StoreTimeLookup) -> int:
    """Unlink entries at or past ``log_end`` and re-link a slot torn by a kill; rewrite the header."""
    buf = index.buffer
    count = index.index_count
    slots = np.frombuffer(buf, dtype=">i4", count=index.hash_slot_num, offset=INDEX_HEADER_SIZE).copy()
    changed = False
    # A kill between a batch's slot writes and its count update leaves slots pointing past the count,
    # possibly at a chain of several uncounted entries: follow each chain back to a counted entry.
    torn = np.flatnonzero(slots >= count)
    for slot in torn:
        n = int(slots[slot])
        for _ in range(index.index_num):
            if n < count:
                break
            prev = index.entry(n)[3] if n < index.index_num else 0
            n = prev if 0 <= prev < n else 0  # links only go back; anything else is damage
        slots[slot] = n if 0 < n < count else 0
        changed = True
    removed = 0
    while count > 1:
        key_hash, phy, _diff, prev = index.entry(count - 1)
        if phy < log_end:
            break
        slot = key_hash % index.hash_slot_num
        if slots[slot] == count - 1:
            slots[slot] = prev if 0 < prev < count - 1 else 0
        count -= 1
        removed += 1
        changed = True
    if not changed:
        return 0
    entries_at = INDEX_HEADER_SIZE + index.hash_slot_num * 4
    index.reserve_entries(count + removed)  # a sparse file: its slots have holes
    buf[INDEX_HEADER_SIZE:entries_at] = slots.astype(">i4").tobytes()
    buf[entries_at + count * 20 : entries_at + (count + removed) * 20] = bytes(removed * 20)
    index.index_count = count
    index.hash_slot_count = int(np.count_nonzero(slots))
    if count > 1:
        last_phy = index.entry(count - 1)[1]
        index.end_phy_offset = last_phy
        stamp = store_time(last_phy)
        if stamp > 0:
            index.end_timestamp = stamp
    else:
        index.end_phy_offset, index.end_timestamp = index.begin_phy_offset, index.begin_timestamp
    index.flush()
    if removed or len(torn):
        log.warning("repaired index file %s: %d entries past the log end unlinked, %d torn slots re-linked",
                    index.path.name, removed, len(torn))
    return removed


def chain_problem(index: IndexFile, *, live: bool = False, block: int = 1 << 20) -> str | None:
    """Why ``index``'s chains are not well formed, or None: whole arrays at once, ``block`` entries at a time
    (bounded memory on a 20-million-entry file), no walk.

    ``live`` allows slots that point past the header's count: a writer puts entries and slots before it
    updates the count, so a reader of a live store sees that between two puts (a writer open repairs such
    torn slots before checking)."""
    found = chain_problem_at(index, live=live, block=block)
    return found[1] if found else None


def chain_problem_at(index: IndexFile, *, live: bool = False, block: int = 1 << 20,
                     thorough: bool = False) -> tuple[int, str] | None:
    """``chain_problem`` with the byte offset in the file of the slot or entry found wrong.

    The quick form (an open's) checks ranges and that as many slots are in use as chains start in the entries
    (a slot table zeroed or lost in part has fewer); ``thorough`` (``verify``'s) holds every link and slot to
    the ones the entries' order makes (``chain_mismatch``): ~4x the time, the whole file."""
    if thorough:
        return _chain_mismatch_at(index, live)
    count = index.index_count
    slots = np.frombuffer(index.buffer, dtype=">i4", count=index.hash_slot_num, offset=INDEX_HEADER_SIZE)
    limit = index.index_num if live else max(count, 1)
    bad_slots = np.flatnonzero((slots < 0) | (slots >= limit))
    if len(bad_slots):
        slot = int(bad_slots[0])
        return INDEX_HEADER_SIZE + 4 * slot, f"slot {slot} points at entry {int(slots[slot])} of {count}"
    entries_at = INDEX_HEADER_SIZE + index.hash_slot_num * 4
    starts = 0
    for first in range(1, count, block):
        n = min(block, count - first)
        prev = np.frombuffer(index.buffer, dtype=">i4", count=n * 5, offset=entries_at + first * 20)[4::5]
        own = np.arange(first, first + n, dtype=np.int32)
        bad = np.flatnonzero((prev < 0) | (prev >= own))
        if len(bad):
            at = int(bad[0])
            return (entries_at + (first + at) * 20, f"entry {first + at} links to entry {int(prev[at])}, not to an "
                    f"earlier one (a cycle or a wild link)")
        starts += int(np.count_nonzero(prev == 0))
    used = int(np.count_nonzero(slots))
    if used < starts or (used > starts and not live):  # a live writer's uncounted entries may use new slots
        return INDEX_HEADER_SIZE, (f"{used} hash slots in use where {starts} chains start in the entries "
                                   f"(a slot table zeroed or damaged: keys of those slots are not found)")
    return None


def _chain_mismatch_at(index: IndexFile, live: bool) -> tuple[int, str] | None:
    entries_at = INDEX_HEADER_SIZE + index.hash_slot_num * 4
    kind, where, expected = _ik.chain_mismatch(index.array, index.hash_slot_num, index.index_num, index.index_count,
                                                live)
    if kind == _ik.CHAINS_FINE:
        return None
    if kind == _ik.CHAIN_BAD_SLOT:
        held = int(np.frombuffer(index.buffer, dtype=">i4", count=1, offset=INDEX_HEADER_SIZE + 4 * where)[0])
        return INDEX_HEADER_SIZE + 4 * where, (
            f"slot {where} names entry {held}, where its newest entry is {expected}" if expected else
            f"slot {where} names entry {held}, where no entry hashes to it")
    key_hash, _phy, _diff, prev = index.entry(where)
    at = entries_at + where * INDEX_ENTRY_SIZE
    if kind == _ik.CHAIN_BAD_HASH:
        return at, f"entry {where} has the negative key hash {key_hash}, which no key has"
    return at, (f"entry {where} links to entry {prev}, where the previous entry of its slot is {expected}"
                if expected else f"entry {where} links to entry {prev}, where it is the first entry of its slot")

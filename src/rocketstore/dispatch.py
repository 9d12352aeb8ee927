"""Dispatch: following the commit log to build consume queues and the index (``ReputMessageService``).

A background thread reads every record between ``reput_from_offset`` and the confirm offset
(the write position under ASYNC_FLUSH, the flushed position under SYNC_FLUSH, so consumers
never see a message that could still vanish) and hands it to the two dispatchers:

* consume queue: NOT and COMMIT transaction types only;
* index: everything but ROLLBACK.

Readers call ``wait_dispatched(offset)`` to see their own writes.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from .codec._kernels import plan_dispatch
from .codec.batch import DispatchBatch, StopKind, decode_dispatch, load_dispatch_kernels
from .codec.hashing import java_string_hash
from .codec.properties import PropertyName, decode_properties
from .codec.record import RecordLayout, read_layout
from .commitlog import CommitLog
from .config import FlushDiskType, StoreConfig
from .consumequeue import ConsumeQueueTable
from .encoder import PARKED_TOPICS, SCHEDULE_TOPIC
from .errors import CorruptDataError, DispatchFailedError, StoreIOError
from .health import RepeatedErrorLog, StoreHealth
from .index.service import IndexRequest, IndexService
from .lifecycle import start_thread
from .mapped.file import reading
from .message import SysFlag

DISPATCH_ROWS = 8192  # records per decoded batch: buffers stay in cache
# After a round that found records the thread rests this long before the next (ReputMessageService rests
# 1 ms too): a round has a fixed cost of ~100 us of Python, and writers that arrive meanwhile share the next
# one instead of each paying it while holding the GIL a SYNC_FLUSH writer needs back after its msync.
# Readers waiting for their own writes (wait_dispatched) cut the rest short.
DISPATCH_REST = 0.001
# Under SYNC_FLUSH the rest is longer: every put already waits for an msync (~0.12 ms here), and a round
# running when that msync returns keeps the writer from the GIL until it ends, so each round lengthened a
# group commit by its own cost (4 writer threads: 9,400 puts/s with 1 ms rests, 12,700 with 10 ms, 13,200
# with no dispatcher at all). Consumers then see a message up to 10 ms after its flush.
DISPATCH_REST_SYNC = 0.01
# How far (bytes of log) dispatch may fall behind before a put waits for it. A producer that runs Python
# without pause holds the GIL, and each time the dispatcher gives it up (a compiled kernel that releases it, a
# large numpy call) it waits up to the switch interval (5 ms) to get it back. A round gave it up at every
# queue's units and a dozen numpy calls: under one busy producer 200,000 records took ~0.65 s of wall for
# ~0.09 s of work, the lag grew without bound (put_messages(32) for 4 s: 286 MB of log no consumer could see) and, with
# this bound, the producer stopped every 16 MB to let dispatch catch up while holding the GIL no longer (stop
# 37: 3 stops per 200,000 messages, the dispatch done mostly then and at the end, serially). A round now gives
# it up twice, in the walk and in the index's put, and keeps it through ``plan_dispatch`` and the queues'
# units: put_messages(32) runs ~2 MB ahead of dispatch at most and never waits. The bound stays for what is
# left (a producer on many more cores, a slow disk under the queues): a put that finds dispatch further behind
# waits, with the GIL released, until it is back under half of it; the wait gives up after KEEP_UP_TIMEOUT,
# and never fails the put, which is already written. Ingest figures include the time to dispatch everything.
MAX_DISPATCH_LAG = 16 << 20
KEEP_UP_TIMEOUT = 1.0
_FIELDS = struct.Struct(">iiqq")  # queue id, flag, queue offset, phy offset at record position 12
_TS = struct.Struct(">q")

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DispatchRequest:
    """What the dispatchers need of one record (``DispatchRequest``)."""

    topic: str
    queue_id: int
    commit_log_offset: int
    size: int
    tags_code: int
    store_timestamp: int
    queue_offset: int
    keys: str | None
    uniq_key: str | None
    sys_flag: int
    index_topic: str

    def index_request(self) -> IndexRequest:
        return IndexRequest(self.index_topic, self.commit_log_offset, self.store_timestamp, self.sys_flag,
                            self.uniq_key, self.keys)


def dispatch_request(buf, pos: int, layout: RecordLayout, config: StoreConfig) -> DispatchRequest:
    """Read the dispatch fields of a validated record (``checkMessageAndReturnSize``'s side output)."""
    queue_id, _flag, queue_offset, phy_offset = _FIELDS.unpack_from(buf, pos + 12)
    sys_flag = layout.sys_flag
    store_ts = _TS.unpack_from(buf, pos + 48 + (20 if sys_flag & SysFlag.BORNHOST_V6 else 8))[0]
    topic = bytes(buf[layout.topic_pos : layout.topic_pos + layout.topic_len]).decode("utf-8", "replace")
    props = decode_properties(bytes(buf[layout.props_pos : layout.props_pos + layout.props_len])
                              .decode("utf-8", "replace")) if layout.props_len else {}
    return DispatchRequest(topic, queue_id, phy_offset, layout.size,
                           tags_code_of(topic, props, store_ts, config.delay_levels_ms),
                           store_ts, queue_offset, props.get(PropertyName.KEYS), props.get(PropertyName.UNIQ_KEY),
                           sys_flag, index_topic_of(topic, props))


def index_topic_of(topic: str, props: dict[str, str]) -> str:
    """The topic a record's keys are indexed under: a delayed (scheduled or timer) message's real topic, so
    that it is findable by key from the moment it is stored (RocketMQ indexes it under its parked topic)."""
    if topic in PARKED_TOPICS:
        return props.get(PropertyName.REAL_TOPIC) or topic
    return topic


def tags_code_of(topic: str, props: dict[str, str], store_timestamp: int, levels: tuple[int, ...]) -> int:
    """Tags code of a record: hash of TAGS, or the delivery time of a delayed message (``levels`` in ms). A timer
    message's is its TAGS hash too, as RocketMQ's ``checkMessageAndReturnSize`` makes it (the wheel reads the due
    time from the record)."""
    if topic == SCHEDULE_TOPIC and PropertyName.DELAY in props:
        try:
            level = int(props[PropertyName.DELAY])
        except ValueError:
            level = 0
        level = min(level, len(levels))
        if level > 0:
            return store_timestamp + levels[level - 1]
    tags = props.get(PropertyName.TAGS)
    return java_string_hash(tags) if tags else 0


class Dispatcher:
    """Builds consume queues and index entries from the commit log, in a background thread."""

    def __init__(self, commit_log: CommitLog, queues: ConsumeQueueTable, index: IndexService | None,
                 config: StoreConfig, on_logic_timestamp, health: StoreHealth | None = None) -> None:
        self.commit_log = commit_log
        self.queues = queues
        self.index = index
        self.config = config
        self.reput_from_offset = 0
        self.rounds = 0  # dispatch rounds that delivered records (consumers wait on it)
        self.attempts = 0  # dispatch rounds started (a waiter judges a failure by a round after it came)
        self.held_back = 0  # puts that waited for dispatch to catch up (keep_up)
        self._on_logic_timestamp = on_logic_timestamp
        self._cond = threading.Condition()
        self._work = threading.Event()
        self._urgent = threading.Event()  # a reader waits for a round: no rest before it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._round_lock = threading.RLock()  # also held by retention while it deletes what a round reads
        self.last_error: BaseException | None = None
        self.health = health or StoreHealth()  # a failing round refuses puts until a round succeeds

    def confirm_offset(self) -> int:
        if self.config.flush_disk_type is FlushDiskType.SYNC_FLUSH:
            return self.commit_log.flushed_offset
        return self.commit_log.max_offset

    def dispatch_available(self) -> int:
        """Dispatch everything up to the confirm offset now; returns the number of records."""
        done = 0
        with self._round_lock:
            self.attempts += 1
            end = self.confirm_offset()
            # Retention may have deleted segments this dispatcher had not read yet (doReput's move to the
            # log's min offset): their messages are gone, the rest of the log must still be dispatched.
            offset = max(self.reput_from_offset, self.commit_log.min_offset)
            files = self.commit_log.mapped_files
            try:
                while offset < end:
                    mapped = files.find(offset)
                    if mapped is None:
                        break
                    pos = offset - mapped.file_from_offset
                    written = mapped.wrote_position
                    if pos >= written:
                        break
                    with reading(mapped):
                        batch, stop = decode_dispatch(mapped.buffer, pos, min(written, end - mapped.file_from_offset),
                                                      base=mapped.file_from_offset, limit=written,
                                                      path=str(mapped.path), max_rows=DISPATCH_ROWS)
                        if len(batch):
                            self._apply(batch, mapped)
                            done += len(batch)
                    if stop.kind is StopKind.DAMAGE:  # recovery validated the log, so this is new damage
                        offset = stop.offset
                        assert stop.error is not None
                        raise stop.error
                    offset = mapped.file_end_offset if stop.kind is StopKind.BLANK else stop.offset
            except CorruptDataError as exc:
                self.last_error = exc
                self.health.fail_dispatch(exc)
                log.error("dispatch stopped at %d: %s", offset, exc)
                self.reput_from_offset = offset
                raise
            except BaseException as exc:  # a write failed (full disk, EMFILE): keep what was done, say so
                self.last_error = exc
                self.health.fail_dispatch(exc)
                self.reput_from_offset = offset
                raise
            self.reput_from_offset = offset
            self.health.clear_dispatch()
        if done:
            with self._cond:
                self.rounds += 1
                self._cond.notify_all()
        return done

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No dispatch round runs inside: retention deletes segments and queue files a round would read."""
        with self._round_lock:
            yield

    def wait_for_round(self, seen: int, timeout: float) -> int:
        """Block until a dispatch round after ``seen`` delivered records (or ``timeout``); returns the count."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.rounds == seen:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            return self.rounds

    def _apply(self, batch: DispatchBatch, mapped) -> None:
        """One decoded batch into consume-queue units and index entries, as the one-record path would put them,
        with whole arrays per queue; slow rows (delayed messages, text that is not UTF-8) one at a time in
        their place."""
        if not batch.slow_count:
            self._apply_run(batch, 0, len(batch))
            return
        start = 0
        for row in np.flatnonzero(batch.slow).tolist():
            self._apply_run(batch, start, row)
            pos = int(batch.pos[row])
            layout = read_layout(mapped.buffer, pos, mapped.wrote_position, path=str(mapped.path),
                                 base=mapped.file_from_offset)
            assert layout is not None  # the walk accepted it
            self.dispatch(dispatch_request(mapped.buffer, pos, layout, self.config))
            start = row + 1
        self._apply_run(batch, start, len(batch))

    def _apply_run(self, batch: DispatchBatch, lo: int, hi: int) -> None:
        """Rows ``lo``..``hi`` (none slow) through ``plan_dispatch``, which holds the GIL: from the walk to the
        index this round gives the GIL up twice, in the walk and the index's put, each worth its wait."""
        if lo >= hi:
            return
        index_from = self.index.end_phy_offset() if self.index is not None else 0
        units, topic_codes, queue_ids, starts, last, entries, records_follow = plan_dispatch(
            batch.topic_code, batch.queue_id, batch.sys_flag, batch.queue_offset, batch.phy, batch.size,
            batch.tags_code, batch.store_ts, batch.entry_owner, batch.entry_hash, lo, hi, index_from)
        if last >= 0:
            wrote = False
            bounds = starts.tolist()
            for code, queue_id, a, b in zip(topic_codes.tolist(), queue_ids.tolist(), bounds, bounds[1:],
                                            strict=False):
                queue = self.queues.find_or_create(batch.topics[code], queue_id)
                wrote |= queue.put_run(units[0, a:b], units[1, a:b], units[2, a:b], units[3, a:b]) > 0
            if wrote:
                self._on_logic_timestamp(int(batch.store_ts[last]))
        if self.index is None or not self.config.message_index_enable:
            return
        self.index.build_index_hashes(entries[0], entries[1], entries[2], records_follow=records_follow)

    def dispatch(self, req: DispatchRequest) -> None:
        """Both dispatchers for one record."""
        self._to_queue(req)
        self._to_index([req.index_request()])

    def _to_queue(self, req: DispatchRequest) -> None:
        tran = SysFlag.transaction_type(req.sys_flag)
        if tran in (SysFlag.TRANSACTION_NOT_TYPE, SysFlag.TRANSACTION_COMMIT_TYPE):
            queue = self.queues.find_or_create(req.topic, req.queue_id)
            if queue.put_position(req.commit_log_offset, req.size, req.tags_code, req.queue_offset):
                self._on_logic_timestamp(req.store_timestamp)

    def _to_index(self, pending: list[IndexRequest]) -> None:
        """Index a round's records in one vectorised batch (consume queues first: they feed consumers)."""
        if pending and self.index is not None and self.config.message_index_enable:
            self.index.build_index_batch(pending)
        pending.clear()

    # --- thread ------------------------------------------------------------------------------

    def start(self) -> None:
        load_dispatch_kernels()
        self._thread = start_thread(self._run, "rocketstore-dispatch")

    def wake(self) -> None:
        if not self._work.is_set():  # set() takes a lock and notifies; every put calls this
            self._work.set()

    def _run(self) -> None:
        rest = DISPATCH_REST_SYNC if self.config.flush_disk_type is FlushDiskType.SYNC_FLUSH else DISPATCH_REST
        failures = RepeatedErrorLog(log, "dispatch failed (puts are refused until it succeeds)",
                                    "dispatch works again: puts are accepted")
        while not self._stop.is_set():
            self._work.wait(0.01)
            self._work.clear()
            try:
                done = self.dispatch_available()
            except Exception as exc:  # keep the thread alive and retrying; puts are refused meanwhile
                self.last_error = exc
                self.health.fail_dispatch(exc)
                failures.failed(exc)
                self._stop.wait(0.05)
                continue
            failures.recovered()
            if done:
                self._urgent.wait(rest)
            self._urgent.clear()

    def wait_dispatched(self, offset: int, timeout: float = 5.0) -> bool:
        """Block until everything below commit-log ``offset`` is dispatched (or it cannot be)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            seen_attempts = self.attempts
            while self.reput_from_offset < offset:
                if self.health.dispatch_error is not None and self.attempts > seen_attempts:
                    self.health.check_writable()  # a round since we started failed too: DispatchFailedError
                self._work.set()
                self._urgent.set()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, 0.05))
        return True

    def keep_up(self) -> None:
        """Called by a producer after its put: wait while dispatch is more than ``MAX_DISPATCH_LAG`` behind."""
        end = self.confirm_offset()
        if end - self.reput_from_offset <= MAX_DISPATCH_LAG:
            return
        thread = self._thread
        if thread is None or thread is threading.current_thread() or not thread.is_alive():
            return  # no thread to wait for (stopped, or this put comes from a dispatch round)
        target = end - MAX_DISPATCH_LAG // 2
        deadline = time.monotonic() + KEEP_UP_TIMEOUT
        with self._cond:
            self.held_back += 1
            while self.reput_from_offset < target and self.health.dispatch_error is None and thread.is_alive():
                self._work.set()
                self._urgent.set()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                self._cond.wait(min(remaining, 0.05))

    def behind_bytes(self) -> int:
        return max(0, self.commit_log.max_offset - self.reput_from_offset)

    def halt(self) -> None:
        """Stop the thread without catching up (an open that failed: the next open re-dispatches)."""
        self._stop.set()
        self._work.set()
        self._urgent.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def shutdown(self) -> None:
        """Stop the thread and catch up. If catching up fails (a full disk), DispatchFailedError: the store's
        abort file stays and the next open re-dispatches (queues and index are derived data)."""
        self.halt()
        try:
            self.dispatch_available()
        except (StoreIOError, CorruptDataError, OSError) as exc:
            self.last_error = exc
            raise DispatchFailedError(getattr(exc, "errno", None) or errno.EIO,
                                      f"dispatch could not catch up before closing ({exc}); the next open "
                                      "re-dispatches") from exc

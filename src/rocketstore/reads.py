"""Reading messages back: by queue offset (``getMessage``), by time, by key, by unique key, by id.

Queries through the index are exact, unlike RocketMQ's store: every candidate offset is read
and kept only if it is a real record start whose topic matches, whose KEYS (or UNIQ_KEY) holds
the key, and whose store time lies in the window. Hash collisions (``Aa``/``BB``) therefore
never return a foreign message, the walk continues past them, and no query returns more than
``max_num`` messages.
"""

from __future__ import annotations

import enum
import logging
import numbers
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from .codec.hashing import java_string_hash
from .codec.msgid import decode_offset_msg_id
from .codec.record import decode_v4_at
from .commitlog import CommitLog
from .config import StoreConfig
from .consumequeue import EXT_ADDR_MAX, ConsumeQueueTable
from .encoder import DLQ_GROUP_TOPIC_PREFIX, PARKED_TOPICS, RETRY_GROUP_TOPIC_PREFIX, is_system_topic
from .errors import (
    CorruptDataError,
    InvalidMessageIdError,
    InvalidQueryError,
    MessageNotFoundError,
    RocketStoreError,
    SegmentDeletedError,
    StoreIOError,
)
from .index.service import IndexService, build_key
from .message import MessageExt
from .sqlfilter import InvalidFilterError, SqlFilter, subscription_filter

LONG_MAX = (1 << 63) - 1
MAX_TOTAL_MSG_SIZE = 128 << 20  # maxTransferBytesOnMessageInDisk-style cap on one getMessage batch
MAX_REPORTED_UNITS = 10_000

log = logging.getLogger(__name__)


class GetMessageStatus(enum.Enum):
    """RocketMQ's ``GetMessageStatus``."""

    FOUND = "FOUND"
    NO_MATCHED_MESSAGE = "NO_MATCHED_MESSAGE"
    MESSAGE_WAS_REMOVING = "MESSAGE_WAS_REMOVING"
    OFFSET_FOUND_NULL = "OFFSET_FOUND_NULL"
    OFFSET_OVERFLOW_BADLY = "OFFSET_OVERFLOW_BADLY"
    OFFSET_OVERFLOW_ONE = "OFFSET_OVERFLOW_ONE"
    OFFSET_TOO_SMALL = "OFFSET_TOO_SMALL"
    NO_MATCHED_LOGIC_QUEUE = "NO_MATCHED_LOGIC_QUEUE"
    NO_MESSAGE_IN_QUEUE = "NO_MESSAGE_IN_QUEUE"


@dataclass(slots=True)
class GetMessageResult:
    status: GetMessageStatus
    next_begin_offset: int
    min_offset: int
    max_offset: int
    messages: list[MessageExt] = field(default_factory=list)
    # commit-log offsets of records a unit pointed at that could not be read (a CRC failure, no record there):
    # skipped as RocketMQ skips what it cannot read, but named here and logged, never passed over silently
    unreadable: list[int] = field(default_factory=list)


def _log_unreadable_candidate(topic: str, key: str, phy: int, exc: CorruptDataError) -> None:
    """A damaged record an index entry of the key points at: perhaps an answer, left out; said, never silently."""
    log.error("key %r of %s: skipping the unreadable record at commit-log offset %d an index entry points at: %s",
              key[:64], topic, phy, exc)


_JAVA_TRIM = "".join(map(chr, range(33)))  # String.trim: every character up to the space


def parse_tags(tags: str | Iterable[str] | None) -> set[str] | None:
    """A tag subscription, as RocketMQ's ``FilterAPI.buildSubscriptionData`` reads it: None, ``""`` or exactly
    ``"*"`` is every message (None); otherwise the pieces between ``||``, trimmed, empty ones dropped, are the tags,
    matched literally: ``"A || *"`` is the tags ``A`` and ``*``, ``" * "`` the tag ``*``, ``" || "`` none at all
    (the empty set: nothing matches). An iterable is the tags themselves, each one literal.

    Raises ``InvalidFilterError`` for a string of nothing but ``||`` (Java's split leaves no piece: RocketMQ refuses
    it, "subString split error"), ``InvalidQueryError`` for what is neither a string nor an iterable of them."""
    if tags is None:
        return None
    if isinstance(tags, str):
        if tags in ("", "*"):
            return None
        pieces = tags.split("||")
        if not any(pieces):
            raise InvalidFilterError(f"tag subscription {tags!r} has only '||' separators, no tags (RocketMQ: "
                                     "subString split error)")
    else:
        try:
            pieces = list(tags)
        except TypeError:
            pieces = [None]
        if not all(isinstance(piece, str) for piece in pieces):
            raise InvalidQueryError(f"tags are a subscription string or an iterable of tags, not {tags!r}")
    return {tag for tag in (piece.strip(_JAVA_TRIM) for piece in pieces) if tag}


class StoreReader:
    """Read paths over the commit log, the consume queues and the index."""

    def __init__(self, commit_log: CommitLog, queues: ConsumeQueueTable, index: IndexService | None,
                 config: StoreConfig) -> None:
        self.commit_log = commit_log
        self.queues = queues
        self.index = index
        self.config = config
        # units found pointing at another queue's record: (topic, queue id, queue offset) -> where they point
        self.damaged_units: dict[tuple[str, int, int], int] = {}
        self.repair_unit: Callable[[str, int, int], MessageExt | None] | None = None
        # topics the store knows beyond those with queues (config/topics.json): a delayed message's topic or a
        # prepared transaction's has none until delivery or commit, yet its UNIQ_KEY is indexed under it
        self.known_topics: Callable[[], Iterable[str]] = lambda: ()

    # --- by queue offset ---------------------------------------------------------------------

    def get_message(self, topic: str, queue_id: int, offset: int, max_msgs: int = 32,
                    tags: str | Iterable[str] | None = None, max_total_bytes: int = MAX_TOTAL_MSG_SIZE, *,
                    sql: str | SqlFilter | None = None) -> GetMessageResult:
        """``getMessage``: up to ``max_msgs`` messages from ``offset`` in one queue, filtered by tags or by an
        SQL92 expression over their properties (``sqlfilter``); a message filtered out is passed over."""
        if type(offset) is not int or type(max_msgs) is not int or max_msgs < 1 or type(queue_id) is not int \
                or type(topic) is not str:
            topic, queue_id, offset, max_msgs = _get_message_args(topic, queue_id, offset, max_msgs)
        wanted = parse_tags(tags)
        selector = subscription_filter(wanted, sql)
        self.queues.check_managed(topic)
        queue = self.queues.get(topic, queue_id)
        if queue is None or queue.max_offset_in_queue == 0:
            return GetMessageResult(GetMessageStatus.NO_MESSAGE_IN_QUEUE, 0, 0, 0)
        low, high = queue.min_offset_in_queue, queue.max_offset_in_queue
        if offset < low:
            return GetMessageResult(GetMessageStatus.OFFSET_TOO_SMALL, low, low, high)
        if offset == high:
            return GetMessageResult(GetMessageStatus.OFFSET_OVERFLOW_ONE, offset, low, high)
        if offset > high:
            return GetMessageResult(GetMessageStatus.OFFSET_OVERFLOW_BADLY, high, low, high)
        codes = {java_string_hash(t) for t in wanted} if wanted is not None else None
        max_units = max(16000, max_msgs * 20) // 20
        try:
            units, next_file = queue.units_from(offset, max_units)
        except SegmentDeletedError:  # retention took the queue file under this read: the offset is now too small
            low = max(queue.min_offset_in_queue, low)
            return GetMessageResult(GetMessageStatus.OFFSET_TOO_SMALL, low, low, queue.max_offset_in_queue)
        if next_file is not None:
            return GetMessageResult(GetMessageStatus.OFFSET_FOUND_NULL, next_file, low, high)
        result = GetMessageResult(GetMessageStatus.NO_MATCHED_MESSAGE, offset, low, high)
        total = 0
        log_min = self.commit_log.min_offset
        for i, (phy, size, tags_code) in enumerate(units):
            if result.messages and (len(result.messages) + 1 > max_msgs or total + size > max_total_bytes):
                break
            result.next_begin_offset = offset + i + 1
            if codes is not None and _int32(tags_code) not in codes and tags_code > EXT_ADDR_MAX:
                continue
            if phy < log_min:
                result.status = GetMessageStatus.MESSAGE_WAS_REMOVING
                continue
            try:
                msg = self.commit_log.get_message(phy)
            except SegmentDeletedError:
                result.status = GetMessageStatus.MESSAGE_WAS_REMOVING
                continue
            except (MessageNotFoundError, CorruptDataError) as exc:
                if phy < self.commit_log.min_offset:  # retention deleted its segment since log_min was read
                    result.status = GetMessageStatus.MESSAGE_WAS_REMOVING
                    continue
                repaired = self._unit_to_nothing(topic, queue_id, offset + i, exc)
                if repaired is None:
                    log.error("%s-%d offset %d: skipping the unreadable record at commit-log offset %d: %s", topic,
                              queue_id, offset + i, phy, exc)
                    result.unreadable.append(phy)
                    continue
                msg = repaired
            if (msg.topic, msg.queue_id, msg.queue_offset) != (topic, queue_id, offset + i):
                msg = self._misdirected(topic, queue_id, offset + i, msg)
                if msg is None:
                    continue
            if wanted is not None and msg.tags not in wanted:
                continue  # the tags code matched, the tags did not: a hash collision
            if selector is not None and not selector.matches(msg.properties):
                continue
            result.messages.append(msg)
            total += size
        if result.messages:
            result.status = GetMessageStatus.FOUND
        return result

    def queue_arrow(self, topic: str, queue_id: int, begin: int | None = None, end: int | None = None,
                    tags: str | Iterable[str] | None = None, *, include_body: bool = True,
                    broker_name: str | None = None, max_rows: int = 8192) -> Iterator:
        """The messages of one queue from queue offset ``begin`` up to ``end``, as ``pyarrow.RecordBatch``es in
        queue order: what ``get_message`` serves (tags code then tags, removed and unreadable records skipped,
        a unit pointing at another queue's record never served), a few thousand units at a time through the batch
        codec instead of one message object per record."""
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc

        from .codec.batch import decode_at, message_row, rows_batch

        self.queues.check_managed(topic)
        queue = self.queues.get(topic, queue_id)
        if queue is None:
            return
        wanted = parse_tags(tags)
        codes = np.array(sorted({java_string_hash(t) for t in wanted}), dtype=np.int64) if wanted is not None \
            else None
        offset = queue.min_offset_in_queue if begin is None else max(begin, queue.min_offset_in_queue)
        high = queue.max_offset_in_queue if end is None else min(end, queue.max_offset_in_queue)
        check = self.config.check_crc_on_read
        while offset < high:
            try:
                units, next_file = queue.units_array(offset, min(max_rows, high - offset))
            except SegmentDeletedError:  # retention took the file under this read: go on from the new minimum
                if queue.min_offset_in_queue <= offset:
                    raise
                offset = queue.min_offset_in_queue
                continue
            if next_file is not None:
                offset = next_file
                continue
            if not len(units):
                break
            queue_offsets = offset + np.arange(len(units), dtype=np.int64)
            offset += len(units)
            phy = units["phy"].astype(np.int64)
            keep = phy >= self.commit_log.min_offset
            if codes is not None:
                tags_codes = units["tags"].astype(np.int64)
                keep &= np.isin(tags_codes.astype(np.int32).astype(np.int64), codes) | (tags_codes <= EXT_ADDR_MAX)
            phy, queue_offsets = phy[keep], queue_offsets[keep]
            records = decode_at(self.commit_log, phy, check_crc=check,
                                verify_prop_crc=check and self.config.force_verify_prop_crc,
                                include_body=include_body, broker_name=broker_name)
            record_phy = records.column("commitLogOffset").to_numpy()
            row = np.minimum(np.searchsorted(record_phy, phy), max(len(record_phy) - 1, 0))
            read = (row < len(record_phy)) & (record_phy[row] == phy) if len(record_phy) else \
                np.zeros(len(phy), bool)
            restored = []  # units where no record starts, repaired by a writer: (queue offset, message)
            if not read.all():
                for unread_phy, unread_at in zip(phy[~read].tolist(), queue_offsets[~read].tolist(), strict=True):
                    if self.repair_unit is None:  # a read-only view: said, as get_message says it (it was silent)
                        self._log_unreadable(topic, queue_id, unread_at, unread_phy)
                        continue
                    msg = self._unreadable_unit(topic, queue_id, unread_at, unread_phy)
                    if msg is not None:
                        restored.append((unread_at, msg))
            row, phy, queue_offsets = row[read], phy[read], queue_offsets[read]
            picked = records.take(pa.array(row, pa.int64()))
            right = (pc.equal(picked.column("topic"), topic).to_numpy(zero_copy_only=False)
                     & (picked.column("queueId").to_numpy() == queue_id)
                     & (picked.column("queueOffset").to_numpy() == queue_offsets))
            if not right.all() or restored:
                picked = self._without_misdirected(picked, right, topic, queue_id, queue_offsets, include_body,
                                                   broker_name, message_row, rows_batch, restored)
            if wanted is not None and picked.num_rows:  # the tags code matched; a collision must not
                picked = picked.filter(pc.is_in(picked.column("tags"), pa.array(sorted(wanted), pa.string())))
            if picked.num_rows:
                yield picked

    def _without_misdirected(self, picked, right, topic: str, queue_id: int, queue_offsets, include_body: bool,
                             broker_name: str | None, message_row, rows_batch, restored=()):
        """``queue_arrow``'s rows whose unit points at another record: reported as damage (``_misdirected``) and
        dropped, or replaced by the right record where a writer repairs the unit; ``restored``: (queue offset,
        message) of units that pointed where no record starts, repaired, put in their places."""
        import numpy as np
        import pyarrow as pa

        repaired_rows = [message_row(msg, include_body, broker_name) for _at, msg in restored]
        repaired_at = [at for at, _msg in restored]
        for i in np.flatnonzero(~right).tolist():
            found = self.commit_log.get_message(picked.column("commitLogOffset")[i].as_py())
            msg = self._misdirected(topic, queue_id, int(queue_offsets[i]), found)
            if msg is not None:
                repaired_rows.append(message_row(msg, include_body, broker_name))
                repaired_at.append(int(queue_offsets[i]))
        kept = picked.filter(pa.array(right))
        if not repaired_rows:
            return kept
        both = pa.Table.from_batches([kept, rows_batch(repaired_rows)]).combine_chunks()
        order = np.argsort(np.concatenate([queue_offsets[right], repaired_at]), kind="stable")
        merged = both.take(pa.array(order))
        return pa.RecordBatch.from_arrays([c.combine_chunks() for c in merged.columns], schema=kept.schema)

    def _unit_to_nothing(self, topic: str, queue_id: int, queue_offset: int, exc: Exception) -> MessageExt | None:
        """A unit where no record starts (past the log's end, inside a record) is damage to the unit, which a
        writer repairs as it repairs one pointing at another queue's record (a damaged record is not the unit's
        fault: None). It was skipped on every read, its message never served again."""
        if self.repair_unit is None or not isinstance(exc, MessageNotFoundError) \
                or isinstance(exc, SegmentDeletedError):
            return None
        return self.repair_unit(topic, queue_id, queue_offset)

    def _log_unreadable(self, topic: str, queue_id: int, queue_offset: int, phy: int) -> None:
        """The error get_message logs for a unit whose record cannot be read (not one retention removed)."""
        if phy < self.commit_log.min_offset:
            return
        try:
            self.commit_log.get_message(phy)
        except (MessageNotFoundError, CorruptDataError) as exc:
            log.error("%s-%d offset %d: skipping the unreadable record at commit-log offset %d: %s", topic, queue_id,
                      queue_offset, phy, exc)

    def _unreadable_unit(self, topic: str, queue_id: int, queue_offset: int, phy: int) -> MessageExt | None:
        """``_unit_to_nothing`` for a unit the batch read left out (it cannot say why): asked of the record codec."""
        if phy < self.commit_log.min_offset:
            return None
        try:
            self.commit_log.get_message(phy)
        except (MessageNotFoundError, CorruptDataError) as exc:
            return self._unit_to_nothing(topic, queue_id, queue_offset, exc)
        return None  # readable now (a race with a write): the next read serves it

    def _misdirected(self, topic: str, queue_id: int, queue_offset: int, found: MessageExt) -> MessageExt | None:
        """A unit that points at a record of another queue (or another offset of this one) is damage: the record
        is never served in its place. ``repair_unit`` (set on a writer) may find and restore the right record."""
        key = (topic, queue_id, queue_offset)
        if key not in self.damaged_units and len(self.damaged_units) < MAX_REPORTED_UNITS:
            self.damaged_units[key] = found.commit_log_offset
            log.error("consume queue %s-%d: unit %d points at commit-log offset %d, a record of %s-%d at queue offset "
                      "%d; not served", topic, queue_id, queue_offset, found.commit_log_offset, found.topic,
                      found.queue_id, found.queue_offset)
        if self.repair_unit is not None:
            return self.repair_unit(topic, queue_id, queue_offset)
        return None

    def offset_by_time(self, topic: str, queue_id: int, timestamp: int, boundary: str = "lower") -> int:
        if type(boundary) is not str or boundary not in ("lower", "upper"):
            raise InvalidQueryError(f"boundary must be 'lower' or 'upper', not {boundary!r}")
        check_str("topic", topic)
        queue_id = check_int("queue_id", queue_id)
        timestamp = check_int("timestamp", timestamp)
        self.queues.check_managed(topic)
        queue = self.queues.get(topic, queue_id)
        if queue is None:
            return 0
        for attempt in range(3):
            try:
                found = queue.offset_by_time(timestamp, boundary == "upper", self.commit_log.store_time,
                                             self.commit_log.min_offset)
                break
            except SegmentDeletedError:  # retention took a file this read used: read the queue as it is now
                if attempt == 2:
                    raise
        return min(max(found, queue.min_offset_in_queue), queue.max_offset_in_queue)

    def earliest_message_time(self, topic: str | None = None, queue_id: int | None = None) -> int:
        if topic is None:
            return self.commit_log.store_time(self.commit_log.min_offset) if self.commit_log.max_offset else -1
        self.queues.check_managed(topic)
        queue = self.queues.get(topic, queue_id or 0)
        if queue is None:
            return -1
        unit = queue.get_unit(queue.min_offset_in_queue)
        return -1 if unit is None else self.commit_log.store_time(unit[0], unit[1])

    # --- by key, unique key, id ------------------------------------------------------------

    def query_message(self, topic: str, key: str, max_num: int = 64, begin: int = 0,
                      end: int | None = None) -> list[MessageExt]:
        """Messages of ``topic`` whose KEYS contain ``key``, stored in [begin, end]; newest ``max_num``,
        returned oldest first (``queryMessage``, with the client's exact filter applied)."""
        if type(max_num) is not int or type(begin) is not int or (end is not None and type(end) is not int) \
                or type(key) is not str or type(topic) is not str:
            max_num, begin, end = _window_args(max_num, begin, end)
            check_str("topic", topic)
            check_str("key", key)
        max_num = min(max_num, self.config.max_msgs_num_batch)
        end = LONG_MAX if end is None else end
        if self.index is None or max_num <= 0:
            return []
        candidates = self.index.candidates(topic, key, begin, end)
        if len(candidates) == 1:  # the usual answer, read and checked here: the calls of the general path
            phy = candidates[0]  # (get_message, _answers, has_key's own) were ~15% of a lookup
            log = self.commit_log
            mapped = log.mapped_files.find(phy)
            msg = None
            if mapped is not None and log.one_pass_reads:
                try:  # get_message's first form; anything else (deleted, damaged, IPv6) takes the general path
                    msg = decode_v4_at(mapped.buffer, phy - mapped.file_from_offset, mapped.wrote_position, phy,
                                       check_crc=log.check_crc)
                except (ValueError, RocketStoreError):
                    msg = None
            if msg is not None:  # _answers, inline
                if not begin <= msg.store_timestamp <= end or not msg.has_key(key):
                    return []
                if msg.topic == topic or (msg.topic in PARKED_TOPICS and msg.get_property("REAL_TOPIC") == topic):
                    return [msg]
                return []
        return self._checked(candidates, topic, key, max_num, begin, end, False)

    def query_by_uniq_key(self, topic: str, uniq_key: str, max_num: int | None = None) -> list[MessageExt]:
        if type(topic) is not str or type(uniq_key) is not str:
            check_str("topic", topic)
            check_str("uniq_key", uniq_key)
        limit = self.config.default_query_max_num if max_num is None else check_int("max_num", max_num)
        return self._verified(topic, uniq_key, limit, 0, LONG_MAX, True)

    def _verified(self, topic: str, key: str, max_num: int, begin: int, end: int, by_uniq_key: bool
                  ) -> list[MessageExt]:
        """The candidates' records that really are ``topic``'s (or parked for it), stored in [begin, end], with
        ``key`` among their KEYS (or as their UNIQ_KEY): a hash match proves nothing."""
        if self.index is None or max_num <= 0:
            return []
        return self._checked(self.index.candidates(topic, key, begin, end), topic, key, max_num, begin, end,
                             by_uniq_key)

    def _checked(self, candidates: list[int], topic: str, key: str, max_num: int, begin: int, end: int,
                 by_uniq_key: bool) -> list[MessageExt]:
        """``_verified``'s answer from the index's ``candidates`` (newest first)."""
        get_message = self.commit_log.get_message
        if len(candidates) == 1:  # the usual answer, checked without the bookkeeping of several
            try:
                msg = get_message(candidates[0])
            except MessageNotFoundError:  # an entry where no record starts (verify names it): no answer
                return []
            except CorruptDataError as exc:
                _log_unreadable_candidate(topic, key, candidates[0], exc)
                return []
            return [msg] if _answers(msg, topic, key, begin, end, by_uniq_key) else []
        found: dict[int, MessageExt] = {}
        # a delivered delay message hides its parked copy, before max_num counts: the hidden copy takes no place
        delivered: set[str | None] = set()  # UNIQ_KEYs of the answers that are the topic's own
        parked: dict[str | None, list[int]] = {}  # UNIQ_KEY -> offsets of parked copies kept so far
        for phy in candidates:
            if phy in found:
                continue
            try:
                msg = get_message(phy)
            except MessageNotFoundError:
                continue
            except CorruptDataError as exc:
                _log_unreadable_candidate(topic, key, phy, exc)
                continue
            if not _answers(msg, topic, key, begin, end, by_uniq_key):
                continue
            if msg.topic != topic:  # parked for topic (a delay or timer message before delivery)
                if msg.uniq_key in delivered:
                    continue
                parked.setdefault(msg.uniq_key, []).append(phy)
            else:
                delivered.add(msg.uniq_key)
                if parked and msg.uniq_key in parked:  # the delivered copy met after its parked one
                    for hidden in parked.pop(msg.uniq_key):
                        del found[hidden]
            found[phy] = msg
            if len(found) >= max_num:
                break
        return [found[phy] for phy in sorted(found)]

    def query_many(self, queries: Sequence[tuple[str, str]], max_num: int = 64, begin: int = 0,
                   end: int | None = None, *, include_body: bool = True, broker_name: str | None = None):
        """``query_message`` for many (topic, key) pairs at once, as one ``pyarrow.RecordBatch``: the message
        columns plus ``queryTopic`` and ``queryKey``, each query's messages oldest first, queries in order.

        The same answers as one ``query_message`` per pair (``tests/test_queries.py`` holds them equal), in
        batches: the keys are hashed in one compiled loop, every index file walks all chains in one, the
        candidate records are decoded together by the batch codec, and the checks (store time, topic or
        parked topic, the key among KEYS, the newest ``max_num``) are array operations.
        """
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc

        from .codec.batch import MESSAGE_FIELDS, decode_at
        from .index.bulk import candidates_batch, index_key_hashes

        schema = pa.schema([*MESSAGE_FIELDS, ("queryTopic", pa.string()), ("queryKey", pa.string())])
        max_num, begin, end = _window_args(max_num, begin, end)
        max_num = min(max_num, self.config.max_msgs_num_batch)
        end = LONG_MAX if end is None else end
        topics, keys = _query_columns(queries)
        if self.index is None or max_num <= 0 or not topics:
            return pa.RecordBatch.from_pylist([], schema=schema)
        hashes = index_key_hashes(list(map(build_key, topics, keys)))
        widened_begin = max(0, begin - 1000)
        with self.index.lock:
            files = list(self.index.files)
        found_q, found_phy = [], []
        if self.index.tail:  # a read-only view's records past the files' last entry: the newest
            tail = [(n, phy) for n, key_hash in enumerate(hashes.tolist())
                    for phy in self.index.tail_candidates(key_hash, widened_begin)]
            found_q.append(np.array([n for n, _ in tail], dtype=np.int64))
            found_phy.append(np.array([phy for _, phy in tail], dtype=np.int64))
        for index in reversed(files):  # newest first, as candidates
            if index.index_count > 1 and index.is_time_matched(widened_begin, end + 1000):
                try:
                    q, phy = candidates_batch(index, hashes, widened_begin)
                except (ValueError, StoreIOError):
                    if index in self.index.files:
                        raise
                    continue  # retention deleted it under this query: its messages are gone with their segments
                found_q.append(q)
                found_phy.append(phy)
            if index.begin_timestamp < widened_begin:
                break
        q = np.concatenate(found_q) if found_q else np.empty(0, np.int64)
        phy = np.concatenate(found_phy) if found_phy else np.empty(0, np.int64)
        rank = np.arange(len(q))
        by_pair = np.lexsort((rank, phy, q))  # the first time a query meets an offset is the one that counts
        repeat = np.zeros(len(q), dtype=bool)
        repeat[1:] = (q[by_pair][1:] == q[by_pair][:-1]) & (phy[by_pair][1:] == phy[by_pair][:-1])
        kept = np.sort(by_pair[~repeat])
        q, phy, rank = q[kept], phy[kept], rank[kept]
        order = np.lexsort((rank, q))  # each query's candidates newest first
        q, phy = q[order], phy[order]

        check = self.config.check_crc_on_read
        records = decode_at(self.commit_log, phy, check_crc=check,
                            verify_prop_crc=check and self.config.force_verify_prop_crc,
                            include_body=include_body, broker_name=broker_name)
        record_phy = records.column("commitLogOffset").to_numpy()
        row = np.minimum(np.searchsorted(record_phy, phy), max(len(record_phy) - 1, 0))
        readable = (record_phy[row] == phy) if len(record_phy) else np.zeros(len(phy), dtype=bool)
        q, phy, row = q[readable], phy[readable], row[readable]

        rows = pa.array(row)
        query_topic = pa.array(topics, pa.string()).take(pa.array(q))
        stamp = pc.cast(records.column("storeTimestamp").take(rows), pa.int64()).to_numpy(zero_copy_only=False)
        in_time = (stamp >= begin * 1000) & (stamp <= min(end, LONG_MAX // 1000) * 1000)
        topic = records.column("topic").take(rows)
        topic_ok = pc.equal(topic, query_topic).to_numpy(zero_copy_only=False)
        parked = pc.is_in(topic, value_set=pa.array(sorted(PARKED_TOPICS), pa.string())).to_numpy(
            zero_copy_only=False)
        if parked.any():
            real = pc.map_lookup(records.column("properties").take(rows), "REAL_TOPIC", "first")
            topic_ok |= parked & pc.fill_null(pc.equal(real, query_topic), False).to_numpy(zero_copy_only=False)
        key_lists = records.column("keys").take(rows)
        owner = pc.list_parent_indices(key_lists).to_numpy()
        same_key = pc.equal(pc.list_flatten(key_lists), pa.array(keys, pa.string()).take(pa.array(q[owner])))
        key_ok = np.zeros(len(q), dtype=bool)
        key_ok[owner[pc.fill_null(same_key, False).to_numpy(zero_copy_only=False)]] = True

        good = in_time & topic_ok & key_ok
        q, phy, row, parked = q[good], phy[good], row[good], parked[good]
        if parked.any():  # a delivered delay message hides its parked copy, before max_num counts
            uniq = records.column("uniqKey").take(pa.array(row)).to_pylist()
            delivered = {(qq, u) for qq, u, p in zip(q.tolist(), uniq, parked.tolist(), strict=True) if not p}
            hidden = np.array([p and (qq, u) in delivered for qq, u, p in zip(q.tolist(), uniq, parked.tolist(),
                                                                            strict=True)], dtype=bool)
            q, phy, row = q[~hidden], phy[~hidden], row[~hidden]
        first_of_query = np.searchsorted(q, q)  # q is sorted: where each query's run starts
        within = np.arange(len(q)) - first_of_query < max_num
        q, phy, row = q[within], phy[within], row[within]
        order = np.lexsort((phy, q))  # oldest first within each query
        q, row = q[order], row[order]
        picked = records.take(pa.array(row))
        return pa.RecordBatch.from_arrays(
            [*picked.columns, pa.array(topics, pa.string()).take(pa.array(q)),
             pa.array(keys, pa.string()).take(pa.array(q))], schema=schema)

    def _read_or_none(self, phy: int) -> MessageExt | None:
        try:
            return self.commit_log.get_message(phy)
        except (MessageNotFoundError, CorruptDataError):
            return None

    def view_message_by_id(self, msg_id: str, topic: str | None = None) -> MessageExt:
        """The message with this offset msgId; a UNIQ_KEY is accepted too (as mqadmin's ``queryMsgById`` falls back
        to ``queryMessageByUniqKey``): as given first (a producer may set a lower-case one), then in upper case
        (how RocketMQ's clients write them). A UNIQ_KEY names every copy of a message (a producer's retry, a
        consumer's retry, a transaction's half and its commit): the oldest of the newest 32 is the answer, as
        mqadmin's, in ``topic`` only when given, else in the first topic that has one, users' topics before
        retry and dead-letter ones and those before the system's."""
        given = msg_id.strip() if isinstance(msg_id, str) else ""
        if not given:
            raise InvalidMessageIdError(f"a message id or UNIQ_KEY is a non-empty string, not {msg_id!r}")
        if topic is not None:
            check_str("topic", topic)
        text = given.upper()
        if len(text) in (32, 56) and all(c in "0123456789ABCDEF" for c in text):
            try:
                _host, phy = decode_offset_msg_id(text)
                msg = self.commit_log.get_message(phy)
                if msg.msg_id == text:
                    return msg
            except (InvalidMessageIdError, MessageNotFoundError, CorruptDataError):
                pass  # not an offset id of this store: try it as a UNIQ_KEY
        topics = [topic] if topic is not None else sorted({*self.queues.topics(), *self.known_topics()},
                                                          key=_lookup_order)
        for uniq_key in dict.fromkeys((given, text)):
            for one in topics:
                hits = self.query_by_uniq_key(one, uniq_key, UNIQ_KEY_QUERY_MAX)
                if hits:
                    return hits[0]
        raise MessageNotFoundError(f"no message with id {msg_id}" + (f" in topic {topic}" if topic else ""))

    def iter_queue(self, topic: str, queue_id: int, start: int = 0) -> Iterator[MessageExt]:
        offset = start
        while True:
            result = self.get_message(topic, queue_id, offset, 256)
            yield from result.messages
            if result.status not in (GetMessageStatus.FOUND, GetMessageStatus.NO_MATCHED_MESSAGE,
                                     GetMessageStatus.MESSAGE_WAS_REMOVING, GetMessageStatus.OFFSET_FOUND_NULL,
                                     GetMessageStatus.OFFSET_TOO_SMALL):
                return
            offset = result.next_begin_offset


UNIQ_KEY_QUERY_MAX = 32  # MQAdminImpl.queryMessageByUniqKey's maxNum


def _lookup_order(topic: str) -> tuple[int, str]:
    """Users' topics, then retry and dead-letter topics, then the system's (a transaction's half, a parked delay)."""
    if is_system_topic(topic):
        return 2, topic
    return int(topic.startswith((RETRY_GROUP_TOPIC_PREFIX, DLQ_GROUP_TOPIC_PREFIX))), topic


def check_int(name: str, value: object, low: int | None = None, error: type[Exception] = InvalidQueryError) -> int:
    """``value`` as an int, or ``error`` naming the argument: an integer (a bool is not one), at least ``low``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise error(f"{name} must be an integer, not {value!r}")
    value = int(value)
    if low is not None and value < low:
        raise error(f"{name} must be at least {low}, not {value}")
    return value


def check_str(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise InvalidQueryError(f"{name} must be a string, not {value!r}")
    return value


def _get_message_args(topic: object, queue_id: object, offset: object, max_msgs: object) -> tuple[str, int, int, int]:
    """``get_message``'s arguments checked, the long way (its hot path only looks at their types)."""
    return (check_str("topic", topic), check_int("queue_id", queue_id), check_int("offset", offset),
            check_int("max_msgs", max_msgs, 1))


def _window_args(max_num: object, begin: object, end: object) -> tuple[int, int, int | None]:
    """A key query's ``max_num`` and store-time window [begin, end] checked."""
    return (check_int("max_num", max_num), check_int("begin", begin),
            None if end is None else check_int("end", end))


_PAIR_TYPES = {tuple, list}
_STR = {str}


def _query_columns(queries) -> tuple[list[str], list[str]]:
    """(topics, keys) of a sequence of (topic, key) string pairs; ``InvalidQueryError`` names the first bad one."""
    if isinstance(queries, str | bytes) or not isinstance(queries, Iterable):
        raise InvalidQueryError(f"queries must be a sequence of (topic, key) pairs, not {type(queries).__name__}")
    queries = queries if type(queries) is list or type(queries) is tuple else list(queries)
    if not queries:
        return [], []
    if {type(pair) for pair in queries} <= _PAIR_TYPES:  # the usual call, checked column by column in C
        try:
            topic_column, key_column = zip(*queries, strict=True)
        except ValueError:
            pass  # a pair of another length: named below
        else:
            if set(map(type, topic_column)) == _STR and set(map(type, key_column)) == _STR:
                return list(topic_column), list(key_column)
    topics: list[str] = []
    keys: list[str] = []
    for n, pair in enumerate(queries):
        if not (isinstance(pair, tuple | list) and len(pair) == 2 and isinstance(pair[0], str)
                and isinstance(pair[1], str)):
            raise InvalidQueryError(f"query {n} is {pair!r}, not a (topic, key) pair of strings")
        topics.append(pair[0])
        keys.append(pair[1])
    return topics, keys


def _int32(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value & 0x80000000 else value


def _answers(msg: MessageExt, topic: str, key: str, begin: int, end: int, by_uniq_key: bool) -> bool:
    """Whether a candidate really answers a key query: stored in [begin, end], ``key`` among its KEYS (or its
    UNIQ_KEY), and ``topic``'s own or parked for it (a delay or timer message before delivery)."""
    if not begin <= msg.store_timestamp <= end or not (msg.uniq_key == key if by_uniq_key else msg.has_key(key)):
        return False
    return msg.topic == topic or (msg.topic in PARKED_TOPICS and msg.get_property("REAL_TOPIC") == topic)

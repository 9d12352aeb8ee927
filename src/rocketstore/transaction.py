"""Transactional messages (RocketMQ's ``TransactionalMessageService``): half messages, commit, rollback, checks.

A half message is stored in ``RMQ_SYS_TRANS_HALF_TOPIC`` queue 0 with its real topic and queue in
REAL_TOPIC/REAL_QID and TRAN_MSG=true: durable, but in no queue a consumer reads. Ending a transaction
writes an op message to ``RMQ_SYS_TRANS_OP_HALF_TOPIC`` queue 0 (tag ``d``, body the half's queue
offset); a commit first stores the message in its real topic (sysflag TRANSACTION_COMMIT_TYPE,
preparedTransactionOffset the half's commit-log offset, the same UNIQ_KEY). So what is still open lives in
the store: on open, the halves without an op message. A crash between the committed copy and the op message
leaves the half open; the producer is asked again and a second commit stores a second copy (at least once).

An open half older than the check delay is offered for a check (the server asks a producer of its topic
through the telemetry stream); after ``max_checks`` unanswered checks it is copied to
``TRANS_CHECK_MAX_TIME_TOPIC`` and closed, as RocketMQ does, so nothing is lost silently. The counts survive
restarts in ``config/transactionChecks.json`` (written after each round of checks).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass

from .brokerconfig import TransactionCheckCounts
from .codec.msgid import decode_offset_msg_id
from .codec.properties import PropertyName
from .encoder import check_sendable, validate_topic
from .errors import InvalidMessageIdError, InvalidPropertyError, InvalidQueueError, RocketStoreError, StoreIOError
from .message import Message, MessageExt, PutMessageResult, SysFlag

log = logging.getLogger(__name__)

HALF_TOPIC = "RMQ_SYS_TRANS_HALF_TOPIC"
OP_TOPIC = "RMQ_SYS_TRANS_OP_HALF_TOPIC"
CHECK_MAX_TOPIC = "TRANS_CHECK_MAX_TIME_TOPIC"
REMOVE_TAG = "d"
_HALF_ONLY = (PropertyName.REAL_TOPIC, PropertyName.REAL_QUEUE_ID)
_DELAYS = frozenset({PropertyName.DELAY, PropertyName.TIMER_DELIVER_MS, PropertyName.TIMER_DELAY_SEC,
                     PropertyName.TIMER_DELAY_MS})
_KEPT_SYS_FLAGS = SysFlag.COMPRESSED | SysFlag.MULTI_TAGS | SysFlag.COMPRESSION_TYPE_MASK
_READ = 32


class UnknownTransactionError(RocketStoreError):
    """No open transaction has this id (never prepared, already ended, or not for this message/topic)."""


@dataclass(slots=True)
class OpenHalf:
    phy: int
    queue_offset: int
    uniq_key: str
    topic: str  # the real topic
    next_check_ms: int
    checks: int = 0
    committed: bool = False  # its committed copy is stored; only the op message that closes it is missing


class TransactionLog:
    """The open transactions of one store; thread-safe."""

    def __init__(self, store, *, check_after_ms: int = 6_000, max_checks: int = 15) -> None:
        self.store = store
        self.check_after_ms = check_after_ms
        self.max_checks = max_checks
        self._lock = threading.Lock()
        self._open: dict[int, OpenHalf] = {}
        self.checks = TransactionCheckCounts(store.root, read_only=store.read_only)
        self.committed = 0
        self.rolled_back = 0
        self._load()

    def _load(self) -> None:
        """Open halves: every half message without an op message."""
        if not self.store.read_only:
            for topic in (HALF_TOPIC, OP_TOPIC, CHECK_MAX_TOPIC):  # system topics exist even when auto-creation is off
                if self.store.topic_config.get(topic) is None:
                    self.store._create_system_topic(topic, 1)
        ended: set[int] = set()
        for msg in self._read_all(OP_TOPIC):
            try:
                ended.add(int(msg.body))
            except ValueError:
                log.warning("op message at %d has no half offset in its body", msg.commit_log_offset)
        for msg in self._read_all(HALF_TOPIC):
            if msg.queue_offset not in ended:
                self._open[msg.commit_log_offset] = self._entry(msg)
        self.checks.load(empty_if_bad=True)  # counts lost to a torn file and its backup: checked again, not lost
        for entry in self._open.values():
            entry.checks = self.checks.get(entry.phy)
        self.checks.keep_only(set(self._open))

    def _read_all(self, topic: str):
        if topic not in self.store.topics():
            return
        offset = self.store.get_min_offset_in_queue(topic, 0)
        while True:
            found = self.store.get_message(topic, 0, offset, _READ)
            yield from found.messages
            if found.next_begin_offset <= offset:
                return
            offset = found.next_begin_offset

    def _entry(self, half: MessageExt) -> OpenHalf:
        return OpenHalf(half.commit_log_offset, half.queue_offset, half.uniq_key or "",
                        half.properties.get(PropertyName.REAL_TOPIC, ""),
                        half.store_timestamp + self.check_after_ms)

    def open_count(self) -> int:
        with self._lock:
            return len(self._open)

    # --- the producer's side ----------------------------------------------------------------------

    def prepare(self, msg: Message) -> tuple[PutMessageResult, str]:
        """Store ``msg`` as a half message; returns the put result and the transaction id (its offset msgId).

        A delivery delay is refused, as RocketMQ's proxy does (its Java producer drops it): parked for later, the
        half would leave the half topic, and the commit would land in the half topic instead of the real one. The
        caller's transaction bits are cleared, as RocketMQ's broker does: a half marked PREPARED would get no
        queue offset, and a restart would forget it."""
        # the real topic and queue as a plain put checks them: a half whose commit can never be stored stayed open
        # (its every commit refused) until the check gave up on it
        check_sendable(validate_topic(msg.topic))
        if type(msg.queue_id) is not int or not 0 <= msg.queue_id < 1 << 31:
            raise InvalidQueueError(f"queue id must be an integer from 0 to 2**31-1, not {msg.queue_id!r}")
        self.store._check_topics([(msg.topic, msg.queue_id)])
        properties = dict(msg.properties or {})
        delays = sorted(set(properties) & _DELAYS)
        if delays:
            raise InvalidPropertyError(f"a transactional message cannot be delayed ({', '.join(delays)})")
        properties[PropertyName.REAL_TOPIC] = msg.topic
        properties[PropertyName.REAL_QUEUE_ID] = str(msg.queue_id)
        properties[PropertyName.TRANSACTION_PREPARED] = "true"
        half = dataclasses.replace(msg, topic=HALF_TOPIC, queue_id=0, properties=properties,
                                   sys_flag=msg.sys_flag & ~SysFlag.TRANSACTION_ROLLBACK_TYPE
                                   if type(msg.sys_flag) is int else msg.sys_flag)  # the encoder names a bad one
        result = self.store._put_system(half)
        if result.ok:
            with self._lock:
                self._open[result.commit_log_offset] = OpenHalf(
                    result.commit_log_offset, result.queue_offset, result.uniq_key or "", msg.topic,
                    result.store_timestamp + self.check_after_ms)
        return result, result.msg_id

    def end(self, transaction_id: str, message_id: str, topic: str, commit: bool) -> PutMessageResult | None:
        """Commit (store the message in its topic) or roll back an open transaction; the committed put's
        result, or None for a rollback (and for a commit an earlier end had stored, whose op message failed: only
        that is written now; a retry stored a second copy). Raises ``UnknownTransactionError``."""
        with self._lock:
            entry = self._find(transaction_id, message_id, topic)
            del self._open[entry.phy]  # no second end while this one writes
        try:
            result = None
            if commit and not entry.committed:  # an end whose op message failed stored the copy already
                half = self.store.look_message_by_offset(entry.phy)
                result = self.store._put_delivered(committed_copy(half))  # prepare checked perm
                entry.committed = True
            elif entry.committed and not commit:
                log.warning("transaction %s was committed (its message is stored) before a rollback came: the "
                            "rollback only closes it", transaction_id)
            self._close(entry)
        except BaseException:
            with self._lock:
                self._open[entry.phy] = entry
            raise
        if commit:
            self.committed += 1
        else:
            self.rolled_back += 1
        return result

    def _find(self, transaction_id: str, message_id: str, topic: str) -> OpenHalf:
        try:
            _host, phy = decode_offset_msg_id(transaction_id)
        except InvalidMessageIdError:
            raise UnknownTransactionError(f"{transaction_id[:64]!r} is not a transaction id") from None
        entry = self._open.get(phy)
        if entry is None:
            raise UnknownTransactionError(f"transaction {transaction_id} is not open (never prepared or already "
                                          f"ended)")
        if entry.uniq_key != message_id or entry.topic != topic:
            raise UnknownTransactionError(f"transaction {transaction_id} belongs to another message or topic")
        return entry

    def _close(self, entry: OpenHalf) -> None:
        self.store._put_system(Message(OP_TOPIC, str(entry.queue_offset).encode(), tags=REMOVE_TAG, queue_id=0))

    # --- the checker's side ----------------------------------------------------------------------

    def due_for_check(self, now_ms: int | None = None) -> list[tuple[MessageExt, str]]:
        """Open halves whose check is due, as (the message as its real topic shows it, transaction id); each
        is offered again ``check_after_ms`` later. Halves past ``max_checks`` are parked and closed."""
        now = time.time_ns() // 1_000_000 if now_ms is None else now_ms
        with self._lock:
            due = [e for e in self._open.values() if e.next_check_ms <= now]
            for entry in due:
                entry.next_check_ms = now + self.check_after_ms
                entry.checks += 1
                self.checks.set(entry.phy, entry.checks)
        out = []
        for entry in due:
            try:
                half = self.store.look_message_by_offset(entry.phy)
            except RocketStoreError as exc:  # retention removed it: nothing left to decide
                log.warning("open transaction at %d is unreadable, closing it: %s", entry.phy, exc)
                self._give_up(entry, None)
                continue
            if entry.checks > self.max_checks:
                self._give_up(entry, half)
                continue
            view = committed_copy(half)
            out.append((half.replace(topic=view.topic, queue_id=view.queue_id, properties=view.properties),
                        half.msg_id))
        with self._lock:
            self.checks.keep_only(set(self._open))  # ended and parked halves' counts go
        if self.checks.dirty:
            self._persist_checks()
        return out

    def _persist_checks(self) -> None:
        """A count that cannot be written stays in memory and is written with the next round: a restart before
        then checks those halves once more (said, not raised: the checks themselves go on)."""
        try:
            self.checks.persist()
        except StoreIOError as exc:
            log.error("cannot record the transaction check counts (a restart would check again): %s", exc)

    def _give_up(self, entry: OpenHalf, half: MessageExt | None) -> None:
        with self._lock:
            if self._open.pop(entry.phy, None) is None:
                return  # ended meanwhile
        try:
            if half is not None:
                log.warning("transaction %s of topic %s unresolved after %d checks: parked in %s", half.msg_id,
                            entry.topic, self.max_checks, CHECK_MAX_TOPIC)
                self.store._put_system(Message(CHECK_MAX_TOPIC, half.body, properties=dict(half.properties),
                                               queue_id=0, born_timestamp=half.born_timestamp,
                                               born_host=half.born_host))
            self._close(entry)
        except BaseException:
            with self._lock:
                self._open[entry.phy] = entry
            raise


def committed_copy(half: MessageExt) -> Message:
    """The message a commit stores: real topic and queue back, TRAN_MSG kept, TRANSACTION_COMMIT_TYPE."""
    properties = {k: v for k, v in half.properties.items() if k not in _HALF_ONLY}
    try:
        queue_id = int(half.properties.get(PropertyName.REAL_QUEUE_ID, "0"))
    except ValueError:
        queue_id = 0
    return Message(half.properties.get(PropertyName.REAL_TOPIC, ""), half.body, properties=properties,
                   queue_id=queue_id, flag=half.flag,
                   sys_flag=(half.sys_flag & _KEPT_SYS_FLAGS) | SysFlag.TRANSACTION_COMMIT_TYPE,
                   born_timestamp=half.born_timestamp, born_host=half.born_host,
                   prepared_transaction_offset=half.commit_log_offset)

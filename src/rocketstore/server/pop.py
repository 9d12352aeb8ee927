"""What SimpleConsumer groups have received and not yet acknowledged (RocketMQ's pop consumption).

Per group, topic and queue: the committed offset (the store's consumer offset, config/consumerOffset.json),
the next offset to hand out, the messages in flight with their invisible deadlines and delivery attempts,
and the offsets acknowledged above the committed one. The committed offset only moves over a contiguous run
of acknowledged (or filtered-out) offsets, so after a crash every message that was received and not
acknowledged is delivered again from it.

That state is also saved (``config/popState.json``, which RocketMQ ignores; RocketMQ keeps it in pop checkpoints
and ack records): at a clean stop, every ``flush_consumer_offset_interval`` while it changes, and under
SYNC_FLUSH before an ack is answered. A restart then keeps a held message invisible until its deadline with its
delivery count (a FIFO group's message is not handed to a second consumer meanwhile), keeps the acknowledgements
above an unacknowledged message, and takes the receipt handles it issued. Without it, a clean restart delivered
every held message at once as a first attempt (never reaching the DLQ) and every acknowledged message above a
held one again. What a crash may still deliver twice is what changed after the last save (at-least-once).

A FIFO group (consumeMessageOrderly in subscriptionGroup.json) has at most one message of each message
group in flight: a message whose group has one in flight, or an earlier one held back, is held back too
(remembered by offset, not re-read) and handed out, in order, once the one before it is acknowledged or
dead-lettered. A message that is not acknowledged in time comes back before any later one of its group.

A receipt handle names the queue, the offset and the delivery (a number that changes with every
delivery and every ChangeInvisibleDuration), signed with a key kept with the saved state: a forged handle or one
from an earlier delivery of the same message is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import logging
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..codec.properties import PropertyName
from ..errors import RocketStoreError
from ..mapped.file import replace_file
from ..message import MessageExt
from ..reads import GetMessageStatus
from ..sqlfilter import SqlFilter
from ..store import MessageStore
from .renewal import RenewPolicy, retry_delay

log = logging.getLogger("rocketstore.server")

DLQ_PREFIX = "%DLQ%"
SCAN_MAX = 32  # messages read per queue per look (the store's get_message batch)
MAX_BATCH = 32  # messages a receive or pull hands out at most (RocketMQ's proxy: MAX_MSG_NUMS_FOR_POP_REQUEST)
# and their bodies' bytes, past the first message (RocketMQ's maxTransferBytesOnMessageInMemory): a receive of 32
# 4 MiB messages would otherwise hold 128 MiB per call
MAX_BATCH_BYTES = 256 * 1024
HELD_MAX = 4096  # a FIFO queue stops reading ahead once this many messages wait behind their groups
# what _sign makes, and nothing else: ASCII digits only (int() would take "٣", " 3" or "1_0"), a hex MAC (a
# non-ASCII one made hmac.compare_digest raise TypeError: an internal error instead of INVALID_RECEIPT_HANDLE)
_HANDLE = re.compile(r"([0-9]{1,10})\.([0-9]{1,19})\.([0-9]{1,19})\.([0-9a-f]{24})", re.ASCII)


def fit(messages: list[MessageExt], next_begin: int, taken_bytes: int = 0) -> tuple[list[MessageExt], int]:
    """The head of ``messages`` whose bodies fit in MAX_BATCH_BYTES beside ``taken_bytes`` already taken (one at
    least, when nothing is), and the queue offset to read next: the first message left out, or ``next_begin``."""
    total = taken_bytes
    for i, msg in enumerate(messages):
        total += len(msg.body)
        if total > MAX_BATCH_BYTES and (i or taken_bytes):
            return messages[:i], msg.queue_offset
    return messages, next_begin


class _Taken(list):
    """A receive's deliveries, with their bodies' bytes: full past MAX_BATCH_BYTES."""

    bytes = 0

    def append(self, delivery: Delivery) -> None:
        super().append(delivery)
        self.bytes += len(delivery.message.body)

    @property
    def full(self) -> bool:
        return self.bytes >= MAX_BATCH_BYTES


class InvalidReceiptHandleError(RocketStoreError):
    """A receipt handle that this server did not issue for a message still in flight."""


class QueueBusyError(Exception):
    """``next_due(..., wait=False)`` found a queue's lock held: an operation on that queue is running."""


class DeadLetterError(RocketStoreError):
    """The store refused a message's copy in ``%DLQ%<group>``: the message stays the group's to consume."""


@dataclass(slots=True)
class Renewing:
    """A message the server keeps invisible for its push consumer (``renewal.py``)."""

    client: str
    received_ms: int
    renewals: int = 0


@dataclass(slots=True)
class InFlight:
    deadline_ms: int
    attempt: int  # 1 for the first delivery
    delivery: int  # the number in the current receipt handle
    group: str | None = None  # its message group, in a FIFO consumer group
    renew: Renewing | None = None  # received with auto_renew: renewed while its client is there


@dataclass(slots=True)
class QueueState:
    committed: int
    next: int
    inflight: dict[int, InFlight] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)  # acknowledged or filtered out, above committed
    busy: dict[str, int] = field(default_factory=dict)  # FIFO: message group -> its offset in flight
    held: dict[int, str] = field(default_factory=dict)  # FIFO: offset -> message group, read but waiting
    held_groups: dict[str, int] = field(default_factory=dict)  # FIFO: message group -> how many are held
    # held by every operation on this queue's state, across its store reads, DLQ puts and offset commits: those
    # of other groups, topics and queues go on meanwhile
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def hold(self, offset: int, message_group: str) -> None:
        self.held[offset] = message_group
        self.held_groups[message_group] = self.held_groups.get(message_group, 0) + 1

    def release(self, offset: int) -> str:
        message_group = self.held.pop(offset)
        left = self.held_groups[message_group] - 1
        if left:
            self.held_groups[message_group] = left
        else:
            del self.held_groups[message_group]
        return message_group


@dataclass(slots=True)
class Delivery:
    message: MessageExt
    receipt_handle: str
    attempt: int
    invisible_ms: int


class PopGroups:
    """In-flight state of every (group, topic); thread-safe.

    Each (group, topic, queue) has a lock of its own (``QueueState.lock``), held for a whole operation on it, store
    reads and dead-letter puts included: an operation sees and leaves the queue's in-flight state consistent, and
    a slow read of one queue holds up only the calls on that queue. ``_lock`` only guards the table of queue states
    and the counters, never across store I/O."""

    def __init__(self, store: MessageStore, *, max_attempts: int = 16, is_fifo=None,
                 state_path: Path | None = None) -> None:
        self.store = store
        self.max_attempts = max_attempts
        self.is_fifo = is_fifo or (lambda group: False)
        self._key = secrets.token_bytes(32)
        self._lock = threading.Lock()
        self._queues: dict[tuple[str, str, int], QueueState] = {}
        self._deliveries = itertools.count(1)  # next() is atomic: no lock needed
        self.dead_lettered = 0
        self.dead_letter_failures = 0
        self.renewed = 0
        self.state_path = state_path
        self._changed = 0  # changes so far (``_mark``, under the queue's lock); ``save`` writes all it has seen
        self._saved = 0
        self._save_lock = threading.Lock()
        if state_path is not None:
            self._load(state_path)

    # --- receipt handles -------------------------------------------------------------------------

    def _sign(self, group: str, topic: str, queue_id: int, offset: int, delivery: int) -> str:
        body = f"{queue_id}.{offset}.{delivery}"
        mac = hmac.new(self._key, f"{group}\0{topic}\0{body}".encode(), hashlib.sha256).hexdigest()[:24]
        return f"{body}.{mac}"

    def _parse(self, group: str, topic: str, handle: str) -> tuple[int, int, int]:
        parts = _HANDLE.fullmatch(handle)
        if parts is None:
            raise InvalidReceiptHandleError(f"malformed receipt handle {handle[:64]!r}")
        queue_id, offset, delivery = int(parts[1]), int(parts[2]), int(parts[3])
        mac = parts[4]
        expected = self._sign(group, topic, queue_id, offset, delivery).rsplit(".", 1)[1]
        if not hmac.compare_digest(mac, expected):
            raise InvalidReceiptHandleError("receipt handle was not issued by this server for this group and topic")
        return queue_id, offset, delivery

    # --- receive, ack, change invisible duration ------------------------------------------------------

    def _state(self, group: str, topic: str, queue_id: int) -> QueueState:
        key = (group, topic, queue_id)
        state = self._queues.get(key)
        if state is None:
            with self._lock:
                state = self._queues.get(key)
                if state is None:  # the store's offset tables, in memory
                    committed = self.store.query_offset(group, topic, queue_id)
                    if committed < 0:  # a new group reads the queue from its oldest message (what tests expect)
                        committed = self.store.get_min_offset_in_queue(topic, queue_id)
                    state = self._queues[key] = QueueState(committed, committed)
        return state

    def move_offset(self, group: str, topic: str, queue_id: int, offset: int) -> bool:
        """UpdateOffset for a queue this group also receives from: its state takes the new offset (receives go on
        from there), else the group's next ack committed its old position over it (an OK answer undone, the
        stored offset moving back). False, changing nothing, while messages of the queue are in flight or held."""
        with self._lock:
            state = self._queues.get((group, topic, queue_id))
        if state is None:
            self.store.commit_offset(group, topic, queue_id, offset)
            return True
        with state.lock:
            if state.inflight or state.held:
                return False
            self.store.commit_offset(group, topic, queue_id, offset)
            state.committed = state.next = offset
            state.done.clear()
            self._mark()
            return True

    def receive(self, group: str, topic: str, queue_ids: list[int], batch: int, invisible_ms: int,
                tags: str | None, sql: SqlFilter | None = None) -> list[Delivery]:
        """Up to ``batch`` messages: those whose invisible time has passed first, then new ones.

        A store error raises only when nothing was taken yet: messages already marked in flight are handed out
        (else they would be invisible, undelivered, until their deadline) and the error is logged."""
        now = _now_ms()
        out = _Taken()
        batch = min(batch, MAX_BATCH)
        try:
            for queue_id in queue_ids:
                if len(out) >= batch or out.full:
                    break
                state = self._state(group, topic, queue_id)
                with state.lock:
                    for offset in sorted(o for o, f in state.inflight.items() if f.deadline_ms <= now):
                        if len(out) >= batch or out.full:
                            break
                        self._redeliver(group, topic, queue_id, state, offset, now, invisible_ms, out)
            fifo = self.is_fifo(group)
            for queue_id in queue_ids:
                if len(out) >= batch or out.full:
                    break
                state = self._state(group, topic, queue_id)
                with state.lock:
                    if fifo:
                        self._take_held(group, topic, queue_id, state, batch - len(out), now, invisible_ms, out)
                    self._take_new(group, topic, queue_id, state, batch - len(out), now, invisible_ms, tags, sql,
                                   out, fifo)
        except RocketStoreError as exc:
            if not out:
                raise
            log.error("receive of %s from %s stopped after %d messages: %s", group, topic, len(out), exc)
        return list(out)

    def next_due(self, group: str, topic: str, queue_ids: list[int], *, wait: bool = True) -> int | None:
        """When (epoch ms) the first message of these queues now in flight becomes visible again, if any: a
        waiting receive wakes then to take it. With ``wait=False``, QueueBusyError rather than wait for a queue's
        lock (the long-poll watcher, which wakes every receive, must not stall behind a store read)."""
        deadlines = []
        for queue_id in queue_ids:
            state = self._queues.get((group, topic, queue_id))
            if state is None:
                continue
            if not state.lock.acquire(blocking=wait):
                raise QueueBusyError(f"{group} on {topic} queue {queue_id} is busy")
            try:
                deadlines += [f.deadline_ms for f in state.inflight.values()]
            finally:
                state.lock.release()
        return min(deadlines, default=None)

    def _deliver(self, group: str, topic: str, queue_id: int, state: QueueState, msg: MessageExt, attempt: int,
                 now: int, invisible_ms: int, out: list[Delivery], message_group: str | None = None) -> None:
        delivery = next(self._deliveries)
        self._mark()
        state.inflight[msg.queue_offset] = InFlight(now + invisible_ms, attempt, delivery, message_group)
        if message_group is not None:
            state.busy[message_group] = msg.queue_offset
        handle = self._sign(group, topic, queue_id, msg.queue_offset, delivery)
        out.append(Delivery(msg, handle, attempt, invisible_ms))

    def _redeliver(self, group: str, topic: str, queue_id: int, state: QueueState, offset: int, now: int,
                   invisible_ms: int, out: list[Delivery]) -> None:
        flight = state.inflight[offset]
        found = self.store.get_message(topic, queue_id, offset, 1)
        msgs = [m for m in found.messages if m.queue_offset == offset]
        if not msgs:  # gone (retention): nothing left to deliver
            self._finish(group, topic, queue_id, state, offset)
            return
        if flight.attempt >= self.max_attempts:
            try:
                self._dead_letter(group, msgs[0])
            except DeadLetterError as exc:  # delivered again instead: a refused DLQ must not wedge the group
                log.error("%s; delivering it again", exc)
            else:
                self._finish(group, topic, queue_id, state, offset)
                return
        self._deliver(group, topic, queue_id, state, msgs[0], flight.attempt + 1, now, invisible_ms, out, flight.group)

    def _take_held(self, group: str, topic: str, queue_id: int, state: QueueState, room: int, now: int,
                   invisible_ms: int, out: list[Delivery]) -> None:
        """FIFO: held-back messages whose group is free again, oldest first, one per group."""
        for offset in sorted(state.held):
            if room <= 0 or out.full:
                return
            if state.held[offset] in state.busy:
                continue
            message_group = state.release(offset)
            found = [m for m in self.store.get_message(topic, queue_id, offset, 1).messages if m.queue_offset == offset]
            if not found:  # gone (retention)
                state.done.add(offset)
                self._advance(group, topic, queue_id, state)
                continue
            self._deliver(group, topic, queue_id, state, found[0], 1, now, invisible_ms, out, message_group)
            room -= 1

    def _take_new(self, group: str, topic: str, queue_id: int, state: QueueState, room: int, now: int,
                  invisible_ms: int, tags: str | None, sql: SqlFilter | None, out: list[Delivery],
                  fifo: bool = False) -> None:
        while room > 0 and not out.full and not (fifo and len(state.held) >= HELD_MAX):
            found = self.store.get_message(topic, queue_id, state.next, min(SCAN_MAX, room), tags, sql=sql)
            if found.status is GetMessageStatus.OFFSET_TOO_SMALL:  # retention removed what we had not read
                state.next = max(state.next, found.min_offset)
                state.committed = max(state.committed, found.min_offset)
                continue
            messages, next_begin = fit(found.messages, found.next_begin_offset, out.bytes)
            delivered = {m.queue_offset for m in messages}
            for offset in range(state.next, next_begin):
                if offset not in delivered:
                    state.done.add(offset)  # filtered out by tag: consumed as far as this group goes
            for msg in messages:
                message_group = msg.properties.get(PropertyName.SHARDING_KEY) if fifo else None
                if message_group is not None and (message_group in state.busy or message_group in state.held_groups):
                    state.hold(msg.queue_offset, message_group)  # waits for the one before it
                    continue
                self._deliver(group, topic, queue_id, state, msg, 1, now, invisible_ms, out, message_group)
                room -= 1
            advanced = next_begin > state.next
            state.next = max(state.next, next_begin)
            self._advance(group, topic, queue_id, state)
            if not advanced or (found.status is not GetMessageStatus.FOUND and not found.messages):
                return

    def _handled(self, group: str, topic: str, handle: str) -> tuple[int, int, int, QueueState]:
        """(queue id, offset, delivery, queue state) of the delivery ``handle`` names."""
        queue_id, offset, delivery = self._parse(group, topic, handle)
        return queue_id, offset, delivery, self._state(group, topic, queue_id)

    @staticmethod
    def _in_flight(state: QueueState, offset: int, delivery: int) -> InFlight:
        """The in-flight entry of that delivery, if it is still the current one; hold ``state.lock``."""
        flight = state.inflight.get(offset)
        if flight is None or flight.delivery != delivery:
            raise InvalidReceiptHandleError("receipt handle expired: the message was delivered again or already "
                                            "acknowledged")
        return flight

    @staticmethod
    def _unexpired(flight: InFlight, now: int) -> InFlight:
        """The proxy's ``validateReceiptHandle``: once a message is visible again, the consumer that held it has lost
        it (another may receive it any moment), so its ack or invisible-time change is refused, not half-honoured."""
        if flight.deadline_ms <= now:
            raise InvalidReceiptHandleError("receipt handle is expired: the message's invisible time has passed and "
                                            "it will be delivered again")
        return flight

    def ack(self, group: str, topic: str, handle: str) -> None:
        queue_id, offset, delivery, state = self._handled(group, topic, handle)
        with state.lock:
            self._unexpired(self._in_flight(state, offset, delivery), _now_ms())
            self._finish(group, topic, queue_id, state, offset)

    def change_invisible(self, group: str, topic: str, handle: str, invisible_ms: int) -> str:
        """Make the message invisible for ``invisible_ms`` from now; returns its new receipt handle."""
        queue_id, offset, delivery, state = self._handled(group, topic, handle)
        with state.lock:
            now = _now_ms()
            flight = self._unexpired(self._in_flight(state, offset, delivery), now)
            flight.deadline_ms = now + invisible_ms
            flight.delivery = next(self._deliveries)
            flight.renew = None  # the client decides now (a nack's backoff): the proxy stops renewing it too
            self._mark()
            return self._sign(group, topic, queue_id, offset, flight.delivery)

    def mark_renewed(self, group: str, topic: str, deliveries: list[Delivery], client_id: str) -> None:
        """``deliveries`` were received with ``auto_renew`` by ``client_id``: ``renew`` keeps them invisible."""
        now = _now_ms()
        for d in deliveries:
            _queue_id, offset, delivery, state = self._handled(group, topic, d.receipt_handle)
            with state.lock:
                flight = state.inflight.get(offset)
                if flight is not None and flight.delivery == delivery:
                    flight.renew = Renewing(client_id, now)
                    self._mark()

    def give_back(self, client_id: str, invisible_ms: int) -> list[tuple[str, str, int]]:
        """What ``client_id`` held with ``auto_renew``, visible again ``invisible_ms`` from now and renewed no more
        (it said it terminates: the proxy clears it then, so a later word from the same id revives nothing);
        (topic, group, when) of each."""
        now = _now_ms()
        with self._lock:
            states = list(self._queues.items())
        sooner = []
        for (group, topic, _queue_id), state in states:
            if not state.inflight:
                continue
            with state.lock:
                for flight in state.inflight.values():
                    if flight.renew is not None and flight.renew.client == client_id:
                        flight.deadline_ms = now + invisible_ms
                        flight.renew = None
                        sooner.append((topic, group, flight.deadline_ms))
                        self._mark()
        return sooner

    def renew(self, policy: RenewPolicy, online, now: int | None = None) -> list[tuple[str, str, int]]:
        """One renewal pass (the proxy's ``scheduleRenewTask``): every message received with ``auto_renew`` is
        hidden longer once within ``policy.ahead_ms`` of visible again, given back with the group's retry delay past
        ``policy.max_ms``, and visible again ``policy.clear_ms`` from now once ``online(client)`` says its client is
        gone. The receipt handle stays the same. Returns (topic, group, when) of each message now visible sooner,
        for the receives waiting on it."""
        now = _now_ms() if now is None else now
        with self._lock:
            states = list(self._queues.items())
        sooner = []
        present: dict[str, bool] = {}  # asked once per client and pass, not once per message under a queue's lock
        for (group, topic, _queue_id), state in states:
            if not state.inflight:
                continue
            with state.lock:
                for flight in state.inflight.values():
                    renewing = flight.renew
                    if renewing is None:
                        continue
                    there = present.get(renewing.client)
                    if there is None:
                        there = present[renewing.client] = online(renewing.client)
                    if not there:
                        flight.deadline_ms = now + policy.clear_ms
                        flight.renew = None
                    elif flight.deadline_ms - now > policy.ahead_ms:
                        continue
                    elif now - renewing.received_ms >= policy.max_ms:
                        flight.deadline_ms = now + retry_delay(flight.attempt)
                        flight.renew = None
                    else:
                        flight.deadline_ms = now + policy.step(renewing.renewals)
                        renewing.renewals += 1
                        self.renewed += 1
                    if flight.renew is None:
                        sooner.append((topic, group, flight.deadline_ms))
                    self._mark()
        return sooner

    def release(self, group: str, topic: str, deliveries: list[Delivery]) -> int:
        """Hand back ``deliveries`` that never reached their client (its receive was cancelled): each is visible
        again at once, its delivery attempt not counted, and a FIFO group's message comes back before the rest of
        its group. Deliveries no longer in flight as handed out (acknowledged, delivered again) are skipped; returns
        how many were released."""
        released = 0
        for d in deliveries:
            _queue_id, offset, delivery, state = self._handled(group, topic, d.receipt_handle)
            with state.lock:
                try:
                    flight = self._in_flight(state, offset, delivery)
                except InvalidReceiptHandleError:
                    continue
                flight.deadline_ms = 0
                flight.attempt -= 1  # its next delivery is this attempt again
                flight.renew = None
                self._mark()
                released += 1
        return released

    def forward_to_dlq(self, group: str, topic: str, handle: str) -> None:
        """ForwardMessageToDeadLetterQueue: the push consumer gave up on the message. If the store refuses the
        DLQ copy (DeadLetterError) the message stays in flight and comes back after its invisible time."""
        queue_id, offset, delivery, state = self._handled(group, topic, handle)
        with state.lock:
            self._in_flight(state, offset, delivery)
            found = [m for m in self.store.get_message(topic, queue_id, offset, 1).messages if m.queue_offset == offset]
            if found:
                self._dead_letter(group, found[0])
            self._finish(group, topic, queue_id, state, offset)

    # --- bookkeeping ----------------------------------------------------------------------------

    def _finish(self, group: str, topic: str, queue_id: int, state: QueueState, offset: int) -> None:
        self._mark()
        flight = state.inflight.pop(offset, None)
        if flight is not None and flight.group is not None and state.busy.get(flight.group) == offset:
            del state.busy[flight.group]
        state.done.add(offset)
        self._advance(group, topic, queue_id, state)

    def _advance(self, group: str, topic: str, queue_id: int, state: QueueState) -> None:
        start = state.committed
        while state.committed in state.done:
            state.done.discard(state.committed)
            state.committed += 1
        if state.committed != start:
            self.store.commit_offset(group, topic, queue_id, state.committed)

    def _dead_letter(self, group: str, msg: MessageExt) -> None:
        """Copy ``msg`` to ``%DLQ%<group>``; a store that refuses it (topic not writable, disk full, ...) raises
        DeadLetterError and the caller keeps the message in the group, so one bad DLQ cannot stop a queue."""
        from ..message import Message

        props = dict(msg.properties)
        props.setdefault("REAL_TOPIC", msg.topic)
        props["ORIGIN_MESSAGE_ID"] = msg.msg_id
        props["RETRY_TOPIC"] = msg.topic
        try:
            self.store.put_message(Message(DLQ_PREFIX + group, msg.body, properties=props, queue_id=0, flag=msg.flag,
                                           born_timestamp=msg.born_timestamp, born_host=msg.born_host))
        except RocketStoreError as exc:
            with self._lock:
                self.dead_letter_failures += 1
            raise DeadLetterError(f"{msg.topic} queue {msg.queue_id} offset {msg.queue_offset} could not go to "
                                  f"{DLQ_PREFIX}{group}: {exc}") from exc
        with self._lock:
            self.dead_lettered += 1

    # --- the saved state ------------------------------------------------------------------------

    @property
    def unsaved(self) -> bool:
        return self._changed > self._saved

    def _mark(self) -> None:
        """Count a change to a queue's state; called holding that queue's lock, so a save that has seen the count
        snapshots the queue after the change is whole."""
        with self._lock:
            self._changed += 1

    def save(self) -> None:
        """Write every queue's state (and first the consumer offsets it agrees with) if it changed since the last
        save; concurrent callers share one write (a caller whose change an ongoing write did not see waits for
        the next). Raises ``StoreIOError``."""
        if self.state_path is None:
            return
        with self._lock:
            wanted = self._changed
        with self._save_lock:
            if self._saved >= wanted:
                return
            with self._lock:
                seen = self._changed
                queues = list(self._queues.items())
            rows = []
            for (group, topic, queue_id), state in queues:
                with state.lock:
                    rows.append({"group": group, "topic": topic, "queueId": queue_id, "committed": state.committed,
                                 "next": state.next, "done": _runs(state.done),
                                 "inflight": [[o, f.deadline_ms, f.attempt, f.delivery, f.group, *_renewing(f)]
                                              for o, f in sorted(state.inflight.items())],
                                 "held": sorted(state.held.items())})
            self.store.consumer_offsets.persist(force=True)
            # numbers handed out after this save must never be handed out again by a restart that loads it (the
            # same key signs them: a dead consumer's handle would act on a new delivery): the file reserves the next
            # 2^32, more than any server hands out between two saves
            document = {"version": 1, "key": self._key.hex(), "delivery": next(self._deliveries) + _RESERVED,
                        "queues": rows}
            # private: it holds the key that signs receipt handles
            replace_file(self.state_path, json.dumps(document, separators=(",", ":")).encode(), private=True)
            self._saved = seen

    def _load(self, path: Path) -> None:
        """The saved state, each queue's as far as it agrees with the store's committed offset: an offsets file
        written after it (later acks) moves the queue on; one before it (an operator's reset-offset) wins, and
        that queue starts over. A state that does not parse is logged and ignored (at-least-once: the committed
        offsets alone)."""
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
            key = bytes.fromhex(document["key"])
            delivery = int(document["delivery"])
            rows = document["queues"]
            if len(key) != 32 or delivery < 1 or not isinstance(rows, list):
                raise ValueError("bad key, delivery or queues")
            states = {}
            for row in rows:
                group, topic, queue_id = str(row["group"]), str(row["topic"]), int(row["queueId"])
                committed, nxt = int(row["committed"]), int(row["next"])
                stored = self.store.query_offset(group, topic, queue_id)
                if 0 <= stored < committed or nxt < committed:
                    continue  # the offset was moved back since: it wins
                base = max(committed, stored)
                # nothing past the queue's end can have been handed out: a damaged file's wild numbers stop there
                # (a run to 10^12 would otherwise fill the memory)
                nxt = min(max(nxt, base), max(self.store.get_max_offset_in_queue(topic, queue_id), base))
                state = QueueState(base, nxt)
                state.done = {o for start, end in row["done"]
                              for o in range(max(int(start), base), min(int(end), nxt))}
                for offset, deadline, attempt, number, message_group, *renewing in row["inflight"]:
                    if int(offset) >= base:
                        state.inflight[int(offset)] = InFlight(int(deadline), int(attempt), int(number),
                                                               None if message_group is None else str(message_group),
                                                               _renewing_of(renewing))
                        if message_group is not None:
                            state.busy[str(message_group)] = int(offset)
                for offset, message_group in row["held"]:
                    if int(offset) >= base:
                        state.hold(int(offset), str(message_group))
                if stored != base:
                    self.store.commit_offset(group, topic, queue_id, base)
                self._advance(group, topic, queue_id, state)
                states[(group, topic, queue_id)] = state
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.error("ignoring the saved consumer state %s (%s): messages held before the restart are delivered "
                      "again now", path, exc)
            return
        self._key, self._deliveries, self._queues = key, itertools.count(delivery), states

    def in_flight(self) -> int:
        with self._lock:
            states = list(self._queues.values())
        return sum(len(s.inflight) for s in states)


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _renewing(flight: InFlight) -> list:
    """A saved in-flight row's renewal, when it has one: [[client, received ms, renewals]]."""
    renewing = flight.renew
    return [] if renewing is None else [[renewing.client, renewing.received_ms, renewing.renewals]]


def _renewing_of(saved: list) -> Renewing | None:
    if not saved or saved[0] is None:
        return None
    client, received, renewals = saved[0]
    return Renewing(str(client), int(received), int(renewals))


_RESERVED = 1 << 32


def _runs(offsets: set[int]) -> list[list[int]]:
    """``offsets`` as sorted [start, end) runs: acknowledgements come mostly in order, so a few runs."""
    runs: list[list[int]] = []
    for offset in sorted(offsets):
        if runs and runs[-1][1] == offset:
            runs[-1][1] = offset + 1
        else:
            runs.append([offset, offset + 1])
    return runs

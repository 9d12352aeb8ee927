"""``apache.rocketmq.v2.MessagingService`` over one ``MessageStore``: what RocketMQ 5's proxy does for its clients.

Covered: routes (this endpoint, the topic's queues), heartbeats, the telemetry stream's settings handshake,
sending (normal and FIFO messages with keys, tags and properties), SimpleConsumer and PushConsumer
consumption (receive with an invisible duration, ack, change invisible duration, redelivery with the
attempt counted, dead-letter queue after the group's max attempts, QueryAssignment, forwarding to the
DLQ), and the pull-style offsets (GetOffset, QueryOffset, UpdateOffset, PullMessage). Every failure is a
status in the response, with RocketMQ's codes; nothing is written for a refused request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import inspect
import ipaddress
import logging
import socket
import threading
import time
import zlib
from collections.abc import AsyncIterator, Iterator

import grpc

from ..brokerconfig import PERM_READ, PERM_WRITE, TopicConfig
from ..codec.hosts import Host
from ..codec.properties import PropertyName
from ..config import FlushDiskType
from ..encoder import (
    _TOPIC_CHARS,
    DLQ_GROUP_TOPIC_PREFIX,
    RETRY_GROUP_TOPIC_PREFIX,
    is_system_topic,
    validate_topic,
)
from ..errors import (
    IllegalDeliveryTimeError,
    InvalidPropertyError,
    InvalidQueueError,
    InvalidTopicError,
    MessageIllegalError,
    MessageTooLargeError,
    PropertiesTooLargeError,
    RocketStoreError,
    StoreFailedError,
    StoreIOError,
    TopicNotExistError,
    UnsupportedLayoutError,
)
from ..message import Message, MessageExt, PutMessageStatus
from ..reads import parse_tags
from ..sqlfilter import InvalidFilterError, SqlFilter, compile_sql92
from ..store import MessageStore
from ..transaction import TransactionLog, UnknownTransactionError
from .auth import Accounts
from .longpoll import LongPolls, call_soon
from .pop import MAX_BATCH, DeadLetterError, InvalidReceiptHandleError, PopGroups, fit
from .protocol import SERVICE, pb, service_methods
from .renewal import RETRY_MS, Clients, RenewPolicy

log = logging.getLogger("rocketstore.server")

BROKER_NAME = "rocketstore"
# RocketMQ's MessageConst.STRING_HASH_SET (a send naming one is refused, a delivery leaves them out of the user
# properties), and the names rocketstore's own store reads (__SHARDINGKEY, INNER_NUM, ...)
RESERVED_PROPERTIES = frozenset((
    "TRACE_ON", "MSG_REGION", "KEYS", "TAGS", "WAIT", "DELAY", "RETRY_TOPIC", "REAL_TOPIC", "REAL_QID", "TRAN_MSG",
    "PGROUP", "MIN_OFFSET", "MAX_OFFSET", "BUYER_ID", "ORIGIN_MESSAGE_ID", "TRANSFER_FLAG", "CORRECTION_FLAG",
    "MQ2_FLAG", "RECONSUME_TIME", "UNIQ_KEY", "MAX_RECONSUME_TIMES", "CONSUME_START_TIME", "POP_CK",
    "POP_CK_OFFSET", "1ST_POP_TIME", "TRAN_PREPARED_QUEUE_OFFSET", "DUP_INFO", "EXTEND_UNIQ_INFO", "INSTANCE_ID",
    "CORRELATION_ID", "REPLY_TO_CLIENT", "TTL", "ARRIVE_TIME", "PUSH_REPLY_TIME", "CLUSTER", "MSG_TYPE",
    "INNER_MULTI_QUEUE_OFFSET", "TIMER_DELAY_MS", "TIMER_DELAY_SEC", "TIMER_DELIVER_MS", "TIMER_ENQUEUE_MS",
    "TIMER_DEQUEUE_MS", "TIMER_ROLL_TIMES", "TIMER_OUT_MS", "TIMER_DEL_UNIQKEY", "TIMER_DELAY_LEVEL", "__BORNHOST",
    "BORN_TIMESTAMP", "DLQ_ORIGIN_TOPIC", "DLQ_ORIGIN_MESSAGE_ID", "__CRC32#",
)) | frozenset(v for k, v in vars(PropertyName).items() if k.isupper() and isinstance(v, str))
# the proxy's send limits (ProxyConfig): user properties, their bytes with the tag and keys, a message group's bytes
USER_PROPERTY_MAX_NUM = 128
MAX_USER_PROPERTY_SIZE = 16 << 10
MAX_MESSAGE_GROUP_SIZE = 64
DEFAULT_INVISIBLE_MS = 30_000
MAX_LONG_POLL_S = 30.0
MIN_WAIT_S = 0.01  # the shortest a long poll waits before it looks again
ACCEPTED_TYPES = (pb.MessageType.NORMAL, pb.MessageType.FIFO, pb.MessageType.DELAY, pb.MessageType.TRANSACTION)
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})
# (readable, writable) -> what a route says of a queue (the proxy's RouteActivity.convertToPermission)
_PERMISSIONS = {(True, True): pb.Permission.READ_WRITE, (True, False): pb.Permission.READ,
                (False, True): pb.Permission.WRITE, (False, False): pb.Permission.NONE}
# TopicValidator.GROUP_MAX_LENGTH: "%RETRY%"/"%DLQ%" + a group must still be a legal topic name
GROUP_MAX_LENGTH = 120
SYSTEM_GROUP_PREFIX = "CID_RMQ_SYS_"  # MixAll.CID_RMQ_SYS_PREFIX: the broker's own consumer groups
CONSUMER_TYPES = (pb.ClientType.PUSH_CONSUMER, pb.ClientType.SIMPLE_CONSUMER, pb.ClientType.PULL_CONSUMER)
# The proxy answers ILLEGAL_TOPIC to any call that names a system topic (encoder.SYSTEM_TOPICS): a client's message
# there would be taken for the broker's own (a delay, a half message, a timer), and a route would auto-create it
# with a client's queue count. The store refuses sends to the ones only it writes (NOT_SENDABLE_TOPICS).
# topics the server writes for a group: readable (a group's dead letters), not sendable
GROUP_TOPIC_PREFIXES = (RETRY_GROUP_TOPIC_PREFIX, DLQ_GROUP_TOPIC_PREFIX)


class Status(Exception):
    """A request refused with a RocketMQ status code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def status(code: int = pb.Code.OK, message: str = "OK"):
    return pb.Status(code=code, message=message)


# the proxy's mapping of broker results, most specific first (subclasses before their bases)
_CODES: tuple[tuple[type | tuple[type, ...], int], ...] = (
    (MessageTooLargeError, pb.Code.MESSAGE_BODY_TOO_LARGE),
    (PropertiesTooLargeError, pb.Code.MESSAGE_PROPERTIES_TOO_LARGE),
    (InvalidTopicError, pb.Code.ILLEGAL_TOPIC),
    (TopicNotExistError, pb.Code.TOPIC_NOT_FOUND),
    (IllegalDeliveryTimeError, pb.Code.ILLEGAL_DELIVERY_TIME),
    (UnknownTransactionError, pb.Code.INVALID_TRANSACTION_ID),
    (InvalidPropertyError, pb.Code.ILLEGAL_MESSAGE_PROPERTY_KEY),
    (InvalidReceiptHandleError, pb.Code.INVALID_RECEIPT_HANDLE),
    (InvalidFilterError, pb.Code.ILLEGAL_FILTER_EXPRESSION),
    (DeadLetterError, pb.Code.INTERNAL_SERVER_ERROR),
    ((MessageIllegalError, InvalidQueueError), pb.Code.BAD_REQUEST),
    (UnsupportedLayoutError, pb.Code.BAD_REQUEST),  # a broker's LMQ topic: the request's, not a server failure
)


def status_of(exc: BaseException) -> Status:
    """The RocketMQ status for a store error."""
    if isinstance(exc, Status):
        return exc
    text = str(exc)
    for kind, code in _CODES:
        if isinstance(exc, kind):
            return Status(code, text)
    if isinstance(exc, StoreFailedError | StoreIOError):
        return Status(pb.Code.INTERNAL_SERVER_ERROR, f"the store cannot write: {text}")
    return Status(pb.Code.INTERNAL_SERVER_ERROR, f"{type(exc).__name__}: {text}")


def topic_name(topic: str, *, send: bool = False) -> str:
    """``topic`` checked as the proxy's ``GrpcValidator.validateTopic`` (the name's rules, not a system topic) and,
    for a send, not a retry or dead-letter topic either; else ILLEGAL_TOPIC."""
    try:
        validate_topic(topic)
    except InvalidTopicError as exc:
        raise Status(pb.Code.ILLEGAL_TOPIC, str(exc)) from None
    if is_system_topic(topic):
        raise Status(pb.Code.ILLEGAL_TOPIC, f"topic {topic} is a system topic")
    if send and topic.startswith(GROUP_TOPIC_PREFIXES):
        raise Status(pb.Code.ILLEGAL_TOPIC, f"topic {topic} is written by the server for its consumer group; "
                                            f"clients cannot send to it")
    return topic


def consumer_group(resource) -> str:
    """The consumer group a request names, checked as the proxy's ``GrpcValidator.validateConsumerGroup``: not
    blank, at most 120 of the topic characters, not a system group; else ILLEGAL_CONSUMER_GROUP. Every call that
    takes a group checks it first, so a group no RocketMQ accepts never reaches offsets, pop state or a DLQ."""
    name = resource.name
    if not name.strip():
        raise Status(pb.Code.ILLEGAL_CONSUMER_GROUP, "the consumer group is blank")
    if len(name) > GROUP_MAX_LENGTH:
        raise Status(pb.Code.ILLEGAL_CONSUMER_GROUP, f"consumer group {name[:64]!r}... is {len(name)} characters "
                                                     f"long; the limit is {GROUP_MAX_LENGTH}")
    if not _TOPIC_CHARS.fullmatch(name):
        raise Status(pb.Code.ILLEGAL_CONSUMER_GROUP, f"consumer group {name!r} may contain only letters, digits and "
                                                     f"the characters %|_-")
    if name.startswith(SYSTEM_GROUP_PREFIX):
        raise Status(pb.Code.ILLEGAL_CONSUMER_GROUP, f"consumer group {name!r} is a system group "
                                                     f"({SYSTEM_GROUP_PREFIX}*)")
    return name


MAX_INVISIBLE_MS = 12 * 3600 * 1000  # RocketMQ's proxy: maxInvisibleTimeMills
# a filter compiles on the event loop (then cached): 800 KB of one held every call for 4 s; 16 KiB takes ~50 ms
MAX_SQL92_LENGTH = 16 << 10


def check_invisible(invisible_ms: int) -> None:
    """ILLEGAL_INVISIBLE_TIME outside (0, 12 h], as RocketMQ's proxy (``GrpcValidator.validateInvisibleTime``): a
    message hidden for 2^40 s was freed by nothing but a restart, and held its queue's committed offset meanwhile.
    (The proxy's 10 s minimum for receives is not applied: tests and CI want redeliveries sooner.)"""
    if invisible_ms <= 0:
        raise Status(pb.Code.ILLEGAL_INVISIBLE_TIME, "invisible duration must be positive")
    if invisible_ms > MAX_INVISIBLE_MS:
        raise Status(pb.Code.ILLEGAL_INVISIBLE_TIME, f"invisible duration {invisible_ms} ms is over the maximum, "
                                                     f"{MAX_INVISIBLE_MS} ms (12 hours)")


def subscription(expression) -> tuple[str | None, SqlFilter | None]:
    """(tags, SQL92 filter) of a request's ``FilterExpression``: a TAG expression (empty or exactly ``*``: every
    message; else tags between ``||``, as ``parse_tags`` reads them) or a compiled SQL92 one; an expression that
    does not compile, or tags RocketMQ's ``FilterAPI`` refuses (only ``||``), is ILLEGAL_FILTER_EXPRESSION."""
    if expression.type == pb.FilterType.SQL:
        if len(expression.expression) > MAX_SQL92_LENGTH:
            raise Status(pb.Code.ILLEGAL_FILTER_EXPRESSION, f"the SQL92 filter is {len(expression.expression):,} "
                         f"characters; this server compiles at most {MAX_SQL92_LENGTH:,}")
        try:
            return None, compile_sql92(expression.expression)
        except InvalidFilterError as exc:
            raise Status(pb.Code.ILLEGAL_FILTER_EXPRESSION, f"SQL92 filter {expression.expression!r}: {exc}") from None
    try:
        parse_tags(expression.expression)
    except InvalidFilterError as exc:
        raise Status(pb.Code.ILLEGAL_FILTER_EXPRESSION, str(exc)) from None
    return expression.expression or None, None


def _ms(stamp) -> int:
    return stamp.seconds * 1000 + stamp.nanos // 1_000_000


def _stamp(ms: int):
    return pb.Timestamp(seconds=ms // 1000, nanos=(ms % 1000) * 1_000_000)


class Metrics:
    """Counters the serve command prints (sends/s, receives/s, in flight)."""

    def __init__(self) -> None:
        self.sent = 0
        self.received = 0
        self.acked = 0
        self.checks = 0
        self.refused = 0
        self._lock = threading.Lock()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + n)


@dataclasses.dataclass
class TelemetryClient:
    """One client's telemetry stream: what it publishes, and what the server has to tell it (``send``, from any
    thread: the stream's handler runs on the server's event loop and writes what it finds in ``outbox``)."""

    client_id: str
    loop: asyncio.AbstractEventLoop
    topics: set[str] = dataclasses.field(default_factory=set)
    outbox: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)

    def send(self, command) -> None:
        """Queue ``command`` for the client; None ends the stream."""
        call_soon(self.loop, self.outbox.put_nowait, command)


class MessagingService:
    """The RPC handlers; ``handler()`` makes the grpc generic handler that routes to them."""

    def __init__(self, store: MessageStore, *, auto_create_topics: bool = True, max_attempts: int = 16,
                 transaction_check_ms: int = 6_000, accounts: Accounts | None = None,
                 renew_policy: RenewPolicy | None = None) -> None:
        self.store = store
        self.accounts = accounts
        self.auto_create_topics = auto_create_topics
        self.pop = PopGroups(store, max_attempts=max_attempts, is_fifo=store.subscription_groups.is_orderly,
                             state_path=store.root / "config" / "popState.json")
        # under SYNC_FLUSH an ack answered OK is saved first (nothing acknowledged comes back after a crash)
        self._save_acks = store.config.flush_disk_type is FlushDiskType.SYNC_FLUSH
        self.transactions = TransactionLog(store, check_after_ms=transaction_check_ms)
        self.metrics = Metrics()
        self._round_robin: dict[str, int] = {}
        self._listen = ("127.0.0.1", 8081)  # what Server binds, set by listening_on
        self._create_lock = threading.Lock()
        self._rotation: dict[tuple[str, str], int] = {}  # (group, topic) -> receives so far
        self._rotation_lock = threading.Lock()
        self.long_polls = LongPolls(store, next_due=functools.partial(self.pop.next_due, wait=False))
        self._closing = threading.Event()
        self._clients: dict[str, TelemetryClient] = {}  # client id -> its open telemetry stream
        self._clients_lock = threading.Lock()
        self._checker = threading.Thread(target=self._check_transactions, args=(max(transaction_check_ms, 100),),
                                         name="rocketstore-transaction-check", daemon=True)
        self._saver = threading.Thread(target=self._save_pop_state_periodically, name="rocketstore-pop-state",
                                       daemon=True)
        self.renew_policy = renew_policy or RenewPolicy()
        self.clients = Clients(self.renew_policy.client_expiry_ms)  # who was heard from lately
        self._renewer = threading.Thread(target=self._renew_periodically, name="rocketstore-renew", daemon=True)

    def start(self) -> None:
        self._checker.start()
        self._saver.start()
        self._renew_once()  # before any receive: a held message whose deadline passed while serve was down
        self._renewer.start()
        self.long_polls.start()

    def _save_pop_state_periodically(self) -> None:
        """Save what consumers hold and acknowledged (``PopGroups.save``) while it changes, as RocketMQ flushes
        consumer offsets: every ``flush_consumer_offset_interval``."""
        interval = max(self.store.config.flush_consumer_offset_interval, 100) / 1000
        while not self._closing.wait(interval):
            self.save_pop_state()

    def _online(self, client_id: str) -> bool:
        """Whether the client is still there (the proxy's ``clientIsOffline``, negated): its telemetry stream is open,
        or it was heard from within the last two minutes (a heartbeat, a receive); not once it said it terminates.
        A stream alone is not enough: the Python client rebuilds a broken one only every 5 minutes, heartbeating
        and receiving meanwhile."""
        with self._clients_lock:
            if client_id in self._clients:
                return True
        return self.clients.online(client_id)

    def _renew_periodically(self) -> None:
        """``PopGroups.renew`` every ``period_s``: push consumers' messages kept invisible (``renewal.py``)."""
        while not self._closing.wait(self.renew_policy.period_s):
            self._renew_once()

    def _renew_once(self) -> None:
        try:
            sooner = self.pop.renew(self.renew_policy, self._online)
        except Exception:
            log.exception("renewing the push consumers' messages failed (tried again in %.0f s)",
                          self.renew_policy.period_s)
            return
        for topic, group, due_ms in sooner:  # receives waiting take them once visible
            self.long_polls.due(topic, group, due_ms)

    def save_pop_state(self) -> None:
        """``PopGroups.save``, a failure logged (the periodic saver tries again; a stop's last save is the last)."""
        try:
            self.pop.save()
        except RocketStoreError as exc:
            log.error("saving the consumers' state failed (tried again later): %s", exc)

    # --- plumbing --------------------------------------------------------------------------------------

    def handler(self) -> grpc.GenericRpcHandler:
        handlers = {}
        for name, request, response, client_streaming, server_streaming in service_methods():
            method = getattr(self, name, None)
            if method is None:
                method = self._unsupported(name, response, server_streaming)
            if self.accounts is not None:
                method = self._signed_only(method, name, response, server_streaming)
            make = {(False, False): grpc.unary_unary_rpc_method_handler,
                    (False, True): grpc.unary_stream_rpc_method_handler,
                    (True, True): grpc.stream_stream_rpc_method_handler,
                    (True, False): grpc.stream_unary_rpc_method_handler}[(client_streaming, server_streaming)]
            handlers[name] = make(method, request_deserializer=request.FromString,
                                  response_serializer=response.SerializeToString)
        return grpc.method_handlers_generic_handler(SERVICE, handlers)

    @staticmethod
    def _unsupported(name: str, response: type, server_streaming: bool):
        def refuse(request, context):
            reply = response(status=status(pb.Code.NOT_IMPLEMENTED, f"{name} is not supported by rocketstore serve"))
            return iter([reply]) if server_streaming else reply
        return refuse

    def _signed_only(self, method, name: str, response: type, server_streaming: bool):
        """``method`` for signed calls only (an async method stays async: it runs on the event loop)."""
        accounts = self.accounts
        assert accounts is not None

        def refusal_of(context):
            refusal = accounts.refusal(context.invocation_metadata())
            if refusal is None:
                return None
            self.metrics.add("refused")
            log.warning("%s from %s refused: %s", name, context.peer(), refusal)
            return response(status=status(pb.Code.UNAUTHORIZED, refusal))

        if inspect.isasyncgenfunction(method):
            async def guarded_stream(request, context):
                reply = refusal_of(context)
                if reply is not None:
                    yield reply
                    return
                async for item in method(request, context):
                    yield item
            return guarded_stream

        def guarded(request, context):
            reply = refusal_of(context)
            if reply is None:
                return method(request, context)
            return iter([reply]) if server_streaming else reply
        return guarded

    def close(self) -> None:
        """Answer every long poll and end every telemetry stream now; stop the service's threads."""
        self._closing.set()
        self.long_polls.close()
        with self._clients_lock:
            for client in self._clients.values():
                client.send(None)
        if self._checker.is_alive():
            self._checker.join()
        if self._saver.is_alive():
            self._saver.join()
        if self._renewer.is_alive():
            self._renewer.join()
        self.save_pop_state()  # a clean stop keeps what is held and acknowledged

    # --- routes -----------------------------------------------------------------------------------------

    def _topic_config(self, topic: str, create: bool) -> TopicConfig:
        """A topic's config (queue counts, perm), the topic created on first use (a route query) when auto-creation
        is on."""
        topic_name(topic)
        config = self.store.topic_config.get(topic)
        if config is None:
            if not (create and self.auto_create_topics):
                raise Status(pb.Code.TOPIC_NOT_FOUND, f"topic {topic} does not exist")
            with self._create_lock:
                if self.store.topic_config.get(topic) is None:
                    self.store.create_topic(topic, self.store.config.default_topic_queue_nums)
            config = self.store.topic_config.get(topic)
            assert config is not None
        return config

    def _readable(self, topic: str) -> int:
        """The read queue count of a topic a consumer names; one whose perm forbids reading is FORBIDDEN."""
        config = self._topic_config(topic, create=False)
        if not config.perm & PERM_READ:
            raise Status(pb.Code.FORBIDDEN, f"topic {topic} is not readable (perm {config.perm})")
        return config.read_queue_nums

    def QueryRoute(self, request, context):
        try:
            config = self._topic_config(request.topic.name, create=True)
        except Status as exc:
            return pb.QueryRouteResponse(status=status(exc.code, str(exc)))
        broker = pb.Broker(name=BROKER_NAME, id=0, endpoints=self._endpoints(request.endpoints, context))
        types = list(ACCEPTED_TYPES)
        read, write = config.read_queue_nums, config.write_queue_nums
        readable, writable = bool(config.perm & PERM_READ), bool(config.perm & PERM_WRITE)
        queues = []
        for queue_id in range(max(read, write)):  # each queue as the topic's perm and queue counts allow
            permission = _PERMISSIONS[(readable and queue_id < read, writable and queue_id < write)]
            queues.append(pb.MessageQueue(topic=request.topic, id=queue_id, permission=permission, broker=broker,
                                          accept_message_types=types))
        return pb.QueryRouteResponse(status=status(), message_queues=queues)

    def listening_on(self, host: str, port: int) -> None:
        """The address the server bound (``Server`` tells it once the port is known): what routes advertise."""
        self._listen = (host.strip("[]"), port)

    def _endpoints(self, requested, context):
        """Where routes (QueryRoute, QueryAssignment) say this server is: the address it listens on; when that is a
        wildcard (0.0.0.0, ::), the address the client connected to: the endpoints its request names (the clients
        send the ones they were configured with), else this host's address on the way to the client."""
        host, port = self._listen
        if host not in WILDCARD_HOSTS:
            return _endpoints_of(host, port)
        if requested.addresses:
            return requested
        return _endpoints_of(_local_address_towards(context.peer()), port)

    def Heartbeat(self, request, context):
        if request.HasField("group") or request.client_type in CONSUMER_TYPES:  # producers name no group
            try:
                consumer_group(request.group)
            except Status as exc:
                return pb.HeartbeatResponse(status=status(exc.code, str(exc)))
        self.clients.touch(_client_id(context))
        return pb.HeartbeatResponse(status=status())

    def NotifyClientTermination(self, request, context):
        if request.HasField("group"):  # absent for a producer
            try:
                consumer_group(request.group)
            except Status as exc:
                return pb.NotifyClientTerminationResponse(status=status(exc.code, str(exc)))
        client_id = _client_id(context)
        self.clients.terminated(client_id)
        for topic, group, due_ms in self.pop.give_back(client_id, self.renew_policy.clear_ms):  # now, as the proxy
            self.long_polls.due(topic, group, due_ms)
        log.info("client %s terminated", client_id)
        return pb.NotifyClientTerminationResponse(status=status())

    async def Telemetry(self, requests, context) -> AsyncIterator:
        """The settings handshake (each Settings a client sends is answered with the server's view of it), and
        the server's own commands to the client (orphaned-transaction checks) on the same stream. An open stream
        is a task on the event loop, not a thread."""
        client_id = _client_id(context)
        client = TelemetryClient(client_id, asyncio.get_running_loop())
        log.info("client %s connected (%s)", client_id, context.peer())

        async def read() -> None:
            try:
                async for command in requests:
                    self.clients.touch(client_id)
                    if command.HasField("settings"):
                        if command.settings.HasField("subscription"):
                            try:
                                consumer_group(command.settings.subscription.group)
                            except Status as exc:  # answered, then the stream ends (the proxy ends it too)
                                client.outbox.put_nowait(pb.TelemetryCommand(status=status(exc.code, str(exc))))
                                return
                        if command.settings.HasField("publishing"):
                            try:
                                for topic in command.settings.publishing.topics:
                                    topic_name(topic.name)
                            except Status as exc:
                                client.outbox.put_nowait(pb.TelemetryCommand(status=status(exc.code, str(exc))))
                                return
                            client.topics = {t.name for t in command.settings.publishing.topics}
                        client.outbox.put_nowait(pb.TelemetryCommand(status=status(),
                                                                     settings=self._settings(command.settings)))
            except Exception as exc:  # the client went away mid-read
                log.debug("telemetry stream of %s ended: %s", client_id, exc)
            finally:
                client.outbox.put_nowait(None)

        with self._clients_lock:
            self._clients[client_id] = client
        reader = asyncio.get_running_loop().create_task(read())
        try:
            while not self._closing.is_set():
                item = await client.outbox.get()
                if item is None:
                    return
                yield item
        finally:
            reader.cancel()
            with self._clients_lock:
                if self._clients.get(client_id) is client:
                    del self._clients[client_id]
            log.info("client %s disconnected", client_id)

    def _check_transactions(self, interval_ms: int) -> None:
        """Ask a producer of the topic about every transaction left open longer than the check delay."""
        while not self._closing.wait(min(interval_ms, 1_000) / 1000):
            try:
                due = self.transactions.due_for_check()
            except RocketStoreError as exc:
                log.error("transaction check failed: %s", exc)
                continue
            for msg, transaction_id in due:
                with self._clients_lock:
                    producers = [c for c in self._clients.values() if msg.topic in c.topics]
                if not producers:
                    log.info("transaction %s of topic %s is open and no producer of the topic is connected",
                             transaction_id, msg.topic)
                    continue
                producer = producers[self.metrics.checks % len(producers)]
                command = pb.RecoverOrphanedTransactionCommand(message=self._to_proto(msg, None, 1, 0),
                                                               transaction_id=transaction_id)
                producer.send(pb.TelemetryCommand(recover_orphaned_transaction_command=command))
                self.metrics.add("checks")
                log.info("asked %s about open transaction %s", producer.client_id, transaction_id)

    def _settings(self, client):
        settings = pb.Settings()
        settings.CopyFrom(client)
        if client.HasField("subscription"):
            # a consumer's client retries as the server does (RocketMQ's proxy: the group's retry times + 1); it said
            # 3 whatever --max-attempts was, and a Java FIFO push consumer then dead-lettered after 3. The delays
            # are the group's retry policy (the proxy's mergeSubscriptionData: CustomizedRetryPolicy, 1 s to 2 h):
            # the producers' 10 ms-1 s backoff sent a message a push consumer failed for 18 s to the DLQ
            settings.ClearField("backoff_policy")  # replaced, not merged with the client's (mergeSubscriptionData)
            settings.backoff_policy.max_attempts = self.pop.max_attempts
            for delay_ms in RETRY_MS:
                settings.backoff_policy.customized_backoff.next.add().FromMilliseconds(delay_ms)
        else:  # the proxy's grpcClientProducer* settings
            settings.ClearField("backoff_policy")
            settings.backoff_policy.max_attempts = 3
            settings.backoff_policy.exponential_backoff.initial.FromMilliseconds(10)
            settings.backoff_policy.exponential_backoff.max.FromMilliseconds(1000)
            settings.backoff_policy.exponential_backoff.multiplier = 2.0
        if client.HasField("publishing"):
            settings.publishing.max_body_size = self.store.config.max_message_size
            settings.publishing.validate_message_type = True
        if client.HasField("subscription"):
            settings.subscription.fifo = self.store.subscription_groups.is_orderly(client.subscription.group.name)
            settings.subscription.receive_batch_size = 32
            if not client.subscription.HasField("long_polling_timeout"):
                settings.subscription.long_polling_timeout.FromSeconds(20)
        return settings

    # --- send -------------------------------------------------------------------------------------------

    def SendMessage(self, request, context):
        if not request.messages:
            return pb.SendMessageResponse(status=status(pb.Code.BAD_REQUEST, "no messages"))
        transactional = [m.system_properties.message_type == pb.MessageType.TRANSACTION for m in request.messages]
        transaction_ids = [""] * len(request.messages)
        try:
            first = request.messages[0].topic
            if any(m.topic != first for m in request.messages):  # the proxy's buildMessage: one batch, one topic
                raise Status(pb.Code.MESSAGE_CORRUPTED, "the messages of one send name different topics")
            messages = [self._to_store(m) for m in request.messages]
            if len(messages) > 1:
                self._check_batch_size(messages)
            if any(transactional):
                if len(messages) > 1:
                    raise Status(pb.Code.BAD_REQUEST, "a transactional message is sent on its own")
                result, transaction_ids[0] = self.transactions.prepare(messages[0])
                if result.ok:  # the half message was stored: its topic must exist by the commit
                    self._create_missing(messages)
                results = [result]
            else:
                self._create_missing(messages)
                results = self.store.put_messages(messages)
        except (RocketStoreError, Status) as exc:
            failure = status_of(exc)
            log.debug("send refused: %s", failure)
            return pb.SendMessageResponse(status=status(failure.code, str(failure)))
        entries = []
        code = pb.Code.OK
        for msg, result, transaction_id in zip(request.messages, results, transaction_ids, strict=True):
            entry_code = pb.Code.OK if result.status is PutMessageStatus.PUT_OK else pb.Code.MASTER_PERSISTENCE_TIMEOUT
            code = code if entry_code == pb.Code.OK else entry_code
            entries.append(pb.SendResultEntry(status=status(entry_code, result.status.name),
                                              message_id=msg.system_properties.message_id or result.uniq_key or "",
                                              offset=result.queue_offset, transaction_id=transaction_id))
        self.metrics.add("sent", len(results))
        return pb.SendMessageResponse(status=status(code, "OK" if code == pb.Code.OK else "flush timed out"),
                                      entries=entries)

    def _check_batch_size(self, messages: list[Message]) -> None:
        """A batch is one body to the broker (``MessageBatch``: each message as size, magic, CRC, flag, body and
        properties): more than ``max_message_size`` of it is refused (``MessageExtEncoder``), however small each
        message is."""
        limit = self.store.config.max_message_size
        total = 0
        for m in messages:
            props = sum(len(k.encode()) + len(v.encode()) + 2 for k, v in (m.properties or {}).items())
            props += len(m.tags.encode()) + 6 if m.tags else 0
            props += len(" ".join(m.keys).encode()) + 6 if m.keys else 0
            total += 22 + len(m.body) + props
        if total > limit:
            raise Status(pb.Code.MESSAGE_BODY_TOO_LARGE, f"the batch is {total:,} bytes as the broker encodes it; at "
                                                         f"most {limit:,} (max_message_size)")

    def _send_queues(self, topic: str) -> int:
        """The write queue count of a topic a send names. One that does not exist yet (auto-creation on) counts the
        queues it will have: it is created only once its messages passed every check (``_create_missing``)."""
        topic_name(topic, send=True)
        config = self.store.topic_config.get(topic)
        if config is not None:
            if not config.perm & PERM_WRITE:
                raise Status(pb.Code.FORBIDDEN, f"topic {topic} is not writable (perm {config.perm})")
            return config.write_queue_nums
        if not self.auto_create_topics:
            raise Status(pb.Code.TOPIC_NOT_FOUND, f"topic {topic} does not exist")
        return self.store.config.default_topic_queue_nums

    def _create_missing(self, messages: list[Message]) -> None:
        """Create the topics of a send that do not exist yet, after the store's encoder accepted every message: a
        refused send writes nothing, no topic either. (Rare: a producer's route query creates its topics first.)"""
        missing = {m.topic for m in messages if self.store.topic_config.get(m.topic) is None}
        if not missing:
            return
        self.store.encoder.encode_many(messages)  # the put's own checks; raises what the put would
        with self._create_lock:
            for topic in sorted(missing):
                if self.store.topic_config.get(topic) is None:
                    self.store.create_topic(topic, self.store.config.default_topic_queue_nums)

    def _to_store(self, m) -> Message:
        topic = m.topic.name
        write = self._send_queues(topic)
        props = m.system_properties
        if not m.body:
            raise Status(pb.Code.MESSAGE_BODY_EMPTY, "message body is empty")
        _check_user_properties(m.user_properties, props.tag, props.keys)
        if not props.message_id.strip():
            raise Status(pb.Code.ILLEGAL_MESSAGE_ID, "message id cannot be empty")
        user = dict(m.user_properties)
        user[PropertyName.UNIQ_KEY] = props.message_id
        if props.HasField("message_group"):
            group = props.message_group
            if not group.strip():
                raise Status(pb.Code.ILLEGAL_MESSAGE_GROUP, "message group is empty or blank")
            if len(group.encode()) >= MAX_MESSAGE_GROUP_SIZE:
                raise Status(pb.Code.ILLEGAL_MESSAGE_GROUP, f"message group is {len(group.encode())} bytes; it must "
                                                            f"be under {MAX_MESSAGE_GROUP_SIZE}")
            if _has_control(group):
                raise Status(pb.Code.ILLEGAL_MESSAGE_GROUP, "message group cannot contain control characters")
            user[PropertyName.SHARDING_KEY] = props.message_group
            queue_id = _java_hash(props.message_group) % write  # one queue per group: order kept
        else:
            queue_id = self._next_queue(topic, write)
        if props.HasField("delivery_timestamp"):
            if props.HasField("message_group") or props.message_type == pb.MessageType.TRANSACTION:
                raise Status(pb.Code.BAD_REQUEST, "a delayed message cannot be FIFO or transactional")
            user[PropertyName.TIMER_DELIVER_MS] = str(_ms(props.delivery_timestamp))
        elif props.message_type == pb.MessageType.DELAY:
            raise Status(pb.Code.ILLEGAL_DELIVERY_TIME, "a DELAY message needs a delivery timestamp")
        # as the proxy's GrpcValidator.validateTag and validateMessageKey: blank, '|' (a tag) or a control character
        if props.tag and ("|" in props.tag or not props.tag.strip() or _has_control(props.tag)):
            raise Status(pb.Code.ILLEGAL_MESSAGE_TAG, f"tag {props.tag!r} may not be blank or contain '|' or control "
                                                      f"characters")
        for key in props.keys:
            if key and (not key.strip() or _has_control(key)):
                raise Status(pb.Code.ILLEGAL_MESSAGE_KEY, f"key {key!r} may not be blank or contain control "
                                                          f"characters")
        # KEYS is the keys joined by spaces, so "order 42" is stored, indexed and delivered as two keys, as RocketMQ's
        keys = [part for key in props.keys for part in key.split(" ") if part]
        born = _ms(props.born_timestamp) if props.HasField("born_timestamp") else None
        born_host = props.born_host or None
        body = bytes(m.body)
        if props.body_encoding == pb.Encoding.GZIP:
            body = self._gunzip(body)
        try:
            return Message(topic, body, tags=props.tag or None, keys=keys, properties=user,
                           queue_id=queue_id, born_timestamp=born, born_host=_host(born_host))
        except ValueError as exc:
            raise Status(pb.Code.BAD_REQUEST, str(exc)) from None

    def _gunzip(self, body: bytes) -> bytes:
        """A body the client sent gzip-compressed (``body_encoding`` GZIP), inflated: it is stored and delivered
        plain. It was stored compressed with no COMPRESSED flag and handed out as IDENTITY: consumers got gzip."""
        limit = self.store.config.max_message_size
        inflater = zlib.decompressobj(wbits=31)
        try:
            plain = inflater.decompress(body, limit + 1)
        except zlib.error as exc:
            raise Status(pb.Code.MESSAGE_CORRUPTED, f"the body is not gzip data: {exc}") from None
        if len(plain) > limit or inflater.unconsumed_tail:
            raise Status(pb.Code.MESSAGE_BODY_TOO_LARGE, f"the body is more than {limit} bytes uncompressed")
        if not inflater.eof:
            raise Status(pb.Code.MESSAGE_CORRUPTED, "the gzip body is cut short")
        return plain

    def _next_start(self, group: str, topic: str) -> int:
        """The queue a receive of the whole topic starts from, one further each call: a batch fills from its first
        queues, so a fixed start let one busy queue take every batch and starve the others."""
        key = (group, topic)
        with self._rotation_lock:
            n = self._rotation.get(key, 0)
            self._rotation[key] = n + 1
        return n

    def _next_queue(self, topic: str, queues: int) -> int:
        n = self._round_robin.get(topic, 0)
        self._round_robin[topic] = n + 1
        return n % queues

    def EndTransaction(self, request, context):
        resolution = request.resolution
        try:
            if resolution not in (pb.TransactionResolution.COMMIT, pb.TransactionResolution.ROLLBACK):
                raise Status(pb.Code.BAD_REQUEST, "resolution must be COMMIT or ROLLBACK")
            committed = self.transactions.end(request.transaction_id, request.message_id, request.topic.name,
                                              resolution == pb.TransactionResolution.COMMIT)
        except (RocketStoreError, Status) as exc:
            failure = status_of(exc)
            log.debug("end transaction refused: %s", failure)
            return pb.EndTransactionResponse(status=status(failure.code, str(failure)))
        if committed is not None and not committed.ok:
            return pb.EndTransactionResponse(status=status(pb.Code.MASTER_PERSISTENCE_TIMEOUT, committed.status.name))
        return pb.EndTransactionResponse(status=status())

    # --- consume ----------------------------------------------------------------------------------------

    def QueryAssignment(self, request, context):
        try:
            consumer_group(request.group)
            config = self._topic_config(request.topic.name, create=False)
            if not (config.perm & PERM_READ and config.read_queue_nums):
                raise Status(pb.Code.FORBIDDEN, "no readable queue")  # the proxy's answer
        except Status as exc:
            return pb.QueryAssignmentResponse(status=status(exc.code, str(exc)))
        broker = pb.Broker(name=BROKER_NAME, id=0, endpoints=self._endpoints(request.endpoints, context))
        # One assignment for the whole topic: receives pop from every queue (the proxy's pop mode does the same).
        permission = _PERMISSIONS[(True, bool(config.perm & PERM_WRITE))]
        queue = pb.MessageQueue(topic=request.topic, id=-1, permission=permission, broker=broker,
                                accept_message_types=ACCEPTED_TYPES)
        return pb.QueryAssignmentResponse(status=status(), assignments=[pb.Assignment(message_queue=queue)])

    async def ReceiveMessage(self, request, context) -> AsyncIterator:
        """Pop up to a batch of the group's messages; with none, wait up to the long-polling timeout for some. A
        waiting receive is a future on the event loop (``LongPolls``), so a thousand idle consumers hold no thread;
        the store is read in the worker threads."""
        group, topic = request.group.name, request.message_queue.topic.name
        try:
            consumer_group(request.group)
            read = self._readable(topic)
            tags, sql = subscription(request.filter_expression)
            if request.auto_renew:  # a push consumer: the server renews (the proxy's enableProxyAutoRenew)
                invisible_ms = self.renew_policy.invisible_ms
            else:
                invisible_ms = _duration_ms(request.invisible_duration) if request.HasField("invisible_duration") \
                    else DEFAULT_INVISIBLE_MS
                check_invisible(invisible_ms)
            batch = max(1, min(request.batch_size or MAX_BATCH, MAX_BATCH))
        except Status as exc:
            yield pb.ReceiveMessageResponse(status=status(exc.code, str(exc)))
            return
        poll_s = min(_duration_ms(request.long_polling_timeout) / 1000 if request.HasField("long_polling_timeout")
                     else 20.0, MAX_LONG_POLL_S)
        remaining = context.time_remaining()
        if remaining is not None:
            poll_s = min(poll_s, max(0.0, remaining - 1.0))  # answer before the client's deadline
        deadline = time.monotonic() + poll_s
        start = request.message_queue.id if request.message_queue.id >= 0 else self._next_start(group, topic)
        queue_ids = [(start + i) % read for i in range(read)] if read else []
        client_id = _client_id(context)
        self.clients.touch(client_id)
        look = functools.partial(self._look, group, topic, queue_ids, batch, invisible_ms, tags, sql,
                                 client_id if request.auto_renew else None)
        loop = asyncio.get_running_loop()
        ticket = None
        failure = None
        try:  # however the call ends (a client cancelling it mid-read too), its ticket leaves the line
            while True:
                ticket = self.long_polls.watch(topic, group)  # before the look: what arrives after it wakes us
                job = loop.run_in_executor(None, look)
                try:  # shielded: a receive cancelled now gets what the read took back, and hands it back
                    deliveries, due_ms = await asyncio.shield(job)
                except asyncio.CancelledError:
                    job.add_done_callback(functools.partial(self._hand_back_taken, group, topic))
                    raise
                except RocketStoreError as exc:
                    failure = status_of(exc)
                    break
                now = time.monotonic()
                if deliveries or now >= deadline or self._closing.is_set() or context.cancelled():
                    break
                until_due = (due_ms - time.time_ns() // 1_000_000) / 1000 if due_ms is not None else poll_s
                # never 0: a due message this receive could not take (none known, but cheap to rule out) must not
                # spin
                await self.long_polls.wait(ticket, min(deadline - now, max(until_due, MIN_WAIT_S)))
        finally:
            if ticket is not None:
                self.long_polls.leave(ticket)
        if failure is not None:
            yield pb.ReceiveMessageResponse(status=status(failure.code, str(failure)))
            return
        if not deliveries:
            yield pb.ReceiveMessageResponse(status=status(pb.Code.MESSAGE_NOT_FOUND, "no new message"))
            return
        if context.cancelled():  # while it looked (a cancellation asyncio.wait_for swallowed): nobody to write to
            self._hand_back_soon(group, topic, deliveries)
            return
        written = 0
        try:  # a call cancelled (or failing) mid-reply hands back what it had not written
            yield pb.ReceiveMessageResponse(status=status())
            # the transport's delivery time: push consumers compute their receive latency from it (and fail
            # without it)
            yield pb.ReceiveMessageResponse(delivery_timestamp=_stamp(time.time_ns() // 1_000_000))
            for d in deliveries:
                yield pb.ReceiveMessageResponse(message=self._to_proto(d.message, d.receipt_handle, d.attempt,
                                                                       d.invisible_ms))
                written += 1  # grpc took it and asked for the next
        finally:
            if written < len(deliveries):
                self._hand_back_soon(group, topic, deliveries[written:])
        self.metrics.add("received", len(deliveries))

    def _look(self, group: str, topic: str, queue_ids: list[int], batch: int, invisible_ms: int, tags: str | None,
              sql: SqlFilter | None, renew_for: str | None = None) -> tuple[list, int | None]:
        """A receive's look at the queues, in a worker thread: (the deliveries, and when none, the epoch ms at which
        the first message of these queues now in flight becomes visible again: a waiting receive wakes then to take
        it). Pop's locks are taken here, never on the event loop: a worker holds one across a store read.
        ``renew_for``: the client of an ``auto_renew`` receive, whose deliveries the server renews."""
        deliveries = self.pop.receive(group, topic, queue_ids, batch, invisible_ms, tags, sql)
        if deliveries and renew_for is not None:
            self.pop.mark_renewed(group, topic, deliveries, renew_for)
        if deliveries:  # other receives waiting now take them if they are not acknowledged in time
            self.long_polls.due(topic, group, time.time_ns() // 1_000_000 + invisible_ms)
            return deliveries, None
        return deliveries, self.pop.next_due(group, topic, queue_ids)

    def _hand_back_taken(self, group: str, topic: str, job: asyncio.Future) -> None:
        """The store read of a receive that was cancelled meanwhile is done: hand back what it took."""
        if not job.cancelled() and job.exception() is None:
            self._hand_back_soon(group, topic, job.result()[0])

    def _hand_back_soon(self, group: str, topic: str, deliveries: list) -> None:
        """From the event loop: ``_hand_back`` in a worker thread (the loop never waits for pop's lock)."""
        if not deliveries:
            return
        try:
            asyncio.get_running_loop().run_in_executor(None, self._hand_back, group, topic, deliveries)
        except RuntimeError:  # the workers are shut down: the server is stopping, the messages come back anyway
            log.debug("%d messages of %s not handed back: the server is stopping", len(deliveries), group)

    def _hand_back(self, group: str, topic: str, deliveries: list) -> None:
        """Deliveries no client got are visible again now (``PopGroups.release``), and wake receives waiting."""
        try:
            released = self.pop.release(group, topic, deliveries)
        except Exception:  # nobody waits for this job's result: log what went wrong
            log.exception("handing back %d messages of %s failed", len(deliveries), group)
            return
        if released:
            log.info("%d messages of %s handed back: the receive that took them was cancelled", released, group)
            self.long_polls.wake(topic, group, released)

    def _to_proto(self, msg: MessageExt, handle: str | None, attempt: int, invisible_ms: int):
        props = msg.properties
        user = {k: v for k, v in props.items() if k not in RESERVED_PROPERTIES}
        system = pb.SystemProperties(
            message_id=msg.uniq_key or msg.msg_id, body_encoding=pb.Encoding.IDENTITY,
            # MD5 in upper-case hex, as the proxy sends (GrpcConverter): the Java client compares a CRC32 digest with
            # its own unpadded hex, so a CRC below 0x10000000 (1 body in 16) was marked corrupted and never consumed
            body_digest=pb.Digest(type=pb.DigestType.MD5, checksum=hashlib.md5(msg.body).hexdigest().upper()),
            born_timestamp=_stamp(msg.born_timestamp), born_host=str(msg.born_host.ip),
            store_timestamp=_stamp(msg.store_timestamp), store_host=str(msg.store_host),
            queue_id=msg.queue_id, queue_offset=msg.queue_offset, delivery_attempt=attempt,
            message_type=_message_type(props))
        due = props.get(PropertyName.TIMER_OUT_MS) or props.get(PropertyName.TIMER_DELIVER_MS)
        if due and due.isdigit():
            system.delivery_timestamp.CopyFrom(_stamp(int(due)))
        if msg.tags:
            system.tag = msg.tags
        system.keys.extend(msg.keys)
        if handle is not None:
            system.receipt_handle = handle
            system.invisible_duration.FromMilliseconds(invisible_ms)
        if PropertyName.SHARDING_KEY in props:
            system.message_group = props[PropertyName.SHARDING_KEY]
        return pb.Message(topic=pb.Resource(name=msg.topic), user_properties=user, system_properties=system,
                          body=msg.body)

    def AckMessage(self, request, context):
        group, topic = request.group.name, request.topic.name
        try:
            topic_name(topic)
            consumer_group(request.group)
        except Status as exc:
            return pb.AckMessageResponse(status=status(exc.code, str(exc)))
        entries, failures = [], 0
        for entry in request.entries:
            try:
                self.pop.ack(group, topic, entry.receipt_handle)
                entries.append(pb.AckMessageResultEntry(message_id=entry.message_id,
                                                        receipt_handle=entry.receipt_handle, status=status()))
            except RocketStoreError as exc:
                failures += 1
                failure = status_of(exc)
                entries.append(pb.AckMessageResultEntry(message_id=entry.message_id,
                                                        receipt_handle=entry.receipt_handle,
                                                        status=status(failure.code, str(failure))))
        if self._save_acks and failures < len(entries):
            try:
                self.pop.save()
            except RocketStoreError as exc:  # stored, not saved: the client is told, as for a send's failed flush
                return pb.AckMessageResponse(status=status(pb.Code.INTERNAL_SERVER_ERROR, f"acknowledged, but "
                                                           f"saving the acknowledgement failed: {exc}"),
                                             entries=entries)
        self.metrics.add("acked", len(entries) - failures)
        if failures < len(entries) and self.pop.is_fifo(group):  # the next messages of their groups are free
            self.long_polls.wake(topic, group, len(entries) - failures)
        if failures == 0:
            top = status()
        elif failures == len(entries) and len(entries) == 1:
            top = entries[0].status
        else:
            top = status(pb.Code.MULTIPLE_RESULTS, f"{failures} of {len(entries)} acks failed")
        return pb.AckMessageResponse(status=top, entries=entries)

    def ChangeInvisibleDuration(self, request, context):
        try:
            topic_name(request.topic.name)
            consumer_group(request.group)
            invisible_ms = _duration_ms(request.invisible_duration)
            check_invisible(invisible_ms)
            handle = self.pop.change_invisible(request.group.name, request.topic.name, request.receipt_handle,
                                               invisible_ms)
        except (RocketStoreError, Status) as exc:
            failure = status_of(exc)
            return pb.ChangeInvisibleDurationResponse(status=status(failure.code, str(failure)))
        # a receive waiting since before takes the message once visible again (sooner, if this shortened it)
        self.long_polls.due(request.topic.name, request.group.name, time.time_ns() // 1_000_000 + invisible_ms)
        return pb.ChangeInvisibleDurationResponse(status=status(), receipt_handle=handle)

    def ForwardMessageToDeadLetterQueue(self, request, context):
        try:
            topic_name(request.topic.name)
            consumer_group(request.group)
            self.pop.forward_to_dlq(request.group.name, request.topic.name, request.receipt_handle)
        except (RocketStoreError, Status) as exc:
            failure = status_of(exc)
            return pb.ForwardMessageToDeadLetterQueueResponse(status=status(failure.code, str(failure)))
        if self.pop.is_fifo(request.group.name):  # as after an ack: the next message of its group is free
            self.long_polls.wake(request.topic.name, request.group.name)
        return pb.ForwardMessageToDeadLetterQueueResponse(status=status())

    # --- pull-style offsets -----------------------------------------------------------------------------

    def _pull_queue(self, queue) -> tuple[str, int]:
        """(topic, queue id) of a pull-style call: a topic that exists (TOPIC_NOT_FOUND; pulls never create one)
        and one of its read queues (BAD_REQUEST), as the broker's PullMessageProcessor checks them."""
        topic = queue.topic.name
        read = self._readable(topic)
        if not 0 <= queue.id < read:
            raise Status(pb.Code.BAD_REQUEST, f"queue {queue.id} does not exist: topic {topic} has {read} read queues")
        return topic, queue.id

    def QueryOffset(self, request, context):
        try:
            topic, queue_id = self._pull_queue(request.message_queue)
        except Status as exc:
            return pb.QueryOffsetResponse(status=status(exc.code, str(exc)))
        policy = request.query_offset_policy
        if policy == pb.QueryOffsetPolicy.BEGINNING:
            offset = self.store.get_min_offset_in_queue(topic, queue_id)
        elif policy == pb.QueryOffsetPolicy.TIMESTAMP:
            offset = self.store.get_offset_in_queue_by_time(topic, queue_id, _ms(request.timestamp))
        else:
            offset = self.store.get_max_offset_in_queue(topic, queue_id)
        return pb.QueryOffsetResponse(status=status(), offset=offset)

    def GetOffset(self, request, context):
        try:
            group = consumer_group(request.group)
            topic, queue_id = self._pull_queue(request.message_queue)
        except Status as exc:
            return pb.GetOffsetResponse(status=status(exc.code, str(exc)))
        offset = self.store.query_offset(group, topic, queue_id)
        if offset < 0:
            return pb.GetOffsetResponse(status=status(pb.Code.OFFSET_NOT_FOUND, "the group has no offset here"))
        return pb.GetOffsetResponse(status=status(), offset=offset)

    def UpdateOffset(self, request, context):
        """Commit a group's offset: at most the queue's max offset (the next one to be written), never negative."""
        try:
            group = consumer_group(request.group)
            topic, queue_id = self._pull_queue(request.message_queue)
            end = self.store.get_max_offset_in_queue(topic, queue_id)
            if not 0 <= request.offset <= end:
                raise Status(pb.Code.ILLEGAL_OFFSET, f"offset {request.offset} is outside {topic} queue {queue_id}: "
                                                     f"0..{end}")
            if not self.pop.move_offset(group, topic, queue_id, request.offset):
                raise Status(pb.Code.BAD_REQUEST, f"group {group} has messages of {topic} queue {queue_id} in flight "
                                                  f"(received, not acknowledged): its offset moves with its acks")
        except Status as exc:
            return pb.UpdateOffsetResponse(status=status(exc.code, str(exc)))
        except (RocketStoreError, ValueError) as exc:
            return pb.UpdateOffsetResponse(status=status(pb.Code.BAD_REQUEST, str(exc)))
        return pb.UpdateOffsetResponse(status=status())

    def PullMessage(self, request, context) -> Iterator:
        try:
            consumer_group(request.group)
            topic, queue_id = self._pull_queue(request.message_queue)
            if request.offset < 0:
                raise Status(pb.Code.ILLEGAL_OFFSET, f"offset {request.offset} is negative")
            tags, sql = subscription(request.filter_expression)
            found = self.store.get_message(topic, queue_id, request.offset,
                                           max(1, min(request.batch_size or MAX_BATCH, MAX_BATCH)), tags, sql=sql)
            messages, next_offset = fit(found.messages, found.next_begin_offset)
        except (RocketStoreError, Status) as exc:
            failure = status_of(exc)
            yield pb.PullMessageResponse(status=status(failure.code, str(failure)))
            return
        code = pb.Code.OK if messages else pb.Code.MESSAGE_NOT_FOUND
        yield pb.PullMessageResponse(status=status(code, found.status.name))
        for msg in messages:
            yield pb.PullMessageResponse(message=self._to_proto(msg, None, 1, 0))
        yield pb.PullMessageResponse(next_offset=next_offset)


_CONTROL = frozenset(map(chr, [*range(0x20), *range(0x7F, 0xA0)]))  # Java's Character.isISOControl


def _has_control(text: str) -> bool:
    return not _CONTROL.isdisjoint(text)


def _check_user_properties(user, tag: str, keys) -> None:
    """A send's user properties as the proxy's ``buildMessageProperty`` checks them: at most 128, no reserved name,
    no control character in a name or value, at most 16 KiB with the tag and the keys."""
    if len(user) > USER_PROPERTY_MAX_NUM:
        raise Status(pb.Code.MESSAGE_PROPERTIES_TOO_LARGE, f"{len(user)} user properties; at most "
                                                           f"{USER_PROPERTY_MAX_NUM}")
    size = len(tag.encode()) + sum(len(key.encode()) for key in keys)
    for name, value in user.items():
        if name in RESERVED_PROPERTIES:
            raise Status(pb.Code.ILLEGAL_MESSAGE_PROPERTY_KEY, f"property {name!r} is reserved for the system")
        if _has_control(name) or _has_control(value):
            raise Status(pb.Code.ILLEGAL_MESSAGE_PROPERTY_KEY, f"property {name!r}: names and values cannot contain "
                                                               f"control characters")
        size += len(name.encode()) + len(value.encode())
    if size > MAX_USER_PROPERTY_SIZE:
        raise Status(pb.Code.MESSAGE_PROPERTIES_TOO_LARGE, f"user properties, tag and keys are {size:,} bytes; at "
                                                           f"most {MAX_USER_PROPERTY_SIZE:,}")


def _message_type(props: dict[str, str]) -> int:
    """In the proxy's order (``GrpcConverter.buildSystemProperties``): transaction, delay, FIFO."""
    if props.get(PropertyName.TRANSACTION_PREPARED) == "true":
        return pb.MessageType.TRANSACTION
    if PropertyName.TIMER_OUT_MS in props or PropertyName.TIMER_DELIVER_MS in props or PropertyName.DELAY in props \
            or PropertyName.TIMER_DELAY_SEC in props:
        return pb.MessageType.DELAY
    if PropertyName.SHARDING_KEY in props:
        return pb.MessageType.FIFO
    return pb.MessageType.NORMAL


def _duration_ms(duration) -> int:
    return duration.seconds * 1000 + duration.nanos // 1_000_000


def _java_hash(text: str) -> int:
    """A non-negative String.hashCode (RocketMQ selects a FIFO group's queue by it)."""
    from ..codec.hashing import java_string_hash

    return java_string_hash(text) & 0x7FFFFFFF


@functools.lru_cache(maxsize=4096)
def _host(text: str | None) -> Host | None:
    """The client's born host (an IP, no port); one that does not parse is stored as the store's own."""
    if not text:
        return None
    try:
        return Host(str(ipaddress.ip_address(text.strip("[]"))), 0)
    except ValueError:
        return None


def _endpoints_of(host: str, port: int):
    """``pb.Endpoints`` of one address, its scheme by the form of ``host``."""
    try:
        scheme = pb.AddressScheme.IPv6 if ipaddress.ip_address(host).version == 6 else pb.AddressScheme.IPv4
    except ValueError:
        scheme = pb.AddressScheme.DOMAIN_NAME
    return pb.Endpoints(scheme=scheme, addresses=[pb.Address(host=host, port=port)])


def _local_address_towards(peer: str) -> str:
    """This host's address on the route to ``peer`` (grpc's "ipv4:1.2.3.4:5" or "ipv6:[::1]:5"): the address a
    client that sent no endpoints most likely connected to (grpc's asyncio server does not tell the :authority).
    Connecting a UDP socket sends nothing; it only makes the kernel pick the source address."""
    kind, _, rest = peer.partition(":")
    host = rest.rpartition(":")[0].strip("[]")
    family = socket.AF_INET6 if kind == "ipv6" else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return probe.getsockname()[0]
    except (OSError, ValueError):
        return socket.gethostname()


def _client_id(context) -> str:
    for key, value in context.invocation_metadata():
        if key == "x-mq-client-id":
            return value
    return context.peer()

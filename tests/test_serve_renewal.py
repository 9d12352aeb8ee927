"""``rocketstore serve`` as RocketMQ's proxy where its clients notice it: receipt handles renewed for push consumers
(``auto_renew``), the consumers' retry policy, the body digest, and the sends the proxy refuses.

The server runs in this process on 127.0.0.1 with an ephemeral port (renewal with a policy of seconds instead of
minutes), spoken to by the official client and by raw gRPC calls.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from pathlib import Path

import pytest

rocketmq = pytest.importorskip("rocketmq")
import grpc  # noqa: E402
from rocketmq import (  # noqa: E402
    ClientConfiguration,
    ConsumeResult,
    Credentials,
    FilterExpression,
    Message,
    MessageListener,
    Producer,
    PushConsumer,
)

from rocketstore import MessageStore  # noqa: E402
from rocketstore.errors import RocketStoreError  # noqa: E402
from rocketstore.server import RenewPolicy, Server  # noqa: E402
from rocketstore.server.pop import PopGroups  # noqa: E402
from rocketstore.server.protocol import SERVICE, pb  # noqa: E402
from rocketstore.server.renewal import RETRY_MS, ReceiptRenewals  # noqa: E402
from serving import CONFIG  # noqa: E402

FAST = RenewPolicy(invisible_ms=3_000, ahead_ms=1_500, period_s=0.3, steps_ms=(3_000,), clear_ms=500)


@contextlib.contextmanager
def serving(tmp_path: Path, *topics: str, renew_policy: RenewPolicy | None = FAST):
    store = MessageStore.open(tmp_path / "store", CONFIG)
    try:
        for topic in topics:
            store.create_topic(topic, 2)
        server = Server(store, "127.0.0.1:0", renew_policy=renew_policy).start()
        try:
            yield server, store
        finally:
            server.stop()
    finally:
        store.close()


def client_config(server: Server) -> ClientConfiguration:
    return ClientConfiguration(f"127.0.0.1:{server.port}", Credentials(), request_timeout=5)


def call(server: Server, method: str, request, response_type, *, stream: bool = False):
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        path = f"/{SERVICE}/{method}"
        if stream:
            return list(channel.unary_stream(path, request_serializer=type(request).SerializeToString,
                                             response_deserializer=response_type.FromString)(request, timeout=30))
        return channel.unary_unary(path, request_serializer=type(request).SerializeToString,
                                   response_deserializer=response_type.FromString)(request, timeout=30)


def send_all(server: Server, topic: str, bodies: list[bytes], group: str | None = None) -> None:
    producer = Producer(client_config(server), (topic,))
    producer.startup()
    try:
        for body in bodies:
            msg = Message()
            msg.topic = topic
            msg.body = body
            if group:
                msg.message_group = group
            producer.send(msg)
    finally:
        producer.shutdown()


# --- auto_renew: the server keeps what a push consumer holds invisible --------------------------------------------

class FakePop:
    """``change_invisible`` of a pop state, recorded: each call makes a new handle."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.gone: set[str] = set()

    def change_invisible(self, group: str, topic: str, handle: str, ms: int) -> str:
        if handle in self.gone:
            raise RocketStoreError(f"{handle} is not in flight")
        self.calls.append((handle, ms))
        return f"{handle}+"


def test_renewals_renew_when_due_and_acks_name_the_current_handle():
    pop, now, online = FakePop(), [0], {"c1"}
    policy = RenewPolicy(invisible_ms=60_000, ahead_ms=10_000, steps_ms=(60_000, 180_000))
    renewals = ReceiptRenewals(pop.change_invisible, online.__contains__, policy, clock=lambda: now[0])
    renewals.add("c1", "G", "T", "h1", 60_000, attempt=1)
    renewals.add("c1", "G", "T", "h2", 60_000, attempt=1)
    now[0] = 49_000
    renewals.run_once()
    assert pop.calls == []  # 11 s left: not due
    now[0] = 50_000
    renewals.run_once()
    assert sorted(pop.calls) == [("h1", 60_000), ("h2", 60_000)]
    assert renewals.take("c1", "G", "h1") == "h1+"  # the client's first handle maps to the renewed one
    now[0] = 100_000  # h2 is due again (deadline 110 s); h1 is taken: never renewed again
    renewals.run_once()
    assert pop.calls[-1] == ("h2+", 180_000) and len(pop.calls) == 3
    assert renewals.take("c1", "G", "h2") == "h2++"
    assert renewals.take("c1", "G", "unknown") == "unknown"  # a handle not renewed here is itself
    assert len(renewals) == 0


def test_renewals_give_back_what_an_offline_client_held_and_stop_after_the_longest_hold():
    pop, now, online = FakePop(), [0], {"c1", "c2"}
    policy = RenewPolicy(invisible_ms=60_000, ahead_ms=10_000, max_ms=3_600_000, clear_ms=1_000)
    renewals = ReceiptRenewals(pop.change_invisible, online.__contains__, policy, clock=lambda: now[0])
    renewals.add("c1", "G", "T", "a", 60_000, attempt=1)
    renewals.add("c2", "G", "T", "b", 60_000, attempt=3)
    online.discard("c1")
    renewals.run_once()
    assert pop.calls == [("a", 1_000)] and renewals.cleared == 1  # visible again in a second, for another consumer
    now[0] = 3_600_000  # b held an hour: given back with the group's retry delay for its attempt, as a nack
    renewals.run_once()
    assert pop.calls[-1] == ("b", RETRY_MS[2])
    now[0] += 10 * 3_600_000
    renewals.run_once()
    assert len(pop.calls) == 2  # never renewed again
    renewals.add("c2", "G", "T", "gone", 60_000, attempt=1)
    pop.gone.add("gone")  # acknowledged another way, or delivered again: the renewal stops quietly
    now[0] += 55_000
    renewals.run_once()
    assert len(renewals) == 0 and renewals.take("c2", "G", "gone") == "gone"


def test_clear_all_gives_back_and_still_maps_the_handles():
    pop = FakePop()
    renewals = ReceiptRenewals(pop.change_invisible, lambda client: True, RenewPolicy(clear_ms=1_000))
    renewals.add("c", "G", "T", "x", 60_000, attempt=1)
    renewals.clear_all()
    assert pop.calls == [("x", 1_000)]
    assert renewals.take("c", "G", "x") == "x+"  # an ack that runs on through a stop finds the current handle


def test_renewal_of_a_real_pop_state_then_an_ack_with_the_first_handle(tmp_path):
    with MessageStore.open(tmp_path / "store", CONFIG) as store:
        store.create_topic("T", 1)
        store.put_message(pytest.importorskip("rocketstore").Message("T", b"held"))
        store.wait_for_dispatch()
        pop = PopGroups(store)
        now = [time.time_ns() // 1_000_000]
        renewals = ReceiptRenewals(pop.change_invisible, lambda client: True,
                                   RenewPolicy(invisible_ms=60_000, ahead_ms=10_000), clock=lambda: now[0])
        (delivery,) = pop.receive("G", "T", [0], 1, 60_000, None)
        renewals.add("c", "G", "T", delivery.receipt_handle, 60_000, delivery.attempt)
        now[0] += 55_000
        renewals.run_once()
        assert renewals.renewed == 1
        with pytest.raises(RocketStoreError):  # the first handle alone is stale now
            pop.ack("G", "T", delivery.receipt_handle)
        pop.ack("G", "T", renewals.take("c", "G", delivery.receipt_handle))
        assert store.query_offset("G", "T", 0) == 1


def test_a_push_consumer_slower_than_the_invisible_time_consumes_each_message_once(tmp_path):
    """The listener takes 1.2 s a message, one at a time: the last of 8 waits ~10 s in the client's cache, over
    three times the 3 s an auto-renewed receive hides it for. Renewed, each is consumed once."""
    with serving(tmp_path, "Slow") as (server, _store):
        send_all(server, "Slow", [f"s{i}".encode() for i in range(8)])
        seen: list[tuple[bytes, int]] = []
        done = threading.Event()

        class Slow(MessageListener):
            def consume(self, msg):
                seen.append((msg.body, msg.delivery_attempt))
                time.sleep(1.2)
                if len({body for body, _ in seen}) == 8:
                    done.set()
                return ConsumeResult.SUCCESS

        consumer = PushConsumer(client_config(server), "SlowG", Slow(), {"Slow": FilterExpression()},
                                consumption_thread_count=1)
        consumer.startup()
        try:
            assert done.wait(60), seen
            time.sleep(2 * FAST.invisible_ms / 1000)  # long enough for a message not renewed to come back
        finally:
            consumer.shutdown()
        assert sorted(seen) == sorted((f"s{i}".encode(), 1) for i in range(8)), seen
        assert server.service.renewals.renewed > 0


# --- what consumers are told, and what they get ------------------------------------------------------------------

def test_consumers_get_the_groups_retry_policy_and_producers_their_backoff(tmp_path):
    with serving(tmp_path) as (server, _store):
        consumer = pb.Settings(subscription=pb.Subscription(group=pb.Resource(name="G")))
        settings = server.service._settings(consumer)
        delays = [d.ToMilliseconds() for d in settings.backoff_policy.customized_backoff.next]
        assert delays == list(RETRY_MS) and delays[:4] == [1_000, 5_000, 10_000, 30_000] and delays[-1] == 7_200_000
        assert settings.backoff_policy.max_attempts == server.service.pop.max_attempts
        assert not settings.backoff_policy.HasField("exponential_backoff")
        producer = server.service._settings(pb.Settings(publishing=pb.Publishing()))
        assert producer.backoff_policy.exponential_backoff.max.ToMilliseconds() == 1_000
        assert producer.backoff_policy.max_attempts == 3


def test_bodies_carry_an_md5_digest_as_the_proxy_sends(tmp_path):
    # bodies whose CRC32 is below 0x10000000 (a Java client compares them unpadded) among them
    bodies = [f"order-{i}".encode() for i in range(32)]
    with serving(tmp_path, "Digest") as (server, _store):
        send_all(server, "Digest", bodies)
        request = pb.ReceiveMessageRequest(group=pb.Resource(name="D"), batch_size=32,
                                           message_queue=pb.MessageQueue(topic=pb.Resource(name="Digest"), id=-1))
        request.invisible_duration.FromSeconds(30)
        request.long_polling_timeout.FromSeconds(1)
        got = {}
        while len(got) < len(bodies):
            replies = [r for r in call(server, "ReceiveMessage", request, pb.ReceiveMessageResponse, stream=True)
                       if r.HasField("message")]
            assert replies, got
            got.update((r.message.body, r.message.system_properties.body_digest) for r in replies)
    for body, digest in got.items():
        assert digest.type == pb.DigestType.MD5
        assert digest.checksum == hashlib.md5(body).hexdigest().upper()


# --- sends the proxy refuses ------------------------------------------------------------------------------------

def _request(n: int = 1, topics: list[str] | None = None, body: bytes = b"x", user: dict | None = None,
             message_id: str = "01ABCDEF", group: str | None = None, tag: str | None = None,
             keys: tuple[str, ...] = ()) -> pb.SendMessageRequest:
    request = pb.SendMessageRequest()
    for i in range(n):
        msg = request.messages.add()
        msg.topic.name = topics[i] if topics else "Valid"
        msg.body = body
        msg.user_properties.update(user or {})
        msg.system_properties.message_id = message_id
        if group is not None:
            msg.system_properties.message_group = group
        if tag is not None:
            msg.system_properties.tag = tag
        msg.system_properties.keys.extend(keys)
    return request


REFUSED = [
    *[(f"reserved {name}", {"user": {name: "1"}}, pb.Code.ILLEGAL_MESSAGE_PROPERTY_KEY)
      for name in ("MSG_TYPE", "TIMER_DELAY_LEVEL", "RECONSUME_TIME", "__BORNHOST", "TIMER_DEL_UNIQKEY", "POP_CK",
                   "DLQ_ORIGIN_TOPIC", "BORN_TIMESTAMP", "TTL", "CORRELATION_ID", "1ST_POP_TIME", "UNIQ_KEY")],
    ("control character in a value", {"user": {"a": "x\ny"}}, pb.Code.ILLEGAL_MESSAGE_PROPERTY_KEY),
    ("control character in a name", {"user": {"a\tb": "x"}}, pb.Code.ILLEGAL_MESSAGE_PROPERTY_KEY),
    ("129 user properties", {"user": {f"p{i}": "v" for i in range(129)}}, pb.Code.MESSAGE_PROPERTIES_TOO_LARGE),
    ("16 KiB of user properties", {"user": {"big": "v" * (16 << 10)}}, pb.Code.MESSAGE_PROPERTIES_TOO_LARGE),
    ("a message group of 64 bytes", {"group": "g" * 64}, pb.Code.ILLEGAL_MESSAGE_GROUP),
    ("a blank message group", {"group": "  "}, pb.Code.ILLEGAL_MESSAGE_GROUP),
    ("a control character in a message group", {"group": "a\nb"}, pb.Code.ILLEGAL_MESSAGE_GROUP),
    ("a control character in a key", {"keys": ("k\n1",)}, pb.Code.ILLEGAL_MESSAGE_KEY),
    ("a control character in a tag", {"tag": "t\x01ag"}, pb.Code.ILLEGAL_MESSAGE_TAG),
    ("a control character in a tag (C1)", {"tag": "t\x85ag"}, pb.Code.ILLEGAL_MESSAGE_TAG),
    ("an empty message id", {"message_id": ""}, pb.Code.ILLEGAL_MESSAGE_ID),
    ("a blank message id", {"message_id": " "}, pb.Code.ILLEGAL_MESSAGE_ID),
    ("one batch, two topics", {"n": 2, "topics": ["Valid", "Other"]}, pb.Code.MESSAGE_CORRUPTED),
    ("a batch past max_message_size", {"n": 5, "body": b"x" * (1 << 20)}, pb.Code.MESSAGE_BODY_TOO_LARGE),
]


def test_sends_the_proxy_refuses_are_refused_with_its_codes_and_write_nothing(tmp_path):
    with serving(tmp_path, "Valid", "Other") as (server, store):
        for what, fields, code in REFUSED:
            reply = call(server, "SendMessage", _request(**fields), pb.SendMessageResponse)
            assert reply.status.code == code, (what, reply.status)
        fine = [_request(user={f"p{i}": "v" for i in range(128)}), _request(group="g" * 63),
                _request(n=3, body=b"x" * (1 << 20)), _request(tag="TagA", keys=("k1", "k2"))]
        for request in fine:
            reply = call(server, "SendMessage", request, pb.SendMessageResponse)
            assert reply.status.code == pb.Code.OK, reply.status
        store.wait_for_dispatch()
        assert sum(1 for _ in store.iter_messages()) == 6  # the refused sends wrote nothing

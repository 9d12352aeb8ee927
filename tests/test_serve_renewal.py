"""``rocketstore serve`` as RocketMQ's proxy where its clients notice it: receipt handles renewed for push consumers
(``auto_renew``), the consumers' retry policy, the body digest, and the sends the proxy refuses.

The server runs in this process on 127.0.0.1 with an ephemeral port (renewal with a policy of seconds instead of
minutes), spoken to by the official client and by raw gRPC calls.
"""

from __future__ import annotations

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

from rocketstore import Message as StoredMessage  # noqa: E402
from rocketstore import MessageStore  # noqa: E402
from rocketstore.server import RenewPolicy, Server  # noqa: E402
from rocketstore.server.pop import PopGroups  # noqa: E402
from rocketstore.server.protocol import SERVICE, pb  # noqa: E402
from rocketstore.server.renewal import RETRY_MS, Clients  # noqa: E402
from serving import CONFIG  # noqa: E402
from test_serve_robustness import in_process_server  # noqa: E402

# renewals in seconds, with room for a loaded machine (a pass every 0.25 s, 2.5 s before the deadline)
FAST = RenewPolicy(invisible_ms=4_000, ahead_ms=2_500, period_s=0.25, steps_ms=(4_000,), clear_ms=500)


def serving(tmp_path: Path, *topics: str, renew_policy: RenewPolicy | None = FAST):
    """An in-process server (``test_serve_robustness.in_process_server``) with ``topics`` of 2 queues and a renewal
    policy of seconds."""
    return in_process_server(tmp_path, *((topic, 2) for topic in topics), renew_policy=renew_policy)


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

def _pop_with_messages(tmp_path: Path, n: int, **kwargs) -> tuple[MessageStore, PopGroups]:
    store = MessageStore.open(tmp_path / "store", CONFIG)
    store.create_topic("T", 1)
    for i in range(n):
        store.put_message(StoredMessage("T", f"m{i}".encode()))
    store.wait_for_dispatch()
    return store, PopGroups(store, **kwargs)


def _deadline(pop: PopGroups, offset: int) -> int:
    return pop._queues[("G", "T", 0)].inflight[offset].deadline_ms


def test_renewal_hides_a_held_message_longer_and_keeps_its_receipt_handle(tmp_path):
    store, pop = _pop_with_messages(tmp_path, 2)
    with store:
        policy = RenewPolicy(invisible_ms=60_000, ahead_ms=10_000, steps_ms=(60_000, 180_000))
        first, second = pop.receive("G", "T", [0], 2, 60_000, None)
        pop.mark_renewed("G", "T", [first, second], "c1")
        start = _deadline(pop, 0) - 60_000
        assert pop.renew(policy, lambda client: True, now=start + 49_000) == []  # 11 s left: not due
        assert _deadline(pop, 0) == start + 60_000
        pop.renew(policy, lambda client: True, now=start + 50_000)
        assert _deadline(pop, 0) == start + 110_000 and pop.renewed == 2
        pop.ack("G", "T", first.receipt_handle)  # the handle the client got still acknowledges it
        pop.renew(policy, lambda client: True, now=start + 100_000)
        assert _deadline(pop, 1) == start + 280_000  # the second renewal hides it for the second step
        pop.change_invisible("G", "T", second.receipt_handle, 1_000)  # the client's nack: renewals stop
        before = _deadline(pop, 1)
        pop.renew(policy, lambda client: True, now=before)
        assert _deadline(pop, 1) == before and pop.renewed == 3


def test_renewal_gives_back_what_a_gone_client_held_and_stops_after_the_longest_hold(tmp_path):
    store, pop = _pop_with_messages(tmp_path, 2)
    with store:
        policy = RenewPolicy(invisible_ms=60_000, ahead_ms=10_000, max_ms=3_600_000, clear_ms=1_000)
        first, second = pop.receive("G", "T", [0], 2, 60_000, None)
        pop.mark_renewed("G", "T", [first], "gone")
        pop.mark_renewed("G", "T", [second], "here")
        now = _deadline(pop, 0) - 60_000
        sooner = pop.renew(policy, lambda client: client == "here", now=now)
        assert sooner == [("T", "G", now + 1_000)]  # visible again in a second, for another consumer
        assert _deadline(pop, 0) == now + 1_000 and _deadline(pop, 1) == now + 60_000
        received = pop._queues[("G", "T", 0)].inflight[1].renew.received_ms  # (ms after the receive, under load)
        pop.renew(policy, lambda client: True, now=received + 3_600_000)  # held an hour: a nack, the retry delay
        assert _deadline(pop, 1) == received + 3_600_000 + RETRY_MS[0]
        pop.renew(policy, lambda client: True, now=received + 3_600_000 + RETRY_MS[0])
        assert _deadline(pop, 1) == received + 3_600_000 + RETRY_MS[0]  # never renewed again


def test_renewals_are_saved_and_a_restarted_server_goes_on_with_them(tmp_path):
    state = tmp_path / "popState.json"
    store, pop = _pop_with_messages(tmp_path, 1, state_path=state)
    with store:
        (held,) = pop.receive("G", "T", [0], 1, 60_000, None)
        pop.mark_renewed("G", "T", [held], "c1")
        now = _deadline(pop, 0) - 60_000
        pop.renew(RenewPolicy(), lambda client: True, now=now + 55_000)
        pop.save()
        again = PopGroups(store, state_path=state)
        flight = again._queues[("G", "T", 0)].inflight[0]
        assert (flight.deadline_ms, flight.renew.client, flight.renew.renewals) == (now + 115_000, "c1", 1)
        again.renew(RenewPolicy(), lambda client: True, now=now + 110_000)
        assert again._queues[("G", "T", 0)].inflight[0].deadline_ms == now + 110_000 + 180_000
        again.ack("G", "T", held.receipt_handle)  # the handle from before the restart


def test_a_client_is_there_while_heard_from_and_gone_once_it_says_so():
    now = [0]
    clients = Clients(expiry_ms=120_000, clock=lambda: now[0])
    assert clients.online("unknown")  # after a (re)start every client gets the expiry to come back
    now[0] = 119_999
    clients.touch("c1")
    assert clients.online("unknown") and clients.online("c1")
    now[0] = 120_000
    assert not clients.online("unknown") and clients.online("c1")
    now[0] = 239_998
    assert clients.online("c1")
    now[0] = 239_999  # two minutes since it was heard
    assert not clients.online("c1")
    clients.touch("c1")
    clients.terminated("c1")
    assert not clients.online("c1")
    clients.touch("c1")  # a client id in use again
    assert clients.online("c1")


def _receive(server: Server, client: str, group: str, invisible_s: int = 30, auto_renew: bool = False) -> list:
    request = pb.ReceiveMessageRequest(group=pb.Resource(name=group), batch_size=8, auto_renew=auto_renew,
                                       message_queue=pb.MessageQueue(topic=pb.Resource(name="Held"), id=-1))
    request.invisible_duration.FromSeconds(invisible_s)
    request.long_polling_timeout.FromSeconds(1)
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        rpc = channel.unary_stream(f"/{SERVICE}/ReceiveMessage",
                                   request_serializer=pb.ReceiveMessageRequest.SerializeToString,
                                   response_deserializer=pb.ReceiveMessageResponse.FromString)
        replies = rpc(request, timeout=30, metadata=[("x-mq-client-id", client)])
        return [r.message for r in replies if r.HasField("message")]


def _as_client(server: Server, client: str, method: str, request, response_type):
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        rpc = channel.unary_unary(f"/{SERVICE}/{method}", request_serializer=type(request).SerializeToString,
                                  response_deserializer=response_type.FromString)
        return rpc(request, timeout=30, metadata=[("x-mq-client-id", client)])


def test_a_client_without_its_telemetry_stream_keeps_what_it_holds_until_it_terminates(tmp_path):
    """The Python client rebuilds a broken telemetry stream only every 5 minutes, heartbeating and receiving
    meanwhile: such a client is still there (the proxy's channel lives on heartbeats), so what it holds with
    auto_renew is renewed, not handed to another consumer; once it says it terminates, it is given back."""
    with serving(tmp_path, "Held") as (server, _store):
        send_all(server, "Held", [b"held"])
        (msg,) = _receive(server, "c1", "HG", auto_renew=True)
        heartbeat = pb.HeartbeatRequest(group=pb.Resource(name="HG"), client_type=pb.ClientType.PUSH_CONSUMER)
        deadline = time.monotonic() + 3 * FAST.invisible_ms / 1000
        while time.monotonic() < deadline:  # three invisible times: c2 gets nothing while c1 is there
            assert _as_client(server, "c1", "Heartbeat", heartbeat, pb.HeartbeatResponse).status.code == pb.Code.OK
            assert _receive(server, "c2", "HG") == []
        assert server.service.pop.renewed > 0
        bye = pb.NotifyClientTerminationRequest(group=pb.Resource(name="HG"))
        _as_client(server, "c1", "NotifyClientTermination", bye, pb.NotifyClientTerminationResponse)
        # the same id heard again before the next renewal pass revives nothing: given back at the termination
        assert _as_client(server, "c1", "Heartbeat", heartbeat, pb.HeartbeatResponse).status.code == pb.Code.OK
        again = []
        deadline = time.monotonic() + 10
        while not again and time.monotonic() < deadline:
            again = _receive(server, "c2", "HG")
        assert [(m.body, m.system_properties.delivery_attempt) for m in again] == [(b"held", 2)]
        ack = pb.AckMessageRequest(group=pb.Resource(name="HG"), topic=pb.Resource(name="Held"), entries=[
            pb.AckMessageEntry(message_id=msg.system_properties.message_id,
                               receipt_handle=msg.system_properties.receipt_handle)])
        late = _as_client(server, "c1", "AckMessage", ack, pb.AckMessageResponse)
        assert late.status.code == pb.Code.INVALID_RECEIPT_HANDLE  # delivered again since: c1's handle is stale


def test_a_push_consumer_slower_than_the_invisible_time_consumes_each_message_once(tmp_path):
    """The listener takes 1.2 s a message, one at a time: the last of 8 waits ~10 s in the client's cache, over
    more than twice the 4 s an auto-renewed receive hides it for. Renewed, each is consumed once."""
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
        assert server.service.pop.renewed > 0


# --- what consumers are told, and what they get ------------------------------------------------------------------

def test_consumers_get_the_groups_retry_policy_and_producers_their_backoff(tmp_path):
    with serving(tmp_path) as (server, _store):
        consumer = pb.Settings(subscription=pb.Subscription(group=pb.Resource(name="G")))
        settings = server.service._settings(consumer)
        delays = [d.ToMilliseconds() for d in settings.backoff_policy.customized_backoff.next]
        assert delays == list(RETRY_MS) and delays[:4] == [1_000, 5_000, 10_000, 30_000] and delays[-1] == 7_200_000
        assert settings.backoff_policy.max_attempts == server.service.pop.max_attempts
        assert not settings.backoff_policy.HasField("exponential_backoff")
        consumer.backoff_policy.customized_backoff.next.add().FromSeconds(3)  # a client's own policy is replaced
        again = server.service._settings(consumer)
        assert [d.ToMilliseconds() for d in again.backoff_policy.customized_backoff.next] == list(RETRY_MS)
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
    ("a blank key", {"keys": ("  ",)}, pb.Code.ILLEGAL_MESSAGE_KEY),
    ("a blank tag", {"tag": " "}, pb.Code.ILLEGAL_MESSAGE_TAG),
    ("a tag with |", {"tag": "a|b"}, pb.Code.ILLEGAL_MESSAGE_TAG),
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
                _request(n=3, body=b"x" * (1 << 20)), _request(tag="TagA", keys=("k1", "k2")),
                # what the proxy (and the Python client) take: a key with a space inside is two keys, as KEYS
                # (the keys joined by spaces) makes it in RocketMQ; a tag with a blank at an end
                _request(body=b"spaced", tag="TagB ", keys=("order 42",))]
        for request in fine:
            reply = call(server, "SendMessage", request, pb.SendMessageResponse)
            assert reply.status.code == pb.Code.OK, reply.status
        store.wait_for_dispatch()
        assert sum(1 for _ in store.iter_messages()) == 7  # the refused sends wrote nothing
        (spaced,) = store.query_message("Valid", "42")
        assert (spaced.body, spaced.keys, spaced.tags) == (b"spaced", ["order", "42"], "TagB ")


def test_a_restarted_server_renews_before_any_receive_and_asks_each_client_once(tmp_path):
    """A held message whose saved deadline passed while serve was down was visible to any receive until the first
    renewal pass, a period later (the proxy's first pass runs at once); and a pass asked whether the client is
    there for every message it held, under each queue's lock."""
    from rocketstore.server.service import MessagingService

    store, pop = _pop_with_messages(tmp_path, 3, state_path=tmp_path / "store" / "config" / "popState.json")
    with store:
        held = pop.receive("G", "T", [0], 3, 60_000, None)
        pop.mark_renewed("G", "T", held, "c1")
        asked = []
        pop.renew(RenewPolicy(), lambda client: asked.append(client) or True)
        assert asked == ["c1"]  # once for its three messages
        for flight in pop._queues[("G", "T", 0)].inflight.values():
            flight.deadline_ms = time.time_ns() // 1_000_000 - 1_000  # passed while serve was down
        pop.save()
        service = MessagingService(store, renew_policy=RenewPolicy(period_s=3600))
        service.start()
        try:
            now = time.time_ns() // 1_000_000
            deadlines = [f.deadline_ms for f in service.pop._queues[("G", "T", 0)].inflight.values()]
            assert len(deadlines) == 3 and min(deadlines) > now + 50_000  # renewed at the start, not visible
            assert service.pop.receive("G", "T", [0], 3, 60_000, None) == []
        finally:
            service.close()

"""``rocketstore serve`` under requests a review found it mishandled: malformed handles, illegal groups and topics,
pull calls on queues that do not exist, refused dead-letter puts, many open calls, SIGTERM mid-traffic.

Most tests share one server (a module fixture over a store seeded with topics of every permission) and speak raw
gRPC with rocketstore's own protocol classes, so each bad request reaches the server as it is. A test that needs
other options or a stop of its own starts its own server.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from rocketstore import MessageStore
from rocketstore.brokerconfig import PERM_READ, PERM_WRITE
from rocketstore.codec.hashing import java_string_hash
from rocketstore.encoder import validate_topic
from rocketstore.errors import InvalidTopicError
from rocketstore.message import Message
from rocketstore.server.protocol import SERVICE, pb
from serving import CONFIG, SMALL, Served

# one worker, one module server (--dist loadgroup); a worker that gets some of the tests anyway starts its own,
# so no test may rely on another having run before it
pytestmark = pytest.mark.xdist_group("serve_robustness")

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("robust") / "store"
    with MessageStore.open(root, CONFIG) as store:
        store.put_message(Message("Seed", b"the store has a log from the start", queue_id=0))
        store.create_topic("Shared", 4)
        store.create_topic("DlqSource", 1)
        store.create_topic("Busy", 4)
        store.create_topic("Idle", 4)
        store.topic_config.create_or_update("%DLQ%Stuck", write_queue_nums=1, perm=PERM_READ)  # refuses puts
        for topic, write, read, perm in (("ReadOnly", 4, 4, PERM_READ), ("WriteOnly", 4, 4, PERM_WRITE),
                                         ("MoreRead", 2, 4, PERM_READ | PERM_WRITE),
                                         ("MoreWrite", 4, 2, PERM_READ | PERM_WRITE), ("Sealed", 2, 2, 0)):
            store.topic_config.create_or_update(topic, write_queue_nums=write, read_queue_nums=read, perm=perm)
    served = Served(root, "--max-attempts", "1")
    yield served
    if served.proc.poll() is None:
        served.proc.kill()
        served.proc.wait(30)


def send(server: Served, topic: str, *bodies: bytes, group: str | None = None, **user: str):
    request = pb.SendMessageRequest()
    for i, body in enumerate(bodies):
        msg = request.messages.add()
        msg.topic.name = topic
        msg.body = body
        msg.user_properties.update(user)
        msg.system_properties.message_id = f"01{time.monotonic_ns():020X}{i:04X}"
        if group is not None:
            msg.system_properties.message_group = group
    return server.call("SendMessage", request, pb.SendMessageResponse)


def receive(server: Served, group: str, topic: str, *, batch: int = 32, invisible_s: int = 30, poll_s: int = 1,
            queue_id: int = -1) -> tuple[int, list]:
    """(status code, messages) of one ReceiveMessage."""
    request = pb.ReceiveMessageRequest(group=pb.Resource(name=group),
                                       message_queue=pb.MessageQueue(topic=pb.Resource(name=topic), id=queue_id),
                                       batch_size=batch)
    request.invisible_duration.FromSeconds(invisible_s)
    request.long_polling_timeout.FromSeconds(poll_s)
    replies = server.call("ReceiveMessage", request, pb.ReceiveMessageResponse, stream=True)
    return replies[0].status.code, [r.message for r in replies if r.HasField("message")]


def receive_until(server: Served, group: str, topic: str, count: int, *, timeout: float = 10, **options) -> list:
    """Messages of as many receives as it takes to get ``count`` (dispatch is asynchronous), or a timeout."""
    got: list = []
    deadline = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        got += receive(server, group, topic, **options)[1]
    return got


def ack(server: Served, group: str, topic: str, *handles: str):
    request = pb.AckMessageRequest(group=pb.Resource(name=group), topic=pb.Resource(name=topic),
                                   entries=[pb.AckMessageEntry(message_id="01AB", receipt_handle=h) for h in handles])
    return server.call("AckMessage", request, pb.AckMessageResponse)


def change_invisible(server: Served, group: str, topic: str, handle: str, seconds: int = 5):
    request = pb.ChangeInvisibleDurationRequest(group=pb.Resource(name=group), topic=pb.Resource(name=topic),
                                                receipt_handle=handle, message_id="01AB")
    request.invisible_duration.FromSeconds(seconds)
    return server.call("ChangeInvisibleDuration", request, pb.ChangeInvisibleDurationResponse)


# --- 1. receipt handles ------------------------------------------------------------------------------------------

def test_undecodable_receipt_handles_are_invalid_not_internal_errors(server):
    assert send(server, "Shared", b"handle me").status.code == pb.Code.OK
    got = receive_until(server, "Handles", "Shared", 1, batch=1)
    assert len(got) == 1
    good = got[0].system_properties.receipt_handle
    queue_id, offset, delivery, mac = good.split(".")
    for bad in (f"{queue_id}.{offset}.{delivery}.dé{mac[2:]}",  # non-ASCII MAC: hmac.compare_digest raised
                "0.0.1.\u00e9\u00e9", "\u0663.0.1." + mac,  # an Arabic-Indic digit, which int() accepts
                f" {queue_id}.{offset}.{delivery}.{mac}", f"{queue_id}.{offset}.{delivery}.{mac.upper()}",
                "\U0001F680" * 40, ""):
        reply = ack(server, "Handles", "Shared", bad)
        assert reply.status.code == pb.Code.INVALID_RECEIPT_HANDLE, (bad, reply.status)
        assert [e.status.code for e in reply.entries] == [pb.Code.INVALID_RECEIPT_HANDLE]
        assert change_invisible(server, "Handles", "Shared", bad).status.code == pb.Code.INVALID_RECEIPT_HANDLE
    mixed = ack(server, "Handles", "Shared", "0.0.1.d\u00e9", good)  # one bad entry does not spoil the others
    assert mixed.status.code == pb.Code.MULTIPLE_RESULTS
    assert [e.status.code for e in mixed.entries] == [pb.Code.INVALID_RECEIPT_HANDLE, pb.Code.OK]


# --- 2. consumer groups -------------------------------------------------------------------------------------

def test_invisible_durations_past_twelve_hours_are_illegal(server):
    """2^40 s was accepted: a message hidden that long was freed only by a restart, and held its queue's committed
    offset meanwhile. RocketMQ's proxy refuses more than 12 hours."""
    send(server, "Invisible", b"x")
    assert receive(server, "G12h", "Invisible", invisible_s=12 * 3600 + 1)[0] == pb.Code.ILLEGAL_INVISIBLE_TIME
    [msg] = receive_until(server, "G12h", "Invisible", 1, invisible_s=12 * 3600)
    handle = msg.system_properties.receipt_handle
    assert change_invisible(server, "G12h", "Invisible", handle, 1 << 40).status.code == pb.Code.ILLEGAL_INVISIBLE_TIME
    assert ack(server, "G12h", "Invisible", handle).status.code == pb.Code.OK  # the refused change changed nothing


ILLEGAL_GROUPS = ("", "   ", "g" * 121, "bad/group", "bad group", "gr\u00fcppe", "CID_RMQ_SYS_TRANS", "CID_RMQ_SYS_x")


def group_calls(group: str) -> dict[str, tuple]:
    """Every call that names a consumer group: (method, request, response class, streaming)."""
    res = pb.Resource(name=group)
    topic = pb.Resource(name="Shared")
    queue = pb.MessageQueue(topic=topic, id=0)
    receive = pb.ReceiveMessageRequest(group=res, message_queue=queue, batch_size=1)
    receive.long_polling_timeout.FromSeconds(1)
    change = pb.ChangeInvisibleDurationRequest(group=res, topic=topic, receipt_handle="0.0.1.x", message_id="01AB")
    change.invisible_duration.FromSeconds(5)
    return {
        "ReceiveMessage": (receive, pb.ReceiveMessageResponse, True),
        "AckMessage": (pb.AckMessageRequest(group=res, topic=topic, entries=[
            pb.AckMessageEntry(message_id="01AB", receipt_handle="0.0.1.x")]), pb.AckMessageResponse, False),
        "ChangeInvisibleDuration": (change, pb.ChangeInvisibleDurationResponse, False),
        "ForwardMessageToDeadLetterQueue": (pb.ForwardMessageToDeadLetterQueueRequest(
            group=res, topic=topic, receipt_handle="0.0.1.x", message_id="01AB"),
            pb.ForwardMessageToDeadLetterQueueResponse, False),
        "PullMessage": (pb.PullMessageRequest(group=res, message_queue=queue, offset=0, batch_size=1),
                        pb.PullMessageResponse, True),
        "UpdateOffset": (pb.UpdateOffsetRequest(group=res, message_queue=queue, offset=0), pb.UpdateOffsetResponse,
                         False),
        "GetOffset": (pb.GetOffsetRequest(group=res, message_queue=queue), pb.GetOffsetResponse, False),
        "QueryAssignment": (pb.QueryAssignmentRequest(group=res, topic=topic), pb.QueryAssignmentResponse, False),
        "Heartbeat": (pb.HeartbeatRequest(group=res, client_type=pb.ClientType.SIMPLE_CONSUMER),
                      pb.HeartbeatResponse, False),
        "NotifyClientTermination": (pb.NotifyClientTerminationRequest(group=res), pb.NotifyClientTerminationResponse,
                                    False),
    }


def telemetry(server: Served, *commands, timeout: float = 5) -> list:
    with grpc.insecure_channel(server.address) as channel:
        rpc = channel.stream_stream(f"/{SERVICE}/Telemetry", request_serializer=pb.TelemetryCommand.SerializeToString,
                                    response_deserializer=pb.TelemetryCommand.FromString)
        replies = rpc(iter(commands), timeout=timeout, metadata=[("x-mq-client-id", "robust-test")])
        out = []
        try:
            for reply in replies:
                out.append(reply)
                if len(out) == len(commands):
                    break
        finally:
            replies.cancel()
        return out


def test_every_call_that_takes_a_consumer_group_checks_it(server):
    for group in ILLEGAL_GROUPS:
        for method, (request, response, stream) in group_calls(group).items():
            reply = server.call(method, request, response, stream=stream)
            code = (reply[0] if stream else reply).status.code
            assert code == pb.Code.ILLEGAL_CONSUMER_GROUP, (method, group, code)
        settings = pb.Settings(client_type=pb.ClientType.SIMPLE_CONSUMER,
                               subscription=pb.Subscription(group=pb.Resource(name=group)))
        replies = telemetry(server, pb.TelemetryCommand(settings=settings))
        assert [r.status.code for r in replies] == [pb.Code.ILLEGAL_CONSUMER_GROUP], group
    longest = "g" * 120  # RocketMQ's limit: "%DLQ%" + it is still a topic name
    for method, (request, response, stream) in group_calls(longest).items():
        reply = server.call(method, request, response, stream=stream)
        code = (reply[0] if stream else reply).status.code
        assert code != pb.Code.ILLEGAL_CONSUMER_GROUP, (method, code)
    producer = server.call("Heartbeat", pb.HeartbeatRequest(client_type=pb.ClientType.PRODUCER), pb.HeartbeatResponse)
    assert producer.status.code == pb.Code.OK  # a producer names no group
    assert server.call("NotifyClientTermination", pb.NotifyClientTerminationRequest(),
                       pb.NotifyClientTerminationResponse).status.code == pb.Code.OK
    settings = pb.Settings(client_type=pb.ClientType.SIMPLE_CONSUMER,
                           subscription=pb.Subscription(group=pb.Resource(name=longest)))
    assert [r.status.code for r in telemetry(server, pb.TelemetryCommand(settings=settings))] == [pb.Code.OK]
    with MessageStore.open(server.root, CONFIG, read_only=True) as store:  # no offset was kept for an illegal group
        for group in ILLEGAL_GROUPS:
            assert store.consumer_offsets.query(group, "Shared", 0) == -1, group  # (query_offset refuses it)


# --- 3. dead-letter queue -----------------------------------------------------------------------------------

def test_dead_letter_topics_of_long_groups_are_storable(tmp_path):
    """RocketMQ allows 255 characters for a %DLQ% topic as for a %RETRY% one (RETRY_OR_DLQ_TOPIC_MAX_LENGTH)."""
    long_dlq = "%DLQ%" + "g" * 250
    assert validate_topic(long_dlq) == long_dlq
    with pytest.raises(InvalidTopicError):
        validate_topic(long_dlq + "g")
    with MessageStore.open(tmp_path / "store", CONFIG) as store:
        store.put_message(Message(long_dlq, b"dead", queue_id=0))
        store.wait_for_dispatch()
        assert [m.body for m in store.get_message(long_dlq, 0, 0).messages] == [b"dead"]


def test_a_refused_dead_letter_put_does_not_wedge_the_group(server):
    """%DLQ%Stuck is read-only: the store refuses every dead-letter copy of group Stuck (--max-attempts 1)."""
    group, topic = "Stuck", "DlqSource"
    assert send(server, topic, b"m0", b"m1", b"m2").status.code == pb.Code.OK
    first = receive_until(server, group, topic, 1, batch=1, invisible_s=1)
    assert [m.body for m in first] == [b"m0"]
    time.sleep(1.1)  # m0 is due again, its attempts used up: its DLQ put fails
    got = receive_until(server, group, topic, 3, invisible_s=1)
    assert sorted((m.body, m.system_properties.delivery_attempt) for m in got) == [(b"m0", 2), (b"m1", 1), (b"m2", 1)]
    assert any("could not go to %DLQ%Stuck" in line for line in server.lines), "the failure is logged"
    by_body = {m.body: m.system_properties.receipt_handle for m in got}
    assert ack(server, group, topic, by_body[b"m0"], by_body[b"m2"]).status.code == pb.Code.OK
    forward = pb.ForwardMessageToDeadLetterQueueRequest(group=pb.Resource(name=group), topic=pb.Resource(name=topic),
                                                        receipt_handle=by_body[b"m1"], message_id="01AB")
    reply = server.call("ForwardMessageToDeadLetterQueue", forward, pb.ForwardMessageToDeadLetterQueueResponse)
    assert reply.status.code == pb.Code.INTERNAL_SERVER_ERROR and "%DLQ%Stuck" in reply.status.message
    time.sleep(1.1)  # m1 stayed in flight: back after its invisible time
    again = receive_until(server, group, topic, 1, invisible_s=30)
    assert [m.body for m in again] == [b"m1"]
    assert ack(server, group, topic, again[0].system_properties.receipt_handle).status.code == pb.Code.OK


def test_a_group_of_the_longest_legal_name_dead_letters(server):
    group = "L" * 120
    assert send(server, "DlqSource", b"poison").status.code == pb.Code.OK
    got: list = []  # the topic may hold another test's messages before it (one module's server): up to the poison
    deadline = time.monotonic() + 10
    while not any(m.body == b"poison" for m in got) and time.monotonic() < deadline:
        got += receive(server, group, "DlqSource", invisible_s=30)[1]
    poison = [m for m in got if m.body == b"poison"]
    assert poison, got
    forward = pb.ForwardMessageToDeadLetterQueueRequest(
        group=pb.Resource(name=group), topic=pb.Resource(name="DlqSource"),
        receipt_handle=poison[0].system_properties.receipt_handle, message_id="01AB")
    reply = server.call("ForwardMessageToDeadLetterQueue", forward, pb.ForwardMessageToDeadLetterQueueResponse)
    assert reply.status.code == pb.Code.OK, reply.status


# --- 4. system topics ---------------------------------------------------------------------------------------

SYSTEM_TOPICS = ("SCHEDULE_TOPIC_XXXX", "rmq_sys_wheel_timer", "rmq_sys_anything", "RMQ_SYS_TRANS_HALF_TOPIC",
                 "RMQ_SYS_TRANS_OP_HALF_TOPIC", "RMQ_SYS_TRACE_TOPIC", "RMQ_SYS_OTHER", "TRANS_CHECK_MAX_TIME_TOPIC",
                 "TBW102", "SELF_TEST_TOPIC", "OFFSET_MOVED_EVENT", "BenchmarkTest", "CHECKPOINT_TOPIC")


def test_sending_to_a_system_topic_is_illegal_topic(server):
    for topic in (*SYSTEM_TOPICS, "%RETRY%Shared", "%DLQ%Stuck", "%DLQ%Nobody"):
        reply = send(server, topic, b"sneaky")
        assert reply.status.code == pb.Code.ILLEGAL_TOPIC, (topic, reply.status)
    for topic in SYSTEM_TOPICS:  # as the proxy: no route to one either, and no publishing settings naming one
        route = server.call("QueryRoute", pb.QueryRouteRequest(topic=pb.Resource(name=topic)), pb.QueryRouteResponse)
        assert route.status.code == pb.Code.ILLEGAL_TOPIC, topic
        code, _ = receive(server, "Sys", topic)
        assert code == pb.Code.ILLEGAL_TOPIC, topic
        settings = pb.Settings(client_type=pb.ClientType.PRODUCER,
                               publishing=pb.Publishing(topics=[pb.Resource(name="Shared"), pb.Resource(name=topic)]))
        assert [r.status.code for r in telemetry(server, pb.TelemetryCommand(settings=settings))] == \
               [pb.Code.ILLEGAL_TOPIC], topic
    dlq = server.call("QueryRoute", pb.QueryRouteRequest(topic=pb.Resource(name="%DLQ%Stuck")), pb.QueryRouteResponse)
    assert dlq.status.code == pb.Code.OK  # a group's dead letters can be consumed, only not sent to
    with MessageStore.open(server.root, CONFIG, read_only=True) as store:
        assert not any(m.body == b"sneaky" for m in store.iter_messages())
        assert not {"%RETRY%Shared", "%DLQ%Nobody", "rmq_sys_anything", "TBW102"} & set(store.topic_config.topics)


# --- 6. a refused send creates no topic ----------------------------------------------------------------------

def test_a_refused_send_does_not_create_its_topic(server):
    refused = {
        "NewTooBig": (send(server, "NewTooBig", b"x" * (4 * 1024 * 1024 + 1)), pb.Code.MESSAGE_BODY_TOO_LARGE),
        "NewReserved": (send(server, "NewReserved", b"x", UNIQ_KEY="mine"), pb.Code.ILLEGAL_MESSAGE_PROPERTY_KEY),
        "NewEmpty": (send(server, "NewEmpty", b""), pb.Code.MESSAGE_BODY_EMPTY),
        # refused by the store's encoder, after the service's own checks passed
        "NewHugeProps": (send(server, "NewHugeProps", b"x", big="v" * 40_000), pb.Code.MESSAGE_PROPERTIES_TOO_LARGE),
        "NewBadProp": (send(server, "NewBadProp", b"x", **{"bad\u0001name": "v"}),
                       pb.Code.ILLEGAL_MESSAGE_PROPERTY_KEY),
    }
    for topic, (reply, expected) in refused.items():
        assert reply.status.code == expected, (topic, reply.status)
    batch = pb.SendMessageRequest()  # a good message and a bad one: all or nothing, no topic either
    for topic, body in (("NewBatchA", b"fine"), ("NewBatchA", b"")):
        msg = batch.messages.add()
        msg.topic.name, msg.body, msg.system_properties.message_id = topic, body, "01AB"
    assert server.call("SendMessage", batch, pb.SendMessageResponse).status.code == pb.Code.MESSAGE_BODY_EMPTY
    assert send(server, "NewGood", b"fine").status.code == pb.Code.OK
    with MessageStore.open(server.root, CONFIG, read_only=True) as store:
        topics = set(store.topic_config.topics)
        good = store.topic_config.get("NewGood")
    assert good is not None and good.write_queue_nums == 8  # an accepted send still creates its topic
    assert not topics & {*refused, "NewBatchA", "NewBatchB"}, topics & {*refused, "NewBatchA", "NewBatchB"}


# --- 5. pull-style calls -------------------------------------------------------------------------------------

def pull_calls(topic: str, queue_id: int, offset: int = 0) -> dict[str, tuple]:
    queue = pb.MessageQueue(topic=pb.Resource(name=topic), id=queue_id)
    group = pb.Resource(name="Puller")
    return {
        "QueryOffset": (pb.QueryOffsetRequest(message_queue=queue, query_offset_policy=pb.QueryOffsetPolicy.END),
                        pb.QueryOffsetResponse, False),
        "GetOffset": (pb.GetOffsetRequest(group=group, message_queue=queue), pb.GetOffsetResponse, False),
        "UpdateOffset": (pb.UpdateOffsetRequest(group=group, message_queue=queue, offset=offset),
                         pb.UpdateOffsetResponse, False),
        "PullMessage": (pb.PullMessageRequest(group=group, message_queue=queue, offset=offset, batch_size=4),
                        pb.PullMessageResponse, True),
    }


def code_of(server: Served, method: str, request, response, stream: bool) -> int:
    reply = server.call(method, request, response, stream=stream)
    return (reply[0] if stream else reply).status.code


def test_pull_calls_check_the_topic_the_queue_and_the_offset(server):
    for method, call in pull_calls("NoSuchTopic", 0).items():
        assert code_of(server, method, *call) == pb.Code.TOPIC_NOT_FOUND, method
    for queue_id in (-1, 4, 99, 2**31 - 1):  # Shared has 4 queues
        for method, call in pull_calls("Shared", queue_id).items():
            assert code_of(server, method, *call) == pb.Code.BAD_REQUEST, (method, queue_id)
    assert send(server, "Shared", b"p0", b"p1", group="pull").status.code == pb.Code.OK  # one queue, by group
    ends = {}
    deadline = time.monotonic() + 10
    while sum(ends.values()) < 2 and time.monotonic() < deadline:  # dispatch is asynchronous
        ends = {q: server.call("QueryOffset", *pull_calls("Shared", q)["QueryOffset"][:2]).offset for q in range(4)}
    queue_id, end = max(ends.items(), key=lambda item: item[1])
    assert end >= 2
    for offset in (-1, end + 1, 2**62):
        assert code_of(server, "UpdateOffset", *pull_calls("Shared", queue_id, offset)["UpdateOffset"]) == \
               pb.Code.ILLEGAL_OFFSET, offset
    assert code_of(server, "PullMessage", *pull_calls("Shared", queue_id, -1)["PullMessage"]) == pb.Code.ILLEGAL_OFFSET
    assert code_of(server, "UpdateOffset", *pull_calls("Shared", queue_id, end)["UpdateOffset"]) == pb.Code.OK
    got = server.call("GetOffset", *pull_calls("Shared", queue_id)["GetOffset"][:2])
    assert got.status.code == pb.Code.OK and got.offset == end
    pulled = server.call("PullMessage", *pull_calls("Shared", queue_id, end - 2)["PullMessage"][:2], stream=True)
    assert [r.message.body for r in pulled if r.HasField("message")] == [b"p0", b"p1"]
    with MessageStore.open(server.root, CONFIG, read_only=True) as store:
        assert store.topic_config.get("NoSuchTopic") is None
        assert store.query_offset("Puller", "NoSuchTopic", 0) == -1 and store.query_offset("Puller", "Shared", 99) == -1


# --- 7. queue permissions in routes ----------------------------------------------------------------------------

def route(server: Served, topic: str, **request):
    return server.call("QueryRoute", pb.QueryRouteRequest(topic=pb.Resource(name=topic), **request),
                       pb.QueryRouteResponse)


def test_routes_advertise_each_queues_real_permission(server):
    P = pb.Permission
    expected = {"Shared": [P.READ_WRITE] * 4, "ReadOnly": [P.READ] * 4, "WriteOnly": [P.WRITE] * 4,
                "MoreRead": [P.READ_WRITE] * 2 + [P.READ] * 2, "MoreWrite": [P.READ_WRITE] * 2 + [P.WRITE] * 2,
                "Sealed": [P.NONE] * 2}
    for topic, permissions in expected.items():
        reply = route(server, topic)
        assert reply.status.code == pb.Code.OK
        assert [(q.id, q.permission) for q in reply.message_queues] == list(enumerate(permissions)), topic
    # and the calls follow the perm: no send to a topic that is not writable, no consuming one that is not readable
    assert send(server, "ReadOnly", b"x").status.code == pb.Code.FORBIDDEN
    assert receive(server, "Perm", "WriteOnly")[0] == pb.Code.FORBIDDEN
    pull = pb.PullMessageRequest(group=pb.Resource(name="Perm"), offset=0,
                                 message_queue=pb.MessageQueue(topic=pb.Resource(name="Sealed"), id=0))
    assert server.call("PullMessage", pull, pb.PullMessageResponse, stream=True)[0].status.code == pb.Code.FORBIDDEN
    for topic, code, permission in (("WriteOnly", pb.Code.FORBIDDEN, None), ("ReadOnly", pb.Code.OK, P.READ),
                                    ("Shared", pb.Code.OK, P.READ_WRITE)):
        assignment = server.call("QueryAssignment", pb.QueryAssignmentRequest(
            topic=pb.Resource(name=topic), group=pb.Resource(name="Perm")), pb.QueryAssignmentResponse)
        assert assignment.status.code == code, topic
        if permission is not None:
            assert [a.message_queue.permission for a in assignment.assignments] == [permission], topic


# --- 8. the address routes advertise ----------------------------------------------------------------------------

def addresses(endpoints) -> list[tuple[int, str, int]]:
    return [(endpoints.scheme, a.host, a.port) for a in endpoints.addresses]


def assignment_endpoints(server: Served, address: str | None = None, **request):
    reply = server.call("QueryAssignment", pb.QueryAssignmentRequest(
        topic=pb.Resource(name="Shared"), group=pb.Resource(name="Where"), **request), pb.QueryAssignmentResponse,
        address=address)
    assert reply.status.code == pb.Code.OK
    return [a.message_queue.broker.endpoints for a in reply.assignments]


def test_routes_advertise_the_address_the_server_listens_on(server):
    listening = [(pb.AddressScheme.IPv4, "127.0.0.1", server.port)]
    elsewhere = pb.Endpoints(scheme=pb.AddressScheme.IPv4, addresses=[pb.Address(host="10.9.9.9", port=1)])
    for request in ({}, {"endpoints": elsewhere}):
        reply = route(server, "Shared", **request)
        assert {tuple(addresses(q.broker.endpoints)) for q in reply.message_queues} == {tuple(listening)}, request
        assert [addresses(e) for e in assignment_endpoints(server, **request)] == [listening], request


def test_a_wildcard_server_advertises_the_address_each_client_connected_to(tmp_path):
    served = Served(tmp_path / "store", listen="0.0.0.0:0")
    try:
        assert served.address == f"0.0.0.0:{served.port}"
        for host in ("127.0.0.1", "127.0.0.3", "localhost"):
            address = f"{host}:{served.port}"
            used = pb.Endpoints(scheme=pb.AddressScheme.DOMAIN_NAME if host == "localhost" else pb.AddressScheme.IPv4,
                                addresses=[pb.Address(host=host, port=served.port)])
            reply = served.call("QueryRoute", pb.QueryRouteRequest(topic=pb.Resource(name="Shared"), endpoints=used),
                                pb.QueryRouteResponse, address=address)  # the clients send what they connected to
            assert reply.status.code == pb.Code.OK
            assert {tuple(addresses(q.broker.endpoints)) for q in reply.message_queues} == {tuple(addresses(used))}
            assert [addresses(e) for e in assignment_endpoints(served, address, endpoints=used)] == [addresses(used)]
        # no endpoints: this host's address on the way to the client (grpc's asyncio server does not tell the
        # :authority), with the server's port, not the client's
        reply = served.call("QueryRoute", pb.QueryRouteRequest(topic=pb.Resource(name="Shared")), pb.QueryRouteResponse,
                            address=f"127.0.0.1:{served.port}")
        assert addresses(reply.message_queues[0].broker.endpoints) == [(pb.AddressScheme.IPv4, "127.0.0.1",
                                                                         served.port)]
        assert served.stop() == 0
    finally:
        if served.proc.poll() is None:
            served.proc.kill()
            served.proc.wait(30)


# --- 9. receives rotate over the queues --------------------------------------------------------------------------

def test_one_busy_queue_does_not_starve_the_others(server):
    """64 messages in queue 0 of Busy (a receive that starts there fills its batch of 8 from it), one in each other
    queue: four receives must reach all four queues."""
    groups: dict[int, str] = {}
    n = 0
    while len(groups) < 4:  # a message group per queue (SendMessage picks the queue by its hash, as RocketMQ)
        groups.setdefault((java_string_hash(f"mg{n}") & 0x7FFFFFFF) % 4, f"mg{n}")
        n += 1
    for queue_id in range(4):
        assert send(server, "Busy", *[f"q{queue_id}-{i}".encode() for i in range(64 if queue_id == 0 else 1)],
                    group=groups[queue_id]).status.code == pb.Code.OK
    deadline = time.monotonic() + 10
    while sum(server.call("QueryOffset", *pull_calls("Busy", q)["QueryOffset"][:2]).offset for q in range(4)) < 67:
        assert time.monotonic() < deadline, "not dispatched"
        time.sleep(0.02)
    seen: set[int] = set()
    for _ in range(4):
        code, got = receive(server, "Rotor", "Busy", batch=8)
        assert code == pb.Code.OK and len(got) == 8
        seen |= {m.system_properties.queue_id for m in got}
    assert seen == {0, 1, 2, 3}


# --- 10. a thousand open calls ----------------------------------------------------------------------------------

def process_threads_and_cpu(pid: int) -> tuple[int, float]:
    """(threads, CPU seconds so far) of a process, from /proc."""
    status = Path(f"/proc/{pid}/status").read_text()
    threads = int(re.search(r"^Threads:\s+(\d+)", status, re.M).group(1))
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return threads, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="counts the server's threads in /proc")
def test_a_thousand_long_polls_stay_open_and_more_are_refused_at_once(server):
    """1,000 receives long-polling an empty topic at once: sends and acks still answer at once, the server runs a
    few dozen threads, not a thousand, and sits idle; calls past its limit (1,024 open calls) are refused at once
    with RESOURCE_EXHAUSTED, not queued. Every one of the thousand ends with its poll: MESSAGE_NOT_FOUND."""
    poll_s = 4

    def poll(channel, group: str):
        request = pb.ReceiveMessageRequest(group=pb.Resource(name=group), batch_size=1,
                                           message_queue=pb.MessageQueue(topic=pb.Resource(name="Idle"), id=-1))
        request.invisible_duration.FromSeconds(30)
        request.long_polling_timeout.FromSeconds(poll_s)
        rpc = channel.unary_stream(f"/{SERVICE}/ReceiveMessage", request_serializer=pb.ReceiveMessageRequest.
                                   SerializeToString, response_deserializer=pb.ReceiveMessageResponse.FromString)
        return rpc(request, timeout=poll_s + 10)

    async def outcome(call) -> tuple[str, float]:
        began = time.monotonic()
        try:
            replies = [r async for r in call]
            return pb.Code.Name(replies[0].status.code), time.monotonic() - began
        except grpc.aio.AioRpcError as exc:
            return exc.code().name, time.monotonic() - began

    async def main() -> dict:
        report: dict = {}
        async with grpc.aio.insecure_channel(server.address) as channel:
            held = [asyncio.ensure_future(outcome(poll(channel, f"Idle{i % 20}"))) for i in range(1000)]
            await asyncio.sleep(1.5)  # all open on the server by now
            threads, cpu = process_threads_and_cpu(server.proc.pid)
            began = time.monotonic()
            report["send"] = (await asyncio.to_thread(send, server, "Shared", b"among the polls")).status.code
            report["send_s"] = time.monotonic() - began
            await asyncio.sleep(1)
            report["threads"], cpu_after = process_threads_and_cpu(server.proc.pid)
            report["idle_cpu"] = (cpu_after - cpu) / (time.monotonic() - began)  # of one core
            report["threads"] = max(report["threads"], threads)
            extra = await asyncio.gather(*(outcome(poll(channel, "Extra")) for _ in range(100)))
            report["extra"] = extra
            report["held"] = await asyncio.gather(*held)
        return report

    report = asyncio.run(main())
    assert report["send"] == pb.Code.OK and report["send_s"] < 1.0, report["send_s"]
    assert report["threads"] < 100, report["threads"]
    assert report["idle_cpu"] < 0.5, report["idle_cpu"]
    refused = [took for code, took in report["extra"] if code == "RESOURCE_EXHAUSTED"]
    assert len(refused) >= 70 and max(refused) < 1.0, report["extra"]
    assert all(code in ("MESSAGE_NOT_FOUND", "RESOURCE_EXHAUSTED") for code, _ in report["extra"])
    assert {code for code, _ in report["held"]} == {"MESSAGE_NOT_FOUND"}
    assert all(poll_s - 1 < took < poll_s + 3 for _, took in report["held"])
    print(f"1000 long polls open: {report['threads']} server threads, {report['idle_cpu']:.0%} of a core idle; "
          f"send among them {report['send_s'] * 1000:.0f} ms; {len(refused)} of 100 more refused in "
          f"<= {max(refused) * 1000:.0f} ms")


# --- 11. SIGTERM ---------------------------------------------------------------------------------------------

def test_sigterm_finishes_running_calls_then_closes_the_store_cleanly(tmp_path):
    """SIGTERM while a long poll is open and four producers are sending: the poll is answered, the process exits 0
    with the store closed cleanly (no abort file, checkpoint written), and every send that was acknowledged is in
    the store when it is opened again."""
    root = tmp_path / "store"
    served = Served(root)
    acked: list[str] = []
    failed: list[str] = []
    polled: list[object] = []
    stop_sending = threading.Event()

    def long_poll() -> None:
        try:
            code, _got = receive(served, "Waiter", "Quiet", poll_s=20)
            polled.append(code)
        except grpc.RpcError as exc:
            polled.append(exc.code())

    def producer(n: int) -> None:
        with grpc.insecure_channel(served.address) as channel:
            rpc = channel.unary_unary(f"/{SERVICE}/SendMessage", request_serializer=pb.SendMessageRequest.
                                      SerializeToString, response_deserializer=pb.SendMessageResponse.FromString)
            i = 0
            while not stop_sending.is_set():
                message_id = f"01{n:02X}{i:026X}"
                request = pb.SendMessageRequest(messages=[pb.Message(
                    topic=pb.Resource(name="Term"), body=b"x" * 200,
                    system_properties=pb.SystemProperties(message_id=message_id))])
                try:
                    ok = rpc(request, timeout=10).status.code == pb.Code.OK
                except grpc.RpcError:
                    ok = False
                (acked if ok else failed).append(message_id)
                if not ok:
                    return  # the server is going away
                i += 1

    assert send(served, "Term", b"first").status.code == pb.Code.OK
    assert route(served, "Quiet").status.code == pb.Code.OK  # created, empty: the poll waits there
    poller = threading.Thread(target=long_poll)
    poller.start()
    producers = [threading.Thread(target=producer, args=(n,)) for n in range(4)]
    for thread in producers:
        thread.start()
    time.sleep(1.5)  # the poll is waiting, the sends are flowing
    sent_before = len(acked)
    signalled = time.time()
    os.kill(served.proc.pid, signal.SIGTERM)
    try:
        code = served.proc.wait(20)
    finally:
        stop_sending.set()
        for thread in (poller, *producers):
            thread.join(20)
    took = time.time() - signalled
    log = "".join(served.lines)
    assert code == 0, log
    assert took < 10, took
    assert sent_before > 20 and len(acked) >= sent_before
    assert polled == [pb.Code.MESSAGE_NOT_FOUND], polled  # answered, not cut off
    assert "Traceback" not in log and "stopped, store closed" in log, log
    assert not (root / "abort").exists(), "the store was not closed cleanly"
    assert (root / "checkpoint").stat().st_mtime >= signalled - 0.01
    with MessageStore.open(root, CONFIG) as store:  # opened again: every acknowledged send is there
        store.wait_for_dispatch()
        stored = {m.uniq_key for m in store.iter_messages() if m.topic == "Term"}
        assert set(acked) <= stored, f"{len(set(acked) - stored)} acknowledged sends lost"
        queued = sum(store.get_max_offset_in_queue("Term", q) for q in store.queue_ids("Term"))
        assert queued >= len(acked) + 1  # and dispatched to their queues
    print(f"SIGTERM after {len(acked)} acknowledged sends ({len(failed)} refused while stopping): exit 0 in "
          f"{took:.2f} s")


# --- 12. receives that end while they look or wait ------------------------------------------------------------

@contextlib.contextmanager
def in_process_server(tmp_path: Path, *topics: tuple[str, int], **options):
    """A ``Server`` in this process over a new store with ``topics`` (name, queues): (server, store), stopped after."""
    from rocketstore.server import Server

    store = MessageStore.open(tmp_path / "store", CONFIG)
    try:
        for name, queues in topics:
            store.create_topic(name, queues)
        server = Server(store, "127.0.0.1:0", **options).start()
        try:
            yield server, store
        finally:
            server.stop()
    finally:
        store.close()


class SlowedReads:
    """Every store read takes ``seconds`` longer while ``slow`` is set (a cold disk): a receive stays in its look
    that long, where a client can cancel it. ``idle()``: no read is running."""

    def __init__(self, monkeypatch, store: MessageStore, seconds: float) -> None:
        self.slow = threading.Event()
        self.slow.set()
        self.running = 0
        self._lock = threading.Lock()
        real = store.get_message

        def get_message(*args, **kwargs):
            with self._lock:
                self.running += 1
            try:
                if self.slow.is_set():
                    time.sleep(seconds)
                return real(*args, **kwargs)
            finally:
                with self._lock:
                    self.running -= 1

        monkeypatch.setattr(store, "get_message", get_message)

    def idle(self) -> bool:
        return self.running == 0


def receive_call(channel, group: str, topic: str, *, batch: int = 32, invisible_ms: int = 30_000, poll_s: float = 10):
    """A ReceiveMessage call started on ``channel``: iterate it for the replies, or cancel it."""
    request = pb.ReceiveMessageRequest(group=pb.Resource(name=group), batch_size=batch,
                                       message_queue=pb.MessageQueue(topic=pb.Resource(name=topic), id=-1))
    request.invisible_duration.FromMilliseconds(invisible_ms)
    request.long_polling_timeout.FromMilliseconds(int(poll_s * 1000))
    rpc = channel.unary_stream(f"/{SERVICE}/ReceiveMessage", request_serializer=pb.ReceiveMessageRequest.
                               SerializeToString, response_deserializer=pb.ReceiveMessageResponse.FromString)
    return rpc(request, timeout=poll_s + 10)


def messages_of(call) -> list:
    return [r.message for r in call if r.HasField("message")]


def wait_until(condition, timeout: float = 5, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_receive_cancelled_mid_read_leaves_the_long_poll_line(tmp_path, monkeypatch):
    """Receives cancelled by their clients while they read the store: their tickets leave the line (and the topic is
    no longer watched), so the next message wakes the live waiter at once, not at its 5 s recheck."""
    with in_process_server(tmp_path, ("T", 1)) as (server, store), grpc.insecure_channel(server.address) as channel:
        polls = server.service.long_polls
        reads = SlowedReads(monkeypatch, store, 0.3)
        for _ in range(3):
            call = receive_call(channel, "G", "T")
            time.sleep(0.1)  # in its read
            call.cancel()
            wait_until(reads.idle, what="the cancelled receive's read done")
        reads.slow.clear()
        got: list = []
        waiter = threading.Thread(target=lambda: got.extend(messages_of(receive_call(channel, "G", "T"))))
        waiter.start()
        wait_until(lambda: polls._waiting, what="the live receive waits")
        time.sleep(0.1)
        sent = time.monotonic()
        assert send_in_process(channel, "T", b"wake the live one").status.code == pb.Code.OK
        waiter.join(10)
        took = time.monotonic() - sent
        assert [m.body for m in got] == [b"wake the live one"]
        assert took < 1.5, f"the live receive got the message {took:.2f} s after it was sent"
        wait_until(lambda: not polls._waiting and not polls._ends, what="lines and topics dropped")


def send_in_process(channel, topic: str, *bodies: bytes, group: str | None = None):
    request = pb.SendMessageRequest()
    for i, body in enumerate(bodies):
        msg = request.messages.add()
        msg.topic.name = topic
        msg.body = body
        msg.system_properties.message_id = f"01{time.monotonic_ns():020X}{i:04X}"
        if group is not None:
            msg.system_properties.message_group = group
    rpc = channel.unary_unary(f"/{SERVICE}/SendMessage", request_serializer=pb.SendMessageRequest.SerializeToString,
                              response_deserializer=pb.SendMessageResponse.FromString)
    return rpc(request, timeout=10)


def test_a_wake_up_of_a_receive_cancelled_while_it_waits_goes_to_the_next_one():
    """One message, two waiting receives: the oldest is woken, and cancelled before it looks; the other gets the
    wake-up (it would else sleep through the message until its recheck)."""
    from rocketstore.server.longpoll import LongPolls

    polls = LongPolls(SimpleNamespace(topic_config={}, dispatcher=None))  # no watcher: wake() by hand

    async def main() -> tuple[bool, float]:
        first, second = polls.watch("T", "G"), polls.watch("T", "G")
        waits = [asyncio.ensure_future(polls.wait(ticket, 3)) for ticket in (first, second)]
        await asyncio.sleep(0.01)
        polls.wake("T", "G")  # one message: the oldest receive is woken...
        waits[0].cancel()  # ...and its client goes away before it looks
        began = time.monotonic()
        woken = await waits[1]
        took = time.monotonic() - began
        with pytest.raises(asyncio.CancelledError):
            await waits[0]
        return woken, took

    woken, took = asyncio.run(main())
    assert woken and took < 1, (woken, took)
    assert polls._waiting == {} and polls._ends == {}


def test_a_receive_cancelled_mid_read_hands_back_what_it_took(tmp_path, monkeypatch):
    """A receive cancelled while it reads the store: the messages its read took are visible again at once (not after
    their 30 s invisible time), as the same delivery attempt; a FIFO group's message comes back before the next one
    of its group."""
    with in_process_server(tmp_path, ("T", 1), ("F", 1)) as (server, store), \
            grpc.insecure_channel(server.address) as channel:
        store.subscription_groups.set_orderly("Fifo", True)
        assert send_in_process(channel, "T", b"taken by a gone receive").status.code == pb.Code.OK
        assert send_in_process(channel, "F", b"f1", b"f2", group="mg").status.code == pb.Code.OK
        store.wait_for_dispatch()
        reads = SlowedReads(monkeypatch, store, 0.3)
        for group, topic in (("G", "T"), ("Fifo", "F")):
            call = receive_call(channel, group, topic)
            time.sleep(0.1)  # in its read
            call.cancel()
        wait_until(reads.idle, what="the cancelled receives' reads done")
        reads.slow.clear()
        began = time.monotonic()
        got = messages_of(receive_call(channel, "G", "T", poll_s=2))
        assert [(m.body, m.system_properties.delivery_attempt) for m in got] == [(b"taken by a gone receive", 1)]
        fifo = messages_of(receive_call(channel, "Fifo", "F", poll_s=2))
        assert [(m.body, m.system_properties.delivery_attempt) for m in fifo] == [(b"f1", 1)]
        assert time.monotonic() - began < 1, "the messages came back at once"


def test_a_receive_cancelled_mid_reply_hands_back_what_it_did_not_write(tmp_path, monkeypatch):
    """A receive whose client stops reading and cancels while the reply is written (8 messages of 3 MB: grpc's flow
    control holds the writes): what was not written is visible again at once."""
    from rocketstore.server import pop

    monkeypatch.setattr(pop, "MAX_BATCH_BYTES", 64 << 20)  # a receive takes all 8
    with in_process_server(tmp_path, ("T", 1)) as (server, store), grpc.insecure_channel(server.address) as channel:
        bodies = [bytes([65 + i]) * (3 << 20) for i in range(8)]
        for body in bodies:
            assert send_in_process(channel, "T", body).status.code == pb.Code.OK
        store.wait_for_dispatch()
        call = receive_call(channel, "G", "T")  # not read
        time.sleep(0.5)  # taken, part written
        call.cancel()
        got = messages_of(receive_call(channel, "G", "T", poll_s=2))
        assert len(got) >= 4, f"{len(got)} of 8 messages came back"
        assert [m.body for m in got] == bodies[-len(got):]  # the last ones: those not written
        assert {m.system_properties.delivery_attempt for m in got} == {1}


def test_a_slow_read_of_one_queue_holds_up_neither_the_event_loop_nor_other_groups(tmp_path, monkeypatch):
    """Group Heavy keeps reading topic Big, whose reads take 0.3 s (a cold disk). Meanwhile 20 receives of other
    groups start long polls on the empty topic Idle, and a receive and an ack of another group run: the event loop
    (every long poll, telemetry stream and grpc's own I/O) never stalls behind that read, nor do the other
    groups."""
    with in_process_server(tmp_path, ("Big", 1), ("Idle", 1), ("Small", 1)) as (server, store), \
            grpc.insecure_channel(server.address) as channel:
        assert send_in_process(channel, "Big", *[b"big"] * 8).status.code == pb.Code.OK
        assert send_in_process(channel, "Small", b"one").status.code == pb.Code.OK
        store.wait_for_dispatch()
        taken = messages_of(receive_call(channel, "Other", "Small", poll_s=0))
        assert len(taken) == 1
        real = store.get_message

        def get_message(topic, *args, **kwargs):
            if topic == "Big":
                time.sleep(0.3)
            return real(topic, *args, **kwargs)

        monkeypatch.setattr(store, "get_message", get_message)
        lags: list[float] = []

        async def probe() -> None:
            while True:
                began = time.monotonic()
                await asyncio.sleep(0.005)
                lags.append(time.monotonic() - began - 0.005)

        probing = asyncio.run_coroutine_threadsafe(probe(), server._loop)
        probed = time.monotonic()
        stop = threading.Event()

        def heavy() -> None:
            while not stop.is_set():
                messages_of(receive_call(channel, "Heavy", "Big", batch=1, poll_s=0))

        heavies = [threading.Thread(target=heavy) for _ in range(2)]
        for thread in heavies:
            thread.start()
        try:
            time.sleep(0.2)  # a Heavy read is running
            polls = [receive_call(channel, f"Idle{i}", "Idle", poll_s=1) for i in range(20)]
            time.sleep(0.1)
            began = time.monotonic()
            assert receive_call(channel, "Other", "Idle", poll_s=0).next().status.code == pb.Code.MESSAGE_NOT_FOUND
            other_receive = time.monotonic() - began
            began = time.monotonic()
            acked = ack_in_process(channel, "Other", "Small", taken[0].system_properties.receipt_handle)
            other_ack = time.monotonic() - began
            assert acked.status.code == pb.Code.OK
            for call in polls:
                assert call.next().status.code == pb.Code.MESSAGE_NOT_FOUND
        finally:
            stop.set()
            for thread in heavies:
                thread.join(10)
            probing.cancel()
        window = time.monotonic() - probed
        # A read on the loop would stall it 0.3 s each time, over and over; a busy 2-core machine (the other test
        # worker, grpc's threads, the GIL) can stall it a few hundred ms once, but not most of the time.
        assert max(lags) < 0.28, f"the event loop stalled {max(lags) * 1000:.0f} ms: a 0.3 s read ran on it"
        assert sum(lags) < 0.5 * window, f"the event loop was stalled {sum(lags):.2f} s of {window:.2f} s"
        assert other_receive < 0.25 and other_ack < 0.25, (other_receive, other_ack)


def ack_in_process(channel, group: str, topic: str, *handles: str):
    request = pb.AckMessageRequest(group=pb.Resource(name=group), topic=pb.Resource(name=topic),
                                   entries=[pb.AckMessageEntry(message_id="01AB", receipt_handle=h) for h in handles])
    rpc = channel.unary_unary(f"/{SERVICE}/AckMessage", request_serializer=pb.AckMessageRequest.SerializeToString,
                              response_deserializer=pb.AckMessageResponse.FromString)
    return rpc(request, timeout=10)


def change_in_process(channel, group: str, topic: str, handle: str, invisible_ms: int):
    request = pb.ChangeInvisibleDurationRequest(group=pb.Resource(name=group), topic=pb.Resource(name=topic),
                                                receipt_handle=handle, message_id="01AB")
    request.invisible_duration.FromMilliseconds(invisible_ms)
    rpc = channel.unary_unary(f"/{SERVICE}/ChangeInvisibleDuration", response_deserializer=pb.
                              ChangeInvisibleDurationResponse.FromString,
                              request_serializer=pb.ChangeInvisibleDurationRequest.SerializeToString)
    return rpc(request, timeout=10)


def test_a_waiting_receive_gets_a_message_once_visible_again_whenever_its_deadline_was_set(tmp_path):
    """Receives that started waiting before a message went into flight (or before its invisible time was
    shortened) get it as soon as it is visible again, not at their 5 s recheck."""
    with in_process_server(tmp_path, ("T", 1)) as (server, _store), grpc.insecure_channel(server.address) as channel:
        polls = server.service.long_polls
        returned: dict[str, tuple[float, list]] = {}

        def poll(name: str, invisible_ms: int) -> threading.Thread:
            def run() -> None:
                got = messages_of(receive_call(channel, "G", "T", invisible_ms=invisible_ms))
                returned[name] = (time.monotonic(), got)
            thread = threading.Thread(target=run)
            thread.start()
            return thread

        def waiting(count: int) -> bool:
            return sum(len(line) for lines in polls._waiting.values() for line in lines.values()) == count

        first = poll("first", 500)
        wait_until(lambda: waiting(1), what="first waits")
        second = poll("second", 30_000)
        wait_until(lambda: waiting(2), what="second waits")
        time.sleep(0.1)  # both looked: nothing in flight
        assert send_in_process(channel, "T", b"m").status.code == pb.Code.OK  # wakes the oldest: first takes it
        first.join(10)
        second.join(10)
        took_again = returned["second"][0] - returned["first"][0]
        assert [(m.body, m.system_properties.delivery_attempt) for m in returned["second"][1]] == [(b"m", 2)]
        assert took_again < 1.2, f"visible again after 0.5 s, received again after {took_again:.2f} s"

        third = poll("third", 30_000)
        wait_until(lambda: waiting(1), what="third waits")
        time.sleep(0.1)  # it looked: the message is in flight for 30 s more
        handle = returned["second"][1][0].system_properties.receipt_handle
        changed = time.monotonic()
        assert change_in_process(channel, "G", "T", handle, 200).status.code == pb.Code.OK
        third.join(10)
        took_again = returned["third"][0] - changed
        assert [(m.body, m.system_properties.delivery_attempt) for m in returned["third"][1]] == [(b"m", 3)]
        assert took_again < 1, f"visible again after 0.2 s, received again after {took_again:.2f} s"


def test_a_fifo_message_forwarded_to_the_dead_letter_queue_frees_its_group_for_a_waiting_receive(tmp_path):
    """ForwardMessageToDeadLetterQueue frees the message's group in a FIFO consumer group, as an ack does: a receive
    waiting for the group's next message gets it at once, not at its 5 s recheck."""
    with in_process_server(tmp_path, ("T", 1)) as (server, store), grpc.insecure_channel(server.address) as channel:
        store.subscription_groups.set_orderly("F", True)
        assert send_in_process(channel, "T", b"poison", b"next", group="mg").status.code == pb.Code.OK
        store.wait_for_dispatch()
        first = messages_of(receive_call(channel, "F", "T", batch=1, poll_s=0))
        assert [m.body for m in first] == [b"poison"]
        got: list = []
        waiter = threading.Thread(target=lambda: got.extend(messages_of(receive_call(channel, "F", "T"))))
        waiter.start()
        wait_until(lambda: server.service.long_polls._waiting, what="the receive waits")
        time.sleep(0.1)  # it looked: "next" is held behind "poison"
        forward = pb.ForwardMessageToDeadLetterQueueRequest(
            group=pb.Resource(name="F"), topic=pb.Resource(name="T"),
            receipt_handle=first[0].system_properties.receipt_handle, message_id="01AB")
        rpc = channel.unary_unary(f"/{SERVICE}/ForwardMessageToDeadLetterQueue",
                                  request_serializer=pb.ForwardMessageToDeadLetterQueueRequest.SerializeToString,
                                  response_deserializer=pb.ForwardMessageToDeadLetterQueueResponse.FromString)
        forwarded = time.monotonic()
        assert rpc(forward, timeout=10).status.code == pb.Code.OK
        waiter.join(10)
        took = time.monotonic() - forwarded
        assert [m.body for m in got] == [b"next"]
        assert took < 1, f"the group's next message came {took:.2f} s after the forward"


# --- 13. signals while serve starts --------------------------------------------------------------------------

def start_serve_and_signal(root: Path, *signals: int) -> tuple[int, str]:
    """Start ``rocketstore serve`` on a new store at ``root``, send ``signals`` the moment the store is open (the
    server being built and started), and return (exit code, stderr)."""
    with MessageStore.open(root, CONFIG) as store:
        store.create_topic("T", 1)
    proc = subprocess.Popen([sys.executable, "-m", "rocketstore.cli.app", "serve", "--store", str(root),
                             "--listen", "127.0.0.1:0", *SMALL], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not (root / "abort").exists():  # the store is open
            assert time.monotonic() < deadline and proc.poll() is None, "serve did not open its store"
            time.sleep(0.001)
        for sig in signals:
            os.kill(proc.pid, sig)
        code = proc.wait(30)
        return code, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_serve_starts_closes_the_store_cleanly(tmp_path, sig):
    root = tmp_path / "store"
    code, log = start_serve_and_signal(root, sig)
    assert code == 0, log
    assert "Traceback" not in log and "stopped, store closed" in log, log
    assert not (root / "abort").exists(), "the store was not closed cleanly"


def test_a_second_signal_exits_at_once(tmp_path):
    """SIGINT and SIGTERM at once (a stop that hangs, and an operator who wants out): the second exits at once,
    non-zero, saying so; the store is left as after a crash."""
    root = tmp_path / "store"
    code, log = start_serve_and_signal(root, signal.SIGTERM, signal.SIGINT)
    assert code in (128 + signal.SIGTERM, 128 + signal.SIGINT), (code, log)
    assert "again, exiting now without closing the store" in log, log



def test_waking_a_receive_or_a_telemetry_stream_as_the_server_loop_closes_is_quiet():
    """The server's loop closed between a waker's look at it and its call (a stop racing a wake-up from another
    thread): the wake-up is dropped, it does not raise in the thread that wakes."""
    from rocketstore.server.longpoll import LongPolls
    from rocketstore.server.service import TelemetryClient

    polls = LongPolls(SimpleNamespace(topic_config={}, dispatcher=None))

    async def open_both() -> tuple:
        return polls.watch("T", "G"), TelemetryClient("c", asyncio.get_running_loop())

    loop = asyncio.new_event_loop()
    ticket, client = loop.run_until_complete(open_both())
    loop.close()
    loop.is_closed = lambda: False  # it closed after the waker looked
    try:
        polls.wake("T", "G")
        client.send(None)
    finally:
        del loop.is_closed
    assert ticket.woken


def test_a_restart_keeps_what_consumers_hold_and_acknowledged(tmp_path):
    """A clean restart (and a crash after the state was saved) forgot the in-flight table: a message held for 300 s
    came back at once as a first delivery (a failing message never reached the DLQ; a FIFO group's message went to
    a second consumer while the first still processed it), and every message acknowledged above a held one of the
    same queue came back too (the committed offset stops below the held message). The state is saved at a stop."""
    root = tmp_path / "store"
    with MessageStore.open(root, CONFIG) as store:
        store.create_topic("Held", 1)
    server = Served(root)
    try:
        send(server, "Held", b"slow")
        [slow] = receive_until(server, "G", "Held", 1, invisible_s=1)
        time.sleep(1.2)
        [slow] = receive_until(server, "G", "Held", 1, invisible_s=300)  # its second delivery, held for 5 minutes
        assert slow.system_properties.delivery_attempt == 2
        send(server, "Held", *[b"m%d" % i for i in range(10)])
        rest = receive_until(server, "G", "Held", 10, invisible_s=300)
        assert ack(server, "G", "Held", *[m.system_properties.receipt_handle for m in rest]).status.code == pb.Code.OK
        assert server.stop() == 0
        server = Served(root)
        assert receive(server, "G", "Held", invisible_s=300, poll_s=2)[1] == []  # nothing back: held or acknowledged
        handle = slow.system_properties.receipt_handle  # a handle from before the restart is good
        shortened = change_invisible(server, "G", "Held", handle, 1)
        assert shortened.status.code == pb.Code.OK, shortened.status
        time.sleep(1.2)
        [third] = receive_until(server, "G", "Held", 1, invisible_s=300)
        assert third.body == b"slow" and third.system_properties.delivery_attempt == 3  # counted on
        assert ack(server, "G", "Held", third.system_properties.receipt_handle).status.code == pb.Code.OK
        assert server.stop() == 0
        with MessageStore.open(root, CONFIG, read_only=True) as store:
            assert store.query_offset("G", "Held", 0) == 11  # every message consumed, the offset committed
        # an offset reset while serve was down wins over the state it saved
        subprocess.run([sys.executable, "-m", "rocketstore.cli.app", "reset-offset", "--store", str(root), "-g", "G",
                        "-t", "Held", "-s", "earliest", "--max-hash-slot-num", "97", "--max-index-num", "400"],
                       check=True, capture_output=True, timeout=60)
        server = Served(root)
        again = receive_until(server, "G", "Held", 11, invisible_s=300)
        assert sorted(m.body for m in again) == sorted([b"slow", *(b"m%d" % i for i in range(10))])
        assert server.stop() == 0
    finally:
        if server.proc.poll() is None:
            server.kill()


def test_a_damaged_saved_consumer_state_is_ignored_with_a_word(tmp_path, caplog):
    from rocketstore.server.pop import PopGroups

    with MessageStore.open(tmp_path / "s", CONFIG) as store:
        store.put_message(Message("T", b"x", queue_id=0))
        store.wait_for_dispatch()
        path = tmp_path / "s" / "config" / "popState.json"
        for bad in ("{", '{"key": "zz"}', '{"version": 1, "key": "00", "delivery": 1, "queues": []}', "[]",
                    '{"version": 1, "key": "' + "00" * 32 + '", "delivery": 1, "queues": [{"group": "G"}]}',
                    '{"version": 1, "key": "' + "00" * 32 + '", "delivery": 1, "queues": [{"group": "G", "topic": "T", '
                    '"queueId": 0, "committed": 0, "next": 1000000000000, "done": [[0, 1000000000000]], "inflight": '
                    '[], "held": []}]}'):
            path.write_text(bad)
            caplog.clear()
            pop = PopGroups(store, state_path=path)
            if "1000000000000" in bad:  # wild numbers stop at the queue's end: x counts as consumed, no memory blowup
                assert pop.receive("G", "T", [0], 4, 30_000, None) == [] and store.query_offset("G", "T", 0) == 1
                continue
            assert "ignoring the saved consumer state" in caplog.text, bad
            assert [d.message.body for d in pop.receive("G", "T", [0], 4, 30_000, None)] == [b"x"]  # serves on


def test_a_handle_from_before_a_crash_never_acts_on_a_later_delivery(tmp_path):
    """The saved state restarted the delivery numbers where the save had left them, under the same key: numbers
    handed out after the last save came again after a kill, so a dead consumer's handle acked a message another
    consumer held (the new-code review). A save reserves the numbers after it."""
    from rocketstore.server.pop import InvalidReceiptHandleError, PopGroups

    with MessageStore.open(tmp_path / "s", CONFIG) as store:
        for body in (b"m0", b"m1"):
            store.put_message(Message("T", body, queue_id=0))
        store.wait_for_dispatch()
        path = tmp_path / "s" / "config" / "popState.json"
        pop = PopGroups(store, state_path=path)
        [first] = pop.receive("G", "T", [0], 1, 60_000, None)
        pop.ack("G", "T", first.receipt_handle)
        pop.save()
        [old] = pop.receive("G", "T", [0], 1, 60_000, None)  # after the save: lost with the "crash"
        again = PopGroups(store, state_path=path)  # the restart, from the last save
        [new] = again.receive("G", "T", [0], 1, 60_000, None)
        assert new.message.body == old.message.body == b"m1" and new.receipt_handle != old.receipt_handle
        renewed = again.change_invisible("G", "T", new.receipt_handle, 60_000)
        for stale in (old.receipt_handle, new.receipt_handle):
            with pytest.raises(InvalidReceiptHandleError):
                again.ack("G", "T", stale)
        again.ack("G", "T", renewed)


def test_an_ack_after_the_invisible_time_is_refused_and_the_message_comes_again(tmp_path, monkeypatch):
    """The proxy refuses an ack or invisible-time change once the handle's invisible time has passed
    (``validateReceiptHandle``). Accepting it let a slow consumer ack a message that was visible again and could
    already be in another consumer's hands (a later receive would have seen it gone)."""
    from rocketstore.server import pop as pop_module
    from rocketstore.server.pop import InvalidReceiptHandleError, PopGroups

    clock = [1_000_000]
    monkeypatch.setattr(pop_module, "_now_ms", lambda: clock[0])
    with MessageStore.open(tmp_path / "s", CONFIG) as store:
        for body in (b"m0", b"m1"):
            store.put_message(Message("T", body, queue_id=0))
        store.wait_for_dispatch()
        pop = PopGroups(store)
        first, second = pop.receive("G", "T", [0], 2, 10_000, None)
        clock[0] += 9_999
        pop.ack("G", "T", first.receipt_handle)  # a millisecond before: still its own
        clock[0] += 1
        with pytest.raises(InvalidReceiptHandleError, match="expired"):
            pop.ack("G", "T", second.receipt_handle)
        with pytest.raises(InvalidReceiptHandleError, match="expired"):
            pop.change_invisible("G", "T", second.receipt_handle, 60_000)
        [again] = pop.receive("G", "T", [0], 2, 10_000, None)
        assert (again.message.body, again.attempt) == (b"m1", 2)
        pop.ack("G", "T", again.receipt_handle)
        assert pop.in_flight() == 0


def test_the_saved_consumer_state_is_readable_by_its_owner_alone(tmp_path):
    """popState.json holds the key that signs receipt handles: anyone who reads it can forge acks. It is written
    0600, also over a temporary file a crash left with a wider mode."""
    from rocketstore.server.pop import PopGroups

    with MessageStore.open(tmp_path / "s", CONFIG) as store:
        store.put_message(Message("T", b"m0", queue_id=0))
        store.wait_for_dispatch()
        path = tmp_path / "s" / "config" / "popState.json"
        path.parent.mkdir(exist_ok=True)
        left = path.with_name(f".{path.name}.tmp")
        left.write_bytes(b"a crash's")
        left.chmod(0o644)
        pop = PopGroups(store, state_path=path)
        pop.receive("G", "T", [0], 1, 60_000, None)
        pop.save()
        assert path.stat().st_mode & 0o777 == 0o600
        assert not left.exists()


def pull_in_process(channel, topic: str, offset: int, batch: int) -> tuple[list, int]:
    """(messages, next offset) of one PullMessage of queue 0."""
    request = pb.PullMessageRequest(group=pb.Resource(name="Puller"), batch_size=batch, offset=offset,
                                    message_queue=pb.MessageQueue(topic=pb.Resource(name=topic), id=0))
    rpc = channel.unary_stream(f"/{SERVICE}/PullMessage", request_serializer=pb.PullMessageRequest.SerializeToString,
                               response_deserializer=pb.PullMessageResponse.FromString)
    replies = list(rpc(request, timeout=10))
    return [r.message for r in replies if r.HasField("message")], replies[-1].next_offset


def test_receives_and_pulls_hand_out_at_most_32_messages_and_256_kib(tmp_path):
    """RocketMQ's proxy takes at most 32 messages a receive, and its store stops a batch past 256 KiB (one message
    at least): a receive of 1,024 messages of 3.5 MB held 3.5 GB. What a receive leaves comes with the next ones,
    each message once."""
    with in_process_server(tmp_path, ("Small", 1), ("Big", 1)) as (server, store), \
            grpc.insecure_channel(server.address) as channel:
        assert send_in_process(channel, "Small", *[b"s%d" % i for i in range(40)]).status.code == pb.Code.OK
        big = [bytes([65 + i]) * (100 << 10) for i in range(5)] + [b"Z" * (300 << 10), b"tail"]
        for body in big:
            assert send_in_process(channel, "Big", body).status.code == pb.Code.OK
        store.wait_for_dispatch()
        first = messages_of(receive_call(channel, "G", "Small", batch=1000, poll_s=1))
        assert [m.body for m in first] == [b"s%d" % i for i in range(32)]
        assert [m.body for m in messages_of(receive_call(channel, "G", "Small", poll_s=1))] == \
               [b"s%d" % i for i in range(32, 40)]
        sizes = [[len(m.body) >> 10 for m in messages_of(receive_call(channel, "G", "Big", poll_s=1))]
                 for _ in range(5)]
        assert sizes == [[100, 100], [100, 100], [100], [300], [0]]  # the 300 KiB one alone: one at least
        got, next_offset = pull_in_process(channel, "Big", 0, 1000)
        assert [len(m.body) >> 10 for m in got] == [100, 100] and next_offset == 2
        got, next_offset = pull_in_process(channel, "Big", 5, 32)
        assert [m.body for m in got] == big[5:6] and next_offset == 6
        got, next_offset = pull_in_process(channel, "Big", 4, 32)
        assert [len(m.body) >> 10 for m in got] == [100] and next_offset == 5

"""``rocketstore serve`` with the official RocketMQ 5 Python client (rocketmq-python-client from PyPI).

Each test runs the real command in a subprocess on 127.0.0.1 with an ephemeral port, over a store in a
temporary directory, and stops it by its pid. Bad requests go through a raw gRPC channel (the client checks
some of them itself before sending), built from rocketstore's own protocol classes.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
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
    SimpleConsumer,
)

import serving  # noqa: E402
from rocketstore import MessageStore  # noqa: E402
from rocketstore.server.protocol import SERVICE, compile_descriptor_set, pb  # noqa: E402
from serving import CONFIG, SMALL  # noqa: E402


class Served(serving.Served):
    """A running `rocketstore serve`, with the official client's configuration for it."""

    def config(self) -> ClientConfiguration:
        return ClientConfiguration(self.address, Credentials(), request_timeout=5)


@pytest.fixture
def served(tmp_path):
    servers: list[Served] = []

    def start(*args: str, root: Path | None = None) -> Served:
        server = Served(root or tmp_path / "store", *args)
        servers.append(server)
        return server

    yield start
    for server in servers:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(30)


def message(topic: str, body: bytes, *, tag: str | None = "TagA", keys: str | None = None,
            group: str | None = None, **props: str) -> Message:
    msg = Message()
    msg.topic = topic
    msg.body = body
    if tag:
        msg.tag = tag
    if keys:
        msg.keys = keys
    if group:
        msg.message_group = group
    for name, value in props.items():
        msg.add_property(name, value)
    return msg


def send_all(server: Served, topic: str, messages: list[Message]) -> list:
    producer = Producer(server.config(), (topic,))
    producer.startup()
    try:
        return [producer.send(m) for m in messages]
    finally:
        producer.shutdown()


def receive_until(consumer: SimpleConsumer, count: int, invisible: int = 10, timeout: float = 20) -> list[Message]:
    got: list[Message] = []
    deadline = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        got += consumer.receive(32, invisible)
    return got


def test_producer_to_simple_consumer_round_trip_and_the_store_sees_it(served, tmp_path, request):
    spark = request.getfixturevalue("spark") if importlib.util.find_spec("pyspark") else None
    server = served()
    receipts = send_all(server, "Orders", [message("Orders", f"order {i}".encode(), keys=f"order-{i}",
                                                   tag="Paid" if i % 2 else "New", color="red", n=str(i))
                                           for i in range(6)])
    assert len({r.message_id for r in receipts}) == 6
    consumer = SimpleConsumer(server.config(), "Billing", {"Orders": FilterExpression("Paid")}, await_duration=1)
    consumer.startup()
    try:
        got = receive_until(consumer, 3)
        for m in got:
            consumer.ack(m)
        assert sorted(m.body for m in got) == [b"order 1", b"order 3", b"order 5"]  # the tag filter
        for m in got:
            n = int(m.properties["n"])
            assert m.tag == "Paid" and m.keys == {f"order-{n}"} and m.properties == {"color": "red", "n": str(n)}
            assert m.delivery_attempt == 1 and m.message_id == receipts[n].message_id
        assert consumer.receive(32, 10) == []  # acknowledged; the filtered-out ones are not delivered either
    finally:
        consumer.shutdown()
    assert server.stop() == 0
    assert any("connected" in line for line in server.lines)
    with MessageStore.open(tmp_path / "store", CONFIG, read_only=True) as store:
        found = store.query_message("Orders", "order-3")
        assert [m.body for m in found] == [b"order 3"] and found[0].uniq_key == receipts[3].message_id
        assert sum(store.query_offset("Billing", "Orders", q) for q in store.queue_ids("Orders")) == 6
    if spark is not None:  # and through Spark, as any broker store
        from rocketstore.spark.jobs import read_store

        rows = read_store(spark, tmp_path / "store").where("topic = 'Orders'").collect()
        by_key = {tuple(r["keys"]): r for r in rows}
        assert len(rows) == 6 and by_key[("order-3",)]["body"] == b"order 3"
        assert by_key[("order-3",)]["tags"] == "Paid" and by_key[("order-3",)]["properties"]["color"] == "red"


def test_redelivery_after_the_invisible_duration_counts_attempts(served):
    server = served()
    send_all(server, "Jobs", [message("Jobs", b"job")])
    consumer = SimpleConsumer(server.config(), "Workers", {"Jobs": FilterExpression()}, await_duration=1)
    consumer.startup()
    try:
        first = receive_until(consumer, 1, invisible=3)
        visible_again = time.monotonic() + 3
        assert [m.delivery_attempt for m in first] == [1]
        assert consumer.receive(32, 3) == []  # invisible for now (a 1 s long poll)
        time.sleep(max(0.0, visible_again - time.monotonic()) + 0.1)
        again = receive_until(consumer, 1, invisible=10)
        assert [(m.body, m.delivery_attempt) for m in again] == [(b"job", 2)]
        with pytest.raises(Exception, match=r"expired"):
            consumer.ack(first[0])  # the first delivery's handle is stale
        consumer.ack(again[0])
        time.sleep(0.2)
        assert consumer.receive(32, 1) == []
    finally:
        consumer.shutdown()


def test_dead_letter_queue_after_max_attempts(served, tmp_path):
    server = served("--max-attempts", "2")
    send_all(server, "Flaky", [message("Flaky", b"poison", keys="poison-1")])
    consumer = SimpleConsumer(server.config(), "G1", {"Flaky": FilterExpression()}, await_duration=1)
    consumer.startup()
    try:
        assert [m.delivery_attempt for m in receive_until(consumer, 1, invisible=1)] == [1]
        time.sleep(1.1)
        assert [m.delivery_attempt for m in receive_until(consumer, 1, invisible=1)] == [2]
        time.sleep(1.1)
        assert consumer.receive(32, 1) == []  # attempts used up: moved to %DLQ%G1
    finally:
        consumer.shutdown()
    assert server.stop() == 0
    with MessageStore.open(tmp_path / "store", CONFIG, read_only=True) as store:
        dead = store.get_message("%DLQ%G1", 0, 0).messages
        assert [(m.body, m.keys, m.properties["REAL_TOPIC"]) for m in dead] == [(b"poison", ["poison-1"], "Flaky")]
        assert store.query_offset("G1", "Flaky", store.queue_ids("Flaky")[0]) >= 0


def test_fifo_groups_keep_their_order(served):
    server = served()
    sent = [message("Fifo", f"{g}-{i}".encode(), group=f"g{g}") for i in range(8) for g in range(3)]
    send_all(server, "Fifo", sent)
    consumer = SimpleConsumer(server.config(), "F", {"Fifo": FilterExpression()}, await_duration=1)
    consumer.startup()
    try:
        got = receive_until(consumer, len(sent))
        for m in got:
            consumer.ack(m)
    finally:
        consumer.shutdown()
    for g in range(3):
        mine = [m for m in got if m.message_group == f"g{g}"]
        assert [m.body for m in mine] == [f"{g}-{i}".encode() for i in range(8)]


def test_fifo_consumer_groups_keep_one_message_in_flight_per_message_group(served, tmp_path):
    server = served("--fifo-group", "Ordered")
    sent = [message("Fifo", f"{g}-{i}".encode(), group=f"g{g}") for i in range(6) for g in range(3)]
    send_all(server, "Fifo", sent)
    consumers = [SimpleConsumer(server.config(), "Ordered", {"Fifo": FilterExpression()}, await_duration=1)
                 for _ in range(2)]
    lock = threading.Lock()
    in_flight: dict[str, bytes] = {}
    acking: dict[str, float] = {}  # when the ack of the group's message in flight was sent
    order: dict[str, list[bytes]] = {f"g{g}": [] for g in range(3)}
    problems: list[str] = []
    skipped_ack = []

    def consume(consumer: SimpleConsumer) -> None:
        deadline = time.monotonic() + 40
        while sum(map(len, order.values())) < len(sent) and time.monotonic() < deadline:
            batch = consumer.receive(8, 3)
            received = time.monotonic()
            for m in batch:
                with lock:
                    held = in_flight.get(m.message_group, m.body)
                    # only a redelivery may overlap; a message received while the ack of the one before it was
                    # on its way is in order (the other thread had not yet marked it done)
                    if held != m.body and not (m.message_group in acking and acking[m.message_group] <= received):
                        problems.append(f"{m.body} while {held} is in flight")
                    in_flight[m.message_group] = m.body
                    acking.pop(m.message_group, None)
                time.sleep(0.02)
                if m.body == b"1-2" and not skipped_ack:  # not acknowledged once: it comes back first
                    skipped_ack.append(m.delivery_attempt)
                    continue
                with lock:  # done before the ack goes: the group's next message may come at once after it
                    order[m.message_group].append(m.body)
                    acking[m.message_group] = time.monotonic()
                consumer.ack(m)
                with lock:
                    if in_flight.get(m.message_group) == m.body:
                        del in_flight[m.message_group]
                        acking.pop(m.message_group, None)

    for consumer in consumers:
        consumer.startup()
    try:
        threads = [threading.Thread(target=consume, args=(c,)) for c in consumers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for consumer in consumers:
            consumer.shutdown()
    assert problems == []
    for g in range(3):
        assert order[f"g{g}"] == [f"{g}-{i}".encode() for i in range(6)]
    assert skipped_ack == [1]
    assert server.stop() == 0
    groups = (tmp_path / "store" / "config" / "subscriptionGroup.json").read_text()
    assert '"consumeMessageOrderly":true' in groups.replace(" ", "")


def test_push_consumer_receives_and_acks(served):
    server = served()
    send_all(server, "Push", [message("Push", f"p{i}".encode()) for i in range(10)])
    seen: list[bytes] = []
    done = threading.Event()

    class Listener(MessageListener):
        def consume(self, msg):
            seen.append(msg.body)
            if len(seen) >= 10:
                done.set()
            return ConsumeResult.SUCCESS

    consumer = PushConsumer(server.config(), "P", Listener(), {"Push": FilterExpression()})
    consumer.startup()
    try:
        assert done.wait(30), seen
    finally:
        consumer.shutdown()
    assert sorted(seen) == sorted(f"p{i}".encode() for i in range(10))


def test_bad_requests_get_their_status_and_write_nothing(served, tmp_path):
    server = served("--no-auto-create-topics")
    route = server.call("QueryRoute", pb.QueryRouteRequest(topic=pb.Resource(name="Nope")), pb.QueryRouteResponse)
    assert route.status.code == pb.Code.TOPIC_NOT_FOUND

    def send(topic: str, body: bytes, **user: str):
        request = pb.SendMessageRequest()
        msg = request.messages.add()
        msg.topic.name = topic
        msg.body = body
        msg.user_properties.update(user)
        msg.system_properties.message_id = "01ABC"
        return server.call("SendMessage", request, pb.SendMessageResponse)

    assert send("Nope", b"x").status.code == pb.Code.TOPIC_NOT_FOUND
    assert send("bad/topic", b"x").status.code == pb.Code.ILLEGAL_TOPIC
    server.stop()

    server = served()  # auto-creation on
    assert send("Fine", b"x" * (4 * 1024 * 1024 + 1)).status.code == pb.Code.MESSAGE_BODY_TOO_LARGE
    assert send("Fine", b"x", UNIQ_KEY="mine").status.code == pb.Code.ILLEGAL_MESSAGE_PROPERTY_KEY
    assert send("Fine", b"").status.code == pb.Code.MESSAGE_BODY_EMPTY
    ack = pb.AckMessageRequest(group=pb.Resource(name="G"), topic=pb.Resource(name="Fine"),
                               entries=[pb.AckMessageEntry(message_id="01ABC", receipt_handle="0.0.1.deadbeef")])
    assert server.call("AckMessage", ack, pb.AckMessageResponse).status.code == pb.Code.INVALID_RECEIPT_HANDLE
    change = pb.ChangeInvisibleDurationRequest(group=pb.Resource(name="G"), topic=pb.Resource(name="Fine"),
                                               receipt_handle="garbage", message_id="01ABC")
    change.invisible_duration.FromSeconds(5)
    assert server.call("ChangeInvisibleDuration", change,
                       pb.ChangeInvisibleDurationResponse).status.code == pb.Code.INVALID_RECEIPT_HANDLE
    assert send("Fine", b"ok").status.code == pb.Code.OK
    assert server.stop() == 0
    with MessageStore.open(tmp_path / "store", CONFIG, read_only=True) as store:
        assert [m.body for m in store.iter_messages()] == [b"ok"]  # the refused sends wrote nothing


def test_kill_9_keeps_every_acknowledged_send_and_redelivers_unacked(served, tmp_path):
    """Under --sync-flush an ack answered OK is saved (``config/popState.json``) before the answer: after a kill
    the acknowledged messages stay consumed (all eight came back before: acks lived in memory until the next
    offsets flush), and the held ones come back once their invisible time is over, not at once."""
    server = served("--sync-flush")
    receipts = send_all(server, "Durable", [message("Durable", f"d{i}".encode(), keys=f"d-{i}") for i in range(20)])
    consumer = SimpleConsumer(server.config(), "C", {"Durable": FilterExpression()}, await_duration=1)
    consumer.startup()
    try:
        got = receive_until(consumer, 20, invisible=6)
        held_until = time.monotonic() + 6
        acked = got[:8]
        for m in acked:
            consumer.ack(m)
    finally:
        consumer.shutdown()
    server.kill()
    server = served("--sync-flush")  # the same store, after a crash
    consumer = SimpleConsumer(server.config(), "C", {"Durable": FilterExpression()}, await_duration=1)
    consumer.startup()
    try:
        again = receive_until(consumer, 12, invisible=60)
        back_at = time.monotonic()
        for m in again:
            consumer.ack(m)
    finally:
        consumer.shutdown()
    unacked = {m.body for m in got} - {m.body for m in acked}
    assert unacked <= {m.body for m in again}  # every received-but-unacked message comes back
    assert not {m.body for m in acked} & {m.body for m in again}  # and no acknowledged one
    assert back_at >= held_until - 1  # after its invisible time
    assert server.stop() == 0
    with MessageStore.open(tmp_path / "store", CONFIG, read_only=True) as store:
        stored = {m.uniq_key for m in store.iter_messages()}
        assert {r.message_id for r in receipts} <= stored


def test_protocol_descriptors_match_the_vendored_protos():
    pytest.importorskip("grpc_tools")
    committed = (Path(__file__).resolve().parents[1] / "src/rocketstore/server/proto/messaging.desc").read_bytes()
    assert compile_descriptor_set() == committed


def test_protocol_classes_coexist_with_the_official_clients():
    from rocketmq.grpc_protocol import definition_pb2

    theirs = definition_pb2.Message(body=b"x")
    theirs.topic.name = "T"
    ours = pb.Message.FromString(theirs.SerializeToString())
    assert ours.topic.name == "T" and ours.body == b"x"


def test_pull_offsets_forward_to_dlq_and_the_metrics_line(served, tmp_path):
    """The pull-style calls on the store's offsets, ForwardMessageToDeadLetterQueue with a real receipt handle,
    and the sends/s line --stats-interval prints."""
    server = served("--stats-interval", "0.3")
    send_all(server, "Pull", [message("Pull", f"m{i}".encode(), group="one") for i in range(3)])  # one queue
    queues = [pb.MessageQueue(topic=pb.Resource(name="Pull"), id=q) for q in range(8)]

    def query(policy, q):
        return server.call("QueryOffset", pb.QueryOffsetRequest(message_queue=q, query_offset_policy=policy),
                           pb.QueryOffsetResponse).offset

    deadline = time.monotonic() + 10  # the queue's end moves when dispatch (asynchronous, as RocketMQ's) gets there
    while sum(ends := [query(pb.QueryOffsetPolicy.END, q) for q in queues]) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(ends) == [0] * 7 + [3] and all(query(pb.QueryOffsetPolicy.BEGINNING, q) == 0 for q in queues)
    queue = queues[ends.index(3)]
    pulled = server.call("PullMessage", pb.PullMessageRequest(group=pb.Resource(name="Puller"), message_queue=queue,
                                                              offset=1, batch_size=10), pb.PullMessageResponse,
                         stream=True)
    assert pulled[0].status.code == pb.Code.OK
    assert [r.message.body for r in pulled if r.HasField("message")] == [b"m1", b"m2"]
    assert pulled[-1].next_offset == 3
    get = pb.GetOffsetRequest(group=pb.Resource(name="Puller"), message_queue=queue)
    assert server.call("GetOffset", get, pb.GetOffsetResponse).status.code == pb.Code.OFFSET_NOT_FOUND
    update = pb.UpdateOffsetRequest(group=pb.Resource(name="Puller"), message_queue=queue, offset=2)
    assert server.call("UpdateOffset", update, pb.UpdateOffsetResponse).status.code == pb.Code.OK
    assert server.call("GetOffset", get, pb.GetOffsetResponse).offset == 2

    receive = pb.ReceiveMessageRequest(group=pb.Resource(name="Giver"), message_queue=queue, batch_size=1)
    receive.invisible_duration.FromSeconds(30)
    receive.long_polling_timeout.FromSeconds(1)
    got = [r.message for r in server.call("ReceiveMessage", receive, pb.ReceiveMessageResponse, stream=True)
           if r.HasField("message")]
    assert [m.body for m in got] == [b"m0"]
    forward = pb.ForwardMessageToDeadLetterQueueRequest(
        group=pb.Resource(name="Giver"), topic=pb.Resource(name="Pull"),
        receipt_handle=got[0].system_properties.receipt_handle, message_id=got[0].system_properties.message_id)
    reply = server.call("ForwardMessageToDeadLetterQueue", forward, pb.ForwardMessageToDeadLetterQueueResponse)
    assert reply.status.code == pb.Code.OK
    again = server.call("ForwardMessageToDeadLetterQueue", forward, pb.ForwardMessageToDeadLetterQueueResponse)
    assert again.status.code == pb.Code.INVALID_RECEIPT_HANDLE  # done once: the handle is spent
    time.sleep(0.5)
    assert server.stop() == 0
    assert any(line.startswith("sends/s") and "sent 3" in line for line in server.lines), server.lines
    with MessageStore.open(tmp_path / "store", CONFIG, read_only=True) as store:
        assert [m.body for m in store.get_message("%DLQ%Giver", 0, 0).messages] == [b"m0"]
        assert store.query_offset("Puller", "Pull", queue.id) == 2


def rocketstore_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rocketstore.cli.app", *args], capture_output=True, text=True,
                          check=False, timeout=120)


def test_delayed_messages_arrive_at_their_time_and_are_findable_at_once(served, tmp_path):
    server = served()
    due_s = int(time.time()) + 4
    due = due_s * 1000
    later = message("Timed", b"later", keys="later-1")
    later.delivery_timestamp = due_s  # documented as ms, sent as the Timestamp's seconds by client 5.1.2
    send_all(server, "Timed", [later, message("Timed", b"now")])
    deadline = time.monotonic() + 10  # the CLI's read-only commands work on the served store
    while True:
        found = rocketstore_cli("query-by-key", "--store", str(tmp_path / "store"), *SMALL, "-t", "Timed",
                                "-k", "later-1", "--json")
        if '"later-1"' in found.stdout or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert found.returncode == 0 and '"later-1"' in found.stdout, found.stderr
    assert time.time() * 1000 < due, "found by key before it is due"
    consumer = SimpleConsumer(server.config(), "Timers", {"Timed": FilterExpression()}, await_duration=1)
    consumer.startup()
    try:
        first = receive_until(consumer, 1)
        assert [m.body for m in first] == [b"now"]
        consumer.ack(first[0])
        second = receive_until(consumer, 1, timeout=20)
        arrived = time.time() * 1000
        assert [m.body for m in second] == [b"later"] and arrived >= due
        assert second[0].delivery_timestamp == due and second[0].keys == {"later-1"}
        assert second[0].message_type == pb.MessageType.DELAY
        consumer.ack(second[0])
    finally:
        consumer.shutdown()
    with grpc.insecure_channel(server.address):
        bad = pb.SendMessageRequest(messages=[pb.Message(
            topic=pb.Resource(name="Timed"), body=b"x", system_properties=pb.SystemProperties(
                message_id="01ABC", message_type=pb.MessageType.DELAY,
                delivery_timestamp=pb.Timestamp(seconds=int(time.time()) + 10 * 86_400)))])
        reply = server.call("SendMessage", bad, pb.SendMessageResponse)
        assert reply.status.code == pb.Code.ILLEGAL_DELIVERY_TIME, reply.status


class Checker:
    """A transaction checker that answers from a table and records what it was asked."""

    def __init__(self, answers: dict[bytes, int]) -> None:
        self.answers = answers
        self.asked: list[tuple[bytes, str]] = []

    def check(self, msg):
        self.asked.append((msg.body, msg.topic))
        return self.answers[msg.body]


def test_transactions_commit_rollback_and_the_orphan_check(served, tmp_path):
    from rocketmq.grpc_protocol import TransactionResolution
    from rocketmq.v5.producer import TransactionChecker

    class TableChecker(Checker, TransactionChecker):
        pass

    server = served("--transaction-check-seconds", "1")
    checker = TableChecker({b"orphan-commit": TransactionResolution.COMMIT,
                            b"orphan-rollback": TransactionResolution.ROLLBACK})
    producer = Producer(server.config(), ("Pay",), checker)
    producer.startup()
    try:
        for body, commit in ((b"committed", True), (b"rolled back", False)):
            transaction = producer.begin_transaction()
            receipt = producer.send(message("Pay", body, keys=body.decode().replace(" ", "-")), transaction)
            assert receipt.transaction_id
            transaction.commit() if commit else transaction.rollback()
        for body in (b"orphan-commit", b"orphan-rollback"):  # neither committed nor rolled back: checked
            producer.send(message("Pay", body), producer.begin_transaction())
        consumer = SimpleConsumer(server.config(), "Payments", {"Pay": FilterExpression()}, await_duration=1)
        consumer.startup()
        try:
            got = receive_until(consumer, 1)
            assert [m.body for m in got] == [b"committed"]
            assert got[0].message_type == pb.MessageType.TRANSACTION
            consumer.ack(got[0])
            orphan = receive_until(consumer, 1, timeout=20)
            assert [m.body for m in orphan] == [b"orphan-commit"]
            consumer.ack(orphan[0])
            time.sleep(1.5)
            assert consumer.receive(32, 1) == []
        finally:
            consumer.shutdown()
        assert sorted(checker.asked) == [(b"orphan-commit", "Pay"), (b"orphan-rollback", "Pay")]
        end = server.call("EndTransaction", pb.EndTransactionRequest(
            topic=pb.Resource(name="Pay"), message_id="X", transaction_id="7F0000010000" + "0" * 20,
            resolution=pb.TransactionResolution.COMMIT), pb.EndTransactionResponse)
        assert end.status.code == pb.Code.INVALID_TRANSACTION_ID
    finally:
        producer.shutdown()
    assert server.stop() == 0
    with MessageStore.open(tmp_path / "store", CONFIG, read_only=True) as store:
        bodies = sorted(m.body for q in store.queue_ids("Pay") for m in store.get_message("Pay", q, 0, 100).messages)
        assert bodies == [b"committed", b"orphan-commit"]
        assert [m.body for m in store.query_message("Pay", "committed")] == [b"committed"]


def test_access_control_refuses_unsigned_and_wrongly_signed_calls(served, tmp_path):
    from rocketstore.server.auth import authorization

    accounts = tmp_path / "accounts"
    accounts.write_text("# team accounts\nci-bot s3cret-1\nops  s3cret-2  # the operators\n")
    server = served("--accounts-file", str(accounts), "--access-key", "admin", "--secret-key", "adm1n")
    for ak, sk in (("ops", "s3cret-2"), ("admin", "adm1n")):
        signed = ClientConfiguration(server.address, Credentials(ak, sk), request_timeout=5)
        producer = Producer(signed, ("Secure",))
        producer.startup()
        try:
            producer.send(message("Secure", f"from {ak}".encode()))
        finally:
            producer.shutdown()
    wrong = ClientConfiguration(server.address, Credentials("ops", "guess"), request_timeout=5)
    producer = Producer(wrong, ("Secure",))
    with pytest.raises(Exception, match=r"(?i)unauthori|route"):
        producer.startup()  # the route query is refused (the client reports "failed to fetch topic route")
        producer.send(message("Secure", b"intruder"))
    producer.shutdown()
    deadline = time.monotonic() + 5
    while not any("refused: signature does not match" in line for line in server.lines):
        assert time.monotonic() < deadline, "".join(server.lines)
        time.sleep(0.1)

    send = pb.SendMessageRequest(messages=[pb.Message(topic=pb.Resource(name="Secure"), body=b"raw",
                                                      system_properties=pb.SystemProperties(message_id="01AB"))])
    stamp = time.strftime("%Y%m%dT%H%M%SZ")
    with grpc.insecure_channel(server.address) as channel:
        rpc = channel.unary_unary(f"/{SERVICE}/SendMessage", request_serializer=pb.SendMessageRequest.SerializeToString,
                                  response_deserializer=pb.SendMessageResponse.FromString)
        for metadata in ([], authorization("ops", "nope", stamp), authorization("nobody", "s3cret-1", stamp),
                         [("authorization", "Basic b3BzOnMzY3JldC0y")]):
            assert rpc(send, metadata=metadata, timeout=10).status.code == pb.Code.UNAUTHORIZED
        assert rpc(send, metadata=authorization("ci-bot", "s3cret-1", stamp), timeout=10).status.code == pb.Code.OK
        telemetry = channel.stream_stream(f"/{SERVICE}/Telemetry",
                                          request_serializer=pb.TelemetryCommand.SerializeToString,
                                          response_deserializer=pb.TelemetryCommand.FromString)
        replies = list(telemetry(iter([pb.TelemetryCommand(settings=pb.Settings())]), timeout=10))
        assert [r.status.code for r in replies] == [pb.Code.UNAUTHORIZED]
    assert server.stop() == 0
    with MessageStore.open(tmp_path / "store", CONFIG, read_only=True) as store:
        bodies = sorted(m.body for q in store.queue_ids("Secure")
                        for m in store.get_message("Secure", q, 0, 100).messages)
        assert bodies == [b"from admin", b"from ops", b"raw"], "refused calls wrote nothing"


def test_bad_access_control_options_are_usage_errors(tmp_path):
    bad = tmp_path / "accounts"
    bad.write_text("only-one-word\n")
    for args, expected in ((["--access-key", "a"], "go together"), (["--accounts-file", str(bad)], "line 1"),
                           (["--accounts-file", str(tmp_path / "missing")], "cannot read")):
        done = rocketstore_cli("serve", "--store", str(tmp_path / "s"), "--listen", "127.0.0.1:0", *args)
        assert done.returncode in (1, 2) and expected in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_sql92_subscriptions_select_by_properties_and_bad_ones_are_refused(served):
    """A SimpleConsumer subscribed with an SQL92 expression gets exactly the messages it selects; PullMessage
    filters the same way; an expression that does not parse is ILLEGAL_FILTER_EXPRESSION, not a tag."""
    from rocketmq.grpc_protocol import FilterType

    server = served()
    send_all(server, "Shop", [message("Shop", f"sale {i}".encode(), tag="Paid" if i % 2 else "New",
                                      group="one", amount=str(i * 10), region="eu" if i < 4 else "us")
                              for i in range(8)])  # one message group: one queue, for the pull below
    selector = "amount >= 20 AND (region = 'eu' OR TAGS = 'New')"  # 2, 3, 4, 6
    consumer = SimpleConsumer(server.config(), "Sql", {"Shop": FilterExpression(selector, FilterType.SQL)},
                              await_duration=1)
    consumer.startup()
    try:
        got = receive_until(consumer, 4)
        for m in got:
            consumer.ack(m)
        assert sorted(m.body for m in got) == [b"sale 2", b"sale 3", b"sale 4", b"sale 6"]
        assert consumer.receive(32, 10) == []
    finally:
        consumer.shutdown()

    queue = next(q for q in (pb.MessageQueue(topic=pb.Resource(name="Shop"), id=i) for i in range(8))
                 if server.call("QueryOffset", pb.QueryOffsetRequest(
                     message_queue=q, query_offset_policy=pb.QueryOffsetPolicy.END), pb.QueryOffsetResponse).offset)
    sql = pb.FilterExpression(type=pb.FilterType.SQL, expression="amount > 50")
    pull = pb.PullMessageRequest(group=pb.Resource(name="Puller"), message_queue=queue, offset=0, batch_size=32,
                                 filter_expression=sql)
    pulled = server.call("PullMessage", pull, pb.PullMessageResponse, stream=True)
    assert [r.message.body for r in pulled if r.HasField("message")] == [b"sale 6", b"sale 7"]
    # a literal past 4,300 digits raised Python's ValueError (gRPC UNKNOWN); 800 KB of filter held the loop for 4 s
    for bad in ("amount >", "amount = NULL", "a = 1 b", "a = 1" + "0" * 5000, " AND ".join(["a = 1"] * 5000)):
        pull.filter_expression.expression = bad
        reply = server.call("PullMessage", pull, pb.PullMessageResponse, stream=True)
        assert reply[0].status.code == pb.Code.ILLEGAL_FILTER_EXPRESSION, bad
        receive = pb.ReceiveMessageRequest(group=pb.Resource(name="Sql2"), message_queue=queue, batch_size=1,
                                           filter_expression=pb.FilterExpression(type=pb.FilterType.SQL,
                                                                                 expression=bad))
        receive.long_polling_timeout.FromSeconds(1)
        replies = server.call("ReceiveMessage", receive, pb.ReceiveMessageResponse, stream=True)
        assert replies[0].status.code == pb.Code.ILLEGAL_FILTER_EXPRESSION and not any(
            r.HasField("message") for r in replies), bad
    # tags as RocketMQ's FilterAPI reads them: "*" alone is every tag, else a literal one; only "||" is refused
    for tags, bodies in (("Paid || *", [b"sale 1", b"sale 3", b"sale 5", b"sale 7"]), (" * ", []), (" || ", [])):
        pull.filter_expression.CopyFrom(pb.FilterExpression(type=pb.FilterType.TAG, expression=tags))
        pulled = server.call("PullMessage", pull, pb.PullMessageResponse, stream=True)
        assert [r.message.body for r in pulled if r.HasField("message")] == bodies, tags
    pull.filter_expression.expression = receive.filter_expression.expression = "||"
    receive.filter_expression.type = pb.FilterType.TAG
    assert server.call("PullMessage", pull, pb.PullMessageResponse, stream=True)[0].status.code == \
        pb.Code.ILLEGAL_FILTER_EXPRESSION
    assert server.call("ReceiveMessage", receive, pb.ReceiveMessageResponse, stream=True)[0].status.code == \
        pb.Code.ILLEGAL_FILTER_EXPRESSION
    assert server.stop() == 0


def test_sigusr1_writes_every_threads_stack_and_serving_goes_on(served):
    """A serve that does not stop (a CI run waited 30 s for one) said nothing about what it waited for:
    SIGUSR1 now writes every thread's stack to stderr (faulthandler), and the server serves on."""
    import os
    import signal

    server = served()
    os.kill(server.proc.pid, signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any("most recent call first" in line for line in server.lines):
        time.sleep(0.05)
    dump = "".join(server.lines)
    assert "most recent call first" in dump and dump.count("Thread 0x") >= 2, dump[-2000:]
    route = server.call("QueryRoute", pb.QueryRouteRequest(topic=pb.Resource(name="Anything")), pb.QueryRouteResponse)
    assert route.status.code in (pb.Code.OK, pb.Code.TOPIC_NOT_FOUND)
    assert server.stop() == 0


def test_a_stop_signal_the_kernel_hands_to_another_thread_stops_serve(served):
    """The kernel delivers a process-directed SIGTERM to any thread not blocking it; Python runs its handler in the
    main thread only, which slept on in its wait: serve stopped only when something else woke it (a CI run waited
    30 s). The signal's C handler now writes it to a pipe the main thread waits on, whichever thread runs it."""
    import ctypes
    import os
    import signal

    server = served()
    pid = server.proc.pid
    takers = []  # threads other than the main one that would run a SIGTERM handler
    for tid in map(int, os.listdir(f"/proc/{pid}/task")):
        status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        blocked = int(next(line for line in status.splitlines() if line.startswith("SigBlk:")).split()[1], 16)
        if tid != pid and not blocked & (1 << (signal.SIGTERM - 1)):
            takers.append(tid)
    assert takers, "every thread but the main one blocks SIGTERM: the kernel could only pick the main thread"
    assert ctypes.CDLL(None, use_errno=True).tgkill(pid, takers[0], signal.SIGTERM) == 0
    assert server.proc.wait(20) == 0  # before: still serving (until a SIGUSR1 to the main thread)
    assert "SIGTERM, finishing calls and closing the store" in "".join(server.lines)


STOP_SIGNALS_SCRIPT = """
import signal, threading, time
from rocketstore.cli.signals import StopSignals

parked = threading.Event()
other = threading.Thread(target=parked.wait, daemon=True)
other.start()
with StopSignals() as signals:
    assert signals.wait(0) is None
    threading.Timer(0.2, signal.pthread_kill, (other.ident, signal.SIGTERM)).start()  # run by a thread not main
    started = time.monotonic()
    print(signals.wait(30), time.monotonic() - started < 10, flush=True)
    signals.exit_on_next("exiting now")
    signal.pthread_kill(other.ident, signal.SIGINT)
    time.sleep(30)
print("not reached")
"""


def test_stop_signals_are_seen_from_any_thread_and_a_second_one_exits_at_once():
    done = subprocess.run([sys.executable, "-c", STOP_SIGNALS_SCRIPT], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.stdout.split() == ["15", "True"], done.stderr
    assert done.returncode == 128 + 2 and "SIGINT again, exiting now" in done.stderr


def test_gzip_bodies_update_offset_and_the_consumers_retry_count(served, tmp_path):
    """From a review with the official client: a body sent gzip-compressed (body_encoding GZIP) was stored and handed
    to consumers compressed, as IDENTITY; UpdateOffset answered OK, but a group that had received from the queue
    went on from its old position and its next ack moved the stored offset back (6 -> 2); and consumers were told
    max_attempts 3 whatever --max-attempts was."""
    import gzip

    server = served("--max-attempts", "10")

    def send(body: bytes, encoding: int, message_id: str, group: str | None = None):
        props = pb.SystemProperties(message_id=message_id, body_encoding=encoding)
        if group is not None:
            props.message_group = group
        request = pb.SendMessageRequest(messages=[pb.Message(topic=pb.Resource(name="Z"), body=body,
                                                             system_properties=props)])
        return server.call("SendMessage", request, pb.SendMessageResponse).status.code

    def receive(group: str) -> list:
        request = pb.ReceiveMessageRequest(
            group=pb.Resource(name=group), batch_size=1,
            message_queue=pb.MessageQueue(topic=pb.Resource(name="Z"), id=-1),
            filter_expression=pb.FilterExpression(type=pb.FilterType.TAG, expression="*"))
        request.invisible_duration.FromSeconds(10)
        request.long_polling_timeout.FromSeconds(1)
        return [r.message for r in server.call("ReceiveMessage", request, pb.ReceiveMessageResponse, stream=True)
                if r.HasField("message")]

    def ack(group: str, handle: str) -> int:
        request = pb.AckMessageRequest(group=pb.Resource(name=group), topic=pb.Resource(name="Z"),
                                       entries=[pb.AckMessageEntry(receipt_handle=handle)])
        return server.call("AckMessage", request, pb.AckMessageResponse).status.code

    original = b"hello " * 100
    assert send(gzip.compress(original), pb.Encoding.GZIP, "GZ1", "one") == pb.Code.OK
    assert send(b"not gzip", pb.Encoding.GZIP, "GZ2", "one") == pb.Code.MESSAGE_CORRUPTED
    assert send(gzip.compress(b"x" * (4 << 20) + b"y"), pb.Encoding.GZIP, "GZ3", "one") == \
        pb.Code.MESSAGE_BODY_TOO_LARGE
    for i in range(6):
        assert send(f"u{i}".encode(), pb.Encoding.IDENTITY, f"U{i}", "one") == pb.Code.OK  # one group: one queue
    first = receive("G")[0]
    assert first.body == original and first.system_properties.body_encoding == pb.Encoding.IDENTITY
    queue = pb.MessageQueue(topic=pb.Resource(name="Z"), id=first.system_properties.queue_id)

    def update(offset: int) -> int:
        request = pb.UpdateOffsetRequest(group=pb.Resource(name="G"), message_queue=queue, offset=offset)
        return server.call("UpdateOffset", request, pb.UpdateOffsetResponse).status.code

    def offset() -> int:
        request = pb.GetOffsetRequest(group=pb.Resource(name="G"), message_queue=queue)
        return server.call("GetOffset", request, pb.GetOffsetResponse).offset

    assert update(5) == pb.Code.BAD_REQUEST and offset() == 0  # the first message is still in flight
    assert ack("G", first.system_properties.receipt_handle) == pb.Code.OK and offset() == 1
    assert update(6) == pb.Code.OK and offset() == 6
    after = receive("G")
    assert [m.body for m in after] == [b"u5"]  # from the new offset, not from u0
    assert ack("G", after[0].system_properties.receipt_handle) == pb.Code.OK and offset() == 7
    settings = pb.Settings(client_type=pb.ClientType.SIMPLE_CONSUMER,
                           subscription=pb.Subscription(group=pb.Resource(name="G")))
    with grpc.insecure_channel(server.address) as channel:
        rpc = channel.stream_stream(f"/{SERVICE}/Telemetry", request_serializer=pb.TelemetryCommand.SerializeToString,
                                    response_deserializer=pb.TelemetryCommand.FromString)
        call = rpc(iter([pb.TelemetryCommand(settings=settings)]), timeout=5)
        reply = next(call)
        call.cancel()
    assert reply.settings.backoff_policy.max_attempts == 10
    assert server.stop() == 0
    with MessageStore.open(server.root, CONFIG, read_only=True) as store:
        assert next(m.body for m in store.iter_messages()) == original

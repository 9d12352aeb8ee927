"""Timer messages (TIMER_DELIVER_MS / TIMER_DELAY_SEC / TIMER_DELAY_MS): any delivery time, not just a level.

Delivery is driven with ``store.schedule.deliver_due(now_ms=...)`` and times far enough ahead that the
store's own thread (on the real clock) never delivers them first.
"""

from __future__ import annotations

import struct
import time

import pyarrow as pa
import pytest

from rocketstore import Message, MessageStore, StoreConfig
from rocketstore.brokerconfig import parse_fastjson
from rocketstore.codec.hashing import java_string_hash
from rocketstore.encoder import TIMER_TOPIC
from rocketstore.errors import ConfigFileError, IllegalDeliveryTimeError, StoreIOError
from rocketstore.verify import verify_store

CONFIG = StoreConfig(mapped_file_size_commit_log=64 << 10, mapped_file_size_consume_queue=20 * 100,
                     max_hash_slot_num=97, max_index_num=400, timer_max_delay_sec=3600)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def bodies(store: MessageStore, topic: str) -> list[bytes]:
    out = []
    for queue_id in store.queue_ids(topic):
        out += [m.body for m in store.get_message(topic, queue_id, 0, 100).messages]
    return sorted(out)


def test_timer_messages_wait_in_the_timer_queue_and_are_delivered_in_time_order(tmp_path):
    base = now_ms()
    with MessageStore.open(tmp_path, CONFIG) as store:
        sent = {}
        for body, ahead in ((b"third", 300_000), (b"first", 100_000), (b"second", 200_000)):
            sent[body] = store.put_message(Message("Pay", body, keys=[f"k-{body.decode()}"], queue_id=2,
                                                   properties={"TIMER_DELIVER_MS": str(base + ahead)}))
        store.put_message(Message("Pay", b"relative", keys=["k-rel"], properties={"TIMER_DELAY_SEC": "250"}))
        store.wait_for_dispatch()
        assert store.get_max_offset_in_queue(TIMER_TOPIC, 0) == 4
        assert bodies(store, "Pay") == [], "nothing is in the real topic before its time"
        for body in (b"first", b"second", b"third"):  # findable by key at once, under the real topic
            assert [m.body for m in store.query_message("Pay", f"k-{body.decode()}")] == [body]

        assert store.schedule.deliver_due(now_ms=base + 150_000) == 1
        store.wait_for_dispatch()
        assert bodies(store, "Pay") == [b"first"]
        assert store.schedule.deliver_due(now_ms=base + 500_000) == 3
        store.wait_for_dispatch()
        assert bodies(store, "Pay") == sorted([b"first", b"second", b"third", b"relative"])
        assert store.schedule.deliver_due(now_ms=base + 900_000) == 0, "each is delivered once"

        delivered = store.get_message("Pay", 2, 0, 10).messages
        assert [m.body for m in delivered] == [b"first", b"second", b"third"], "in delivery-time order"
        first = delivered[0]
        assert first.uniq_key == sent[b"first"].uniq_key and first.keys == ["k-first"]
        assert "REAL_TOPIC" not in first.properties and "REAL_QID" not in first.properties
        assert first.properties["TIMER_OUT_MS"] == str(base + 100_000) and "TIMER_DELIVER_MS" not in first.properties
        found = store.query_message("Pay", "k-second")
        assert [(m.topic, m.body) for m in found] == [("Pay", b"second")], "the parked copy is hidden once delivered"
    assert verify_store(tmp_path, CONFIG).clean
    offsets = parse_fastjson((tmp_path / "config" / "timerOffset.json").read_text())["offsetTable"]
    assert offsets == {0: 4}


def test_a_restart_delivers_every_timer_message_not_yet_delivered(tmp_path):
    base = now_ms()
    with MessageStore.open(tmp_path, CONFIG) as store:
        for i, ahead in enumerate((100_000, 400_000, 200_000, 300_000)):
            store.put_message(Message("Pay", f"m{i}".encode(), properties={"TIMER_DELIVER_MS": str(base + ahead)}))
        store.wait_for_dispatch()
        assert store.schedule.deliver_due(now_ms=base + 250_000) == 2  # m0 (offset 0) and m2 (offset 2)
    saved = parse_fastjson((tmp_path / "config" / "timerOffset.json").read_text())
    assert saved["offsetTable"] == {0: 1}, "the committed offset stops below the first one still waiting"
    assert saved["deliveredAbove"] == [[2, 1]], "m2, delivered out of queue order, is remembered"
    with MessageStore.open(tmp_path, CONFIG) as store:
        store.wait_for_dispatch()
        assert store.schedule.deliver_due(now_ms=base + 500_000) == 2  # m1 and m3; m2 not again
        store.wait_for_dispatch()
        assert bodies(store, "Pay") == [b"m0", b"m1", b"m2", b"m3"]
    saved = parse_fastjson((tmp_path / "config" / "timerOffset.json").read_text())
    assert saved["offsetTable"] == {0: 4} and "deliveredAbove" not in saved


def test_delivered_timers_are_remembered_as_runs_and_a_bad_list_is_refused(tmp_path):
    base = now_ms()
    with MessageStore.open(tmp_path, CONFIG) as store:
        store.put_message(Message("Pay", b"late", properties={"TIMER_DELIVER_MS": str(base + 900_000)}))
        for i in range(6):
            store.put_message(Message("Pay", f"m{i}".encode(),
                                      properties={"TIMER_DELIVER_MS": str(base + (100_000 if i != 3 else 800_000))}))
        store.wait_for_dispatch()
        assert store.schedule.deliver_due(now_ms=base + 200_000) == 5
    path = tmp_path / "config" / "timerOffset.json"
    saved = parse_fastjson(path.read_text())
    assert saved["offsetTable"] == {0: 0} and saved["deliveredAbove"] == [[1, 3], [5, 2]]
    with MessageStore.open(tmp_path, CONFIG) as store:  # a restart delivers each of the two left once
        store.wait_for_dispatch()
        assert store.schedule.deliver_due(now_ms=base + 850_000) == 1
        assert store.schedule.deliver_due(now_ms=base + 950_000) == 1
        store.wait_for_dispatch()
        assert bodies(store, "Pay") == sorted([b"late"] + [f"m{i}".encode() for i in range(6)])
    text = path.read_text()
    path.with_name(path.name + ".bak").unlink(missing_ok=True)  # a good backup would be loaded instead
    for bad in ('[[5, 1], [1, 3]]', '[[1, 0]]', '[[1, 3], [2, 1]]', '"1-3"', '[[-1, 2]]'):
        path.write_text(text.replace('"offsetTable"', f'"deliveredAbove":{bad},"offsetTable"', 1))
        with pytest.raises(ConfigFileError, match="deliveredAbove"):
            MessageStore.open(tmp_path, CONFIG).close()


def test_timer_message_rules(tmp_path):
    with MessageStore.open(tmp_path, CONFIG) as store:
        for props in ({"TIMER_DELIVER_MS": "soon"}, {"TIMER_DELAY_SEC": "1.5"},
                      {"TIMER_DELIVER_MS": str(now_ms() + 3_700_000)}, {"TIMER_DELAY_MS": str(3_601_000)}):
            with pytest.raises(IllegalDeliveryTimeError):
                store.put_message(Message("Pay", b"x", properties=props))
        assert store.max_phy_offset == 0, "a refused timer message writes nothing"
        past = store.put_message(Message("Pay", b"due", properties={"TIMER_DELIVER_MS": str(now_ms() - 5)}))
        store.wait_for_dispatch()
        assert past.ok and bodies(store, "Pay") == [b"due"], "a time already past is stored as it is"
        level = store.put_message(Message("Pay", b"lvl", properties={"DELAY": "3", "TIMER_DELAY_SEC": "60"}))
        assert store.look_message_by_offset(level.commit_log_offset).topic == "SCHEDULE_TOPIC_XXXX", \
            "a delay level wins over a timer"
        table = pa.table({"topic": ["Pay", "Pay"], "body": [b"now", b"later"],
                          "properties": pa.array([[], [("TIMER_DELAY_SEC", "600")]],
                                                 pa.map_(pa.string(), pa.string()))})
        result = store.put_batch(table)
        store.wait_for_dispatch()
        parked = store.look_message_by_offset(int(result.commit_log_offsets[1]))
        assert (parked.topic, parked.queue_id, parked.properties["REAL_TOPIC"]) == (TIMER_TOPIC, 0, "Pay")
        assert int(parked.properties["TIMER_DELIVER_MS"]) >= now_ms() + 590_000
        assert bodies(store, "Pay") == [b"due", b"now"]


def test_a_message_the_store_refuses_holds_up_nothing_and_a_passing_refusal_is_retried(tmp_path, monkeypatch,
                                                                                     caplog):
    """A due message whose topic was deleted (auto-create off) or whose queue went away raised out of the
    delivery loop on every tick: its level, every later level and the timers never delivered again."""
    base = now_ms()
    with MessageStore.open(tmp_path, CONFIG.replace(auto_create_topic_enable=False)) as store:
        for topic, queues in (("Gone", 1), ("Live", 1), ("Shrunk", 8)):
            store.create_topic(topic, queues=queues)
        doomed = store.put_message(Message("Gone", b"doomed", properties={"DELAY": "10"}))
        store.put_message(Message("Live", b"after the doomed one", properties={"DELAY": "10"}))
        store.put_message(Message("Live", b"flaky", properties={"DELAY": "11"}))
        store.put_message(Message("Live", b"level 12", properties={"DELAY": "12"}))
        lost_queue = store.put_message(Message("Shrunk", b"queue 5", queue_id=5,
                                               properties={"TIMER_DELIVER_MS": str(base + 100_000)}))
        store.put_message(Message("Live", b"timer", properties={"TIMER_DELIVER_MS": str(base + 200_000)}))
        store.delete_topic("Gone")
        store.create_topic("Shrunk", queues=2)
        store.wait_for_dispatch()
        put, failures = store._put_delivered, []

        def disk_full_once(msg):
            if msg.body == b"flaky" and not failures:
                failures.append(msg)
                raise StoreIOError(28, "No space left on device")
            return put(msg)

        monkeypatch.setattr(store, "_put_delivered", disk_full_once)
        assert store.schedule.deliver_due(now_ms=base + 3_600_000) == 3
        store.wait_for_dispatch()
        assert bodies(store, "Live") == [b"after the doomed one", b"level 12", b"timer"]
        passed_over = store.schedule.undeliverable
        assert sorted(passed_over) == sorted([doomed.commit_log_offset, lost_queue.commit_log_offset])
        assert isinstance(store.schedule.deliveries.last_error, StoreIOError)
        assert store.schedule.deliver_due(now_ms=base + 3_600_000) == 1, "the level waited, then delivered"
        store.wait_for_dispatch()
        assert bodies(store, "Live") == [b"after the doomed one", b"flaky", b"level 12", b"timer"]
        assert store.schedule.deliver_due(now_ms=base + 3_600_000) == 0
        assert store.view_message_by_id(doomed.msg_id).body == b"doomed", "passed over, still readable"
        assert sum("cannot be delivered" in r.message for r in caplog.records) == 2


def test_delay_and_timer_properties_parse_as_javas_parse_int_and_parse_long(tmp_path):
    """Python's int() took " 3", "1_0", other scripts' digits and 20-digit numbers, which a broker refuses."""
    from rocketstore.errors import IllegalDeliveryTimeError, InvalidPropertyError

    with MessageStore.open(tmp_path, CONFIG) as store:
        for bad in (" 3", "1_0", "٣", "99999999999999999999", "3.0"):
            with pytest.raises(InvalidPropertyError, match="DELAY must be"):
                store.put_message(Message("T", b"x", properties={"DELAY": bad}))
        for bad in ("1_000", " 1000", "1e3", "9" * 20):
            with pytest.raises(IllegalDeliveryTimeError, match="must be an integer"):
                store.put_message(Message("T", b"x", properties={"TIMER_DELAY_MS": bad}))
        assert store.max_phy_offset == 0
        assert store.put_message(Message("T", b"x", properties={"DELAY": "+1"})).ok
        assert store.put_message(Message("T", b"y", properties={"TIMER_DELAY_MS": "-5"})).ok  # past: stored as is


def test_timer_units_carry_the_tags_hash_a_broker_gives_them_and_the_wheel_reads_the_due_time(tmp_path):
    """RocketMQ's dispatch gives only the delay levels' units a due time: a broker's timer units carry their TAGS
    hash, which a wheel taking it for the due time delivered at once (hash 0: every untagged timer message)."""
    base = now_ms()
    with MessageStore.open(tmp_path, CONFIG) as store:
        store.put_message(Message("Pay", b"tagged", tags="TagT", properties={"TIMER_DELIVER_MS": str(base + 100_000)}))
        store.put_message(Message("Pay", b"plain", properties={"TIMER_DELIVER_MS": str(base + 200_000)}))
        store.wait_for_dispatch()
        queue = store.queues.get(TIMER_TOPIC, 0)
        assert [queue.get_unit(n)[2] for n in (0, 1)] == [java_string_hash("TagT"), 0]
        assert store.schedule.deliver_due(now_ms=base + 50_000) == 0
        assert store.schedule.deliver_due(now_ms=base + 150_000) == 1
        assert store.schedule.deliver_due(now_ms=base + 250_000) == 1
    assert verify_store(tmp_path, CONFIG).clean
    unit = tmp_path / "consumequeue" / TIMER_TOPIC / "0" / "00000000000000000000"
    data = bytearray(unit.read_bytes())
    struct.pack_into(">q", data, 12, base + 100_000)  # as earlier versions wrote it: the due time, still sound
    unit.write_bytes(bytes(data))
    assert verify_store(tmp_path, CONFIG).clean
    struct.pack_into(">q", data, 12, 12345)
    unit.write_bytes(bytes(data))
    assert [p.detail for p in verify_store(tmp_path, CONFIG).problems] == [
        f"tags code 12345 but the record's is {java_string_hash('TagT')}"]


def test_a_brokers_store_delivers_what_its_timer_had_not_and_nothing_twice(tmp_path):
    """A broker keeps its timer's progress in config/timercheck, not timerOffset.json: the units below its
    lastTimerQueueOffset were taken into its timerlog, delivered or still waiting there."""
    base = now_ms()
    with MessageStore.open(tmp_path, CONFIG) as store:
        for body, ahead in ((b"delivered", 100_000), (b"waiting", 400_000), (b"new", 300_000)):
            store.put_message(Message("Pay", body, properties={"TIMER_DELIVER_MS": str(base + ahead)}))
        store.wait_for_dispatch()
        assert store.schedule.deliver_due(now_ms=base + 150_000) == 1  # as the broker's timer delivered it
        store.wait_for_dispatch()
    for name in ("timerOffset.json", "timerOffset.json.bak"):
        (tmp_path / "config" / name).unlink(missing_ok=True)
    # TimerCheckpoint: lastReadTimeMs, lastTimerLogFlushPos, lastTimerQueueOffset (units 0 and 1 taken), master's
    (tmp_path / "config" / "timercheck").write_bytes(struct.pack(">qqqq", base, 0, 2, 0).ljust(4096, b"\0"))
    with MessageStore.open(tmp_path, CONFIG) as store:
        assert store.schedule.deliver_due(now_ms=base + 1_000_000) == 2
        store.wait_for_dispatch()
        assert bodies(store, "Pay") == [b"delivered", b"new", b"waiting"]
    with MessageStore.open(tmp_path, CONFIG) as store:  # its own file from now on
        assert store.schedule.deliver_due(now_ms=base + 2_000_000) == 0


@pytest.mark.parametrize("kind", ["delay", "timer"])
def test_a_close_during_a_delivery_backlog_loses_nothing(tmp_path, kind):
    """close() marked the store closed before it stopped the schedule thread: every due message the thread then
    read was "unreadable", skipped, and its offset advanced and written. 3,492 of 4,000 due messages were never
    delivered, with no fault (the schedule review). The thread stops first now; the rest is delivered after a reopen,
    each once."""
    import collections

    config = CONFIG.replace(message_delay_level="1s", mapped_file_size_commit_log=1 << 20,
                            mapped_file_size_consume_queue=20 * 1000, max_index_num=4000)
    n = 3000  # a backlog long enough that the close falls inside it on a loaded machine too
    store = MessageStore.open(tmp_path, config)
    due = time.time_ns() // 1_000_000 + 1000
    properties = {"DELAY": "1"} if kind == "delay" else {"TIMER_DELIVER_MS": str(due)}
    store.put_messages([Message("Real", b"m%d" % i, properties=properties) for i in range(n)])
    store.wait_for_dispatch()
    deadline = time.monotonic() + 30
    while store.schedule.delivered == 0 and time.monotonic() < deadline:
        time.sleep(0.002)
    store.close()  # while the backlog is being delivered
    delivered_before = store.schedule.delivered
    assert 0 < delivered_before < n, "the close did not fall in the backlog: the test proves nothing"
    with MessageStore.open(tmp_path, config) as store:
        deadline = time.monotonic() + 30
        while store.get_max_offset_in_queue("Real", 0) + sum(
                store.get_max_offset_in_queue("Real", q) for q in store.queue_ids("Real") if q) < n \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        store.wait_for_dispatch()
        got = collections.Counter(m.body for q in store.queue_ids("Real")
                                  for m in _all(store, "Real", q))
    assert sorted(got) == sorted(b"m%d" % i for i in range(n)) and set(got.values()) == {1}


def _all(store, topic, queue_id):
    offset = 0
    while (found := store.get_message(topic, queue_id, offset, 500)).messages:
        yield from found.messages
        offset = found.next_begin_offset


@pytest.mark.parametrize("kind", ["delay", "timer"])
def test_a_parked_message_that_cannot_be_read_holds_up_nothing(tmp_path, monkeypatch, kind):
    """A read of a parked record that fails for good (an I/O error every time) is passed over, as RocketMQ's delivery
    passes over a message it cannot look up: kept waiting, it held up its delay level, or every timer message (an
    unreadable timer is due at once and stayed first in the wheel), for good (the fix review)."""
    config = CONFIG.replace(message_delay_level="1s")
    with MessageStore.open(tmp_path, config) as store:
        due = now_ms() + 1000
        properties = {"DELAY": "1"} if kind == "delay" else {"TIMER_DELIVER_MS": str(due)}
        parked = [store.put_message(Message("Real", b"m%d" % i, properties=properties)) for i in range(5)]
        real = store.look_message_by_offset
        bad = parked[1].commit_log_offset

        def look(offset, *args, **kwargs):
            if offset == bad:
                raise StoreIOError(5, "Input/output error")
            return real(offset, *args, **kwargs)

        monkeypatch.setattr(store, "look_message_by_offset", look)
        deadline = time.monotonic() + 20
        while len(bodies(store, "Real")) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert bodies(store, "Real") == [b"m0", b"m2", b"m3", b"m4"]

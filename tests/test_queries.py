"""Queries by key, unique key and id: exact where RocketMQ compares hashes, over rolled index files."""

from __future__ import annotations

import base64
import json
import shutil
import time

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rocketstore import Message, MessageStore, StoreConfig
from rocketstore.checkpoint import StoreCheckpoint
from rocketstore.errors import InvalidMessageIdError, MessageNotFoundError
from rocketstore.index import IndexFile
from rocketstore.verify import verify_store


def keyed(store: MessageStore, topic: str, keys: list[str], body: bytes = b"b", **kw):
    return store.put_message(Message(topic, body, keys=keys, **kw))


def test_colliding_keys_never_return_a_foreign_message(tmp_path, small_config):
    with MessageStore.open(tmp_path, small_config) as store:
        aa = keyed(store, "TopicA", ["Aa"], b"aa")
        bb = keyed(store, "TopicA", ["BB"], b"bb")
        ea = keyed(store, "Ea", ["20231001123456"], b"ea")
        fb = keyed(store, "FB", ["20231001123456"], b"fb")
        store.wait_for_dispatch()
        raw = store.index.query_offset("TopicA", "Aa", 64, 0, 1 << 62)[0]
        assert sorted(raw) == sorted([aa.commit_log_offset, bb.commit_log_offset]), "RocketMQ's answer"
        assert [m.body for m in store.query_message("TopicA", "Aa")] == [b"aa"]
        assert [m.body for m in store.query_message("TopicA", "BB")] == [b"bb"]
        assert [m.body for m in store.query_message("Ea", "20231001123456")] == [b"ea"]
        assert [m.body for m in store.query_message("FB", "20231001123456")] == [b"fb"]
        assert ea.commit_log_offset != fb.commit_log_offset
        # max_num=1: RocketMQ's walk stops at the newest colliding entry (BB) and the client drops it
        assert [m.body for m in store.query_message("TopicA", "Aa", max_num=1)] == [b"aa"]


def test_unicode_emoji_and_multiple_keys(tmp_path, small_config):
    with MessageStore.open(tmp_path, small_config) as store:
        r = keyed(store, "T", ["订单-42", "😀", "plain"])
        keyed(store, "T", ["other"])
        store.wait_for_dispatch()
        for key in ("订单-42", "😀", "plain"):
            assert [m.commit_log_offset for m in store.query_message("T", key)] == [r.commit_log_offset]
        assert store.query_message("T", "订单") == [] and store.query_message("U", "plain") == []


def test_results_are_capped_and_are_the_newest(tmp_path, small_config):
    with MessageStore.open(tmp_path, small_config) as store:
        results = [keyed(store, "T", ["same"], str(i).encode()) for i in range(100)]
        store.wait_for_dispatch()
        got = store.query_message("T", "same", max_num=10)
        assert [m.commit_log_offset for m in got] == [r.commit_log_offset for r in results[-10:]]
        assert len(store.query_message("T", "same", max_num=1000)) == 64, "capped by max_msgs_num_batch"


def test_a_hidden_parked_copy_does_not_count_toward_max_num(tmp_path, small_config):
    """After delivery a delay message's parked copy is hidden: it must not take one of the max_num places."""
    with MessageStore.open(tmp_path, small_config) as store:
        keyed(store, "T", ["K"], b"older plain")
        keyed(store, "T", ["K"], b"delayed", properties={"DELAY": "1"})
        deadline = time.monotonic() + 10
        while store.get_max_offset_in_queue("T", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        store.wait_for_dispatch()
        assert [m.body for m in store.query_message("T", "K")] == [b"older plain", b"delayed"]
        assert [m.body for m in store.query_message("T", "K", max_num=2)] == [b"older plain", b"delayed"]
        assert [m.body for m in store.query_message("T", "K", max_num=1)] == [b"delayed"]
        for max_num, bodies in ((2, [b"older plain", b"delayed"]), (1, [b"delayed"])):
            assert store.query_messages_arrow([("T", "K")], max_num).column("body").to_pylist() == bodies


def test_time_windows_are_exact_at_second_boundaries(tmp_path, small_config):
    with MessageStore.open(tmp_path, small_config) as store:
        stamps = []
        for i in range(6):
            stamps.append(keyed(store, "T", ["k"], str(i).encode()).store_timestamp)
            time.sleep(0.35)
        store.wait_for_dispatch()
        for lo in range(6):
            for hi in range(lo, 6):
                got = store.query_message("T", "k", begin=stamps[lo], end=stamps[hi])
                expected = [i for i in range(6) if stamps[lo] <= stamps[i] <= stamps[hi]]
                assert [int(m.body) for m in got] == expected, (lo, hi)
        assert store.query_message("T", "k", begin=stamps[-1] + 1) == []
        assert store.query_message("T", "k", end=stamps[0] - 1) == []


def test_several_rolled_index_files_answer_newest_first(tmp_path, small_config):
    config = small_config.replace(max_index_num=50)  # 49 entries per file: rolls every ~16 messages
    with MessageStore.open(tmp_path, config) as store:
        results = [keyed(store, "T", [f"k{i}", "common"], str(i).encode()) for i in range(100)]
        store.wait_for_dispatch()
        assert len(store.index.files) >= 5
        names = [f.path.name for f in store.index.files]
        assert names == sorted(names) and all(len(n) == 17 and n.isdigit() for n in names)
        for i in (0, 31, 99):
            assert [m.commit_log_offset for m in store.query_message("T", f"k{i}")] == [results[i].commit_log_offset]
        assert [int(m.body) for m in store.query_message("T", "common", max_num=64)] == list(range(36, 100))
        full = store.index.files[0]
        assert full.is_write_full()
        second = store.index.files[1]
        assert second.begin_phy_offset >= full.end_phy_offset
    checkpoint = StoreCheckpoint.load(tmp_path / "checkpoint")
    assert checkpoint.index_msg_timestamp >= full.end_timestamp > 0


def test_uniq_key_and_message_id_lookups(tmp_path, small_config):
    with MessageStore.open(tmp_path, small_config) as store:
        r = keyed(store, "T", ["k"], b"hello")
        dup = store.put_message(Message("T", b"retry", properties={"UNIQ_KEY": r.uniq_key}))
        store.wait_for_dispatch()
        assert [m.body for m in store.query_message_by_uniq_key("T", r.uniq_key)] == [b"hello", b"retry"]
        assert store.query_message_by_uniq_key("U", r.uniq_key) == []
        assert store.view_message_by_id(r.msg_id).body == b"hello"
        assert store.view_message_by_id(r.msg_id.lower()).body == b"hello"
        assert store.view_message_by_id(dup.uniq_key).commit_log_offset == r.commit_log_offset  # the oldest copy
        odd = store.put_message(Message("T", b"odd", properties={"UNIQ_KEY": "7F0000012BE17705E00568F469B49A2C"}))
        store.wait_for_dispatch()  # that UNIQ_KEY read as an offset id holds a negative offset
        assert store.view_message_by_id(odd.uniq_key).body == b"odd"
        with pytest.raises(MessageNotFoundError):  # no offset id: looked for as a UNIQ_KEY (mqadmin's fallback)
            store.view_message_by_id("not-an-id")
        for bad in ("", "  ", None, 5):
            with pytest.raises(InvalidMessageIdError):
                store.view_message_by_id(bad)
        bogus = r.msg_id[:-4] + "0003"  # an offset inside the first record
        with pytest.raises(MessageNotFoundError):
            store.view_message_by_id(bogus)
        with pytest.raises(MessageNotFoundError):
            store.view_message_by_id("7F00000100002A9F00000000FFFFFFFF")


def test_a_uniq_key_by_id_is_the_oldest_copy_in_the_topic_asked_for(tmp_path, small_config):
    """A UNIQ_KEY names every copy of a message. The lookup walked topics in name order and took the newest copy of
    the first with one: a committed transaction's id answered with its half message (RMQ_SYS_TRANS_HALF_TOPIC sorts
    first) and query-by-id -t TopicTest said not found; a message consumed once answered with its %RETRY% copy
    (the semantics review). As mqadmin's queryMsgById: in the topic given only, the oldest of the newest 32; without
    one, users' topics before retry and dead-letter ones, those before the system's."""
    from rocketstore.cli.app import main as cli
    from rocketstore.transaction import HALF_TOPIC, TransactionLog

    with MessageStore.open(tmp_path, small_config) as store:
        transactions = TransactionLog(store, check_after_ms=60_000)
        half, half_id = transactions.prepare(Message("Orders", b"paid", keys=["o-1"]))
        transactions.end(half_id, half.uniq_key, "Orders", commit=True)
        first = store.put_message(Message("TopicTest", b"original", keys=["k"]))
        uniq = first.uniq_key
        for topic, body in (("%RETRY%group", b"retry copy"), ("TopicTest", b"producer retry")):
            store.put_message(Message(topic, body, properties={"UNIQ_KEY": uniq}))
        only = store.put_message(Message("%RETRY%group", b"only retried", properties={"UNIQ_KEY": "U-ONLY"}))
        store.wait_for_dispatch()
        assert store.view_message_by_id(half.uniq_key).topic == "Orders"  # the commit, not its half
        assert store.view_message_by_id(half.uniq_key, HALF_TOPIC).topic == HALF_TOPIC
        assert store.view_message_by_id(uniq, "TopicTest").body == b"original"
        assert store.view_message_by_id(uniq, "%RETRY%group").body == b"retry copy"
        assert store.view_message_by_id(uniq).body == b"original"
        store.put_message(Message("Aaa", b"another topic's", properties={"UNIQ_KEY": uniq}))
        store.wait_for_dispatch()
        assert store.view_message_by_id(uniq).body == b"another topic's"  # users' topics by name
        assert store.view_message_by_id(" U-ONLY ").commit_log_offset == only.commit_log_offset
        with pytest.raises(MessageNotFoundError, match="in topic TopicTest"):
            store.view_message_by_id("U-ONLY", "TopicTest")
        assert store.view_message_by_id(first.msg_id, "Aaa").body == b"original"  # an offset id names one record
    runner = CliRunner()
    store_args = ["--store", str(tmp_path), "--max-hash-slot-num", "97", "--max-index-num", "500"]
    done = runner.invoke(cli, ["query-by-id", *store_args, "-i", uniq, "-t", " TopicTest ", "--json", "--body"])
    assert done.exit_code == 0, done.output
    assert [base64.b64decode(json.loads(line)["body"]) for line in done.output.splitlines()] == [b"original"]
    done = runner.invoke(cli, ["query-by-id", *store_args, "-i", first.msg_id, "-t", "Aaa"])
    assert done.exit_code == 1 and "of topic TopicTest, not Aaa" in done.output


def test_a_uniq_key_is_found_before_its_topic_has_a_queue(tmp_path, small_config):
    """A delayed message's topic, or a prepared transaction's, has no consume queue until delivery or commit, yet
    its UNIQ_KEY is indexed under it: looked up without a topic (view_message_by_id, query-by-unique-key), it was
    not found, as only topics with queues were searched (the model-based review). Topics in topics.json are too."""
    from rocketstore.cli.app import main as cli

    with MessageStore.open(tmp_path, small_config) as store:
        delayed = store.put_message(Message("Orders", b"in 10 s", keys=["order-1"], properties={"DELAY": "3"}))
        prepared = store.put_message(Message("Payments", b"half", keys=["pay-1"], sys_flag=0x4))
        store.wait_for_dispatch()
        assert "Orders" not in store.topics() and "Payments" not in store.topics()
        assert store.view_message_by_id(delayed.uniq_key).commit_log_offset == delayed.commit_log_offset
        assert store.view_message_by_id(prepared.uniq_key).commit_log_offset == prepared.commit_log_offset
    done = CliRunner().invoke(cli, ["query-by-unique-key", "--store", str(tmp_path), "--max-hash-slot-num", "97",
                                    "--max-index-num", "500", "-i", prepared.uniq_key, "--json"])
    assert done.exit_code == 0, done.output
    assert [json.loads(line)["commitLogOffset"] for line in done.output.splitlines()] == [prepared.commit_log_offset]


def test_view_message_by_id_finds_a_lower_case_uniq_key_as_given(tmp_path, small_config):
    """A producer-given UNIQ_KEY in lower case: found as given first, upper case being only the fallback."""
    with MessageStore.open(tmp_path, small_config) as store:
        lower = "0a0b0c0d00002a9f0000000000abcdef"
        store.put_message(Message("T", b"lower", properties={"UNIQ_KEY": lower}))
        upper = store.put_message(Message("T", b"upper"))
        store.wait_for_dispatch()
        assert store.view_message_by_id(lower).body == b"lower"
        assert store.view_message_by_id(f"  {lower} ").body == b"lower"
        assert store.view_message_by_id(upper.uniq_key.lower()).body == b"upper", "upper case as the fallback"
        with pytest.raises(MessageNotFoundError):
            store.view_message_by_id(lower.upper())


def test_index_survives_a_crash_where_rocketmq_would_delete_it(tmp_path, small_config):
    with MessageStore.open(tmp_path, small_config) as store:
        results = [keyed(store, "T", [f"k{i}"]) for i in range(30)]
        store.wait_for_dispatch()
    checkpoint = StoreCheckpoint.load(tmp_path / "checkpoint")
    checkpoint.index_msg_timestamp = 0  # RocketMQ would now delete every index file on an abnormal start
    checkpoint.flush()
    (tmp_path / "abort").write_text("1")
    names = sorted(p.name for p in (tmp_path / "index").iterdir())
    with MessageStore.open(tmp_path, small_config) as store:
        assert sorted(p.name for p in (tmp_path / "index").iterdir()) == names
        for i, r in enumerate(results):
            assert [m.commit_log_offset for m in store.query_message("T", f"k{i}")] == [r.commit_log_offset]


def test_index_entries_past_a_cut_log_are_unlinked_and_rebuilt(tmp_path, small_config):
    config = small_config.replace(mapped_file_size_commit_log=1 << 16)
    with MessageStore.open(tmp_path, config) as store:
        results = [keyed(store, "T", [f"k{i}", "all"]) for i in range(20)]
        store.wait_for_dispatch()
    cut = results[15]
    segment = tmp_path / "commitlog" / f"{0:020d}"
    with open(segment, "r+b") as f:  # damage record 15: recovery ends the log there
        f.seek(cut.commit_log_offset)
        f.write(b"\xff" * 8)
    (tmp_path / "abort").write_text("1")
    with MessageStore.open(tmp_path, config) as store:
        assert store.recovery.end_offset == cut.commit_log_offset
        assert store.index_entries_repaired == 5 * 3  # UNIQ_KEY + 2 keys for each of 5 messages
        assert len(store.query_message("T", "all")) == 15
        assert store.get_max_offset_in_queue("T", 0) == 15
        again = keyed(store, "T", ["k15", "all"], b"new 15")
        assert again.queue_offset == 15 and again.commit_log_offset == cut.commit_log_offset
        store.wait_for_dispatch()
        assert [m.body for m in store.query_message("T", "k15")] == [b"new 15"]
        assert len(store.query_message("T", "all")) == 16
        newest = store.index.files[-1]
        assert newest.end_phy_offset == again.commit_log_offset


def test_torn_index_slot_is_relinked(tmp_path, small_config):
    """A kill between a put's slot write and its count update: the slot points one past the count."""
    with MessageStore.open(tmp_path, small_config) as store:
        first = keyed(store, "T", ["x"])
        middle = keyed(store, "T", ["x", "y"])  # the re-dispatch after the crash re-indexes only this one
        store.wait_for_dispatch()
    path = sorted((tmp_path / "index").iterdir())[-1]
    index = IndexFile.open(path, 97, 500)
    key_hash, slot = index.slot_of("T#x")
    count = index.index_count
    head = index.buffer[40 + slot * 4 : 44 + slot * 4]  # what a put writes as the new entry's prev
    index.buffer[40 + 97 * 4 + count * 20 : 40 + 97 * 4 + count * 20 + 20] = (
        key_hash.to_bytes(4, "big") + (999).to_bytes(8, "big") + bytes(4) + head)
    index.buffer[40 + slot * 4 : 44 + slot * 4] = count.to_bytes(4, "big")  # entry `count` was never counted
    index.close()
    (tmp_path / "abort").write_text("1")
    with MessageStore.open(tmp_path, small_config) as store:
        second = keyed(store, "T", ["x"])
        store.wait_for_dispatch()
        assert [m.commit_log_offset for m in store.query_message("T", "x")] == [
            first.commit_log_offset, middle.commit_log_offset, second.commit_log_offset]


def test_missing_queues_and_index_are_rebuilt_from_the_commit_log(tmp_path, small_config):
    with MessageStore.open(tmp_path, small_config) as store:
        results = [keyed(store, f"T{i % 3}", [f"k{i}"], queue_id=i % 2) for i in range(60)]
        store.wait_for_dispatch()
    shutil.rmtree(tmp_path / "consumequeue")
    shutil.rmtree(tmp_path / "index")
    with MessageStore.open(tmp_path, small_config) as store:
        for i, r in enumerate(results):
            assert store.query_message(f"T{i % 3}", f"k{i}")[0].commit_log_offset == r.commit_log_offset
            got = store.get_message(f"T{i % 3}", i % 2, r.queue_offset, max_msgs=1).messages
            assert got[0].commit_log_offset == r.commit_log_offset
        assert store.next_queue_offset("T0", 0) == 10


def test_checkpoint_records_how_far_the_index_is_durable(tmp_path, small_config):
    with MessageStore.open(tmp_path, small_config) as store:
        last = [keyed(store, "T", [f"k{i}"]) for i in range(5)][-1]
        store.wait_for_dispatch()
        store.checkpoint_now()
        assert StoreCheckpoint.load(tmp_path / "checkpoint").index_msg_timestamp == last.store_timestamp
        later = keyed(store, "T", ["late"])
    assert StoreCheckpoint.load(tmp_path / "checkpoint").index_msg_timestamp == later.store_timestamp


def test_retention_deletes_index_files_that_only_cover_deleted_segments(tmp_path, small_config):
    config = small_config.replace(max_index_num=20, file_reserved_time=0)
    with MessageStore.open(tmp_path, config) as store:
        results = [keyed(store, "T", [f"k{i}"], b"z" * 200) for i in range(80)]
        store.wait_for_dispatch()
        files_before = len(store.index.files)
        report = store.delete_expired_files(immediately=True)
        assert report.index_files > 0 and len(store.index.files) == files_before - report.index_files
        assert all(f.end_phy_offset >= store.min_phy_offset for f in store.index.files)
        assert store.query_message("T", "k79")[0].commit_log_offset == results[79].commit_log_offset
    assert len(list((tmp_path / "index").iterdir())) == files_before - report.index_files


def test_clean_reopens_do_not_index_anything_twice(tmp_path, small_config):
    with MessageStore.open(tmp_path, small_config) as store:
        for i in range(10):
            keyed(store, "T", [f"k{i}", "all"])
        store.wait_for_dispatch()
        entries = sum(f.index_count - 1 for f in store.index.files)
    assert entries == 10 * 3
    for _ in range(3):
        with MessageStore.open(tmp_path, small_config) as store:
            assert sum(f.index_count - 1 for f in store.index.files) == entries


def test_abnormal_reopens_do_not_index_the_newest_record_again(tmp_path, small_config):
    """Dispatch after a crash starts again at the newest indexed record (its keys may be split across two files):
    each abnormal open put its keys in the index once more, as RocketMQ's does (3 entries a crash here). The
    entries the newest file holds for it are not put again."""
    with MessageStore.open(tmp_path, small_config) as store:
        for i in range(10):
            keyed(store, "T", [f"k{i}", "all", "all"])  # a key twice in one record: counted, not merged
        store.wait_for_dispatch()
        entries = sum(f.index_count - 1 for f in store.index.files)
    assert entries == 10 * 4
    for _ in range(3):
        (tmp_path / "abort").touch()  # as a crash leaves it
        with MessageStore.open(tmp_path, small_config) as store:
            store.wait_for_dispatch()
            assert store.recovery.abnormal
            assert sum(f.index_count - 1 for f in store.index.files) == entries
            assert len(store.query_message("T", "all")) == 10 and len(store.query_message("T", "k9")) == 1
    with MessageStore.open(tmp_path, small_config) as store:  # what comes next is indexed as before
        keyed(store, "T", ["k10"])
        store.wait_for_dispatch()
        assert sum(f.index_count - 1 for f in store.index.files) == entries + 2
    assert verify_store(tmp_path, small_config).clean


def test_a_torn_batch_of_index_puts_is_relinked_to_the_counted_entries(tmp_path, small_config):
    """Batched puts write every slot head before the count: a kill between leaves chains of uncounted
    entries; each slot must be walked back to its newest counted entry, not cleared."""
    with MessageStore.open(tmp_path, small_config) as store:
        older = [keyed(store, "T", ["x"]) for _ in range(3)]
        store.wait_for_dispatch()
    path = sorted((tmp_path / "index").iterdir())[-1]
    index = IndexFile.open(path, 97, 500)
    count = index.index_count
    key_hash, slot = index.slot_of("T#x")
    head = int.from_bytes(index.buffer[40 + slot * 4 : 44 + slot * 4], "big")
    entries_at = 40 + 97 * 4
    for n, prev in ((count, head), (count + 1, count)):  # two uncounted entries chained in the slot
        index.buffer[entries_at + n * 20 : entries_at + n * 20 + 20] = (
            key_hash.to_bytes(4, "big") + (10**9 + n).to_bytes(8, "big") + bytes(4) + prev.to_bytes(4, "big"))
    index.buffer[40 + slot * 4 : 44 + slot * 4] = (count + 1).to_bytes(4, "big")
    index.close()
    (tmp_path / "abort").write_text("1")
    with MessageStore.open(tmp_path, small_config) as store:
        store.wait_for_dispatch()
        assert [m.commit_log_offset for m in store.query_message("T", "x")] == [r.commit_log_offset for r in older]


# --- many keys at once: query_messages_arrow == one query_message per pair ----------------------------------

POOL_TOPICS = ["TopicA", "Ea", "FB", "T2"]
POOL_KEYS = ["Aa", "BB", "20231001123456", "订单-7", "😀", "common", "k0", "k5", "k17", "none", ""]


@pytest.fixture(scope="module")
def many_keys_store(tmp_path_factory):
    """Colliding keys and topics, several keys per message, more matches than max_num, rolled index files,
    a delay message (parked, then delivered), a damaged record, and store times spread over ~1.5 s."""
    root = tmp_path_factory.mktemp("many-keys")
    config = StoreConfig(mapped_file_size_commit_log=8192, mapped_file_size_consume_queue=20 * 50,
                         max_hash_slot_num=31, max_index_num=60, flush_interval_commit_log=10)
    stamps = []
    store = MessageStore.open(root, config)
    for i in range(90):
        topic = POOL_TOPICS[i % 4]
        keys = [POOL_KEYS[i % 7], "common", f"k{i % 20}"] + (["BB", "Aa"] if i % 11 == 0 else [])
        props = {"DELAY": "1"} if i == 3 else None
        r = store.put_message(Message(topic, f"m{i}".encode(), keys=keys, properties=props))
        stamps.append(r.store_timestamp)
        if i % 30 == 29:
            time.sleep(0.5)
    store.wait_for_dispatch()
    time.sleep(1.2)  # the delay message comes out of SCHEDULE_TOPIC_XXXX into its real topic
    damaged = store.query_message("T2", "k7")[0]
    assert damaged.body == b"m7"
    mapped = store.commit_log.mapped_files.find(damaged.commit_log_offset)
    body_at = damaged.commit_log_offset - mapped.file_from_offset + store.commit_log.get_record_bytes(
        damaged.commit_log_offset).index(b"m7")
    store.close()
    with open(mapped.path, "r+b") as f:  # its body no longer matches its CRC
        f.seek(body_at)
        f.write(b"X")
    store = MessageStore.open(root, config, read_only=True)
    yield store, stamps
    store.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(picks=st.lists(st.tuples(st.sampled_from([*POOL_TOPICS, "SCHEDULE_TOPIC_XXXX"]), st.sampled_from(POOL_KEYS)),
                      max_size=12),
       max_num=st.integers(0, 70), window=st.tuples(st.integers(-1, 89), st.integers(-1, 89)))
def test_query_messages_arrow_equals_query_message_per_pair(many_keys_store, picks, max_num, window):
    store, stamps = many_keys_store
    lo, hi = sorted(window)
    begin = 0 if lo < 0 else stamps[lo]
    end = None if hi < 0 else stamps[hi]
    batch = store.query_messages_arrow(picks, max_num, begin, end)
    got = batch.to_pydict()
    rows = list(zip(got["queryTopic"], got["queryKey"], got["commitLogOffset"], got["body"], got["msgId"],
                    got["keys"], got["topic"], strict=True))
    expected = [(topic, key, m.commit_log_offset, m.body, m.msg_id, m.keys, m.topic) for topic, key in picks
                for m in store.query_message(topic, key, max_num, begin, end)]
    assert rows == expected


def test_query_messages_arrow_reads_each_record_once_and_skips_damage(many_keys_store):
    store, _stamps = many_keys_store
    batch = store.query_messages_arrow([("T2", "k7"), ("TopicA", "common"), ("TopicA", "common")], 64)
    got = batch.to_pydict()
    t2 = [b for t, b in zip(got["queryTopic"], got["body"], strict=True) if t == "T2"]
    assert t2 == [m.body for m in store.query_message("T2", "k7")] == [b"m27", b"m47", b"m67", b"m87"], \
        "the damaged record (m7) is returned by neither"
    common = [o for t, o in zip(got["queryTopic"], got["commitLogOffset"], strict=True) if t == "TopicA"]
    assert len(common) == 2 * len(store.query_message("TopicA", "common")) > 0
    assert store.query_messages_arrow([], 64).num_rows == 0
    assert batch.schema.names[-2:] == ["queryTopic", "queryKey"]


def test_query_messages_arrow_refuses_what_is_not_a_list_of_pairs(many_keys_store):
    from rocketstore.errors import InvalidQueryError

    store, _stamps = many_keys_store
    for bad in ("Tk", [("T2",)], [("T2", 5)], [None], [("T2", "k7", "x")], 7, ["ab"], [("T2", "k7"), ("T2",)],
                [("T2", "k7"), ["T2", b"k7"]], [("T2", "k7", "x"), ("T2", "k7", "y")]):
        with pytest.raises(InvalidQueryError):
            store.query_messages_arrow(bad)
    assert store.query_messages_arrow(iter([("T2", "k27")])).num_rows == 0, "any iterable of pairs"
    assert store.query_messages_arrow([["T2", "k7"]]).num_rows == 4
    assert store.query_messages_arrow([["T2", "k7"], ("T2", "k7")]).num_rows == 8

    class Text(str):
        pass

    assert store.query_messages_arrow([(Text("T2"), Text("k7"))]).num_rows == 4, "str subclasses are strings"


def test_an_index_file_whose_clock_stepped_back_is_still_searched(tmp_path, small_config, monkeypatch):
    """A RocketMQ broker stores ``currentTimeMillis``, which can step back: an index file may end before it
    begins. Its messages are still found in their time windows, by one query and by many at once."""
    from rocketstore import commitlog

    t0 = 1_700_000_000_000
    with MessageStore.open(tmp_path, small_config) as store:
        for key, ts in (("a", t0 + 20_000), ("b", t0 + 15_000), ("c", t0 + 10_000)):
            monkeypatch.setattr(commitlog, "now_ms", lambda ts=ts: ts)
            store.commit_log.last_store_timestamp = 0  # as a Java broker writes it: no max with the last time
            store.put_message(Message("T", key.encode(), keys=[key]))
        assert store.wait_for_dispatch(10)
        index = store.index.files[-1]
        assert index.end_timestamp < index.begin_timestamp
        for key, ts in (("a", t0 + 20_000), ("b", t0 + 15_000), ("c", t0 + 10_000)):
            begin, end = ts - 500, ts + 500
            assert [m.body for m in store.query_message("T", key, begin=begin, end=end)] == [key.encode()]
            assert store.query_messages_arrow([("T", key)], begin=begin, end=end).column("body").to_pylist() == \
                [key.encode()]


@pytest.mark.parametrize("slots", [5_000_000, 3])  # the same key; every key sharing three slots
def test_a_read_only_store_keeps_answering_while_its_writer_indexes_the_same_keys(tmp_path, slots):
    """A read-only open beside a live writer reads the index's count once: when the writer then indexed the same key
    (or any key of the same slot), the slot named an entry past that count and the reader's walk stopped there,
    answering nothing for messages its log holds. The newer entries are stepped over, back to the covered ones."""
    config = StoreConfig(max_hash_slot_num=slots, max_index_num=4000, preallocate=False)
    writer = MessageStore.open(tmp_path, config)
    try:
        old = [keyed(writer, "T", [f"k{i}", "all"], f"old{i}".encode()) for i in range(100)]
        writer.wait_for_dispatch()
        writer.flush()
        with MessageStore.open(tmp_path, config, read_only=True) as reader:
            def answers():
                return ([m.body for m in reader.query_message("T", "k50")],
                        len(reader.query_message("T", "all", max_num=64)),
                        reader.query_messages_arrow([("T", "k7"), ("T", "all")], 64).num_rows,
                        [m.body for m in reader.query_message_by_uniq_key("T", old[3].uniq_key)],
                        reader.index.files[0].select_phy_offsets("T#k9", 64, 0, 1 << 62))
            before = answers()
            assert before[:4] == ([b"old50"], 64, 65, [b"old3"]) and before[4] == [old[9].commit_log_offset]
            for i in range(200):
                keyed(writer, "T", [f"k{i % 100}", "all"], f"new{i}".encode())
            writer.wait_for_dispatch()
            assert answers() == before  # the reader's snapshot: the newer messages are past its log
        with MessageStore.open(tmp_path, config, read_only=True) as fresh:  # a new open sees them all
            assert [m.body for m in fresh.query_message("T", "k50")] == [b"old50", b"new50", b"new150"]
    finally:
        writer.close()


def test_the_newest_index_files_lost_after_a_clean_close_are_indexed_again(tmp_path, caplog):
    """After a clean close, the newest index file deleted: dispatch resumed after the consume queues, so the records
    only that file indexed were never indexed again (keys silently not found). The open compares where the index
    ends with where the queues end; a clean reopen of an intact store indexes nothing twice."""
    import glob
    import os

    config = StoreConfig(mapped_file_size_commit_log=64 << 10, mapped_file_size_consume_queue=20 * 100,
                         max_hash_slot_num=97, max_index_num=400)
    with MessageStore.open(tmp_path, config) as store:
        for i in range(600):
            keyed(store, "T", [f"k{i}"], b"x" * 200, queue_id=i % 4)
    with MessageStore.open(tmp_path, config) as store:  # intact: nothing indexed again
        entries = sum(f.index_count - 1 for f in store.index.files)
    assert "its newest files were lost" not in caplog.text
    os.unlink(sorted(glob.glob(str(tmp_path / "index" / "*")))[-1])
    with MessageStore.open(tmp_path, config) as store:
        store.wait_for_dispatch()
        assert all(store.query_message("T", f"k{i}") for i in range(600))
        assert sum(f.index_count - 1 for f in store.index.files) >= entries - 1
    assert "its newest files were lost" in caplog.text


def test_index_files_made_after_the_clock_stepped_back_sort_after_the_older_ones(tmp_path, caplog):
    """Index files are ordered by their names (local time). A file named by a clock that had stepped back (NTP)
    sorted before the older ones, so each open took the index for cut short and indexed the log since the step
    again: its entries grew with every open. New names are now always later than the newest."""
    config = StoreConfig(max_hash_slot_num=8, max_index_num=40)
    real = lambda: time.time_ns() // 1_000_000  # noqa: E731
    ahead = lambda: real() + 3_600_000  # noqa: E731
    root = tmp_path / "s"

    def put(store, tag, n):
        for i in range(n):
            store.put_message(Message("T", f"{tag}{i}".encode(), keys=[f"{tag}{i}", "common"]))
        store.wait_for_dispatch()

    with MessageStore.open(root, config, index_clock=ahead) as store:  # the host clock ran an hour fast ...
        put(store, "a", 60)
    entries = []
    for n in range(4):  # ... and was stepped back
        with MessageStore.open(root, config, index_clock=real) as store:
            if n == 0:
                put(store, "b", 60)
            files = store.index.files
            assert [f.path.name for f in files] == sorted(f.path.name for f in files)
            begins = [f.end_phy_offset for f in files]
            assert begins == sorted(begins), "the newest file by name is not the one written last"
            entries.append(sum(f.index_count - 1 for f in files))
            assert [m.body for m in store.query_message("T", "b59")] == [b"b59"]
            assert len(store.query_message("T", "common", max_num=64)) == 64
    assert len(set(entries)) == 1, f"index entries grew with each open: {entries}"
    assert "indexed again" not in caplog.text


@pytest.mark.parametrize("records", [4, 5, 7])
def test_abnormal_reopens_index_nothing_twice_where_a_file_filled_at_the_newest_record(tmp_path, small_config,
                                                                                        records):
    """The newest record's keys split across two files, or filling the older one exactly: the entries the older file
    held for it were put again by every abnormal open (the final review). 19 entries a file, 6 a record."""
    config = small_config.replace(max_index_num=20)
    with MessageStore.open(tmp_path, config) as store:
        for i in range(records):
            keyed(store, "T", [f"a{i}", f"b{i}", f"c{i}", f"d{i}", "dup"])
        store.wait_for_dispatch()
        entries = sum(f.index_count - 1 for f in store.index.files)
    assert entries == records * 6
    for _ in range(2):
        (tmp_path / "abort").touch()
        with MessageStore.open(tmp_path, config) as store:
            store.wait_for_dispatch()
            assert sum(f.index_count - 1 for f in store.index.files) == entries
            assert len(store.query_message("T", "dup")) == records
            assert all(store.query_message("T", f"{k}{records - 1}") for k in "abcd")
    assert verify_store(tmp_path, config).clean

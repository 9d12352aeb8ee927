"""MessageStore: puts, reads, segment rolls, batches, bad input, locking, read-only opens."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rocketstore import (
    FlushDiskType,
    Message,
    MessageStore,
    PutMessageResult,
    PutMessageStatus,
    StoreConfig,
    StoreNotFoundError,
)
from rocketstore.codec import BLANK_MAGIC, decode_offset_msg_id, read_layout
from rocketstore.errors import (
    InvalidFlagError,
    InvalidPropertyError,
    InvalidTopicError,
    MessageIllegalError,
    MessageNotFoundError,
    MessageTooLargeError,
    OffsetOutOfRangeError,
    PropertiesTooLargeError,
    ReadOnlyStoreError,
    StoreClosedError,
    StoreLockedError,
)


def tree_digest(root: Path) -> dict[str, str]:
    """sha256 of every file under root (the lock file excluded: opening it would drop a POSIX lock)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "lock"}


def put_many(store: MessageStore, count: int, topics: int = 3, queues: int = 2, size: int = 40):
    return [store.put_message(Message(f"Topic{i % topics}", bytes([i % 256]) * size, tags=f"Tag{i % 2}",
                                      keys=[f"key-{i}", f"shared-{i % 5}"], queue_id=i % queues))
            for i in range(count)]


def test_put_then_read_back_every_field(tmp_path, small_config):
    with MessageStore.open(tmp_path, small_config) as store:
        result = store.put_message(Message("TopicTest", b"hello", tags="TagA", keys=["order-1", "order-2"],
                                           properties={"color": "red"}, queue_id=3, flag=7))
        assert result.status is PutMessageStatus.PUT_OK and result.ok
        assert result.queue_offset == 0 and result.commit_log_offset == 0
        msg = store.look_message_by_offset(result.commit_log_offset)
    assert (msg.topic, msg.body, msg.queue_id, msg.flag, msg.queue_offset) == ("TopicTest", b"hello", 3, 7, 0)
    assert msg.tags == "TagA" and msg.keys == ["order-1", "order-2"] and msg.properties["color"] == "red"
    assert msg.uniq_key == result.uniq_key and len(result.uniq_key) == 32
    assert msg.msg_id == result.msg_id
    assert decode_offset_msg_id(result.msg_id) == (msg.store_host, 0)
    assert str(msg.store_host) == "127.0.0.1:10911"
    assert msg.store_timestamp == result.store_timestamp and msg.store_size == result.store_size
    assert msg.born_timestamp <= msg.store_timestamp


def test_open_without_a_config_takes_the_geometry_of_the_files(tmp_path, small_config):
    """``MessageStore.open(root)`` on a store of other sizes than the defaults (a broker's, or one made with a
    small config) raised CorruptDataError or ConfigError: only the command line read the sizes from the files."""
    small_config = small_config.replace(max_index_num=4 * 97)  # RocketMQ's 4 entries a slot: readable from a size
    with MessageStore.open(tmp_path, small_config) as store:
        store.put_message(Message("T", b"x", keys=["k"]))
    for read_only in (True, False):
        with MessageStore.open(tmp_path, read_only=read_only) as store:
            for name in ("mapped_file_size_commit_log", "mapped_file_size_consume_queue", "max_hash_slot_num",
                         "max_index_num"):
                assert getattr(store.config, name) == getattr(small_config, name), name
            assert [m.body for m in store.query_message("T", "k")] == [b"x"]
    with MessageStore.open(tmp_path / "new") as store:  # nothing there yet: the defaults
        assert store.config == StoreConfig()


@pytest.mark.parametrize("read_only", [True, False])
def test_a_file_the_open_cannot_read_is_a_typed_error(tmp_path, small_config, read_only):
    """A consume-queue file or directory that is a symlink loop (or unreadable) made the open raise a bare OSError
    (the fuzz review): a StoreIOError now, naming the store and the file, with nothing changed."""
    from rocketstore.errors import StoreIOError

    with MessageStore.open(tmp_path, small_config) as store:
        store.put_message(Message("T", b"x", keys=["k"]))
    queue_dir = tmp_path / "consumequeue" / "T" / "0"
    shutil.rmtree(queue_dir)
    queue_dir.symlink_to("0")  # itself
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if not p.is_symlink())
    with pytest.raises(StoreIOError, match=f"cannot open the store {tmp_path}: Too many levels of symbolic links"):
        MessageStore.open(tmp_path, small_config, read_only=read_only)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if not p.is_symlink()) == before


def test_queue_offsets_are_dense_per_queue_and_times_never_go_back(tmp_path, small_config):
    with MessageStore.open(tmp_path, small_config) as store:
        results = put_many(store, 300)
        seen: dict[tuple[str, int], list[int]] = {}
        last_ts = 0
        for msg in store.iter_messages():
            seen.setdefault((msg.topic, msg.queue_id), []).append(msg.queue_offset)
            assert msg.store_timestamp >= last_ts
            last_ts = msg.store_timestamp
    assert sum(len(v) for v in seen.values()) == 300
    for offsets in seen.values():
        assert offsets == list(range(len(offsets)))
    assert [r.commit_log_offset for r in results] == sorted(r.commit_log_offset for r in results)


def test_segments_roll_with_blank_records_and_exact_names(tmp_path, small_config):
    with MessageStore.open(tmp_path, small_config) as store:
        results = put_many(store, 200, size=100)
    files = sorted((tmp_path / "commitlog").iterdir())
    assert len(files) > 5
    for i, path in enumerate(files):
        assert path.name == f"{i * 4096:020d}" and path.stat().st_size == 4096
    for path in files[:-1]:  # every closed segment ends with a BLANK covering exactly the rest
        data = path.read_bytes()
        pos = 0
        while True:
            layout = read_layout(data, pos)
            if layout is None:
                assert int.from_bytes(data[pos + 4 : pos + 8], "big", signed=True) == BLANK_MAGIC
                assert int.from_bytes(data[pos : pos + 4], "big") == 4096 - pos
                break
            pos += layout.size
    for r in results:  # no record spans two segments
        assert r.commit_log_offset // 4096 == (r.commit_log_offset + r.store_size - 1) // 4096


def test_batch_is_contiguous_shares_store_time_and_moves_whole_to_next_segment(tmp_path, small_config):
    with MessageStore.open(tmp_path, small_config) as store:
        store.put_message(Message("T", b"x" * 3500))  # leaves ~450 bytes in segment 0
        batch = [Message("T", b"y" * 100, keys=[f"b{i}"], queue_id=1) for i in range(4)]
        results = store.put_messages(batch)
    assert all(r.commit_log_offset >= 4096 for r in results), "a batch never splits across segments"
    assert [r.queue_offset for r in results] == [0, 1, 2, 3]
    assert len({r.store_timestamp for r in results}) == 1
    for a, b in itertools.pairwise(results):
        assert b.commit_log_offset == a.commit_log_offset + a.store_size


@pytest.mark.parametrize("count", [1, 3, 12])  # 12: the compiled encoding path of larger puts
def test_each_result_names_its_own_record(tmp_path, small_config, count):
    """Every field of every result of a put is that message's: its msgId reads back its body, its offset and
    size are where the record is, its UNIQ_KEY is the one stored with it."""
    with MessageStore.open(tmp_path, small_config) as store:
        store.put_message(Message("T", b"first"))
        batch = [Message(f"T{i % 2}", f"body-{i}".encode() * (1 + i % 3), tags="t", keys=[f"k{i}"])
                 for i in range(count)]
        # records of two layouts in one put (the store time sits 12 bytes later after an IPv6 born host) and
        # the per-message path's properties: a put that the compiled stamping takes whole
        batch += [Message("T0", b"v6", born_host="[2001:db8::7]:4000", queue_id=1),
                  Message("T1", b"props", properties={"a": "b"}, born_timestamp=5)]
        results = store.put_messages(batch)
        assert len(results) == count + 2
        store.wait_for_dispatch(10)
        for msg, result in zip(batch, results, strict=True):
            assert result.ok and type(result.msg_id) is str and type(result.commit_log_offset) is int
            assert decode_offset_msg_id(result.msg_id)[1] == result.commit_log_offset
            stored = store.view_message_by_id(result.msg_id)
            assert stored.body == msg.body and stored.uniq_key == result.uniq_key
            assert stored.store_size == result.store_size and stored.queue_offset == result.queue_offset
            assert stored.store_timestamp == result.store_timestamp
            assert stored.commit_log_offset == result.commit_log_offset
            assert (stored.topic, stored.queue_id) == (msg.topic, msg.queue_id)
            queued = store.get_message(msg.topic, msg.queue_id, result.queue_offset, 1).messages
            assert queued[0].msg_id == result.msg_id
        # put_message builds its one result directly: the same fields as put_messages' would be
        for msg in (Message("T1", b"single", keys=["s"]), Message("T1", b"again", born_host="[2001:db8::7]:4000")):
            result = store.put_message(msg)
            store.wait_for_dispatch(10)
            stored = store.view_message_by_id(result.msg_id)
            assert type(result) is PutMessageResult and result.ok and result.msg_id == stored.msg_id
            assert (stored.body, stored.uniq_key, stored.store_size, stored.queue_offset, stored.store_timestamp,
                    stored.commit_log_offset) == (msg.body, result.uniq_key, result.store_size, result.queue_offset,
                                                  result.store_timestamp, result.commit_log_offset)
            assert result.queue_offset == store.get_max_offset_in_queue("T1", 0) - 1 > 0


def test_put_results_are_made_when_first_read_and_name_their_records(tmp_path, small_config, monkeypatch):
    """``put_messages`` returns a sequence whose results are built on first read: a put nobody reads builds none
    (they were a sixth of a put of 32). Once read it is the list, built once, and every result of the compiled
    path (UNIQ_KEYs written by the kernel, made as strings only now) names its own record."""
    import rocketstore.store as store_module

    built = []
    real = store_module.put_results
    monkeypatch.setattr(store_module, "put_results", lambda *args: built.append(1) or real(*args))
    with MessageStore.open(tmp_path, small_config) as store:
        batch = [Message(f"T{i % 3}", f"body-{i}".encode(), tags="t" if i % 4 else None, keys=[f"k{i}"] if i % 5
                         else (), queue_id=i % 2) for i in range(16)]
        results = store.put_messages(batch)
        assert len(results) == 16 and not built
        listed = list(results)
        assert built == [1] and len(listed) == 16
        assert results == listed and listed == results and results[3] == listed[3] and results[-2:] == listed[-2:]
        assert list(results) == listed and built == [1]
        head, tail = [listed[0]], listed[1:]
        assert results + tail == listed + tail and head + results == head + listed  # as the list it was
        assert results + results == listed + listed
        assert len({r.uniq_key for r in results}) == 16
        store.wait_for_dispatch(10)
        for msg, result in zip(batch, results, strict=True):
            stored = store.view_message_by_id(result.msg_id)
            assert stored.body == msg.body and stored.uniq_key == result.uniq_key and stored.tags == msg.tags
            assert stored.keys == list(msg.keys) and stored.queue_offset == result.queue_offset
        single = store.put_message(Message("T0", b"one"))
        assert type(single) is PutMessageResult and single.ok
        assert store.view_message_by_id(single.msg_id).body == b"one"
        empty = store.put_messages([])
        assert len(empty) == 0 and empty == [] and list(empty) == []


def test_batch_may_span_topics_and_queues(tmp_path, small_config):
    with MessageStore.open(tmp_path, small_config) as store:
        results = store.put_messages([Message("A", b"1"), Message("B", b"2", queue_id=5), Message("A", b"3")])
        assert [r.queue_offset for r in results] == [0, 0, 1]
        assert store.next_queue_offset("A", 0) == 2 and store.next_queue_offset("B", 5) == 1


def test_reopen_keeps_everything_and_continues_queue_offsets(tmp_path, small_config):
    with MessageStore.open(tmp_path, small_config) as store:
        before = put_many(store, 150)
    with MessageStore.open(tmp_path, small_config) as store:
        assert not store.recovery.abnormal
        for r in before:
            msg = store.look_message_by_offset(r.commit_log_offset)
            assert msg.queue_offset == r.queue_offset and msg.msg_id == r.msg_id
        nxt = store.put_message(Message("Topic0", b"more"))
        assert nxt.queue_offset == sum(1 for i in range(150) if i % 3 == 0 and i % 2 == 0)
        assert nxt.commit_log_offset >= before[-1].commit_log_offset + before[-1].store_size


def test_transaction_prepared_and_rollback_get_no_queue_offset(tmp_path, small_config):
    with MessageStore.open(tmp_path, small_config) as store:
        a = store.put_message(Message("Tx", b"half", sys_flag=0x4))
        b = store.put_message(Message("Tx", b"normal"))
        c = store.put_message(Message("Tx", b"rollback", sys_flag=0xC))
        d = store.put_message(Message("Tx", b"commit", sys_flag=0x8))
    assert (a.queue_offset, b.queue_offset, c.queue_offset, d.queue_offset) == (0, 0, 0, 1)


@pytest.mark.parametrize("offset_kind", ["negative", "past_end", "mid_record", "blank", "not_int"])
def test_bad_offsets_raise_typed_errors(tmp_path, small_config, offset_kind):
    with MessageStore.open(tmp_path, small_config) as store:
        results = put_many(store, 60, size=200)
        last_in_first = max((r for r in results if r.commit_log_offset < 4096), key=lambda r: r.commit_log_offset)
        offset = {"negative": -1, "past_end": store.max_phy_offset, "mid_record": results[1].commit_log_offset + 3,
                  "blank": last_in_first.commit_log_offset + last_in_first.store_size, "not_int": "12"}[offset_kind]
        expected = OffsetOutOfRangeError if offset_kind in ("negative", "past_end", "not_int") else MessageNotFoundError
        with pytest.raises(expected):
            store.look_message_by_offset(offset)


BAD_READS = {
    "get_message max_msgs str": (lambda s: s.get_message("T", 0, 0, "5"), "max_msgs"),
    "get_message max_msgs 0": (lambda s: s.get_message("T", 0, 0, 0), "max_msgs"),
    "get_message max_msgs bool": (lambda s: s.get_message("T", 0, 0, True), "max_msgs"),
    "get_message offset float": (lambda s: s.get_message("T", 0, 1.5), "offset"),
    "get_message offset str": (lambda s: s.get_message("T", 0, "1"), "offset"),
    "get_message offset None": (lambda s: s.get_message("T", 0, None), "offset"),
    "get_message offset bool": (lambda s: s.get_message("T", 0, False), "offset"),
    "get_message queue str": (lambda s: s.get_message("T", "0", 0), "queue_id"),
    "get_message topic None": (lambda s: s.get_message(None, 0, 0), "topic"),
    "query_message max_num str": (lambda s: s.query_message("T", "k", "5"), "max_num"),
    "query_message begin str": (lambda s: s.query_message("T", "k", 64, "0"), "begin"),
    "query_message end float": (lambda s: s.query_message("T", "k", 64, 0, 1.5), "end"),
    "query_message key None": (lambda s: s.query_message("T", None), "key"),
    "query_by_uniq_key None": (lambda s: s.query_message_by_uniq_key("T", None), "uniq_key"),
    "by time timestamp str": (lambda s: s.get_offset_in_queue_by_time("T", 0, "0"), "timestamp"),
    "by time boundary": (lambda s: s.get_offset_in_queue_by_time("T", 0, 0, "middle"), "boundary"),
    "queue_arrow begin str": (lambda s: s.queue_arrow("T", 0, begin="0"), "begin"),
    "queue_arrow end float": (lambda s: s.queue_arrow("T", 0, end=2.0), "end"),
    "delete_expired_files now_ms": (lambda s: s.delete_expired_files(now_ms="x"), "now_ms"),
    "query_messages_arrow max_num": (lambda s: s.query_messages_arrow([("T", "k")], max_num="3"), "max_num"),
    "query_messages_arrow begin": (lambda s: s.query_messages_arrow([("T", "k")], begin=None), "begin"),
}


def test_bad_store_arguments_are_typed_errors_that_change_nothing(tmp_path, small_config):
    from rocketstore.errors import ConfigError, InvalidQueryError, InvalidTopicError

    with pytest.raises(ConfigError, match="root"):
        MessageStore.open(5)
    with pytest.raises(ConfigError, match="config"):
        MessageStore.open(tmp_path, {"mapped_file_size_commit_log": 4096})
    with MessageStore.open(tmp_path, small_config) as store:
        store.put_message(Message("T", b"x"))
        store.wait_for_dispatch()
        for call in (lambda: store.get_min_offset_in_queue("T", "0"), lambda: store.get_max_offset_in_queue("T", "0"),
                     lambda: store.get_earliest_message_time("T", "0"), lambda: store.get_min_offset_in_queue(None, 0)):
            with pytest.raises(InvalidQueryError):
                call()
        with pytest.raises(InvalidTopicError):
            store.reset_offset("g", "a/b", "earliest")
        with pytest.raises(ConfigError, match="group"):
            store.reset_offset("a b", "Empty", "earliest")
        assert store.offset_resets("a b", "Empty") == 0 and store.consumer_offsets.table == {}
        assert store.reset_offset("g", "T", "latest")[0] == 1


def test_bad_read_arguments_are_typed_errors_naming_the_argument(tmp_path, small_config):
    from rocketstore.errors import InvalidQueryError

    with MessageStore.open(tmp_path, small_config) as store:
        for i in range(5):
            store.put_message(Message("T", b"x%d" % i, keys=["k"]))
        store.wait_for_dispatch()
        for call, argument in BAD_READS.values():
            with pytest.raises(InvalidQueryError, match=argument):
                call(store)
        for bad in ("0", 1.5, True):
            with pytest.raises(OffsetOutOfRangeError, match="from_offset"):
                store.iter_messages(bad)
            with pytest.raises(OffsetOutOfRangeError, match="to_offset"):
                store.iter_messages(0, bad)
        # what stays an answer: int subclasses and numpy integers are integers, and RocketMQ's statuses
        import numpy as np

        assert len(store.get_message("T", np.int32(0), np.int64(1), np.int64(2)).messages) == 2
        assert store.get_message("T", 0, -1).status.name == "OFFSET_TOO_SMALL"
        assert [m.body for m in store.query_message("T", "k", 2, 0, None)] == [b"x3", b"x4"]
        assert store.query_message("T", "k", 0) == []
        assert store.get_offset_in_queue_by_time("T", 0, 0, "upper") == 0


BAD_MESSAGES = {
    "empty_topic": (Message("", b"x"), InvalidTopicError),
    "path_escape_topic": (Message("../../etc/passwd", b"x"), InvalidTopicError),
    "slash_topic": (Message("a/b", b"x"), InvalidTopicError),
    "dot_topic": (Message("..", b"x"), InvalidTopicError),
    "long_topic": (Message("T" * 128, b"x"), InvalidTopicError),
    "nul_topic": (Message("a\0b", b"x"), InvalidTopicError),
    "unicode_topic": (Message("订单", b"x"), InvalidTopicError),
    "body_too_large": (Message("T", b"x" * 5000), MessageTooLargeError),
    "props_too_large": (Message("T", b"x", properties={"p": "v" * 40000}), PropertiesTooLargeError),
    "separator_in_value": (Message("T", b"x", properties={"p": "a\x02b"}), InvalidPropertyError),
    "separator_in_name": (Message("T", b"x", properties={"p\x01q": "v"}), InvalidPropertyError),
    "empty_value": (Message("T", b"x", properties={"p": ""}), InvalidPropertyError),
    "space_in_key": (Message("T", b"x", keys=["a b"]), InvalidPropertyError),
    "unknown_sysflag": (Message("T", b"x", sys_flag=0x800), InvalidFlagError),
    "inner_batch_sysflag": (Message("T", b"x", sys_flag=0x80), InvalidFlagError),
    "flag_too_big": (Message("T", b"x", flag=1 << 31), InvalidFlagError),
    "negative_queue": (Message("T", b"x", queue_id=-1), InvalidFlagError),
    "none_body": (Message("T", None), MessageIllegalError),  # type: ignore[arg-type]
    "bad_born_host": (Message("T", b"x", born_host="not-a-host"), InvalidFlagError),
    "surrogate_body": (Message("T", "a\ud800"), MessageIllegalError),
    "surrogate_tags": (Message("T", b"x", tags="\ud800"), InvalidPropertyError),
    "surrogate_key": (Message("T", b"x", keys=["k", "\udc00"]), InvalidPropertyError),
    "surrogate_value": (Message("T", b"x", properties={"p": "\udfff"}), InvalidPropertyError),
    "surrogate_name": (Message("T", b"x", properties={"p\ud800": "v"}), InvalidPropertyError),
}


@pytest.mark.parametrize(("message", "field"), [
    (Message("T", b"x", tags="\ud800"), "tags"), (Message("T", b"x", keys=["\ud800"]), "keys"),
    (Message("T", "\ud800"), "body"), (Message("T", b"x", properties={"p": "\udfff"}), "'p'")])
def test_a_lone_surrogate_is_a_typed_error_naming_the_field_on_every_put_path(tmp_path, small_config, message,
                                                                             field):
    with MessageStore.open(tmp_path, small_config) as store:
        for put in (lambda: store.put_message(message), lambda: store.put_messages([message] * 4),
                    lambda: store.put_messages([Message("T", b"fine")] * 8 + [message])):
            with pytest.raises(MessageIllegalError, match=field):
                put()
        assert store.max_phy_offset == 0


@pytest.mark.parametrize("case", sorted(BAD_MESSAGES))
def test_bad_input_raises_specific_error_and_writes_nothing(tmp_path, case):
    config = StoreConfig(mapped_file_size_commit_log=4096, max_message_size=4000, max_hash_slot_num=97,
                         max_index_num=500)
    message, error = BAD_MESSAGES[case]
    with MessageStore.open(tmp_path, config) as store:
        put_many(store, 5)
        store.flush()
        store.wait_for_dispatch()
        before, end = tree_digest(tmp_path), store.max_phy_offset
        with pytest.raises(error):
            store.put_message(message)
        with pytest.raises(error):  # one bad message fails the whole batch
            store.put_messages([Message("T", b"fine"), message])
        assert store.max_phy_offset == end
        store.flush()
        store.wait_for_dispatch()
        assert tree_digest(tmp_path) == before
        assert store.put_message(Message("Topic0", b"still works")).ok


def test_record_too_large_for_a_segment_is_rejected(tmp_path):
    config = StoreConfig(mapped_file_size_commit_log=4096, max_hash_slot_num=97, max_index_num=500)
    with MessageStore.open(tmp_path, config) as store:
        with pytest.raises(MessageTooLargeError):
            store.put_message(Message("T", b"x" * 4090))
        with pytest.raises(MessageTooLargeError):
            store.put_messages([Message("T", b"x" * 1500) for _ in range(3)])
        assert store.max_phy_offset == 0


def test_a_refused_put_creates_no_topic(tmp_path, small_config):
    """Every row's topic and queue, and the batch's size, are checked before any topic is auto-created."""
    import pyarrow as pa

    from rocketstore.errors import InvalidQueueError

    with MessageStore.open(tmp_path, small_config) as store:
        store.create_topic("Existing", 2)
        refused = {
            "queue": (InvalidQueueError, lambda: store.put_messages([Message("NewA", b"x"),
                                                                    Message("Existing", b"y", queue_id=5)])),
            "queue, delayed": (InvalidQueueError, lambda: store.put_messages([
                Message("Existing", b"x", properties={"DELAY": "1"}), Message("Existing", b"y", queue_id=7)])),
            "size": (MessageTooLargeError, lambda: store.put_messages([Message("NewB", b"x" * 1000)
                                                                       for _ in range(5)])),
            "table": (InvalidQueueError, lambda: store.put_batch(pa.table({
                "topic": ["NewC", "Existing"], "body": [b"x", b"y"], "queue_id": pa.array([0, 5], pa.int32())}))),
            # a new topic's queue beyond the 1,024 a topic may have: refused with the others, not mid-creation
            "queue of a new topic": (InvalidQueueError, lambda: store.put_messages([
                Message("NewD", b"x"), Message("NewE", b"y", queue_id=5000)])),
            "table, queue of a new topic": (InvalidQueueError, lambda: store.put_batch(pa.table({
                "topic": ["NewF", "NewG"], "body": [b"x", b"y"], "queue_id": pa.array([0, 5000], pa.int32())}))),
        }
        for name, (error, put) in refused.items():
            with pytest.raises(error):
                put()
            assert sorted(store.topic_config.topics) == ["Existing"], name
        assert store.max_phy_offset == 0
    assert "New" not in (tmp_path / "config" / "topics.json").read_text()
    assert "SCHEDULE_TOPIC_XXXX" not in (tmp_path / "config" / "topics.json").read_text()


def test_system_topics_are_not_created_by_hand(tmp_path, small_config):
    """``create_topic("SCHEDULE_TOPIC_XXXX", 2)`` was accepted, and every later delay of level 3 or more was then
    refused (its queue did not exist); RocketMQ's updateAndCreateTopic refuses every system topic."""
    from rocketstore.errors import InvalidTopicError

    with MessageStore.open(tmp_path, small_config) as store:
        for topic in ("SCHEDULE_TOPIC_XXXX", "RMQ_SYS_TRANS_HALF_TOPIC", "rmq_sys_wheel_timer", "TBW102",
                      "RMQ_SYS_ANYTHING"):
            with pytest.raises(InvalidTopicError, match="is a system topic"):
                store.create_topic(topic, 2)
        with pytest.raises(InvalidTopicError):
            store.create_topic("bad/topic", 2)
        assert store.topic_config.topics == {}
        store.put_message(Message("T", b"x", properties={"DELAY": "5"}))  # creates SCHEDULE_TOPIC_XXXX itself
        assert store.topic_config.get("SCHEDULE_TOPIC_XXXX").write_queue_nums == len(small_config.delay_levels_ms)
        store.create_topic("Mine", 3)
        assert store.topic_config.get("Mine").write_queue_nums == 3


def test_auto_creation_never_replaces_a_concurrent_create_topic(tmp_path, small_config, monkeypatch):
    """A put that found its topic missing (twice: also under the topic lock) must not overwrite the config an
    operator's create_topic set meanwhile."""
    with MessageStore.open(tmp_path, small_config) as store:
        get = store.topic_config.get
        calls = []

        def slow_get(topic):
            config = get(topic)
            if threading.current_thread().name == "producer" and config is None:
                calls.append(topic)
                if len(calls) == 2:  # the re-check before creating: the operator's create_topic runs now
                    time.sleep(0.3)
            return config

        monkeypatch.setattr(store.topic_config, "get", slow_get)
        producer = threading.Thread(target=lambda: store.put_message(Message("Orders", b"x")), name="producer")
        producer.start()
        time.sleep(0.1)
        store.create_topic("Orders", 2, read_queues=2)
        producer.join()
        assert (store.topic_config.get("Orders").write_queue_nums, store.topic_config.get("Orders").read_queue_nums) \
            == (2, 2)
        assert store.topic_config.create_if_absent("Orders", 8).write_queue_nums == 2


def test_second_writer_in_same_process_is_refused(tmp_path, small_config):
    with MessageStore.open(tmp_path, small_config), pytest.raises(StoreLockedError):
        MessageStore.open(tmp_path, small_config)
    with MessageStore.open(tmp_path, small_config):  # released on close
        pass


def test_second_writer_in_another_process_is_refused(tmp_path, small_config):
    code = ("import sys; from rocketstore import MessageStore, StoreConfig; from rocketstore.errors import "
            "StoreLockedError\ntry:\n"
            "    MessageStore.open(sys.argv[1], StoreConfig(mapped_file_size_commit_log=4096))\n"
            "except StoreLockedError as e:\n    print('LOCKED', e); sys.exit(3)\nsys.exit(0)")
    with MessageStore.open(tmp_path, small_config):
        proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60,
                              check=False)
    assert proc.returncode == 3 and "LOCKED" in proc.stdout
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60,
                              check=False)
    assert proc.returncode == 0, proc.stderr


def test_read_only_open_sees_data_and_changes_nothing(tmp_path, small_config):
    with MessageStore.open(tmp_path, small_config) as writer:
        results = put_many(writer, 80)
        writer.flush()
        writer.wait_for_dispatch()
        writer.checkpoint_now()
        before = tree_digest(tmp_path)
        with MessageStore.open(tmp_path, small_config, read_only=True) as reader:  # beside a live writer
            assert reader.look_message_by_offset(results[-1].commit_log_offset).msg_id == results[-1].msg_id
            assert sum(1 for _ in reader.iter_messages()) == 80
            with pytest.raises(ReadOnlyStoreError):
                reader.put_message(Message("T", b"x"))
        assert tree_digest(tmp_path) == before


def test_read_only_open_of_crashed_store_writes_nothing(tmp_path, small_config):
    with MessageStore.open(tmp_path, small_config) as store:
        put_many(store, 30)
        end = store.max_phy_offset
    (tmp_path / "abort").write_text("12345")
    last = sorted((tmp_path / "commitlog").iterdir())[-1]
    with open(last, "r+b") as f:  # garbage after the end: a torn write
        f.seek(end - int(last.name) + 8)
        f.write(b"\x07" * 50)
    before = tree_digest(tmp_path)
    with MessageStore.open(tmp_path, small_config, read_only=True) as reader:
        assert reader.recovery.abnormal
        assert sum(1 for _ in reader.iter_messages()) == 30
    assert tree_digest(tmp_path) == before
    assert not (tmp_path / "lock").exists() or (tmp_path / "lock").read_bytes() == b"lock"


def test_read_only_open_forgets_queue_units_past_its_log_end(tmp_path, small_config, monkeypatch):
    """A reader loads the log, then the queues: units a live writer added in between point past the reader's log
    end. They are forgotten in memory (not served as unreadable, not counted), and nothing is written."""
    from rocketstore.consumequeue import ConsumeQueueTable

    writer = MessageStore.open(tmp_path, small_config)
    early = [writer.put_message(Message("T", b"a%d" % i)) for i in range(10)]
    writer.wait_for_dispatch()
    state = {}
    load = ConsumeQueueTable.load

    def load_after_more_writes(self):
        for i in range(40):  # past the first segment: into files the reader's log does not have
            writer.put_message(Message("T", b"b%d" % i))
        writer.wait_for_dispatch()
        writer.close()
        state["before"] = tree_digest(tmp_path)
        return load(self)

    monkeypatch.setattr(ConsumeQueueTable, "load", load_after_more_writes)
    with MessageStore.open(tmp_path, small_config, read_only=True) as reader:
        monkeypatch.setattr(ConsumeQueueTable, "load", load)
        end = reader.max_phy_offset
        served = [m for m in reader.iter_messages()]
        assert len(served) > len(early) and all(m.topic == "T" for m in served)
        assert reader.get_max_offset_in_queue("T", 0) == len(served)
        got = reader.get_message("T", 0, 0, 64)
        assert got.unreadable == [] and [m.body for m in got.messages] == [m.body for m in served]
        assert got.next_begin_offset == len(served) and all(m.commit_log_offset < end for m in got.messages)
        assert reader.recovery.missing_flushed_until == 0, "what the writer flushed since is not reported lost"
    assert tree_digest(tmp_path) == state["before"]


def test_read_only_open_of_missing_store(tmp_path):
    with pytest.raises(StoreNotFoundError):
        MessageStore.open(tmp_path / "nothing-here", read_only=True)
    assert not (tmp_path / "nothing-here").exists()


def test_a_close_during_a_maintenance_pass_logs_no_error(tmp_path, small_config, caplog):
    """The maintenance thread may be inside a pass (here a checkpoint) when ``close`` marks the store closed: the
    pass ends quietly (close flushes and checkpoints itself), no "store maintenance failed" traceback."""
    config = dataclasses.replace(small_config, flush_consume_queue_thorough_interval=20)
    store = MessageStore.open(tmp_path, config)
    entered, closing = threading.Event(), threading.Event()
    real = store.checkpoint_now

    def checkpoint_while_closing() -> None:
        entered.set()
        closing.wait(5)
        while not store.closed:
            time.sleep(0.001)
        real()  # raises StoreClosedError, as any pass that starts its work after close began

    store.checkpoint_now = checkpoint_while_closing
    assert entered.wait(5)
    closing.set()
    store.close()
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    with MessageStore.open(tmp_path, config) as again:
        assert again.recovery is not None and not again.recovery.abnormal


def test_closed_store_refuses_use(tmp_path, small_config):
    store = MessageStore.open(tmp_path, small_config)
    store.close()
    store.close()  # idempotent
    with pytest.raises(StoreClosedError):
        store.put_message(Message("T", b"x"))
    with pytest.raises(StoreClosedError):
        store.look_message_by_offset(0)
    for use in (store.topics, lambda: store.queue_ids("T"), lambda: store.next_queue_offset("T", 0)):
        with pytest.raises(StoreClosedError):  # not the answers of an empty store
            use()


@pytest.mark.parametrize("which", ["iter_messages", "scan_arrow", "queue_arrow"])
def test_an_iterator_used_after_close_raises_store_closed(tmp_path, small_config, which):
    store = MessageStore.open(tmp_path, small_config)
    for i in range(200):
        store.put_message(Message("T", b"m%d" % i * 10))
    store.wait_for_dispatch()
    iterator = {"iter_messages": store.iter_messages,
                "scan_arrow": lambda: store.scan_arrow(max_rows=5),
                "queue_arrow": lambda: store.queue_arrow("T", 0, max_rows=5)}[which]()
    next(iterator)
    store.close()
    with pytest.raises(StoreClosedError):
        for _ in iterator:
            pass


def test_iter_messages_starts_only_at_a_record_start(tmp_path, small_config):
    with MessageStore.open(tmp_path, small_config) as store:
        results = put_many(store, 60, size=200)
        with pytest.raises(MessageNotFoundError, match="not the start of a record"):
            store.iter_messages(results[1].commit_log_offset + 3)
        with pytest.raises(MessageNotFoundError, match="not the start of a record"):
            store.iter_messages(1)
        starts = [r.commit_log_offset for r in results]
        assert [m.commit_log_offset for m in store.iter_messages(starts[7])] == starts[7:]
        blank = max(o for o in starts if o < 4096)
        blank += next(r.store_size for r in results if r.commit_log_offset == blank)
        assert [m.commit_log_offset for m in store.iter_messages(blank)] == [o for o in starts if o >= 4096]
        assert list(store.iter_messages(store.max_phy_offset)) == []
        assert len(list(store.iter_messages(0, starts[3]))) == 3


def test_abort_file_lives_while_open_and_checkpoint_is_4096_bytes(tmp_path, small_config):
    with MessageStore.open(tmp_path, small_config) as store:
        assert (tmp_path / "abort").read_text() == str(os.getpid())
        put_many(store, 10)
    assert not (tmp_path / "abort").exists()
    data = (tmp_path / "checkpoint").read_bytes()
    assert len(data) == 4096 and data[48:] == bytes(4048)
    physic = int.from_bytes(data[0:8], "big")
    with MessageStore.open(tmp_path, small_config, read_only=True) as store:
        last = list(store.iter_messages())[-1]
    assert physic == last.store_timestamp


def concurrently(work, count: int) -> list[BaseException]:
    """Run ``work(n)`` in ``count`` threads at once; what they raised."""
    errors: list[BaseException] = []

    def run(n: int) -> None:
        try:
            work(n)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n,)) for n in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_sync_flush_acknowledges_only_flushed_bytes_and_groups_commits(tmp_path, monkeypatch):
    from rocketstore.mapped.file_queue import MappedFileQueue

    real_flush = MappedFileQueue.flush

    def slow_flush(self, least_pages=0):  # a 5 ms msync, like a real disk: concurrent puts pile up
        time.sleep(0.005)
        return real_flush(self, least_pages)

    monkeypatch.setattr(MappedFileQueue, "flush", slow_flush)
    config = StoreConfig(mapped_file_size_commit_log=1 << 20, max_hash_slot_num=97, max_index_num=500,
                         flush_disk_type=FlushDiskType.SYNC_FLUSH)
    with MessageStore.open(tmp_path, config) as store:
        result = store.put_message(Message("Durable", b"durable"))
        assert result.ok and store.flushed_phy_offset >= result.commit_log_offset + result.store_size
        flushes_before = store.flusher.flush_count

        def producer(n: int) -> None:
            for i in range(50):
                r = store.put_message(Message("T", f"{n}-{i}".encode(), queue_id=n))
                assert r.ok and store.flushed_phy_offset >= r.commit_log_offset + r.store_size

        assert not concurrently(producer, 8)
        assert store.flusher.flush_count - flushes_before < 200, "group commit shares flushes between puts"
        for q in range(8):
            assert store.next_queue_offset("T", q) == 50


def test_sync_flush_dispatches_in_few_rounds_and_readers_still_see_their_writes(tmp_path):
    """Under SYNC_FLUSH the dispatcher rests DISPATCH_REST_SYNC between rounds (a round holds the GIL a writer
    needs back after its msync), yet a reader waiting for its own write is served at once."""
    from rocketstore.dispatch import DISPATCH_REST_SYNC

    config = StoreConfig(mapped_file_size_commit_log=1 << 20, max_hash_slot_num=97, max_index_num=500,
                         flush_disk_type=FlushDiskType.SYNC_FLUSH)
    with MessageStore.open(tmp_path, config) as store:
        store.put_message(Message("T", b"first"))
        assert store.wait_for_dispatch(5)
        rounds_before, started = store.dispatcher.rounds, time.monotonic()
        stop = started + 0.4

        def producer(n: int) -> None:
            while time.monotonic() < stop:
                assert store.put_message(Message("T", b"x", queue_id=n)).ok

        assert not concurrently(producer, 4)
        elapsed = time.monotonic() - started
        rounds = store.dispatcher.rounds - rounds_before
        assert rounds <= elapsed / DISPATCH_REST_SYNC + 3, (rounds, elapsed)  # 1 ms rests made ~10x more
        result = store.put_message(Message("T", b"mine", queue_id=7))
        waited = time.monotonic()
        assert store.wait_for_dispatch(5)
        assert time.monotonic() - waited < DISPATCH_REST_SYNC * 5  # no whole rest: readers cut it short
        got = store.get_message("T", 7, result.queue_offset, 1)
        assert [m.body for m in got.messages] == [b"mine"]


def test_sync_flush_wait_false_skips_the_wait(tmp_path):
    config = StoreConfig(mapped_file_size_commit_log=1 << 20, max_hash_slot_num=97, max_index_num=500,
                         flush_disk_type="SYNC_FLUSH")
    with MessageStore.open(tmp_path, config) as store:
        count = store.flusher.flush_count
        assert store.put_message(Message("T", b"x", properties={"WAIT": "false"})).ok
        assert store.flusher.flush_count == count


def test_async_flush_flushes_in_background(tmp_path):
    config = StoreConfig(mapped_file_size_commit_log=1 << 20, max_hash_slot_num=97, max_index_num=500,
                         flush_interval_commit_log=5,
                         flush_commit_log_thorough_interval=20)
    with MessageStore.open(tmp_path, config) as store:
        r = store.put_message(Message("T", b"x"))
        deadline = threading.Event()
        for _ in range(1000):  # up to 10 s: a busy machine may delay the flush thread
            if store.flushed_phy_offset >= r.commit_log_offset + r.store_size:
                break
            deadline.wait(0.01)
        assert store.flushed_phy_offset >= r.commit_log_offset + r.store_size


@pytest.mark.parametrize("api", ["put_messages", "put_batch"])
def test_dispatch_keeps_up_with_a_producer_that_never_pauses(tmp_path, monkeypatch, api):
    """A producer in a tight loop holds the GIL; the dispatcher, which gives it up at every kernel call, fell
    further behind with every put (286 MB after 4 s). Puts now wait whenever dispatch is more than
    MAX_DISPATCH_LAG behind, so what a consumer sees trails the log by at most that much."""
    import pyarrow as pa

    from rocketstore import dispatch

    limit = 128 << 10
    monkeypatch.setattr(dispatch, "MAX_DISPATCH_LAG", limit)
    config = StoreConfig(mapped_file_size_commit_log=64 << 20, max_hash_slot_num=4099, max_index_num=80_000)
    rows = 32 if api == "put_messages" else 500
    with MessageStore.open(tmp_path / "s", config) as store:
        worst = 0
        for n in range(0, 40_000, rows):
            if api == "put_messages":
                store.put_messages([Message(f"T{i % 3}", b"b" * 120, tags="t", keys=[f"k{i}"], queue_id=i % 4)
                                    for i in range(n, n + rows)])
            else:
                store.put_batch(pa.table({"topic": [f"T{i % 3}" for i in range(n, n + rows)],
                                          "body": [b"b" * 120] * rows,
                                          "keys": [[f"k{i}"] for i in range(n, n + rows)],
                                          "queue_id": pa.array([i % 4 for i in range(n, n + rows)], pa.int32())}))
            worst = max(worst, store.commit_log.max_offset - store.dispatcher.reput_from_offset)
        assert worst <= limit
        assert store.dispatcher.held_back > 0
        assert store.wait_for_dispatch(10)
        assert sum(store.get_max_offset_in_queue("T0", q) for q in range(4)) == 40_000 // 3 + 1
        assert [m.queue_id for m in store.query_message("T2", "k39998")] == [39998 % 4]


def test_read_only_open_never_truncates_consume_queues(tmp_path, small_config):
    with MessageStore.open(tmp_path, small_config) as store:
        put_many(store, 40, topics=1, queues=1)
        store.wait_for_dispatch()
    queue_dir = tmp_path / "consumequeue" / "Topic0" / "0"
    first = sorted(queue_dir.iterdir())[0]
    data = bytearray(first.read_bytes())
    data[20 * 5 + 8 : 20 * 5 + 12] = bytes(4)  # unit 5 invalid: recovery would cut the queue there
    first.write_bytes(bytes(data))
    (queue_dir / f"{1000:020d}").write_bytes(bytes(1000))  # and a later file recovery would drop
    before = tree_digest(tmp_path)
    with MessageStore.open(tmp_path, small_config, read_only=True) as store:
        assert store.get_max_offset_in_queue("Topic0", 0) == 5
    assert tree_digest(tmp_path) == before


def test_more_bad_arguments_are_typed_errors_that_write_nothing(tmp_path):
    """Each of these raised an untyped error from inside (TypeError, ArrowInvalid, KeyError, AttributeError, OSError
    EOVERFLOW) before; nothing is written either way."""
    import pyarrow as pa

    from rocketstore.errors import (
        InvalidFlagError,
        InvalidPropertyError,
        InvalidQueryError,
        MessageIllegalError,
        RocketStoreError,
    )

    def table(**columns):
        return pa.table({"topic": ["T", "T"], "body": [b"x", b"y"], **columns})

    with MessageStore.open(tmp_path, StoreConfig(preallocate=False)) as store:
        stored = store.put_message(Message("T", b"hello", keys=["k"]))
        store.wait_for_dispatch()
        bad_host = pa.array([b"\xff", b"1.2.3.4:5"])
        two_topics = pa.Table.from_arrays([pa.array(["T"]), pa.array([b"x"]), pa.array(["U"])],
                                          names=["topic", "body", "topic"])
        cases = [
            (InvalidPropertyError, "keys must be a string or a list",
             lambda: store.put_message(Message("T", b"x", keys=5))),
            (InvalidPropertyError, "keys must be",
             lambda: store.put_message(Message("T", b"x", keys=5, properties={"a": "b"}))),
            (InvalidPropertyError, "keys must be", lambda: store.put_messages([Message("T", b"x", keys=5)] * 40)),
            (MessageIllegalError, "takes a list of messages", lambda: store.put_messages(None)),
            (InvalidFlagError, "must be strings", lambda: store.put_batch(table(born_host=bad_host))),
            (InvalidFlagError, "must be strings", lambda: store.put_batch(table(born_host=[["a"], ["b"]]))),
            (InvalidFlagError, r"^row 1: not a host:port address: 'x'",
             lambda: store.put_batch(table(born_host=["1.2.3.4:5", "x"]))),
            (MessageIllegalError, "column 'topic' twice", lambda: store.put_batch(two_topics)),
            (InvalidQueryError, "broker_name must be a string",
             lambda: store.query_messages_arrow([("T", "k")], broker_name=5)),
            (InvalidQueryError, "now_ms must be an epoch-ms time", lambda: store.delete_expired_files(now_ms=2 ** 70)),
            (InvalidQueryError, "timeout must be a number", lambda: store.wait_for_dispatch("1")),
            (InvalidQueryError, "timeout must be a number", lambda: store.wait_for_dispatch(float("nan"))),
        ]
        for error, text, call in cases:
            with pytest.raises(error, match=text):
                call()
            assert issubclass(error, RocketStoreError)
        assert store.max_phy_offset == stored.store_size
        assert [m.body for m in store.query_message("T", "k")] == [b"hello"]


def test_an_abort_that_cannot_be_written_refuses_the_open_before_recovery_changes_anything(tmp_path, small_config):
    """``abort`` as a directory: the open ran an abnormal recovery (re-indexing records) and only then failed to write
    the file, so a refused command had changed the index."""
    from rocketstore.errors import StoreIOError
    from test_cli import tree

    with MessageStore.open(tmp_path, small_config) as store:
        store.put_message(Message("T", b"x", keys=["k"]))
    (tmp_path / "abort").mkdir()
    before = tree(tmp_path)
    with pytest.raises(StoreIOError, match="not a regular file"):
        MessageStore.open(tmp_path, small_config)
    assert tree(tmp_path) == before
    (tmp_path / "abort").rmdir()
    with MessageStore.open(tmp_path, small_config) as store:
        assert [m.body for m in store.query_message("T", "k")] == [b"x"]


def test_one_wrong_clock_reading_does_not_stamp_every_later_message(tmp_path, monkeypatch):
    """Store times never go back, except from a time more than a day ahead of the clock: one reading in 2100 stamped
    every later message with it, across restarts, for 76 years, and no time-bounded query found them (the time
    review). Found by key in their real time window again, and the store verifies clean."""
    from rocketstore import commitlog
    from rocketstore.verify import verify_store

    config = StoreConfig(mapped_file_size_commit_log=64 << 10, mapped_file_size_consume_queue=20 * 100,
                         max_hash_slot_num=97, max_index_num=400)
    clock = [1_700_000_000_000]
    monkeypatch.setattr(commitlog, "now_ms", lambda: clock[0])
    with MessageStore.open(tmp_path, config) as store:
        store.put_message(Message("T", b"a", keys=["a"]))
        clock[0] = 4_102_444_800_000  # the clock wrong once
        store.put_message(Message("T", b"b", keys=["b"]))
        clock[0] = 1_700_000_000_500
        store.put_message(Message("T", b"c", keys=["c"]))
        clock[0] = 1_700_000_000_400  # a small step back: held, as before
        held = store.put_message(Message("T", b"d", keys=["d"]))
    assert held.store_timestamp == 1_700_000_000_500
    clock[0] = 1_700_000_060_000
    with MessageStore.open(tmp_path, config) as store:
        after = store.put_message(Message("T", b"e", keys=["e"]))
        assert after.store_timestamp == 1_700_000_060_000
        store.wait_for_dispatch()
        window = (1_700_000_000_000, 1_700_000_100_000)
        assert [m.body for m in store.query_message("T", "c", 10, *window)] == [b"c"]
        assert [m.body for m in store.query_message("T", "e", 10, *window)] == [b"e"]
    assert verify_store(tmp_path, config).clean


@pytest.mark.parametrize("when, deletes", [("04", True), ("4", True), ("1;4", True), ("+4", True), ("04;", True),
                                           ("05", False), ("3;5", False)])
def test_delete_when_names_hours_as_rocketmq_parses_them(tmp_path, when, deletes):
    """deleteWhen=4 is 04:00 to RocketMQ (Integer.parseInt of each ';' piece); compared as text with "%H" it never
    matched, and expired segments were never deleted."""
    config = StoreConfig(mapped_file_size_commit_log=4096, max_hash_slot_num=97, max_index_num=500,
                         file_reserved_time=0, delete_when=when)
    with MessageStore.open(tmp_path / "s", config) as store:
        for _ in range(40):
            store.put_message(Message("T", b"x" * 500))
        store.wait_for_dispatch()
        segments = len(list((tmp_path / "s" / "commitlog").iterdir()))
        four_thirty = time.mktime((*time.localtime(time.time() + 86_400)[:3], 4, 30, 0, 0, 0, -1))
        report = store.delete_expired_files(now_ms=int(four_thirty * 1000))
        assert len(report.commit_log_files) == (segments - 1 if deletes else 0), (when, report)


@pytest.mark.parametrize("when", [" 4", "4am", "24", "", "04;;16", "-1"])
def test_delete_when_that_never_matches_is_refused(when):
    from rocketstore.errors import ConfigError

    with pytest.raises(ConfigError, match="delete_when"):
        StoreConfig(delete_when=when)


@pytest.mark.parametrize("read_only", [True, False])
@pytest.mark.parametrize("call", ["get_message", "query_message", "query_messages_arrow", "query_message_by_uniq_key",
                                  "view_message_by_id", "look_message_by_offset", "get_offset_in_queue_by_time"])
def test_a_read_racing_close_raises_store_closed(tmp_path, small_config, monkeypatch, read_only, call):
    """A read in one thread while another closed the store met the unmapped files and raised numpy's or mmap's
    ValueError ("mmap closed or invalid"): a read-only close unmaps at once (the concurrency review). Here the close
    lands inside the call, just before the read touches the files."""
    with MessageStore.open(tmp_path, small_config) as writer:
        results = put_many(writer, 40, size=200)
        writer.wait_for_dispatch()
    store = MessageStore.open(tmp_path, small_config, read_only=read_only)
    first = results[0]
    calls = {"get_message": lambda: store.get_message("Topic0", 0, 0),
             "query_message": lambda: store.query_message("Topic0", "key-0"),
             "query_messages_arrow": lambda: store.query_messages_arrow([("Topic0", "key-0")]),
             "query_message_by_uniq_key": lambda: store.query_message_by_uniq_key("Topic0", first.uniq_key),
             "view_message_by_id": lambda: store.view_message_by_id(first.msg_id),
             "look_message_by_offset": lambda: store.look_message_by_offset(first.commit_log_offset),
             "get_offset_in_queue_by_time": lambda: store.get_offset_in_queue_by_time("Topic0", 0,
                                                                                      first.store_timestamp)}
    calls[call]()  # answers while open
    target = store.commit_log if call == "look_message_by_offset" else store.reader
    inner = {"look_message_by_offset": "get_message", "get_message": "get_message", "query_message": "query_message",
             "query_messages_arrow": "query_many", "query_message_by_uniq_key": "query_by_uniq_key",
             "view_message_by_id": "view_message_by_id", "get_offset_in_queue_by_time": "offset_by_time"}[call]
    real = getattr(target, inner)

    def closing_first(*args, **kwargs):
        store.close()
        return real(*args, **kwargs)

    monkeypatch.setattr(target, inner, closing_first)
    with pytest.raises(StoreClosedError, match="was closed while"):
        calls[call]()


def test_a_maintenance_task_that_keeps_failing_is_said_once_and_others_go_on(tmp_path, small_config, caplog,
                                                                              monkeypatch):
    """Maintenance said "works again" after every pass in which the failing task was not due, so an error that
    never passed was logged again every few seconds (the fix review); and a checkpoint that failed kept the offsets
    and retention of the same pass from running. Each task has its own account now."""
    from rocketstore.errors import StoreIOError

    config = dataclasses.replace(small_config, flush_consumer_offset_interval=30, flush_interval_consume_queue=10,
                                 flush_consume_queue_thorough_interval=20)
    store = MessageStore.open(tmp_path, config)
    try:
        def full(force=False):
            raise StoreIOError(28, "No space left on device")

        checkpoints = []
        real_checkpoint = store.checkpoint_now
        monkeypatch.setattr(store.consumer_offsets, "persist", full)
        monkeypatch.setattr(store, "checkpoint_now", lambda: checkpoints.append(real_checkpoint()))
        with caplog.at_level("INFO", logger="rocketstore.store"):
            time.sleep(0.6)  # about 20 offsets passes, 30 checkpoints
        lines = [r.getMessage() for r in caplog.records if "store maintenance" in r.getMessage()]
        assert lines == ["store maintenance (offsets) failed, the next pass retries: [Errno 28] No space left on "
                         "device"], lines
        assert len(checkpoints) >= 3  # the checkpoints went on beside the failing task (about 30 unloaded)
    finally:
        monkeypatch.undo()
        store.close()

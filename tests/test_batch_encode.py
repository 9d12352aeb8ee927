"""The column-wise encoder and ``MessageStore.put_batch``.

The batch encoder must write exactly the bytes the per-message encoder writes (hypothesis, every field
the table can carry), reject a bad row before anything is written, and put rows where they can be read
back every way: by queue, by key, by UNIQ_KEY and msgId, across segment boundaries, under SYNC_FLUSH.
"""

from __future__ import annotations

import hashlib
import threading
import zlib
from pathlib import Path
from unittest import mock

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rocketstore import FlushDiskType, Message, MessageStore, PutMessageStatus, StoreConfig
from rocketstore.codec.batch_encode import BatchEncoder
from rocketstore.codec.msgid import decode_uniq_key
from rocketstore.codec.scratch import KEEP_MAX, scratch
from rocketstore.encoder import MessageEncoder
from rocketstore.errors import (
    InvalidFlagError,
    InvalidPropertyError,
    InvalidQueueError,
    InvalidTopicError,
    MessageIllegalError,
    MessageTooLargeError,
    TopicNotExistError,
)

NOW = 1_790_000_000_123
SMALL = StoreConfig(mapped_file_size_commit_log=16 * 1024, mapped_file_size_consume_queue=20 * 64,
                    max_hash_slot_num=97, max_index_num=2000)

topics = st.sampled_from(["TopicA", "T", "%RETRY%group", "x" * 127, "%RETRY%" + "g" * 200, "Orders_1"])  # V2 too
texts = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x01\x02 "), min_size=1,
                max_size=12)
props = st.dictionaries(st.sampled_from(["a", "b", "ORDER", "TAGS", "DELAY", "WAIT", "zz"]), texts, max_size=4)
rows = st.lists(st.fixed_dictionaries({
    "topic": topics,
    "body": st.one_of(st.binary(max_size=300), st.binary(min_size=300, max_size=1500)),  # both CRC paths
    "keys": st.lists(texts, max_size=3),
    "tags": st.one_of(st.none(), texts),
    "queue_id": st.integers(0, 7),
    "flag": st.integers(-(1 << 31), (1 << 31) - 1),
    "born_timestamp": st.integers(0, 1 << 45),
    "born_host": st.sampled_from([None, "10.0.0.7:4000", "[2001:db8::1]:9876"]),
    "properties": st.one_of(st.none(), props),
    # a copied message's rarer fields (an import): a compressed body, MULTI_TAGS, a committed transaction, a retry
    "sys_flag": st.one_of(st.just(0), st.sampled_from([0x1, 0x2, 0x4, 0x8, 0xC, 0x101, 0x301, 0x20B])),
    "reconsume_times": st.one_of(st.just(0), st.integers(-(1 << 31), (1 << 31) - 1)),
    "prepared_transaction_offset": st.one_of(st.just(0), st.integers(-(1 << 63), (1 << 63) - 1)),
}), min_size=1, max_size=12)


def table_of(items: list[dict]) -> pa.Table:
    return pa.table({
        "topic": pa.array([r["topic"] for r in items], pa.string()),
        "body": pa.array([r["body"] for r in items], pa.binary()),
        "keys": pa.array([r["keys"] for r in items], pa.list_(pa.string())),
        "tags": pa.array([r["tags"] for r in items], pa.string()),
        "queue_id": pa.array([r["queue_id"] for r in items], pa.int32()),
        "flag": pa.array([r["flag"] for r in items], pa.int32()),
        "born_timestamp": pa.array([r["born_timestamp"] for r in items], pa.int64()),
        "born_host": pa.array([r["born_host"] for r in items], pa.string()),
        "properties": pa.array([list((r["properties"] or {}).items()) for r in items],
                               pa.map_(pa.string(), pa.string())),
        **{name: pa.array([r.get(name, 0) for r in items], kind)
           for name, kind in (("sys_flag", pa.int32()), ("reconsume_times", pa.int32()),
                              ("prepared_transaction_offset", pa.int64()))},
    })


def message_of(r: dict) -> Message:
    return Message(r["topic"], r["body"], tags=r["tags"], keys=r["keys"], properties=r["properties"],
                   queue_id=r["queue_id"], flag=r["flag"], born_timestamp=r["born_timestamp"],
                   born_host=r["born_host"], sys_flag=r.get("sys_flag", 0), reconsume_times=r.get("reconsume_times", 0),
                   prepared_transaction_offset=r.get("prepared_transaction_offset", 0))


def usable(r: dict) -> bool:
    p = r["properties"] or {}
    if "TAGS" in p and r["tags"] not in (None, "") and p["TAGS"] != r["tags"]:
        return False  # a conflict both encoders reject; the error test covers it
    return "DELAY" not in p or is_int(p["DELAY"])


def is_int(text: str) -> bool:
    """What both encoders accept as a delay level (``int``: not every ``isdigit`` character, e.g. '²')."""
    try:
        int(text)
    except ValueError:
        return False
    return True


def shaped(items: list[dict], shape: str, cut: int) -> pa.Table:
    """The same rows as Arrow hands them over in practice: a slice of a bigger table (buffers that start
    before the rows), several chunks, or keys as large_list."""
    if shape == "sliced":
        filler = [dict(items[0], keys=["pad"], tags="pad")] * cut
        return table_of(filler + items + filler).slice(cut, len(items))
    if shape == "chunked":
        k = cut % (len(items) + 1)
        return pa.concat_tables([table_of(items[:k]), table_of(items[k:])])
    if shape == "large_list":
        table = table_of(items)
        return table.set_column(table.schema.get_field_index("keys"), "keys",
                                table.column("keys").cast(pa.large_list(pa.string())))
    return table_of(items)


@pytest.mark.parametrize("store_host", ["127.0.0.1:10911", "[::1]:10911"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(items=rows, prop_crc=st.booleans(), shape=st.sampled_from(["plain", "sliced", "chunked", "large_list"]),
       cut=st.integers(1, 5))
def test_batch_and_single_encoders_write_the_same_bytes(items, prop_crc, store_host, shape, cut):
    items = [r for r in items if usable(r)]
    if not items:
        return
    config = StoreConfig(enabled_append_prop_crc=prop_crc, store_host=store_host)
    single = MessageEncoder(config)
    batch = BatchEncoder(MessageEncoder(config))
    state = single.uniq_keys.state
    batch.encoder.uniq_keys = single.uniq_keys  # the same generator, rewound between the two runs
    poison_scratch()
    with mock.patch("time.time_ns", return_value=NOW * 1_000_000):
        encoded = batch.encode(shaped(items, shape, cut))
        single.uniq_keys.state = state
        records = [single.encode(message_of(r)) for r in items]
    assert bytes(encoded.data) == b"".join(bytes(rec.data) for rec in records)
    assert encoded.uniq_keys.to_pylist() == [rec.uniq_key for rec in records]
    assert [encoded.topics[i] for i in encoded.topic_index] == [rec.topic for rec in records]
    assert encoded.queue_ids.tolist() == [rec.queue_id for rec in records]


def poison_scratch() -> None:
    """Fill this thread's encode buffer with bytes no encoder writes there, so a byte an encoder leaves
    unwritten shows up as a difference instead of as the previous put's byte."""
    view = scratch(1 << 20)
    view[:] = b"\xa5" * len(view)


def test_each_thread_reuses_its_own_scratch_buffer():
    first = scratch(1000)
    assert scratch(500).obj is first.obj  # kept between puts: no new pages to fault in
    grown = scratch(10_000)
    assert len(grown) == 10_000 and scratch(10).obj is grown.obj
    other = []
    thread = threading.Thread(target=lambda: other.append(scratch(1000).obj))
    thread.start()
    thread.join()
    assert other[0] is not grown.obj  # another thread never writes into this one's records
    huge = scratch(KEEP_MAX + 1)
    assert len(huge) == KEEP_MAX + 1 and scratch(10).obj is grown.obj  # a huge put is not kept


def test_puts_after_a_bigger_put_keep_every_byte(tmp_path):
    """The scratch buffer holds an older, larger put's bytes: a later put's records are exactly its own."""
    with MessageStore.open(tmp_path, StoreConfig()) as store:
        store.put_messages([Message("T", b"\xee" * 5000, tags="old", keys=["old"]) for _ in range(8)])
        store.put_batch(pa.table({"topic": ["T"] * 8, "body": [b"\xee" * 5000] * 8}))
        small = [Message("T", bytes([i]) * 10, tags=f"t{i}", keys=[f"k{i}"]) for i in range(8)]
        phys = [r.commit_log_offset for r in store.put_messages(small)]
        phys += store.put_batch(pa.table({"topic": ["T"] * 8, "body": [m.body for m in small],
                                          "tags": [m.tags for m in small],
                                          "keys": [m.keys for m in small]})).commit_log_offsets.tolist()
        size = len(MessageEncoder(StoreConfig()).encode(small[0]).data)
        for msg, phy in zip(small + small, phys, strict=True):
            got = store.look_message_by_offset(phy)
            assert got.store_size == size and got.body_crc == zlib.crc32(msg.body) & 0x7FFFFFFF
            assert (got.body, got.tags, got.keys) == (msg.body, msg.tags, msg.keys)


def fast_table(n: int, start: int = 0, topics: int = 3) -> pa.Table:
    return pa.table({
        "topic": pa.array([f"Topic{i % topics}" for i in range(start, start + n)]),
        "body": pa.array([hashlib.sha256(str(i).encode()).digest() * (1 + i % 4) for i in range(start, start + n)]),
        "keys": pa.array([[f"k{i}", f"g{i % 10}"] for i in range(start, start + n)], pa.list_(pa.string())),
        "tags": pa.array([f"Tag{i % 2}" if i % 3 else None for i in range(start, start + n)], pa.string()),
        "queue_id": pa.array([i % 4 for i in range(start, start + n)], pa.int32()),
    })


@pytest.mark.parametrize("mode", [FlushDiskType.ASYNC_FLUSH, FlushDiskType.SYNC_FLUSH])
def test_put_batch_round_trip_across_segments(tmp_path, mode):
    config = SMALL.replace(flush_disk_type=mode)
    with MessageStore.open(tmp_path, config) as store:
        first = store.put_message(Message("Topic0", b"before", queue_id=0))
        result = store.put_batch(fast_table(300))  # ~20 KiB of records per 16 KiB segment: several appends
        assert result.status is PutMessageStatus.PUT_OK and len(result) == 300
        store.wait_for_dispatch()
        offsets = result.commit_log_offsets.tolist()
        assert offsets == sorted(offsets) and offsets[0] > first.commit_log_offset
        assert len({o // config.mapped_file_size_commit_log for o in offsets}) > 3
        table = fast_table(300).to_pylist()
        for i in (0, 1, 2, 150, 299):
            msg = store.look_message_by_offset(offsets[i])
            assert (msg.topic, msg.body, msg.keys, msg.tags, msg.queue_id) == \
                (table[i]["topic"], table[i]["body"], table[i]["keys"], table[i]["tags"], table[i]["queue_id"])
            assert msg.queue_offset == result.queue_offsets[i]
            assert msg.msg_id == result.msg_ids[i].as_py() and msg.uniq_key == result.uniq_keys[i].as_py()
            assert msg.store_timestamp == result.store_timestamp
            assert [m.commit_log_offset for m in store.query_message(msg.topic, f"k{i}")] == [offsets[i]]
            assert store.query_message_by_uniq_key(msg.topic, msg.uniq_key)[0].commit_log_offset == offsets[i]
            assert store.view_message_by_id(msg.msg_id).commit_log_offset == offsets[i]
        got = store.get_message("Topic0", 0, 0, max_msgs=1000).messages
        assert [m.body for m in got] == [b"before"] + [r["body"] for r in table if (r["topic"], r["queue_id"]) ==
                                                       ("Topic0", 0)]
        assert [m.queue_offset for m in got] == list(range(len(got)))
        assert result.to_arrow().num_rows == 300
    with MessageStore.open(tmp_path, config) as reopened:  # and after a clean reopen
        assert sum(1 for _ in reopened.iter_messages()) == 301


@settings(max_examples=200, deadline=None)
@given(keys=st.lists(st.one_of(st.integers(0, 40), st.integers(-(1 << 63), (1 << 63) - 1)), max_size=300))
def test_queue_groups_numbers_keys_by_first_appearance_and_ranks_rows(keys):
    """The compiled grouping behind put_batch's queue offsets, against a dict: wide keys make its open-addressing
    table probe, small ones repeat."""
    from rocketstore.codec._kernels import queue_groups

    group, rank, group_keys, counts = queue_groups(np.array(keys, dtype=np.int64))
    numbering: dict[int, int] = {}
    seen: dict[int, int] = {}
    want_group, want_rank = [], []
    for key in keys:
        want_group.append(numbering.setdefault(key, len(numbering)))
        want_rank.append(seen.get(key, 0))
        seen[key] = want_rank[-1] + 1
    assert group.tolist() == want_group and rank.tolist() == want_rank
    assert group_keys.tolist() == list(numbering) and counts.tolist() == [seen[k] for k in numbering]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(puts=st.lists(st.lists(st.tuples(st.sampled_from(["A", "B", "C"]), st.integers(0, 5)), min_size=1,
                              max_size=60), min_size=1, max_size=4))
def test_put_batch_queue_offsets_run_on_per_queue_across_puts(tmp_path_factory, puts):
    expected_next: dict[tuple[str, int], int] = {}
    with MessageStore.open(tmp_path_factory.mktemp("q"), SMALL) as store:
        for rows_ in puts:
            result = store.put_batch(pa.table({"topic": [t for t, _q in rows_], "body": [b"x" * 700] * len(rows_),
                                               "queue_id": pa.array([q for _t, q in rows_], pa.int32())}))
            want = []
            for queue in rows_:
                want.append(expected_next.get(queue, 0))
                expected_next[queue] = want[-1] + 1
            assert result.queue_offsets.tolist() == want
        assert {q: store.next_queue_offset(*q) for q in expected_next} == expected_next


@pytest.mark.parametrize("shape", ["one queue", "own queues", "mixed"])
def test_put_messages_queue_offsets_run_on_per_queue(tmp_path, shape):
    queues = {"one queue": [("TopicA", 2)] * 8, "own queues": [("TopicA", q) for q in range(8)],
              "mixed": [("TopicA", 0), ("TopicB", 1), ("TopicA", 0), ("TopicA", 1)] * 2}[shape]
    with MessageStore.open(tmp_path, SMALL) as store:
        for put in range(3):
            result = store.put_messages([Message(t, b"m", queue_id=q) for t, q in queues])
            seen: dict[tuple[str, int], int] = {}
            want = []
            for queue in queues:
                want.append(put * queues.count(queue) + seen.get(queue, 0))
                seen[queue] = seen.get(queue, 0) + 1
            assert [r.queue_offset for r in result] == want
        store.wait_for_dispatch(10)
        for topic, queue in set(queues):
            got = store.get_message(topic, queue, 0, 100)
            assert [m.queue_offset for m in got.messages] == list(range(3 * queues.count((topic, queue))))


def store_bytes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name not in ("lock", "abort")}


@pytest.mark.parametrize(("column", "value", "error", "row"), [
    ("topic", "bad/topic", InvalidTopicError, 5),
    ("keys", ["has space"], InvalidPropertyError, 5),
    ("keys", [""], InvalidPropertyError, 5),
    ("tags", "a\x01b", InvalidPropertyError, 5),
    ("body", b"x" * (4 * 1024 * 1024 + 1), MessageTooLargeError, 5),
    ("queue_id", 100_000, InvalidQueueError, None),
])
def test_a_bad_row_is_named_and_nothing_is_written(tmp_path, column, value, error, row):
    with MessageStore.open(tmp_path, SMALL) as store:
        store.create_topic("Topic0", 4)
        store.put_batch(fast_table(10))
        store.wait_for_dispatch()
        before = store_bytes(tmp_path)
        end = store.max_phy_offset
        data = fast_table(10, start=10).to_pylist()
        data[5][column] = value
        schema = fast_table(1).schema
        with pytest.raises(error) as caught:
            store.put_batch(pa.Table.from_pylist(data, schema=schema))
        if row is not None:
            assert f"row {row}" in str(caught.value)
        assert store.max_phy_offset == end
    after = store_bytes(tmp_path)
    changed = {k for k in before if before[k] != after.get(k)} - {"checkpoint"}
    assert not {k for k in changed if k.startswith(("commitlog", "consumequeue", "index"))}


def test_bad_columns_and_properties(tmp_path):
    with MessageStore.open(tmp_path, SMALL.replace(auto_create_topic_enable=False)) as store:
        with pytest.raises(MessageIllegalError, match="column"):
            store.put_batch(pa.table({"topic": ["T"]}))
        with pytest.raises(MessageIllegalError, match="does not know"):
            store.put_batch(pa.table({"topic": ["T"], "body": [b"x"], "colour": ["red"]}))
        with pytest.raises(TopicNotExistError):
            store.put_batch(pa.table({"topic": ["T"], "body": [b"x"]}))
        store.create_topic("T", 2)
        with pytest.raises(InvalidFlagError, match="row 1"):
            store.put_batch(pa.table({"topic": ["T", "T"], "body": [b"x", b"y"], "flag": pa.array([1, 1 << 40])}))
        bad_props = pa.array([[("a", "1")], [("b", "x\x02y")]], pa.map_(pa.string(), pa.string()))
        with pytest.raises(InvalidPropertyError, match="row 1"):
            store.put_batch(pa.table({"topic": ["T", "T"], "body": [b"x", b"y"], "properties": bad_props}))
        assert store.max_phy_offset == 0
        result = store.put_batch(pa.table({"topic": ["T"], "body": [b"x"], "keys": ["a b  c"]}))
        store.wait_for_dispatch()
        assert store.look_message_by_offset(int(result.commit_log_offsets[0])).keys == ["a", "b", "c"]


def test_delayed_rows_go_to_the_schedule_topic_and_are_findable_by_key(tmp_path):
    props = pa.array([[("DELAY", "2")], []], pa.map_(pa.string(), pa.string()))
    with MessageStore.open(tmp_path, SMALL) as store:
        result = store.put_batch(pa.table({"topic": ["Late", "Now"], "body": [b"later", b"now"],
                                           "keys": [["late-1"], ["now-1"]], "properties": props}))
        store.wait_for_dispatch()
        late = store.look_message_by_offset(int(result.commit_log_offsets[0]))
        assert late.topic == "SCHEDULE_TOPIC_XXXX" and late.queue_id == 1
        assert late.properties["REAL_TOPIC"] == "Late"
        assert [m.body for m in store.query_message("Late", "late-1")] == [b"later"]
        # the stored topic goes through the topic rules too, as with put_message: it exists now
        assert store.topic_config.get("SCHEDULE_TOPIC_XXXX").write_queue_nums == len(SMALL.delay_levels_ms)


def test_put_batch_columns_come_back_through_scan_arrow(tmp_path):
    table = fast_table(500)
    with MessageStore.open(tmp_path, SMALL) as store:
        result = store.put_batch(table)
        scanned = pa.Table.from_batches(list(store.scan_arrow(max_rows=64)))
    assert scanned.num_rows == 500
    assert scanned.column("topic").to_pylist() == table.column("topic").to_pylist()
    assert scanned.column("body").to_pylist() == table.column("body").to_pylist()
    assert scanned.column("tags").to_pylist() == table.column("tags").to_pylist()
    assert scanned.column("keys").to_pylist() == table.column("keys").to_pylist()
    assert scanned.column("queueId").to_pylist() == table.column("queue_id").to_pylist()
    assert scanned.column("queueOffset").to_pylist() == result.queue_offsets.tolist()
    assert scanned.column("commitLogOffset").to_pylist() == result.commit_log_offsets.tolist()
    assert scanned.column("msgId").to_pylist() == result.msg_ids.to_pylist()
    assert scanned.column("uniqKey").to_pylist() == result.uniq_keys.to_pylist()
    with MessageStore.open(tmp_path, SMALL, read_only=True) as store:  # read-only opens scan too
        assert sum(b.num_rows for b in store.scan_arrow(topics=["Topic1"], include_body=False)) == \
            sum(1 for t in table.column("topic").to_pylist() if t == "Topic1")


def test_the_compiled_encoder_refuses_sizes_that_disagree_with_the_pieces():
    """numba does not check bounds: a record whose pieces do not add up to its size is refused before a byte of
    it is written."""
    import numpy as np

    from rocketstore.codec._kernels import encode_v1

    body, topic, props = b"hello", b"T", b"TAGS\x01a\x02"
    size = 88 + len(body) + 1 + len(topic) + 2 + len(props)

    def run(sizes, room, body_off=None, props_off=None, topic_index=None, queue_ids=None, strided=False):
        out = np.zeros(2 * room if strided else room, dtype=np.uint8)
        n = len(sizes)
        written = encode_v1(out[::2] if strided else out, np.array(sizes, np.int64),
                            np.arange(n + 1, dtype=np.int32) * len(body) if body_off is None else body_off,
                            np.frombuffer(body * n, np.uint8),
                            np.arange(n + 1, dtype=np.int32) * len(props) if props_off is None else props_off,
                            np.frombuffer(props * n, np.uint8), np.array([0, 1], np.int64),
                            np.frombuffer(topic, np.uint8),
                            np.zeros(n, np.int64) if topic_index is None else topic_index,
                            np.zeros(n, np.int64) if queue_ids is None else queue_ids,
                            np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros((n, 8), np.uint8),
                            np.zeros(8, np.uint8))
        return written, out

    assert run([size, size], 2 * size)[0] == 2 * size
    written, out = run([size, size - 1], 2 * size)
    assert written == -1 and not out[size:].any()
    written, out = run([size, size], 2 * size - 1)  # the output is one byte short
    assert written == -1 and not out[size:].any()
    # the pieces are copied unchecked (memmove): offsets outside their buffers are refused before any copy
    shifted = np.array([0, len(body), 2 * len(body) + 1], np.int32)  # the last body would end past the data
    assert run([size, size + 1], 2 * size + 1, body_off=shifted)[0] == -1
    backwards = np.array([0, len(props), 0], np.int32)
    assert run([size, size - len(props) * 2], 2 * size, props_off=backwards)[0] == -1
    assert run([size, size], 2 * size, topic_index=np.array([0, 1], np.int64))[0] == -1  # one topic only
    assert run([size, size], 2 * size, topic_index=np.array([0, -1], np.int64))[0] == -1
    assert run([size, size], 2 * size, queue_ids=np.zeros(1, np.int64))[0] == -1  # a column one row short
    written, out = run([size, size], 2 * size, strided=True)  # an output that is not contiguous
    assert written == -1 and not out.any()


def test_the_compiled_copies_refuse_runs_outside_their_buffers():
    """``gather`` (the decoder's strings) and ``plain_properties`` (the encoder's) copy with memmove: a run
    outside its buffer raises instead of reading past it."""
    from rocketstore.codec._kernels import gather, plain_properties

    buf = np.arange(64, dtype=np.uint8)
    offsets, data = gather(buf, np.array([0, -1, 60], np.int64), np.array([3, 9, 4], np.int64))
    assert offsets.tolist() == [0, 3, 3, 7] and data.tolist() == [0, 1, 2, 60, 61, 62, 63]
    with pytest.raises(ValueError, match="outside"):
        gather(buf, np.array([0, 61], np.int64), np.array([3, 4], np.int64))
    with pytest.raises(ValueError, match="contiguous"):
        gather(buf[::2], np.array([0], np.int64), np.array([3], np.int64))

    def props(key_off, tags_off=(0, 1)):
        return plain_properties(np.zeros((1, 16), np.uint8), np.array(tags_off, np.int32),
                                np.frombuffer(b"t", np.uint8), np.ones(1, bool), np.array([0, 1], np.int32),
                                np.array(key_off, np.int32), np.frombuffer(b"key", np.uint8), np.ones(1, bool),
                                np.array([[0, 1, 2]] * 4, np.int64), 0)

    text = bytes(props([0, 3])[1]).decode()
    assert text == "UNIQ_KEY\x01" + "0" * 32 + "\x02TAGS\x01t\x02KEYS\x01key\x02"
    with pytest.raises(ValueError, match="key offset"):
        props([0, 4])
    with pytest.raises(ValueError, match="tags offset"):
        props([0, 3], tags_off=(1, 0))


def test_the_plain_put_kernel_refuses_lengths_that_disagree_with_its_blob():
    """``encode_plain_v1`` sizes records from the lengths it is given and builds each row's properties string
    (UNIQ_KEY from a head and a wrapping counter, TAGS and KEYS when present, the CRC's reserve): lengths that do
    not add up to the blob, a topic code out of range, a counter past 16 bits or an output one byte short are
    refused with nothing written past the output."""
    from rocketstore.codec._kernels import encode_plain_v1

    body, topic, head = b"hello", b"T", b"0A0B0C0D"
    tags, keys = [b"a", b""], [b"", b"k1 k2"]
    props = [b"UNIQ_KEY\x010A0B0C0DFFFF\x02TAGS\x01a\x02\0\0", b"UNIQ_KEY\x010A0B0C0D0000\x02KEYS\x01k1 k2\x02\0\0"]
    sizes = [88 + len(body) + 1 + len(topic) + 2 + len(p) for p in props]
    store_host = bytes([127, 0, 0, 1, 0, 0, 0x2A, 0x9F])

    full, head_size, topic_size = sum(sizes), len(head), len(topic)

    def run(body_lens, codes=(0, 0), room=full, blob_extra=b"", first=0xFFFF, head_len=head_size, tags=tags,
            topic_len=topic_size):
        n = len(body_lens)
        meta = np.zeros(8 * n + 2 + 3, dtype=np.int64)
        meta[0:n] = body_lens
        meta[n : 2 * n] = list(map(len, tags))
        meta[2 * n : 3 * n] = list(map(len, keys))
        meta[3 * n : 4 * n] = codes
        meta[4 * n : 5 * n] = [3, 5]
        meta[7 * n : 7 * n + 4] = [topic_len, first, 2, head_len]
        blob = body * n + b"".join(tags) + b"".join(keys) + topic + bytes(8 * n) + store_host + head + blob_extra
        out = np.zeros(room, dtype=np.uint8)
        written = encode_plain_v1(out, meta, np.frombuffer(blob, np.uint8), n, 1)
        return written, out, meta

    written, out, meta = run([len(body), len(body)])
    assert written == sum(sizes)
    assert meta[7 * 2 + 4 : 8 * 2 + 4].tolist() == sizes and meta[-1] == 5  # sizes, highest queue id
    assert bytes(out[64:72]) == store_host
    assert bytes(out[sizes[0] - len(props[0]) : sizes[0]]) == props[0] and bytes(out[-len(props[1]) :]) == props[1]
    two = [len(body)] * 2
    for bad in ({"body_lens": [len(body), len(body) - 1]}, {"body_lens": two, "codes": (0, 1)},
                {"body_lens": two, "blob_extra": b"x"}, {"body_lens": two, "room": sum(sizes) - 1},
                {"body_lens": two, "first": 0x10000}, {"body_lens": two, "head_len": len(head) - 1},
                # a negative topic length that the blob's total hides; a properties string past a short's range
                {"body_lens": two, "topic_len": -1, "tags": [b"aT", b""], "blob_extra": b"x"},
                {"body_lens": two, "tags": [b"a" * 0x7FFF, b""]}):
        written, out, _ = run(**bad)
        assert written == -1 and not out[sizes[0] :].any()


# --- put_messages: the same compiled loop for lists of Message ---------------------------------------------

nasty = st.text(st.characters(blacklist_categories=("Cs",)), max_size=6)  # separators and spaces too
plain_message = st.builds(
    Message,
    topic=st.sampled_from(["TopicA", "T", "Orders_1"]),
    body=st.binary(max_size=300),
    tags=st.one_of(st.none(), st.just(""), texts),
    keys=st.one_of(st.just(()), st.lists(texts, max_size=3), st.tuples(texts, texts)),
    queue_id=st.integers(0, 7),
    flag=st.integers(-(1 << 31), (1 << 31) - 1),
    born_timestamp=st.one_of(st.none(), st.integers(0, 1 << 45)),
    born_host=st.sampled_from([None, "10.0.0.7:4000"]),
)
UNUSUAL = {  # per field, values that ``encode`` takes the long way or refuses
    "topic": ["%RETRY%" + "g" * 200, "bad/topic", "NewTopic", 7],
    "body": ["text body", bytearray(b"ba"), None, b"x" * (4 * 1024 * 1024 + 1)],
    "tags": ["a\x01b", "a\x02", 5, "has space"],
    "keys": ["a b", ["has space"], [""], ["a\x01"], ["a\x02"], [1], "single", ("a", "b"), [["nested"]]],
    "properties": [{"a": "1"}, {"DELAY": "2"}, {"UNIQ_KEY": "0A0B"}, {"x": "a\x02"}],
    "queue_id": [-1, 1 << 31, True, 1.0],
    "flag": [1 << 31, -(1 << 31) - 1, 1.0, None],
    "sys_flag": [0x4, 0x8, 0x1000, 1.0],
    "born_timestamp": [1 << 63, -(1 << 63) - 1, "now", 1.5, 1 << 62, -(1 << 62)],
    "born_host": ["[2001:db8::1]:9876", "10.1.1.1:1", "no-port", 12],
    "reconsume_times": [1, 1 << 40, 0.0],
    "prepared_transaction_offset": [5, -1, 1 << 63, 0.0],
}
unusual = {field: st.sampled_from(values) for field, values in UNUSUAL.items()}


@st.composite
def messages(draw):
    """Mostly puts the batch pass takes whole; half with one message, anywhere, with one unusual field."""
    msgs = draw(st.lists(plain_message, min_size=1, max_size=12))  # below BATCH_PASS_MIN: the per-message path
    if draw(st.booleans()):
        odd = draw(plain_message)
        field = draw(st.sampled_from(sorted(unusual)))
        setattr(odd, field, draw(unusual[field]))
        msgs.insert(draw(st.integers(0, len(msgs))), odd)
    return msgs


def outcome(encode):
    try:
        return encode()
    except MessageIllegalError as exc:
        return type(exc)


@pytest.mark.parametrize("store_host", ["127.0.0.1:10911", "[::1]:10911"])
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(msgs=messages(), prop_crc=st.booleans(), counter=st.sampled_from([None, 0xFFF8]))
def test_encode_many_writes_what_encode_writes(msgs, prop_crc, counter, store_host):
    """``put_messages``' encoder (one columnar pass + ``encode_plain_v1`` for plain messages, ``encode`` for the
    rest) against ``encode`` per message: same bytes, same record facts, the same error type for a bad message; a
    UNIQ_KEY counter about to wrap wraps the same way."""
    single, many = encoders(StoreConfig(enabled_append_prop_crc=prop_crc, store_host=store_host))
    same_outcome(single, many, msgs, single.uniq_keys.state[0] if counter is None else counter)


def encoders(config: StoreConfig | None = None) -> tuple[MessageEncoder, MessageEncoder]:
    """Two encoders that know the same topics and born hosts and share one UNIQ_KEY generator."""
    single, many = MessageEncoder(config or StoreConfig()), MessageEncoder(config or StoreConfig())
    for warm in (many, single):  # known topics and born hosts: what the batch pass needs to take a message
        for topic in ("TopicA", "T", "Orders_1"):
            warm.encode(Message(topic, b"", born_host="10.0.0.7:4000"))
    many.uniq_keys = single.uniq_keys
    return single, many


def same_outcome(single: MessageEncoder, many: MessageEncoder, msgs: list[Message], counter: int) -> None:
    with mock.patch("time.time_ns", return_value=NOW * 1_000_000):
        single.uniq_keys.state = (counter, -1)
        poison_scratch()
        pending = outcome(lambda: many.encode_many(msgs))
        single.uniq_keys.state = (counter, -1)
        records = outcome(lambda: [single.encode(m) for m in msgs])
    if isinstance(records, type) or isinstance(pending, type):
        assert pending is records
        return
    assert bytes(pending.data) == b"".join(bytes(rec.data) for rec in records)
    assert list(pending.sizes) == [rec.size for rec in records]
    assert list(pending.topics) == [rec.topic for rec in records]
    assert list(pending.queue_ids) == [rec.queue_id for rec in records]
    assert list(pending.store_ts_pos) == [rec.store_ts_pos for rec in records]
    assert list(pending.takes_queue_offset) == [rec.takes_queue_offset for rec in records]
    assert list(pending.uniq_keys) == [rec.uniq_key for rec in records]
    assert pending.wait_store == any(rec.wait_store for rec in records)
    highest: dict[str, int] = {}
    for topic, queue_id in [(m.topic, m.queue_id) for m in msgs] + [(r.topic, r.queue_id) for r in records]:
        highest[topic] = max(highest.get(topic, 0), queue_id)
    assert dict(pending.queue_checks) == highest


@pytest.mark.parametrize(("field", "value"), [(f, v) for f, values in UNUSUAL.items() for v in values])
def test_one_unusual_message_is_encoded_or_refused_as_encode_does(field, value):
    single, many = encoders()
    msgs = [Message("TopicA", b"body", tags="TagA", keys=[f"k{i}"], queue_id=i) for i in range(5)]
    setattr(msgs[2], field, value)
    same_outcome(single, many, msgs, 100)


@st.composite
def one_message(draw):
    """A plain message, or one with one unusual field: ``put_message``'s single-message pass or ``encode``."""
    msg = draw(plain_message)
    if draw(st.booleans()):
        field = draw(st.sampled_from(sorted(unusual)))
        setattr(msg, field, draw(unusual[field]))
    return msg


@pytest.mark.parametrize("store_host", ["127.0.0.1:10911", "[::1]:10911"])
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(msg=one_message(), prop_crc=st.booleans(), counter=st.sampled_from([None, 0xFFFF]))
def test_one_message_is_encoded_as_encode_does(msg, prop_crc, counter, store_host):
    single, many = encoders(StoreConfig(enabled_append_prop_crc=prop_crc, store_host=store_host))
    same_outcome(single, many, [msg], single.uniq_keys.state[0] if counter is None else counter)


def test_a_plain_put_of_few_messages_takes_the_one_pass_form():
    """The equivalence tests above would pass with the one-pass form never taken (one message, and two or three:
    below the compiled pass's minimum)."""
    encoder = MessageEncoder(StoreConfig())
    encoder.encode(Message("T", b"", born_host="10.0.0.7:4000"))
    plain = [Message("T", b"x" * 3, tags="TagA", keys=["k1"], queue_id=2), Message("T", b"", born_timestamp=5),
             Message("T", b"y", keys=[], tags="", born_host="10.0.0.7:4000"), Message("T", b"z", keys=None)]
    with mock.patch.object(MessageEncoder, "encode", side_effect=AssertionError("per-message path taken")):
        for msg in plain:
            pending = encoder.encode_many([msg])
            assert pending.queue_checks == [("T", msg.queue_id)] and len(pending.data) == pending.sizes[0]
        for few in (plain[:2], plain[1:4]):
            pending = encoder.encode_many(few)
            assert len(pending) == len(few) and len(pending.data) == sum(pending.sizes)
            assert pending.queue_checks == [("T", max(m.queue_id for m in few))]
        for msg in (Message("T", b"x", keys=["a", "b"]), Message("T", b"x", properties={"a": "b"})):
            with pytest.raises(AssertionError, match="per-message"):
                encoder.encode_many([msg])
            with pytest.raises(AssertionError, match="per-message"):  # one message the long way: all of them
                encoder.encode_many([plain[0], msg])


def test_plain_messages_take_the_compiled_pass(tmp_path):
    """Known topics, tags and keys, no user properties: no per-message ``encode`` at all (the equivalence test
    above would pass with the batch pass never taken)."""
    encoder = MessageEncoder(StoreConfig())
    msgs = [Message(f"Topic{i % 3}", b"x" * i, tags="TagA" if i % 2 else None, keys=[f"k{i}", "g"] if i % 3 else (),
                    queue_id=i % 4, born_host="10.0.0.7:4000" if i % 5 == 0 else None) for i in range(40)]
    for m in msgs[:5]:
        encoder.encode(m)
    with mock.patch.object(MessageEncoder, "encode", side_effect=AssertionError("per-message path taken")):
        pending = encoder.encode_many(msgs)
    assert len(pending) == 40 and sorted(pending.queue_checks) == [("Topic0", 3), ("Topic1", 3), ("Topic2", 3)]
    with mock.patch.object(MessageEncoder, "encode", side_effect=AssertionError("per-message path taken")), \
            pytest.raises(AssertionError, match="per-message"):
        encoder.encode_many([*msgs, Message("Topic0", b"x", properties={"a": "b"})])


def test_born_times_a_timestamp_column_cannot_hold_are_refused_by_every_put(tmp_path):
    """A put may not store what ``scan_arrow`` and the Spark source could not return (they read such a time as
    damage); the widest time they hold goes in and comes back exactly."""
    from rocketstore.codec.record import MAX_TIME_MS

    with MessageStore.open(tmp_path, SMALL) as store:
        stored = [store.put_message(Message("T", b"edge", born_timestamp=t)) for t in (MAX_TIME_MS, -MAX_TIME_MS)]
        end = store.max_phy_offset
        for bad in (MAX_TIME_MS + 1, -MAX_TIME_MS - 1, 1 << 62):
            with pytest.raises(InvalidFlagError, match="born_timestamp"):
                store.put_message(Message("T", b"x", born_timestamp=bad))
            with pytest.raises(InvalidFlagError, match="born_timestamp"):
                store.put_messages([Message("T", b"x", keys=[f"k{i}"]) for i in range(5)]
                                   + [Message("T", b"x", born_timestamp=bad)])
            with pytest.raises(InvalidFlagError, match="row 1: born_timestamp"):
                store.put_batch(pa.table({"topic": ["T", "T"], "body": [b"x", b"y"],
                                          "born_timestamp": pa.array([0, bad], pa.int64())}))
        assert store.max_phy_offset == end
        batch = pa.Table.from_batches(list(store.scan_arrow()))
    micros = batch.column("bornTimestamp").cast(pa.int64()).to_pylist()
    assert micros == [MAX_TIME_MS * 1000, -MAX_TIME_MS * 1000]
    assert batch.column("commitLogOffset").to_pylist() == [r.commit_log_offset for r in stored]


@pytest.mark.parametrize("column", ["tags", "body"])
def test_an_arrow_column_whose_offsets_leave_its_data_is_a_typed_error_and_writes_nothing(tmp_path, column):
    """``from_buffers`` checks only the last offset: a middle one past the data is refused before any kernel."""
    offsets = pa.py_buffer(np.array([0, 64, 3], np.int32).tobytes())
    kind = pa.string() if column == "tags" else pa.binary()
    bad = pa.Array.from_buffers(kind, 2, [None, offsets, pa.py_buffer(b"abc")])
    columns = {"topic": ["T", "T"], "body": [b"x", b"y"], column: bad}
    with MessageStore.open(tmp_path, StoreConfig()) as store:
        with pytest.raises(MessageIllegalError, match="not a valid Arrow array"):
            store.put_batch(pa.table(columns))
        assert store.max_phy_offset == 0


def test_a_topic_too_long_for_a_v1_record_is_refused_by_every_put(tmp_path):
    """With auto_message_version_on_topic_len off every record is V1, whose topic length is one signed byte:
    put_batch wrote a 200-byte %RETRY% topic's length as -56 and acknowledged it; every read and dispatch then
    failed, every later put was refused, and the reopen cut the acknowledged rows (the review)."""
    topic = "%RETRY%" + "g" * 193
    config = StoreConfig(mapped_file_size_commit_log=16 * 1024, max_hash_slot_num=97, max_index_num=2000,
                         auto_message_version_on_topic_len=False)
    with MessageStore.open(tmp_path, config) as store:
        store.put_message(Message("Before", b"x"))
        end = store.max_phy_offset
        with pytest.raises(InvalidTopicError, match="row 2: topic longer than 127 bytes"):
            store.put_batch(pa.table({"topic": ["Fine", "Fine", topic], "body": [b"a", b"b", b"c"]}))
        for put in (lambda: store.put_message(Message(topic, b"c")),
                    lambda: store.put_messages([Message("Fine", b"a")] * 4 + [Message(topic, b"c")])):
            with pytest.raises(InvalidTopicError, match="topic longer than 127 bytes"):
                put()
        assert store.max_phy_offset == end
        store.put_batch(pa.table({"topic": ["%RETRY%" + "g" * 120], "body": [b"127 bytes fit"]}))
        store.wait_for_dispatch()
    with MessageStore.open(tmp_path, config) as store:
        assert [m.body for m in store.iter_messages()] == [b"x", b"127 bytes fit"]


@settings(max_examples=60, deadline=None)
@given(takes=st.lists(st.tuples(st.sampled_from(["next", "hex", "raw"]), st.integers(1, 70_000)), min_size=1,
                      max_size=6),
       start=st.sampled_from([0, 1, 0xFFF0, 0xFFFF, 12345]), clock=st.lists(st.integers(0, 2), min_size=6,
                                                                               max_size=6))
def test_uniq_keys_never_repeat_however_many_one_millisecond_takes(takes, start, clock):
    """A block's ids share one time field, so a put of more than 65,536 rows (an ordinary put_batch) repeated its
    first ids: a consumer deduplicating by msgId dropped messages (the review). Ids are unique whatever mix of
    single ids, hex blocks and raw blocks a few milliseconds (or one) hand out, and their times never go back."""
    from rocketstore.codec.msgid import UniqKeyGenerator

    gen = UniqKeyGenerator("10.0.0.1")
    gen.state = (start, -1)
    now = NOW
    seen: list[str] = []
    for (kind, count), tick in zip(takes, clock, strict=False):
        now += tick
        if kind == "next":
            seen += [gen.next(now) for _ in range(min(count, 300))]
        elif kind == "hex":
            block = gen.hex_block(count, now)
            if block is None:  # it would wrap: the caller encodes one id at a time
                assert gen.state[0] + count > 0x10000
                continue
            head, first = block
            seen += [f"{head}{first + i:04X}" for i in range(count)]
        else:
            seen += [row.tobytes().hex().upper() for row in gen.raw_block(count, now)]
    assert len(set(seen)) == len(seen)
    times = [decode_uniq_key(u, NOW + 1000).timestamp for u in seen[:: max(1, len(seen) // 5000)]]
    assert times == sorted(times) and (not times or times[0] >= NOW)


def _bad_utf8_strings(count: int, bad_row: int) -> pa.Array:
    """``count`` one-character strings, row ``bad_row`` a lone 0xFF byte: what ``from_buffers`` lets through."""
    data = b"".join(b"\xff" if i == bad_row else b"k" for i in range(count))
    return pa.Array.from_buffers(pa.string(), count, [None, pa.py_buffer(np.arange(count + 1, dtype=np.int32)
                                                                          .tobytes()), pa.py_buffer(data)])


@pytest.mark.parametrize(("column", "error"), [("topic", InvalidTopicError), ("tags", InvalidPropertyError),
                                                ("keys", InvalidPropertyError), ("properties", InvalidPropertyError)])
def test_text_columns_that_are_not_utf8_are_refused_naming_the_row(tmp_path, column, error):
    """Arrow arrays built from buffers are not checked: tags and keys went into the log as their raw bytes (the
    record codec never writes such a properties string) and a topic raised a bare UnicodeDecodeError."""
    n = 4
    columns = {"topic": pa.array(["T"] * n), "body": pa.array([b"x"] * n)}
    bad = _bad_utf8_strings(n, 2)
    offsets = pa.array(range(n + 1), pa.int32())
    columns[column] = {"topic": bad, "tags": bad, "keys": pa.ListArray.from_arrays(offsets, bad),
                       "properties": pa.MapArray.from_arrays(offsets, pa.array(["p"] * n), bad)}[column]
    with MessageStore.open(tmp_path, SMALL) as store:
        with pytest.raises(error, match=rf"row 2: {column} is not a valid Arrow array of UTF-8 strings"):
            store.put_batch(pa.table(columns))
        assert store.max_phy_offset == 0


def test_a_null_properties_row_is_a_row_without_properties(tmp_path):
    """A null map slot whose offsets still span entries raised TypeError (dict(None)): nulls mean none, as they
    do for tags and keys."""
    props = pa.MapArray.from_arrays(pa.array([0, 1, 2], pa.int32()), pa.array(["a", "b"]), pa.array(["1", "2"]),
                                    mask=pa.array([False, True]))
    with MessageStore.open(tmp_path, SMALL) as store:
        result = store.put_batch(pa.table({"topic": ["T", "T"], "body": [b"x", b"y"], "properties": props}))
        stored = [store.look_message_by_offset(int(p)) for p in result.commit_log_offsets.tolist()]
    assert stored[0].properties["a"] == "1" and "b" not in stored[1].properties


def test_dictionary_and_large_text_columns_encode_as_plain_ones():
    """Parquet readers hand strings over dictionary-encoded, and large_string is pyarrow's other string type:
    refused for tags, keys and every dictionary column before; the same bytes as plain columns now."""
    plain = pa.table({"topic": ["TopicA", "T", "TopicA"], "body": [b"a", b"b", b"c"], "tags": ["x", None, "y"],
                      "keys": pa.array([["k1"], ["k2", "k3"], []], pa.list_(pa.string()))})
    other = pa.table({"topic": plain.column("topic").dictionary_encode(), "body": plain.column("body"),
                      "tags": plain.column("tags").cast(pa.large_string()).dictionary_encode(),
                      "keys": plain.column("keys").cast(pa.large_list(pa.large_string()))})
    nested = pa.table({"topic": plain.column("topic").cast(pa.string_view()),  # newer writers' strings
                       "body": plain.column("body").cast(pa.binary_view()), "tags": plain.column("tags"),
                       "keys": pa.array([["k1"], ["k2", "k3"], []], pa.list_(pa.dictionary(pa.int32(),
                                                                                         pa.string())))})
    single = MessageEncoder(StoreConfig())
    batch = BatchEncoder(single)
    state = single.uniq_keys.state
    with mock.patch("time.time_ns", return_value=NOW * 1_000_000):
        first = bytes(batch.encode(plain).data)
        for table in (other, nested):
            single.uniq_keys.state = state
            assert bytes(batch.encode(table).data) == first


def test_a_refused_put_messages_names_the_message(tmp_path):
    """put_batch names its bad row; put_messages named nothing (a CLI put of a thousand JSON lines said only
    "property 'TAGS' contains a separator")."""
    with MessageStore.open(tmp_path, SMALL) as store:
        msgs = [Message("T", b"x", tags="fine") for _ in range(6)]
        msgs[4] = Message("T", b"x", tags="a\x01b")
        with pytest.raises(InvalidPropertyError, match=r"^message 4: property 'TAGS' contains a separator"):
            store.put_messages(msgs)
        with pytest.raises(InvalidPropertyError, match=r"^property 'TAGS' contains a separator"):
            store.put_message(msgs[4])  # one message: nothing to name
        assert store.max_phy_offset == 0


def test_copied_rarer_fields_round_trip(tmp_path):
    """What an import carries over besides the usual columns: a compressed body (its flag, so it reads back
    inflated), a retry's count, a committed transaction's type and half offset, a prepared or rolled-back record
    (no queue offset, as put_message stores it). Bits the store sets itself are refused."""
    table = pa.table({
        "topic": ["Zip", "Zip", "%RETRY%g", "Tx", "Tx", "Tx", "Tx"],
        "body": [zlib.compress(b"hello " * 50), b"plain", b"again", b"tx", b"half", b"rolled back", b"after"],
        "sys_flag": pa.array([0x301, 0, 0, 0x8, 0x4, 0xC, 0], pa.int32()),  # 0x301: COMPRESSED, zlib
        "reconsume_times": pa.array([0, 0, 5, 0, 0, 0, 0], pa.int32()),
        "prepared_transaction_offset": pa.array([0, 0, 0, 4242, 0, 0, 0], pa.int64()),
        "born_host": [None, None, "[2001:db8::1]:1", None, None, None, None],  # an IPv6 row: the general path too
    })
    with MessageStore.open(tmp_path / "s", StoreConfig(max_hash_slot_num=97, max_index_num=400)) as store:
        result = store.put_batch(table.slice(0, 2))  # IPv4 rows only: the compiled path
        store.put_batch(table.slice(2, 1))
        tx_result = store.put_batch(table.slice(3))
        store.wait_for_dispatch()
        got = {(m.topic, m.body): m for m in store.iter_messages()}
        zipped = got[("Zip", zlib.compress(b"hello " * 50))]  # stored as sent, as a broker keeps it
        assert zipped.sys_flag & 0x1 and zipped.queue_offset == 0
        inflated = store.look_message_by_offset(zipped.commit_log_offset, decompress=True)
        assert inflated.body == b"hello " * 50
        assert got[("Zip", b"plain")].sys_flag == 0 and result.queue_offsets.tolist() == [0, 1]
        assert got[("%RETRY%g", b"again")].reconsume_times == 5
        tx = got[("Tx", b"tx")]
        assert (tx.sys_flag & 0xC, tx.prepared_transaction_offset) == (0x8, 4242)
        assert tx_result.queue_offsets.tolist() == [0, 0, 0, 1]  # the half and the rollback take none
        assert [m.body for m in store.get_message("Tx", 0, 0, 8).messages] == [b"tx", b"after"]
        assert got[("Tx", b"half")].sys_flag & 0xC == 0x4 and got[("Tx", b"rolled back")].sys_flag & 0xC == 0xC
        end = store.commit_log.max_offset
        bad = table.slice(0, 2).set_column(2, "sys_flag", pa.array([0, 0x10], pa.int32()))  # a host bit
        with pytest.raises(InvalidFlagError, match="row 1: sys_flag 0x10"):
            store.put_batch(bad)
        assert store.commit_log.max_offset == end


def test_rows_without_a_queue_offset_in_a_table_split_over_segments(tmp_path):
    """A table larger than a segment is one append per segment; the queues advance per segment over the rows
    that take an offset only, and the next put goes on from there."""
    n = 120
    flags = [0x4 if i % 3 == 0 else 0 for i in range(n)]
    table = pa.table({"topic": ["T"] * n, "body": [b"%03d" % i + b"." * 100 for i in range(n)],
                      "queue_id": pa.array([i % 2 for i in range(n)], pa.int32()),
                      "sys_flag": pa.array(flags, pa.int32())})
    config = StoreConfig(mapped_file_size_commit_log=4096, max_hash_slot_num=97, max_index_num=400)
    with MessageStore.open(tmp_path / "s", config) as store:
        result = store.put_batch(table)
        assert len(list((tmp_path / "s" / "commitlog").iterdir())) > 3
        expected, next_of = [], {0: 0, 1: 0}
        for i in range(n):
            if flags[i]:
                expected.append(0)
            else:
                expected.append(next_of[i % 2])
                next_of[i % 2] += 1
        assert result.queue_offsets.tolist() == expected
        after = store.put_batch(pa.table({"topic": ["T", "T"], "body": [b"a", b"b"],
                                          "queue_id": pa.array([0, 1], pa.int32())}))
        assert after.queue_offsets.tolist() == [next_of[0], next_of[1]]
        store.wait_for_dispatch()
        for q in (0, 1):
            bodies = [m.body[:3] for m in store.get_message("T", q, 0, 100).messages]
            assert bodies == [b"%03d" % i for i in range(n) if i % 2 == q and not flags[i]] + [b"ab"[q:q + 1]]


def test_a_prepared_or_rolled_back_record_with_a_delay_stays_in_its_topic(tmp_path):
    """RocketMQ parks only the NOT and COMMIT transaction types in the delay or timer topic."""
    config = StoreConfig(max_hash_slot_num=97, max_index_num=400)
    with MessageStore.open(tmp_path / "s", config) as store:
        for flag in (0x4, 0xC):
            store.put_message(Message("T", b"m%d" % flag, properties={"DELAY": "2"}, sys_flag=flag))
        store.put_batch(pa.table({"topic": ["T", "T"], "body": [b"b4", b"b0"],
                                  "properties": pa.array([[("DELAY", "2")], [("DELAY", "2")]],
                                                         pa.map_(pa.string(), pa.string())),
                                  "sys_flag": pa.array([0x4, 0], pa.int32())}))
        store.wait_for_dispatch()
        topics = {m.body: m.topic for m in store.iter_messages()}
    assert topics == {b"m4": "T", b"m12": "T", b"b4": "T", b"b0": "SCHEDULE_TOPIC_XXXX"}

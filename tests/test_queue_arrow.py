"""``queue_arrow``: a queue read in batches answers what paging through ``get_message`` answers."""

from __future__ import annotations

import struct
import tempfile
from pathlib import Path

import pyarrow as pa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rocketstore import Message, MessageStore, StoreConfig
from rocketstore.codec.batch import message_row, rows_batch

CONFIG = StoreConfig(mapped_file_size_commit_log=4096, mapped_file_size_consume_queue=20 * 16,
                     max_hash_slot_num=97, max_index_num=500)
TAGS = ["Aa", "BB", "C", "*", None]  # "Aa" and "BB" share a tags code
SUBSCRIPTIONS = [None, "*", "Aa", "BB || C", "Aa || X", "C", "C || *", " * ", " || "]  # * is a tag unless alone


def paged(store: MessageStore, topic: str, queue_id: int, begin: int, end: int, tags) -> list[dict]:
    """The reference: ``get_message`` page by page, as print-msg used to read."""
    rows, offset = [], begin
    while offset < end:
        result = store.get_message(topic, queue_id, offset, 7, tags)
        rows += [message_row(m, True, None) for m in result.messages if m.queue_offset < end]
        if result.next_begin_offset <= offset:
            break
        offset = result.next_begin_offset
    return rows_batch(rows).to_pylist() if rows else []


def batched(store: MessageStore, topic: str, queue_id: int, begin: int | None, end: int | None, tags,
            max_rows: int) -> list[dict]:
    batches = list(store.queue_arrow(topic, queue_id, begin, end, tags, max_rows=max_rows))
    assert all(b.num_rows for b in batches)
    return pa.Table.from_batches(batches).to_pylist() if batches else []


messages = st.lists(st.tuples(st.sampled_from(["T0", "T1"]), st.integers(0, 2), st.sampled_from(TAGS),
                              st.binary(max_size=300)), min_size=1, max_size=60)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages, st.integers(0, 59), st.data())
def test_queue_arrow_equals_paging_get_message(msgs, damaged, data):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        with MessageStore.open(root, CONFIG) as store:
            results = [store.put_message(Message(t, body, tags=tag, queue_id=q)) for t, q, tag, body in msgs]
            store.wait_for_dispatch()
        with MessageStore.open(root, CONFIG, read_only=True) as store:
            hit = results[damaged % len(results)]  # one record's body CRC broken under the open store: both skip it
            segment = sorted((root / "commitlog").iterdir())[hit.commit_log_offset // 4096]
            with open(segment, "r+b") as f:  # BODYCRC is the third field; the mapping sees the write
                f.seek(hit.commit_log_offset % 4096 + 8)
                crc = struct.unpack(">i", f.read(4))[0]
                f.seek(hit.commit_log_offset % 4096 + 8)
                f.write(struct.pack(">i", crc ^ 0x55))
            for topic in ("T0", "T1"):
                for queue_id in store.queue_ids(topic):
                    high = store.get_max_offset_in_queue(topic, queue_id)
                    begin = data.draw(st.integers(0, high))
                    end = data.draw(st.integers(begin, high + 2))
                    tags = data.draw(st.sampled_from(SUBSCRIPTIONS))
                    max_rows = data.draw(st.integers(1, 20))
                    assert batched(store, topic, queue_id, begin, end, tags, max_rows) == \
                        paged(store, topic, queue_id, begin, end, tags)
                    assert batched(store, topic, queue_id, None, None, tags, 8192) == \
                        paged(store, topic, queue_id, 0, high, tags)
            assert not list(store.queue_arrow("Nope", 0))


def test_queue_arrow_starts_at_the_queue_minimum_after_retention(tmp_path):
    config = StoreConfig(mapped_file_size_commit_log=4096, mapped_file_size_consume_queue=20 * 10,
                         file_reserved_time=0)
    with MessageStore.open(tmp_path, config) as store:
        for i in range(60):
            store.put_message(Message("T", b"y" * 300, keys=[f"k{i}"]))
        store.wait_for_dispatch()
        store.delete_expired_files(immediately=True)
        low = store.get_min_offset_in_queue("T", 0)
        assert low > 0
        got = batched(store, "T", 0, 0, None, None, 8)
        assert [r["queueOffset"] for r in got] == list(range(low, 60))
        assert got == paged(store, "T", 0, low, 60, None)


def test_queue_arrow_refuses_a_batch_size_below_one(tmp_path):
    import pytest

    from rocketstore.errors import InvalidQueryError

    with MessageStore.open(tmp_path, CONFIG) as store:
        store.put_message(Message("T", b"x"))
        store.wait_for_dispatch()
        for bad in (0, -1, 1.5, True):
            with pytest.raises(InvalidQueryError):
                store.queue_arrow("T", 0, max_rows=bad)
        assert len(batched(store, "T", 0, None, None, None, 1)) == 1


def test_retention_deleting_the_segments_a_batched_read_is_decoding(tmp_path, monkeypatch):
    """``decode_at`` (under ``queue_arrow`` and ``query_messages_arrow``) holds a view of a segment's mapping while
    the compiled walk reads it; retention closing that mapping at that moment, or between finding a segment and
    mapping it, must neither crash nor serve anything but the records as they were written."""
    import rocketstore.codec.batch as batch_codec
    from rocketstore.mapped.file import MappedFile

    config = StoreConfig(mapped_file_size_commit_log=4096, mapped_file_size_consume_queue=20 * 100,
                         file_reserved_time=0)
    with MessageStore.open(tmp_path, config) as store:
        for i in range(60):
            store.put_message(Message("T", f"m{i}".encode() * 40, keys=[f"k{i}"]))
        store.wait_for_dispatch()
        written = {r["queueOffset"]: r for r in batched(store, "T", 0, None, None, None, 8192)}
        assert len(written) == 60
        segments = len(store.commit_log.mapped_files.files)
        parse_at, buffer = batch_codec.k.parse_at, MappedFile.buffer

        def retention_in_the_walk(*args):  # the mapping is exported to numpy: closing it must wait for the view
            monkeypatch.setattr(batch_codec.k, "parse_at", parse_at)
            store.delete_expired_files(immediately=True)
            return parse_at(*args)

        monkeypatch.setattr(batch_codec.k, "parse_at", retention_in_the_walk)
        got = batched(store, "T", 0, 0, None, None, 8192)
        assert len(store.commit_log.mapped_files.files) == 1 < segments  # retention ran during the read
        assert got and all(row == written[row["queueOffset"]] for row in got)
        assert [r["queueOffset"] for r in batched(store, "T", 0, 0, None, None, 8192)] == \
            list(range(store.get_min_offset_in_queue("T", 0), 60))

    with MessageStore.open(tmp_path / "b", config) as store:
        for i in range(60):
            store.put_message(Message("T", f"m{i}".encode() * 40, keys=[f"k{i}"]))
        store.wait_for_dispatch()
        pairs = [("T", f"k{i}") for i in range(60)]
        before = {r["queryKey"]: r for r in store.query_messages_arrow(pairs).to_pylist()}
        assert len(before) == 60

        def retention_before_mapping(self):  # found by offset, then closed before its buffer is taken
            monkeypatch.setattr(MappedFile, "buffer", buffer)
            store.delete_expired_files(immediately=True)
            return buffer.fget(self)

        monkeypatch.setattr(MappedFile, "buffer", property(retention_before_mapping))
        got = store.query_messages_arrow(pairs).to_pylist()
        assert len(store.commit_log.mapped_files.files) == 1
        assert got and all(row == before[row["queryKey"]] for row in got)
        kept = {m.commit_log_offset for pair in pairs for m in store.query_message(*pair)}
        assert {row["commitLogOffset"] for row in got} >= kept  # nothing still in the log is left out

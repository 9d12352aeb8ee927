"""Planning a scan: tasks of equal bytes covering the log once, and the columns a reader's schema picks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("pyspark")

from rocketstore.errors import ConfigError
from rocketstore.spark.partitions import LogRange, ScanOptions, even_tasks


@st.composite
def log_pieces(draw) -> list[LogRange]:
    """Pieces of consecutive segments (of one or two stores) in log order, as ``plan_ranges`` collects them."""
    pieces = []
    for store in range(draw(st.integers(1, 2))):
        size = draw(st.sampled_from([1000, 4096, 1 << 20]))
        first = draw(st.integers(0, 3))
        for n in range(first, first + draw(st.integers(1, 4))):
            start = n * size + draw(st.integers(0, size - 1))
            stop = draw(st.integers(start + 1, (n + 1) * size))
            pieces.append(LogRange(f"/s{store}", f"b{store}", f"/s{store}/{n * size:020d}", n * size, size, start, stop,
                                   stop))
    return pieces


@settings(max_examples=400, deadline=None, database=None)
@given(pieces=log_pieces(), min_tasks=st.integers(1, 40), data=st.data())
def test_tasks_cover_every_byte_once_in_order_and_are_even(pieces, min_tasks, data):
    total = sum(p.stop - p.start for p in pieces)
    # down to one byte per task, but at most ~2,000 tasks: a million one-byte tasks made this test 23 s long
    max_bytes = data.draw(st.integers(max(1, total // 2000), 5 << 20), label="max_bytes")
    tasks = even_tasks(pieces, min_tasks, max_bytes)
    assert len(tasks) == min(total, max(min_tasks, -(-total // max_bytes)))
    flat = [r for task in tasks for r in task]
    # in log order, each inside one piece, together exactly the pieces' bytes
    rebuilt: list[tuple] = []
    for r in flat:
        assert r.start < r.stop
        if rebuilt and rebuilt[-1][:2] == (r.root, r.segment) and rebuilt[-1][3] == r.start:
            rebuilt[-1] = (*rebuilt[-1][:3], r.stop)
        else:
            rebuilt.append((r.root, r.segment, r.start, r.stop))
    assert rebuilt == [(p.root, p.segment, p.start, p.stop) for p in pieces]
    by_segment = {(p.root, p.segment): p for p in pieces}
    for r in flat:  # everything but the bounds is its piece's
        piece = by_segment[r.root, r.segment]
        assert (r.broker_name, r.segment_start, r.segment_size, r.data_end) == (
            piece.broker_name, piece.segment_start, piece.segment_size, piece.data_end)
        assert piece.start <= r.start < r.stop <= piece.stop
    sizes = [sum(r.stop - r.start for r in task) for task in tasks]
    assert max(sizes) - min(sizes) <= 1
    assert max(sizes) <= max(max_bytes, -(-total // len(tasks)))


def test_no_bytes_no_tasks():
    assert even_tasks([], 4, 1 << 20) == []


def test_a_schema_picks_columns_and_bad_ones_are_named():
    options = ScanOptions()
    picked = options.with_schema([("storeTimestamp", "timestamp"), ("topic", "string"), ("tagsCode", "bigint")])
    assert picked.output_columns == ("storeTimestamp", "topic", "tagsCode")
    full = [(n, t) for n, t in [("topic", "string"), ("queueId", "int")]]
    assert options.with_schema(full).output_columns == ("topic", "queueId")
    with pytest.raises(ConfigError, match="no column 'topics'"):
        options.with_schema([("topics", "string")])
    with pytest.raises(ConfigError, match="column queueId is int in the rocketmq source, not bigint"):
        options.with_schema([("queueId", "bigint")])
    with pytest.raises(ConfigError, match="no column asked"):
        options.with_schema([])
    with pytest.raises(ConfigError, match="twice"):
        options.with_schema([("topic", "string"), ("topic", "string")])
    for bad in ("-2", "0"):
        with pytest.raises(ConfigError, match="minPartitions must be at least 1"):
            ScanOptions.from_options({"minPartitions": bad})
    assert ScanOptions.from_options({"MINPARTITIONS": "7"}).min_partitions == 7


def test_the_columns_option_picks_columns_as_a_schema_does():
    options = ScanOptions.from_options({"Columns": "storeTimestamp, topic,tagsCode", "packArrow": "true"})
    assert options.output_columns == ("storeTimestamp", "topic", "tagsCode") and options.packed
    assert options.output_schema.names == ["storeTimestamp", "topic", "tagsCode"]
    assert str(options.output_schema.field("tagsCode").type) == "int64"
    with pytest.raises(ConfigError, match="no column 'offset'"):
        ScanOptions.from_options({"columns": "topic,offset"})
    with pytest.raises(ConfigError, match="no column asked"):
        ScanOptions.from_options({"columns": " , "})
    with pytest.raises(ConfigError, match="packArrow must be true or false"):
        ScanOptions.from_options({"packArrow": "yes"})


@settings(max_examples=50, deadline=None, database=None)
@given(sizes=st.lists(st.integers(0, 300), max_size=12), limit=st.integers(1, 20_000))
def test_packed_rows_hold_every_batch_in_order(sizes, limit):
    import pyarrow as pa

    from rocketstore.spark.partitions import PACKED_COLUMN, packed, unpacked

    schema = ScanOptions(columns=("commitLogOffset", "topic")).output_schema
    batches, start = [], 0
    for size in sizes:
        batches.append(pa.RecordBatch.from_pydict(
            {"commitLogOffset": list(range(start, start + size)), "topic": [f"T{i % 7}" for i in range(size)]},
            schema=schema))
        start += size
    rows = list(packed(iter(batches), schema, limit))
    assert all(r.schema.names == [PACKED_COLUMN] and r.num_rows == 1 for r in rows)
    expected, size, pending = 0, 0, 0  # a row when the batches since the last one reach the limit, then the rest
    for b in batches:
        size, pending = size + b.nbytes, pending + 1
        if size >= limit:
            expected, size, pending = expected + 1, 0, 0
    assert len(rows) == expected + (pending > 0)
    blobs = pa.chunked_array([r.column(0) for r in rows], pa.binary())
    table = unpacked(blobs, schema)
    assert table.schema == schema
    assert table.column("commitLogOffset").to_pylist() == list(range(start))


def test_a_validated_end_plans_the_same_tasks_without_a_second_recovery(tmp_path, monkeypatch):
    """The rebuild recovered the log under the store's lock: each window's planning takes that end instead of
    recovering again (which walks the last segments once per window)."""
    from rocketstore import Message, MessageStore, StoreConfig
    from rocketstore.spark import partitions
    from rocketstore.spark.partitions import plan_ranges, resolve_roots

    with MessageStore.open(tmp_path / "s", StoreConfig(mapped_file_size_commit_log=4096)) as store:
        for i in range(120):
            store.put_message(Message("T", b"x" * 100, keys=[f"k{i}"]))
    roots = resolve_roots(str(tmp_path / "s"))
    end = partitions.log_bounds(roots[0], 4096)[2]
    assert end > 3 * 4096
    plain = ScanOptions.from_options({"startingOffset": "100", "endingOffset": str(end - 7),
                                      "maxBytesPerPartition": "2048"})
    expected = plan_ranges(roots, plain)

    def no_recovery(*args, **kwargs):
        raise AssertionError("a validated end needs no recovery")

    monkeypatch.setattr(partitions, "recover_commit_log", no_recovery)
    validated = ScanOptions.from_options({"startingOffset": "100", "endingOffset": str(end - 7),
                                          "maxBytesPerPartition": "2048", "validatedLogEnd": str(end)})
    assert plan_ranges(roots, validated) == expected and len(expected) > 3
    with pytest.raises(AssertionError, match="no recovery"):
        plan_ranges(roots, plain)
    for outside in (10 << 20, -5):
        with pytest.raises(ConfigError, match="outside the log's files"):
            plan_ranges(roots, ScanOptions.from_options({"validatedLogEnd": str(outside)}))
    with pytest.raises(ConfigError, match="one store's"):
        plan_ranges(roots * 2, validated)


def test_a_stream_plans_its_micro_batch_from_the_end_it_just_validated(tmp_path, monkeypatch):
    """Each trigger recovers the log once (``latestOffset``); its tasks are planned from that end, not from a
    second recovery (a live store's abnormal recovery walks whole segments)."""
    from rocketstore import Message, MessageStore, StoreConfig
    from rocketstore.spark import partitions
    from rocketstore.spark.source import RocketMQStreamReader

    with MessageStore.open(tmp_path / "s", StoreConfig(mapped_file_size_commit_log=4096)) as store:
        for i in range(60):
            store.put_message(Message("T", b"x" * 100, keys=[f"k{i}"]))
    reader = RocketMQStreamReader(str(tmp_path / "s"), ScanOptions(max_bytes_per_partition=2048))
    start, end = reader.initialOffset(), reader.latestOffset()
    recovered = partitions.recover_commit_log
    calls = []
    monkeypatch.setattr(partitions, "recover_commit_log", lambda *a, **kw: calls.append(1) or recovered(*a, **kw))
    planned = reader.partitions(start, end)
    assert calls == [] and len(planned) > 3
    ((_, first),), ((_, last),) = start.items(), end.items()
    assert sum(r.stop - r.start for p in planned for r in p.ranges) == last - first > 0


def test_a_stream_recovers_the_log_once_and_then_follows_its_end(tmp_path, monkeypatch):
    from rocketstore import Message, MessageStore, StoreConfig
    from rocketstore.spark import partitions
    from rocketstore.spark.source import RocketMQStreamReader

    config = StoreConfig(mapped_file_size_commit_log=4096)
    recovered = partitions.recover_commit_log
    calls = []
    monkeypatch.setattr(partitions, "recover_commit_log", lambda *a, **kw: calls.append(1) or recovered(*a, **kw))
    with MessageStore.open(tmp_path / "s", config) as store:
        store.put_message(Message("T", b"x" * 100))
        reader = RocketMQStreamReader(str(tmp_path / "s"), ScanOptions())
        (root, first), = reader.initialOffset().items()
        assert calls == [1]
        for i in range(80):  # into new segments: the live store's abort file would make each recovery abnormal
            last = store.put_message(Message("T", b"y" * 120, keys=[f"k{i}"]))
        assert reader.latestOffset() == {root: last.commit_log_offset + last.store_size}
        assert calls == [1], "a trigger after the first validates only what was appended"
    assert reader.latestOffset() == {root: last.commit_log_offset + last.store_size} and first == 0
    assert calls == [1]

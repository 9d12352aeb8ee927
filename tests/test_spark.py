"""The Spark pipeline: the rocketmq data source, parallel rebuild, export/import, keys at scale, streaming."""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rocketstore import Message, MessageStore, StoreConfig
from rocketstore.errors import ConfigError, CorruptDataError
from test_cli import cli
from test_cli import tree as files_of
from test_import import DIE_AFTER_THIRD_BATCH, stop_at_third_batch

pytest.importorskip("pyspark")

from rocketstore.spark.jobs import (
    export_parquet,
    find_keys,
    import_messages,
    messages_per_topic_and_minute,
    read_store,
    rebuild,
)

CONFIG = StoreConfig(mapped_file_size_commit_log=32 << 10, mapped_file_size_consume_queue=20 * 100,
                     max_hash_slot_num=97, max_index_num=300)


def counter_clock(start: int = 1_700_000_000_000):
    state = [start]

    def tick() -> int:
        state[0] += 1
        return state[0]

    return tick


def build_store(root: Path, count: int = 400, *, clock=None, seed: int = 0) -> list:
    with MessageStore.open(root, CONFIG, index_clock=clock) as store:
        results = [store.put_message(Message(f"Topic{(i + seed) % 3}", f"body {seed}-{i} ".encode() * (i % 7 + 1),
                                             tags=f"Tag{i % 2}", keys=[f"k{seed}-{i}", f"g{i % 10}"],
                                             properties={"n": str(i)}, queue_id=i % 4))
                   for i in range(count)]
        results += store.put_messages([Message("Batch", b"b" * 50, keys=[f"batch{j}"]) for j in range(20)])
        store.put_message(Message("Tx", b"half", keys=["tx"], sys_flag=0x4))
        store.put_message(Message("Tx", b"rolled back", keys=["rb"], sys_flag=0xC))
        store.wait_for_dispatch()
    return results


def row_matches_message(row, msg) -> None:
    assert (row.topic, row.queueId, row.queueOffset, row.commitLogOffset) == (
        msg.topic, msg.queue_id, msg.queue_offset, msg.commit_log_offset)
    assert (row.msgId, row.uniqKey, row.keys, row.tags, row.body) == (msg.msg_id, msg.uniq_key, msg.keys, msg.tags,
                                                                      msg.body)
    assert dict(row.properties) == msg.properties
    assert int(row.storeTimestamp.timestamp() * 1000) == msg.store_timestamp
    assert int(row.bornTimestamp.timestamp() * 1000) == msg.born_timestamp
    assert (row.bornHost, row.storeHost) == (str(msg.born_host), str(msg.store_host))
    assert (row.sysFlag, row.flag, row.reconsumeTimes, row.preparedTransactionOffset, row.storeSize, row.bodyCRC) == (
        msg.sys_flag, msg.flag, msg.reconsume_times, msg.prepared_transaction_offset, msg.store_size, msg.body_crc)


def test_dataframe_equals_the_stores_own_reads(spark, tmp_path):
    build_store(tmp_path / "broker-a")
    df = read_store(spark, tmp_path / "broker-a", maxBytesPerPartition=8 << 10)
    assert df.rdd.getNumPartitions() > 4  # several per 32 KiB segment
    rows = df.orderBy("commitLogOffset").collect()
    with MessageStore.open(tmp_path / "broker-a", CONFIG, read_only=True) as store:
        expected = list(store.iter_messages())
    assert len(rows) == len(expected) == 422
    for row, msg in zip(rows, expected, strict=True):
        row_matches_message(row, msg)
        assert row.brokerName == "broker-a"


def test_records_larger_than_a_task_are_read_once_by_every_reader(spark, tmp_path):
    """A task found the first record starting in its byte range by validating it only up to the range's end: a
    record longer than a task was passed over by both tasks it spans (the reviewer's 1 MiB messages in 8 tasks: 6
    rows of 10), so an export wrote fewer rows and a rebuild left gaps in the queues, both as success."""
    from rocketstore.rebuild import rebuild as rebuild_here

    config = CONFIG.replace(mapped_file_size_commit_log=1 << 20)
    original = tmp_path / "original"
    with MessageStore.open(original, config, index_clock=counter_clock()) as store:
        for i in range(12):
            store.put_message(Message("Big", bytes([i]) * (20_000 + 5_000 * (i % 3)), keys=[f"b{i}"], queue_id=i % 2))
            store.put_message(Message("Small", b"s%d" % i, keys=[f"s{i}"]))
        store.wait_for_dispatch()
        expected = [(m.topic, m.commit_log_offset, m.body) for m in store.iter_messages()]
    for task_bytes in (4096, 9000, 1 << 20):
        df = read_store(spark, original, maxBytesPerPartition=task_bytes, columns=["topic", "commitLogOffset", "body"])
        rows = sorted((r.topic, r.commitLogOffset, bytes(r.body)) for r in df.collect())
        assert rows == sorted(expected), task_bytes
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copytree(original / "commitlog", copy / "commitlog")
    shutil.copy(original / "checkpoint", copy / "checkpoint")
    report = rebuild_here(copy, config=config, clock=counter_clock(), max_bytes_per_task=4096)
    assert report.records == 24 and report.partitions > 20
    assert tree(copy, "consumequeue") == tree(original, "consumequeue")
    assert tree(copy, "index") == tree(original, "index")


def test_columns_read_only_what_is_asked_in_tasks_of_equal_size(spark, tmp_path):
    build_store(tmp_path / "s")
    path = str(tmp_path / "s")
    full = read_store(spark, path, dispatchInfo=True)
    wanted = ["storeTimestamp", "keys", "tagsCode", "commitLogOffset", "indexKeyHashes"]
    picked = read_store(spark, path, columns=wanted, minPartitions=5, maxBytesPerPartition=1 << 30)
    assert picked.columns == wanted
    assert picked.rdd.getNumPartitions() == 5  # one per 64 MiB would have been 1
    assert picked.orderBy("commitLogOffset").collect() == full.select(*wanted).orderBy("commitLogOffset").collect()
    by_schema = spark.read.format("rocketmq").schema("tags string, queueOffset bigint").load(path)
    assert sorted(map(str, by_schema.collect())) == sorted(map(str, full.select("tags", "queueOffset").collect()))
    with pytest.raises(Exception, match="column queueId is int in the rocketmq source, not string"):
        spark.read.format("rocketmq").schema("queueId string").load(path).collect()
    from rocketstore.errors import ConfigError

    for bad, reason in ((["topic", "offset"], "no column 'offset'"), (["tags", "tags"], "twice"), ([], "no column")):
        with pytest.raises(ConfigError, match=reason):  # on the driver, before Spark plans anything
            read_store(spark, path, columns=bad)


def test_packed_rows_carry_the_same_columns_as_arrow(spark, tmp_path):
    """packArrow: the decoded columns reach the driver as Arrow IPC (the rebuild's path), equal to the rows."""
    from rocketstore.spark.partitions import ScanOptions, unpacked

    build_store(tmp_path / "s")
    path = str(tmp_path / "s")
    wanted = ["commitLogOffset", "topic", "keys", "storeTimestamp", "tagsCode", "indexKeyHashes"]
    rows = read_store(spark, path, columns=wanted, minPartitions=3, maxBytesPerPartition=4096)
    blobs = read_store(spark, path, columns=wanted, packed=True, minPartitions=3, maxBytesPerPartition=4096)
    assert blobs.columns == ["arrow"] and 3 <= blobs.count() < rows.count()
    table = unpacked(blobs.toArrow().column(0), ScanOptions(columns=tuple(wanted)).output_schema)
    assert table.column_names == wanted and table.num_rows == rows.count()
    expected = rows.orderBy("commitLogOffset").toArrow()
    assert table.sort_by("commitLogOffset").to_pylist() == expected.to_pylist()
    by_option = spark.read.format("rocketmq").option("columns", "topic, queueId").load(path)
    assert by_option.columns == ["topic", "queueId"]
    expected_pairs = read_store(spark, path, columns=["topic", "queueId"]).collect()
    assert sorted(map(tuple, by_option.collect())) == sorted(map(tuple, expected_pairs)) and len(expected_pairs) == 422
    with pytest.raises(Exception, match="packArrow the rocketmq source's schema is 'arrow binary'"):
        spark.read.format("rocketmq").option("packArrow", "true").schema("topic string").load(path).collect()


def test_a_task_leaves_its_workers_heap_frozen_and_talks_over_a_unix_socket(spark, tmp_path):
    """PySpark's daemon runs a full gc.collect() after every task of a reused worker (~100 ms once numba and
    pyarrow are loaded): a read freezes what survives it, in the worker only. Workers are reached over a Unix
    socket (loopback TCP waited on delayed ACKs)."""
    import gc

    import pyarrow as pa

    from rocketstore.spark.heap import settle_after_task
    from rocketstore.spark.partitions import ScanOptions, plan_ranges, resolve_roots
    from rocketstore.spark.source import RangePartition

    build_store(tmp_path / "s", 40)
    options = ScanOptions()
    planned = plan_ranges(resolve_roots(str(tmp_path / "s")), options)
    partitions = [RangePartition(ranges, options) for ranges in planned]

    def read_in_a_task(batches):
        import os

        for _ in batches:
            pass
        gc.unfreeze()  # an earlier test's task may have frozen this reused worker already
        before = gc.get_freeze_count()
        rows = sum(b.num_rows for p in partitions for b in p.read())
        yield pa.RecordBatch.from_pylist([{"before": before, "after": gc.get_freeze_count(), "rows": rows,
                                           "unix": os.environ.get("PYTHON_UNIX_DOMAIN_ENABLED", "").lower()}])

    driver_frozen = gc.get_freeze_count()
    [row] = spark.range(1, numPartitions=1).mapInArrow(
        read_in_a_task, "before bigint, after bigint, rows bigint, unix string").collect()
    assert (row.before, row.rows, row.unix) == (0, 40 + 20 + 2, "true")
    assert row.after > 10_000  # the modules the read loaded, now in the permanent generation
    assert not settle_after_task() and gc.get_freeze_count() == driver_frozen  # outside a task: nothing changes


def test_filters_by_topic_time_and_offset(spark, tmp_path):
    results = build_store(tmp_path / "s")
    mid = results[200]
    df = read_store(spark, tmp_path / "s", topics="Topic1,Batch", maxBytesPerPartition=16 << 10)
    assert df.count() == sum(1 for i in range(400) if (i % 3) == 1) + 20
    assert {r.topic for r in df.select("topic").distinct().collect()} == {"Topic1", "Batch"}
    after = read_store(spark, tmp_path / "s", startingOffset=mid.commit_log_offset,
                       endingOffset=results[300].commit_log_offset)
    assert [r.commitLogOffset for r in after.orderBy("commitLogOffset").select("commitLogOffset").collect()] == [
        r.commit_log_offset for r in results[200:300]]
    timed = read_store(spark, tmp_path / "s", startingTimestamp=mid.store_timestamp,
                       endingTimestamp=results[-1].store_timestamp)
    assert timed.count() == sum(1 for r in results if mid.store_timestamp <= r.store_timestamp
                                < results[-1].store_timestamp)
    no_body = read_store(spark, tmp_path / "s", includeBody=False).select("body").distinct().collect()
    assert [r.body for r in no_body] == [None]


def test_several_stores_by_glob(spark, tmp_path):
    for n, name in enumerate(("broker-a", "broker-b")):
        build_store(tmp_path / name / "store", 100, seed=n)
    df = read_store(spark, str(tmp_path / "broker-*" / "store"))
    counts = {r.brokerName: r["count"] for r in df.groupBy("brokerName").count().collect()}
    assert counts == {"broker-a": 122, "broker-b": 122}
    (tmp_path / "broker-c").mkdir()
    (tmp_path / "broker-c" / "store").symlink_to(tmp_path / "broker-a" / "store")
    a = str(tmp_path / "broker-a" / "store")
    for named in (f"{a},{a}", [str(tmp_path / "broker-*" / "store"), a]):  # a store named twice is read once
        twice = read_store(spark, named, columns=["brokerName", "commitLogOffset"])
        assert twice.count() == twice.distinct().count() == (122 if isinstance(named, str) else 244)
    with pytest.raises(Exception, match="no store found"):
        read_store(spark, str(tmp_path / "nothing-*")).count()


def copy_vector(vectors: Path, name: str, root: Path) -> Path:
    (root / "commitlog").mkdir(parents=True)
    shutil.copy(vectors / name / "00000000000000000000", root / "commitlog" / "00000000000000000000")
    return root


def test_golden_commit_log_as_a_dataframe(spark, vectors, tmp_path):
    root = copy_vector(vectors, "v4_commitlog", tmp_path / "golden")
    expected = [json.loads(line) for line in (vectors / "v4_commitlog" / "decode.jsonl").read_text().splitlines()]
    rows = read_store(spark, root, maxBytesPerPartition=1024).orderBy("commitLogOffset").collect()
    records = [e for e in expected if "msgId" in e]
    assert len(rows) == len(records)
    for row, e in zip(rows, records, strict=True):
        assert (row.msgId, row.topic, row.queueId, row.queueOffset, row.sysFlag, row.storeSize, row.bodyCRC) == (
            e["msgId"], e["topic"], e["queueId"], e["queueOffset"], e["sysFlag"], e["storeSize"], e["bodyCRC"])
        assert (row.bornHost, row.storeHost, dict(row.properties)) == (e["bornHost"], e["storeHost"], e["properties"])
        assert row.body == (base64.b64decode(e["body"]) if e["body"] else b"")


def test_corrupt_records_fail_or_are_skipped_never_returned(spark, vectors, tmp_path):
    root = copy_vector(vectors, "v6_commitlog_corrupt", tmp_path / "damaged")
    # recovery ends the log at 184, with intact records after it: the scan fails rather than leave them out ...
    with pytest.raises(Exception, match=r"DamagedLogError: .* at offset 184 .*intact records from offset 415"):
        read_store(spark, root).collect()
    # ... or (skip) reads up to the damage
    assert [r.commitLogOffset for r in read_store(spark, root, onCorrupt="skip").collect()] == [0]
    # the whole segment, past that end, through the partition reader
    with pytest.raises(CorruptDataError, match="past the record end"):
        _scan_whole_segment(root, "fail")
    offsets = _scan_whole_segment(root, "skip")
    third = [json.loads(line)["pos"] for line in
             (vectors / "v6_commitlog_corrupt" / "decode_from_3rd.jsonl").read_text().splitlines()]
    assert offsets == [0] + [p for p in third if p < 1650]


def _scan_whole_segment(root: Path, on_corrupt: str) -> list[int]:
    """Read the full segment (past recovery's end) through the partition reader."""
    from rocketstore.spark.partitions import LogRange, ScanOptions, read_range

    segment = root / "commitlog" / "00000000000000000000"
    r = LogRange(str(root), "b", str(segment), 0, 8192, 0, 8192, 8192)
    offsets = []
    for batch in read_range(r, ScanOptions(on_corrupt=on_corrupt)):
        offsets += batch.column("commitLogOffset").to_pylist()
    return offsets


def test_damage_found_while_reading_fails_the_job_by_default(spark, tmp_path):
    """Damage in an old segment (recovery re-checks only the newest ones) is met by the scan itself."""
    results = build_store(tmp_path / "s", 700)
    victim = results[10]
    assert victim.commit_log_offset < 32 << 10 and len(list((tmp_path / "s" / "commitlog").iterdir())) > 4
    segment = tmp_path / "s" / "commitlog" / f"{0:020d}"
    data = bytearray(segment.read_bytes())
    data[victim.commit_log_offset + 100] ^= 0xFF  # inside the body
    segment.write_bytes(bytes(data))
    with pytest.raises(Exception, match="CRC"):
        read_store(spark, tmp_path / "s").count()
    report_dir = tmp_path / "corrupt"
    skipped = read_store(spark, tmp_path / "s", onCorrupt="skip", corruptLog=report_dir).select(
        "commitLogOffset").collect()
    assert victim.commit_log_offset not in {r.commitLogOffset for r in skipped}
    assert len(skipped) == 700 + 20 + 2 - 1
    from rocketstore.spark.partitions import corrupt_report

    report = corrupt_report(report_dir)
    assert [(item["offset"], item["bytes"]) for item in report] == [(victim.commit_log_offset, victim.store_size)]
    assert "CRC" in report[0]["reason"]


def test_damage_in_the_last_segments_fails_the_export_instead_of_ending_the_log_there(spark, tmp_path):
    """The planner's read-only recovery validates the newest segments and ends the log at damage: the export
    succeeded without the damaged record and every intact one after it. It fails now, typed, naming the offset;
    onCorrupt=skip reads up to the damage and says how much it left out."""
    from click.testing import CliRunner

    from rocketstore.cli.app import main
    from rocketstore.errors import DamagedLogError
    from rocketstore.spark.partitions import corrupt_report

    results = build_store(tmp_path / "s", 150)
    victim = results[120]
    segment_size = CONFIG.mapped_file_size_commit_log
    base = victim.commit_log_offset // segment_size * segment_size
    assert len(list((tmp_path / "s" / "commitlog").iterdir())) <= 3  # all of them validated by the recovery
    segment = tmp_path / "s" / "commitlog" / f"{base:020d}"
    data = bytearray(segment.read_bytes())
    data[data.index(b"body 0-120 ", victim.commit_log_offset - base)] ^= 0xFF  # a body byte: its CRC fails
    segment.write_bytes(bytes(data))
    with pytest.raises(DamagedLogError, match=f"at offset {victim.commit_log_offset} .*intact records") as caught:
        export_parquet(tmp_path / "s", tmp_path / "out", spark=spark)
    assert caught.value.offset == victim.commit_log_offset and not (tmp_path / "out").exists()
    with pytest.raises(Exception, match="DamagedLogError"):
        read_store(spark, tmp_path / "s").count()
    done = CliRunner().invoke(main, ["export", "--store", str(tmp_path / "s"), "--out", str(tmp_path / "out"),
                                     "--max-hash-slot-num", "97", "--max-index-num", "300"])
    assert done.exit_code == 1 and done.output.count("\n") == 1 and "DamagedLog" not in done.output
    assert done.output.startswith(f"error: the commit log of {tmp_path / 's'} ends at damage at offset "
                                  f"{victim.commit_log_offset}")
    count = export_parquet(tmp_path / "s", tmp_path / "out", spark=spark, onCorrupt="skip",
                           corruptLog=str(tmp_path / "skipped"))
    assert count == 120
    (item,) = corrupt_report(tmp_path / "skipped")
    assert item["offset"] == victim.commit_log_offset and item["bytes"] > 29 * victim.store_size


def test_live_store_reads_a_consistent_prefix(spark, tmp_path):
    store = MessageStore.open(tmp_path / "live", CONFIG)
    try:
        for i in range(50):
            store.put_message(Message("Live", f"{i}".encode()))
        assert read_store(spark, tmp_path / "live").count() == 50
        for i in range(50, 80):
            store.put_message(Message("Live", f"{i}".encode()))
        assert sorted(int(r.body) for r in read_store(spark, tmp_path / "live").collect()) == list(range(80))
    finally:
        store.close()


def tree(root: Path, name: str) -> dict[str, str]:
    base = root / name
    return {str(p.relative_to(base)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(base.rglob("*")) if p.is_file()}


def _store_and_bare_log(tmp_path: Path) -> tuple[Path, Path]:
    """A store of 722 records dispatched as it was written, and a copy of its log and checkpoint alone."""
    original = tmp_path / "original"
    build_store(original, 700, clock=counter_clock())
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copytree(original / "commitlog", copy / "commitlog")
    shutil.copy(original / "checkpoint", copy / "checkpoint")
    return original, copy


@pytest.mark.parametrize("window", [1 << 30, 1])
def test_rebuild_is_byte_identical_to_sequential_dispatch(spark, tmp_path, monkeypatch, window):
    """The driver writes one window of the log at a time (``1``: the smallest, four tasks of 8 KiB: there are
    several and index files fill and roll at their seams too)."""
    from rocketstore.spark import jobs

    monkeypatch.setattr(jobs, "REBUILD_WINDOW_BYTES", window)
    windows = []
    dispatch_windows = jobs._dispatch_windows
    monkeypatch.setattr(jobs, "_dispatch_windows", lambda *a: (windows.append(w) or w for w in dispatch_windows(*a)))
    original, copy = _store_and_bare_log(tmp_path)
    report = rebuild(copy, spark=spark, config=CONFIG, clock=counter_clock(), max_bytes_per_partition=8 << 10)
    assert report.records == 722 and report.partitions > 4 and report.index_files > 3
    assert (len(windows) == 1) == (window > 1) and sum(t.num_rows for t, _ in windows) == 722
    assert report.windows == len(windows)
    assert tree(copy, "consumequeue") == tree(original, "consumequeue")
    assert tree(copy, "index") == tree(original, "index")
    with MessageStore.open(original, CONFIG, read_only=True) as a, MessageStore.open(copy, CONFIG) as b:
        messages = list(a.iter_messages())
        every = {(m.topic, k) for m in messages for k in m.keys}
        assert len(every) > 700
        for topic, key in every:
            assert [m.msg_id for m in a.query_message(topic, key)] == [m.msg_id for m in b.query_message(topic, key)]
        for m in messages:
            found = [x.msg_id for x in b.query_message_by_uniq_key(m.topic, m.uniq_key)]
            assert found == [x.msg_id for x in a.query_message_by_uniq_key(m.topic, m.uniq_key)]
            assert found == ([] if m.sys_flag & 0xC == 0xC else [m.msg_id])  # ROLLBACK records are not indexed
        assert b.get_message("Topic1", 2, 0, 500).messages[-1].msg_id == a.get_message("Topic1", 2, 0,
                                                                                      500).messages[-1].msg_id


@pytest.mark.parametrize("task_bytes", [64 << 20, 2048])
def test_rebuild_in_this_process_is_byte_identical_to_sequential_dispatch(tmp_path, task_bytes):
    """``rocketstore.rebuild.rebuild`` (``rocketstore rebuild --no-spark``): the same writer fed by this process's
    dispatch walk, one range at a time (2 KiB: ranges end mid-record and index files roll between them)."""
    from rocketstore.rebuild import rebuild as rebuild_here

    original, copy = _store_and_bare_log(tmp_path)
    (copy / "index").mkdir()
    (copy / "index" / "junk").write_bytes(b"an old index: moved aside")
    seen = []
    report = rebuild_here(copy, config=CONFIG, clock=counter_clock(), max_bytes_per_task=task_bytes,
                          progress=lambda what, done, total: seen.append((done, total)))
    assert report.records == 722 and report.index_files > 3 and report.partitions == report.windows == len(seen)
    assert (report.partitions > 20) == (task_bytes < 4096) and seen[-1] == (report.partitions, report.partitions)
    assert tree(copy, "consumequeue") == tree(original, "consumequeue")
    assert tree(copy, "index") == tree(original, "index")
    assert [Path(p).name for p in report.moved_aside] == ["index"]
    with MessageStore.open(original, CONFIG, read_only=True) as a, MessageStore.open(copy, CONFIG) as b:
        for m in a.iter_messages():
            for key in m.keys:
                assert [x.msg_id for x in b.query_message(m.topic, key)] == [
                    x.msg_id for x in a.query_message(m.topic, key)]


def test_rebuilds_in_one_second_each_set_their_old_files_aside_in_a_directory_of_their_own(tmp_path, monkeypatch):
    """The directory old files go to is named by the second: a second rebuild in that second nested its files in
    the first's (``consumequeue/consumequeue``) and a third failed half way, after moving the index aside
    (found by the Spark bench's three rebuilds of a small store)."""
    import time as time_module

    from rocketstore import rebuild as rebuild_module

    original, copy = _store_and_bare_log(tmp_path)
    (copy / "index").mkdir()
    (copy / "index" / "junk").write_bytes(b"an old index: moved aside")
    real, second = time_module.strftime, time_module.strftime("%Y%m%d%H%M%S")
    # every "now" stamp is this second (index files are named from the clock given, through an explicit time)
    monkeypatch.setattr(time_module, "strftime", lambda fmt, *when: real(fmt, *when) if when else second)
    reports = [rebuild_module.rebuild(copy, config=CONFIG, clock=counter_clock()) for _ in range(3)]
    aside = [copy / "recovery" / f"rebuild-{second}{suffix}" for suffix in ("", "-2", "-3")]
    assert sorted((copy / "recovery").iterdir()) == aside
    assert reports[0].moved_aside == [str(aside[0] / "index")]
    assert (aside[0] / "index" / "junk").read_bytes() == b"an old index: moved aside"
    for report, directory in zip(reports[1:], aside[1:], strict=True):
        assert report.moved_aside == [str(directory / "consumequeue"), str(directory / "index")]
        assert sorted(p.name for p in directory.iterdir()) == ["consumequeue", "index"]
        assert tree(directory, "consumequeue") == tree(original, "consumequeue")
        assert tree(directory, "index") == tree(original, "index")
    assert tree(copy, "consumequeue") == tree(original, "consumequeue")
    assert tree(copy, "index") == tree(original, "index")


def test_rebuilding_a_directory_without_a_store_is_a_typed_error_that_creates_nothing(tmp_path):
    from rocketstore.rebuild import rebuild as rebuild_here
    from rocketstore.store import StoreNotFoundError

    with pytest.raises(StoreNotFoundError, match="holds no store"):
        rebuild_here(tmp_path / "typo")
    assert not (tmp_path / "typo").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(StoreNotFoundError):
        rebuild_here(tmp_path / "empty")
    assert list((tmp_path / "empty").iterdir()) == []


def test_a_writer_error_closes_the_decoder_and_moves_nothing(tmp_path, monkeypatch):
    """``rebuild_from_log`` closes its decoder when the writer fails (a Spark rebuild's job in flight is cancelled
    then, not when the generator is collected), moves nothing into place, removes its staging directory, and
    releases the store's lock."""
    from rocketstore import rebuild as rebuilding

    _original, copy = _store_and_bare_log(tmp_path)
    events = []

    def decode(*args):
        try:
            yield from rebuilding.local_decoder(2048)(*args)
        finally:
            events.append("decoder closed")

    def failing_add(self, table):
        events.append("write")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(rebuilding.RebuildWriter, "add", failing_add)
    with pytest.raises(OSError, match="No space left"):
        rebuilding.rebuild_from_log(copy, CONFIG, decode)
    assert events == ["write", "decoder closed"]
    assert not (copy / "consumequeue").exists() and not (copy / "index").exists()
    assert list((copy / ".staging").iterdir()) == [] and not (copy / "recovery").exists()
    with MessageStore.open(copy, CONFIG) as store:  # the lock was released; the open re-dispatches the log
        assert store.wait_for_dispatch() and store.get_max_offset_in_queue("Batch", 0) == 20


@pytest.mark.parametrize("on_spark", [False, True])
def test_a_failed_rebuild_leaves_the_old_queues_and_index_in_place(request, tmp_path, on_spark):
    """A record with a damaged magic code in an old segment (recovery re-checks only the newest) fails the rebuild
    half way: the store keeps its queues and index, byte for byte, and serves them (the old files were moved aside
    before decoding and never came back: queues read empty and a writer's open stopped at the damage)."""
    from rocketstore.rebuild import rebuild as rebuild_here

    root = tmp_path / "s"
    results = build_store(root, 700)
    before = tree(root, "consumequeue"), tree(root, "index")
    victim = results[10].commit_log_offset
    assert victim < CONFIG.mapped_file_size_commit_log and len(list((root / "commitlog").iterdir())) > 4
    with open(root / "commitlog" / f"{0:020d}", "r+b") as f:
        f.seek(victim + 4)
        f.write(b"\0\0\0\0")
    with pytest.raises(Exception, match=r"(?i)bad magic"):
        if on_spark:
            rebuild(root, spark=request.getfixturevalue("spark"), config=CONFIG)
        else:
            rebuild_here(root, config=CONFIG)
    assert (tree(root, "consumequeue"), tree(root, "index")) == before
    assert list((root / ".staging").iterdir()) == [] and not (root / "recovery").exists()
    for read_only in (True, False):
        with MessageStore.open(root, CONFIG, read_only=read_only) as store:
            assert store.get_max_offset_in_queue("Topic0", 0) == 59
            assert store.query_message("Topic0", "k0-699") and store.query_message("Topic1", "k0-1")


class Killed(BaseException):
    """A kill, as far as the code under test can tell: nothing after it runs."""


@pytest.mark.parametrize("renames", [0, 1, 2, 3])
def test_a_rebuild_killed_mid_swap_is_finished_by_the_next_open(tmp_path, monkeypatch, renames):
    """Once the new set is complete a marker makes the swap final: a kill before any of its renames (``renames``
    done) leaves the old set or a mix on disk, and the next writer's open finishes the swap: the new set in place,
    the old one in recovery/. A build killed before the marker is removed by the open, the old set kept."""
    from rocketstore import swap

    original, copy = _store_and_bare_log(tmp_path)
    for name in ("consumequeue", "index"):
        (copy / name).mkdir()
        (copy / name / "old").write_bytes(b"the old set")
    stale = copy / ".staging" / "rebuild-19700101000000"  # a build killed before it was complete
    shutil.copytree(original / "index", stale / "index")
    from rocketstore.rebuild import rebuild as rebuild_here

    real_rename, done = swap.os.rename, []

    def rename(src, dst):
        if len(done) == renames:
            raise Killed
        done.append(dst)
        real_rename(src, dst)

    monkeypatch.setattr(swap.os, "rename", rename)
    with pytest.raises(Killed):
        rebuild_here(copy, config=CONFIG, clock=counter_clock())
    monkeypatch.undo()
    assert not stale.exists()  # the rebuild took the lock and cleared it first
    staged = [p for p in (copy / ".staging").iterdir()]
    assert len(staged) == 1 and (staged[0] / "swap").exists()
    MessageStore.open(copy, CONFIG, read_only=True).close()  # a reader changes nothing
    with MessageStore.open(copy, CONFIG) as store:
        assert tree(copy, "consumequeue") == tree(original, "consumequeue")
        assert tree(copy, "index").keys() == tree(original, "index").keys()  # the open writes the newest one's header
        assert store.get_max_offset_in_queue("Topic1", 2) > 0 and store.query_message("Topic0", "k0-699")
    assert list((copy / ".staging").iterdir()) == []
    (aside,) = (copy / "recovery").iterdir()
    assert sorted(p.name for p in aside.iterdir()) == ["consumequeue", "index"]
    assert all((aside / name / "old").read_bytes() == b"the old set" for name in ("consumequeue", "index"))


@pytest.mark.parametrize("seam", [None, 299, 300])
def test_a_full_index_file_then_records_without_keys_rolls_a_file_at_any_window_seam(tmp_path, seam):
    """The store's dispatch opens a new index file for the first record after a full one, keys or none: the
    rebuild's writer does the same whether that record ends a window's table, starts the next, or neither."""
    import pyarrow as pa

    from rocketstore.checkpoint import StoreCheckpoint
    from rocketstore.rebuild import DISPATCH_SCHEMA, RebuildReport, RebuildWriter

    config = StoreConfig(max_hash_slot_num=97, max_index_num=300)  # a file is full after 299 entries
    n = 301  # 299 records with one key each, then two without (a rolled-back transaction's: not indexed)
    table = pa.Table.from_pydict({
        "topic": ["T"] * n, "queueId": [0] * n, "queueOffset": list(range(n)),
        "commitLogOffset": [100 * i for i in range(n)], "storeSize": [100] * n, "tagsCode": [0] * n,
        "storeTimestamp": [1_700_000_000_000_000 + i for i in range(n)], "sysFlag": [0] * 299 + [0xC] * 2,
        "indexKeyHashes": [[i * 7919] for i in range(299)] + [[], []]}, schema=DISPATCH_SCHEMA)
    writer = RebuildWriter(tmp_path, config, StoreCheckpoint.load(tmp_path / "checkpoint"), counter_clock(),
                            consume_queues=True, index=True)
    try:
        for part in ([table] if seam is None else [table.slice(0, seam), table.slice(seam)]):
            writer.add(part)
        report = RebuildReport()
        writer.finish(report)
    finally:
        writer.close()
    assert (report.records, report.index_keys, report.queue_units) == (n, 299, 299)  # rollbacks: no queue unit
    assert report.index_files == 2 and len(list((tmp_path / "index").iterdir())) == 2


class _Context:
    """A SparkContext's job-group calls, recorded with the thread that made them."""

    def __init__(self) -> None:
        import threading

        self.calls: list[tuple[str, str, object]] = []
        self.current = threading.current_thread

    def setJobGroup(self, group: str, description: str) -> None:
        self.calls.append(("set", group, self.current()))

    def cancelJobGroup(self, group: str) -> None:
        self.calls.append(("cancel", group, self.current()))


def test_read_ahead_makes_the_next_window_while_the_caller_writes_this_one():
    import threading
    from types import SimpleNamespace

    from rocketstore.spark.jobs import read_ahead

    context = _Context()
    second_started = threading.Event()

    def windows():
        yield "first"
        second_started.set()
        yield "second"
        raise ValueError("window 3 failed")

    got = read_ahead(SimpleNamespace(sparkContext=context), windows(), "test")
    assert next(got) == "first"
    assert second_started.wait(10), "the next window is made while the caller holds this one"
    assert next(got) == "second"
    with pytest.raises(ValueError, match="window 3 failed"):
        next(got)  # the producer's error reaches the caller at the window it failed on
    groups = {group for _, group, _ in context.calls}
    assert len(groups) == 1 and all(kind == "set" and thread is not threading.current_thread()
                                    for kind, _, thread in context.calls)


def test_read_ahead_cancels_the_job_in_flight_when_the_caller_stops(spark):
    """A real job of a slow task is running for the next window when the writer fails: it is cancelled, and the
    call returns in seconds, not after the task's minute."""
    import time

    from rocketstore.spark.jobs import read_ahead

    def slow(batches):
        import time as clock

        clock.sleep(60)
        yield from batches

    def windows():
        yield "first"
        yield spark.range(1, numPartitions=1).mapInArrow(slow, "id long").collect()

    started = time.monotonic()
    got = read_ahead(spark, windows(), "test")
    assert next(got) == "first"
    tracker = spark.sparkContext.statusTracker()
    deadline = time.monotonic() + 30
    while not tracker.getActiveJobsIds() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tracker.getActiveJobsIds(), "the next window's job runs while the caller holds the first"
    got.close()  # the writer failed: the rebuild leaves the loop
    assert time.monotonic() - started < 40
    assert not tracker.getActiveJobsIds()


def test_rebuild_moves_old_indexes_aside_and_repairs_a_damaged_store(spark, tmp_path):
    results = build_store(tmp_path / "s", 100)
    (tmp_path / "s" / "index").joinpath(sorted(p.name for p in (tmp_path / "s" / "index").iterdir())[0]).write_bytes(
        b"garbage")
    report = rebuild(tmp_path / "s", spark=spark, config=CONFIG)
    assert any("rebuild-" in p for p in report.moved_aside)
    with MessageStore.open(tmp_path / "s", CONFIG) as store:
        assert store.query_message("Topic0", "k0-0")[0].msg_id == results[0].msg_id


def test_export_to_parquet_and_read_back(spark, tmp_path):
    build_store(tmp_path / "s", 150)
    out = tmp_path / "parquet"
    count = export_parquet(tmp_path / "s", out, spark=spark, topics=["Topic0", "Topic2"])
    assert count == 100
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["topic=Topic0", "topic=Topic2"]
    back = spark.read.parquet(str(out)).orderBy("commitLogOffset").collect()
    source = read_store(spark, tmp_path / "s", topics="Topic0,Topic2").orderBy("commitLogOffset").collect()
    for a, b in zip(back, source, strict=True):
        assert (a.msgId, a.body, dict(a.properties), a.keys, a.topic) == (b.msgId, b.body, dict(b.properties),
                                                                          b.keys, b.topic)


def test_export_refuses_a_non_empty_out_and_a_failed_overwrite_keeps_the_earlier_export(spark, tmp_path):
    """Spark's overwrite mode deleted everything in --out first (a user's files, or a good export that a failing
    one then never replaced). A non-empty out is refused without overwrite; with it, the new export is written
    aside and renamed in only when complete."""
    from rocketstore.errors import ConfigError

    results = build_store(tmp_path / "s", 700)
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("not an export")
    with pytest.raises(ConfigError, match="not empty"):
        export_parquet(tmp_path / "s", out, spark=spark)
    assert [p.name for p in out.iterdir()] == ["precious.txt"]
    assert export_parquet(tmp_path / "s", out, spark=spark, topics=["Batch"], overwrite=True) == 20
    first = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    assert "precious.txt" not in first and any(name.startswith("topic=Batch/") for name in first)
    segment = tmp_path / "s" / "commitlog" / f"{0:020d}"
    data = bytearray(segment.read_bytes())
    data[results[10].commit_log_offset + 100] ^= 0xFF  # a body byte in an old segment: the scan fails (CRC)
    segment.write_bytes(bytes(data))
    with pytest.raises(Exception, match="CRC"):
        export_parquet(tmp_path / "s", out, spark=spark, overwrite=True)
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "s"]  # no staging sibling left


def test_topics_that_look_like_numbers_survive_an_export_and_import(spark, tmp_path):
    """Spark infers partition column types from directory names: topic=007 came back as 7 and was imported as
    topic "7". Exports are read with the partition columns as strings (or with the export's own schema)."""
    from rocketstore.spark.jobs import read_export, read_parquet

    with MessageStore.open(tmp_path / "s", CONFIG) as store:
        store.put_messages([Message(topic, f"{topic} {i}".encode()) for i in range(2) for topic in ("007", "1e3")])
    assert export_parquet(tmp_path / "s", tmp_path / "out", spark=spark) == 4
    for df in (read_parquet(spark, tmp_path / "out"), read_export(spark, tmp_path / "out")):
        assert sorted(r.topic for r in df.select("topic").collect()) == ["007", "007", "1e3", "1e3"]
    import_messages(read_parquet(spark, tmp_path / "out"), tmp_path / "t", config=CONFIG)
    with MessageStore.open(tmp_path / "t", CONFIG, read_only=True) as store:
        assert sorted((m.topic, m.body) for m in store.iter_messages()) == sorted(
            (t, f"{t} {i}".encode()) for i in range(2) for t in ("007", "1e3"))
    assert spark.conf.get("spark.sql.sources.partitionColumnTypeInference.enabled") == "true"


def test_an_export_imported_keeps_every_queues_order(spark, tmp_path):
    """Spark lists a dataset's files largest first: an export -> import round trip stored a topic's part files (one
    per log range) out of log order, and every queue's messages with them. Both readers store them in name order."""
    import pyarrow as pa

    from rocketstore.importing import import_parquet
    from rocketstore.spark.jobs import read_parquet

    with MessageStore.open(tmp_path / "s", CONFIG) as store:
        for start in range(0, 1200, 100):
            n = range(start, start + 100)
            store.put_batch(pa.table({"topic": [f"Q{i % 2}" for i in n], "body": [b"%d" % i for i in n],
                                      "queue_id": pa.array([i // 2 % 2 for i in n], pa.int32())}))

    def queues(root: Path) -> dict[tuple[str, int], list[bytes]]:
        found: dict[tuple[str, int], list[bytes]] = {}
        with MessageStore.open(root, CONFIG, read_only=True) as store:
            for m in store.iter_messages():
                found.setdefault((m.topic, m.queue_id), []).append(m.body)
        return found

    export_parquet(tmp_path / "s", tmp_path / "out", spark=spark, maxBytesPerPartition=16 << 10, minPartitions=8)
    assert len(list((tmp_path / "out").rglob("*.parquet"))) >= 8
    import_messages(read_parquet(spark, tmp_path / "out"), tmp_path / "spark", config=CONFIG)
    import_parquet(tmp_path / "out", tmp_path / "here", config=CONFIG)
    original = queues(tmp_path / "s")
    assert queues(tmp_path / "spark") == original and queues(tmp_path / "here") == original


def test_both_readers_name_a_bad_row_by_its_place_in_file_name_order(spark, tmp_path):
    """The check pass counts rows in the order the import stores them: file name order, whatever the order of
    Spark's partitions (larger files first, a file split over several)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rocketstore.errors import MessageIllegalError
    from rocketstore.importing import import_parquet
    from rocketstore.spark.jobs import read_parquet

    for k, size in enumerate([3, 50, 7, 30]):
        bodies = [None if (k, i) == (2, 4) else b"x" * (10 + 90 * (k == 1)) for i in range(size)]
        pq.write_table(pa.table({"topic": ["A"] * size, "body": pa.array(bodies, pa.binary())}),
                       tmp_path / f"part-{k}.parquet")
    for run in (lambda: import_messages(read_parquet(spark, tmp_path), tmp_path / "s", config=CONFIG),
                lambda: import_parquet(tmp_path, tmp_path / "s", config=CONFIG)):
        with pytest.raises(MessageIllegalError, match=r"^row 57: body is null"):
            run()
    assert not (tmp_path / "s").exists()


def test_files_without_a_row_index_are_imported_in_partition_order_quietly(spark, tmp_path, capfd):
    """JSON (or CSV) files have no _metadata.row_index: such a DataFrame keeps Spark's partition order, and the probe
    for the row index does not print Spark's logged AnalysisException at the user."""
    (tmp_path / "j").mkdir()
    for k in range(3):
        (tmp_path / "j" / f"part-{k}.json").write_text(
            "\n".join(json.dumps({"topic": "A", "body": f"{k}-{i}"}) for i in range(5 * (k + 1))))
    report = import_messages(spark.read.json(str(tmp_path / "j")), tmp_path / "s", config=CONFIG)
    assert report.rows == 30
    assert sorted(_stored_bodies(tmp_path / "s")) == sorted(f"{k}-{i}".encode() for k in range(3)
                                                            for i in range(5 * (k + 1)))
    assert "FIELD_NOT_FOUND" not in capfd.readouterr().err


def test_scans_and_exports_of_nothing_are_empty_not_errors(spark, tmp_path):
    """A scan that plans no task failed ('InputPartition' object has no attribute 'read'), an export matching
    nothing with UNABLE_TO_INFER_SCHEMA: both are empty, and the empty export still says what its columns are."""
    from rocketstore.spark.jobs import read_export

    build_store(tmp_path / "s", 5)
    (tmp_path / "empty" / "commitlog").mkdir(parents=True)
    assert read_store(spark, tmp_path / "empty").count() == 0
    assert read_store(spark, tmp_path / "s", startingOffset=1 << 40).count() == 0
    assert read_store(spark, tmp_path / "s", columns=["topic"], packed=True, startingOffset=1 << 40).count() == 0
    for n, options in enumerate([{"topics": ["Nope"]}, {"begin": 1, "end": 2}]):
        out = tmp_path / f"out{n}"
        assert export_parquet(tmp_path / "s", out, spark=spark, **options) == 0
        assert read_export(spark, out).count() == 0
        assert spark.read.parquet(str(out)).columns[:2] == ["topic", "queueId"]
    assert export_parquet(tmp_path / "empty", tmp_path / "out2", spark=spark) == 0


def test_import_stores_each_row_once_and_reads_back_equal(spark, tmp_path):
    rows = [(f"Imp{i % 2}", f"payload {i}".encode(), [f"ik{i}"], f"T{i % 3}", {"i": str(i)}, i % 3)
            for i in range(300)]
    df = spark.createDataFrame(rows, "topic string, body binary, keys array<string>, tags string, "
                                     "properties map<string,string>, queueId int").repartition(3)
    report = import_messages(df, tmp_path / "s", config=CONFIG)
    assert report.rows == 300
    back = read_store(spark, tmp_path / "s").collect()
    assert len(back) == 300
    got = sorted((r.topic, r.body, r.keys, r.tags, dict(r.properties)["i"], r.queueId) for r in back)
    assert got == sorted((t, b, k, g, p["i"], q) for t, b, k, g, p, q in rows)
    with MessageStore.open(tmp_path / "s", CONFIG) as store:
        assert store.query_message("Imp1", "ik7")[0].body == b"payload 7"
    bad = spark.createDataFrame([("ok", b"x"), ("bad/topic", b"y")], "topic string, body binary").coalesce(1)
    with pytest.raises(Exception, match="row 1"):
        import_messages(bad, tmp_path / "s", config=CONFIG)


def test_export_and_import_carry_flag_born_timestamp_and_born_host(spark, tmp_path):
    from rocketstore.spark.jobs import read_export

    with MessageStore.open(tmp_path / "s", CONFIG) as store:
        store.put_message(Message("A", b"one", keys=["k1"], tags="t1", properties={"color": "red"}, flag=7,
                                  born_timestamp=1_600_000_000_123, born_host="10.1.2.3:4567", queue_id=2))
        store.put_message(Message("A", b"two", queue_id=1))
    export_parquet(tmp_path / "s", tmp_path / "out", spark=spark)
    import_messages(read_export(spark, tmp_path / "out"), tmp_path / "t", config=CONFIG)
    fields = ("topic", "queue_id", "body", "keys", "tags", "flag", "born_timestamp", "born_host", "uniq_key")
    with MessageStore.open(tmp_path / "s", CONFIG, read_only=True) as a, \
            MessageStore.open(tmp_path / "t", CONFIG, read_only=True) as b:
        before, after = ([(*(getattr(m, f) for f in fields), m.properties.get("color"))
                          for m in sorted(s.iter_messages(), key=lambda m: m.body)] for s in (a, b))
    assert after == before and after[0][5:7] == (7, 1_600_000_000_123) and str(after[0][7]) == "10.1.2.3:4567"


def test_import_names_the_bad_row_of_a_batch_and_keeps_the_batches_before(spark, tmp_path):
    """Rows go in as one put_batch per Arrow batch (here 64 rows): a bad row the checks before the import cannot
    see (a born host that does not parse) stops it in its batch, nothing of which is stored, every batch before it
    is, and the error says where to resume. String bodies and keys work."""
    rows = [(f"Imp{i % 2}", f"text {i}", f"a{i} b{i}", "not a host" if i == 70 else None) for i in range(100)]
    df = spark.createDataFrame(rows, "topic string, body string, keys string, bornHost string").coalesce(1)
    old = spark.conf.get("spark.sql.execution.arrow.maxRecordsPerBatch")
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "64")
    try:
        with pytest.raises(Exception, match=r"row 70: .*not a host.*\(rows 64\.\.99 not stored, the 64 before them "
                                            r"are: once the data is fixed, import from row 64 on: --from-row 64\)"):
            import_messages(df, tmp_path / "s", config=CONFIG)
        report = import_messages(df.where("bornHost is null").repartition(3), tmp_path / "t", config=CONFIG)
    finally:
        spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", old)
    with MessageStore.open(tmp_path / "s", CONFIG) as store:
        stored = list(store.iter_messages())
        assert [m.body for m in stored] == [f"text {i}".encode() for i in range(64)]
        assert stored[5].keys == ["a5", "b5"] and store.query_message("Imp1", "b63")[0].body == b"text 63"
    assert report.rows == 99 and report.batches >= 3
    with MessageStore.open(tmp_path / "t", CONFIG) as store:
        assert sorted(m.body for m in store.iter_messages()) == sorted(f"text {i}".encode() for i in range(100)
                                                                        if i != 70)


def test_an_import_that_stopped_finishes_from_the_row_its_error_names(spark, tmp_path):
    """The error of an import that stopped said "import from row N on", which nothing could do: ``skip_rows``
    (``--from-row``) reads the rows before N and stores the rest, so every row is stored once, in order."""
    rows = [(f"Imp{i % 2}", f"text {i}", "not a host" if i == 70 else None) for i in range(100)]
    schema = "topic string, body string, bornHost string"
    old = spark.conf.get("spark.sql.execution.arrow.maxRecordsPerBatch")
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "32")
    try:
        df = spark.createDataFrame(rows, schema).coalesce(1)
        with pytest.raises(Exception, match=r"import from row 64 on: --from-row 64\)"):
            import_messages(df, tmp_path / "s", config=CONFIG)
        fixed = spark.createDataFrame([(t, b, None) for t, b, _h in rows], schema).coalesce(1)
        with pytest.raises(ConfigError, match="cannot import from row 101 on: the dataset has 100 rows"):
            import_messages(fixed, tmp_path / "s", config=CONFIG, skip_rows=101)
        with pytest.raises(Exception, match=r"row 70: .*not a host.*import from row 64 on"):  # as before
            import_messages(df, tmp_path / "s", config=CONFIG, skip_rows=64)
        report = import_messages(fixed, tmp_path / "s", config=CONFIG, skip_rows=70)
    finally:
        spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", old)
    assert (report.rows, report.skipped) == (30, 70)
    with MessageStore.open(tmp_path / "s", CONFIG, read_only=True) as store:
        assert [m.body for m in store.iter_messages()] == [f"text {i}".encode() for i in range(64)] + \
            [f"text {i}".encode() for i in range(70, 100)]
    done = cli("import", "--store", str(tmp_path / "s"), "--parquet", str(tmp_path), "--from-row", "-1", check=False)
    assert done.returncode == 2 and "--from-row" in done.stderr and "Traceback" not in done.stderr


@pytest.fixture
def small_arrow_batches(spark):
    old = spark.conf.get("spark.sql.execution.arrow.maxRecordsPerBatch")
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "32")
    yield
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", old)


def _stored_bodies(root: Path) -> list[bytes]:
    with MessageStore.open(root, CONFIG, read_only=True) as store:
        return [m.body for m in store.iter_messages()]


@pytest.mark.parametrize("stop", ["after the append", "before the append"])
def test_an_import_stopped_mid_way_finishes_each_row_once_when_run_again(spark, tmp_path, small_arrow_batches,
                                                                        monkeypatch, stop):
    """An import stopped between batches (a crash, a refused row) had no record of what it had stored: run again
    it stored every row again, and the error's row was all there was to go on. The store's journal of the
    import now lets the same import run again go on from the first row the store does not hold, whether the
    batch being written when it stopped reached the log or not."""
    rows = [(f"Imp{i % 3}", f"row {i}".encode(), [f"k{i}"]) for i in range(200)]
    df = spark.createDataFrame(rows, "topic string, body binary, keys array<string>").coalesce(1)
    real_put = stop_at_third_batch(monkeypatch, stop)
    with pytest.raises(KeyboardInterrupt):
        import_messages(df, tmp_path / "s", config=CONFIG)
    monkeypatch.setattr(MessageStore, "put_batch", real_put)
    assert (tmp_path / "s" / "importProgress.json").exists()
    stored = 96 if stop == "after the append" else 64
    assert len(_stored_bodies(tmp_path / "s")) == stored
    geometry = ("--max-hash-slot-num", "97", "--max-index-num", "300")
    shown = cli("inspect", "--store", str(tmp_path / "s"), *geometry).stdout
    assert f"unfinished import of a DataFrame of 200 rows, read by Spark: {stored} rows stored" in shown

    other = spark.createDataFrame([("Other", b"o")], "topic string, body binary")
    before = files_of(tmp_path / "s")
    with pytest.raises(ConfigError, match="holds an unfinished import of a DataFrame of 200 rows"):
        import_messages(other, tmp_path / "s", config=CONFIG)
    assert files_of(tmp_path / "s") == before
    report = import_messages(df, tmp_path / "s", config=CONFIG)
    assert (report.skipped, report.rows) == ((96, 104) if stop == "after the append" else (64, 136))
    assert _stored_bodies(tmp_path / "s") == [body for _t, body, _k in rows]
    assert json.loads((tmp_path / "s" / "importProgress.json").read_text())["complete"] is True
    assert json.loads(cli("inspect", "--store", str(tmp_path / "s"), *geometry, "--json").stdout)[
        "unfinishedImport"] is None
    with MessageStore.open(tmp_path / "s", CONFIG, read_only=True) as store:
        assert [m.body for m in store.query_message("Imp2", "k95")] == [b"row 95"]
    import_messages(other, tmp_path / "s", config=CONFIG)  # nothing unfinished: another dataset goes in
    assert _stored_bodies(tmp_path / "s")[-1] == b"o"


def test_a_damaged_import_journal_is_a_typed_error_and_changes_nothing(spark, tmp_path):
    df = spark.createDataFrame([("A", b"a")], "topic string, body binary")
    import_messages(df, tmp_path / "s", config=CONFIG)
    for damage in ("{not json", '{"source": {}, "rows_done": -1, "log_end": 0}', '{"source": {}}', "[" * 100_000,
                   '{"source": {}, "rows_done": true, "log_end": 0}', "[1, 2]"):
        (tmp_path / "s" / "importProgress.json").write_text(damage)
        before = files_of(tmp_path / "s")
        with pytest.raises(ConfigError, match=r"import journal .*importProgress\.json is damaged"):
            import_messages(df, tmp_path / "s", config=CONFIG)
        assert files_of(tmp_path / "s") == before
    report = import_messages(df, tmp_path / "s", config=CONFIG, skip_rows=0)  # named: the journal is replaced
    assert report.rows == 1 and _stored_bodies(tmp_path / "s") == [b"a", b"a"]
    assert json.loads((tmp_path / "s" / "importProgress.json").read_text())["complete"] is True
    source = {"plan": df.semanticHash(), "rows": 1, "reader": "spark", "order": "partitions"}  # a journal that
    # counted rows past the log's end
    (tmp_path / "s" / "importProgress.json").write_text(json.dumps({"source": source, "rows_done": 1,
                                                                    "log_end": 1 << 20}))
    before = files_of(tmp_path / "s")
    with pytest.raises(ConfigError, match="before the 1048576 where the import's journal counted 1 rows"):
        import_messages(df, tmp_path / "s", config=CONFIG)
    assert files_of(tmp_path / "s") == before


KILLED_IMPORT = DIE_AFTER_THIRD_BATCH + """
from rocketstore import StoreConfig
from rocketstore.spark import spark_session
from rocketstore.spark.jobs import import_messages, read_parquet

spark = spark_session("local[1]", "killed-import", driver_memory="512m", shuffle_partitions=1,
                      extra_conf={"spark.sql.execution.arrow.maxRecordsPerBatch": "32"})
config = StoreConfig(mapped_file_size_commit_log=32 << 10, mapped_file_size_consume_queue=20 * 100,
                     max_hash_slot_num=97, max_index_num=300)
import_messages(read_parquet(spark, sys.argv[1]), sys.argv[2], config=config)
"""


def test_an_import_killed_mid_way_finishes_each_row_once_when_run_again(spark, tmp_path, small_arrow_batches):
    """SIGKILL right after the third batch reached the log: run again, the import stores the other rows once."""
    from rocketstore.spark.jobs import read_parquet

    rows = [(f"Imp{i % 3}", f"row {i}".encode()) for i in range(150)]
    spark.createDataFrame(rows, "topic string, body binary").coalesce(1).write.parquet(str(tmp_path / "src"))
    done = subprocess.run([sys.executable, "-c", KILLED_IMPORT, str(tmp_path / "src"), str(tmp_path / "s")],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    assert (tmp_path / "s" / "abort").exists() and (tmp_path / "s" / "importProgress.json").exists()
    report = import_messages(read_parquet(spark, tmp_path / "src"), tmp_path / "s", config=CONFIG)
    assert (report.skipped, report.rows) == (96, 54)
    assert sorted(_stored_bodies(tmp_path / "s")) == sorted(body for _t, body in rows)


def test_import_checks_the_rows_before_storing_any_and_leaves_no_skeleton(spark, tmp_path):
    """A null body near the end of an import failed after the batches before it were stored, with no marker; a
    run after fixing the row stored them twice. Rows are checked in one pass first (nulls, topic rules, sizes,
    queue ids): a bad one is named by its place and nothing is stored; a new store's directory is not left."""
    from rocketstore.errors import InvalidTopicError, MessageIllegalError, MessageTooLargeError

    good = [("A", b"m%d" % i, 0) for i in range(300)]
    cases = [(250, ("A", None, 0), MessageIllegalError, "body is null"),
             (299, (None, b"x", 0), MessageIllegalError, "topic is null"),
             (7, ("bad/topic", b"x", 0), InvalidTopicError, "may contain only"),
             (100, ("A", b"x" * 40000, 0), MessageTooLargeError, "does not fit a commit-log segment of 32768"),
             (3, ("A", b"x", -1), MessageIllegalError, "queueId -1 is negative")]
    for at, row, error, text in cases:
        rows = [*good[:at], row, *good[at + 1:]]
        df = spark.createDataFrame(rows, "topic string, body binary, queueId int").repartition(3)
        place = [r.body for r in df.collect()].index(row[1])  # where the import reads it (bodies are unique)
        with pytest.raises(error, match=text + r".*nothing imported") as caught:
            import_messages(df, tmp_path / "new" / "store", config=CONFIG)
        assert str(caught.value).startswith(f"row {place}: ")
        assert not (tmp_path / "new").joinpath("store").exists()
    build_store(tmp_path / "old", 5)
    with pytest.raises(MessageIllegalError, match="body is null"):
        import_messages(spark.createDataFrame([("A", b"a"), ("A", None)], "topic string, body binary"),
                        tmp_path / "old", config=CONFIG)
    with MessageStore.open(tmp_path / "old", CONFIG, read_only=True) as store:
        assert sum(1 for _ in store.iter_messages()) == 27


def test_find_keys_across_stores(spark, tmp_path):
    a = build_store(tmp_path / "a", 120, seed=0)
    b = build_store(tmp_path / "b", 120, seed=1)
    found = find_keys([tmp_path / "a", tmp_path / "b"], [("Topic0", "k0-0"), ("Topic1", "k1-0"), ("Topic0", "g3"),
                                                         ("Nope", "x"), ("Topic0", "k9-9")], spark=spark, config=CONFIG)
    rows = found.collect()
    by_query: dict[tuple[str, str], set[str]] = {}
    for r in rows:
        by_query.setdefault((r.queryTopic, r.queryKey), set()).add(r.msgId)
        assert r.topic == r.queryTopic and r.queryKey in r.keys
    assert by_query[("Topic0", "k0-0")] == {a[0].msg_id}
    assert by_query[("Topic1", "k1-0")] == {b[0].msg_id}
    assert ("Nope", "x") not in by_query and ("Topic0", "k9-9") not in by_query
    expected_g3 = sum(1 for i in range(120) if i % 10 == 3 and i % 3 == 0) + sum(
        1 for i in range(120) if i % 10 == 3 and (i + 1) % 3 == 0)
    assert len(by_query[("Topic0", "g3")]) == expected_g3


def test_find_keys_answers_once_for_a_store_or_key_named_twice(spark, tmp_path):
    a = build_store(tmp_path / "broker-a" / "store", 30)
    (tmp_path / "link").symlink_to(tmp_path / "broker-a")
    stores = [tmp_path / "broker-a" / "store", str(tmp_path / "*" / "store"), tmp_path / "link" / "store"]
    found = find_keys(stores, [("Topic0", "k0-0"), ("Topic0", "k0-0")], spark=spark, config=CONFIG).collect()
    assert [r.msgId for r in found] == [a[0].msg_id]
    keys = spark.createDataFrame([("Topic0", "k0-0")] * 2, "topic string, key string")
    assert [r.msgId for r in find_keys(stores, keys, spark=spark, config=CONFIG).collect()] == [a[0].msg_id]


def test_summary_per_topic_and_minute(spark, tmp_path):
    build_store(tmp_path / "s", 90)
    per_topic, per_minute = messages_per_topic_and_minute(read_store(spark, tmp_path / "s"))
    assert {r.topic: r["count"] for r in per_topic.collect()} == {"Topic0": 30, "Topic1": 30, "Topic2": 30,
                                                                  "Batch": 20, "Tx": 2}
    assert sum(r["count"] for r in per_minute.collect()) == 112


def test_streaming_reads_exactly_what_was_appended(spark, tmp_path):
    root = tmp_path / "stream"
    build_store(root, 30)
    checkpoint = tmp_path / "ckpt"
    out = tmp_path / "out"

    def run_once() -> None:
        query = (spark.readStream.format("rocketmq").load(str(root)).select("commitLogOffset", "topic")
                 .writeStream.format("parquet").option("checkpointLocation", str(checkpoint))
                 .option("path", str(out)).trigger(availableNow=True).start())
        query.awaitTermination(120)

    run_once()
    assert spark.read.parquet(str(out)).count() == 52
    with MessageStore.open(root, CONFIG) as store:
        added = [store.put_message(Message("Later", f"{i}".encode())) for i in range(7)]
    run_once()
    rows = spark.read.parquet(str(out)).collect()
    assert len(rows) == 59 and len({r.commitLogOffset for r in rows}) == 59
    assert {r.commitLogOffset for r in rows if r.topic == "Later"} == {r.commit_log_offset for r in added}


def test_bad_options_are_clear_errors(spark, tmp_path):
    build_store(tmp_path / "s", 5)
    with pytest.raises(Exception, match="onCorrupt"):
        read_store(spark, tmp_path / "s", onCorrupt="maybe").count()
    with pytest.raises(Exception, match="startingTimestamp"):
        read_store(spark, tmp_path / "s", startingTimestamp="yesterday").count()
    with pytest.raises(CorruptDataError):
        _scan_whole_segment_of_garbage(tmp_path)
    # unknown and misspelt options were ignored: a scan of everything; a size of 0 meant the default
    for name, value, message in [("topic", "A", "no option 'topic' .*did you mean 'topics'"),
                                 ("startTimestamp", "1", "did you mean 'startingTimestamp'"),
                                 ("maxBytesPerPartition", "0", "at least 1024, not 0"),
                                 ("mappedFileSizeCommitLog", "-1", "at least 1024, not -1")]:
        with pytest.raises(Exception, match=message):
            spark.read.format("rocketmq").option(name, value).load(str(tmp_path / "s")).count()
    # names ignore case, as Spark's do
    assert spark.read.format("rocketmq").option("TOPICS", "Topic0").load(str(tmp_path / "s")).count() == 2


def _scan_whole_segment_of_garbage(tmp_path: Path) -> None:
    from rocketstore.spark.partitions import LogRange, ScanOptions, read_range

    segment = tmp_path / "g" / "commitlog" / "00000000000000000000"
    segment.parent.mkdir(parents=True)
    segment.write_bytes(b"\x00\x00\x01\x00\x12\x34\x56\x78" + bytes(1016))
    list(read_range(LogRange(str(tmp_path / "g"), "g", str(segment), 0, 1024, 0, 1024, 1024), ScanOptions()))


def test_job_entry_point_runs_a_rebuild_and_reports_errors_in_one_line(spark, tmp_path, capsys):
    import subprocess
    import sys

    from rocketstore.spark.__main__ import main

    build_store(tmp_path / "s", 50)
    base = [sys.executable, "-m", "rocketstore.spark", "--master", "local[1]", "--max-hash-slot-num", "97",
            "--max-index-num", "300"]
    assert main([*base[3:], "rebuild", str(tmp_path / "s")]) == 0  # in this process: the suite's session
    out = capsys.readouterr().out
    assert "rebuilt 70 queue units" in out and "from 72 records" in out  # 2 are transactional
    assert main([*base[3:], "summary", str(tmp_path / "s")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert {"Topic0\t17", "Topic1\t17", "Topic2\t16", "Batch\t20", "Tx\t2"} <= set(lines)
    assert sum(int(line.split("\t")[1]) for line in lines if line[:1].isdigit()) == 72  # the per-minute rows
    missing = subprocess.run([*base, "rebuild", str(tmp_path / "nope")], capture_output=True, text=True, timeout=120,
                             check=False)
    assert missing.returncode == 1
    assert missing.stderr.strip().startswith("error:") and "no store" in missing.stderr
    assert "Traceback" not in missing.stderr
    bad_key = subprocess.run([*base, "find-keys", str(tmp_path / "s"), "--key", "nocolon"], capture_output=True,
                             text=True, timeout=120, check=False)
    assert bad_key.returncode == 2 and "TOPIC:KEY" in bad_key.stderr


@pytest.mark.parametrize("how", ["here", "spark"])
def test_rebuilds_write_delayed_messages_due_at_the_stores_own_delay_levels(spark, tmp_path, how):
    """A parked message's tags code is its due time, from the broker's messageDelayLevel: both rebuilds used
    RocketMQ's default levels whatever the store's, so a one-hour delay was delivered after a second (and verify,
    given the same levels, called the rebuilt store damaged; the review)."""
    from rocketstore.rebuild import rebuild as rebuild_here

    config = CONFIG.replace(message_delay_level="1h 2h")
    original = tmp_path / "original"
    with MessageStore.open(original, config) as store:
        for i in range(6):
            store.put_message(Message("Late", b"later %d" % i, properties={"DELAY": str(1 + i % 2)}))
            store.put_message(Message("Now", b"now %d" % i))
        store.wait_for_dispatch()
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copytree(original / "commitlog", copy / "commitlog")
    shutil.copy(original / "checkpoint", copy / "checkpoint")
    if how == "here":
        rebuild_here(copy, config=config)
    else:
        rebuild(copy, spark=spark, config=config)
    assert tree(copy, "consumequeue") == tree(original, "consumequeue")
    with MessageStore.open(copy, config, read_only=True) as store:
        due = [unit[2] - store.look_message_by_offset(unit[0]).store_timestamp
               for level in (0, 1) for unit in (store.queues.get("SCHEDULE_TOPIC_XXXX", level).get_unit(n)
                                                for n in range(3))]
    assert due == [3_600_000] * 3 + [7_200_000] * 3


def test_a_whole_store_export_with_the_brokers_own_queues_imports_with_skip_system(spark, tmp_path):
    """An export holds SCHEDULE_TOPIC_XXXX and the transaction topics once the store used delays; importing it was
    refused whole. Refused still, saying how to go on; with skip_system both readers store the other rows and count
    the passed-over ones. The export keeps times as microsecond timestamps (INT96 wrapped in other readers)."""
    import pyarrow.parquet as pq

    from rocketstore.errors import InvalidTopicError
    from rocketstore.importing import import_parquet
    from rocketstore.spark.jobs import read_parquet

    with MessageStore.open(tmp_path / "s", CONFIG) as store:
        store.put_messages([Message("Orders", b"now %d" % i) for i in range(3)])
        store.put_message(Message("Orders", b"later", properties={"DELAY": "18"}))  # waits 2 h in the schedule topic
        store.put_message(Message("Orders", b"compressed", sys_flag=0x301))
    export_parquet(tmp_path / "s", tmp_path / "out", spark=spark)
    files = list((tmp_path / "out").rglob("*.parquet"))
    assert all(pq.ParquetFile(f).schema.column(pq.ParquetFile(f).schema.names.index("bornTimestamp"))
               .physical_type == "INT64" for f in files)
    with pytest.raises(InvalidTopicError, match="skip-system-topics"):
        import_parquet(tmp_path / "out", tmp_path / "refused", config=CONFIG)
    assert not (tmp_path / "refused").exists()
    here = import_parquet(tmp_path / "out", tmp_path / "here", config=CONFIG, skip_system=True)
    there = import_messages(read_parquet(spark, tmp_path / "out"), tmp_path / "spark", config=CONFIG,
                            skip_system=True)
    for report, root in ((here, tmp_path / "here"), (there, tmp_path / "spark")):
        assert (report.rows, report.system_rows) == (4, {"SCHEDULE_TOPIC_XXXX": 1}), root
        with MessageStore.open(root, CONFIG, read_only=True) as store:
            got = sorted((m.body, m.sys_flag) for m in store.iter_messages())
        assert got == sorted([(b"now %d" % i, 0) for i in range(3)] + [(b"compressed", 0x301)]), root

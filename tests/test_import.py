"""``import_parquet`` / ``rocketstore import --no-spark``: a Parquet dataset read in this process, files in name order,
each row stored once, checked before the first is stored, resumable from the store's journal."""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rocketstore import Message, MessageStore, StoreConfig, importing
from rocketstore.errors import (
    ConfigError,
    InvalidQueueError,
    InvalidTopicError,
    MessageIllegalError,
    MessageTooLargeError,
    StoredButNotClosedError,
    StoreIOError,
)
from rocketstore.importing import import_parquet
from test_cli import cli
from test_cli import tree as files_of

CONFIG = StoreConfig(mapped_file_size_commit_log=32 << 10, mapped_file_size_consume_queue=20 * 100,
                     max_hash_slot_num=97, max_index_num=300)
GEOMETRY = ("--mapped-file-size-commit-log", str(32 << 10), "--max-hash-slot-num", "97", "--max-index-num", "300")


def write(path: Path, **columns) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)


def stored(root: Path, config: StoreConfig = CONFIG) -> list:
    with MessageStore.open(root, config, read_only=True) as store:
        return list(store.iter_messages())


def export_like(root: Path) -> list[tuple[str, bytes]]:
    """An export's layout: topic=/date= directories, part files whose names give the log order (not their size
    order), Spark's _SUCCESS and .crc files beside them. Returns (topic, body) in name order."""
    expected = []
    for topic in ("007", "Orders"):  # "007": a directory name that looks like a number stays the topic's name
        for date in ("2026-11-24", "2026-11-25"):
            for part, count in enumerate((5, 40, 1, 12)):  # uneven: larger files are not the first ones
                bodies = [f"{topic} {date} {part} {i}".encode() for i in range(count)]
                write(root / f"topic={topic}" / f"date={date}" / f"part-{part:05d}-x.c000.snappy.parquet",
                      queueId=pa.array([i % 2 for i in range(count)], pa.int32()), body=bodies,
                      keys=pa.array([[f"k-{b.decode().replace(' ', '-')}"] for b in bodies], pa.list_(pa.string())))
                expected += [(topic, b) for b in bodies]
            (root / f"topic={topic}" / f"date={date}" / ".part-00000-x.c000.snappy.parquet.crc").write_bytes(b"crc")
    (root / "_SUCCESS").write_bytes(b"")
    return expected


def import_complete(root: Path) -> bool:
    """The store's journal says its last import finished (it stays: the same import run again stores nothing)."""
    return json.loads((root / "importProgress.json").read_text())["complete"] is True


def test_a_dataset_is_stored_in_file_name_order_with_its_partition_columns_as_strings(tmp_path):
    expected = export_like(tmp_path / "exp")
    report = import_parquet(tmp_path / "exp", tmp_path / "s", config=CONFIG)
    assert (report.rows, report.skipped) == (len(expected), 0)
    messages = stored(tmp_path / "s")
    assert [(m.topic, m.body) for m in messages] == expected
    assert all(m.keys == [f"k-{m.body.decode().replace(' ', '-')}"] for m in messages)
    assert import_complete(tmp_path / "s")
    with MessageStore.open(tmp_path / "s", CONFIG, read_only=True) as store:  # every queue in its original order
        for queue in (0, 1):
            got = [m.body for m in store.get_message("Orders", queue, 0, 1000).messages]
            assert got == [b for t, b in expected if t == "Orders" and int(b.split()[-1]) % 2 == queue]
        assert [m.body for m in store.query_message("007", "k-007-2026-11-25-1-39")] == [b"007 2026-11-25 1 39"]


def test_every_column_export_writes_comes_back(tmp_path):
    born = datetime.datetime(2020, 9, 13, 12, 26, 40, 123000, tzinfo=datetime.UTC)
    write(tmp_path / "one.parquet", topic=["A", "A"], body=[b"one", b"two"], tags=["t1", None],
          keys=pa.array([["k1", "k2"], None], pa.list_(pa.string())),
          properties=pa.array([[("color", "red")], None], pa.map_(pa.string(), pa.string())),
          queueId=pa.array([2, 1], pa.int32()), flag=pa.array([7, 0], pa.int32()),
          bornTimestamp=pa.array([born, born], pa.timestamp("ms", "UTC")), bornHost=["10.1.2.3:4567", None])
    import_parquet(tmp_path / "one.parquet", tmp_path / "s", config=CONFIG)
    one, two = stored(tmp_path / "s")
    assert (one.topic, one.body, one.tags, one.keys, one.properties["color"], one.queue_id, one.flag) == \
        ("A", b"one", "t1", ["k1", "k2"], "red", 2, 7)
    assert (one.born_timestamp, str(one.born_host)) == (1_600_000_000_123, "10.1.2.3:4567")
    assert (two.body, two.queue_id, two.keys, two.tags) == (b"two", 1, [], None)


@pytest.mark.parametrize(("at", "row", "error", "text"), [
    (250, ("A", None, 0), MessageIllegalError, "body is null"),
    (299, (None, b"x", 0), MessageIllegalError, "topic is null"),
    (7, ("bad/topic", b"x", 0), InvalidTopicError, "may contain only"),
    (100, ("A", b"x" * 40000, 0), MessageTooLargeError, "does not fit a commit-log segment of 32768"),
    (3, ("A", b"x", -1), InvalidQueueError, "queueId -1 is negative"),
])
def test_rows_are_checked_before_any_is_stored(tmp_path, at, row, error, text):
    """The same checks as the Spark import's, the bad row named by its place in the dataset (across files)."""
    rows = [("A", b"m%d" % i, 0) for i in range(300)]
    rows[at] = row
    for n, start in enumerate(range(0, 300, 120)):
        part = rows[start:start + 120]
        write(tmp_path / "d" / f"part-{n:05d}.parquet", topic=pa.array([r[0] for r in part], pa.string()),
              body=pa.array([r[1] for r in part], pa.binary()), queueId=pa.array([r[2] for r in part], pa.int32()))
    with pytest.raises(error, match=text + r".*nothing imported") as caught:
        import_parquet(tmp_path / "d", tmp_path / "new" / "store", config=CONFIG)
    assert str(caught.value).startswith(f"row {at}: ")
    assert not (tmp_path / "new" / "store").exists()
    with MessageStore.open(tmp_path / "old", CONFIG) as store:
        store.put_message(Message("A", b"before"))
    before = files_of(tmp_path / "old")
    with pytest.raises(error):
        import_parquet(tmp_path / "d", tmp_path / "old", config=CONFIG)
    assert files_of(tmp_path / "old") == before


def test_what_is_not_a_dataset_of_messages_is_a_typed_error(tmp_path):
    write(tmp_path / "nobody" / "a.parquet", topic=["A"])
    (tmp_path / "empty").mkdir()
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.parquet").write_text("not parquet")
    for path, text in [(tmp_path / "missing", "does not exist"), (tmp_path / "empty", "holds no Parquet file"),
                       (tmp_path / "text", r"a\.parquet is not a readable Parquet file"),
                       (tmp_path / "nobody", r"needs columns topic and body; missing \['body'\]")]:
        with pytest.raises(ConfigError, match=text):
            import_parquet(path, tmp_path / "s", config=CONFIG)
    write(tmp_path / "ok.parquet", topic=["A"], body=[b"a"])
    with pytest.raises(ConfigError, match="cannot import from row 2 on: the dataset has 1 rows"):
        import_parquet(tmp_path / "ok.parquet", tmp_path / "s", config=CONFIG, skip_rows=2)
    assert not (tmp_path / "s").exists()
    for args, text in [(("--master", "spark://h:7077"), "leave out --master"),
                       (("--ship-env",), "leave out --master and --ship-env")]:
        done = cli("import", "--store", str(tmp_path / "s"), "--parquet", str(tmp_path / "ok.parquet"), "--no-spark",
                   *args, check=False)
        assert done.returncode == 2 and text in done.stderr and "Traceback" not in done.stderr
    done = cli("import", "--store", str(tmp_path / "s"), "--parquet", "hdfs:///x", "--no-spark", check=False)
    assert done.returncode == 2 and "a URL needs Spark" in done.stderr
    done = cli("import", "--store", str(tmp_path / "s"), "--parquet", str(tmp_path / "text"), "--no-spark", check=False)
    assert done.returncode == 1 and "is not a readable Parquet file" in done.stderr and "Traceback" not in done.stderr


def stop_at_third_batch(monkeypatch, stop: str):
    """``put_batch`` stops the import at its third batch, after or before appending it, as a kill would (checking
    that the log is flushed before each batch: what the journal counts is on disk). Returns the real one."""
    real_put, calls = MessageStore.put_batch, []

    def put_then_stop(store, table, **options):
        assert store.commit_log.flushed_offset == store.commit_log.max_offset  # what the journal counts is on disk
        calls.append(table.num_rows)
        if len(calls) == 3:
            if stop == "after the append":
                real_put(store, table, **options)
            raise KeyboardInterrupt  # nothing after this line of the import runs, as after a kill
        return real_put(store, table, **options)

    monkeypatch.setattr(MessageStore, "put_batch", put_then_stop)
    return real_put


@pytest.mark.parametrize("stop", ["after the append", "before the append"])
def test_an_import_stopped_mid_way_finishes_each_row_once_when_run_again(tmp_path, monkeypatch, stop):
    rows = [f"row {i}".encode() for i in range(200)]
    for n in range(2):
        write(tmp_path / "d" / f"part-{n}.parquet", topic=[f"Imp{i % 3}" for i in range(n * 100, n * 100 + 100)],
              body=rows[n * 100:n * 100 + 100])
    monkeypatch.setattr(importing, "IMPORT_CHUNK_ROWS", 32)
    real_put = stop_at_third_batch(monkeypatch, stop)
    with pytest.raises(KeyboardInterrupt):
        import_parquet(tmp_path / "d", tmp_path / "s", config=CONFIG)
    monkeypatch.setattr(MessageStore, "put_batch", real_put)
    done = 96 if stop == "after the append" else 64
    assert len(stored(tmp_path / "s")) == done
    shown = cli("inspect", "--store", str(tmp_path / "s"), *GEOMETRY).stdout
    assert f"(200 rows), read in this process (--no-spark): {done} rows stored" in shown
    write(tmp_path / "other.parquet", topic=["Other"], body=[b"o"])
    before = files_of(tmp_path / "s")
    with pytest.raises(ConfigError, match=r"holds an unfinished import of 2 file.*read in this process"):
        import_parquet(tmp_path / "other.parquet", tmp_path / "s", config=CONFIG)
    assert files_of(tmp_path / "s") == before
    report = import_parquet(tmp_path / "d", tmp_path / "s", config=CONFIG)
    assert (report.skipped, report.rows) == (done, 200 - done)
    assert [m.body for m in stored(tmp_path / "s")] == rows
    assert import_complete(tmp_path / "s")
    again = import_parquet(tmp_path / "d", tmp_path / "s", config=CONFIG)  # run once more: a kill hid the report
    assert (again.already_imported, again.rows, again.skipped) == (True, 0, 200)
    assert [m.body for m in stored(tmp_path / "s")] == rows
    import_parquet(tmp_path / "other.parquet", tmp_path / "s", config=CONFIG)  # another import replaces the journal
    assert stored(tmp_path / "s")[-1].body == b"o" and import_complete(tmp_path / "s")


def test_an_unfinished_import_read_by_spark_is_not_finished_in_another_order(tmp_path):
    """Spark and this process may read a dataset in different orders: the rows the store holds are counted in one,
    so the other may not go on from them."""
    write(tmp_path / "d" / "a.parquet", topic=["A"] * 3, body=[b"a", b"b", b"c"])
    import_parquet(tmp_path / "d", tmp_path / "s", config=CONFIG)
    source = {**importing.ParquetDataset(tmp_path / "d").source(), "reader": "spark", "order": "files"}
    with MessageStore.open(tmp_path / "s", CONFIG, read_only=True) as store:
        end = store.commit_log.max_offset
    (tmp_path / "s" / "importProgress.json").write_text(json.dumps({"source": source, "rows_done": 1, "log_end": end}))
    before = files_of(tmp_path / "s")
    with pytest.raises(ConfigError, match=r"unfinished import of 1 file\(s\) .*, read by Spark: run that import again"):
        import_parquet(tmp_path / "d", tmp_path / "s", config=CONFIG)
    assert files_of(tmp_path / "s") == before
    report = import_parquet(tmp_path / "d", tmp_path / "s", config=CONFIG, skip_rows=1)  # named: goes ahead
    assert report.rows == 2 and [m.body for m in stored(tmp_path / "s")] == [b"a", b"b", b"c", b"b", b"c"]


DIE_AFTER_THIRD_BATCH = """
import os, signal, sys
from rocketstore import MessageStore

real_put, calls = MessageStore.put_batch, []

def put_then_die(store, table, **options):
    result = real_put(store, table, **options)
    calls.append(1)
    if len(calls) == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return result

MessageStore.put_batch = put_then_die
"""  # the start of a script: an import that SIGKILLs itself once its third batch is in the log

KILLED = DIE_AFTER_THIRD_BATCH + """
from rocketstore import importing
from rocketstore.cli.app import main

importing.IMPORT_CHUNK_ROWS = 32
main(["import", "--no-spark", "--parquet", sys.argv[1], "--store", sys.argv[2], *sys.argv[3:]])
"""


def test_an_import_killed_mid_way_finishes_each_row_once_when_run_again(tmp_path):
    """SIGKILL right after the third batch reached the log: run again, the import stores the other rows once."""
    rows = [f"row {i}".encode() for i in range(150)]
    write(tmp_path / "src.parquet", topic=[f"Imp{i % 3}" for i in range(150)], body=rows)
    done = subprocess.run([sys.executable, "-c", KILLED, str(tmp_path / "src.parquet"), str(tmp_path / "s"),
                           *GEOMETRY], capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    assert (tmp_path / "s" / "abort").exists() and (tmp_path / "s" / "importProgress.json").exists()
    again = cli("import", "--no-spark", "--parquet", str(tmp_path / "src.parquet"), "--store", str(tmp_path / "s"),
                *GEOMETRY)
    assert "imported 54 messages in 1 batches" in again.stdout and "(rows 96 on)" in again.stdout
    assert [m.body for m in stored(tmp_path / "s")] == rows


def _damage_column(path: Path, column: str) -> None:
    """Overwrite the data pages of ``column`` in every row group (the footer stays readable)."""
    meta = pq.ParquetFile(path).metadata
    data = bytearray(path.read_bytes())
    for group in range(meta.num_row_groups):
        for i in range(meta.num_columns):
            chunk = meta.row_group(group).column(i)
            if chunk.path_in_schema.split(".")[0] == column:
                start = chunk.data_page_offset
                data[start:start + chunk.total_compressed_size] = b"\xff" * chunk.total_compressed_size
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["unreadable keys", "keys of another type"])
def test_a_file_failing_after_the_checks_names_the_rows_stored_and_where_to_go_on(tmp_path, damage):
    """The check pass reads topic, body and queueId only: a later file whose other columns cannot be read (or cast)
    stops the store pass after the earlier files are stored. The error says how many are and where the same import
    goes on from, as a refused batch's does; run again once the file is fixed, it finishes each row once."""
    write(tmp_path / "d" / "a.parquet", topic=["T"] * 50, body=[f"a{i}".encode() for i in range(50)],
          keys=pa.array([[f"a{i}"] for i in range(50)], pa.list_(pa.string())))
    good_b = dict(topic=["T"] * 30, body=[f"b{i}".encode() for i in range(30)],
                  keys=pa.array([[f"b{i}"] for i in range(30)], pa.list_(pa.string())))
    if damage == "unreadable keys":
        pq.write_table(pa.table(good_b), tmp_path / "d" / "b.parquet", compression="none", use_dictionary=False)
        _damage_column(tmp_path / "d" / "b.parquet", "keys")
        reason = r"cannot read .*b\.parquet"
    else:
        write(tmp_path / "d" / "b.parquet", **{**good_b, "keys": pa.array([b"x"] * 30, pa.binary())})
        reason = "import columns cannot be read as messages"
    with pytest.raises(ConfigError, match=reason + r".*\(rows from 50 on not stored; the 50 rows before them are: "
                                                   r"the same import run again goes on from row 50, or name it: "
                                                   r"--from-row 50\)"):
        import_parquet(tmp_path / "d", tmp_path / "s", config=CONFIG)
    assert [m.body for m in stored(tmp_path / "s")] == [f"a{i}".encode() for i in range(50)]
    done = cli("import", "--no-spark", "--parquet", str(tmp_path / "d"), "--store", str(tmp_path / "s"), *GEOMETRY,
               check=False)
    assert done.returncode == 1 and done.stderr.startswith("error: ") and "--from-row 50)" in done.stderr
    assert "Traceback" not in done.stderr
    write(tmp_path / "d" / "b.parquet", **good_b)  # fixed
    report = import_parquet(tmp_path / "d", tmp_path / "s", config=CONFIG)
    assert (report.skipped, report.rows) == (50, 30)
    assert [m.keys for m in stored(tmp_path / "s")] == [[f"a{i}"] for i in range(50)] + [[f"b{i}"] for i in range(30)]


def test_a_dataset_unreadable_before_anything_is_stored_says_nothing_was(tmp_path):
    write(tmp_path / "d" / "a.parquet", topic=["T"] * 5, body=[b"x"] * 5, keys=pa.array([b"x"] * 5, pa.binary()))
    with pytest.raises(ConfigError, match=r"cannot be read as messages.*\(nothing imported\)$"):
        import_parquet(tmp_path / "d", tmp_path / "s", config=CONFIG)
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("bad", ["a key with a space", "a queue the topic lacks"])
def test_an_import_refused_before_storing_anything_leaves_no_journal(tmp_path, bad):
    """A row only put_batch refuses (a key with a space; a queueId past the existing topic's queues) in the first
    batch left importProgress.json behind: every other import into the store was then refused as "an unfinished
    import", and running the refused one again failed the same way; only --from-row 0 got past it."""
    root = tmp_path / "s"
    with MessageStore.open(root, CONFIG) as store:
        store.create_topic("T", 4)
        store.put_message(Message("T", b"there before"))
    columns = {"topic": ["T"] * 100, "body": [b"x"] * 100}
    if bad == "a key with a space":
        columns["keys"] = pa.array([["k"]] * 50 + [["a b"]] + [["k"]] * 49, pa.list_(pa.string()))
    else:
        columns["queueId"] = pa.array([0] * 50 + [500] + [0] * 49, pa.int32())
    write(tmp_path / "bad" / "p.parquet", **columns)
    write(tmp_path / "ok" / "p.parquet", topic=["T"] * 10, body=[b"ok"] * 10)
    before = files_of(root)
    done = cli("import", "--no-spark", "--parquet", str(tmp_path / "bad"), "--store", str(root), *GEOMETRY,
               check=False)
    assert done.returncode == 1 and "(nothing imported" in done.stderr.splitlines()[-1], done.stderr
    assert "row 50: " in done.stderr and "Traceback" not in done.stderr
    assert not (root / "importProgress.json").exists() and files_of(root) == before
    report = import_parquet(tmp_path / "ok", root, config=CONFIG)
    assert (report.skipped, report.rows) == (0, 10)
    assert [m.body for m in stored(root)] == [b"there before"] + [b"ok"] * 10


def test_an_import_whose_close_failed_stores_nothing_when_run_again(tmp_path, monkeypatch):
    """The journal went before the store closed: a close that failed after the last batch (queueEnds.json not
    written), or a kill before the report, and the same import run again stored every row a second time. The CLI
    said only "error:", exit 1, as if nothing had been stored; now exit 3 says the change is stored."""
    from rocketstore.consumequeue import ConsumeQueueTable

    write(tmp_path / "d" / "part-0.parquet", topic=[f"T{i % 2}" for i in range(50)],
          body=[f"row {i}".encode() for i in range(50)])

    def failing_save(self):
        raise StoreIOError(5, "cannot write queueEnds.json: Input/output error")

    with monkeypatch.context() as patch:
        patch.setattr(ConsumeQueueTable, "save_ends", failing_save)
        with pytest.raises(StoredButNotClosedError, match=r"queueEnds\.json") as failed:
            import_parquet(tmp_path / "d", tmp_path / "s", config=CONFIG)
    assert (failed.value.done.rows, failed.value.done.batches) == (50, 1)
    assert len(stored(tmp_path / "s")) == 50
    report = import_parquet(tmp_path / "d", tmp_path / "s", config=CONFIG)
    assert (report.already_imported, report.rows) == (True, 0)
    assert len(stored(tmp_path / "s")) == 50
    done = cli("import", "--no-spark", "--parquet", str(tmp_path / "d"), "--store", str(tmp_path / "s"), *GEOMETRY)
    assert done.stdout.startswith("nothing imported: this import finished before, its 50 rows are in ")
    assert len(stored(tmp_path / "s")) == 50


def test_a_writing_command_whose_close_fails_prints_its_result_and_exits_3(tmp_path):
    """put, topic create/delete and reset-offset applied their change, then a failing close made them exit 1 with
    the close's error alone (no SendResult): a script ran the put again and stored it twice."""
    root = tmp_path / "s"
    cli("put", "-t", "T", "-p", "first", "--store", str(root), *GEOMETRY)
    (root / "queueEnds.json").unlink()
    (root / "queueEnds.json").mkdir()  # the close cannot replace it
    for args in (["put", "-t", "T", "-p", "second"], ["topic", "create", "-t", "NewT"],
                 ["reset-offset", "-g", "G", "-t", "T", "-s", "earliest"], ["topic", "delete", "-t", "NewT"]):
        done = cli(*args, "--store", str(root), *GEOMETRY, check=False)
        assert done.returncode == 3, (args, done.stderr)
        assert done.stderr.startswith("error: the command's change is stored, but closing the store failed: ")
        assert done.stdout, args  # the command's own output came first
    write(tmp_path / "d" / "part-0.parquet", topic=["T"] * 3, body=[b"imported"] * 3)
    done = cli("import", "--no-spark", "--parquet", str(tmp_path / "d"), "--store", str(root), *GEOMETRY, check=False)
    assert done.returncode == 3, done.stderr
    assert done.stdout.startswith("imported 3 messages in 1 batches into ")
    assert done.stderr.startswith("error: closing ") and "Do not run the import again" in done.stderr
    assert (root / "abort").exists()  # the queue ends were not saved: the next open checks the queues
    (root / "queueEnds.json").rmdir()
    assert [m.body for m in stored(root)] == [b"first", b"second"] + [b"imported"] * 3
    assert "SendResult [sendStatus=PUT_OK" in cli("put", "-t", "T", "-p", "x", "--store", str(root), *GEOMETRY).stdout


def test_a_dataset_rewritten_with_other_rows_is_another_import(tmp_path):
    """A finished import is remembered by its source; named by file names and row count alone, a file rewritten
    with three other rows was taken for it: "nothing imported", and the new rows never stored (the review)."""
    path = tmp_path / "d" / "part-0.parquet"
    write(path, topic=["T"] * 3, body=[b"day1-%d" % i for i in range(3)])
    import_parquet(tmp_path / "d", tmp_path / "s", config=CONFIG)
    write(path, topic=["T"] * 3, body=[b"day2-%d" % i for i in range(3)])
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000))  # a later write, surely
    report = import_parquet(tmp_path / "d", tmp_path / "s", config=CONFIG)
    assert (report.already_imported, report.rows) == (False, 3)
    assert [m.body for m in stored(tmp_path / "s")] == [b"day1-%d" % i for i in range(3)] + \
        [b"day2-%d" % i for i in range(3)]


def test_a_finished_import_grown_by_a_file_is_refused_not_stored_twice(tmp_path):
    """An incremental export adds a file to the dataset: taken for another import, the rows the finished one
    stored were all stored a second time (the README review: A 5 -> 10). Files it shares with the finished import,
    unchanged, now refuse it; --from-row 0 still stores every row, and a dataset of only new files is imported."""
    write(tmp_path / "d" / "part-0.parquet", topic=["T"] * 3, body=[b"day1-%d" % i for i in range(3)])
    import_parquet(tmp_path / "d", tmp_path / "s", config=CONFIG)
    write(tmp_path / "d" / "part-1.parquet", topic=["T"] * 2, body=[b"day2-%d" % i for i in range(2)])
    before = files_of(tmp_path / "s")
    with pytest.raises(ConfigError, match="1 of these 2 files are files it imported, unchanged"):
        import_parquet(tmp_path / "d", tmp_path / "s", config=CONFIG)
    (tmp_path / "link").symlink_to(tmp_path / "d")  # the same files by another name (relative, a link): the same
    with pytest.raises(ConfigError, match="1 of these 2 files are files it imported, unchanged"):
        import_parquet(tmp_path / "link", tmp_path / "s", config=CONFIG)
    done = cli("import", "--no-spark", "--parquet", str(tmp_path / "d"), "--store", str(tmp_path / "s"), *GEOMETRY,
               check=False)
    assert done.returncode == 1 and "--from-row 0" in done.stderr and "Traceback" not in done.stderr
    assert files_of(tmp_path / "s") == before
    assert len(stored(tmp_path / "s")) == 3
    (tmp_path / "new").mkdir()
    (tmp_path / "d" / "part-1.parquet").rename(tmp_path / "new" / "part-1.parquet")
    assert import_parquet(tmp_path / "new", tmp_path / "s", config=CONFIG).rows == 2  # only the new file
    assert [m.body for m in stored(tmp_path / "s")] == [b"day1-0", b"day1-1", b"day1-2", b"day2-0", b"day2-1"]
    report = import_parquet(tmp_path / "d", tmp_path / "s", config=CONFIG, skip_rows=0)  # said: all again
    assert report.rows == 3 and len(stored(tmp_path / "s")) == 8
    journal = json.loads((tmp_path / "s" / "importProgress.json").read_text())
    assert journal["complete"] and journal["source"]["stamps"]  # the stamps, written once the import is complete


def test_a_journal_an_earlier_version_finished_still_means_nothing_to_import(tmp_path):
    """Journals written before files were stamped name the same import without the stamps."""
    write(tmp_path / "d" / "part-0.parquet", topic=["T"] * 3, body=[b"x"] * 3)
    import_parquet(tmp_path / "d", tmp_path / "s", config=CONFIG)
    path = tmp_path / "s" / "importProgress.json"
    data = json.loads(path.read_text())
    del data["source"]["stamps"], data["crc"]  # as an earlier version wrote it: no stamps (and no seal)
    path.write_text(json.dumps(data))
    report = import_parquet(tmp_path / "d", tmp_path / "s", config=CONFIG)
    assert (report.already_imported, report.rows) == (True, 0)


@pytest.mark.parametrize("rows_done", [500, 2500, 99_999])
def test_a_journal_damaged_into_other_numbers_is_refused_not_trusted(tmp_path, rows_done):
    """A journal whose rows_done was changed (2,500 of a 3,000-row dataset of which 1,000 are stored) still
    parsed: the import skipped the rows it named and said it was complete (1,500 rows lost), or stored rows
    twice. The journal is sealed with a CRC, and a count past the source's rows is damage too (the review)."""
    for n in range(3):
        write(tmp_path / "d" / f"part-{n}.parquet", topic=["T"] * 1000, body=[b"%d-%d" % (n, i) for i in range(1000)])
    import_parquet(tmp_path / "d", tmp_path / "s", config=CONFIG)
    path = tmp_path / "s" / "importProgress.json"
    journal = json.loads(path.read_text())
    journal.update(complete=False, rows_done=rows_done)
    path.write_text(json.dumps(journal))
    before = files_of(tmp_path / "s")
    with pytest.raises(ConfigError, match=r"import journal .* is damaged"):
        import_parquet(tmp_path / "d", tmp_path / "s", config=CONFIG)
    journal.pop("crc")  # an earlier version's journal (no seal): held to the source's row count still
    path.write_text(json.dumps(journal))
    if rows_done > 3000:
        with pytest.raises(ConfigError, match="99999 rows stored and 0 pending of a source of 3000"):
            import_parquet(tmp_path / "d", tmp_path / "s", config=CONFIG)
    assert files_of(tmp_path / "s") == {**before, "importProgress.json": files_of(tmp_path / "s")[
        "importProgress.json"]}
    assert len(stored(tmp_path / "s")) == 3000


def test_an_import_keeps_a_brokers_multi_dispatch_properties_a_put_refuses(tmp_path):
    """A put with INNER_MULTI_DISPATCH is refused (rocketstore dispatches no LMQ queue); an import copies stored
    messages, and refusing those properties refused the whole export of a store that used multi-dispatch."""
    from rocketstore.errors import InvalidPropertyError

    properties = pa.array([[("INNER_MULTI_DISPATCH", "%LMQ%q1"), ("INNER_MULTI_QUEUE_OFFSET", "0")], []],
                          pa.map_(pa.string(), pa.string()))
    write(tmp_path / "export" / "part-0.parquet", topic=["Orders", "Orders"], body=[b"multi", b"plain"],
          properties=properties)
    report = import_parquet(tmp_path / "export", tmp_path / "s", config=CONFIG)
    assert report.rows == 2
    assert [m.properties.get("INNER_MULTI_DISPATCH") for m in stored(tmp_path / "s")] == ["%LMQ%q1", None]
    with MessageStore.open(tmp_path / "s", CONFIG) as store, pytest.raises(InvalidPropertyError, match="multi"):
        store.put_batch(pa.table({"topic": ["Orders"], "body": [b"x"], "properties": properties[:1]}))


def test_an_import_keeps_what_else_a_stored_message_carries(tmp_path):
    """A compressed body's flag (its bytes stay compressed: without the flag consumers got zlib bytes), a retry's
    count, a committed transaction's type and half offset; the host bits follow the importing store. A KEYS
    property is the keys as stored, spacing too: it wins over the split keys column (both were refused)."""
    import zlib

    write(tmp_path / "one.parquet", topic=["Zip", "%RETRY%g", "Tx", "Keys"],
          body=[zlib.compress(b"hello " * 20), b"again", b"tx", b"spaced"],
          keys=pa.array([None, None, None, ["a", "b"]], pa.list_(pa.string())),
          properties=pa.array([None, None, None, [("KEYS", "a  b")]], pa.map_(pa.string(), pa.string())),
          sysFlag=pa.array([0x301 | 0x10, 0, 0x8, 0], pa.int32()),  # 0x10: the exporting store's IPv6 born host
          reconsumeTimes=pa.array([0, 5, 0, 0], pa.int32()),
          preparedTransactionOffset=pa.array([0, 0, 4242, 0], pa.int64()))
    import_parquet(tmp_path / "one.parquet", tmp_path / "s", config=CONFIG)
    zipped, retry, tx, keyed = stored(tmp_path / "s")
    assert zipped.sys_flag == 0x301 and zipped.body == zlib.compress(b"hello " * 20)
    with MessageStore.open(tmp_path / "s", CONFIG, read_only=True) as store:
        inflated = store.look_message_by_offset(zipped.commit_log_offset, decompress=True)
        assert inflated.body == b"hello " * 20
        assert [m.body for m in store.query_message("Keys", "b")] == [b"spaced"]
    assert retry.reconsume_times == 5
    assert (tx.sys_flag, tx.prepared_transaction_offset) == (0x8, 4242)
    assert keyed.properties["KEYS"] == "a  b"


def test_born_times_in_int96_timestamps_are_read_whole(tmp_path):
    """Spark wrote born times as INT96; read as nanoseconds, those outside 1677-2262 wrapped around (one stored as
    1970, others refused after part of the import was stored)."""
    born = [datetime.datetime(1, 1, 1, tzinfo=datetime.UTC), datetime.datetime(1500, 6, 1, tzinfo=datetime.UTC),
            datetime.datetime(2026, 11, 27, 12, 0, 0, 123000, tzinfo=datetime.UTC),
            datetime.datetime(3000, 1, 1, tzinfo=datetime.UTC)]
    table = pa.table({"topic": ["T"] * 4, "body": [b"a", b"b", b"c", b"d"],
                      "bornTimestamp": pa.array(born, pa.timestamp("us", "UTC"))})
    pq.write_table(table, tmp_path / "int96.parquet", use_deprecated_int96_timestamps=True)
    assert pq.ParquetFile(tmp_path / "int96.parquet").schema.column(2).physical_type == "INT96"
    import_parquet(tmp_path / "int96.parquet", tmp_path / "s", config=CONFIG)
    epoch = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
    assert [m.born_timestamp for m in stored(tmp_path / "s")] == \
        [(b - epoch) // datetime.timedelta(milliseconds=1) for b in born]


def test_a_topic_with_more_queues_than_the_first_table_shows_is_imported_whole(tmp_path, monkeypatch):
    """The first table's put created the topic with 8 queues; a later table's queue 12 was refused part-way."""
    monkeypatch.setattr(importing, "IMPORT_CHUNK_ROWS", 4)
    queues = [0, 1, 2, 3, 4, 5, 6, 7, 12, 12, 3, 15]
    write(tmp_path / "wide.parquet", topic=["Wide"] * len(queues), body=[b"%d" % i for i in range(len(queues))],
          queueId=pa.array(queues, pa.int32()))
    import_parquet(tmp_path / "wide.parquet", tmp_path / "s", config=CONFIG)
    with MessageStore.open(tmp_path / "s", CONFIG, read_only=True) as store:
        assert store.topic_config.get("Wide").write_queue_nums == 16
        assert [m.queue_id for m in store.iter_messages()] == queues
    write(tmp_path / "more.parquet", topic=["Wide"], body=[b"x"], queueId=pa.array([20], pa.int32()))
    with pytest.raises(InvalidQueueError, match="queue 20"):  # a topic that was there keeps its queues
        import_parquet(tmp_path / "more.parquet", tmp_path / "s", config=CONFIG)


def test_the_cli_passes_over_the_brokers_own_queues_when_asked(tmp_path):
    write(tmp_path / "all.parquet", topic=["Orders", "SCHEDULE_TOPIC_XXXX", "RMQ_SYS_TRANS_HALF_TOPIC", "Orders"],
          body=[b"a", b"parked", b"half", b"b"])
    done = cli("import", "--store", str(tmp_path / "s"), "--parquet", str(tmp_path / "all.parquet"), "--no-spark",
               *GEOMETRY, check=False)
    assert done.returncode == 1 and "--skip-system-topics" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "s").exists()
    done = cli("import", "--store", str(tmp_path / "s"), "--parquet", str(tmp_path / "all.parquet"), "--no-spark",
               "--skip-system-topics", *GEOMETRY)
    assert "imported 2 messages" in done.stdout
    assert "passed over 2 rows of the broker's own queues (RMQ_SYS_TRANS_HALF_TOPIC 1, SCHEDULE_TOPIC_XXXX 1)" \
        in done.stderr
    assert [(m.topic, m.body) for m in stored(tmp_path / "s")] == [("Orders", b"a"), ("Orders", b"b")]


def test_topics_are_made_for_the_whole_dataset_before_a_row_is_stored_and_a_resumed_import_finishes(tmp_path):
    """A topic made from the first table's rows refused a later table's higher queue, and once the import had
    stopped (a refusal, a crash) its next run took the topic for one it had not made and could never grow it.
    The topics are now made for the whole dataset first: a topic that is there with too few queues is refused
    before any row is stored, and after the operator gives it more the import runs through."""
    write(tmp_path / "ds" / "a.parquet", topic=["T"] * 4, body=[b"a%d" % i for i in range(4)],
          queueId=pa.array([0, 1, 2, 3], pa.int32()))
    write(tmp_path / "ds" / "b.parquet", topic=["U"], body=[b"u"], queueId=pa.array([20], pa.int32()))
    write(tmp_path / "ds" / "c.parquet", topic=["T", "T"], body=[b"c11", b"c12"],
          queueId=pa.array([11, 12], pa.int32()))
    root = tmp_path / "s"
    with MessageStore.open(root, CONFIG) as store:
        store.create_topic("U", 8)
    with pytest.raises(InvalidQueueError, match=r"queue 20 .*nothing imported"):
        import_parquet(tmp_path / "ds", root, config=CONFIG)
    assert not any((root / "commitlog").glob("[0-9]*"))
    with MessageStore.open(root, CONFIG) as store:
        store.create_topic("U", 32)
    report = import_parquet(tmp_path / "ds", root, config=CONFIG)
    assert report.rows == 7
    with MessageStore.open(root, CONFIG, read_only=True) as store:
        assert store.topic_config.get("T").write_queue_nums == 13
        assert sorted((m.topic, m.queue_id) for m in store.iter_messages()) == sorted(
            [("T", q) for q in (0, 1, 2, 3, 11, 12)] + [("U", 20)])


def _import_whose_second_table_keeps_10_rows(tmp_path, monkeypatch, says_how_many: bool):
    """An import of 200 rows (tables of 64) whose second ``put_batch`` stores 10 rows and fails: as a plain disk
    error, or as ``TablePartlyStoredError``. Returns the rows and the error; the same import again stores the rest."""
    import errno as _errno

    from rocketstore.errors import StoreIOError, TablePartlyStoredError

    rows = [f"row {i}".encode() for i in range(200)]
    for n in range(2):
        write(tmp_path / "d" / f"part-{n}.parquet", topic=["Imp"] * 100, body=rows[n * 100:n * 100 + 100])
    monkeypatch.setattr(importing, "IMPORT_CHUNK_ROWS", 64)
    real_put, calls = MessageStore.put_batch, []

    def part_then_fail(store, table, **options):
        calls.append(table.num_rows)
        if len(calls) == 2:  # the first 10 rows reach the log, then the disk fails
            kept = real_put(store, table.slice(0, 10), **options)
            if not says_how_many:
                raise StoreIOError(_errno.EIO, "fsync of directory commitlog failed: Input/output error")
            cause = StoreIOError(_errno.EIO, "write to commitlog/00000000000000131072 at 0 failed: Input/output error")
            raise TablePartlyStoredError(_errno.EIO, "Input/output error; rows 0-9 are stored", 10, kept) from cause
        return real_put(store, table, **options)

    monkeypatch.setattr(MessageStore, "put_batch", part_then_fail)
    with pytest.raises(StoreIOError) as failed:
        import_parquet(tmp_path / "d", tmp_path / "s", config=CONFIG)
    assert failed.value.errno == _errno.EIO
    monkeypatch.setattr(MessageStore, "put_batch", real_put)
    return rows, failed.value


def test_a_disk_failure_mid_batch_does_not_say_its_rows_are_not_stored(tmp_path, monkeypatch):
    """A table over several segments is one append per segment: a disk failure at the second kept the first's rows.
    The error said the whole batch was not stored and named --from-row at its first row, which stored those rows
    twice (216 duplicates in the consumer-and-faults review). It says some may be stored and to run the same import
    again, which goes on from the first row the store does not hold."""
    rows, error = _import_whose_second_table_keeps_10_rows(tmp_path, monkeypatch, says_how_many=False)
    text = str(error)
    assert "some of these rows may be stored" in text and "without --from-row" in text and "not stored" not in text
    import_parquet(tmp_path / "d", tmp_path / "s", config=CONFIG)
    assert [m.body for m in stored(tmp_path / "s")] == rows  # each row once


def test_a_disk_failure_in_a_table_written_in_parts_names_the_rows_stored(tmp_path, monkeypatch):
    """``put_batch`` now says how many rows of a table in parts a disk failure kept (``TablePartlyStoredError``):
    the import names the first row not stored instead of "some may be", and counts the stored ones."""
    rows, error = _import_whose_second_table_keeps_10_rows(tmp_path, monkeypatch, says_how_many=True)
    assert str(error) == ("[Errno 5] rows 74..99 not stored: write to commitlog/00000000000000131072 at 0 failed: "
                          "Input/output error (the 74 rows before them are: run the same import again, without "
                          "--from-row, and it goes on from row 74)")
    assert [m.body for m in stored(tmp_path / "s")] == rows[:74]
    import_parquet(tmp_path / "d", tmp_path / "s", config=CONFIG)
    assert [m.body for m in stored(tmp_path / "s")] == rows  # each row once

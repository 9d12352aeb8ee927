"""Consume-queue units that point at a real record of another queue (a real record start, the right size).

Such a unit passes every check RocketMQ makes, so it serves a foreign message; rocketstore checks the record's
topic, queue id and queue offset against the unit, never serves a mismatch, restores the unit when it can find
the right record, and cuts a damaged tail on a writer open so that re-dispatch writes it again.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from rocketstore import Message, MessageStore, StoreConfig

CONFIG = StoreConfig(mapped_file_size_commit_log=1 << 20, mapped_file_size_consume_queue=20 * 100)
UNIT = struct.Struct(">qiq")


def build(root: Path) -> dict[str, list[tuple[int, int]]]:
    """A store with topics A and B interleaved; returns each topic's (offset, size) of queue 0 in order."""
    where: dict[str, list[tuple[int, int]]] = {"A": [], "B": []}
    with MessageStore.open(root, CONFIG) as store:
        for i in range(10):
            for topic in ("A", "B"):
                result = store.put_message(Message(topic, f"{topic}-{i}".encode(), keys=[f"{topic}{i}"], queue_id=0))
                where[topic].append((result.commit_log_offset, result.store_size))
        store.wait_for_dispatch()
    return where


def point_unit(root: Path, topic: str, queue_offset: int, phy: int, size: int) -> None:
    path = root / "consumequeue" / topic / "0" / f"{0:020d}"
    with open(path, "r+b") as f:
        f.seek(queue_offset * 20)
        f.write(UNIT.pack(phy, size, 0))


def bodies(store: MessageStore, topic: str) -> list[bytes]:
    return [m.body for m in store.get_message(topic, 0, 0, max_msgs=100).messages]


def batch_bodies(store: MessageStore, topic: str) -> list[bytes]:
    return [body for batch in store.queue_arrow(topic, 0, max_rows=3) for body in batch.column("body").to_pylist()]


def test_a_unit_pointing_at_another_topics_record_is_never_served(tmp_path):
    where = build(tmp_path)
    point_unit(tmp_path, "B", 3, *where["A"][7])  # B-3 now points at A's 8th record
    with MessageStore.open(tmp_path, CONFIG, read_only=True) as store:
        got = bodies(store, "B")
        assert b"A-7" not in got
        assert got == [f"B-{i}".encode() for i in range(10) if i != 3]
        assert ("B", 0, 3) in store.reader.damaged_units


def test_the_batch_queue_read_never_serves_a_foreign_message_either(tmp_path):
    where = build(tmp_path)
    point_unit(tmp_path, "B", 3, *where["A"][7])
    with MessageStore.open(tmp_path, CONFIG, read_only=True) as store:
        assert batch_bodies(store, "B") == [f"B-{i}".encode() for i in range(10) if i != 3]
        assert store.reader.damaged_units == {("B", 0, 3): where["A"][7][0]}
    with MessageStore.open(tmp_path, CONFIG) as store:  # a writer finds B-3 again and serves it in its place
        assert batch_bodies(store, "B") == [f"B-{i}".encode() for i in range(10)]
        assert store.queue_units_repaired == 1


def test_print_msg_never_prints_the_foreign_message(tmp_path):
    where = build(tmp_path)
    point_unit(tmp_path, "B", 0, *where["A"][0])
    cli = Path(sys.executable).with_name("rocketstore")
    out = subprocess.run([str(cli), "print-msg", "--store", str(tmp_path), "-t", "B", "--body"], check=False,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "A-0" not in out.stdout and "B-1" in out.stdout


def test_a_writer_restores_a_middle_unit_when_it_reads_it(tmp_path):
    where = build(tmp_path)
    point_unit(tmp_path, "B", 4, *where["A"][2])
    with MessageStore.open(tmp_path, CONFIG) as store:
        assert bodies(store, "B") == [f"B-{i}".encode() for i in range(10)]  # B-4 found again, in its place
        assert store.queue_units_repaired == 1
    raw = (tmp_path / "consumequeue" / "B" / "0" / f"{0:020d}").read_bytes()
    assert UNIT.unpack_from(raw, 4 * 20)[:2] == where["B"][4]  # the repair is on disk


def test_a_damaged_tail_is_cut_and_re_dispatched_on_a_writer_open(tmp_path):
    """The issue's case: the last unit of B points at A's record; B's real record was re-dispatched as a
    'duplicate' and never delivered, and A's message was served twice."""
    where = build(tmp_path)
    point_unit(tmp_path, "B", 9, *where["A"][9])
    with MessageStore.open(tmp_path, CONFIG) as store:
        assert store.queue_units_repaired == 1
        assert bodies(store, "B") == [f"B-{i}".encode() for i in range(10)]
        result = store.put_message(Message("B", b"B-10", queue_id=0))
        assert result.queue_offset == 10
        store.wait_for_dispatch()
        assert bodies(store, "B") == [f"B-{i}".encode() for i in range(11)]
        assert bodies(store, "A") == [f"A-{i}".encode() for i in range(10)]
    with MessageStore.open(tmp_path, CONFIG, read_only=True) as store:
        assert bodies(store, "B") == [f"B-{i}".encode() for i in range(11)]
        assert not store.reader.damaged_units


@pytest.mark.parametrize("reader", ["get_message", "queue_arrow"])
@pytest.mark.parametrize("where", ["past the log's end", "inside a record"])
def test_a_unit_pointing_where_no_record_starts_is_restored_by_a_writer(tmp_path, reader, where):
    """A unit repointed past the log's end (or into the middle of a record) was skipped on every read, by writers
    too, and its message never served again; one pointing at another queue's record was already restored."""
    where_b = build(tmp_path)
    phy = 10 ** 9 if where == "past the log's end" else where_b["A"][4][0] + 7
    point_unit(tmp_path, "B", 4, phy, 100)
    read = bodies if reader == "get_message" else batch_bodies
    expected = [f"B-{i}".encode() for i in range(10)]
    with MessageStore.open(tmp_path, CONFIG, read_only=True) as store:  # a reader cannot repair: it skips the unit
        assert read(store, "B") == expected[:4] + expected[5:]
    with MessageStore.open(tmp_path, CONFIG) as store:
        assert read(store, "B") == expected
        assert store.queue_units_repaired == 1
    with MessageStore.open(tmp_path, CONFIG, read_only=True) as store:  # the unit itself was rewritten
        assert bodies(store, "B") == expected and batch_bodies(store, "B") == expected


@pytest.mark.parametrize("lost", ["the last file", "the directory"])
def test_a_queue_that_lost_its_last_files_is_re_dispatched_not_reused(tmp_path, lost, caplog):
    """After a clean close, B's last queue file (or its whole directory) deleted: the writer's open took B for a
    queue ending there, re-dispatched only after A's units, and the next put to B reused a queue offset a record
    in the log already had. The close records every queue's end (queueEnds.json); a queue short of it is
    re-dispatched from its last unit."""
    import shutil

    config = CONFIG.replace(mapped_file_size_consume_queue=20 * 4)
    with MessageStore.open(tmp_path, config) as store:
        for i in range(10):
            for topic in ("A", "B"):
                store.put_message(Message(topic, f"{topic}-{i}".encode(), queue_id=0))
    queue_dir = tmp_path / "consumequeue" / "B" / "0"
    if lost == "the last file":
        (queue_dir / f"{160:020d}").unlink()  # units 8 and 9
    else:
        shutil.rmtree(queue_dir)
    with MessageStore.open(tmp_path, config, read_only=True):
        pass
    assert "consume queue B-0 ended at offset 10 when the store was last closed" in caplog.text
    with MessageStore.open(tmp_path, config) as store:
        store.wait_for_dispatch()
        assert every_body(store, "B") == [f"B-{i}".encode() for i in range(10)]
        assert store.put_message(Message("B", b"B-10", queue_id=0)).queue_offset == 10
        store.wait_for_dispatch()
        assert every_body(store, "A") == [f"A-{i}".encode() for i in range(10)]
    with MessageStore.open(tmp_path, config, read_only=True) as store:
        assert every_body(store, "B") == [f"B-{i}".encode() for i in range(11)]


def every_body(store: MessageStore, topic: str) -> list[bytes]:
    """Queue 0's bodies by ``get_message`` pages (one page ends at a queue file's end)."""
    found, offset = [], 0
    while True:
        result = store.get_message(topic, 0, offset, max_msgs=100)
        found += [m.body for m in result.messages]
        if result.next_begin_offset <= offset:
            return found
        offset = result.next_begin_offset


@pytest.mark.parametrize("hole", [(0, 0), (1 << 62, -5), (-1, 100)])  # zeroed; garbage units
@pytest.mark.parametrize("rolled", [False, True])  # the hole in the last file, or in an earlier one
def test_a_hole_in_the_middle_of_a_queue_is_re_dispatched_not_reused(tmp_path, hole, rolled, caplog):
    """One invalid unit in the middle of B's queue, with A's queue intact: recovery ended B's queue at the hole
    (as RocketMQ's does), re-dispatch started after A's last unit, so B's units after the hole were never written
    again, and the next put to B took the hole's queue offset (5): a duplicate offset, the old message gone from
    its queue, the new one behind consumers already past 5. With one queue the same damage was repaired."""
    config = CONFIG.replace(mapped_file_size_consume_queue=20 * 4) if rolled else CONFIG
    where = {"A": [], "B": []}
    with MessageStore.open(tmp_path, config) as store:
        for i in range(10):
            for topic in ("A", "B"):
                result = store.put_message(Message(topic, f"{topic}-{i}".encode(), queue_id=0))
                where[topic].append((result.commit_log_offset, result.store_size))
        store.wait_for_dispatch()
    at = 5 if not rolled else 2  # rolled: unit 2 of the first 4-unit file, files of units 4..9 after it
    path = tmp_path / "consumequeue" / "B" / "0" / f"{0:020d}"
    with open(path, "r+b") as f:
        f.seek(at * 20)
        f.write(UNIT.pack(hole[0], hole[1], 0))
    with MessageStore.open(tmp_path, config, read_only=True) as store:  # cannot repair: says so
        assert every_body(store, "B") == [f"B-{i}".encode() for i in range(at)]
    assert f"consume queue B-0: an invalid unit at offset {at} has units after it" in caplog.text
    with MessageStore.open(tmp_path, config) as store:
        assert store.queue_units_repaired >= 1
        store.wait_for_dispatch()
        assert every_body(store, "B") == [f"B-{i}".encode() for i in range(10)]
        assert store.put_message(Message("B", b"B-10", queue_id=0)).queue_offset == 10
        store.wait_for_dispatch()
        assert every_body(store, "B") == [f"B-{i}".encode() for i in range(11)]
        assert every_body(store, "A") == [f"A-{i}".encode() for i in range(10)]
    with MessageStore.open(tmp_path, config, read_only=True) as store:
        assert every_body(store, "B") == [f"B-{i}".encode() for i in range(11)]
        offsets = [o for b in store.queue_arrow("B", 0) for o in b.column("queueOffset").to_pylist()]
        assert offsets == list(range(11))


# --- an index whose chain forms a cycle ------------------------------------------------------------------

def test_an_index_chain_that_cycles_is_set_aside_and_rebuilt(tmp_path):
    import hashlib

    from rocketstore.index import IndexFile
    from rocketstore.index.service import chain_problem

    config = StoreConfig(mapped_file_size_commit_log=1 << 20, max_hash_slot_num=97, max_index_num=400)
    with MessageStore.open(tmp_path, config) as store:
        for i in range(50):
            store.put_message(Message("T", f"m{i}".encode(), keys=["shared", f"own{i}"]))
        store.wait_for_dispatch()
        assert len(store.query_message("T", "shared")) == 50
    path = next((tmp_path / "index").iterdir())
    index = IndexFile.open(path, 97, 400)
    slot = index.slot_of("T#shared")[1]
    head = struct.unpack_from(">i", index.buffer, 40 + slot * 4)[0]
    entries_at = 40 + 97 * 4
    prev_pos = entries_at + head * 20 + 16
    older = struct.unpack_from(">i", index.buffer, prev_pos)[0]
    # the head's predecessor now links back to the head: shared -> older -> head -> older ... (a cycle)
    struct.pack_into(">i", index.buffer, entries_at + older * 20 + 16, head)
    index.flush()
    assert chain_problem(index) is not None
    index.close()
    digest = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in tmp_path.rglob("*") if p.is_file()}
    with MessageStore.open(tmp_path, config, read_only=True) as store:  # bounded walk: no hang, no write
        assert store.index.damaged == [path.name]  # skipped: the records past the files left are indexed in memory
        assert len(store.query_message("T", "shared")) == 50
    assert digest == {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in tmp_path.rglob("*") if p.is_file()}
    with MessageStore.open(tmp_path, config) as store:
        assert store.index.set_aside is not None
        store.wait_for_dispatch()
        assert len(store.query_message("T", "shared")) == 50
        assert all(len(store.query_message("T", f"own{i}")) == 1 for i in range(50))


def test_a_queue_gone_with_its_topic_is_not_brought_back(tmp_path):
    """A broker's deleteTopic removes the topic's config and its queue directories (its messages stay in the log):
    the recorded end of such a queue does not bring it back."""
    import shutil

    with MessageStore.open(tmp_path, CONFIG) as store:
        for i in range(5):
            store.put_message(Message("Gone", f"g{i}".encode()))
            store.put_message(Message("Kept", f"k{i}".encode()))
    with MessageStore.open(tmp_path, CONFIG) as store:
        store.delete_topic("Gone")
    shutil.rmtree(tmp_path / "consumequeue" / "Gone")
    with MessageStore.open(tmp_path, CONFIG) as store:
        store.wait_for_dispatch()
        assert store.queue_ids("Gone") == [] and len(bodies(store, "Kept")) == 5


@pytest.mark.parametrize("lost", [5, 130])  # within one queue file, and over two (100 units a file)
def test_a_queue_whose_every_unit_is_past_the_recovered_log_is_emptied_on_disk(tmp_path, lost):
    """A queue all of whose units pointed past the log's recovered end (the log's tail lost, the queue files
    kept) had its first file kept with only its position reset: the units stayed on disk and came back at the
    next load, so after a clean close the queue's offsets jumped (a put took offset 37 after offset 0) and verify
    reported units of other topics' records (the review)."""
    root = tmp_path / "s"
    with MessageStore.open(root, CONFIG) as store:
        store.put_messages([Message("A", b"a" * 100, queue_id=0) for _ in range(5)])
        first_n = store.put_message(Message("N", b"n" * 100, queue_id=0)).commit_log_offset
        for _ in range(lost - 1):
            store.put_message(Message("N", b"n" * 100, queue_id=0))
        store.wait_for_dispatch()
    segment = root / "commitlog" / f"{0:020d}"
    with open(segment, "r+b") as f:  # the log's tail from N's first record never reached the disk
        f.seek(first_n)
        f.write(bytes(CONFIG.mapped_file_size_commit_log - first_n))
    (root / "queueEnds.json").unlink()  # as after a crash
    with MessageStore.open(root, CONFIG) as store:
        assert store.get_max_offset_in_queue("N", 0) == 0
        store.put_messages([Message("A", b"x" * 100, queue_id=0) for _ in range(10)])  # over the lost records
        assert store.put_message(Message("N", b"new-0", queue_id=0)).queue_offset == 0
        store.wait_for_dispatch()
    units = (root / "consumequeue" / "N" / "0" / f"{0:020d}").read_bytes()
    assert units[20:] == bytes(len(units) - 20)  # nothing stale left behind the new unit
    with MessageStore.open(root, CONFIG) as store:
        assert store.get_max_offset_in_queue("N", 0) == 1
        assert store.put_message(Message("N", b"new-1", queue_id=0)).queue_offset == 1
        store.wait_for_dispatch()
        assert [m.body for m in store.get_message("N", 0, 0).messages] == [b"new-0", b"new-1"]
    done = subprocess.run([sys.executable, "-m", "rocketstore.cli.app", "verify", "--store", str(root),
                           "--mapped-file-size-commit-log", str(CONFIG.mapped_file_size_commit_log),
                           "--mapped-file-size-consume-queue", str(CONFIG.mapped_file_size_consume_queue)],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0 and "0 problem(s)" in done.stdout, done.stdout + done.stderr


@pytest.mark.parametrize("victim", ["consumequeue/B/0", "consumequeue/B"])
def test_a_file_where_a_queue_directory_belongs_is_a_typed_error_then_re_dispatched(tmp_path, victim):
    """A file in place of a queue's directory made a writer's open raise pathlib's bare FileExistsError /
    NotADirectoryError (the review): a StoreIOError naming the directory now; with the file gone, the next open
    dispatches that queue again."""
    from rocketstore.errors import StoreIOError

    root = tmp_path / "s"
    build(root)
    path = root / victim
    shutil.rmtree(path)
    path.write_bytes(b"not a directory")
    with pytest.raises(StoreIOError, match=r"cannot create .*consumequeue/B/0: it or a directory above it is not"):
        MessageStore.open(root, CONFIG)
    path.unlink()
    with MessageStore.open(root, CONFIG) as store:
        store.wait_for_dispatch()
        assert [m.body for m in store.get_message("B", 0, 0).messages] == [f"B-{i}".encode() for i in range(10)]


def test_a_read_only_open_serves_a_queue_up_to_its_damaged_file(tmp_path, caplog):
    """One file of a queue cut short (a partial copy): a read-only open dropped the whole queue ("holds offsets
    [0, 0)") and blamed lost files and a writer that stopped early. It serves the units before that file now,
    says why, and changes nothing; a writer's open sets the queue aside and dispatches it again."""
    root = tmp_path / "s"
    with MessageStore.open(root, CONFIG) as store:
        store.put_messages([Message("A", f"a{i}".encode(), queue_id=0) for i in range(250)])
        store.wait_for_dispatch()
    cut = root / "consumequeue" / "A" / "0" / f"{200 * 20:020d}"
    with open(cut, "r+b") as f:
        f.truncate(30)
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file() and p.name != "lock"}
    with MessageStore.open(root, CONFIG, read_only=True) as store:
        assert store.get_max_offset_in_queue("A", 0) == 200
        assert store.get_message("A", 0, 150, 1).messages[0].body == b"a150"
    assert "consume queue A-0 is damaged: segment is 30 bytes" in caplog.text
    assert "queue offsets below 200" in caplog.text and "files lost" not in caplog.text
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file() and p.name != "lock"} == before
    with MessageStore.open(root, CONFIG) as store:
        store.wait_for_dispatch()
        assert store.get_max_offset_in_queue("A", 0) == 250
        assert [m.body for m in store.get_message("A", 0, 240).messages] == [f"a{i}".encode() for i in range(240, 250)]


def test_a_live_writers_unit_without_its_size_yet_is_not_called_damage(tmp_path, caplog):
    """A writer puts a run of units with sizes last: a read-only view opened meanwhile saw an invalid unit with
    units after it and warned of damage (the live-reader review). Beside a live writer it serves the queue up to
    there and says nothing; on a store nobody writes the same bytes are still damage."""
    with MessageStore.open(tmp_path, CONFIG) as writer:
        for i in range(10):
            writer.put_message(Message("B", f"B-{i}".encode(), queue_id=0))
        writer.wait_for_dispatch()
        path = tmp_path / "consumequeue" / "B" / "0" / f"{0:020d}"
        with open(path, "r+b") as f:  # unit 7's size not written yet, 8 and 9 in the same state
            for unit in (7, 8, 9):
                f.seek(unit * 20 + 8)
                f.write(bytes(4))
        with MessageStore.open(tmp_path, CONFIG, read_only=True) as reader:
            assert every_body(reader, "B") == [f"B-{i}".encode() for i in range(7)]
        assert "has units after it" not in caplog.text


def test_a_run_of_units_a_kill_left_without_sizes_is_no_damage(tmp_path, caplog):
    """``put_queue_units`` writes a run's offsets and tags, then its sizes: a writer SIGKILLed in between leaves units
    with an offset and size 0 after the last whole one. That is a torn tail, not a hole: the next open ended the
    queue there and re-dispatched, but logged it as damage (ERROR) and counted a repaired unit."""
    with MessageStore.open(tmp_path, CONFIG) as writer:
        for i in range(10):
            writer.put_message(Message("B", f"B-{i}".encode(), queue_id=0))
        writer.wait_for_dispatch()
    path = tmp_path / "consumequeue" / "B" / "0" / f"{0:020d}"
    with open(path, "r+b") as f:  # units 7, 8 and 9: offsets and tags written, the kill before their sizes
        for unit in (7, 8, 9):
            f.seek(unit * 20 + 8)
            f.write(bytes(4))
    (tmp_path / "abort").write_text("999999")  # the kill, in a run opened after a clean close at 7 units
    (tmp_path / "queueEnds.json").write_text('{"version": 1, "ends": {"B": {"0": 7}}}')
    with MessageStore.open(tmp_path, CONFIG, read_only=True) as reader:
        assert every_body(reader, "B") == [f"B-{i}".encode() for i in range(7)]
    with MessageStore.open(tmp_path, CONFIG) as store:
        assert store.queue_units_repaired == 0
        store.wait_for_dispatch()
        assert every_body(store, "B") == [f"B-{i}".encode() for i in range(10)]
    assert "damage" not in caplog.text

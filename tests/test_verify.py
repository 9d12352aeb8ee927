"""``verify_store``: linear in dangling queue units and index entries, and exact on a store a writer is using."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rocketstore import FlushDiskType, Message, MessageStore, StoreConfig
from rocketstore.errors import ConfigError
from rocketstore.verify import verify_store

CONFIG = StoreConfig(mapped_file_size_commit_log=256 << 10, mapped_file_size_consume_queue=20 * 2000,
                     max_hash_slot_num=1999, max_index_num=8000)


def write(root: Path, count: int, config: StoreConfig = CONFIG) -> list:
    """``count`` messages in batches over 3 topics x 2 queues, each with a key (2 index entries each)."""
    results = []
    with MessageStore.open(root, config) as store:
        for start in range(0, count, 500):
            results += store.put_messages([Message(f"T{i % 3}", b"x" * (i % 40), keys=[f"k{i}"], tags=f"Tag{i % 2}",
                                                   queue_id=i % 2) for i in range(start, min(count, start + 500))])
        assert store.wait_for_dispatch(timeout=30)
    return results


def zero_log_from(root: Path, cut: int) -> None:
    """Zero every commit-log byte from ``cut`` on, files kept at their size (as an ASYNC power loss leaves them)."""
    for segment in sorted((root / "commitlog").iterdir()):
        start = int(segment.name)
        size = segment.stat().st_size
        if start + size > cut:
            with open(segment, "r+b") as f:
                f.seek(max(0, cut - start))
                f.write(bytes(size - max(0, cut - start)))


# --- item 7: dangling units and entries cost no per-item Python work ------------------------------------

class CallCounter:
    """Counts Python and C function calls once the commit-log scan is over (its last progress report):
    what is left is checking queue units and index entries, which must not loop over them in Python."""

    def __init__(self) -> None:
        self.calls = 0
        self.counting = False

    def progress(self, phase: str, done: int, total: int) -> None:
        if phase == "commit log" and done == total:
            self.counting = True
            sys.setprofile(self.profile)

    def profile(self, frame, event: str, arg) -> None:
        if event in ("call", "c_call"):
            self.calls += 1

    def run(self, root: Path, **kwargs):
        try:
            return verify_store(root, CONFIG, progress=self.progress, **kwargs)
        finally:
            sys.setprofile(None)


def test_dangling_queue_units_and_index_entries_are_counted_without_per_entry_work(tmp_path):
    root = tmp_path / "s"
    results = write(root, 20_000)
    verify_store(root, CONFIG)  # warm-up: first calls of some numpy functions compile regular expressions
    clean = CallCounter()
    report = clean.run(root)
    assert report.clean and (report.records, report.queue_units, report.index_entries) == (20_000, 20_000, 40_000)

    cut_at = 15_000  # the last quarter of the log is lost: its queue units and index entries dangle
    cut = results[cut_at].commit_log_offset
    zero_log_from(root, cut)
    damaged = CallCounter()
    report = damaged.run(root, max_problems=100)

    lost = len(results) - cut_at
    assert report.records == cut_at and report.queue_units == 20_000 and report.index_entries == 40_000
    full = verify_store(root, CONFIG, max_problems=10**6)
    assert report.problems == full.problems[:100] and report.problem_count == len(full.problems) > 100
    kinds = Counter((p.kind, p.detail.split(" ")[0]) for p in full.problems)
    # each lost record leaves one dangling unit and two dangling index entries (UNIQ_KEY and k<i>); the zeroed
    # segments after the cut are where the log ends, as a broker's next segment made ahead is (the records they
    # lost are what the dangling units and entries name); and nothing else is reported
    assert sum(1 for s in (root / "commitlog").iterdir() if int(s.name) > cut) >= 2
    assert kinds == {("consumequeue", "points"): lost, ("index", "entry"): 2 * lost}
    print(f"calls after the log scan: clean {clean.calls}, damaged {damaged.calls}")
    # after the log scan, work is per file and per problem listed: not per unit or entry checked
    assert clean.calls < (20_000 + 40_000) / 4, clean.calls
    assert damaged.calls < clean.calls + 100 * 40, (damaged.calls, clean.calls)


def test_max_problems_below_zero_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="max_problems"):
        verify_store(tmp_path, CONFIG, max_problems=-1)


# --- item 8: a store a writer is using ----------------------------------------------------------------

WRITER = textwrap.dedent("""
    import sys, threading
    from rocketstore import FlushDiskType, Message, MessageStore, StoreConfig
    config = StoreConfig(mapped_file_size_commit_log=64 << 10, mapped_file_size_consume_queue=20 * 200,
                         max_hash_slot_num=97, max_index_num=388, flush_disk_type=FlushDiskType[sys.argv[2]])
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()  # stdin closed: stop
    with MessageStore.open(sys.argv[1], config) as store:
        i = 0
        while not stop.wait(0.002):  # paced, so that the store stays small enough for a quick test
            store.put_messages([Message(f"T{j % 4}", b"y" * (j % 60), keys=[f"k{j}", f"g{j % 7}"], tags=f"Tag{j % 3}",
                                        queue_id=j % 3) for j in range(i, i + 50)])
            i += 50
            if i == 2000:
                print("ready", flush=True)
    print(i, flush=True)
""")


@pytest.mark.parametrize("flush", ["ASYNC_FLUSH", "SYNC_FLUSH"])
def test_verify_while_a_writer_runs_checks_a_snapshot_without_false_problems(tmp_path, flush):
    root = tmp_path / "live"
    config = StoreConfig(mapped_file_size_commit_log=64 << 10, mapped_file_size_consume_queue=20 * 200,
                         max_hash_slot_num=97, max_index_num=388, flush_disk_type=FlushDiskType[flush])
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(root), flush], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline() == "ready\n"
        reports = []
        for _ in range(4):
            reports.append(verify_store(root, config))
            assert reports[-1].live and reports[-1].clean, reports[-1].problems[:5]
        assert max(r.queue_units for r in reports) > 0 and max(r.index_entries for r in reports) > 0
        ends = [r.snapshot_end for r in reports]
        done = subprocess.run([sys.executable, "-m", "rocketstore.cli.app", "verify", "--store", str(root)],
                              capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr
        assert "store is live (locked by a writer): checked the snapshot up to commit-log offset" in done.stdout
        assert ends == sorted(ends) and ends[0] < ends[-1], "the writer wrote while verify ran"
        writer.stdin.close()
        written = int(writer.stdout.readline())
        assert writer.wait(timeout=60) == 0
    finally:
        writer.kill()
        writer.wait()
    report = verify_store(root, config)
    assert not report.live and report.clean and report.records == written, report.problems[:5]


UNIT_WRITER = textwrap.dedent("""
    import mmap, sys
    import numpy as np
    from rocketstore.codec._kernels import put_queue_units
    path, regions, units = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    with open(path, "r+b") as f, open(path + ".at", "r+b") as g:
        buf = np.frombuffer(mmap.mmap(f.fileno(), 0), dtype=np.uint8)
        at = np.frombuffer(mmap.mmap(g.fileno(), 0), dtype=np.int64)
        queue_offsets = np.arange(units, dtype=np.int64)
        phys, sizes, tags = queue_offsets * 100 + 100, queue_offsets + 1, queue_offsets + 7
        print("ready", flush=True)
        for region in range(regions):  # one queue file after another, written as the dispatcher writes them
            at[0] = region
            i = 0
            while i < units:
                i += put_queue_units(buf, (region * units + i) * 20, 3, queue_offsets, phys, sizes, tags, i)
""")


def test_a_live_snapshot_never_reads_a_unit_the_writer_is_still_writing(tmp_path):
    """The dispatcher writes a unit's offset and tags code before its size; a snapshot copied front to back
    saw the old offset (0: the log's first record, another queue's) beside the new size, and verify reported
    a unit of a clean live store as pointing at a record of another queue. ``written_units`` reads the sizes
    first: run against a real writer of units, it must never return a unit without its offset and tags
    (the front-to-back copy returned thousands of such units in this test's time)."""
    from rocketstore.consumequeue import UNIT_DTYPE
    from rocketstore.verify import written_units

    units, regions = 200, 60_000
    path = tmp_path / "units"
    with open(path, "wb") as f:
        f.truncate(units * 20 * regions)
    with open(f"{path}.at", "wb") as f:
        f.truncate(8)
    writer = subprocess.Popen([sys.executable, "-c", UNIT_WRITER, str(path), str(regions), str(units)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline() == "ready\n"
        import mmap

        with open(path, "rb") as f, open(f"{path}.at", "rb") as g:
            every = np.frombuffer(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ), dtype=UNIT_DTYPE)
            at = np.frombuffer(mmap.mmap(g.fileno(), 0, prot=mmap.PROT_READ), dtype=np.int64)
            mid_write = torn = 0
            while writer.poll() is None and mid_write < 3000:
                region = int(at[0])
                copy, end = written_units(every[region * units : (region + 1) * units])
                assert len(copy) == end
                mid_write += 0 < end < units
                torn += int(((copy["phy"] == 0) | (copy["tags"] == 0)
                             | (copy["phy"] != copy["size"].astype(np.int64) * 100)).sum())
            del every, at
    finally:
        writer.kill()
        writer.wait()
    assert mid_write >= 300, f"only {mid_write} reads met the writer in the middle of a file"
    assert torn == 0, f"{torn} units read before they were whole"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 400), min_size=0, max_size=60, unique=True), st.data())
def test_the_index_entry_check_equals_a_lookup_per_entry(offsets, data):
    """``check_entries`` walks records with a cursor; entries out of order, far ahead, expired, after the
    snapshot, with or without their key, must get what a search per entry gives."""
    from rocketstore.index import _kernels as ik

    rec_phy = np.array(sorted(o * 10 for o in offsets), dtype=np.int64)
    keys = [sorted(set(data.draw(st.lists(st.integers(0, 6), max_size=3)))) for _ in rec_phy]
    key_pairs = np.array([(r << 32) | h for r, hs in enumerate(keys) for h in hs], dtype=np.int64)
    pair_start = np.zeros(len(rec_phy) + 1, dtype=np.int64)
    np.cumsum([len(hs) for hs in keys], out=pair_start[1:])
    entries = data.draw(st.lists(st.tuples(st.integers(-1, 6), st.integers(0, 4100), st.integers(0, 3)),
                                 max_size=80))
    end, log_min = data.draw(st.integers(0, 4200)), int(rec_phy[0]) if len(rec_phy) else 0
    begin_ts = data.draw(st.sampled_from([0, -1, 1_000_000, 1_700_000_000_000]))
    store_ts = np.array([begin_ts + data.draw(st.integers(-1500, 3500)) for _ in rec_phy], dtype=np.int64)
    entries_at = 8
    buf = np.zeros(entries_at + (len(entries) + 1) * 20, dtype=np.uint8)
    for i, (h, phy, diff) in enumerate(entries):
        buf[entries_at + (i + 1) * 20: entries_at + (i + 1) * 20 + 16] = np.frombuffer(struct.pack(">iqi", h, phy,
                                                                                                   diff), np.uint8)
    covered = np.zeros(len(key_pairs), dtype=bool)
    status = ik.check_entries(buf, entries_at, len(entries), end, log_min, rec_phy, pair_start, key_pairs, covered,
                              begin_ts, store_ts)
    expected, want_covered = [], set()
    where = {int(p): r for r, p in enumerate(rec_phy)}
    for n, (h, phy, diff) in enumerate(entries):
        if phy >= end:
            expected.append(ik.ENTRY_AFTER_SNAPSHOT)
        elif phy in where:
            fine = h in keys[where[phy]]
            # IndexFile.putKey: (storeTimestamp - beginTimestamp) / 1000, clamped to [0, MAX_INT]; 0 without a begin
            made = 0 if begin_ts <= 0 else max(0, int((store_ts[where[phy]] - begin_ts) / 1000))
            expected.append(ik.ENTRY_WRONG_KEY if not fine else ik.ENTRY_FINE if diff == made or n == 0 else
                            ik.ENTRY_WRONG_TIME)  # entry 1's diff counts from the file's creation
            if fine:
                want_covered.add((where[phy] << 32) | h)
        else:
            expected.append(ik.ENTRY_EXPIRED if phy < log_min else ik.ENTRY_NO_RECORD)
    assert status.tolist() == expected
    assert {int(p) for p in key_pairs[covered]} == want_covered


# --- index files verify could not read, index chains ----------------------------------------------------

SMALL_INDEX = CONFIG.replace(max_hash_slot_num=97, max_index_num=388)


@pytest.mark.parametrize("damage", ["truncated", "impossible count"])
def test_a_damaged_oldest_index_file_is_a_problem_and_its_keys_are_checked(tmp_path, damage):
    """The read-only load skipped a damaged index file without a word, and missing keys were counted only from
    the first entry of the first file that loaded: a damaged oldest file left verify at 0 problems."""
    root = tmp_path / "s"
    results = write(root, 600, SMALL_INDEX)
    assert verify_store(root, SMALL_INDEX).clean
    files = sorted((root / "index").iterdir())
    assert len(files) >= 3
    oldest = files[0]
    if damage == "truncated":
        oldest.write_bytes(oldest.read_bytes()[:3000])
    else:
        data = bytearray(oldest.read_bytes())
        struct.pack_into(">i", data, 36, 10**9)  # indexCount
        oldest.write_bytes(bytes(data))
    report = verify_store(root, SMALL_INDEX)
    assert not report.clean
    assert any(p.kind == "index" and p.path == str(oldest) for p in report.problems)
    unindexed = {p.offset for p in report.problems if "have no index entry" in p.detail}
    assert results[0].commit_log_offset in unindexed


@pytest.mark.parametrize("link", ["itself", "a later entry", "past the count"])
def test_a_broken_index_chain_in_any_file_is_a_problem(tmp_path, link):
    """verify checked each entry but not the chains: a prevIndex pointing at its own entry or a later one, in a
    file older than the two a writer's open checks, left verify at 0 problems while a key lookup stopped short."""
    root = tmp_path / "s"
    write(root, 600, SMALL_INDEX)
    oldest = sorted((root / "index").iterdir())[0]
    data = bytearray(oldest.read_bytes())
    entries_at = 40 + 97 * 4
    number = 10
    target = {"itself": number, "a later entry": number + 5, "past the count": 10**6}[link]
    struct.pack_into(">i", data, entries_at + number * 20 + 16, target)
    oldest.write_bytes(bytes(data))
    report = verify_store(root, SMALL_INDEX)
    assert [(p.path, p.offset) for p in report.problems if "broken chain" in p.detail] == \
        [(str(oldest), entries_at + number * 20)]


def test_queue_units_below_the_log_start_after_retention_are_no_problem(tmp_path):
    """After retention deleted the oldest segment, the queues' first units point below the log's start, as in
    RocketMQ (a queue file goes once all its units are below it): verify reported each as pointing where no
    record starts. A unit below the log's start after the queue's first live unit is still damage."""
    config = SMALL_INDEX.replace(mapped_file_size_commit_log=16 << 10)
    root = tmp_path / "s"
    with MessageStore.open(root, config) as store:
        i = 0
        while i < 600 or store.commit_log.max_offset % (16 << 10) < 12 << 10:  # the newest segment well filled
            store.put_message(Message(f"T{i % 3}", b"x" * (i % 40), keys=[f"k{i}"], queue_id=i % 2))
            i += 1
        assert store.wait_for_dispatch(timeout=30)
        assert store.delete_expired_files(now_ms=2**62, immediately=True).commit_log_files
        log_min = store.commit_log.min_offset
    assert log_min > 0
    report = verify_store(root, config)
    assert report.clean, report.problems[:3]
    queue_file = sorted((root / "consumequeue" / "T0" / "0").iterdir())[-1]
    units = np.frombuffer(queue_file.read_bytes(), dtype=">i8,>i4,>i8")
    live = int(np.flatnonzero(units["f0"] >= log_min)[0])
    assert units["f1"][live + 1] > 0
    data = bytearray(queue_file.read_bytes())
    struct.pack_into(">q", data, (live + 1) * 20, 0)  # the unit after the first live one: a record long deleted
    queue_file.write_bytes(bytes(data))
    assert [(p.path, p.offset) for p in verify_store(root, config).problems if "no record starts" in p.detail] == \
        [(str(queue_file), (live + 1) * 20)]


@pytest.mark.parametrize("damage", ["slot table zeroed", "a slot skipping its newest entry", "a link cut short",
                                    "a link skipping an entry", "a negative hash"])
def test_index_chains_that_lose_keys_are_problems(tmp_path, damage):
    """verify checked that links run backwards, not that they are the links the entries make: a slot table
    zeroed (every key of the file not found by a lookup), a slot or link naming an older entry of its chain, or
    a link to 0 (the chain's older keys not found) left verify at 0 problems. Only the first place is named."""
    root = tmp_path / "s"
    results = write(root, 600, SMALL_INDEX)
    oldest = sorted((root / "index").iterdir())[0]
    data = bytearray(oldest.read_bytes())
    entries_at = 40 + 97 * 4
    count = struct.unpack_from(">i", data, 36)[0]
    entry = [struct.unpack_from(">iqii", data, entries_at + n * 20) for n in range(count)]
    slot_of = {n: entry[n][0] % 97 for n in range(1, count)}
    linked = next(n for n in range(count - 1, 0, -1) if entry[n][3] and entry[entry[n][3]][3])  # a chain of 3+
    if damage == "slot table zeroed":
        data[40:entries_at] = bytes(entries_at - 40)
        first_used = min(slot_of.values())
        where = 40 + 4 * first_used
    elif damage == "a slot skipping its newest entry":
        slot = slot_of[linked]
        head = struct.unpack_from(">i", data, 40 + 4 * slot)[0]
        struct.pack_into(">i", data, 40 + 4 * slot, entry[head][3])
        where = 40 + 4 * slot
    elif damage == "a link cut short":
        struct.pack_into(">i", data, entries_at + linked * 20 + 16, 0)
        where = entries_at + linked * 20
    elif damage == "a link skipping an entry":
        struct.pack_into(">i", data, entries_at + linked * 20 + 16, entry[entry[linked][3]][3])
        where = entries_at + linked * 20
    else:
        struct.pack_into(">i", data, entries_at + 5 * 20, -7)
        where = entries_at + 5 * 20
    oldest.write_bytes(bytes(data))
    with MessageStore.open(root, SMALL_INDEX, read_only=True) as store:  # what the damage costs: keys not found
        lost = sum(not store.query_message(f"T{i % 3}", f"k{i}") or
                   not store.query_message_by_uniq_key(f"T{i % 3}", r.msg_id) for i, r in enumerate(results))
    assert lost or damage == "a negative hash"
    report = verify_store(root, SMALL_INDEX)
    assert [(p.path, p.offset) for p in report.problems if "broken chain" in p.detail] == [(str(oldest), where)]


@pytest.mark.parametrize("name", ["v1_collisions_97x500", "v2_full_97x500"])
def test_rocketmqs_own_index_files_have_the_chains_verify_expects(vectors, name):
    """Files written by RocketMQ's ``IndexFile.putKey`` (with collisions, and full): no false alarm."""
    from rocketstore.index import IndexFile
    from rocketstore.index.service import chain_problem_at

    folder = vectors / name
    path = next(p for p in folder.iterdir() if p.name.isdigit())
    index = IndexFile.open(path, 97, 500, read_only=True)
    try:
        assert index.index_count > 100
        assert chain_problem_at(index, thorough=True) is None
        assert chain_problem_at(index) is None
    finally:
        index.close()


@pytest.mark.parametrize("name", ["16384", "notes.txt", "00000000000000000000.bak"])
def test_verify_names_what_in_the_log_directory_is_not_a_segment(tmp_path, name, caplog):
    """A file whose name is not a segment's is not read, which was right, but said nowhere: RocketMQ loads a
    numeric name as a segment ("16384": offset 16384) or refuses to start, so verify reports it and an open
    warns."""
    write(tmp_path, 20)
    (tmp_path / "commitlog" / name).write_bytes(b"x" * 100)
    report = verify_store(tmp_path, CONFIG)
    assert [(p.path, p.detail[:16]) for p in report.problems] == [(str(tmp_path / "commitlog" / name),
                                                                   "not a segment (a")]
    with MessageStore.open(tmp_path, CONFIG, read_only=True) as store:
        assert len(list(store.iter_messages())) == 20
    assert f"holds {name}, which is no segment name" in caplog.text


def test_verify_with_other_delay_levels_names_each_parked_unit_once_and_says_why(tmp_path):
    """A store whose broker has other delay levels, verified without them: each parked message was two problems
    (its unit's tags code, and its record "missing from its queue" though the unit is there) and nothing said
    that the levels were the cause (the review). One problem a unit now, naming the setting."""
    config = CONFIG.replace(message_delay_level="1h 2h")
    with MessageStore.open(tmp_path, config) as store:
        for _ in range(3):
            store.put_message(Message("Late", b"later", properties={"DELAY": "1"}))
        store.wait_for_dispatch()
    assert verify_store(tmp_path, config).clean
    report = verify_store(tmp_path, CONFIG)
    assert len(report.problems) == 3
    assert all("delay levels" in p.detail and "--broker-conf" in p.detail for p in report.problems)


def test_a_live_verify_during_retention_reports_nothing_retention_removed(tmp_path, monkeypatch):
    """verify reads the log first, the queues and index later: a writer's retention between the two deleted old
    segments with their index files and queue files, and verify reported the keys of its oldest remaining records
    as having no index entry (1 run in 8 beside a busy writer; the review)."""
    import rocketstore.verify as verify_module

    config = CONFIG.replace(mapped_file_size_commit_log=16 << 10, mapped_file_size_consume_queue=20 * 50,
                            max_hash_slot_num=17, max_index_num=68, file_reserved_time=0)
    with MessageStore.open(tmp_path, config) as store:
        for i in range(600):
            store.put_message(Message("T", b"m%d" % i + b"." * (i % 200), keys=[f"k{i}", f"g{i % 7}"],
                                      queue_id=i % 4))
        store.wait_for_dispatch()
        store.flush()
        check_queues = verify_module._check_queues
        deleted = []

        def retention_first(*args, **kwargs):  # on a real store verify reads for minutes: retention runs meanwhile
            deleted.append(store.delete_expired_files(immediately=True))
            return check_queues(*args, **kwargs)

        monkeypatch.setattr(verify_module, "_check_queues", retention_first)
        report = verify_store(tmp_path, config)
        assert report.live and deleted[0].commit_log_files and deleted[0].index_files
        assert report.problems == []


def test_an_index_files_first_entry_counts_its_time_from_the_files_creation(tmp_path, monkeypatch):
    """putKey computes an entry's time diff before it sets a new file's beginTimestamp, so entry 1 of every file
    but the first counts from the previous file's end: with seconds between messages that is not 0, and verify
    must not call it damage (RocketMQ's files are written the same way)."""
    from rocketstore import commitlog

    clock = iter(range(1_790_000_000_000, 1_790_000_000_000 + 10**9, 3_700))  # 3.7 s between messages
    monkeypatch.setattr(commitlog, "now_ms", lambda: next(clock))
    config = CONFIG.replace(max_hash_slot_num=17, max_index_num=68)
    with MessageStore.open(tmp_path, config) as store:
        for i in range(200):
            store.put_message(Message("T", b"m%d" % i, keys=[f"k{i}"]))
        store.wait_for_dispatch()
    files = sorted((tmp_path / "index").iterdir())
    assert len(files) > 2
    first_diffs = [struct.unpack_from(">i", f.read_bytes(), 40 + 17 * 4 + 20 + 12)[0] for f in files[1:]]
    assert any(d > 0 for d in first_diffs), first_diffs  # counted from the previous file's end
    report = verify_store(tmp_path, config)
    assert report.problems == [], report.problems[:3]


LAGGING_WRITER = textwrap.dedent("""
    import os, sys
    from rocketstore import Message, MessageStore, StoreConfig
    from rocketstore.verify import verify_store
    config = StoreConfig(mapped_file_size_commit_log=256 << 10, mapped_file_size_consume_queue=20 * 2000,
                         max_hash_slot_num=1999, max_index_num=8000)
    store = MessageStore.open(sys.argv[1], config)
    for start in range(0, 9000, 1000):  # more than one dispatch batch (8,192) before the lag
        store.put_messages([Message(f"T{i % 3}", b"x", keys=[f"k{i}"], queue_id=i % 2)
                            for i in range(start, start + 1000)])
    assert store.wait_for_dispatch(timeout=30)
    with store.dispatcher.paused():  # the writer dies with these in the log, not yet in queues or index
        store.put_messages([Message(f"T{i % 3}", b"y", keys=[f"late{i}"], queue_id=i % 2) for i in range(200)])
        os._exit(0)
""")


def test_a_dead_writers_dispatch_lag_is_no_problem(tmp_path):
    """After a kill -9 the newest records are in the log but not yet in their queues or the index: a writer's next
    open dispatches them, as a broker's restart does. verify called each one a problem (18,373 after one kill) and
    exited 1 on a store nothing was wrong with; a record missing before the frontier still is one."""
    root = tmp_path / "store"
    subprocess.run([sys.executable, "-c", LAGGING_WRITER, str(root)], check=True, timeout=120)
    assert (root / "abort").exists()
    report = verify_store(root, CONFIG)
    assert report.unclean and report.clean, report.problems[:5]
    assert report.records == 9200 and report.not_dispatched == 200 and report.not_indexed == 200
    done = subprocess.run([sys.executable, "-m", "rocketstore.cli.app", "verify", "--store", str(root),
                           "--max-hash-slot-num", "1999", "--max-index-num", "8000"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "store was not closed (abort file, no writer): 200 record(s) at the log's end are not in their queues " \
           "yet and 200 not indexed" in done.stdout

    (root / "abort").unlink()  # a closed store's log has nothing left to dispatch: the same lag is 400 problems
    closed = verify_store(root, CONFIG)
    assert not closed.unclean and closed.problem_count == 400 and closed.not_dispatched == 0
    (root / "abort").touch()

    # a unit zeroed well before the frontier is damage: still a problem (the units after it in the last dispatch
    # batch before the frontier count as lag: the next open dispatches again from the batch's start)
    with MessageStore.open(root, CONFIG, read_only=True) as store:
        unit = store.queues.get("T0", 0).mapped_files.files[0].path
    with open(unit, "r+b") as f:
        f.seek(20 * 3)
        f.write(bytes(20))
    gapped = verify_store(root, CONFIG)
    assert gapped.not_dispatched >= 200 and not gapped.clean
    assert any("missing from its queue" in str(p) for p in gapped.problems), gapped.problems[:5]

    with MessageStore.open(root, CONFIG) as store:  # the next writer's open: dispatched, nothing lagging
        assert store.wait_for_dispatch(timeout=30)
        assert len(store.query_message("T1", "late1")) == 1


def test_a_log_with_no_record_left_is_reported_not_an_index_error(tmp_path):
    """A store whose only segment was emptied while its queues still hold units: verify died with numpy's
    "index 0 is out of bounds" (the fuzz review); every unit and entry now points where no record starts."""
    root = tmp_path / "s"
    write(root, 3)
    os.truncate(next((root / "commitlog").iterdir()), 0)
    report = verify_store(root, CONFIG)
    assert report.records == 0 and report.queue_units == 3 and not report.clean
    assert all("where no record starts" in p.detail for p in report.problems if p.kind != "commitlog")


def test_verify_reads_on_past_damage_in_a_segment(tmp_path):
    """verify stopped reading a segment at its first damaged record: a second damage after it was never reported,
    and every unit and index entry of the intact records after it was a problem "where no record starts" (447 for
    one flipped byte in the fuzz review). It now says the damage and reads on from the next record."""
    from rocketstore.codec import read_layout

    root = tmp_path / "s"
    results = write(root, 400)
    first_segment = root / "commitlog" / f"{0:020d}"
    data = bytearray(first_segment.read_bytes())
    in_first = [r for r in results if r.commit_log_offset + 200 < len(data)]
    victims = [in_first[10], in_first[len(in_first) // 40 * 20 + 5]]  # bodies of 10 and 5 bytes
    for victim in victims:
        data[read_layout(bytes(data), victim.commit_log_offset).body_pos] ^= 0x01
    first_segment.write_bytes(bytes(data))
    report = verify_store(root, CONFIG)
    damage = [p for p in report.problems if p.kind == "commitlog"]
    assert [p.offset for p in damage] == [v.commit_log_offset for v in victims]
    assert all("CRC" in p.detail for p in damage), [p.detail for p in damage]
    assert report.records == 398
    # each damaged record's unit and its two index entries (UNIQ_KEY, key): nothing about intact records
    assert report.problem_count == 2 + 2 * 3, [str(p) for p in report.problems]


def test_a_lost_oldest_index_file_is_a_problem(tmp_path):
    """Keys were checked from the oldest remaining index file's first entry on: with that file lost, the keys it
    held were found by no query and verify said nothing (0 problems on the golden store in the fuzz review)."""
    config = CONFIG.replace(max_hash_slot_num=17, max_index_num=68)
    root = tmp_path / "s"
    write(root, 200, config)
    files = sorted((root / "index").iterdir())
    assert len(files) > 2
    files[0].unlink()
    report = verify_store(root, config)
    lost = [p for p in report.problems if "no index file covers them" in p.detail]
    assert len(lost) == 1 and not report.clean, report.problems[:3]
    # one for them all (each was reported again besides); at most the record whose keys the lost file split with
    # the oldest remaining one has its own line
    assert report.problem_count <= 2, [str(p) for p in report.problems]


def test_a_dead_writers_unfinished_append_is_no_problem(tmp_path):
    """A writer killed between an append's body and its first 8 bytes (its commit point) leaves bytes after the
    log's end: verify called them "non-zero bytes after the end of the log" and exited 1 (the self-review), though
    a writer's open zeroes them as it should. With an abort file and no writer they are counted, not a problem."""
    root = tmp_path / "s"
    write(root, 100)
    segment = sorted((root / "commitlog").iterdir())[-1]
    with MessageStore.open(root, CONFIG, read_only=True) as view:
        end = view.max_phy_offset - int(segment.name)
    data = bytearray(segment.read_bytes())
    data[end + 8:end + 200] = b"\x07" * 192  # the body written, the size and magic not yet
    segment.write_bytes(bytes(data))
    (root / "abort").write_text("12345")
    report = verify_store(root, CONFIG)
    assert report.clean and report.unfinished_bytes == 200, report.problems[:3]  # from the end to the last byte
    (root / "abort").unlink()  # a closed store has no unfinished append: bytes after its end are a problem
    assert not verify_store(root, CONFIG).clean


def test_a_zeroed_header_before_puts_stored_apart_is_damage_not_an_unfinished_append(tmp_path):
    """An append's records share one store time; zeros before records stored at other times are no unfinished
    append but acknowledged puts lost from the log (the second review: 20 such puts were called one append)."""
    import time

    root = tmp_path / "s"
    with MessageStore.open(root, CONFIG) as store:
        results = []
        for i in range(5):
            results.append(store.put_message(Message("T0", b"m%d" % i, keys=[f"k{i}"])))
            time.sleep(0.003)
    segment = sorted((root / "commitlog").iterdir())[-1]
    data = bytearray(segment.read_bytes())
    at = results[2].commit_log_offset - int(segment.name)
    data[at:at + 8] = bytes(8)
    segment.write_bytes(bytes(data))
    (root / "abort").write_text("12345")
    report = verify_store(root, CONFIG)
    assert report.unfinished_bytes == 0 and not report.clean
    assert any("non-zero bytes after the end of the log" in p.detail for p in report.problems), report.problems

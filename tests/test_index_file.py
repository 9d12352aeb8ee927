"""IndexFile: RocketMQ's bytes and answers, on the golden files, the spec's examples and random input."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rocketstore.codec import index_key_hash, java_string_hash
from rocketstore.errors import CorruptDataError
from rocketstore.index import IndexFile, index_file_size

LONG_MAX = (1 << 63) - 1


def build_from_tsv(folder: Path, target: Path, slots: int, entries: int) -> tuple[IndexFile, int | None, int]:
    index = IndexFile.create(target, slots, entries)
    full_at, puts = None, 0
    for line_no, line in enumerate((folder / "input.tsv").read_text(encoding="utf-8").splitlines(), 1):
        key, phy, ts = line.split("\t")
        if not index.put_key(key, int(phy), int(ts)):
            full_at = line_no
            break
        puts += 1
    index.flush()
    return index, full_at, puts


@pytest.mark.parametrize("name", ["v1_collisions_97x500", "v2_full_97x500"])
def test_golden_index_rebuilt_byte_for_byte_and_queried_identically(vectors, tmp_path, name):
    folder = vectors / name
    expected = json.loads((folder / "expected_queries.json").read_text())
    index, full_at, puts = build_from_tsv(folder, tmp_path / expected["file"], expected["hashSlotNum"],
                                          expected["indexNum"])
    stdout = dict(line.split("\t") for line in (folder / "build_stdout.txt").read_text().splitlines())
    assert puts == int(stdout["PUT"])
    assert full_at == (int(stdout["FULL"]) if "FULL" in stdout else None)
    assert (tmp_path / expected["file"]).read_bytes() == (folder / expected["file"]).read_bytes()
    header = expected["header"]
    for golden in (index, IndexFile.open(folder / expected["file"], expected["hashSlotNum"], expected["indexNum"],
                                         read_only=True)):
        assert (golden.begin_timestamp, golden.end_timestamp) == (header["beginTimestamp"], header["endTimestamp"])
        assert (golden.begin_phy_offset, golden.end_phy_offset) == (header["beginPhyOffset"], header["endPhyOffset"])
        assert (golden.hash_slot_count, golden.index_count) == (header["hashSlotCount"], header["indexCount"])
        assert golden.is_write_full() == header["isWriteFull"]
        for q in expected["queries"]:
            assert golden.select_phy_offsets(q["key"], q["maxNum"], q["begin"], q["end"]) == q["offsets"], q
            assert golden.is_time_matched(q["begin"], q["end"]) == q["isTimeMatched"], q
        golden.close()


def test_golden_hashes(vectors):
    rows = json.loads((vectors / "v1_collisions_97x500" / "hashes.json").read_text())
    assert len(rows) >= 100
    for row in rows:
        assert java_string_hash(row["key"]) == row["hashCode"], row
        assert index_key_hash(row["key"]) == row["indexKeyHash"], row
        assert row["indexKeyHash"] % 97 == row["slot"]


def spec_e7(tmp_path: Path) -> IndexFile:
    index = IndexFile.create(tmp_path / "e7", 10, 5)
    assert index.put_key("TopicTest#order-1", 0, 1700000000123)
    assert index.put_key("Ea#20231001123456", 128, 1700000001500)
    assert index.put_key("FB#20231001123456", 256, 1700000002999)
    assert index.put_key("TopicTest#order-1", 384, 1700000004000)
    return index


def test_spec_e7_bytes_and_queries(tmp_path):
    index = spec_e7(tmp_path)
    assert not index.put_key("TopicTest#x", 512, 1700000005000), "indexCount 5 >= 5: full"
    assert index.is_write_full()
    index.flush()
    data = (tmp_path / "e7").read_bytes()
    assert len(data) == index_file_size(10, 5) == 180
    assert data[:40].hex() == ("0000018bcfe5687b" "0000018bcfe577a0" "0000000000000000" "0000000000000180"
                               "00000002" "00000005")
    slots = [int.from_bytes(data[40 + 4 * i : 44 + 4 * i], "big") for i in range(10)]
    assert slots == [0, 0, 0, 3, 4, 0, 0, 0, 0, 0]
    assert data[0x64:0xB4].hex() == ("6d0746d0" "0000000000000000" "00000000" "00000000"
                                     "012ad057" "0000000000000080" "00000001" "00000000"
                                     "012ad057" "0000000000000100" "00000002" "00000002"
                                     "6d0746d0" "0000000000000180" "00000003" "00000001")
    assert index.select_phy_offsets("Ea#20231001123456", 64, 0, LONG_MAX) == [256, 128]
    assert index.select_phy_offsets("TopicTest#order-1", 64, 1700000001000, LONG_MAX) == [384]
    assert index.select_phy_offsets("TopicTest#order-1", 64, 0, 1700000003500) == [384, 0]


def test_spec_e8_rollover_quirk(tmp_path):
    full = spec_e7(tmp_path)
    nxt = IndexFile.create(tmp_path / "e8", 10, 5, full.end_phy_offset, full.end_timestamp)
    assert nxt.put_key("TopicTest#order-3", 512, 1700000006500)
    nxt.flush()
    data = (tmp_path / "e8").read_bytes()
    assert data[:40].hex() == ("0000018bcfe58164" "0000018bcfe58164" "0000000000000200" "0000000000000200"
                               "00000001" "00000002")
    assert int.from_bytes(data[40 + 2 * 4 : 44 + 2 * 4], "big") == 1
    assert data[0x64:0x78].hex() == "6d0746ce" "0000000000000200" "00000002" "00000000"
    assert nxt.select_phy_offsets("TopicTest#order-3", 64, 1700000006000, 1700000007000) == []
    assert nxt.select_phy_offsets("TopicTest#order-3", 64, 1700000006000, 1700000009000) == [512]


def test_fresh_file_counts_and_reopen(tmp_path):
    index = IndexFile.create(tmp_path / "f", 7, 9)
    assert index.index_count == 1 and index.hash_slot_count == 0
    assert (tmp_path / "f").read_bytes()[32:40] == bytes(8), "nothing written before the first put"
    assert index.select_phy_offsets("k", 64, 0, LONG_MAX) == []
    index.put_key("T#k", 10, 1000)
    index.close()
    again = IndexFile.open(tmp_path / "f", 7, 9)
    assert (again.index_count, again.hash_slot_count) == (2, 1)
    assert again.select_phy_offsets("T#k", 64, 0, LONG_MAX) == [10]


def test_open_rejects_wrong_geometry_and_impossible_header(tmp_path):
    IndexFile.create(tmp_path / "f", 7, 9).close()
    with pytest.raises(CorruptDataError):
        IndexFile.open(tmp_path / "f", 8, 9)
    with open(tmp_path / "f", "r+b") as f:
        f.seek(36)
        f.write((1000).to_bytes(4, "big"))
    with pytest.raises(CorruptDataError, match="impossible"):
        IndexFile.open(tmp_path / "f", 7, 9)


def test_walk_terminates_on_a_cyclic_chain(tmp_path):
    index = IndexFile.create(tmp_path / "f", 1, 10)
    for i in range(5):
        index.put_key(f"T#{i}", i, 1000 + i)
    entries_at = 40 + 4
    index.buffer[entries_at + 1 * 20 + 16 : entries_at + 1 * 20 + 20] = (4).to_bytes(4, "big")  # 1 -> 4: a cycle
    found = index.select_phy_offsets("T#0", 1000, 0, LONG_MAX)
    assert len(found) <= 5


keys = st.sampled_from(["T#a", "T#b", "T#Aa", "T#BB", "T#c", "U#a", "T#订单", "T#😀", "polygenelubricants"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(puts=st.lists(st.tuples(keys, st.integers(0, 5000)), min_size=1, max_size=60),
       slots=st.integers(1, 13), max_num=st.integers(1, 70))
def test_select_matches_a_model_of_the_chains(tmp_path_factory, puts, slots, max_num):
    """With rising times and an all-time window, a lookup returns every entry of equal hash, newest first."""
    path = tmp_path_factory.mktemp("idx") / "f"
    index = IndexFile.create(path, slots, 40)
    stored = []
    ts = 1_700_000_000_000
    for key, step in puts:
        ts += step
        if not index.put_key(key, len(stored) * 100, ts):
            assert len(stored) == 39
            break
        stored.append((key, len(stored) * 100))
    for key in {k for k, _ in puts}:
        expected = [phy for k, phy in reversed(stored) if index_key_hash(k) == index_key_hash(key)][:max_num]
        assert index.select_phy_offsets(key, max_num, 0, LONG_MAX) == expected
    index.close()


def test_a_kernel_without_populate_advice_still_creates_the_file(tmp_path, monkeypatch):
    """Populating the slots is an optimisation: advice the kernel refuses (EINVAL) leaves a working file."""
    from rocketstore.index import file as index_file

    monkeypatch.setattr(index_file, "_POPULATE_WRITE", 0x7FFF)
    index = index_file.IndexFile.create(tmp_path / "i", 11, 40, preallocate=True)
    assert index.put_key("T#k", 100, 1_700_000_000_000)
    assert index.select_phy_offsets("T#k", 10, 0, 2_000_000_000_000) == [100]
    index.close()


@pytest.mark.parametrize("unnamed", [True, False])
def test_a_continuing_file_has_its_inherited_header_the_moment_it_has_a_name(tmp_path, monkeypatch, unnamed):
    """A roll's new file got the offset and time it continues from after it was linked into index/: a kill in
    between (the 20 MB slot prefault widened it to milliseconds) left a newest file starting at offset 0, and the
    next open indexed the whole log into it again (about 4 entries per message instead of 2, seen in crash loops)."""
    import os

    from rocketstore.mapped import file as mapped_file

    seen: list[bytes] = []

    def header_of(path) -> bytes:
        with open(path, "rb") as f:
            return f.read(40)

    if unnamed:
        real_link = mapped_file._link_open_file

        def link(fd, path):
            real_link(fd, path)
            seen.append(header_of(path))

        monkeypatch.setattr(mapped_file, "_link_open_file", link)
    else:
        monkeypatch.setattr(mapped_file, "_create_unnamed", lambda *args: False)  # a file system without O_TMPFILE
        real_rename = os.rename

        def rename(src, dst):
            real_rename(src, dst)
            seen.append(header_of(dst))

        monkeypatch.setattr(mapped_file.os, "rename", rename)
    index = IndexFile.create(tmp_path / "20261127000000000", 97, 500, 123_456, 1_700_000_000_000,
                             staging=tmp_path / "staging")
    try:
        assert seen == [struct.pack(">qqqqii", 1_700_000_000_000, 1_700_000_000_000, 123_456, 123_456, 0, 0)]
        assert (index.begin_phy_offset, index.end_phy_offset) == (123_456, 123_456)
        assert (index.begin_timestamp, index.end_timestamp) == (1_700_000_000_000, 1_700_000_000_000)
    finally:
        index.close()


def test_an_open_index_file_holds_one_descriptor_and_none_once_closed(tmp_path):
    """Each index file held its own descriptor beside the one its mapping keeps: two per file. A store with many small
    index files reached EMFILE at 20,000 descriptors in the crash review."""
    import os

    def held(path) -> int:
        return sum(1 for fd in os.listdir("/proc/self/fd") if _link(fd) == str(path))

    def _link(fd: str) -> str:
        try:
            return os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return ""

    made = IndexFile.create(tmp_path / "20261127000000000", 97, 500)
    assert held(made.path) == 1
    made.close()
    assert held(made.path) == 0
    opened = IndexFile.open(made.path, 97, 500, read_only=True)
    assert held(made.path) == 1
    opened.close()
    assert held(made.path) == 0


def test_a_sparse_index_file_reserves_its_blocks_before_each_store(tmp_path, monkeypatch):
    """An index file made with preallocate off (or a broker's) was written into through its mapping without blocks:
    on a full disk a SIGBUS killed the process (the full-disk review). The slots are reserved at creation and the
    entries a step ahead of the appends; a refused reservation is a StoreIOError with nothing written."""
    import errno
    import os

    import numpy as np

    from rocketstore.errors import StoreIOError
    from rocketstore.index import bulk
    from rocketstore.index import file as index_file

    slots, entries = 5_000, 200_000  # 4 MB of entries: more than one reservation step
    index = IndexFile.create(tmp_path / "idx", slots, entries, preallocate=False)
    entries_at = 40 + slots * 4
    assert os.stat(index.path).st_blocks * 512 >= entries_at  # header and slots: any key lands anywhere
    assert os.stat(index.path).st_blocks * 512 < index_file_size(slots, entries) // 2  # the entries are not
    n = index_file.RESERVE_STEP // 20 + 10  # past the first step
    hashes = np.arange(1, n + 1, dtype=np.int64) * 7919
    assert bulk.put_hashes(index, hashes[: n // 2], np.arange(n // 2, dtype=np.int64), np.full(n // 2, 1, np.int64))
    assert index.reserved_to >= entries_at + (n // 2 + 1) * 20
    before = (index.index_count, bytes(index.buffer[:40]), index.reserved_to)

    def refuse(path, end, start=0):
        raise StoreIOError(errno.ENOSPC, f"cannot reserve the blocks of {path}: No space left on device")

    monkeypatch.setattr(index_file, "reserve_blocks", refuse)
    with pytest.raises(StoreIOError, match="No space left"):
        bulk.put_hashes(index, hashes[n // 2 :], np.arange(n // 2, n, dtype=np.int64), np.full(n - n // 2, 1, np.int64))
    with pytest.raises(StoreIOError, match="No space left"):
        while True:  # single puts go on until the reserved blocks end, then refuse
            assert index.put_hash(12345, 12345 % slots, 1, 1)
    assert entries_at + index.index_count * 20 <= index.reserved_to == before[2]  # no store past the blocks
    monkeypatch.undo()
    assert bulk.put_hashes(index, hashes[n // 2 :], np.arange(n // 2, n, dtype=np.int64),
                           np.full(n - n // 2, 1, np.int64)) == n - n // 2
    index.close()

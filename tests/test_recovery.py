"""Recovery: torn tails, damaged records, checkpoint trust, odd segment files, real RocketMQ files."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from rocketstore import FlushDiskType, Message, MessageStore, StoreConfig
from rocketstore.checkpoint import StoreCheckpoint
from rocketstore.codec import decode_record, read_layout
from rocketstore.errors import ChecksumError, CorruptDataError, OffsetOutOfRangeError


def fill(store: MessageStore, count: int, size: int = 60) -> list:
    return [store.put_message(Message(f"T{i % 2}", bytes([65 + i % 26]) * size, keys=[f"k{i}"], queue_id=i % 3))
            for i in range(count)]


def segment_of(root: Path, phy: int, size: int = 4096) -> tuple[Path, int]:
    return root / "commitlog" / f"{phy - phy % size:020d}", phy % size


def body_pos(path: Path, pos: int) -> int:
    return read_layout(path.read_bytes(), pos).body_pos


def crash(root: Path) -> None:
    """Make the next open see a crashed run (what SIGKILL leaves behind)."""
    (root / "abort").write_text("999999")


def store_with_a_last_record(root: Path, config: StoreConfig) -> tuple[list, int, bytes, Path, int]:
    """20 messages in 64 KiB segments: (results, log end, the last record's bytes, segment, end's position)."""
    with MessageStore.open(root, config) as store:
        results = fill(store, 20)
        end = store.max_phy_offset
        torn = bytes(store.commit_log.get_record_bytes(results[-1].commit_log_offset))
    path, pos = segment_of(root, end, 1 << 16)
    return results, end, torn, path, pos


def test_torn_append_is_cut_salvaged_and_zeroed(tmp_path, small_config):
    small_config = small_config.replace(mapped_file_size_commit_log=1 << 16)
    results, end, torn, path, pos = store_with_a_last_record(tmp_path, small_config)
    with open(path, "r+b") as f:  # a kill mid-append: everything but the first 8 bytes landed
        f.seek(pos + 8)
        f.write(torn[8:])
    crash(tmp_path)
    with MessageStore.open(tmp_path, small_config) as store:
        report = store.recovery
        assert report.abnormal and report.end_offset == end
        assert report.cut_bytes == len(torn)  # from the end of the log to the last non-zero byte
        salvage = [Path(p) for p in report.salvaged if p.endswith(".tail")]
        assert salvage and salvage[0].read_bytes() == b"\0" * 8 + torn[8:]
        assert path.read_bytes()[pos : pos + len(torn)] == bytes(len(torn)), "the torn bytes are zeroed"
        for r in results:
            assert store.look_message_by_offset(r.commit_log_offset).msg_id == r.msg_id
        again = store.put_message(Message("T0", b"after the crash"))
        assert again.commit_log_offset == end
        assert again.queue_offset == sum(1 for i in range(20) if i % 2 == 0 and i % 3 == 0)
    with MessageStore.open(tmp_path, small_config) as store:
        assert store.look_message_by_offset(end).body == b"after the crash"


@pytest.mark.parametrize("clean", [False, True], ids=["after-crash", "after-clean-exit"])
@pytest.mark.parametrize("prop_crc", [False, True], ids=["compiled-walk", "record-by-record"])
def test_a_stale_copy_of_a_record_past_the_end_is_not_taken_into_the_log(tmp_path, small_config, clean, prop_crc):
    """A well-formed record whose PHYSICALOFFSET names another place (a stale or copied record after the log's
    end) is no record of this log: every reader refuses it, so recovery ends the log before it and salvages it,
    instead of extending the log (and its queues) over bytes nothing can read."""
    small_config = small_config.replace(mapped_file_size_commit_log=1 << 16, enabled_append_prop_crc=prop_crc,
                                        force_verify_prop_crc=prop_crc)
    results, end, _torn, path, pos = store_with_a_last_record(tmp_path, small_config)
    with MessageStore.open(tmp_path, small_config) as store:
        stale = bytes(store.commit_log.get_record_bytes(results[3].commit_log_offset))
    with open(path, "r+b") as f:
        f.seek(pos)
        f.write(stale)
    if not clean:
        crash(tmp_path)
    with MessageStore.open(tmp_path, small_config) as store:
        report = store.recovery
        assert report.end_offset == end
        assert f"written at commit-log offset {results[3].commit_log_offset}" in report.stop_reason
        salvage = [Path(p) for p in report.salvaged if p.endswith(".tail")]
        assert salvage and salvage[0].read_bytes() == stale
        assert store.max_phy_offset == end
        assert sum(1 for _ in store.iter_messages()) == len(results)
        again = store.put_message(Message("T1", b"next"))
        assert again.commit_log_offset == end
        assert store.look_message_by_offset(end).body == b"next"


def test_two_recoveries_in_one_second_keep_both_salvaged_tails(tmp_path, small_config, monkeypatch):
    """Salvage files are named by offset and second: a second crash cut at the same offset in the same second
    overwrote the first one's salvage (and a segment moved aside twice replaced the first copy)."""
    import time as time_module

    real, second = time_module.strftime, time_module.strftime("%Y%m%d%H%M%S")
    monkeypatch.setattr(time_module, "strftime", lambda fmt, *when: real(fmt, *when) if when else second)
    small_config = small_config.replace(mapped_file_size_commit_log=1 << 16)
    _, end, torn, path, pos = store_with_a_last_record(tmp_path, small_config)
    tails = []
    for fill_byte in (0x41, 0x42):
        with open(path, "r+b") as f:  # a kill mid-append, twice at the same offset, different bytes each time
            f.seek(pos + 8)
            f.write(torn[8:-1] + bytes([fill_byte]))
        crash(tmp_path)
        with MessageStore.open(tmp_path, small_config) as store:
            assert store.recovery.end_offset == end
            tails += [Path(p) for p in store.recovery.salvaged if p.endswith(".tail")]
    assert [t.name for t in tails] == [f"commitlog-{end:020d}-{second}.tail", f"commitlog-{end:020d}-{second}-2.tail"]
    assert [t.read_bytes() for t in tails] == [b"\0" * 8 + torn[8:-1] + bytes([b]) for b in (0x41, 0x42)]


def test_a_salvage_whose_name_cannot_be_made_durable_stops_recovery_before_the_bytes_are_zeroed(
        tmp_path, small_config, monkeypatch):
    """The torn tail is zeroed only once its copy's directory entry is on disk: a power loss after the zeroing
    could otherwise keep the zeros and lose the copy. A failed directory fsync fails the open; nothing is cut."""
    from rocketstore import recovery
    from rocketstore.errors import FlushError

    small_config = small_config.replace(mapped_file_size_commit_log=1 << 16)
    _, _, torn, path, pos = store_with_a_last_record(tmp_path, small_config)
    with open(path, "r+b") as f:
        f.seek(pos + 8)
        f.write(torn[8:])
    crash(tmp_path)
    synced = []
    real = recovery.fsync_dir

    def failing(directory):
        synced.append(Path(directory))
        raise FlushError(5, f"fsync of directory {directory} failed: Input/output error")

    monkeypatch.setattr(recovery, "fsync_dir", failing)
    with pytest.raises(FlushError):
        MessageStore.open(tmp_path, small_config)
    assert synced == [tmp_path / "recovery"]
    assert path.read_bytes()[pos + 8 : pos + len(torn)] == torn[8:], "nothing is zeroed"
    monkeypatch.setattr(recovery, "fsync_dir", lambda directory: synced.append(Path(directory)) or real(directory))
    with MessageStore.open(tmp_path, small_config) as store:
        assert store.recovery.cut_bytes == len(torn)
        assert synced[1:3] == [tmp_path / "recovery", tmp_path]
    assert path.read_bytes()[pos : pos + len(torn)] == bytes(len(torn))


def consumed_sync_store(root: Path, config: StoreConfig, count: int) -> StoreConfig:
    """``count`` SYNC_FLUSH messages in topic T queue 0, all consumed by group G; returns the config used."""
    config = config.replace(flush_disk_type=FlushDiskType.SYNC_FLUSH)
    with MessageStore.open(root, config) as store:
        for i in range(count):
            store.put_message(Message("T", b"old-%03d" % i))
        store.wait_for_dispatch()
        store.commit_offset("G", "T", 0, count)
    return config


def test_a_log_that_lost_flushed_messages_says_so_and_consumers_skip_nothing_new(tmp_path, small_config, caplog):
    """A segment deleted by hand (or lost by a device): the open succeeded silently with 84 of 100 acknowledged
    messages, and a group committed at 100 then skipped the first 16 new messages (found in an audit). The
    report and an error now say flushed messages are missing, and offsets past a queue's end go back to it."""
    from rocketstore.checkpoint import StoreCheckpoint as Checkpoint

    config = consumed_sync_store(tmp_path, small_config, 100)
    flushed = Checkpoint.load(tmp_path / "checkpoint").physic_msg_timestamp
    sorted((tmp_path / "commitlog").iterdir())[-1].unlink()
    with MessageStore.open(tmp_path, config) as store:
        kept = store.get_max_offset_in_queue("T", 0)
        assert 0 < kept < 100 and store.recovery.missing_flushed_until == flushed
        assert any(r.levelname == "ERROR" and "flushed messages are missing" in r.getMessage() for r in caplog.records)
        assert store.query_offset("G", "T", 0) == kept
        for i in range(30):
            store.put_message(Message("T", b"new-%02d" % i))
        store.wait_for_dispatch()
        got = []
        with store.consumer("G", "T") as consumer:
            while batch := consumer.poll(timeout=0.2, max_msgs=100):
                got += [m.body for m in batch]
        assert got == [b"new-%02d" % i for i in range(30)]
    with MessageStore.open(tmp_path, config) as store:  # said once: the new messages are flushed and present
        assert store.recovery.missing_flushed_until == 0


def test_a_log_that_lost_every_segment_says_so_too(tmp_path, small_config):
    """A one-segment store whose segment is deleted is a log that lost every segment: the check returned early
    when no segment was left, and a group committed at 10 skipped the first 10 new messages (review)."""
    config = consumed_sync_store(tmp_path, small_config, 10)
    for segment in (tmp_path / "commitlog").iterdir():
        segment.unlink()
    with MessageStore.open(tmp_path, config) as store:
        assert store.recovery.missing_flushed_until > 0 and store.query_offset("G", "T", 0) == 0
        for i in range(5):
            store.put_message(Message("T", b"new-%d" % i))
        store.wait_for_dispatch()
        with store.consumer("G", "T") as consumer:
            assert [m.body for m in consumer.poll(timeout=1, max_msgs=100)] == [b"new-%d" % i for i in range(5)]


def test_offsets_past_a_queues_end_go_back_to_it_at_a_writer_open(tmp_path, small_config):
    """A consumer offsets file ahead of the log (it survived a power loss the log's unflushed tail did not, with
    the checkpoint not ahead) made the group skip as many new messages; a queue this store never had keeps
    whatever a broker's file says (review). After a clean close nothing was lost: an offset past the end was put
    there (an operator, a broker) and stays, as a broker leaves it until a pull (a refused reset-offset's open
    rewrote it)."""
    with MessageStore.open(tmp_path, small_config) as store:
        for i in range(10):
            store.put_message(Message("T", b"old-%d" % i))
        store.wait_for_dispatch()
        store.commit_offset("G", "T", 0, 15)
        store.commit_offset("G", "Elsewhere", 3, 42)
    with MessageStore.open(tmp_path, small_config) as store:
        assert store.query_offset("G", "T", 0) == 15
    (tmp_path / "abort").touch()  # the power loss: the store was open
    with MessageStore.open(tmp_path, small_config) as store:
        assert store.recovery.missing_flushed_until == 0
        assert store.query_offset("G", "T", 0) == 10 and store.query_offset("G", "Elsewhere", 3) == 42
        store.put_message(Message("T", b"new"))
        store.wait_for_dispatch()
        with store.consumer("G", "T") as consumer:
            assert [m.body for m in consumer.poll(timeout=1)] == [b"new"]


def damage_second_last_segment(tmp_path, small_config):
    with MessageStore.open(tmp_path, small_config) as store:
        results = fill(store, 120)
    last_segment = sorted((tmp_path / "commitlog").iterdir())[-1]
    start = int(last_segment.name)
    victims = [r for r in results if start - 4096 <= r.commit_log_offset < start]  # second-last segment
    victim = victims[len(victims) // 2]
    path, pos = segment_of(tmp_path, victim.commit_log_offset)
    with open(path, "r+b") as f:  # flip one body byte: the body CRC no longer matches
        f.seek(body_pos(path, pos) + 10)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    return results, victim, last_segment


def test_after_a_clean_exit_only_the_newest_segments_are_rechecked(tmp_path, small_config):
    """As in RocketMQ, a clean exit vouches for older segments: damage there is found by reads (and verify)."""
    results, victim, _ = damage_second_last_segment(tmp_path, small_config)
    with MessageStore.open(tmp_path, small_config) as store:
        assert store.recovery.end_offset == results[-1].commit_log_offset + results[-1].store_size
        with pytest.raises(ChecksumError):
            store.look_message_by_offset(victim.commit_log_offset)


def test_after_a_crash_a_damaged_record_ends_the_log_and_later_segments_are_moved_aside(tmp_path, small_config):
    results, victim, last_segment = damage_second_last_segment(tmp_path, small_config)
    crash(tmp_path)
    with MessageStore.open(tmp_path, small_config) as store:
        report = store.recovery
        assert report.end_offset == victim.commit_log_offset
        assert "CRC" in report.stop_reason
        kept = [r for r in results if r.commit_log_offset < victim.commit_log_offset]
        for r in kept:
            assert store.look_message_by_offset(r.commit_log_offset).msg_id == r.msg_id
        assert sum(1 for _ in store.iter_messages()) == len(kept)
        moved = [p for p in report.salvaged if p.endswith(".segment")]
        assert moved and Path(moved[0]).stat().st_size == 4096
        assert not last_segment.exists()
        with pytest.raises(OffsetOutOfRangeError):  # the damaged record is no longer part of the log
            store.look_message_by_offset(victim.commit_log_offset)


def test_checksum_failure_on_read_is_reported_not_returned(tmp_path, small_config):
    with MessageStore.open(tmp_path, small_config) as store:
        r = fill(store, 3)[1]
        path, pos = segment_of(tmp_path, r.commit_log_offset)
        store.commit_log.mapped_files.find(r.commit_log_offset).buffer[body_pos(path, pos) + 5] ^= 0x01
        with pytest.raises(ChecksumError) as info:
            store.look_message_by_offset(r.commit_log_offset)
        assert info.value.offset == r.commit_log_offset and info.value.path == str(path)


def test_abnormal_recovery_starts_at_the_checkpoint_safe_segment(tmp_path, small_config):
    with MessageStore.open(tmp_path, small_config) as store:
        fill(store, 200)
    checkpoint = StoreCheckpoint.load(tmp_path / "checkpoint")
    checkpoint.physic_msg_timestamp += 10_000  # as if flushed 10 s after the last put
    checkpoint.logics_msg_timestamp = checkpoint.physic_msg_timestamp
    checkpoint.flush()
    crash(tmp_path)
    with MessageStore.open(tmp_path, small_config) as store:
        assert store.recovery.abnormal and store.recovery.start_offset > 0
        assert sum(1 for _ in store.iter_messages()) == 200


def test_damaged_checkpoint_is_not_trusted(tmp_path, small_config):
    with MessageStore.open(tmp_path, small_config) as store:
        fill(store, 200)
    raw = bytearray((tmp_path / "checkpoint").read_bytes())
    raw[3] ^= 0x40
    (tmp_path / "checkpoint").write_bytes(bytes(raw))
    crash(tmp_path)
    with MessageStore.open(tmp_path, small_config) as store:
        assert not store.checkpoint.trusted
        assert store.recovery.start_offset == 0
        assert sum(1 for _ in store.iter_messages()) == 200


def test_checkpoint_layout_matches_rocketmq(tmp_path):
    """Spec E10: the five i64 fields at 0/8/16/24/32; RocketMQ ignores rocketstore's seal after them."""
    cp = StoreCheckpoint(tmp_path / "checkpoint", physic_msg_timestamp=1700000000123,
                         logics_msg_timestamp=1700000000100, index_msg_timestamp=1699999990000,
                         confirm_phy_offset=128)
    cp.flush()
    data = (tmp_path / "checkpoint").read_bytes()
    assert len(data) == 4096
    assert data[:40].hex() == ("0000018bcfe5687b" "0000018bcfe56864" "0000018bcfe540f0" "0000000000000000"
                               "0000000000000080")
    assert data[40:44] == b"RSCK" and data[48:] == bytes(4048)
    (tmp_path / "checkpoint").write_bytes(data[:40] + bytes(4056))  # as RocketMQ writes it: no seal
    loaded = StoreCheckpoint.load(tmp_path / "checkpoint")
    assert loaded.trusted and loaded.confirm_phy_offset == 128 and loaded.min_timestamp == 1700000000100 - 3000


def test_zero_length_last_segment_is_dropped_and_stale_temp_files_removed(tmp_path, small_config):
    with MessageStore.open(tmp_path, small_config) as store:
        fill(store, 10)
        end = store.max_phy_offset
    (tmp_path / "commitlog" / f"{8192 * 4:020d}").write_bytes(b"")
    (tmp_path / "commitlog" / "00000000000000040960.tmp").write_bytes(b"partial")
    with MessageStore.open(tmp_path, small_config) as store:
        assert store.max_phy_offset == end
    assert sorted(p.name for p in (tmp_path / "commitlog").iterdir())[-1].isdigit()
    assert not list((tmp_path / "commitlog").glob("*.tmp"))


def test_segment_of_wrong_size_or_missing_segment_refuses_to_open(tmp_path, small_config):
    with MessageStore.open(tmp_path, small_config) as store:
        fill(store, 100)
    files = sorted((tmp_path / "commitlog").iterdir())
    with pytest.raises(CorruptDataError, match="configured size"):
        MessageStore.open(tmp_path, small_config.replace(mapped_file_size_commit_log=8192))
    files[1].unlink()
    with pytest.raises(CorruptDataError, match="missing"):
        MessageStore.open(tmp_path, small_config)
    assert not (tmp_path / "lock").exists() or MessageStore.open(tmp_path / "other", small_config).close() is None


def copy_vector_store(vectors: Path, name: str, root: Path) -> Path:
    (root / "commitlog").mkdir(parents=True)
    shutil.copy(vectors / name / "00000000000000000000", root / "commitlog" / "00000000000000000000")
    (root / "commitlog" / "00000000000000000000").chmod(0o644)
    return root


def test_store_rooted_on_rocketmq_commit_log_opens_and_reads(vectors, tmp_path):
    root = copy_vector_store(vectors, "v4_commitlog", tmp_path / "store")
    expected = [json.loads(line) for line in (vectors / "v4_commitlog" / "decode.jsonl").read_text().splitlines()]
    config = StoreConfig(mapped_file_size_commit_log=8192, max_hash_slot_num=97, max_index_num=500)
    for read_only in (True, False):
        with MessageStore.open(root, config, read_only=read_only) as store:
            got = list(store.iter_messages())
            assert [m.commit_log_offset for m in got] == [e["pos"] for e in expected if "msgId" in e]
            for e, m in zip(expected, got, strict=False):
                assert (m.msg_id, m.topic, m.queue_offset, m.properties) == (e["msgId"], e["topic"], e["queueOffset"],
                                                                             e["properties"])
                assert store.look_message_by_offset(e["pos"]).store_timestamp == e["storeTimestamp"]
            if not read_only:  # a writer dispatches the foreign log into consume queues first
                assert store.next_queue_offset("TopicTest", 0) == 2 and store.next_queue_offset("TopicTest", 3) == 18
    with MessageStore.open(root, config) as store:  # as RocketMQ would: the last segment's BLANK is overwritten
        assert store.recovery.salvaged == [] and store.recovery.stop_reason is None
        r = store.put_message(Message("TopicTest", b"from rocketstore"))
        assert r.commit_log_offset == 1650 and r.queue_offset == 2
    with MessageStore.open(root, config, read_only=True) as store:
        assert [m.body for m in store.iter_messages()][-1] == b"from rocketstore"


def test_damaged_rocketmq_commit_log_recovers_the_valid_prefix(vectors, tmp_path):
    root = copy_vector_store(vectors, "v6_commitlog_corrupt", tmp_path / "store")
    original = (root / "commitlog" / "00000000000000000000").read_bytes()
    config = StoreConfig(mapped_file_size_commit_log=8192, max_hash_slot_num=97, max_index_num=500)
    with MessageStore.open(root, config, read_only=True) as store:
        assert store.recovery.end_offset == 184 and "past the record end" in store.recovery.stop_reason
        assert [m.commit_log_offset for m in store.iter_messages()] == [0]
    assert (root / "commitlog" / "00000000000000000000").read_bytes() == original
    crash(root)
    with MessageStore.open(root, config) as store:
        assert store.recovery.end_offset == 184
        tail = Path(next(p for p in store.recovery.salvaged if p.endswith(".tail")))
        assert original[184:].rstrip(b"\0") == tail.read_bytes()
        r = store.put_message(Message("TopicTest", b"next"))
        assert r.commit_log_offset == 184
    data = (root / "commitlog" / "00000000000000000000").read_bytes()
    assert decode_record(data, 184).body == b"next" and data[184 + r.store_size :] == bytes(8192 - 184 - r.store_size)


def test_property_crc_is_written_verified_and_catches_damaged_properties(tmp_path):
    config = StoreConfig(mapped_file_size_commit_log=1 << 16, max_hash_slot_num=97, max_index_num=500,
                         enabled_append_prop_crc=True,
                         force_verify_prop_crc=True)
    with MessageStore.open(tmp_path, config) as store:
        results = [store.put_message(Message("T", f"body {i}".encode(), keys=[f"k{i}"])) for i in range(10)]
        raw = store.commit_log.get_record_bytes(results[0].commit_log_offset)
        assert raw[-20:-11] == b"__CRC32#\x01" and raw[-1:] == b"\x02"
        assert "__CRC32#" in store.look_message_by_offset(results[0].commit_log_offset).properties
    victim = results[6]
    path, pos = segment_of(tmp_path, victim.commit_log_offset, 1 << 16)
    layout = read_layout(path.read_bytes(), pos)
    with open(path, "r+b") as f:  # damage a KEYS byte: the body CRC cannot see it, the record CRC can
        f.seek(layout.props_pos + 6)
        f.write(b"Z")
    crash(tmp_path)
    with MessageStore.open(tmp_path, config) as store:
        assert store.recovery.end_offset == victim.commit_log_offset
        assert "__CRC32#" in store.recovery.stop_reason


def test_following_the_log_end_finds_what_a_recovery_finds_walking_only_the_new_records(tmp_path, monkeypatch):
    """``follow_log_end``: a tail follower's next end (a stream's trigger) from the last one, into new segments
    past a closing blank, stopping before a record still being written; None once its segment is gone."""
    from rocketstore.commitlog import CommitLog
    from rocketstore.recovery import follow_log_end, recover_commit_log

    config = StoreConfig(mapped_file_size_commit_log=4096)
    root = tmp_path / "s"

    def recovered_end() -> int:
        log = CommitLog(root, config, read_only=True)
        log.load()
        try:
            return recover_commit_log(log, StoreCheckpoint.load(root / "checkpoint", read_only=True), root,
                                      abnormal=False).end_offset
        finally:
            log.close()

    def followed(known: int) -> int | None:
        log = CommitLog(root, config, read_only=True)
        log.load()
        try:
            return follow_log_end(log, known)
        finally:
            log.close()

    with MessageStore.open(root, config) as store:
        for i in range(10):
            store.put_message(Message("T", b"x" * 100, keys=[f"k{i}"]))
        first = recovered_end()
        assert followed(first) == first  # nothing new
        for i in range(60):  # across several segments
            store.put_message(Message("T", b"y" * 150, keys=[f"n{i}"]))
        later = recovered_end()
        assert later > 3 * 4096 and followed(first) == later
        last = store.put_message(Message("T", b"z" * 80))
    end = last.commit_log_offset + last.store_size
    assert followed(later) == end == recovered_end()
    segment = root / "commitlog" / f"{end - end % 4096:020d}"
    data = bytearray(segment.read_bytes())
    torn = end % 4096
    data[torn + 4 : torn + 120] = b"\x01" * 116  # a record's body written, its first 8 bytes not yet (the commit point)
    segment.write_bytes(bytes(data))
    assert followed(later) == end, "a record still being written is not part of the log yet"
    assert followed(10 * 4096 * 1000) is None


LAGGING_WRITER = """
import os, signal, sys
from rocketstore import Message, MessageStore, StoreConfig
store = MessageStore.open(sys.argv[1], StoreConfig(mapped_file_size_commit_log=1 << 20))
for i in range(100):
    store.put_message(Message("T", b"x", keys=[f"k{i}"]))
store.wait_for_dispatch()
store.dispatcher.dispatch_available = lambda: 0  # dispatch stops here (it may lag up to 16 MB)
for i in range(100, 150):
    store.put_message(Message("T", b"x", keys=[f"k{i}"]))
store.flush()
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_read_only_open_of_a_dead_writer_whose_dispatch_lagged_says_what_it_cannot_find(tmp_path, caplog):
    """A writer killed while dispatch was behind (allowed up to 16 MB): a read-only open cannot dispatch, so the last
    messages were silently missing from queue and key reads (the CLI's query commands open read-only on a dead
    broker's disk). It now says so; a writer's open dispatches them."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", LAGGING_WRITER, str(tmp_path)], capture_output=True, timeout=120,
                          check=False)
    assert done.returncode == -9, done.stderr.decode()[-2000:]
    config = StoreConfig(mapped_file_size_commit_log=1 << 20)
    with MessageStore.open(tmp_path, config, read_only=True) as store:
        assert store.get_max_offset_in_queue("T", 0) == 100
        assert sum(1 for _ in store.iter_messages()) == 150
        assert [m.body for m in store.query_message("T", "k149")]  # the undispatched tail, indexed in memory
    assert "the consume queues and the index end at commit-log offset" in caplog.text
    with MessageStore.open(tmp_path, config) as store:
        store.wait_for_dispatch()
        assert store.get_max_offset_in_queue("T", 0) == 150 and store.query_message("T", "k149")


def test_delivery_offsets_past_their_queues_go_back_at_a_writer_open(tmp_path, small_config):
    """delayOffset.json and timerOffset.json are saved every few seconds, the log's tail under ASYNC_FLUSH later:
    after a power loss they can be ahead of the SCHEDULE and timer queues, and the delayed and timer messages put
    after the restart below them were never delivered (the review; RocketMQ's correctDelayOffset). A consumer
    offset of a queue a known topic lost whole goes back to 0 too."""
    config = small_config.replace(message_delay_level="1s 2s")
    with MessageStore.open(tmp_path, config) as store:
        store.put_message(Message("Late", b"before"))
        store.create_topic("Fresh", 2)
        store.wait_for_dispatch()
        store.delay_offsets.set(1, 5)  # what the lost run had delivered
        store.timer_offsets.set_progress(5, {6, 7})
        store.commit_offset("G", "Fresh", 1, 4)
    (tmp_path / "abort").touch()  # the power loss: the store was open
    with MessageStore.open(tmp_path, config) as store:
        assert store.delay_offsets.get(1) == 0 and store.timer_offsets.get(0) == 0
        assert not store.timer_offsets.delivered_above() and store.query_offset("G", "Fresh", 1) == 0
        for i in range(3):
            store.put_message(Message("Late", b"d%d" % i, properties={"DELAY": "1"}))
            store.put_message(Message("Late", b"t%d" % i, properties={"TIMER_DELAY_MS": "300"}))
        store.put_message(Message("Fresh", b"f0", queue_id=1))
        deadline = time.monotonic() + 10
        want = sorted([b"before"] + [b"d%d" % i for i in range(3)] + [b"t%d" % i for i in range(3)])
        while time.monotonic() < deadline:
            store.wait_for_dispatch()
            got = sorted(m.body for q in store.queue_ids("Late") for m in store.get_message("Late", q, 0).messages)
            if got == want:
                break
            time.sleep(0.1)
        assert got == want
        with store.consumer("G", "Fresh") as consumer:
            assert [m.body for m in consumer.poll(timeout=2)] == [b"f0"]


def test_a_roll_killed_before_the_new_index_files_header_is_written_indexes_nothing_twice(tmp_path, small_config):
    """A SIGKILL between the rolled index file's creation (zeros, linked into index/) and the header it inherits
    left a newest file whose endPhyOffset is 0: the next open dispatched the whole log into it again (2 -> ~4
    entries per message, 3.995 seen) and, until then, a time-bounded key lookup stopped at its begin time 0."""
    from rocketstore.index.file import index_file_size
    from rocketstore.index.service import index_file_name, index_name_ms

    with MessageStore.open(tmp_path, small_config) as store:
        n = 0
        while not (len(store.index.files) >= 2 and store.index.files[-1].is_write_full()):
            store.put_message(Message("T", b"x" * 60, keys=[f"k{n}"]))
            store.wait_for_dispatch()
            n += 1
        newest = store.index.files[-1].path.name
    # what the kill leaves: the next file made and named, zero-filled, its inherited header never written
    zero = tmp_path / "index" / index_file_name(index_name_ms(newest) + 1)
    zero.write_bytes(bytes(index_file_size(small_config.max_hash_slot_num, small_config.max_index_num)))
    crash(tmp_path)
    start = int(time.time() * 1000) - 3_600_000
    with MessageStore.open(tmp_path, small_config, read_only=True) as reader:
        assert [m.keys for m in reader.query_message("T", "k0", begin=start)] == [["k0"]]
    with MessageStore.open(tmp_path, small_config) as store:
        entries = sum(index.index_count - 1 for index in store.index.files)  # UNIQ_KEY and one key each
        assert 2 * n <= entries <= 2 * n + 2  # (+2: an abnormal open puts the last indexed record's keys again)
        assert [m.keys for m in store.query_message("T", "k0", begin=start)] == [["k0"]]
        store.put_message(Message("T", b"y", keys=["after"]))
        store.wait_for_dispatch()
        assert [m.keys for m in store.query_message("T", "after")] == [["after"]]
        assert sum(index.index_count - 1 for index in store.index.files) == entries + 2

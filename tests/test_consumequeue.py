"""Consume queues and getMessage: unit bytes, file naming, statuses, tag filters, time lookups."""

from __future__ import annotations

import random
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rocketstore import Message, MessageStore, StoreConfig
from rocketstore.codec import java_string_hash
from rocketstore.consumequeue import CQ_UNIT_SIZE, ConsumeQueue
from rocketstore.errors import InvalidQueryError, InvalidTopicError, StoreClosedError
from rocketstore.reads import GetMessageStatus


def test_unit_bytes_and_file_positions_follow_the_spec(tmp_path):
    """Spec E3: unit layout, and queue offset -> (file, position) for 6,000,000-byte files."""
    queue = ConsumeQueue(tmp_path, "TopicTest", 0, StoreConfig())
    assert queue.put_position(0, 128, java_string_hash("TagA"), 0)
    data = (tmp_path / "consumequeue" / "TopicTest" / "0" / "00000000000000000000").read_bytes()
    assert data[:20].hex() == "0000000000000000" "00000080" "000000000027a807"
    for q, name, pos in [(12345, 0, 246900), (300000, 6000000, 0), (1234567, 24000000, 691340)]:
        logical = q * CQ_UNIT_SIZE
        assert (logical - logical % 6_000_000, logical % 6_000_000) == (name, pos)
    queue.close()


def test_queue_files_roll_by_logical_offset(tmp_path, small_config):
    with MessageStore.open(tmp_path, small_config) as store:
        results = [store.put_message(Message("T", b"x" * 10, queue_id=2)) for _ in range(120)]
        store.wait_for_dispatch()
        assert store.get_max_offset_in_queue("T", 2) == 120 and store.get_min_offset_in_queue("T", 2) == 0
    files = sorted((tmp_path / "consumequeue" / "T" / "2").iterdir())
    assert [f.name for f in files] == [f"{i * 1000:020d}" for i in range(3)]  # 50 units per 1000-byte file
    unit = files[1].read_bytes()[0:20]
    assert int.from_bytes(unit[:8], "big") == results[50].commit_log_offset
    assert int.from_bytes(unit[8:12], "big") == results[50].store_size


def put_tagged(store: MessageStore, count: int, queue_id: int = 0) -> list:
    return [store.put_message(Message("T", f"m{i}".encode(), tags=f"Tag{i % 3}", queue_id=queue_id))
            for i in range(count)]


def test_get_message_statuses_at_every_boundary(tmp_path, small_config):
    with MessageStore.open(tmp_path, small_config) as store:
        put_tagged(store, 10)
        store.wait_for_dispatch()
        r = store.get_message("Unknown", 0, 0)
        assert (r.status, r.next_begin_offset) == (GetMessageStatus.NO_MESSAGE_IN_QUEUE, 0)
        r = store.get_message("T", 0, 10)
        assert (r.status, r.next_begin_offset, r.min_offset, r.max_offset) == (
            GetMessageStatus.OFFSET_OVERFLOW_ONE, 10, 0, 10)
        r = store.get_message("T", 0, 11)
        assert (r.status, r.next_begin_offset) == (GetMessageStatus.OFFSET_OVERFLOW_BADLY, 10)
        r = store.get_message("T", 0, 0, max_msgs=4)
        assert r.status is GetMessageStatus.FOUND and [m.queue_offset for m in r.messages] == [0, 1, 2, 3]
        assert r.next_begin_offset == 4
        r = store.get_message("T", 0, 8, max_msgs=32)
        assert [m.body for m in r.messages] == [b"m8", b"m9"] and r.next_begin_offset == 10
        r = store.get_message("T", 0, 0, tags="Tag1 || Tag2")
        assert [m.queue_offset for m in r.messages] == [1, 2, 4, 5, 7, 8]
        r = store.get_message("T", 0, 0, tags="Nope")
        assert (r.status, r.next_begin_offset) == (GetMessageStatus.NO_MATCHED_MESSAGE, 10)
        assert [m.queue_offset for m in store.get_message("T", 0, 0, tags="*").messages] == list(range(10))


def test_tag_subscriptions_read_as_rocketmqs_filter_api_reads_them(tmp_path, small_config):
    """FilterAPI.buildSubscriptionData: only None, "" or exactly "*" is every tag; otherwise the trimmed pieces
    between "||" are tags taken literally, and nothing but "||" is refused. "A || *", " * " and " || " were all
    read as every message."""
    from rocketstore.reads import parse_tags
    from rocketstore.sqlfilter import InvalidFilterError

    readings = {None: None, "": None, "*": None, "A || *": {"A", "*"}, " * ": {"*"}, " || ": set(), "A||": {"A"},
                "|| A ||": {"A"}, "|||": {"|"}, "A | B": {"A | B"}, "\x01A\x1f||\u3000": {"A", "\u3000"},
                ("*",): {"*"}, (): set(), (" A ", "", "B"): {"A", "B"}}  # String.trim: up to U+0020 only
    for tags, expected in readings.items():
        assert parse_tags(tags) == expected, tags
    for refused in ("||", "||||"):
        with pytest.raises(InvalidFilterError, match="split error"):
            parse_tags(refused)
    with pytest.raises(InvalidQueryError, match="iterable of tags"):
        parse_tags(["A", 5])

    with MessageStore.open(tmp_path, small_config) as store:
        for i, tag in enumerate(["A", "B", "*", None, "A"]):
            store.put_message(Message("T", b"m%d" % i, tags=tag, queue_id=0))
        store.wait_for_dispatch()

        def offsets(tags) -> list[int]:
            return [m.queue_offset for m in store.get_message("T", 0, 0, 32, tags).messages]

        assert offsets("A || *") == [0, 2, 4] and offsets(" * ") == [2]
        assert offsets("*") == offsets("") == offsets(None) == [0, 1, 2, 3, 4]
        r = store.get_message("T", 0, 0, 32, " || ")
        assert (r.status, r.messages, r.next_begin_offset) == (GetMessageStatus.NO_MATCHED_MESSAGE, [], 5)
        with pytest.raises(InvalidFilterError):
            store.get_message("T", 0, 0, 32, "||")
        for tags, expected in (("A || *", [b"m0", b"m2", b"m4"]), (" || ", [])):
            with store.consumer("G" + str(len(expected)), "T", tags=tags) as consumer:
                assert [m.body for m in consumer.poll(timeout=0.2)] == expected, tags


def test_offset_too_small_and_message_was_removing_after_retention(tmp_path, small_config):
    config = small_config.replace(file_reserved_time=0)
    with MessageStore.open(tmp_path, config) as store:
        results = [store.put_message(Message("T", b"y" * 300, keys=[f"k{i}"])) for i in range(60)]
        store.wait_for_dispatch()
        report = store.delete_expired_files(immediately=True)
        assert report.commit_log_files and store.min_phy_offset > 0
        low = store.get_min_offset_in_queue("T", 0)
        assert low > 0 and results[low].commit_log_offset >= store.min_phy_offset > results[low - 1].commit_log_offset
        r = store.get_message("T", 0, 0)
        assert (r.status, r.next_begin_offset) == (GetMessageStatus.OFFSET_TOO_SMALL, low)
        assert store.get_message("T", 0, low).messages[0].commit_log_offset == results[low].commit_log_offset
        assert store.query_message("T", "k0") == [] and len(store.query_message("T", "k59")) == 1
        assert len(list((tmp_path / "consumequeue" / "T" / "0").iterdir())) >= 1


def test_a_queue_units_offset_time_and_total_as_rocketmqs_store_answers(tmp_path, small_config):
    """``getCommitLogOffsetInQueue`` (0 when none), ``getMessageStoreTimeStamp`` (-1 when none) and
    ``getMessageTotalInQueue`` (-1 for no queue): the semantics review found them missing."""
    config = small_config.replace(file_reserved_time=0)
    with MessageStore.open(tmp_path, config) as store:
        results = [store.put_message(Message("T", b"y" * 300, queue_id=i % 2)) for i in range(60)]
        store.wait_for_dispatch()
        queue0 = results[::2]
        assert store.get_message_total_in_queue("T", 0) == 30 == store.get_message_total_in_queue("T", 1)
        assert store.get_message_total_in_queue("T", 7) == store.get_message_total_in_queue("Nope", 0) == -1
        for r in queue0:
            assert store.get_commit_log_offset_in_queue("T", 0, r.queue_offset) == r.commit_log_offset
            assert store.get_message_store_timestamp("T", 0, r.queue_offset) == r.store_timestamp
        for offset in (-1, 30, 10 ** 12):
            assert store.get_commit_log_offset_in_queue("T", 0, offset) == 0
            assert store.get_message_store_timestamp("T", 0, offset) == -1
        assert store.get_message_store_timestamp("Nope", 0, 0) == -1
        store.delete_expired_files(immediately=True)
        low = store.get_min_offset_in_queue("T", 0)
        assert 0 < low < 30 and store.get_message_total_in_queue("T", 0) == 30 - low
        assert store.get_commit_log_offset_in_queue("T", 0, low - 1) == 0  # expired: as ConsumeQueue.get's null
        assert store.get_message_store_timestamp("T", 0, low - 1) == -1
        assert store.get_message_store_timestamp("T", 0, low) == queue0[low].store_timestamp
        for call in (lambda: store.get_commit_log_offset_in_queue("T", 0, 1.5),
                     lambda: store.get_message_store_timestamp("T", "0", 0),
                     lambda: store.get_message_total_in_queue(5, 0)):
            with pytest.raises(InvalidQueryError):
                call()
    with pytest.raises(StoreClosedError):
        store.get_message_total_in_queue("T", 0)


def test_tag_filter_checks_real_tags_not_only_hash_codes(tmp_path, small_config):
    """"Aa" and "BB" share a tags code; RocketMQ's store would return both."""
    with MessageStore.open(tmp_path, small_config) as store:
        store.put_message(Message("T", b"1", tags="Aa"))
        store.put_message(Message("T", b"2", tags="BB"))
        store.wait_for_dispatch()
        assert [m.body for m in store.get_message("T", 0, 0, tags="Aa").messages] == [b"1"]


def test_transaction_and_delay_dispatch(tmp_path, small_config):
    with MessageStore.open(tmp_path, small_config) as store:
        prepared = store.put_message(Message("Tx", b"half", keys=["tx"], sys_flag=0x4))
        store.put_message(Message("Tx", b"rolled back", keys=["rb"], sys_flag=0xC))
        delayed = store.put_message(Message("Later", b"later", keys=["d"], properties={"DELAY": "3"}))
        clamped = store.put_message(Message("Later", b"much later", properties={"DELAY": "99"}))
        with pytest.raises(InvalidTopicError, match="system topic"):  # a stray record would stall level 3
            store.put_message(Message("SCHEDULE_TOPIC_XXXX", b"sent", queue_id=2, properties={"DELAY": "18"}))
        store.wait_for_dispatch()
        assert store.get_max_offset_in_queue("Tx", 0) == 0, "prepared and rollback records stay out of queues"
        assert [m.commit_log_offset for m in store.query_message("Tx", "tx")] == [prepared.commit_log_offset]
        assert store.query_message("Tx", "rb") == [], "rollback records are not indexed"
        queue = store.queues.get("SCHEDULE_TOPIC_XXXX", 2)
        assert queue.get_unit(0)[2] == delayed.store_timestamp + 10_000 and queue.max_offset_in_queue == 1
        last = store.queues.get("SCHEDULE_TOPIC_XXXX", len(small_config.delay_levels_ms) - 1)
        assert last.get_unit(0)[2] == clamped.store_timestamp + 7_200_000


def brute_force(times: list[int], ts: int, upper: bool) -> int:
    if upper:
        hits = [i for i, t in enumerate(times) if t <= ts]
        return hits[-1] if hits else 0
    hits = [i for i, t in enumerate(times) if t >= ts]
    return hits[0] if hits else len(times)


def test_offset_by_time_spec_e9(tmp_path):
    queue = ConsumeQueue(tmp_path, "T", 0, StoreConfig(mapped_file_size_consume_queue=200))
    times = [1000, 1000, 1000, 3000, 3000]
    for q in range(5):
        queue.put_position(q * 100, 100, 0, q)
    lookup = lambda offset, size: times[offset // 100]  # noqa: E731
    expected = {500: (0, 0), 1000: (0, 2), 2000: (3, 2), 3000: (3, 4), 4000: (5, 4)}
    for ts, (lower, upper) in expected.items():
        assert queue.offset_by_time(ts, False, lookup, 0) == lower, ts
        assert queue.offset_by_time(ts, True, lookup, 0) == upper, ts
    queue.close()


@pytest.mark.parametrize("seed", range(3))
def test_offset_by_time_matches_brute_force_across_files(tmp_path, seed):
    rng = random.Random(seed)
    queue = ConsumeQueue(tmp_path / str(seed), "T", 0, StoreConfig(mapped_file_size_consume_queue=20 * 7))
    times, t = [], 10_000
    for q in range(rng.randint(1, 60)):
        t += rng.choice([0, 0, 1, 5, 1000])
        times.append(t)
        queue.put_position(q * 100, 100, 0, q)
    lookup = lambda offset, size: times[offset // 100]  # noqa: E731
    for ts in sorted({x + d for x in times for d in (-1, 0, 1)} | {0, 10**15}):
        for upper in (False, True):
            assert queue.offset_by_time(ts, upper, lookup, 0) == brute_force(times, ts, upper), (ts, upper)
    queue.close()


def test_store_offset_by_time_and_earliest_time(tmp_path, small_config):
    with MessageStore.open(tmp_path, small_config) as store:
        results = put_tagged(store, 30, queue_id=1)
        store.wait_for_dispatch()
        times = [r.store_timestamp for r in results]
        for ts in (times[0] - 1, times[0], times[12], times[-1], times[-1] + 1):
            assert store.get_offset_in_queue_by_time("T", 1, ts) == brute_force(times, ts, False)
            assert store.get_offset_in_queue_by_time("T", 1, ts, "upper") == brute_force(times, ts, True)
        assert store.get_earliest_message_time("T", 1) == times[0]
        assert store.get_earliest_message_time() == times[0]
        assert store.get_earliest_message_time("T", 9) == -1
        # a topic alone answered its queue 0's time (-1 here: the messages are in queue 1); a queue id alone, the
        # whole store's (the time-semantics review)
        later = store.put_message(Message("T", b"later", queue_id=0))
        store.wait_for_dispatch()
        assert store.get_earliest_message_time("T", 0) == later.store_timestamp
        assert store.get_earliest_message_time("T") == times[0]
        assert store.get_earliest_message_time("Nope") == -1
        with pytest.raises(InvalidQueryError, match="needs its topic"):
            store.get_earliest_message_time(None, 0)
        with pytest.raises(ValueError):
            store.get_offset_in_queue_by_time("T", 1, 0, "middle")


def test_truncate_dirty_and_recover(tmp_path):
    config = StoreConfig(mapped_file_size_consume_queue=20 * 4)
    queue = ConsumeQueue(tmp_path, "T", 0, config)
    for q in range(10):
        queue.put_position(q * 100, 100, 7, q)
    queue.truncate_dirty(650)  # units whose record starts at >= 650 go
    assert queue.max_offset_in_queue == 7 and queue.max_physic_offset == 700
    assert not queue.put_position(600, 100, 7, 6), "a re-dispatch is absorbed"
    assert queue.put_position(700, 100, 7, 7)
    queue.close()
    again = ConsumeQueue(tmp_path, "T", 0, config)
    again.load()
    again.recover()
    assert again.max_offset_in_queue == 8 and again.max_physic_offset == 800
    again.close()


@pytest.mark.parametrize("present", [0, 1, 5, 12])
def test_a_run_that_repeats_written_units_writes_only_the_new_ones(tmp_path, present):
    """``put_run`` (a dispatch round's units of one queue, a whole run at a time) after a crash re-dispatches
    records the queue already has: it writes the same bytes ``put_position`` would, unit by unit, rolling
    files, and skips what is there."""
    import numpy as np

    config = StoreConfig(mapped_file_size_consume_queue=20 * 4)
    offsets, phys = np.arange(12, dtype=np.int64), np.arange(12, dtype=np.int64) * 100
    sizes, tags = np.full(12, 100, dtype=np.int64), np.arange(12, dtype=np.int64) * 7
    batch, single = ConsumeQueue(tmp_path / "run", "T", 0, config), ConsumeQueue(tmp_path / "one", "T", 0, config)
    for queue in (batch, single):
        for q in range(present):
            queue.put_position(q * 100, 100, q * 7, q)
    assert batch.put_run(offsets, phys, sizes, tags) == 12 - present
    assert batch.put_run(offsets, phys, sizes, tags) == 0, "all of it is there now"
    for q in range(present, 12):
        single.put_position(q * 100, 100, q * 7, q)
    assert batch.max_offset_in_queue == single.max_offset_in_queue == 12
    assert batch.max_physic_offset == single.max_physic_offset == 1200
    batch.close()
    single.close()
    files = [sorted((tmp_path / side / "consumequeue" / "T" / "0").iterdir()) for side in ("run", "one")]
    assert [f.name for f in files[0]] == [f.name for f in files[1]] and len(files[0]) == 3
    assert [f.read_bytes() for f in files[0]] == [f.read_bytes() for f in files[1]]


def test_put_positions_continues_a_queue_in_compiled_runs_with_the_same_bytes(tmp_path, monkeypatch):
    """A rebuild's windows after the first continue queues that have files: ``put_positions`` writes them as
    ``put_run``'s runs (the unit-by-unit loop it used took 6 us a unit), the bytes ``put_position`` writes."""
    import numpy as np

    config = StoreConfig(mapped_file_size_consume_queue=20 * 64)
    offsets = np.arange(1000, dtype=np.int64)
    phys, sizes, tags = offsets * 100, np.full(1000, 100, dtype=np.int32), offsets * 7 - 3
    windowed, single = ConsumeQueue(tmp_path / "w", "T", 0, config), ConsumeQueue(tmp_path / "s", "T", 0, config)
    one_by_one = []
    put_position = ConsumeQueue.put_position
    monkeypatch.setattr(ConsumeQueue, "put_position", lambda self, *a: one_by_one.append(a) or put_position(self, *a))
    for lo, hi in ((0, 300), (300, 301), (301, 777), (777, 1000)):  # the first window, then continuing ones
        assert windowed.put_positions(offsets[lo:hi], phys[lo:hi], sizes[lo:hi], tags[lo:hi]) == hi - lo
    assert windowed.put_positions(offsets[500:600], phys[500:600], sizes[500:600], tags[500:600]) == 0
    assert len(one_by_one) <= 20, "only units at a file's start go one by one"
    for q in range(1000):
        single.put_position(int(phys[q]), int(sizes[q]), int(tags[q]), q)
    windowed.close()
    single.close()
    files = [sorted((tmp_path / side / "consumequeue" / "T" / "0").iterdir()) for side in ("w", "s")]
    assert [f.name for f in files[0]] == [f.name for f in files[1]] and len(files[0]) == 16
    assert [f.read_bytes() for f in files[0]] == [f.read_bytes() for f in files[1]]


def test_queue_starting_past_zero_is_padded_with_pre_blank_units(tmp_path):
    queue = ConsumeQueue(tmp_path, "T", 3, StoreConfig(mapped_file_size_consume_queue=20 * 10))
    assert queue.put_position(500, 50, 0, 17)
    assert queue.min_offset_in_queue == 17 and queue.max_offset_in_queue == 18
    data = (tmp_path / "consumequeue" / "T" / "3" / f"{20 * 10:020d}").read_bytes()
    assert data[:20] == (0).to_bytes(8, "big") + (0x7FFFFFFF).to_bytes(4, "big") + bytes(8)
    queue.close()


_WRITE_ORDER_PROBE = """
import json
import numpy as np
from rocketstore.codec._kernels import put_queue_units
log = []
class Recording(np.ndarray):
    def __setitem__(self, index, value):
        log.append((int(index), int(value)))
        super().__setitem__(index, value)
buf = np.zeros(100, np.uint8).view(Recording)
put = put_queue_units(buf, 20, 4, np.array([5, 6, 7, 9]), np.array([1 << 40, 200, 300, 400]),
                      np.array([50, 60, 70, 80]), np.array([-1, 2, 3, 4]), 0)
print(json.dumps({"put": put, "log": log, "bytes": np.asarray(buf).tobytes().hex()}))
"""


def test_queue_units_get_their_sizes_after_everything_else():
    """A kill in the middle of a run of units must leave no unit with a size but a torn offset or tags code: the
    kernel writes every unit's offset and tags (size 0) first, then the sizes. Run as plain Python (numba's JIT
    off) over an array that records each byte store in order."""
    import json
    import os
    import struct
    import subprocess
    import sys

    env = {**os.environ, "NUMBA_DISABLE_JIT": "1"}
    out = subprocess.run([sys.executable, "-c", _WRITE_ORDER_PROBE], env=env, capture_output=True, text=True,
                         check=True, timeout=120)
    probe = json.loads(out.stdout)
    assert probe["put"] == 3  # queue offsets 5, 6, 7 run on; 9 does not
    expected = bytes(20) + b"".join(struct.pack(">qiq", phy, size, tags) for phy, size, tags in
                                    [(1 << 40, 50, -1), (200, 60, 2), (300, 70, 3)]) + bytes(20)
    assert bytes.fromhex(probe["bytes"]) == expected
    size_bytes = {20 + 20 * unit + 8 + k for unit in range(3) for k in range(4)}
    log = probe["log"]
    last_other = max(i for i, (index, _value) in enumerate(log) if index not in size_bytes)
    sized = [i for i, (index, value) in enumerate(log) if index in size_bytes and value]
    assert sized and min(sized) > last_other


def test_the_disk_ratio_is_dfs_and_a_root_reserve_does_not_count_as_used(tmp_path, small_config, monkeypatch):
    """This VM's disk: 66M blocks, 52.7M free, 13.3M available to a user (a root reserve of 39M). ``(total -
    available) / total`` made it 80% used against df's 51%, over the 75% at which retention deletes an unexpired
    segment on every pass (every 10 s): a half-full disk lost the oldest messages early."""
    import os

    from rocketstore import retention

    class Disk:
        f_blocks, f_bfree, f_bavail, f_frsize = 66_053_021, 52_716_534, 13_261_241, 4096

    monkeypatch.setattr(os, "statvfs", lambda path: Disk)
    assert round(retention.disk_used_ratio(tmp_path), 1) == 50.1  # df's Use% of that disk: 51% (rounded up)
    with MessageStore.open(tmp_path, small_config.replace(file_reserved_time=72)) as store:
        for i in range(60):
            store.put_message(Message("T", b"z" * 300, keys=[f"k{i}"]))
        store.wait_for_dispatch()
        segments = len(store.commit_log.mapped_files.files)
        report = store.delete_expired_files(immediately=True)
        assert report.commit_log_files == [] and len(store.commit_log.mapped_files.files) == segments > 1
        Disk.f_bfree, Disk.f_bavail = 9_000_000, 0  # truly full: the oldest segment goes, expired or not
        assert store.delete_expired_files(immediately=True).commit_log_files == ["00000000000000000000"]


@given(st.lists(st.tuples(st.sampled_from([-1, 0, 5, 1 << 40]), st.sampled_from([-3, 0, 1, 77, 0x7FFFFFFF]),
                          st.integers(-(1 << 63), (1 << 63) - 1)), max_size=40))
def test_the_valid_run_of_units_is_the_unit_by_unit_walks(units):
    """``_valid_run`` (numpy, one pass) against the walk it replaced: stop at the first unit with a negative offset
    or a size <= 0; the end of the last unit that is not a pre-blank."""
    from rocketstore import consumequeue

    buf = bytearray(b"".join(struct.pack(">qiq", *unit) for unit in units))
    count, last_end = 0, None
    for offset, size, _tags in units:
        if offset < 0 or size <= 0:
            break
        if size != 0x7FFFFFFF:
            last_end = offset + size
        count += 1
    chunk = consumequeue._RUN_CHUNK
    try:
        for consumequeue._RUN_CHUNK in (chunk, 3, 1):  # across chunk ends too
            assert consumequeue._valid_run(buf, len(units)) == (count, last_end)
    finally:
        consumequeue._RUN_CHUNK = chunk

"""``store_stats`` counts on compiled batches what a record-by-record pass counts, and its plot stays readable."""

from __future__ import annotations

from collections import Counter

import pytest

from rocketstore import Message, MessageStore, StoreConfig
from rocketstore.stats import BUCKETS_MS, MAX_PLOTTED_TOPICS, StoreStats, stats_figure, store_stats, topic_bars

CONFIG = StoreConfig(mapped_file_size_commit_log=8 << 10, mapped_file_size_consume_queue=20 * 500,
                     max_hash_slot_num=101, max_index_num=4000)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("stats") / "store"
    with MessageStore.open(root, CONFIG) as store:
        for i in range(300):  # many segments; bodies of every size so segment ends fall anywhere
            store.put_message(Message(f"T{i % 7}", b"x" * (i % 97), keys=[f"k{i}"], queue_id=i % 3,
                                      properties={"DELAY": "1"} if i % 50 == 0 else None))
        store.wait_for_dispatch()
    return root


@pytest.mark.parametrize("bucket", ["second", "minute"])
def test_batch_counts_equal_a_record_by_record_count(root, bucket):
    stats = store_stats(root, CONFIG, bucket)
    width = BUCKETS_MS[bucket]
    topics: Counter[str] = Counter()
    times: Counter[int] = Counter()
    size = 0
    with MessageStore.open(root, CONFIG, read_only=True) as store:
        assert len(store.commit_log.mapped_files.files) > 3
        for msg in store.commit_log.iter_messages(read_body=False):
            topics[msg.topic] += 1
            times[msg.store_timestamp - msg.store_timestamp % width] += 1
            size += msg.store_size
    assert stats.messages == 300 == sum(topics.values())
    assert stats.per_topic == dict(sorted(topics.items())) and "SCHEDULE_TOPIC_XXXX" in stats.per_topic
    assert stats.per_bucket == dict(sorted(times.items()))
    assert stats.bytes == size


def test_stats_count_the_log_recovery_keeps_before_damage(tmp_path):
    root = tmp_path / "s"
    with MessageStore.open(root, CONFIG) as store:
        offsets = [store.put_message(Message("T", b"y" * 50)).commit_log_offset for _ in range(20)]
    segment = root / "commitlog" / "00000000000000000000"
    data = bytearray(segment.read_bytes())
    data[offsets[10] + 4 : offsets[10] + 8] = b"\x00\x00\x00\x01"  # record 10's magic code
    segment.write_bytes(bytes(data))
    stats = store_stats(root, CONFIG)
    assert stats.messages == 10 and stats.bytes == offsets[10]


def test_many_topics_are_cut_to_the_largest_and_the_rest_summed():
    per_topic = {f"topic-{i:03d}-" + "x" * (40 if i == 7 else 0): 1000 - i for i in range(60)}
    labels, counts = topic_bars(per_topic)
    assert len(labels) == MAX_PLOTTED_TOPICS and labels[-1] == "(46 other topics)"
    assert sum(counts) == sum(per_topic.values()) and counts[0] == 1000
    assert all(len(label) <= 32 for label in labels) and labels[7].endswith("…")
    assert topic_bars({"a": 1, "b": 2}) == (["b", "a"], [2, 1])


def test_a_store_written_in_one_minute_plots_one_bar_on_a_short_axis():
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    stats = StoreStats(messages=5, per_topic={"T": 5}, bucket="minute", per_bucket={1_700_000_040_000: 5})
    fig = stats_figure(stats)
    try:
        low, high = fig.axes[1].get_xlim()  # in days
        assert (high - low) * 86_400_000 == pytest.approx(3 * BUCKETS_MS["minute"], rel=1e-6)
        assert mdates.num2date(low).timestamp() * 1000 == pytest.approx(1_700_000_040_000 - 60_000, abs=1)
        assert len(fig.axes[1].patches) == 1
    finally:
        plt.close(fig)


@pytest.mark.parametrize(("zone", "utc", "bucket", "local"), [
    ("America/New_York", "2026-11-27T12:00:00+00:00", "day", "2026-11-27T00:00:00-05:00"),
    ("Asia/Kathmandu", "2026-11-27T00:15:16+00:00", "hour", "2026-11-27T06:00:00+05:45"),
    ("Asia/Kolkata", "2026-11-27T00:45:00+00:00", "hour", "2026-11-27T06:00:00+05:30"),
])
def test_time_buckets_start_at_local_boundaries(monkeypatch, zone, utc, bucket, local):
    """stats labels buckets in local time but cut them at UTC boundaries: a message stored at 07:00 in New York was
    counted under the day before, one stored at 06:00 in Kathmandu under hour 05."""
    import datetime as dt
    import time

    import numpy as np

    from rocketstore.stats import BUCKETS_MS, local_bucket_starts

    monkeypatch.setenv("TZ", zone)
    time.tzset()
    try:
        ms = int(dt.datetime.fromisoformat(utc).timestamp() * 1000)
        start = local_bucket_starts(np.array([ms, ms + 1], dtype=np.int64), BUCKETS_MS[bucket])
        assert start.tolist() == [int(dt.datetime.fromisoformat(local).timestamp() * 1000)] * 2
    finally:
        monkeypatch.undo()
        time.tzset()


@pytest.mark.parametrize("zone", ["Europe/Berlin", "America/St_Johns", "Australia/Lord_Howe", "America/Havana"])
def test_each_time_of_a_batch_takes_its_own_offset(monkeypatch, zone):
    """The offset was read at a batch's two ends and, when they agreed (January and December), applied to every
    time: a July message in Berlin was counted under the day before (the time-semantics review). Newfoundland
    changes at 05:30 UTC, Lord Howe by half an hour, and Havana falls back from 01:00 to 00:00 (its day begins at the
    first midnight: it was two buckets): every time here is checked against its own local day."""
    import datetime as dt
    import time

    import numpy as np

    from rocketstore.stats import BUCKETS_MS, local_bucket_starts

    monkeypatch.setenv("TZ", zone)
    time.tzset()
    try:
        base = int(dt.datetime(2024, 1, 10, tzinfo=dt.UTC).timestamp() * 1000)
        times = np.array(sorted({base + k * 3_917_113 for k in range(0, 8_100)} | {base + 350 * 86_400_000}),
                         dtype=np.int64)  # every ~65 minutes through 2024, and the first and last in winter
        starts = local_bucket_starts(times, BUCKETS_MS["day"])
        for t, start in zip(times.tolist(), starts.tolist(), strict=True):
            local = dt.datetime.fromtimestamp(t / 1000)
            midnight = dt.datetime(local.year, local.month, local.day)
            assert start == int(midnight.timestamp() * 1000), (local, dt.datetime.fromtimestamp(start / 1000))
    finally:
        monkeypatch.undo()
        time.tzset()

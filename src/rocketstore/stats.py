"""Store statistics: messages per topic and over time, and how full and how chained the index is.

The chain-length histogram says how many hash slots hold 0, 1, 2, ... entries; long chains are
what makes RocketMQ's key lookups slow and its collisions likely. Everything is read-only.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .checkpoint import StoreCheckpoint
from .codec.batch import scan_dispatch
from .config import StoreConfig
from .index.bulk import ENTRY_DTYPE
from .index.file import INDEX_HEADER_SIZE
from .index.service import IndexService
from .store import MessageStore

BUCKETS_MS = {"second": 1000, "minute": 60_000, "hour": 3_600_000, "day": 86_400_000}


@dataclass(slots=True)
class IndexFileStats:
    name: str
    entries: int
    capacity: int  # maxIndexNum - 1 (entry 0 is never used)
    slots: int
    used_slots: int
    chain_lengths: dict[int, int]  # chain length -> number of slots with it

    @property
    def fill_ratio(self) -> float:
        return self.entries / self.capacity if self.capacity else 0.0

    @property
    def slot_ratio(self) -> float:
        return self.used_slots / self.slots if self.slots else 0.0

    @property
    def longest_chain(self) -> int:
        return max(self.chain_lengths, default=0)


@dataclass(slots=True)
class StoreStats:
    messages: int = 0
    bytes: int = 0
    per_topic: dict[str, int] = field(default_factory=dict)
    bucket: str = "minute"
    per_bucket: dict[int, int] = field(default_factory=dict)  # bucket start (epoch ms) -> messages
    index_files: list[IndexFileStats] = field(default_factory=list)


def _utc_offset_ms(ms: int) -> int:
    return time.localtime(ms // 1000).tm_gmtoff * 1000


def local_bucket_starts(store_ts: np.ndarray, width: int) -> np.ndarray:
    """Each time's bucket, its boundaries in local time (the table labels buckets in local time, as every time the
    CLI prints): UTC boundaries put a message stored at 07:00 in New York under the day before, one stored at 06:00
    in Kathmandu under hour 05. Each time takes the local zone's offset of its own quarter hour (zones change
    offset only at quarter hours): the offset at the batch's two ends, applied to all when they agreed, put a
    summer message of a batch from January to December under the day before."""
    if not len(store_ts):
        return store_ts
    wall = store_ts + _offsets_at(store_ts // _QUARTER_HOUR_MS * _QUARTER_HOUR_MS)
    start_wall = wall - wall % width  # the bucket's start on the local clock
    # back to UTC with the offset in force at the bucket's start: on a change's day, midnight had the old one
    later = start_wall - _offsets_at(start_wall - (wall - store_ts))
    if width < BUCKETS_MS["day"]:
        return later  # an hour the clock shows twice is two buckets, each from its own start
    # a midnight the clock shows twice (Havana falls back at 01:00 to 00:00): the day begins at the first
    earlier = start_wall - _offsets_at(later - 3_600_000)
    first = (earlier < later) & (earlier + _offsets_at(earlier) == start_wall)
    return np.where(first, earlier, later)


def _offsets_at(times: np.ndarray) -> np.ndarray:
    """The local zone's UTC offset at each time, looked up once per distinct time."""
    distinct, where = np.unique(times, return_inverse=True)
    return np.array([_utc_offset_ms(int(t)) for t in distinct.tolist()], dtype=np.int64)[where]


_QUARTER_HOUR_MS = 15 * 60_000


def store_stats(root: str | Path, config: StoreConfig, bucket: str = "minute") -> StoreStats:
    if bucket not in BUCKETS_MS:
        raise ValueError(f"bucket must be one of {', '.join(BUCKETS_MS)}, not {bucket!r}")
    width = BUCKETS_MS[bucket]
    stats = StoreStats(bucket=bucket)
    topics: Counter[str] = Counter()
    times: Counter[int] = Counter()
    with MessageStore.open(root, config.replace(cut_damaged_log=True), read_only=True) as store:
        report = store.recovery
        if report is not None and report.resumes_at is not None and not config.cut_damaged_log:
            from .recovery import damaged_log_error  # counts that silently leave out the records after the damage

            raise damaged_log_error(Path(root), report, "would be left out of the counts")
        for batch in scan_dispatch(store.commit_log, max_rows=65536):
            for code, n in zip(*np.unique(batch.topic_code, return_counts=True), strict=True):
                topics[batch.topics[code]] += int(n)
            starts, n = np.unique(local_bucket_starts(batch.store_ts, width), return_counts=True)
            times.update(dict(zip(starts.tolist(), n.tolist(), strict=True)))
            stats.bytes += int(batch.size.sum())
    stats.messages = sum(topics.values())
    stats.per_topic = dict(sorted(topics.items()))
    stats.per_bucket = dict(sorted(times.items()))
    stats.index_files = index_stats(Path(root), config)
    return stats


def index_stats(root: Path, config: StoreConfig) -> list[IndexFileStats]:
    service = IndexService(root, config, StoreCheckpoint(root / "checkpoint", read_only=True), read_only=True)
    service.load()
    out = []
    try:
        for index in service.files:
            count = index.index_count - 1
            entries = np.frombuffer(index.buffer, dtype=ENTRY_DTYPE, count=count,
                                    offset=INDEX_HEADER_SIZE + index.hash_slot_num * 4 + 20)
            per_slot = np.bincount(entries["hash"].astype(np.int64) % index.hash_slot_num,
                                   minlength=index.hash_slot_num)
            del entries
            lengths, slots = np.unique(per_slot, return_counts=True)
            out.append(IndexFileStats(index.path.name, count, index.index_num - 1, index.hash_slot_num,
                                      int(np.count_nonzero(per_slot)),
                                      {int(n): int(c) for n, c in zip(lengths, slots, strict=True)}))
    finally:
        service.close()
    return out


MAX_PLOTTED_TOPICS = 15  # more bars than this make unreadable labels: the rest are summed into one


def plot_stats(stats: StoreStats, path: str | Path) -> None:
    """Draw messages per topic, messages over time and the chain-length histogram into one PNG."""
    import matplotlib.pyplot as plt

    fig = stats_figure(stats)
    try:
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)


def stats_figure(stats: StoreStats):
    """The three panels as a matplotlib figure: the largest topics (the others summed in one bar, long
    names cut), messages per bucket as bars one bucket wide on an axis that spans the data (a store
    written in one minute shows one bar, not a dot on a four-year axis), and the chain lengths."""
    import matplotlib

    matplotlib.use("Agg")
    import datetime as dt

    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    labels, counts = topic_bars(stats.per_topic)
    axes[0].barh(range(len(labels)), counts, color="#4c72b0")
    axes[0].set_yticks(range(len(labels)), labels, fontsize=8 if len(labels) > 8 else 10)
    axes[0].set_title(f"messages per topic ({len(stats.per_topic)} topics)")
    axes[0].invert_yaxis()
    width_ms = BUCKETS_MS[stats.bucket]
    if stats.per_bucket:
        starts = sorted(stats.per_bucket)
        to_date = [dt.datetime.fromtimestamp(t / 1000, tz=dt.UTC) for t in starts]
        axes[1].bar(to_date, [stats.per_bucket[t] for t in starts], width=dt.timedelta(milliseconds=width_ms),
                    align="edge", color="#dd8452")
        axes[1].set_xlim(dt.datetime.fromtimestamp((starts[0] - width_ms) / 1000, tz=dt.UTC),
                         dt.datetime.fromtimestamp((starts[-1] + 2 * width_ms) / 1000, tz=dt.UTC))
        locator = mdates.AutoDateLocator(minticks=2, maxticks=8)
        axes[1].xaxis.set_major_locator(locator)
        axes[1].xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator, tz=dt.UTC))
    axes[1].set_title(f"messages per {stats.bucket} (UTC)")
    histogram: Counter[int] = Counter()
    for index in stats.index_files:
        histogram.update(index.chain_lengths)
    if histogram:
        lengths = sorted(histogram)
        axes[2].bar(lengths, [histogram[n] for n in lengths], color="#55a868")
        axes[2].set_yscale("log")
    fill = ", ".join(f"{i.fill_ratio:.1%}" for i in stats.index_files) or "no index"
    axes[2].set_title(f"index slots by chain length (fill {fill})")
    axes[2].set_xlabel("entries in slot")
    fig.tight_layout()
    return fig


def topic_bars(per_topic: dict[str, int], limit: int = MAX_PLOTTED_TOPICS) -> tuple[list[str], list[int]]:
    """The ``limit`` largest topics (names over 32 characters cut) and one bar for all the others."""
    ranked = sorted(per_topic.items(), key=lambda item: (-item[1], item[0]))
    shown = ranked if len(ranked) <= limit else ranked[: limit - 1]
    labels = [name if len(name) <= 32 else name[:31] + "…" for name, _ in shown]
    counts = [n for _, n in shown]
    if len(shown) < len(ranked):
        labels.append(f"({len(ranked) - len(shown)} other topics)")
        counts.append(sum(n for _, n in ranked[len(shown):]))
    return labels, counts

"""Store statistics: messages per topic and over time, and how full and how chained the index is.

The chain-length histogram says how many hash slots hold 0, 1, 2, ... entries; long chains are
what makes RocketMQ's key lookups slow and its collisions likely. Everything is read-only.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .checkpoint import StoreCheckpoint
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


def store_stats(root: str | Path, config: StoreConfig, bucket: str = "minute") -> StoreStats:
    if bucket not in BUCKETS_MS:
        raise ValueError(f"bucket must be one of {', '.join(BUCKETS_MS)}, not {bucket!r}")
    width = BUCKETS_MS[bucket]
    stats = StoreStats(bucket=bucket)
    topics: Counter[str] = Counter()
    times: Counter[int] = Counter()
    with MessageStore.open(root, config, read_only=True) as store:
        for msg in store.commit_log.iter_messages(read_body=False, check_crc=False):
            topics[msg.topic] += 1
            times[msg.store_timestamp - msg.store_timestamp % width] += 1
            stats.bytes += msg.store_size
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


def plot_stats(stats: StoreStats, path: str | Path) -> None:
    """Draw messages per topic, messages over time and the chain-length histogram into one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import datetime as dt

    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    topics = list(stats.per_topic)
    axes[0].barh(topics, [stats.per_topic[t] for t in topics], color="#4c72b0")
    axes[0].set_title("messages per topic")
    axes[0].invert_yaxis()
    stamps = [dt.datetime.fromtimestamp(t / 1000, tz=dt.UTC) for t in stats.per_bucket]
    axes[1].plot(stamps, list(stats.per_bucket.values()), marker="o", color="#dd8452")
    axes[1].set_title(f"messages per {stats.bucket} (UTC)")
    axes[1].tick_params(axis="x", rotation=30)
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
    fig.savefig(path, dpi=100)
    plt.close(fig)

"""Operator tools on a whole store: ``verify`` and ``stats`` against one pass over the same bytes.

    ./dev bench tools            # about 512 MB of commit log (200-byte bodies, 8 topics, two keys each)
    ./dev bench tools --quick    # the CI smoke form

The anchor is the cheapest thing that touches every used byte of the log once: ``zlib.crc32`` over
each segment up to its write position (page cache warm for both). Issue #12's target: ``verify`` at
>= 0.1x of that pass. ``verify`` also checks every queue unit and index entry against the records;
``stats`` also reads every index file's entries. Both run in-process through their library calls
(``rocketstore verify`` / ``stats`` add only the CLI start).
"""

from __future__ import annotations

import sys
import tempfile
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import numpy as np
import pyarrow as pa
from harness import Result, bench_main

from rocketstore import MessageStore, StoreConfig
from rocketstore.stats import store_stats
from rocketstore.verify import verify_store

CONFIG = StoreConfig(mapped_file_size_commit_log=128 << 20)
ROWS = 10_000


def build(root: Path, target_bytes: int) -> int:
    """``put_batch`` 10,000-row tables until the log holds ``target_bytes``; returns the message count."""
    count = 0
    rng = np.random.default_rng(7)
    with MessageStore.open(root, CONFIG) as store:
        while store.max_phy_offset < target_bytes:
            i = np.arange(count, count + ROWS)
            bodies = rng.integers(0, 256, size=(ROWS, 200), dtype=np.uint8)
            table = pa.table({
                "topic": pa.array([f"Topic{n % 8}" for n in i.tolist()]),
                "body": pa.array([row.tobytes() for row in bodies], pa.binary()),
                "keys": pa.array([[f"order-{n}", f"user-{n % 977}"] for n in i.tolist()]),
                "tags": pa.array([f"T{n % 3}" for n in i.tolist()]),
                "queue_id": pa.array(i % 4, pa.int32()),
            })
            store.put_batch(table)
            count += ROWS
        store.wait_for_dispatch(timeout=600)
        return count


def crc_pass(root: Path) -> tuple[float, int]:
    with MessageStore.open(root, CONFIG, read_only=True) as store:
        started = time.perf_counter()
        used = 0
        for mapped in store.commit_log.mapped_files.files:
            zlib.crc32(memoryview(mapped.buffer)[: mapped.wrote_position])
            used += mapped.wrote_position
        return time.perf_counter() - started, used


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def run(quick: bool) -> list[Result]:
    with tempfile.TemporaryDirectory(prefix="rocketstore-bench-") as tmp:
        root = Path(tmp) / "store"
        messages = build(root, (8 if quick else 512) << 20)
        crc_pass(root)  # page cache warm
        crc_s, used = min(crc_pass(root) for _ in range(3))
        report = verify_store(root, CONFIG)
        assert report.clean and report.records == messages, report.problems[:3]
        verify_s = min(timed(lambda: verify_store(root, CONFIG)) for _ in range(2))
        stats = store_stats(root, CONFIG)
        assert stats.messages == messages
        stats_s = min(timed(lambda: store_stats(root, CONFIG)) for _ in range(2))
    mb = used / 1e6
    crc = f"one zlib.crc32 pass, {mb / crc_s:,.0f} MB/s"
    notes = {"messages": messages, "log_mb": mb}
    return [
        Result("tools", "verify (log, queues, index)", mb / verify_s, "MB/s", crc, mb / crc_s, 0.1, notes),
        Result("tools", "stats (topics, times, index chains)", mb / stats_s, "MB/s", crc, mb / crc_s, None, notes),
        Result("tools", "verify", messages / verify_s, "rec/s", f"{messages:,} records", messages / verify_s),
    ]


if __name__ == "__main__":
    raise SystemExit(bench_main("tools", run, __doc__.splitlines()[0]))

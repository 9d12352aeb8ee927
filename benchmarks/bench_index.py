"""Index build and key lookup against RocketMQ's Java IndexFile measured on this machine type.

    ./dev bench index [--quick]

* bulk build: hash and put the keys ``TopicTest#key-<i>`` into a default-geometry file
  (5,000,000 slots, 20,000,000 entries, 420 MB): 2,000,000 keys as in the Java measurement, and a
  completely full file (19,999,999 entries);
* incremental dispatch: the dispatcher's real path (decode records, consume queues, vectorised
  index batches) over a commit log of 200,000 messages with 2 keys + UNIQ_KEY each;
* lookups on the full file: single ``select_phy_offsets`` latency (p50/p99) of random existing keys,
  and ``select_batch`` throughput; verified ``query_message`` latency on a store.

Java figures (REFERENCE.md): putKey 15.2 million keys/s, selectPhyOffset 2.19 million queries/s.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).parent))

from harness import JAVA_PUTKEY_KEYS_S, JAVA_SELECT_QUERIES_S, Result, bench_main

from rocketstore import Message, MessageStore, StoreConfig
from rocketstore.checkpoint import StoreCheckpoint
from rocketstore.commitlog import CommitLog
from rocketstore.consumequeue import ConsumeQueueTable
from rocketstore.dispatch import Dispatcher
from rocketstore.index import IndexFile
from rocketstore.index.bulk import index_key_hashes, put_hashes, select_batch
from rocketstore.index.service import IndexService
from rocketstore.recovery import recovered_log_end

LONG_MAX = (1 << 63) - 1


def keys(start: int, stop: int) -> list[str]:
    return [f"TopicTest#key-{i}" for i in range(start, stop)]


def warm_up(path: Path) -> None:
    """Load the compiled kernels first, as Java's figure is JIT-compiled (bench_scan measures first calls)."""
    index = IndexFile.create(path, 11, 100)
    put_hashes(index, index_key_hashes(keys(0, 50)), np.arange(50, dtype=np.int64), np.arange(50, dtype=np.int64))
    index_key_hashes(pa.array(keys(0, 5), pa.string()))
    select_batch(index, index_key_hashes(keys(0, 5)), 64, 0, LONG_MAX)
    index.close()
    path.unlink()


def bulk_build(path: Path, slots: int, entries: int, count: int, arrow: bool = True) -> float:
    """Seconds to hash ``count`` keys and put them (in chunks of 1M) into a new file. The keys exist already, as
    Java's strings do: in an Arrow string column (how the batch codec and the Spark source hold them; the UTF-8
    is hashed where it lies) or, with ``arrow=False``, as a list of Python strings."""
    index = IndexFile.create(path, slots, entries)
    base_ts = 1_700_000_000_000
    chunks = [keys(lo, min(lo + (1 << 20), count)) for lo in range(0, count, 1 << 20)]
    if arrow:
        chunks = [pa.array(chunk, pa.string()) for chunk in chunks]
    started = time.perf_counter()
    for n, chunk in enumerate(chunks):
        lo, hi = n << 20, (n << 20) + len(chunk)
        hashes = index_key_hashes(chunk)
        phys = np.arange(lo, hi, dtype=np.int64) * 200
        put_hashes(index, hashes, phys, base_ts + np.arange(lo, hi, dtype=np.int64) // 100)
    elapsed = time.perf_counter() - started
    index.flush()
    index.close()
    return elapsed


def incremental_dispatch(root: Path, messages: int, config: StoreConfig) -> tuple[float, int]:
    with MessageStore.open(root, config) as store:
        for lo in range(0, messages, 512):
            store.put_messages([Message("TopicTest", b"x" * 100, keys=[f"order-{i}", f"user-{i % 1000}"],
                                        queue_id=i % 8) for i in range(lo, min(lo + 512, messages))])
    for name in ("consumequeue", "index"):
        shutil.rmtree(root / name)
    _low, end = recovered_log_end(root, config)
    log = CommitLog(root, config, read_only=True)
    log.load()
    log.mapped_files.truncate_dirty_files(end, discard=lambda m: None)  # positions at the log's end
    queues = ConsumeQueueTable(root, config)
    index = IndexService(root, config, StoreCheckpoint(root / "checkpoint"))
    dispatcher = Dispatcher(log, queues, index, config, lambda ts: None)
    started = time.perf_counter()
    dispatcher.dispatch_available()
    elapsed = time.perf_counter() - started
    entries = sum(f.index_count - 1 for f in index.files)
    index.close()
    queues.close()
    log.close()
    return elapsed, entries


def lookups(path: Path, slots: int, entries: int, filled: int, samples: int) -> tuple[float, float, float]:
    """(p50 µs, p99 µs) of single lookups and batched queries/s on a filled file."""
    index = IndexFile.open(path, slots, entries, read_only=True)
    rng = np.random.default_rng(7)
    picks = rng.integers(0, filled, samples)
    probe = [f"TopicTest#key-{i}" for i in picks]
    latencies = np.empty(samples)
    for j, key in enumerate(probe):
        started = time.perf_counter_ns()
        index.select_phy_offsets(key, 64, 0, LONG_MAX)
        latencies[j] = (time.perf_counter_ns() - started) / 1000
    batch_keys = [f"TopicTest#key-{i}" for i in rng.integers(0, filled, 200_000 if samples > 2000 else 2000)]
    hashes = index_key_hashes(batch_keys)
    started = time.perf_counter()
    select_batch(index, hashes, 64, 0, LONG_MAX)
    batched = len(hashes) / (time.perf_counter() - started)
    index.close()
    return float(np.percentile(latencies, 50)), float(np.percentile(latencies, 99)), batched


def verified_queries(root: Path, config: StoreConfig, samples: int) -> tuple[float, float]:
    with MessageStore.open(root, config, read_only=True) as store:
        latencies = []
        rng = np.random.default_rng(3)
        for i in rng.integers(0, 1000, samples):
            started = time.perf_counter_ns()
            found = store.query_message("TopicTest", f"order-{i}")
            latencies.append((time.perf_counter_ns() - started) / 1000)
            assert found, i
    return float(np.percentile(latencies, 50)), float(np.percentile(latencies, 99))


def run(quick: bool) -> list[Result]:
    slots, entries = (5000, 20_000) if quick else (5_000_000, 20_000_000)
    java_keys = 20_000 if quick else 2_000_000
    full = entries - 1
    messages = 5000 if quick else 200_000
    results = []
    with tempfile.TemporaryDirectory(prefix="rocketstore-index-") as tmp:
        tmp_path = Path(tmp)
        warm_up(tmp_path / "warm-up")
        # median of 3 fresh files, as Java's figure is the median of 3 runs (ext4 block allocation of a new file's
        # pages varies by 2x from run to run here)
        seconds = sorted(bulk_build(tmp_path / f"partial-{i}", slots, entries, java_keys) for i in range(3))[1]
        results.append(Result("index build", f"bulk: hash + put {java_keys:,} keys", java_keys / seconds, "keys/s",
                              "Java IndexFile.putKey, 15.2M keys/s", JAVA_PUTKEY_KEYS_S, 1.0))
        seconds = bulk_build(tmp_path / "partial-list", slots, entries, java_keys, arrow=False)
        results.append(Result("index build", f"bulk: hash + put {java_keys:,} keys from Python str",
                              java_keys / seconds, "keys/s", "Java IndexFile.putKey, 15.2M keys/s", JAVA_PUTKEY_KEYS_S))
        seconds = bulk_build(tmp_path / "full", slots, entries, full)
        results.append(Result("index build", f"bulk: fill a {slots:,}-slot file ({full:,} keys)", full / seconds,
                              "keys/s", "Java IndexFile.putKey, 15.2M keys/s", JAVA_PUTKEY_KEYS_S, 1.0))
        config = StoreConfig(mapped_file_size_commit_log=256 << 20, max_hash_slot_num=slots, max_index_num=entries)
        seconds, put = incremental_dispatch(tmp_path / "store", messages, config)
        results.append(Result("index build", f"incremental dispatch ({messages:,} msgs, queues too)", put / seconds,
                              "keys/s", "Java IndexFile.putKey, 15.2M keys/s", JAVA_PUTKEY_KEYS_S))
        p50, p99, batched = lookups(tmp_path / "full", slots, entries, full, 2000 if quick else 20_000)
        results.append(Result("key lookup", "single select_phy_offsets p50", p50, "µs", "target p99 50 µs", 50.0,
                              higher_is_better=False))
        results.append(Result("key lookup", "single select_phy_offsets p99", p99, "µs", "target p99 50 µs", 50.0,
                              1.0, higher_is_better=False))
        results.append(Result("key lookup", f"batched select ({'2,000' if quick else '200,000'} keys)", batched,
                              "queries/s",
                              "Java selectPhyOffset, 2.19M/s", JAVA_SELECT_QUERIES_S, 0.5))
        p50, p99 = verified_queries(tmp_path / "store", config, 200 if quick else 2000)
        results.append(Result("key lookup", "verified query_message p50", p50, "µs", "target p99 50 µs", 50.0,
                              higher_is_better=False))
        results.append(Result("key lookup", "verified query_message p99", p99, "µs", "target p99 50 µs", 50.0,
                              higher_is_better=False))
    return results


def main() -> int:
    return bench_main("index", run, __doc__.splitlines()[0])


if __name__ == "__main__":
    raise SystemExit(main())

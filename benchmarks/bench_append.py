"""Append throughput: put_message and put_messages(32) against writing the same bytes into an mmap.

    ./dev bench append [--quick]

Bodies of 100 B, 1 KiB and 16 KiB; ASYNC_FLUSH and SYNC_FLUSH; 1 and 4 producer threads. Each run
puts for a fixed time into a fresh store with RocketMQ's default settings (1 GiB segments, the
dispatcher building consume queues and the index in the background). The baseline copies the
same encoded records into a pre-allocated mmap in a tight loop: the practical limit here.
"""

from __future__ import annotations

import mmap
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from harness import Result, bench_main, run_threads

from rocketstore import FlushDiskType, Message, MessageStore, StoreConfig
from rocketstore.encoder import MessageEncoder

BODIES = {"100B": 100, "1KiB": 1024, "16KiB": 16384}


def messages(body_size: int, count: int) -> list[Message]:
    body = os.urandom(body_size)
    return [Message("BenchTopic", body, tags="TagA", keys=[f"key-{i}"], queue_id=i % 8) for i in range(count)]


def raw_rate(body_size: int, seconds: float) -> float:
    encoder = MessageEncoder(StoreConfig())
    records = [bytes(encoder.encode(m).data) for m in messages(body_size, 256)]
    size = 256 << 20
    with tempfile.TemporaryFile() as f:
        os.posix_fallocate(f.fileno(), 0, size)
        with mmap.mmap(f.fileno(), size) as mm:
            pos = count = 0
            started = time.perf_counter()
            while time.perf_counter() - started < seconds:
                for rec in records:
                    end = pos + len(rec)
                    if end > size:
                        pos, end = 0, len(rec)
                    mm[pos:end] = rec
                    pos = end
                count += len(records)
            return count / (time.perf_counter() - started)


def store_rate(body_size: int, mode: FlushDiskType, threads: int, batch: int, seconds: float) -> float:
    with tempfile.TemporaryDirectory(prefix="rocketstore-append-") as root:
        config = StoreConfig(flush_disk_type=mode)
        with MessageStore.open(Path(root), config) as store:
            pool = messages(body_size, 256)

            def produce(_thread: int, i: int) -> None:
                if batch == 1:
                    store.put_message(pool[i % 256])
                else:
                    start = (i * batch) % 256
                    store.put_messages(pool[start : start + batch])

            calls, _latencies = run_threads(produce, threads, seconds)
            return calls * batch


def run(quick: bool) -> list[Result]:
    seconds = 0.05 if quick else 1.5
    results = []
    for label, size in BODIES.items():
        raw = raw_rate(size, seconds)
        for mode in (FlushDiskType.ASYNC_FLUSH, FlushDiskType.SYNC_FLUSH):
            for threads in (1, 4):
                for batch in (1, 32):
                    rate = store_rate(size, mode, threads, batch, seconds)
                    api = "put_message" if batch == 1 else "put_messages(32)"
                    target = 0.5 if (label, mode, batch) == ("100B", FlushDiskType.ASYNC_FLUSH, 32) else None
                    results.append(Result("append", f"{label} {mode.value[:4]} {threads}t {api}", rate, "msg/s",
                                          f"raw mmap copy, {raw:,.0f} msg/s", raw, target))
    return results


def main() -> int:
    return bench_main("append", run, __doc__.splitlines()[0])


if __name__ == "__main__":
    raise SystemExit(main())

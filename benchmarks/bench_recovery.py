"""Abnormal-recovery scan of a commit log with CRC checks, against reading the bytes and CRC-ing them.

    ./dev bench recovery [--quick]

Builds a 1 GiB commit log (1 KiB bodies, records exactly as the store writes them), marks it crashed
and untrusted, and times ``recover_commit_log`` validating every record with its body CRC. Baselines:
reading the same files and running zlib.crc32 over all their bytes (the limit here), and RocketMQ's
reported ~200 MB/s.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from harness import ROCKETMQ_RECOVERY_MB_S, Result, bench_main

from rocketstore import Message, StoreConfig
from rocketstore.checkpoint import StoreCheckpoint
from rocketstore.codec.record import blank_record, fill_in_place
from rocketstore.commitlog import CommitLog
from rocketstore.encoder import MessageEncoder
from rocketstore.recovery import recover_commit_log

SEGMENT = 256 << 20  # bytes per segment (16 MiB in the quick form)


def build_log(root: Path, total: int, body_size: int, segment: int = SEGMENT) -> int:
    """Segments of real records (the store's encoder, offsets filled in); returns the bytes of records."""
    encoder = MessageEncoder(StoreConfig())
    templates = [encoder.encode(Message("BenchTopic", os.urandom(body_size), tags="TagA", keys=[f"k{i}"],
                                        queue_id=i % 8)) for i in range(64)]
    (root / "commitlog").mkdir(parents=True)
    written = 0
    queue_offsets = [0] * 8
    now = time.time_ns() // 1_000_000
    for start in range(0, total, segment):
        buf = bytearray(segment)
        pos = i = 0
        while True:
            rec = templates[i % 64]
            if pos + rec.size + 8 > segment:
                buf[pos : pos + 8] = blank_record(segment - pos)
                break
            data = bytearray(rec.data)
            fill_in_place(data, 0, queue_offset=queue_offsets[rec.queue_id], phy_offset=start + pos,
                          store_timestamp=now, sys_flag=rec.sys_flag)
            queue_offsets[rec.queue_id] += 1
            buf[pos : pos + rec.size] = data
            pos += rec.size
            written += rec.size
            i += 1
        (root / "commitlog" / f"{start:020d}").write_bytes(buf)
    return written


def scan(root: Path, segment: int) -> tuple[float, int]:
    config = StoreConfig(mapped_file_size_commit_log=segment)
    log = CommitLog(root, config, read_only=True)
    log.load()
    checkpoint = StoreCheckpoint(root / "checkpoint", read_only=True, trusted=False)
    started = time.perf_counter()
    report = recover_commit_log(log, checkpoint, root, abnormal=True)
    elapsed = time.perf_counter() - started
    log.close()
    return elapsed, report.records_checked


def read_and_crc(root: Path) -> float:
    started = time.perf_counter()
    for path in sorted((root / "commitlog").iterdir()):
        with open(path, "rb") as f:
            crc = 0
            while chunk := f.read(8 << 20):
                crc = zlib.crc32(chunk, crc)
    return time.perf_counter() - started


def run(quick: bool) -> list[Result]:
    total, segment = ((32 << 20), (16 << 20)) if quick else ((1 << 30), SEGMENT)
    with tempfile.TemporaryDirectory(prefix="rocketstore-recovery-") as tmp:
        root = Path(tmp)
        data = build_log(root, total, 1024, segment)
        read_and_crc(root)  # both runs read from the page cache
        limit = min(read_and_crc(root) for _ in range(2))
        elapsed, records = min(scan(root, segment) for _ in range(2))
    mb = data / 1e6
    return [
        Result("recovery", f"abnormal recovery, CRC, {mb:,.0f} MB", mb / elapsed, "MB/s",
               f"read + zlib.crc32, {mb / limit:,.0f} MB/s", mb / limit, 0.5, {"records": records}),
        Result("recovery", f"abnormal recovery, CRC, {mb:,.0f} MB", mb / elapsed, "MB/s",
               "RocketMQ, ~200 MB/s (reported)", ROCKETMQ_RECOVERY_MB_S, 5.0),
    ]


def main() -> int:
    return bench_main("recovery", run, __doc__.splitlines()[0])


if __name__ == "__main__":
    raise SystemExit(main())

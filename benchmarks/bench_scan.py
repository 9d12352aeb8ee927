"""Scan a commit log into Arrow in one process: the batch decoder against Parquet and the per-record path.

    ./dev bench scan            # about 256 MiB of commit log (400-byte bodies, 8 topics, two keys each)
    ./dev bench scan --quick    # the CI smoke form: a few MiB

The store is written with ``put_messages`` into a temporary directory. Figures, all in MB/s of
commit log (the bytes the records occupy), on the same data in the same run:

* ``scan_arrow`` with body CRCs (the issue's target: >= 300 MB/s), without CRCs, without bodies, and with its
  batches built in the caller's thread (``threads=0``) instead of two workers beside the walk;
* the anchor: ``pyarrow.parquet.read_table`` of the same rows, written once to Parquet (snappy),
  with pyarrow's threads (both cores) and with one thread;
* the old path: ``read_layout`` + ``message_from_layout`` + Python lists per record, as the Spark
  partition reader did before the batch decoder (timed on the first ``--old-mb`` MB only);
* ``iter_messages`` (one ``MessageExt`` per record, found by the compiled walk) against the
  record-at-a-time walk it replaced (``iter_layouts`` + ``message_from_layout``), on the same MB;
* where the time goes: the numba walk alone (validation, CRCs, fixed fields) with and without CRC;
* the JIT: first-call time in a fresh process with an empty numba cache, and with the cache warm.

Results: a table on stdout and benchmarks/results/scan.json. The peak RSS is the Parquet baseline's
(the whole table in memory, twice while it is written) plus the mapped segments; a scan itself
holds one batch of at most 8192 records.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from harness import Result, peak_rss_mb, save, table

from rocketstore import Message, MessageStore, StoreConfig
from rocketstore.codec import _kernels
from rocketstore.codec.batch import MESSAGE_SCHEMA, message_row, rows_batch, scan_arrow
from rocketstore.codec.record import message_from_layout

CONFIG = StoreConfig(mapped_file_size_commit_log=64 << 20)
FIRST_CALL = """
import time, sys
started = time.perf_counter()
from rocketstore.codec.batch import decode_range
imported = time.perf_counter()
from rocketstore.codec.record import encode_record
host = bytes(8)
rec = bytes(encode_record(topic=b"T", body=b"x", properties=b"", queue_id=0, flag=0, sys_flag=0, born_timestamp=0,
                          born_host=host, store_host=host))
decode_range(rec, 0, len(rec), base=0)
print(imported - started, time.perf_counter() - imported)
"""


def build(root: Path, target_bytes: int, body_size: int) -> tuple[int, int]:
    """Write about ``target_bytes`` of log; returns (log bytes, messages)."""
    count = 0
    with MessageStore.open(root, CONFIG) as store:
        while store.max_phy_offset < target_bytes:
            blob = os.urandom(257 * body_size)  # distinct bodies: Parquet cannot dictionary-encode them away
            store.put_messages([Message(f"Topic{i % 8}", blob[(i - count) * body_size : (i - count + 1) * body_size],
                                        tags=f"T{i % 3}", keys=[f"order-{i}", f"user-{i % 977}"], queue_id=i % 4)
                                for i in range(count, count + 256)])
            count += 256
        store.wait_for_dispatch()
        return store.max_phy_offset, count


def scan(root: Path, **kwargs) -> tuple[float, int]:
    with MessageStore.open(root, CONFIG, read_only=True) as store:
        started = time.perf_counter()
        rows = sum(batch.num_rows for batch in scan_arrow(store.commit_log, **kwargs))
        return time.perf_counter() - started, rows


def old_path(root: Path, max_bytes: int) -> tuple[float, int]:
    """The per-record reader the batch decoder replaced: the record codec and Python lists."""
    with MessageStore.open(root, CONFIG, read_only=True) as store:
        log = store.commit_log
        started = time.perf_counter()
        rows, done = [], 0
        for mapped, pos, layout in log.iter_layouts(to_offset=log.min_offset + max_bytes, check_crc=True):
            msg = message_from_layout(mapped.buffer, pos, layout, path=str(mapped.path), base=mapped.file_from_offset)
            rows.append(message_row(msg, True, None))
            if len(rows) == 8192:
                done += rows_batch(rows).num_rows
                rows = []
        done += rows_batch(rows).num_rows if rows else 0
        return time.perf_counter() - started, done


def message_objects(root: Path, max_bytes: int, compiled: bool) -> tuple[float, int]:
    """One ``MessageExt`` per record with CRCs, over the first ``max_bytes`` of log: ``iter_messages`` (the
    compiled walk, then one unpack per record) or the record-at-a-time walk it replaced."""
    with MessageStore.open(root, CONFIG, read_only=True) as store:
        log = store.commit_log
        end = log.min_offset + max_bytes
        started = time.perf_counter()
        if compiled:
            count = sum(1 for _msg in log.iter_messages(to_offset=end, check_crc=True))
        else:
            count = sum(1 for mapped, pos, layout in log.iter_layouts(to_offset=end, check_crc=True)
                        if message_from_layout(mapped.buffer, pos, layout, path=str(mapped.path),
                                               base=mapped.file_from_offset))
        return time.perf_counter() - started, count


def walk_only(root: Path, check_crc: bool) -> float:
    """The numba walk alone over every segment: validation, CRCs and fixed fields, nothing built."""
    with MessageStore.open(root, CONFIG, read_only=True) as store:
        started = time.perf_counter()
        for mapped in store.commit_log.mapped_files.files:
            arr = np.frombuffer(mapped.buffer, dtype=np.uint8)
            arr = arr.view()
            arr.flags.writeable = False
            pos, end = 0, mapped.wrote_position
            while pos < end:
                _f, n, pos = _kernels.walk(arr, pos, end, end, check_crc, 8192, 64 << 20)
                if n == 0:
                    break
            del arr, _f
        return time.perf_counter() - started


def first_call(cold: bool) -> tuple[float, float]:
    """(import s, first decode s) in a fresh interpreter; ``cold`` empties numba's cache first."""
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as cache:
        if cold:
            env["NUMBA_CACHE_DIR"] = cache
        out = subprocess.run([sys.executable, "-c", FIRST_CALL], capture_output=True, text=True, check=True, env=env)
    imported, first = map(float, out.stdout.split())
    return imported, first


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke form for CI")
    parser.add_argument("--mb", type=int, default=256, help="MiB of commit log to generate")
    parser.add_argument("--body-size", type=int, default=400)
    parser.add_argument("--old-mb", type=int, default=24, help="MB of log the old per-record path decodes")
    args = parser.parse_args(argv)
    mb = 4 if args.quick else args.mb
    with tempfile.TemporaryDirectory(prefix="rocketstore-bench-") as tmp:
        root = Path(tmp) / "store"
        started = time.perf_counter()
        log_bytes, messages = build(root, mb << 20, args.body_size)
        build_s = time.perf_counter() - started
        cold_import, cold_first = first_call(cold=True)
        warm_import, warm_first = first_call(cold=False)
        scan(root)  # page cache warm, JIT loaded
        crc_s, rows = scan(root)
        assert rows == messages, (rows, messages)
        inline_s, _ = scan(root, threads=0)
        nocrc_s, _ = scan(root, check_crc=False)
        nobody_s, _ = scan(root, include_body=False)
        big_s, _ = scan(root, max_rows=65536)
        walk_crc_s = walk_only(root, True)
        walk_s = walk_only(root, False)
        old_bytes = min(log_bytes, (1 if args.quick else args.old_mb) * 1_000_000)
        old_s, _ = old_path(root, old_bytes)
        iter_s, iter_n = message_objects(root, old_bytes, compiled=True)
        layouts_s, layouts_n = message_objects(root, old_bytes, compiled=False)
        assert iter_n == layouts_n, (iter_n, layouts_n)
        parquet = Path(tmp) / "scan.parquet"
        with MessageStore.open(root, CONFIG, read_only=True) as store:
            # one write_table: pyarrow's default row groups (1 Mi rows), the fastest file to read back
            pq.write_table(pa.Table.from_batches(scan_arrow(store.commit_log), MESSAGE_SCHEMA), parquet)
        pq.read_table(parquet)
        parquet_s = min(_timed_parquet(parquet) for _ in range(3))
        parquet_1t_s = min(_timed_parquet(parquet, use_threads=False) for _ in range(3))
        parquet_mb = parquet.stat().st_size / 1e6
    mb_log = log_bytes / 1e6
    crc, parquet_rate = mb_log / crc_s, mb_log / parquet_s
    results = [
        Result("scan", "scan_arrow with CRC vs Parquet read", crc, "MB/s", f"Parquet read, {parquet_rate:.0f} MB/s",
               parquet_rate, 1.0),
        Result("scan", "scan_arrow with CRC vs 300 MB/s target", crc, "MB/s", "target 300 MB/s", 300.0, 1.0),
        Result("scan", "scan_arrow with CRC vs old per-record path", crc, "MB/s",
               f"per-record, {old_bytes / 1e6 / old_s:.1f} MB/s", old_bytes / 1e6 / old_s),
        Result("scan", "scan_arrow with CRC vs Parquet, 1 thread", crc, "MB/s",
               f"Parquet read 1 thread, {mb_log / parquet_1t_s:.0f} MB/s", mb_log / parquet_1t_s),
        Result("scan", "scan_arrow with CRC, threads=0 (built in the caller's thread)", mb_log / inline_s, "MB/s",
               f"Parquet read 1 thread, {mb_log / parquet_1t_s:.0f} MB/s", mb_log / parquet_1t_s),
        Result("scan", "scan_arrow with CRC, 2 build threads vs threads=0", crc, "MB/s",
               f"threads=0, {mb_log / inline_s:.0f} MB/s", mb_log / inline_s),
        Result("scan", "scan_arrow with CRC, 65536-row batches", mb_log / big_s, "MB/s",
               f"8192-row batches, {crc:.0f} MB/s", crc),
        Result("scan", "scan_arrow without CRC", mb_log / nocrc_s, "MB/s", f"with CRC, {crc:.0f} MB/s", crc),
        Result("scan", "scan_arrow without body", mb_log / nobody_s, "MB/s", f"with CRC, {crc:.0f} MB/s", crc),
        Result("scan", "iter_messages with CRC (a MessageExt each)", iter_n / iter_s, "msg/s",
               f"record-at-a-time walk, {layouts_n / layouts_s:,.0f}/s", layouts_n / layouts_s),
        Result("scan", "numba walk alone, with CRC", mb_log / walk_crc_s, "MB/s", f"scan_arrow, {crc:.0f} MB/s", crc),
        Result("scan", "numba walk alone, no CRC", mb_log / walk_s, "MB/s", f"scan_arrow, {crc:.0f} MB/s", crc),
    ]
    print(f"{messages:,} messages, {mb_log:.0f} MB of log ({args.body_size}-byte bodies) written in {build_s:.1f} s; "
          f"Parquet file {parquet_mb:.0f} MB")
    print(f"first call: cold cache {cold_first:.2f} s compile (+{cold_import:.2f} s import), "
          f"warm cache {warm_first:.2f} s (+{warm_import:.2f} s import)")
    print(table(results))
    save("scan-quick" if args.quick else "scan", results,
         {"peak_rss_mb": peak_rss_mb(), "messages": messages, "log_mb": mb_log, "parquet_mb": parquet_mb,
          "first_call_s": {"cold": cold_first, "warm": warm_first, "import_cold": cold_import,
                           "import_warm": warm_import}})
    return 0


def _timed_parquet(path: Path, use_threads: bool = True) -> float:
    started = time.perf_counter()
    pq.read_table(path, use_threads=use_threads)
    return time.perf_counter() - started


if __name__ == "__main__":
    raise SystemExit(main())

"""rocketstore against SQLite on the same messages: ingest, key lookup, scan to Arrow, SYNC group commit.

    ./dev bench peers [--quick]

SQLite is what a Python user would pick instead for a durable, indexed log in-process: stdlib
``sqlite3``, WAL, ``synchronous=NORMAL`` (``FULL`` for the SYNC rows), one table with an index on
(topic, key). Both engines get the same messages: 100-byte bodies, one key and one tag each, 4 topics x
8 queues. Every ratio is rocketstore / SQLite measured in this run (latencies: SQLite / rocketstore, so
>= 1 is good either way); the targets are issue #12's. Ingest includes the dispatch (consume queues and
index built) for rocketstore, and the commit for SQLite; each engine ingests three times, alternating, and
the medians are compared (every run is in the row's notes).
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).parent))

from harness import Result, bench_main, run_threads

from rocketstore import FlushDiskType, Message, MessageStore, StoreConfig

TOPICS = [f"PeerTopic{i}" for i in range(4)]
BODY = 100
SCHEMA = """CREATE TABLE messages (id INTEGER PRIMARY KEY, topic TEXT NOT NULL, queue_id INTEGER NOT NULL,
            tags TEXT, key TEXT, body BLOB NOT NULL, born INTEGER NOT NULL);
            CREATE INDEX by_key ON messages (topic, key);"""


def rows(count: int, start: int = 0) -> list[tuple]:
    """(topic, queue_id, tags, key, body, born) for messages start..start+count."""
    body = os.urandom(BODY)
    now = int(time.time() * 1000)
    return [(TOPICS[i % 4], (i // 4) % 8, "TagA", f"key-{i}", body, now) for i in range(start, start + count)]


def as_messages(batch: list[tuple]) -> list[Message]:
    return [Message(t, b, tags=g, keys=[k], queue_id=q) for t, q, g, k, b, _ in batch]


def as_table(batch: list[tuple]) -> pa.Table:
    topic, queue_id, tags, key, body, _ = zip(*batch, strict=True)
    return pa.table({"topic": pa.array(topic), "body": pa.array(body, pa.binary()),
                     "keys": pa.array([[k] for k in key], pa.list_(pa.string())), "tags": pa.array(tags),
                     "queue_id": pa.array(queue_id, pa.int32())})


def sqlite_open(path: Path, synchronous: str = "NORMAL") -> sqlite3.Connection:
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute(f"PRAGMA synchronous={synchronous}")
    return db


def sqlite_create(path: Path, synchronous: str = "NORMAL") -> sqlite3.Connection:
    db = sqlite_open(path, synchronous)
    db.executescript(SCHEMA)
    return db


INSERT = "INSERT INTO messages (topic, queue_id, tags, key, body, born) VALUES (?, ?, ?, ?, ?, ?)"


def warm_rows() -> list[tuple]:
    """One message per queue, written before the clock starts: the store's first puts create a 1 GiB segment,
    a 420 MB index file and each queue's file, once per GiB of log (over 200,000 messages of this size that
    creation was ~10% of the run). Both engines get the same rows, so the rates are steady-state ones."""
    body = os.urandom(BODY)
    return [(topic, q, "TagA", f"warm-{topic}-{q}", body, int(time.time() * 1000)) for topic in TOPICS
            for q in range(8)]


def sqlite_ingest(path: Path, data: list[tuple], batch: int) -> float:
    db = sqlite_create(path)
    db.execute("BEGIN")
    db.executemany(INSERT, warm_rows())
    db.execute("COMMIT")
    started = time.perf_counter()
    for i in range(0, len(data), batch):
        db.execute("BEGIN")
        db.executemany(INSERT, data[i : i + batch])
        db.execute("COMMIT")
    seconds = time.perf_counter() - started
    db.close()
    return len(data) / seconds


INGEST_RUNS = 3  # this VM: one run of the same ingest varied 1.2-1.9 M msg/s (page-cache copies at times 10x slower)


def ingest_pair(tmp_path: Path, data: list[tuple], batch: int, runs: int) -> tuple[list[float], list[float], dict]:
    """Each engine's ingest rates over ``runs`` alternating runs (who goes first alternates too), and how far the
    store's dispatch fell behind its producer; the last run's database and store stay at ``ingest-<batch>.db``
    and ``store-<batch>`` for the reads that follow."""
    peer, ours, lags = [], [], []
    db, store = tmp_path / f"ingest-{batch}.db", tmp_path / f"store-{batch}"
    for run in range(runs):
        for path in (db, Path(f"{db}-wal"), Path(f"{db}-shm")):
            path.unlink(missing_ok=True)
        shutil.rmtree(store, ignore_errors=True)
        if run % 2:
            lags.append(store_ingest(store, data, batch))
            peer.append(sqlite_ingest(db, data, batch))
        else:
            peer.append(sqlite_ingest(db, data, batch))
            lags.append(store_ingest(store, data, batch))
        ours.append(lags[-1].pop("rate"))
    return peer, ours, {key: [lag[key] for lag in lags] for key in lags[0]}


def store_ingest(root: Path, data: list[tuple], batch: int) -> dict:
    """The rate (dispatch included), the largest dispatch lag seen (MB of log the consume queues and index were
    behind the producer, read after every table or every 64th smaller put) and how often a put waited for
    dispatch to catch up."""
    if batch >= 1000:
        prepared = [as_table(data[i : i + batch]) for i in range(0, len(data), batch)]
    else:
        msgs = as_messages(data)
        prepared = [msgs[i : i + batch] for i in range(0, len(msgs), batch)]
    with MessageStore.open(root, StoreConfig()) as store:
        store.put_messages(as_messages(warm_rows()))
        store.wait_for_dispatch(60)
        log, dispatcher = store.commit_log, store.dispatcher
        lag, every = 0, 0 if batch >= 1000 else 63  # after every table, every 64th smaller put
        started = time.perf_counter()
        for i, group in enumerate(prepared):
            if batch >= 1000:
                store.put_batch(group)
            elif batch == 1:
                store.put_message(group[0])
            else:
                store.put_messages(group)
            if not i & every:
                lag = max(lag, log.max_offset - dispatcher.reput_from_offset)
        store.wait_for_dispatch(60)
        return {"rate": len(data) / (time.perf_counter() - started), "dispatch_lag_max_MB": round(lag / 1e6, 1),
                "held_back": dispatcher.held_back}


def warm(*paths: Path) -> None:
    """Read every file under ``paths`` into the page cache. This VM pages out file data untouched for ~60 s
    (DAMON's pageout scheme), so a store or database left idle while the other ingest rows ran would be read
    back from disk by whichever lookups came first: both engines are measured warm instead."""
    for path in paths:
        for file in [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()):
            with open(file, "rb") as f:
                while f.read(1 << 22):
                    pass


def sqlite_lookups(path: Path, keys: list[tuple[str, str]]) -> np.ndarray:
    db = sqlite_open(path)
    latencies = np.empty(len(keys))
    query = "SELECT id, topic, queue_id, tags, key, body, born FROM messages WHERE topic = ? AND key = ?"
    for n, (topic, key) in enumerate(keys):
        started = time.perf_counter_ns()
        found = db.execute(query, (topic, key)).fetchall()
        latencies[n] = time.perf_counter_ns() - started
        assert found, key
    db.close()
    return latencies / 1000


def store_lookups(root: Path, keys: list[tuple[str, str]]) -> np.ndarray:
    latencies = np.empty(len(keys))
    with MessageStore.open(root, StoreConfig(), read_only=True) as store:
        for n, (topic, key) in enumerate(keys):
            started = time.perf_counter_ns()
            found = store.query_message(topic, key)
            latencies[n] = time.perf_counter_ns() - started
            assert found, key
    return latencies / 1000


def sqlite_many_lookups(path: Path, keys: list[tuple[str, str]]) -> tuple[float, int]:
    """All keys in one statement, SQLite's way: a temporary table of the keys joined on the index, into Arrow."""
    db = sqlite_open(path)
    started = time.perf_counter()
    db.execute("CREATE TEMP TABLE wanted (n INTEGER PRIMARY KEY, topic TEXT, key TEXT)")
    db.executemany("INSERT INTO wanted (topic, key) VALUES (?, ?)", keys)
    cursor = db.execute("SELECT w.topic, w.key, m.id, m.topic, m.queue_id, m.tags, m.key, m.body, m.born "
                        "FROM wanted w JOIN messages m ON m.topic = w.topic AND m.key = w.key ORDER BY w.n, m.id")
    rows = 0
    while chunk := cursor.fetchmany(8192):
        rows += pa.table({str(i): column for i, column in enumerate(zip(*chunk, strict=True))}).num_rows
    seconds = time.perf_counter() - started
    db.close()
    return len(keys) / seconds, rows


def store_many_lookups(root: Path, keys: list[tuple[str, str]]) -> tuple[float, int]:
    with MessageStore.open(root, StoreConfig(), read_only=True) as store:
        started = time.perf_counter()
        found = store.query_messages_arrow(keys)
        return len(keys) / (time.perf_counter() - started), found.num_rows


def sqlite_scan(path: Path) -> tuple[float, int]:
    db = sqlite_open(path)
    started = time.perf_counter()
    cursor = db.execute("SELECT id, topic, queue_id, tags, key, body, born FROM messages")
    names = [d[0] for d in cursor.description]
    count = 0
    while chunk := cursor.fetchmany(8192):
        columns = list(zip(*chunk, strict=True))
        table = pa.table(dict(zip(names, columns, strict=True)))
        count += table.num_rows
    seconds = time.perf_counter() - started
    db.close()
    return count / seconds, count


def store_scan(root: Path) -> tuple[float, int, int]:
    with MessageStore.open(root, StoreConfig(), read_only=True) as store:
        started = time.perf_counter()
        count = 0
        for batch in store.scan_arrow(check_crc=True):
            count += batch.num_rows
        seconds = time.perf_counter() - started
        return count / seconds, count, store.max_phy_offset - store.min_phy_offset


def threaded(put, threads: int, seconds: float) -> tuple[float, float, float, float]:
    """(puts/s, p50, p99 and mean latency in µs) of ``threads`` threads calling ``put(thread, i)`` for ``seconds``.

    With every thread always in a put, the mean is threads / rate (Little's law) whatever the order of service;
    a p50 below it means some puts waited far longer than the rest (SQLite's busy handler sleeps a loser
    1, 2, 5, 10... ms while the winner commits again)."""
    rate, latencies = run_threads(put, threads, seconds)
    spread = np.asarray(latencies, dtype=np.float64) / 1000
    p50, p99 = np.percentile(spread, [50, 99])
    return rate, float(p50), float(p99), float(spread.mean())


def sync_sqlite(path: Path, threads: int, seconds: float) -> tuple[float, float, float, float]:
    sqlite_create(path, "FULL").close()
    conns = [sqlite_open(path, "FULL") for _ in range(threads)]
    for db in conns:
        db.execute("PRAGMA busy_timeout=10000")
    data = rows(256)

    def put(n: int, i: int) -> None:
        conns[n].execute(INSERT, data[i % 256])  # autocommit: one transaction per row

    try:
        return threaded(put, threads, seconds)
    finally:
        for db in conns:
            db.close()


def sync_store(root: Path, threads: int, seconds: float) -> tuple[float, float, float, float]:
    msgs = as_messages(rows(256))
    with MessageStore.open(root, StoreConfig(flush_disk_type=FlushDiskType.SYNC_FLUSH)) as store:
        return threaded(lambda n, i: store.put_message(msgs[i % 256]), threads, seconds)


def warm_up(root: Path) -> None:
    """Load the compiled kernels (first-call cost is bench_scan's subject, not this comparison's)."""
    data = rows(2000)
    with MessageStore.open(root, StoreConfig()) as store:
        store.put_batch(as_table(data[:1000]))
        store.put_messages(as_messages(data[1000:]))
        store.wait_for_dispatch(60)
        store.query_message(TOPICS[0], "key-0")
        store.query_messages_arrow([(TOPICS[0], "key-0")])
        for _ in store.scan_arrow():
            pass


def run(quick: bool) -> list[Result]:
    count = 4_000 if quick else 200_000
    samples = 300 if quick else 20_000
    seconds = 0.3 if quick else 3.0
    data = rows(count)
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="rocketstore-peers-") as tmp:
        tmp_path = Path(tmp)
        warm_up(tmp_path / "warm-up")
        ingest = [(10_000 if not quick else 1000, "put_batch", 5.0), (32, "put_messages", 2.0),
                  (1, "put_message", 1.0)]
        for batch, api, target in ingest:
            n = count if batch > 1 else count // 4
            peer, ours, lags = ingest_pair(tmp_path, data[:n], batch, 1 if quick else INGEST_RUNS)
            results.append(Result("peers: ingest", f"{api}, batches of {batch:,} ({n:,} msgs)",
                                  float(np.median(ours)), "msg/s",
                                  f"SQLite executemany, {float(np.median(peer)):,.0f}/s", float(np.median(peer)),
                                  target, notes={"runs": [round(x) for x in ours],
                                                 "sqlite_runs": [round(x) for x in peer], **lags}))
            if batch != ingest[0][0]:  # only the first store is read below; each holds 1.4 GB of preallocated
                shutil.rmtree(tmp_path / f"store-{batch}")  # files, and a filling disk slowed the next row 2x
        full_db, full_store = tmp_path / f"ingest-{ingest[0][0]}.db", tmp_path / f"store-{ingest[0][0]}"
        rng = np.random.default_rng(7)
        keys = [(TOPICS[i % 4], f"key-{i}") for i in rng.integers(0, count, samples)]
        warm(full_store, *full_db.parent.glob(f"{full_db.name}*"))
        peer = sqlite_lookups(full_db, keys)
        ours = store_lookups(full_store, keys)
        results.append(Result("peers: key lookup", "query_message (verified) rate", 1e6 / ours.mean(), "queries/s",
                              f"SQLite indexed SELECT, {1e6 / peer.mean():,.0f}/s", 1e6 / peer.mean(), 1.5))
        p99, peer_p99 = float(np.percentile(ours, 99)), float(np.percentile(peer, 99))
        results.append(Result("peers: key lookup", "query_message p99", p99, "µs", f"SQLite p99 {peer_p99:.1f} µs",
                              peer_p99, notes={"target_p99_us": 50}, higher_is_better=False))
        peer_rate, peer_rows = sqlite_many_lookups(full_db, keys)
        rate, rows_found = store_many_lookups(full_store, keys)
        assert rows_found == peer_rows, (rows_found, peer_rows)
        results.append(Result("peers: key lookup", f"query_messages_arrow, {len(keys):,} keys in one call", rate,
                              "queries/s", f"SQLite temp-table JOIN into Arrow, {peer_rate:,.0f}/s", peer_rate))
        warm(full_store, *full_db.parent.glob(f"{full_db.name}*"))
        peer_rate, peer_rows = sqlite_scan(full_db)
        rate, scanned, log_bytes = store_scan(full_store)
        assert scanned == peer_rows == count + len(warm_rows()), (scanned, peer_rows, count)
        results.append(Result("peers: scan to Arrow", "scan_arrow with CRC", rate, "rows/s",
                              f"SQLite SELECT into Arrow, {peer_rate:,.0f}", peer_rate, 2.0,
                              notes={"log_MB_s": rate * log_bytes / scanned / 1e6}))
        for threads in (1, 4):
            peer_rate, peer_p50, peer_p99, peer_mean = sync_sqlite(tmp_path / f"sync-{threads}.db", threads, seconds)
            rate, p50, p99, mean = sync_store(tmp_path / f"sync-{threads}", threads, seconds)
            results.append(Result("peers: SYNC_FLUSH", f"{threads} thread{'s' * (threads > 1)}, put_message",
                                  rate, "msg/s", f"SQLite FULL 1-row txn, {peer_rate:,.0f}/s", peer_rate,
                                  2.0 if threads > 1 else None))
            results.append(Result("peers: SYNC_FLUSH", f"{threads} thread{'s' * (threads > 1)}, p50 latency", p50,
                                  "µs", f"SQLite p50 {peer_p50:,.0f} µs", peer_p50,
                                  1.0 if threads > 1 else None, higher_is_better=False))
            results.append(Result("peers: SYNC_FLUSH", f"{threads} thread{'s' * (threads > 1)}, p99 latency", p99,
                                  "µs", f"SQLite p99 {peer_p99:,.0f} µs", peer_p99, higher_is_better=False))
            results.append(Result("peers: SYNC_FLUSH", f"{threads} thread{'s' * (threads > 1)}, mean latency", mean,
                                  "µs", f"SQLite mean {peer_mean:,.0f} µs", peer_mean, higher_is_better=False))
    return results


def main() -> int:
    return bench_main("peers", run, __doc__.splitlines()[0])


if __name__ == "__main__":
    raise SystemExit(main())

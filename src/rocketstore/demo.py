"""The README's main job: build a small store, read it back, reopen it, and summarise.

Run with ``./dev demo`` (or ``python -m rocketstore.demo --store DIR``). The store goes to
``./demo-store`` by default and is rebuilt on every run; a directory that is not a demo store
is never deleted.
"""

from __future__ import annotations

import argparse
import atexit
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

from . import Message, MessageStore, StoreConfig
from .errors import RocketStoreError

MARKER = ".rocketstore-demo"
TOPICS = ("OrderCreated", "OrderPaid", "Shipment", "Audit")
QUEUES = 4


def _prepare(root: Path) -> None:
    if root.exists():
        if not (root / MARKER).exists() and any(root.iterdir()):
            raise SystemExit(f"error: {root} exists and is not a demo store; choose another --store")
        shutil.rmtree(root)
    root.mkdir(parents=True)
    (root / MARKER).write_text("created by rocketstore.demo; safe to delete\n")


def _messages(count: int):
    for i in range(count):
        topic = TOPICS[i % len(TOPICS)]
        yield Message(topic, f"{topic} #{i}: {'x' * (i % 200)}".encode(), tags=f"Tag{i % 3}",
                      keys=[f"order-{i // 4}", f"msg-{i}"], queue_id=(i // len(TOPICS)) % QUEUES,
                      properties={"source": "demo"})


def _found(messages) -> str:
    """'2 messages: "OrderPaid #37" (queue 1, offset 9), ...': what a person reads, not a list repr."""
    described = ", ".join(f'"{m.body.decode().partition(":")[0]}" (queue {m.queue_id}, offset {m.queue_offset})'
                          for m in messages)
    return f"{len(messages)} message{'' if len(messages) == 1 else 's'}" + (f": {described}" if messages else "")


def run(root: Path, count: int, spark_master: str | None = "local[*]", *, ship_env: bool = False,
        verbose: bool = False) -> int:
    _prepare(root)
    # 1 MiB segments so that even a small demo shows segment rolls; a 4.2 MB index instead of 420 MB.
    config = StoreConfig(mapped_file_size_commit_log=1 << 20, max_hash_slot_num=50_000, max_index_num=200_000)
    started = time.perf_counter()
    with MessageStore.open(root, config) as store:
        results = []
        batch: list[Message] = []
        for i, msg in enumerate(_messages(count)):
            if i % 2:
                batch.append(msg)
                if len(batch) == 32:
                    results += store.put_messages(batch)
                    batch = []
            else:
                results.append(store.put_message(msg))
        results += store.put_messages(batch)
        write_s = time.perf_counter() - started
        log_bytes = store.max_phy_offset

    started = time.perf_counter()
    with MessageStore.open(root, config) as store:  # reopen: recovery, then reads through queues and index
        recovery = store.recovery
        per_queue: Counter[tuple[str, int]] = Counter()
        for r in results:
            msg = store.look_message_by_offset(r.commit_log_offset)
            if msg.msg_id != r.msg_id or msg.queue_offset != r.queue_offset:
                raise SystemExit(f"demo: message at {r.commit_log_offset} does not read back as written")
            per_queue[(msg.topic, msg.queue_id)] += 1
        consumed = 0
        for topic, queue_id in per_queue:
            offset = 0
            while True:
                got = store.get_message(topic, queue_id, offset, max_msgs=32)
                consumed += len(got.messages)
                if not got.messages:
                    break
                offset = got.next_begin_offset
        by_key = store.query_message("OrderPaid", "order-9")
        by_id = store.view_message_by_id(results[len(results) // 4].msg_id)
        by_uniq = store.query_message_by_uniq_key(by_id.topic, by_id.uniq_key)
        tagged = store.get_message("Audit", 0, 0, max_msgs=1000, tags="Tag1")
        read_s = time.perf_counter() - started
        segments = len(store.commit_log.mapped_files.files)
        index_files = len(store.index.files)

    print(f"rocketstore demo: {root}")
    print(f"  wrote   {len(results):>7} messages ({log_bytes / 1e6:.2f} MB) in {write_s * 1000:.0f} ms "
          f"({len(results) / write_s:,.0f} msg/s; half single puts, half batches of 32)")
    print(f"  reopen  recovery checked {recovery.records_checked} records in {recovery.seconds * 1000:.1f} ms")
    print(f"  read    every message by commit-log offset, and {consumed} through the consume queues "
          f"({read_s * 1000:.0f} ms): all identical")
    print(f"  query   key 'order-9' in OrderPaid -> {_found(by_key)}")
    print(f"          msgId {by_id.msg_id} -> {by_id.topic} queue {by_id.queue_id} offset {by_id.queue_offset}")
    print(f"          UNIQ_KEY {by_id.uniq_key} -> {len(by_uniq)} message")
    print(f"          tag 'Tag1' in Audit queue 0 -> {len(tagged.messages)} of {per_queue[('Audit', 0)]}")
    print(f"  files   {segments} commit-log segments of 1 MiB, {len(per_queue)} consume queues, "
          f"{index_files} index file, checkpoint")
    for i, topic in enumerate(sorted({t for t, _ in per_queue})):
        counts = " ".join(f"{per_queue[(topic, q)]:>4}" for q in range(QUEUES))
        print(f"  {'queues' if i == 0 else '':<7} {topic:<13} messages in queues 0-{QUEUES - 1}: {counts}")
    if spark_master:
        _spark_step(root, config, spark_master, by_key, by_id, ship_env=ship_env, verbose=verbose)
    return 0


def _spark_step(root: Path, config: StoreConfig, master: str, by_key, by_id, *, ship_env: bool,
                verbose: bool) -> None:
    """Read the store as a DataFrame, summarise it, rebuild its queues and index in parallel, re-query."""
    from .spark import spark_session
    from .spark.jobs import messages_per_topic_and_minute, read_store, rebuild
    from .spark.session import stop_quietly

    started = time.perf_counter()
    spark = spark_session(master, "rocketstore-demo", ship_env=ship_env, verbose=verbose)
    atexit.register(stop_quietly, spark)  # no daemon traceback after the last line
    df = read_store(spark, root, columns=["topic", "storeTimestamp"], maxBytesPerPartition=256 << 10)
    per_topic, per_minute = messages_per_topic_and_minute(df)
    print(f"  spark   {master}, {df.rdd.getNumPartitions()} partitions over the commit log "
          f"(session ready in {time.perf_counter() - started:.1f} s)")
    print("          messages per topic: " + ", ".join(f"{r.topic} {r['count']}" for r in per_topic.collect()))
    print("          messages per minute: " + ", ".join(f"{r.minute:%H:%M} {r['count']}" for r in per_minute.collect()))
    report = rebuild(root, spark=spark, config=config, max_bytes_per_partition=256 << 10)
    print(f"  rebuild {report.records} records -> {report.queue_units} queue units in {report.queues} queues, "
          f"{report.index_keys} index keys in {report.index_files} file(s), {report.partitions} partitions, "
          f"{report.seconds:.1f} s (old files kept in recovery/)")
    with MessageStore.open(root, config, read_only=True) as store:
        same_key = [m.msg_id for m in store.query_message("OrderPaid", "order-9")] == [m.msg_id for m in by_key]
        same_id = store.view_message_by_id(by_id.msg_id).msg_id == by_id.msg_id
    if not (same_key and same_id):
        raise SystemExit("demo: the rebuilt index answers differently")
    print("          the rebuilt queues and index answer the same queries")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rocketstore-demo", description=__doc__.splitlines()[0])
    parser.add_argument("--store", type=Path, default=Path("demo-store"), help="where to build the demo store")
    parser.add_argument("--messages", type=int, default=5000, help="how many messages to write")
    parser.add_argument("--master", default="local[*]", help="Spark master for the pipeline step")
    parser.add_argument("--no-spark", action="store_true", help="skip the Spark step")
    args = parser.parse_args(argv)
    try:
        return run(args.store, args.messages, None if args.no_spark else args.master)
    except RocketStoreError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())

"""The README's main job: build a small store, read it back, reopen it, and summarise.

Run with ``./dev demo`` (or ``python -m rocketstore.demo --store DIR``). The store goes to
``./demo-store`` by default and is rebuilt on every run; a directory that is not a demo store
is never deleted.
"""

from __future__ import annotations

import argparse
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
            raise SystemExit(f"demo: {root} exists and is not a demo store; choose another --store")
        shutil.rmtree(root)
    root.mkdir(parents=True)
    (root / MARKER).write_text("created by rocketstore.demo; safe to delete\n")


def _messages(count: int):
    for i in range(count):
        topic = TOPICS[i % len(TOPICS)]
        yield Message(topic, f"{topic} #{i}: {'x' * (i % 200)}".encode(), tags=f"Tag{i % 3}",
                      keys=[f"order-{i // 4}", f"msg-{i}"], queue_id=(i // len(TOPICS)) % QUEUES,
                      properties={"source": "demo"})


def run(root: Path, count: int) -> int:
    _prepare(root)
    # 1 MiB segments so that even a small demo shows segment rolls.
    config = StoreConfig(mapped_file_size_commit_log=1 << 20)
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
    with MessageStore.open(root, config, read_only=True) as store:
        per_queue: Counter[tuple[str, int]] = Counter()
        for r in results:
            msg = store.look_message_by_offset(r.commit_log_offset)
            if msg.msg_id != r.msg_id or msg.queue_offset != r.queue_offset:
                raise SystemExit(f"demo: message at {r.commit_log_offset} does not read back as written")
            per_queue[(msg.topic, msg.queue_id)] += 1
        scanned = sum(1 for _ in store.iter_messages())
        read_s = time.perf_counter() - started
        segments = len(store.commit_log.mapped_files.files)
        recovery = store.recovery

    print(f"rocketstore demo: {root}")
    print(f"  wrote   {len(results):>7} messages ({log_bytes / 1e6:.2f} MB) in {write_s * 1000:.0f} ms "
          f"({len(results) / write_s:,.0f} msg/s; half single puts, half batches of 32)")
    print(f"  read    {len(results):>7} messages back by commit-log offset and scanned {scanned} "
          f"in {read_s * 1000:.0f} ms: all identical")
    print(f"  reopen  recovery checked {recovery.records_checked} records in {recovery.seconds * 1000:.1f} ms, "
          f"log ends at {recovery.end_offset}")
    print(f"  files   {segments} commit-log segments of 1 MiB, checkpoint, lock")
    print("  queues  topic, queue id: messages")
    for (topic, queue_id), n in sorted(per_queue.items()):
        print(f"          {topic:<13} {queue_id}: {n:>5}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rocketstore-demo", description=__doc__.splitlines()[0])
    parser.add_argument("--store", type=Path, default=Path("demo-store"), help="where to build the demo store")
    parser.add_argument("--messages", type=int, default=5000, help="how many messages to write")
    args = parser.parse_args(argv)
    try:
        return run(args.store, args.messages)
    except RocketStoreError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())

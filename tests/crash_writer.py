"""Crash-test writer: ``python tests/crash_writer.py ROOT SEED MODE`` (MODE: SYNC_FLUSH or ASYNC_FLUSH).

Opens the store at ROOT with small commit-log segments and runs ``THREADS`` producer threads that
write until the process is killed. Each thread follows a plan fixed by (SEED, thread): a run of
single puts and all-or-nothing batches (``put_messages`` of 2..``MAX_BATCH`` messages, or the same rows as a
``put_batch`` table), and now and then a table larger than a segment (``LARGE_TABLE`` rows). Every
message carries its sequence id ``SEED-thread-n`` in the ``CRASH_SEQ`` property, and its topic,
queue id, tags, keys and body are derived from that id alone (``message_spec``), so a checker can
recompute any message it finds in the log, acknowledged or not.

After a put returns, one JSON line per message is written to stdout and flushed: the line is the
acknowledgement. ``tests/test_crash.py`` imports the generator and the config from here, so both
sides always agree.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import threading
import traceback
from collections.abc import Iterator
from dataclasses import dataclass

from rocketstore import FlushDiskType, Message, MessageStore, PutMessageResult, StoreConfig

SEGMENT_SIZE = 64 * 1024  # a commit-log roll every 20-40 messages
CQ_FILE_UNITS = 500  # a consume-queue roll every 500 messages of a queue
THREADS = 3
TOPICS = ("CrashOrders", "CrashEvents", "CrashAudit")
QUEUES = 4
TAGS = (None, "TagA", "TagB", "TagC")
MAX_BODY = 3000
MAX_BATCH = 8
LARGE_TABLE = range(40, 90)  # rows of the rare ``put_batch`` table larger than a segment (written in parts)
SEQ_PROPERTY = "CRASH_SEQ"


def store_config(mode: str) -> StoreConfig:
    """The crash store's config: small files, so rolls are frequent, and background flushes, dispatch
    and checkpoints that run often enough for a kill to land in them."""
    return StoreConfig(mapped_file_size_commit_log=SEGMENT_SIZE, mapped_file_size_consume_queue=CQ_FILE_UNITS * 20,
                       max_hash_slot_num=4099, max_index_num=20_000, flush_disk_type=FlushDiskType(mode),
                       flush_interval_commit_log=10, flush_commit_log_thorough_interval=100,
                       flush_interval_consume_queue=10, flush_consume_queue_thorough_interval=50)


# --- the deterministic workload ---------------------------------------------------------------

def seq_id(seed: int, thread: int, n: int) -> str:
    return f"{seed}-{thread}-{n}"


def parse_seq_id(seq: str) -> tuple[int, int, int]:
    """(seed, thread, n) of a sequence id."""
    seed, thread, n = seq.split("-")
    return int(seed), int(thread), int(n)


@dataclass(frozen=True, slots=True)
class MessageSpec:
    """Everything about a message that its sequence id determines."""

    seq: str
    topic: str
    queue_id: int
    tags: str | None
    keys: tuple[str, ...]
    body: bytes

    def message(self) -> Message:
        return Message(self.topic, self.body, tags=self.tags, keys=list(self.keys), queue_id=self.queue_id,
                       properties={SEQ_PROPERTY: self.seq})


def message_spec(seq: str) -> MessageSpec:
    rng = random.Random(seq)
    size = rng.randint(0, MAX_BODY)
    kind = rng.randrange(4)
    if kind == 0:  # zeros: a body must never be mistaken for the zeroed space after the log
        body = bytes(size)
    elif kind == 1:  # text
        body = (f"{seq}|" * (size // (len(seq) + 1) + 1)).encode()[:size]
    else:
        body = rng.randbytes(size)
    keys = tuple(f"key-{seq}-{i}" for i in range(rng.randint(1, 3)))
    return MessageSpec(seq, rng.choice(TOPICS), rng.randrange(QUEUES), rng.choice(TAGS), keys, body)


def thread_plan(seed: int, thread: int) -> Iterator[range]:
    """The puts of one producer thread, in order: each a range of message numbers n (one put call)."""
    rng = random.Random(f"plan-{seed}-{thread}")
    n = 0
    while True:
        draw = rng.random()
        if draw < 0.03:  # a table larger than a segment: its segments reserved first, then written one by one
            count = rng.randint(LARGE_TABLE.start, LARGE_TABLE.stop - 1)
        else:
            count = 1 if draw < 0.5 else rng.randint(2, MAX_BATCH)
        yield range(n, n + count)
        n += count


def written_in_parts(put: range) -> bool:
    """A put a kill may cut between rows: a table larger than a segment keeps a prefix of whole rows."""
    return len(put) > MAX_BATCH


def body_digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def ack_line(spec: MessageSpec, result: PutMessageResult) -> str:
    return json.dumps({
        "seq": spec.seq, "topic": spec.topic, "queue_id": spec.queue_id, "tags": spec.tags, "keys": list(spec.keys),
        "body_len": len(spec.body), "body_sha256": body_digest(spec.body), "status": result.status.value,
        "commit_log_offset": result.commit_log_offset, "queue_offset": result.queue_offset,
        "msg_id": result.msg_id, "uniq_key": result.uniq_key, "store_size": result.store_size,
        "store_timestamp": result.store_timestamp,
    }, separators=(",", ":"))


# --- the process -------------------------------------------------------------------------------

_out_lock = threading.Lock()


def put_table(store: MessageStore, specs: list[MessageSpec]) -> list[PutMessageResult]:
    """The batch as a pyarrow table through ``put_batch``, its columnar result as one result per row."""
    import pyarrow as pa

    table = pa.table({
        "topic": pa.array([s.topic for s in specs], pa.string()),
        "body": pa.array([s.body for s in specs], pa.binary()),
        "keys": pa.array([list(s.keys) for s in specs], pa.list_(pa.string())),
        "tags": pa.array([s.tags for s in specs], pa.string()),
        "queue_id": pa.array([s.queue_id for s in specs], pa.int32()),
        "properties": pa.array([[(SEQ_PROPERTY, s.seq)] for s in specs], pa.map_(pa.string(), pa.string())),
    })
    got = store.put_batch(table)
    return [PutMessageResult(got.status, got.msg_ids[i].as_py(), got.uniq_keys[i].as_py(),
                             int(got.commit_log_offsets[i]), int(got.queue_offsets[i]), got.store_timestamp,
                             int(got.store_sizes[i])) for i in range(len(specs))]


def produce(store: MessageStore, seed: int, thread: int) -> None:
    try:
        for numbers in thread_plan(seed, thread):
            specs = [message_spec(seq_id(seed, thread, n)) for n in numbers]
            if len(specs) == 1:
                results = [store.put_message(specs[0].message())]
            elif numbers.start % 3 == 0 or written_in_parts(numbers):
                results = put_table(store, specs)
            else:
                results = store.put_messages([s.message() for s in specs])
            for spec, result in zip(specs, results, strict=True):
                line = ack_line(spec, result)
                with _out_lock:
                    sys.stdout.write(line + "\n")
                    sys.stdout.flush()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def main(argv: list[str]) -> None:
    if len(argv) != 3:
        sys.exit(__doc__.splitlines()[0])
    root, seed, mode = argv[0], int(argv[1]), argv[2]
    store = MessageStore.open(root, store_config(mode))
    threads = [threading.Thread(target=produce, args=(store, seed, t), daemon=True) for t in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


if __name__ == "__main__":
    main(sys.argv[1:])

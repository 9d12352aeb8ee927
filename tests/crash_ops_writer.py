"""Run one store operation in a loop until killed: ``python crash_ops_writer.py ROOT OP RUN START``.

For ``test_crash_ops.py``. Prints ``open`` once the store is open, then one JSON line per acknowledged
step, flushed before the next step starts, so every line the test reads is a promise the store made
before the kill. Keys carry RUN, so no two runs put the same key; START is how many topic operations
earlier runs acknowledged (the sequence resumes there: each operation is idempotent). OP is one of ``OPS``:

* retention: put 8 keyed messages, then delete every expired segment at once; lines
  ``{"put": ...}`` per message and ``{"min": phy}`` after each deletion;
* topics: create and delete topics in a fixed sequence, with a put between; ``{"op": k}`` after the
  k-th create/delete returned, ``{"put": ...}`` per acknowledged put;
* delay: put DELAY level 1 (1 s) messages while the store delivers earlier ones; ``{"put": ...}``;
* offsets: put, commit an offset and persist it; a consumer polls, commits and persists too;
  ``{"persisted": [group, queue, offset]}`` once persisted.
"""

from __future__ import annotations

import json
import sys
import time

from rocketstore import Message, MessageStore, PutMessageResult, StoreConfig

OPS = ("retention", "topics", "delay", "offsets")
CONFIG_ARGS = dict(mapped_file_size_commit_log=16 * 1024, mapped_file_size_consume_queue=20 * 40,
                   max_hash_slot_num=211, max_index_num=2000, flush_interval_commit_log=10,
                   flush_consumer_offset_interval=200, message_delay_level="1s 2s")
MADE_TOPICS = 7  # the topics the ``topics`` op creates and deletes
FAR_FUTURE_MS = 10**15  # every closed segment has expired by then


def store_config(**overrides) -> StoreConfig:
    return StoreConfig(**(CONFIG_ARGS | overrides))


def topic_op(k: int) -> tuple[str, str, int]:
    """The k-th operation of the ``topics`` loop: ("create", topic, queues) or ("delete", topic, 0)."""
    if k % 2 == 0:
        return "create", f"Made{(k // 2) % MADE_TOPICS}", 1 + (k // 2) % 8
    return "delete", f"Made{(k // 2 + 3) % MADE_TOPICS}", 0


def topics_after(ops: int) -> dict[str, int]:
    """Made topics and their write queue numbers after the first ``ops`` operations."""
    state: dict[str, int] = {}
    for k in range(ops):
        kind, topic, queues = topic_op(k)
        if kind == "create":
            state[topic] = queues
        else:
            state.pop(topic, None)
    return state


def say(line: dict) -> None:
    sys.stdout.write(json.dumps(line, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def put_line(key: str, result: PutMessageResult, queue_id: int) -> dict:
    return {"put": key, "phy": result.commit_log_offset, "queue_id": queue_id, "queue_offset": result.queue_offset,
            "uniq": result.uniq_key, "status": result.status.value}


def run(store: MessageStore, op: str, run_id: int, start: int) -> None:
    ops_done = start
    n = 0
    consumer = store.consumer("g2", "C", auto_commit=False) if op == "offsets" else None
    while True:
        n += 1
        if op == "retention":
            keys = [f"r{run_id}-{n}-{i}" for i in range(8)]
            msgs = [Message("R", f"{key}|".encode() * 40, keys=[key], queue_id=i % 2) for i, key in enumerate(keys)]
            for msg, result in zip(msgs, store.put_messages(msgs), strict=True):
                say(put_line(msg.keys[0], result, msg.queue_id))
            # no wait for dispatch: retention must keep the segments dispatch has not read (the check finds every
            # message it kept in its queue and by key)
            store.delete_expired_files(now_ms=FAR_FUTURE_MS, immediately=True)
            say({"min": store.min_phy_offset})
        elif op == "topics":
            kind, topic, queues = topic_op(ops_done)
            if kind == "create":
                store.create_topic(topic, queues)
            else:
                store.delete_topic(topic)
            ops_done += 1
            say({"op": ops_done})
            key = f"k{run_id}-{n}"
            say(put_line(key, store.put_message(Message("Keep", key.encode(), keys=[key])), 0))
        elif op == "delay":
            key = f"d{run_id}-{n}"
            say(put_line(key, store.put_message(Message("Late", key.encode(), keys=[key], properties={"DELAY": "1"})),
                         0))
            time.sleep(0.002)
        elif op == "offsets":
            queue_id = n % 2
            result = store.put_message(Message("C", f"c{n}".encode(), queue_id=queue_id))
            store.commit_offset("g", "C", queue_id, result.queue_offset + 1)
            store.consumer_offsets.persist(force=True)
            say({"persisted": ["g", queue_id, result.queue_offset + 1]})
            assert consumer is not None
            if consumer.poll(timeout=0):
                consumer.commit()
                store.consumer_offsets.persist(force=True)
                for q in (0, 1):
                    say({"persisted": ["g2", q, store.consumer_offsets.query("g2", "C", q)]})
        else:
            raise SystemExit(f"unknown op {op}")


def main(argv: list[str]) -> None:
    if len(argv) != 4 or argv[1] not in OPS:
        sys.exit(__doc__.splitlines()[0])
    root, op, run_id, start = argv[0], argv[1], int(argv[2]), int(argv[3])
    store = MessageStore.open(root, store_config())
    print("open", flush=True)
    run(store, op, run_id, start)


if __name__ == "__main__":
    main(sys.argv[1:])

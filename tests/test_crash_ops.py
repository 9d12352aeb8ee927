"""SIGKILL during the operations the main crash loop does not exercise: retention, topic create/delete,
delayed-message delivery, consumer-offset commits, and the Spark rebuild.

Each cycle runs ``OPS_WRITER`` doing one operation in a loop (with puts around it), kills it at a random
moment (seeded; the seed is in every assertion message) and reopens the store here, which runs crash
recovery, then checks what that operation promises. CI runs a few cycles of each; ``-m slow`` runs more.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rocketstore import Message, MessageStore, StoreConfig
from rocketstore.brokerconfig import parse_fastjson

SEED = int(os.environ.get("ROCKETSTORE_CRASH_SEED", "7070"))
CONFIG_ARGS = dict(mapped_file_size_commit_log=32 * 1024, mapped_file_size_consume_queue=20 * 40,
                   max_hash_slot_num=211, max_index_num=2000, flush_interval_commit_log=10,
                   flush_consumer_offset_interval=20, message_delay_level="1s 2s")
CONFIG = StoreConfig(**CONFIG_ARGS)

OPS_WRITER = textwrap.dedent("""
    import json, sys, time
    from rocketstore import Message, MessageStore, StoreConfig
    root, op, config_args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    store = MessageStore.open(root, StoreConfig(**config_args))
    print("open", flush=True)
    n = 0
    while True:
        n += 1
        if op == "retention":
            store.put_messages([Message("R", f"r{n}-{i}".encode() * 20, keys=[f"r{n}-{i}"]) for i in range(8)])
            store.delete_expired_files(now_ms=time.time_ns() // 1_000_000 + 10**12, immediately=True)
        elif op == "topics":
            store.create_topic(f"Made{n % 7}", 1 + n % 8)
            store.delete_topic(f"Made{(n + 3) % 7}")
            store.put_message(Message("Keep", f"k{n}".encode(), keys=[f"k{n}"]))
        elif op == "delay":
            result = store.put_message(Message("Late", f"d{n}".encode(), keys=[f"d{n}"],
                                                properties={"DELAY": "1"}))
            print(json.dumps({"acked": f"d{n}"}), flush=True)
            time.sleep(0.005)
        elif op == "offsets":
            store.put_message(Message("C", f"c{n}".encode(), queue_id=n % 2))
            store.commit_offset("g", "C", n % 2, n)
            store.consumer_offsets.persist(force=True)
            print(json.dumps({"committed": [n % 2, n]}), flush=True)
""")


def run_and_kill(root: Path, op: str, rng: random.Random, log: Path) -> list[dict]:
    with open(log, "ab") as err:
        proc = subprocess.Popen([sys.executable, "-c", OPS_WRITER, str(root), op, json.dumps(CONFIG_ARGS)],
                                stdout=subprocess.PIPE, stderr=err, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "open", log.read_text()[-2000:]
    time.sleep(rng.uniform(0.05, 0.6))
    proc.send_signal(signal.SIGKILL)
    out, _ = proc.communicate(timeout=30)
    return [json.loads(line) for line in out.splitlines() if line.startswith("{") and line.endswith("}")]


def config_files_parse(root: Path) -> None:
    for name in ("topics.json", "consumerOffset.json", "delayOffset.json", "subscriptionGroup.json"):
        for path in (root / "config" / name, root / "config" / (name + ".bak")):
            if path.exists():
                assert isinstance(parse_fastjson(path.read_text(encoding="utf-8")), dict), f"{path} does not parse"


def queue_messages(store: MessageStore, topic: str, queue_id: int, start: int = 0) -> list:
    """Every message of a queue from ``start`` (get_message answers one consume-queue file at a time)."""
    return list(store.reader.iter_queue(topic, queue_id, start))


def cycles(request) -> int:
    return 12 if request.config.getoption("-m") == "slow" else 3


@pytest.mark.parametrize("op", ["retention", "topics", "delay", "offsets"])
def test_sigkill_during_an_operation_keeps_its_promises(tmp_path, op, request):
    rng = random.Random(f"{SEED}-{op}")
    root = tmp_path / "store"
    acked: list[str] = []
    committed: dict[int, int] = {}
    for cycle in range(cycles(request)):
        lines = run_and_kill(root, op, rng, tmp_path / "writer.log")
        acked += [line["acked"] for line in lines if "acked" in line]
        for line in lines:
            if "committed" in line:
                committed[line["committed"][0]] = line["committed"][1]
        where = f"seed {SEED}, op {op}, cycle {cycle}"
        config_files_parse(root)
        with MessageStore.open(root, CONFIG) as store:
            assert store.recovery.abnormal, where
            store.wait_for_dispatch(10)
            if op == "retention":
                low = store.min_phy_offset
                for msg in store.iter_messages():
                    assert msg.commit_log_offset >= low
                    assert [m.commit_log_offset for m in store.query_message("R", msg.keys[0])] == \
                        [msg.commit_log_offset], where
                queue_min = store.get_min_offset_in_queue("R", 0)
                got = queue_messages(store, "R", 0, queue_min)
                assert all(m.commit_log_offset >= low for m in got), where
            elif op == "topics":
                assert store.topic_config.get("Keep") is not None, where
                keep = queue_messages(store, "Keep", 0)
                assert [m.queue_offset for m in keep] == list(range(len(keep))), where
            elif op == "delay":
                deadline = time.monotonic() + 10
                delivered: set[str] = set()
                while time.monotonic() < deadline and not set(acked) <= delivered:
                    delivered = {m.keys[0] for q in range(8) for m in queue_messages(store, "Late", q)}
                    time.sleep(0.1)
                missing = set(acked) - delivered
                assert not missing, f"{where}: delayed messages never delivered: {sorted(missing)[:5]}"
            elif op == "offsets":
                for queue_id, offset in committed.items():
                    # persisted before the acknowledgement line was printed: never lost or moved back
                    assert store.query_offset("g", "C", queue_id) >= offset, where
        config_files_parse(root)


def test_sigkill_during_a_rebuild_leaves_a_store_that_rebuilds_itself(tmp_path):
    """The Spark rebuild builds consume queues and index aside and renames them in when complete; killed at
    any point, the reopened store has whole queues and index (rebuilding whatever is missing)."""
    pytest.importorskip("pyspark")
    root = tmp_path / "store"
    with MessageStore.open(root, CONFIG) as store:
        for i in range(300):
            store.put_message(Message(f"T{i % 3}", f"b{i}".encode(), keys=[f"k{i}"], queue_id=i % 4))
    cli = Path(sys.executable).with_name("rocketstore")
    rng = random.Random(SEED)
    for cycle in range(2):
        proc = subprocess.Popen([str(cli), "rebuild", "--store", str(root), "--master", "local[1]"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        time.sleep(rng.uniform(2.0, 9.0) if cycle == 0 else 12.0)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        with MessageStore.open(root, CONFIG) as store:
            store.wait_for_dispatch(10)
            for t in range(3):
                for q in range(4):
                    got = queue_messages(store, f"T{t}", q)
                    assert len(got) == 25, f"cycle {cycle}: queue T{t}-{q} has {len(got)} of 25"
            assert all(len(store.query_message(f"T{i % 3}", f"k{i}")) == 1 for i in range(300))

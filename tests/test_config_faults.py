"""config/*.json under concurrent writers and hostile content (issue #11, items 4 and 5)."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from rocketstore import Message, MessageStore, StoreConfig
from rocketstore.brokerconfig import parse_fastjson

CONFIG = StoreConfig(mapped_file_size_commit_log=64 << 10, mapped_file_size_consume_queue=20 * 100,
                     max_hash_slot_num=97, max_index_num=388, flush_consumer_offset_interval=10)
CONFIG_FILES = ("consumerOffset.json", "subscriptionGroup.json", "topics.json")


# --- item 4: concurrent consumers ---------------------------------------------------------------------------------

def _read_while_writing(config_dir: Path, stop: threading.Event, problems: list[str], reads: list[int]) -> None:
    """Parse every config file and its backup in a loop: a main file must always exist and parse once it has
    appeared, and a backup that exists must parse."""
    seen: set[str] = set()
    while not stop.is_set():
        for name in CONFIG_FILES:
            for path, is_main in ((config_dir / name, True), (config_dir / f"{name}.bak", False)):
                try:
                    raw = path.read_bytes()
                except FileNotFoundError:
                    if is_main and name in seen:
                        problems.append(f"{name} vanished")
                    continue
                if is_main:
                    seen.add(name)
                try:
                    parse_fastjson(raw.decode("utf-8"))
                except ValueError as exc:
                    problems.append(f"{path.name} torn ({len(raw)} bytes): {exc}")
                reads[0] += 1


def test_concurrent_consumers_never_tear_or_lose_config_files(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    workers, duration = 4, 2.0
    stop = threading.Event()
    errors: list[BaseException] = []
    problems: list[str] = []
    reads = [0]
    with MessageStore.open(tmp_path, CONFIG) as store:
        store.create_topic("T", 4)
        store.put_messages([Message("T", f"m{i}".encode(), queue_id=i % 4) for i in range(200)])
        store.wait_for_dispatch()

        def work(worker: int) -> None:
            rounds = 0
            try:
                while not stop.is_set():
                    group = f"G{worker}_{rounds % 7}"  # new groups for a while (subscriptionGroup.json writes)
                    with store.consumer(group, "T", batch_size=5) as consumer:
                        consumer.poll(timeout=0)
                        consumer.poll(timeout=0)  # commits the first batch
                    store.commit_offset(group, "T", worker % 4, rounds)
                    rounds += 1
            except BaseException as exc:  # every failure of a worker fails the test
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(workers)]
        reader = threading.Thread(target=_read_while_writing, args=(tmp_path / "config", stop, problems, reads))
        for thread in [*threads, reader]:
            thread.start()
        time.sleep(duration)  # the workload's length, not a synchronisation
        stop.set()
        for thread in [*threads, reader]:
            thread.join()
        expected = {f"T@{group}": store.consumer_offsets.offsets(group, "T")
                    for _, group in store.consumer_offsets.groups("T")}
        groups = set(store.subscription_groups.groups)
        store.consumer_offsets.persist(force=True)
        store.consumer_offsets.persist(force=True)  # the backup now holds the final table too
    assert not errors, f"{len(errors)} worker errors, first: {errors[0]!r}"
    assert not problems, f"{len(problems)} bad reads of {reads[0]}, first: {problems[:3]}"
    failures = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not failures, failures[:3]
    assert reads[0] > 100 and len(expected) == workers * 7
    config_dir = tmp_path / "config"
    for path in (config_dir / "consumerOffset.json", config_dir / "consumerOffset.json.bak"):
        table = parse_fastjson(path.read_text())["offsetTable"]
        assert {k: v for k, v in table.items() if k in expected} == expected, path.name
    for path in (config_dir / "subscriptionGroup.json", config_dir / "subscriptionGroup.json.bak"):
        assert set(parse_fastjson(path.read_text())["subscriptionGroupTable"]) <= groups
    assert set(parse_fastjson((config_dir / "subscriptionGroup.json").read_text())["subscriptionGroupTable"]) == \
        groups
    assert not [p.name for p in config_dir.iterdir() if ".tmp" in p.name], "no temporary files left behind"

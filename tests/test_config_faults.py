"""config/*.json under concurrent writers and hostile content (issue #11, items 4 and 5)."""

from __future__ import annotations

import errno
import json
import logging
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from rocketstore import Message, MessageStore, StoreConfig
from rocketstore.brokerconfig import (
    ConsumerOffsetManager,
    DelayOffsetManager,
    OffsetTable,
    SubscriptionGroupManager,
    TopicConfigManager,
    parse_fastjson,
    to_fastjson,
)
from rocketstore.errors import ConfigError, ConfigFileError, InvalidQueueError, RocketStoreError
from test_cli import cli

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
    done_rounds = [0] * workers
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
                    done_rounds[worker] = rounds
            except BaseException as exc:  # every failure of a worker fails the test
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(workers)]
        reader = threading.Thread(target=_read_while_writing, args=(tmp_path / "config", stop, problems, reads))
        for thread in [*threads, reader]:
            thread.start()
        time.sleep(duration)  # the workload's length, not a synchronisation
        deadline = time.monotonic() + 60  # and every worker through its 7 groups (a loaded machine: 27 of 28 in 2 s)
        while min(done_rounds) < 7 and time.monotonic() < deadline:
            time.sleep(0.05)
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



def test_two_managers_of_one_file_write_it_from_many_threads(tmp_path):
    """persist_text is safe by itself: writers of one path share its lock, whichever manager they use."""
    managers = [ConsumerOffsetManager(tmp_path), ConsumerOffsetManager(tmp_path)]
    stop = threading.Event()
    errors: list[BaseException] = []
    problems: list[str] = []
    reads = [0]

    def write(worker: int) -> None:
        offsets = managers[worker % 2]
        try:
            for n in range(40):
                offsets.commit(f"g{worker}", "T", 0, n)
                offsets.persist(force=True)
        except BaseException as exc:  # every failure of a writer fails the test
            errors.append(exc)

    writers = [threading.Thread(target=write, args=(i,)) for i in range(6)]
    reader = threading.Thread(target=_read_while_writing, args=(tmp_path / "config", stop, problems, reads))
    for thread in [reader, *writers]:
        thread.start()
    for thread in writers:
        thread.join()
    stop.set()
    reader.join()
    assert not errors, f"{len(errors)} writer errors, first: {errors[0]!r}"
    assert not problems, problems[:3]
    assert not [p.name for p in (tmp_path / "config").iterdir() if ".tmp" in p.name]


# --- item 5: hostile content ------------------------------------------------------------------------------------

MANAGERS = {"topics.json": TopicConfigManager, "consumerOffset.json": ConsumerOffsetManager,
            "delayOffset.json": DelayOffsetManager, "subscriptionGroup.json": SubscriptionGroupManager}
GOOD = {"topics.json": '{"topicConfigTable":{"T":{"readQueueNums":4,"writeQueueNums":4,"perm":6}}}',
        "consumerOffset.json": '{"offsetTable":{"T@g":{0:7,1:8}}}',
        "delayOffset.json": '{"offsetTable":{1:3,2:4}}',
        "subscriptionGroup.json": '{"subscriptionGroupTable":{"g":{"groupName":"g","retryMaxTimes":16}}}'}
# (file, content, what the error must name)
HOSTILE = [
    ("topics.json", b'{"topicConfigTable": {"T": {"writeQueueNums": \xff}}}', "not UTF-8"),
    ("topics.json", b"[" * 100_000, "nests too deeply"),
    ("topics.json", b'{"a":' * 100_000, "nests too deeply"),
    ("topics.json", b'{"topicConfigTable": []}', "topicConfigTable must be an object, not a list"),
    ("topics.json", b'{"topicConfigTable": {"T": {"writeQueueNums": "x"}}}',
     "topicConfigTable.T.writeQueueNums must be an integer 0..65535, not 'x'"),
    ("topics.json", b'{"topicConfigTable": {"T": {"readQueueNums": -1}}}', "topicConfigTable.T.readQueueNums"),
    ("topics.json", b'{"topicConfigTable": {"T": {"readQueueNums": 100000000000}}}', "T.readQueueNums"),
    ("topics.json", b'{"topicConfigTable": {"T": {"writeQueueNums": true}}}', "not true"),
    ("topics.json", b'{"topicConfigTable": {"T": {"perm": "6"}}}', "topicConfigTable.T.perm"),
    ("topics.json", b'{"topicConfigTable": {"T": {"perm": 6.0}}}', "topicConfigTable.T.perm"),
    ("topics.json", b'{"topicConfigTable": {"T": {"order": 1}}}', "topicConfigTable.T.order must be true or false"),
    ("topics.json", b'{"topicConfigTable": {"T": {"attributes": {"a": 1}}}}', "T.attributes.a must be a string"),
    ("topics.json", b'{"topicConfigTable": {"T": "x"}}', "topicConfigTable.T must be an object"),
    ("topics.json", b'{"topicConfigTable": {"T": {"perm": NaN}}}', "NaN"),
    ("topics.json", b'{"topicConfigTable": {"T": {"perm": -Infinity}}}', "Infinity"),
    ("topics.json", b'{"x": 1e400}', "out of range"),
    ("topics.json", b'{"topicConfigTable": {"T": {}, "T": {}}}', "duplicate key 'T'"),
    ("topics.json", b'{"topicConfigTable": {"\\ud800": {}}}', r"topicConfigTable.\ud800 holds an unpaired"),
    ("topics.json", b'{"topicConfigTable": {"T\\u0007": 5}}', r"topicConfigTable.T\x07 must be an object"),
    ("topics.json", b'{"topicConfigTable": {"": {}}}', "empty name"),
    ("topics.json", b'{"x": ' + b"[" * 70 + b"]" * 70 + b"}", "nests deeper than 64"),
    ("topics.json", b"[]", "must be an object, not a list"),
    ("topics.json", b"null", "must be an object, not null"),
    ("topics.json", b'{"topicConfigTable": {"T": {', "not valid JSON"),
    ("topics.json", b'{"dataVersion": {"counter": "x"}}', "dataVersion.counter must be an integer"),
    ("topics.json", b'{"dataVersion": []}', "dataVersion must be an object"),
    ("consumerOffset.json", b'{"offsetTable": {"T@g": {"0": "abc"}}}', "offsetTable.T@g.0 must be an integer"),
    ("consumerOffset.json", b'{"offsetTable": {"T@g": {"x": 1}}}', "offsetTable.T@g.x key must be an integer"),
    ("consumerOffset.json", b'{"offsetTable": {"T@g": {0: 1, "0": 2}}}', "offsetTable.T@g.0 appears twice"),
    ("consumerOffset.json", b'{"offsetTable": {"T@g": {0: "5"}}}', "offsetTable.T@g.0 must be"),
    ("consumerOffset.json", b'{"offsetTable": {"T@g": [1, 2]}}', "offsetTable.T@g must be an object"),
    ("consumerOffset.json", b'{"offsetTable": {"T@g": {0: 99999999999999999999}}}', "offsetTable.T@g.0"),
    ("consumerOffset.json", b'{"offsetTable": 5}', "offsetTable must be an object, not 5"),
    ("delayOffset.json", b'{"offsetTable": {1: "x"}}', "offsetTable.1 must be an integer"),
    ("delayOffset.json", b'{"offsetTable": {0: 1}}', "offsetTable.0 key must be an integer 1.."),
    ("subscriptionGroup.json", b'{"subscriptionGroupTable": {"g": {"consumeEnable": "yes"}}}',
     "subscriptionGroupTable.g.consumeEnable must be true or false"),
    ("subscriptionGroup.json", b'{"subscriptionGroupTable": {"g": 1}}', "subscriptionGroupTable.g must be an object"),
    ("subscriptionGroup.json", b'{"subscriptionGroupTable": {"g": {"retryMaxTimes": 1.5}}}', "g.retryMaxTimes"),
]


def _write(root: Path, name: str, main: bytes | str | None, bak: bytes | str | None = None) -> None:
    (root / "config").mkdir(parents=True, exist_ok=True)
    for suffix, content in (("", main), (".bak", bak)):
        path = root / "config" / f"{name}{suffix}"
        if content is None:
            path.unlink(missing_ok=True)
        else:
            path.write_bytes(content.encode() if isinstance(content, str) else content)


@pytest.mark.parametrize(("name", "content", "names"), HOSTILE,
                         ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(HOSTILE)])
def test_a_hostile_file_is_a_config_error_naming_file_and_field_and_its_backup_is_used(tmp_path, caplog, name,
                                                                                        content, names):
    _write(tmp_path, name, content)
    manager = MANAGERS[name](tmp_path)
    with pytest.raises(ConfigFileError) as caught:
        manager.load()
    assert names in str(caught.value) and str(caught.value).startswith(str(tmp_path / "config" / name))
    str(caught.value).encode("utf-8")  # hostile names are shown escaped: the message can be logged and printed
    assert manager.load_error is caught.value
    _write(tmp_path, name, content, bak=content)  # both copies bad
    with pytest.raises(ConfigFileError, match=r"its backup .* is bad too"):
        MANAGERS[name](tmp_path).load()
    _write(tmp_path, name, content, bak=GOOD[name])
    with caplog.at_level(logging.WARNING, logger="rocketstore.brokerconfig"):
        from_bak = MANAGERS[name](tmp_path)
        from_bak.load()
    assert names in caplog.text and "loaded from its backup" in caplog.text
    _write(tmp_path / "good", name, GOOD[name])
    good = MANAGERS[name](tmp_path / "good")
    good.load()
    assert vars(from_bak).keys() == vars(good).keys()
    assert _state(from_bak) == _state(good)


def _state(manager) -> object:
    """What a manager loaded, comparable across instances."""
    if isinstance(manager, TopicConfigManager):
        return {k: (v.read_queue_nums, v.write_queue_nums, v.perm, v.order, v.attributes, v.extra)
                for k, v in manager.topics.items()}, manager.extra
    if isinstance(manager, SubscriptionGroupManager):
        return manager.groups, manager.extra
    return manager.table, manager.extra


def test_fastjson_keys_are_only_rewritten_outside_strings(tmp_path):
    text = '{"topicConfigTable":{"T":{"attributes":{"a":"x,1:y","{2:":"z"},"perm":6}},"n":{3:{"s":",4: "}}}'
    assert parse_fastjson(text)["topicConfigTable"]["T"]["attributes"] == {"a": "x,1:y", "{2:": "z"}
    assert parse_fastjson(text)["n"] == {3: {"s": ",4: "}}
    _write(tmp_path, "topics.json", text)
    topics = TopicConfigManager(tmp_path)
    topics.load()
    topics.persist()
    again = TopicConfigManager(tmp_path)
    again.load()
    assert again.get("T").attributes == {"a": "x,1:y", "{2:": "z"} and again.extra == {"n": {3: {"s": ",4: "}}}


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _store_with_messages(root: Path) -> None:
    with MessageStore.open(root, CONFIG) as store:
        store.put_messages([Message("T", f"m{i}".encode(), keys=[f"k{i}"], queue_id=i % 2) for i in range(6)])
        store.wait_for_dispatch()
        with store.consumer("g", "T") as consumer:
            consumer.poll(timeout=1.0)


def test_a_writer_refuses_a_store_whose_file_and_backup_are_both_bad_and_changes_nothing(tmp_path):
    _store_with_messages(tmp_path)
    _write(tmp_path, "topics.json", b'{"topicConfigTable": {"T": {"writeQueueNums": "x"}}}', bak=b"\xff")
    before = _tree(tmp_path)
    with pytest.raises(ConfigFileError, match=r"topics\.json: topicConfigTable\.T\.writeQueueNums must be"):
        MessageStore.open(tmp_path, CONFIG)
    assert _tree(tmp_path) == before, "nothing written, nothing removed"
    _write(tmp_path, "topics.json", GOOD["topics.json"], bak=b"\xff")  # repaired: the lock was released
    with MessageStore.open(tmp_path, CONFIG) as store:
        assert store.topic_config.get("T").write_queue_nums == 4
        store.create_topic("U", 2)
    for suffix in ("", ".bak"):  # the bad backup was not kept, and the bad main never became one
        TopicConfigManager.SCHEMA(parse_fastjson((tmp_path / "config" / f"topics.json{suffix}").read_text()), "")


def test_a_config_file_that_is_a_dangling_symlink_is_a_config_error_not_an_empty_file(tmp_path, caplog):
    """topics.json linked to a disk that is not mounted read as a new store's missing file: every topic and, for
    consumerOffset.json, every committed offset silently gone, then written over. It is a ConfigFileError now
    (its backup is used when good), and an empty file with no backup loads as empty (as RocketMQ does), loudly."""
    _store_with_messages(tmp_path)
    config_dir = tmp_path / "config"
    (config_dir / "consumerOffset.json.bak").unlink(missing_ok=True)
    (config_dir / "consumerOffset.json").unlink(missing_ok=True)
    (config_dir / "consumerOffset.json").symlink_to(tmp_path / "unmounted" / "consumerOffset.json")
    before = _tree(tmp_path)
    with pytest.raises(ConfigFileError, match=r"consumerOffset\.json: is a symbolic link to a file that does not"):
        MessageStore.open(tmp_path, CONFIG)
    assert _tree(tmp_path) == before, "nothing written, nothing removed"
    (config_dir / "consumerOffset.json").unlink()
    (config_dir / "consumerOffset.json").write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="rocketstore.brokerconfig"), MessageStore.open(tmp_path, CONFIG):
        pass
    assert "consumerOffset.json is empty and has no backup with content" in caplog.text


def test_a_bad_main_file_never_becomes_the_backup(tmp_path):
    """The main file is bad, the backup good: the next write must not copy the bad file into the backup."""
    offsets = ConsumerOffsetManager(tmp_path)
    offsets.commit("g", "T", 0, 5)
    offsets.persist()
    _write(tmp_path, "consumerOffset.json", b'{"offsetTable": {"T@g": {"0": "abc"}}}',
           bak=GOOD["consumerOffset.json"])
    offsets = ConsumerOffsetManager(tmp_path)
    offsets.load()
    assert offsets.query("g", "T", 0) == 7
    offsets.commit("g", "T", 0, 9)
    offsets.persist()
    for suffix in ("", ".bak"):
        again = parse_fastjson((tmp_path / "config" / f"consumerOffset.json{suffix}").read_text())
        assert again["offsetTable"]["T@g"][0] == 9


def test_read_only_opens_serve_the_messages_with_hostile_config_files(tmp_path, caplog):
    _store_with_messages(tmp_path)
    for name in MANAGERS:
        _write(tmp_path, name, b'{"x": ' + b"[" * 100_000, bak=b"\xfe\xff")
    before = _tree(tmp_path)
    with caplog.at_level(logging.WARNING), MessageStore.open(tmp_path, CONFIG, read_only=True) as store:
        assert sorted(m.body for m in store.iter_messages()) == [f"m{i}".encode() for i in range(6)]
        assert [m.body for m in store.query_message("T", "k3")] == [b"m3"]
        assert store.topic_config.topics == {} and isinstance(store.topic_config.load_error, ConfigFileError)
        assert store.query_offset("g", "T", 0) == -1
    assert "using an empty topics.json" in caplog.text
    assert _tree(tmp_path) == before


ROCKETSTORE = Path(sys.executable).with_name("rocketstore")


@pytest.mark.parametrize("args", [["print-msg", "-t", "T"], ["query-by-key", "-t", "T", "-k", "k3"], ["inspect"],
                                  ["topic", "list"]])
def test_read_only_cli_commands_work_with_a_hostile_topics_json(tmp_path, args):
    _store_with_messages(tmp_path)
    _write(tmp_path, "topics.json", b'{"topicConfigTable": {"T": {"writeQueueNums": "x"}}}', bak=b"\xff")
    done = subprocess.run([str(ROCKETSTORE), *args, "--store", str(tmp_path)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert "Traceback" not in done.stderr
    if args[0] == "topic":  # may list from the queues, or report the error in one line
        listed = done.returncode == 0 and "T" in done.stdout
        assert listed or (done.returncode == 1 and len(done.stderr.strip().splitlines()) == 1
                          and "topics.json" in done.stderr)
        return
    assert done.returncode == 0, done.stderr
    assert "topics.json" in done.stderr  # the warning
    if args[0] == "print-msg":
        assert all(f"m{i}" in done.stdout or f"k{i}" in done.stdout for i in range(6)), done.stdout
    elif args[0] == "query-by-key":  # m3: queue 1, offset 1
        assert [line.split()[1:] for line in done.stdout.splitlines()[1:]] == [["1", "1"]], done.stdout


# --- any content: ConfigError or success, and what loads writes back the same ---------------------------------------

FIELD_NAMES = ["dataVersion", "counter", "stateVersion", "timestamp", "topicConfigTable", "topicName", "readQueueNums",
               "writeQueueNums", "perm", "topicFilterType", "topicSysFlag", "order", "attributes", "offsetTable",
               "subscriptionGroupTable", "groupName", "consumeEnable", "retryMaxTimes", "brokerId", "T", "T@g", "0",
               "1"]
LEAVES = (st.none() | st.booleans() | st.integers(-2, 1100) | st.integers() | st.floats() | st.text(max_size=8)
          | st.sampled_from(["SINGLE_TAG", "MULTI_TAG", "x", ""]))
JSONISH = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.sampled_from(FIELD_NAMES) | st.text(max_size=6) | st.integers(-1, 5), inner, max_size=5), max_leaves=30)
DOCUMENTS = st.one_of(
    JSONISH.map(to_fastjson).map(str.encode),
    st.binary(max_size=200),
    st.tuples(st.sampled_from(sorted(GOOD.values())), st.integers(0, 120), st.binary(max_size=3)).map(
        lambda t: t[0].encode()[:t[1]] + t[2] + t[0].encode()[t[1] + len(t[2]):]),  # a good file, a few bytes changed
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(sorted(MANAGERS)), main=DOCUMENTS, bak=st.none() | DOCUMENTS)
def test_any_content_loads_or_is_a_config_error_and_round_trips(tmp_path, name, main, bak):
    _write(tmp_path, name, main, bak)
    manager = MANAGERS[name](tmp_path)
    try:
        manager.load()
    except ConfigError:
        event("ConfigError")
        assert _state(manager) == _state(MANAGERS[name](tmp_path)), "a failed load changes nothing"
        return
    event("loaded")
    if isinstance(manager, OffsetTable):
        manager.persist(force=True)
    else:
        manager.persist()
    again = MANAGERS[name](tmp_path)
    again.load()
    assert _state(again) == _state(manager)


# --- killed and failing writers -------------------------------------------------------------------------------------

WRITER = """
import sys
from pathlib import Path
from rocketstore.brokerconfig import ConsumerOffsetManager
offsets = ConsumerOffsetManager(Path(sys.argv[1]))
offsets.load()
n = 0
while True:
    for g in range(50):
        offsets.commit(f"g{g}", "T", n % 8, n)
    offsets.persist()
    n += 1
    if n == 2:  # the second write made the .bak: from here on both files must always be whole
        print("writing", flush=True)
"""


def test_a_killed_writer_leaves_whole_files_and_its_temporaries_go_at_the_next_writer_open(tmp_path):
    config_dir = tmp_path / "config"
    for _ in range(5):
        child = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline() == "writing\n"
        time.sleep(random.uniform(0, 0.05))  # kill at a random point of the write loop
        child.kill()
        child.wait()
        child.stdout.close()
        for suffix in ("", ".bak"):
            ConsumerOffsetManager.SCHEMA(parse_fastjson((config_dir / f"consumerOffset.json{suffix}").read_text()), "")
    stale = config_dir / "consumerOffset.json.tmp.99999.0"
    stale.write_text('{"offsetTable":{"T@g"')
    (config_dir / "consumerOffset.json.bak.tmp").write_text("")  # the name older versions used
    ConsumerOffsetManager(tmp_path, read_only=True).load()
    assert stale.exists(), "a reader removes nothing"
    with MessageStore.open(tmp_path, CONFIG) as store:
        assert store.consumer_offsets.groups("T")
        assert not [p.name for p in config_dir.iterdir() if ".tmp" in p.name]


FAILING_WRITER = """
import json, sys
from pathlib import Path
from rocketstore.brokerconfig import ConsumerOffsetManager
from rocketstore.errors import StoreIOError
offsets = ConsumerOffsetManager(Path(sys.argv[1]))
offsets.commit("g", "T", 0, 1)
offsets.persist()  # fsyncs 1 (the file's temporary) and 2 (the directory)
offsets.commit("g", "T", 0, 2)
try:
    offsets.persist()  # fsyncs 3 (the backup's temporary), 4 (the file's), 5 (the directory)
    error = None
except StoreIOError as exc:
    error = type(exc).__name__
print(json.dumps({"error": error, "dirty": offsets.dirty}), flush=True)
"""


@pytest.mark.parametrize("failing_fsync", [3, 4, 5])
def test_a_failed_write_keeps_a_good_file_and_is_retried(tmp_path, failing_fsync):
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed")
    done = subprocess.run(["strace", "-f", "-qq", "-o", "/dev/null", "-e", "trace=fsync",
                           "-e", f"inject=fsync:error=EIO:when={failing_fsync}",
                           sys.executable, "-c", FAILING_WRITER, str(tmp_path)],
                          capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(done.stdout) == {"error": "FlushError" if failing_fsync == 5 else "StoreIOError", "dirty": True}
    config_dir = tmp_path / "config"
    assert not [p.name for p in config_dir.iterdir() if ".tmp" in p.name], "temporaries removed"
    offsets = ConsumerOffsetManager(tmp_path)
    offsets.load()
    assert offsets.query("g", "T", 0) == (2 if failing_fsync == 5 else 1)  # renamed before the directory fsync
    offsets.commit("g", "T", 0, 3)
    offsets.persist()
    for suffix in ("", ".bak"):
        ConsumerOffsetManager.SCHEMA(parse_fastjson((config_dir / f"consumerOffset.json{suffix}").read_text()), "")


def test_a_failed_topics_write_changes_no_topic(tmp_path, monkeypatch):
    """``create_or_update`` and ``delete`` kept their change in memory when topics.json could not be written
    (found in an audit: a put then used 16 queues the file never had, and a restart brought 13 back)."""
    from rocketstore.brokerconfig import TopicConfigManager
    from rocketstore.errors import StoreIOError

    topics = TopicConfigManager(tmp_path)
    topics.create_or_update("Kept", write_queue_nums=4)
    before = (tmp_path / "config" / "topics.json").read_bytes()

    def full_disk(self, body):
        raise StoreIOError(28, "cannot write topics.json: No space left on device")

    monkeypatch.setattr(TopicConfigManager, "_write", full_disk)
    with pytest.raises(StoreIOError):
        topics.create_or_update("New", write_queue_nums=16)
    with pytest.raises(StoreIOError):
        topics.create_or_update("Kept", write_queue_nums=16, order=True)
    with pytest.raises(StoreIOError):
        topics.delete("Kept")
    assert topics.get("New") is None
    kept = topics.get("Kept")
    assert (kept.write_queue_nums, kept.read_queue_nums, kept.order) == (4, 4, False)
    assert (tmp_path / "config" / "topics.json").read_bytes() == before
    monkeypatch.undo()
    topics.create_or_update("New", write_queue_nums=16)
    assert topics.get("New").write_queue_nums == 16 and topics.get("Kept").write_queue_nums == 4
    # a failed fsync of the directory comes after the rename: the file has the change, and memory keeps it
    from rocketstore.brokerconfig import persist_text
    from rocketstore.errors import FlushError

    def renamed_then_dir_fsync_fails(self, body):
        persist_text(self.path, json.dumps(body), self.SCHEMA)
        raise FlushError(5, "fsync of directory config failed: Input/output error")

    monkeypatch.setattr(TopicConfigManager, "_write", renamed_then_dir_fsync_fails)
    with pytest.raises(FlushError):
        topics.create_or_update("Late", write_queue_nums=2)
    monkeypatch.undo()
    reloaded = TopicConfigManager(tmp_path)
    reloaded.load()
    assert topics.get("Late") is not None and reloaded.get("Late") is not None


OPEN_AND_CLOSE = """
import sys
from rocketstore import MessageStore, StoreConfig
from rocketstore.errors import StoreIOError
try:
    with MessageStore.open(sys.argv[1], StoreConfig(mapped_file_size_commit_log=4096)) as store:
        print(store.query_offset("g", "T", 0), flush=True)
except StoreIOError as exc:
    print(type(exc).__name__, exc.errno, flush=True)
"""


@pytest.mark.parametrize("error", ["EMFILE", "EIO", "EACCES"])
def test_a_config_file_that_cannot_be_read_now_is_not_replaced_by_its_older_backup(tmp_path, error):
    """An error opening a good offsets file (too many open files, EIO, no permission) is not bad content: the
    store ran on the older ``.bak`` and then wrote it over the file (an audit saw an offset go from 30 to 20)."""
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed")
    with MessageStore.open(tmp_path, StoreConfig(mapped_file_size_commit_log=4096)) as store:
        store.commit_offset("g", "T", 0, 20)
        store.consumer_offsets.persist(force=True)
        store.commit_offset("g", "T", 0, 30)
    config_dir = tmp_path / "config"
    before = {p.name: p.read_bytes() for p in config_dir.iterdir()}
    target = config_dir / "consumerOffset.json"
    done = subprocess.run(["strace", "-f", "-qq", "-o", "/dev/null", "-P", str(target),
                           "-e", f"inject=openat:error={error}:when=1", sys.executable, "-c", OPEN_AND_CLOSE,
                           str(tmp_path)], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.split() == ["StoreIOError", str(getattr(errno, error))], done.stderr
    assert {p.name: p.read_bytes() for p in config_dir.iterdir()} == before
    with MessageStore.open(tmp_path, StoreConfig(mapped_file_size_commit_log=4096)) as store:
        assert store.query_offset("g", "T", 0) == 30


# --- bad input through the API never reaches the files ------------------------------------------------------------

@pytest.mark.parametrize("call", [
    lambda s: s.commit_offset("g", "T", 0, "x"),
    lambda s: s.commit_offset("g", "T", 0, -1),
    lambda s: s.commit_offset("g", "T", True, 1),
    lambda s: s.commit_offset("a b", "T", 0, 1),
    lambda s: s.commit_offset("g\ud800", "T", 0, 1),
    lambda s: s.consumer("", "T"),
    lambda s: s.consumer("x" * 256, "T"),
    lambda s: s.create_topic("U", True),
    lambda s: s.create_topic("U", 4, read_queues=2000),
    lambda s: s.topic_config.create_or_update("U", perm="6"),
], ids=["offset-str", "offset-negative", "queue-bool", "group-space", "group-surrogate", "group-empty", "group-long",
        "queues-bool", "read-queues-2000", "perm-str"])
def test_bad_arguments_raise_typed_errors_and_never_make_the_store_unopenable(tmp_path, call):
    with MessageStore.open(tmp_path, CONFIG) as store:
        store.commit_offset("g", "T", 0, 1)
        with pytest.raises(RocketStoreError):
            call(store)
        store.consumer_offsets.persist(force=True)
        store.subscription_groups.persist()
        store.topic_config.persist()
    with MessageStore.open(tmp_path, CONFIG) as store:
        assert store.consumer_offsets.table == {"T@g": {0: 1}}
        assert store.topic_config.get("U") is None and not store.subscription_groups.groups


SHORT_CHECKPOINT = """
import sys
from rocketstore import Message, MessageStore, StoreConfig
from rocketstore.errors import StoreIOError
store = MessageStore.open(sys.argv[1], StoreConfig(mapped_file_size_commit_log=4096))
store.put_message(Message("T", b"x"))
try:
    store.close()
    print("closed")
except StoreIOError as exc:
    print(type(exc).__name__, exc)
"""


def test_a_short_write_of_the_checkpoint_is_an_error_not_success(tmp_path):
    """The checkpoint's 48 bytes were written with one pwrite whose count was not read: a short write closed the
    store as if its checkpoint were current. Now the rest is written after a short write, and a write that makes
    no progress (0 bytes here) is ENOSPC."""
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed")
    with MessageStore.open(tmp_path, StoreConfig(mapped_file_size_commit_log=4096)) as store:
        store.put_message(Message("T", b"first"))
    target = tmp_path / "checkpoint"
    done = subprocess.run(["strace", "-f", "-qq", "-o", "/dev/null", "-P", str(target),
                           "-e", "inject=pwrite64:retval=0", sys.executable, "-c", SHORT_CHECKPOINT, str(tmp_path)],
                          capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.startswith("StoreIOError") and "checkpoint" in done.stdout, (done.stdout, done.stderr)
    assert (tmp_path / "abort").exists()  # the next open recovers
    with MessageStore.open(tmp_path, StoreConfig(mapped_file_size_commit_log=4096)) as store:
        assert [m.body for m in store.iter_messages()] == [b"first", b"x"]


def test_values_a_broker_stores_unchecked_load_and_keep_their_meaning(tmp_path):
    """A broker's admin creates topics with any queue count and commits any offset: one such value refused the
    whole file (a writer would not open; read-only tools answered with no topics and no consumer lag)."""
    _write(tmp_path, "topics.json", b'{"topicConfigTable":{"Closed":{"readQueueNums":2048,"writeQueueNums":0,'
                                    b'"perm":6},"T":{"readQueueNums":4,"writeQueueNums":4,"perm":6}}}')
    _write(tmp_path, "consumerOffset.json", b'{"offsetTable":{"T@g":{0:-1,1:8}}}')
    with MessageStore.open(tmp_path, CONFIG) as store:
        assert store.topic_config.get("Closed").write_queue_nums == 0
        assert store.topic_config.get("Closed").read_queue_nums == 2048
        with pytest.raises(InvalidQueueError):
            store.put_message(Message("Closed", b"x"))
        assert store.query_offset("g", "T", 0) == -1  # none: a consumer starts where its policy says
        # past the empty queue's end: kept, as a broker keeps it until a pull (nothing was lost to correct)
        assert store.query_offset("g", "T", 1) == 8
        store.put_message(Message("T", b"x", queue_id=2))
    progress = [json.loads(row) for row in cli("consumer-progress", "--store", str(tmp_path), "--json")
                .stdout.splitlines()]
    # -1 shown as 0, as the broker's getConsumeStats; each of the topic's 4 read queues; 8 past the end: diff -8
    assert [(r["queueId"], r["consumerOffset"], r["diff"]) for r in progress] == [(0, 0, 0), (1, 8, -8), (2, 0, 1),
                                                                                 (3, 0, 0)]
    listed = {json.loads(row)["topic"]: json.loads(row) for row in
              cli("topic", "list", "--store", str(tmp_path), "--json").stdout.splitlines()}
    assert listed["Closed"]["writeQueueNums"] == 0
    assert "│ Closed │ 0 " in cli("topic", "list", "--store", str(tmp_path)).stdout.replace("  ", " ")

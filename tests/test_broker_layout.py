"""A broker's store holding what rocketstore does not manage (``brokerlayout``): LMQ queues, BatchCQ topics,
consume queues in RocksDB, config files a broker left. Each must come through a writer's open, a rebuild and the
read-only tools untouched, and never be answered for as if it were empty."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from rocketstore import Message, MessageStore
from rocketstore.brokerconfig import ConsumerOffsetManager
from rocketstore.errors import InvalidPropertyError, InvalidTopicError, UnsupportedLayoutError
from rocketstore.rebuild import rebuild
from rocketstore.verify import verify_store
from test_cli import CONFIG, cli, tree

UNIT = struct.Struct(">qiq")


def _store(root: Path, config=CONFIG) -> list:
    with MessageStore.open(root, config) as store:
        results = [store.put_message(Message("TopicA", f"m{i}".encode(), keys=[f"k{i}"], queue_id=i % 2))
                   for i in range(6)]
        store.commit_offset("g1", "TopicA", 0, 2)
        store.wait_for_dispatch()
    return results


def _add_lmq(root: Path, results: list, config=CONFIG) -> Path:
    """What a broker with enableLmq writes for messages sent with INNER_MULTI_DISPATCH=%LMQ%q1: units of
    queue 0 pointing at the records of another topic, and its consumers' offsets."""
    queue = root / "consumequeue" / "%LMQ%q1" / "0"
    queue.mkdir(parents=True)
    data = bytearray(config.mapped_file_size_consume_queue)
    for n, result in enumerate(results[:3]):
        UNIT.pack_into(data, n * UNIT.size, result.commit_log_offset, result.store_size, 0)
    (queue / "00000000000000000000").write_bytes(bytes(data))
    # fastjson's form, bare integer keys
    (root / "config" / "consumerOffset.json").write_text('{"offsetTable":{"TopicA@g1":{0:2},"%LMQ%q1@gl":{0:3}}}')
    return queue


def _offsets(root: Path, group: str, topic: str) -> dict[int, int]:
    offsets = ConsumerOffsetManager(root, read_only=True)
    offsets.load()
    return offsets.offsets(group, topic)


def _without(files: dict[str, str], *prefixes: str) -> dict[str, str]:
    return {name: digest for name, digest in files.items() if not name.startswith(prefixes)}


def test_a_writer_leaves_lmq_queues_and_their_offsets_as_the_broker_wrote_them(tmp_path):
    root = tmp_path / "s"
    results = _store(root)
    queue = _add_lmq(root, results)
    lmq_before = tree(queue)
    (root / "abort").touch()  # the broker was killed: the writer's open checks every queue
    with MessageStore.open(root, CONFIG) as store:
        assert store.query_offset("gl", "%LMQ%q1", 0) == 3  # not "past the queue's end" of a queue it never read
        with pytest.raises(InvalidTopicError, match="LMQ"):
            store.put_message(Message("%LMQ%q1", b"x"))
        with pytest.raises(InvalidPropertyError, match="multi-dispatch"):
            store.put_message(Message("TopicA", b"x", properties={"INNER_MULTI_DISPATCH": "%LMQ%q1"}))
        with pytest.raises(UnsupportedLayoutError, match="LMQ"):
            store.get_message("%LMQ%q1", 0, 0)
        with pytest.raises(UnsupportedLayoutError, match="LMQ"):
            store.get_max_offset_in_queue("%LMQ%q1", 0)
        assert store.get_message("TopicA", 0, 0).status.value == "FOUND"
    assert tree(queue) == lmq_before
    assert _offsets(root, "gl", "%LMQ%q1") == {0: 3}
    report = verify_store(root, CONFIG)
    assert report.clean, report.problems
    assert any("LMQ" in note for note in report.not_checked)
    rebuild(root, config=CONFIG)
    assert tree(queue) == lmq_before  # carried into the rebuilt consumequeue/, not left behind in recovery/
    with MessageStore.open(root, CONFIG, read_only=True) as store:
        assert [m.body for m in store.get_message("TopicA", 0, 0).messages] == [b"m0", b"m2", b"m4"]
    progress = cli("consumer-progress", "--store", str(root))
    assert "gl: not shown: %LMQ%q1 is a broker's LMQ queue" in progress.stderr
    assert "TopicA" in progress.stdout and "%LMQ%q1" not in progress.stdout
    refused = cli("query-by-offset", "--store", str(root), "-t", "%LMQ%q1", "-q", "0", "-o", "0", check=False)
    assert refused.returncode == 1 and "LMQ queue" in refused.stderr and "Traceback" not in refused.stderr


def _batch_topic(root: Path) -> None:
    topics = json.loads((root / "config" / "topics.json").read_text())
    topics["topicConfigTable"]["BatchTopic"] = {"topicName": "BatchTopic", "readQueueNums": 1, "writeQueueNums": 1,
                                                "perm": 6, "attributes": {"queue.type": "BatchCQ"}}
    (root / "config" / "topics.json").write_text(json.dumps(topics))


@pytest.mark.parametrize("how", ["attribute", "directory"])
def test_a_batch_cq_store_is_refused_to_writers_and_rebuilds_and_changes_nothing(tmp_path, how):
    root = tmp_path / "s"
    _store(root)
    if how == "attribute":
        _batch_topic(root)
    else:
        (root / "batchconsumequeue" / "BatchTopic" / "0").mkdir(parents=True)
    before = tree(root)
    with pytest.raises(UnsupportedLayoutError, match="BatchCQ queues \\(topics BatchTopic\\)"):
        MessageStore.open(root, CONFIG)
    with pytest.raises(UnsupportedLayoutError, match="BatchCQ"):
        rebuild(root, config=CONFIG)
    refused = cli("topic", "create", "--store", str(root), "-t", "NewTopic", check=False)
    assert refused.returncode == 1 and "BatchCQ" in refused.stderr and "Traceback" not in refused.stderr
    assert tree(root) == before
    with MessageStore.open(root, CONFIG, read_only=True) as store:
        assert len(store.get_message("TopicA", 0, 0).messages) == 3
        with pytest.raises(UnsupportedLayoutError, match="BatchCQ topic"):
            store.get_message("BatchTopic", 0, 0)
    assert any("BatchCQ" in note for note in verify_store(root, CONFIG).not_checked)
    listed = [json.loads(line) for line in cli("topic", "list", "--store", str(root), "--json").stdout.splitlines()]
    messages = {row["topic"]: row["messages"] for row in listed}
    assert messages["TopicA"] == 6 and messages.get("BatchTopic") is None  # not read here: not 0
    refused = cli("print-msg", "--store", str(root), "-t", "BatchTopic", check=False)
    assert refused.returncode == 1 and "BatchCQ topic" in refused.stderr


def test_consume_queues_in_rocksdb_are_refused_to_writers_and_never_read_as_empty(tmp_path):
    root = tmp_path / "s"
    _store(root)
    for name in ("CURRENT", "MANIFEST-000005", "000004.log"):
        (root / "consumequeue" / name).write_bytes(b"rocksdb " + name.encode())
    before = tree(root)
    with pytest.raises(UnsupportedLayoutError, match="RocksDB"):
        MessageStore.open(root, CONFIG)
    with pytest.raises(UnsupportedLayoutError, match="RocksDB"):
        rebuild(root, config=CONFIG)
    assert tree(root) == before
    with MessageStore.open(root, CONFIG, read_only=True) as store:
        with pytest.raises(UnsupportedLayoutError, match="RocksDB"):
            store.get_message("TopicA", 0, 0)
        assert [m.body for m in store.query_message("TopicA", "k1")] == [b"m1"]  # the log and the index still serve
    progress = cli("consumer-progress", "--store", str(root), check=False)
    assert progress.returncode == 1 and "RocksDB" in progress.stderr
    report = verify_store(root, CONFIG)
    assert report.clean and any("RocksDB" in note for note in report.not_checked)


def test_a_dledger_store_is_refused_to_every_open_with_what_it_is(tmp_path):
    """Its log is dledger-<id>/data (DLedger's framing): the advice for a store without commitlog/ ("create an empty
    commitlog directory") would have started its log over and dropped its queues."""
    root = tmp_path / "s"
    _store(root)
    (root / "commitlog").rename(root / "dledger-n0")
    before = tree(root)
    for read_only in (False, True):
        with pytest.raises(UnsupportedLayoutError, match="DLedger commit log \\(dledger-n0/\\)"):
            MessageStore.open(root, CONFIG, read_only=read_only)
    refused = cli("print-msg", "--store", str(root), "-t", "TopicA", check=False)
    assert refused.returncode == 1 and "DLedger" in refused.stderr and "Traceback" not in refused.stderr
    assert tree(root) == before


def test_units_whose_tags_code_is_a_consume_queue_ext_address_are_filtered_by_their_records_tags(tmp_path):
    """A broker with enableConsumeQueueExt keeps the real tags code in consumequeue_ext/ and an address (at most
    Integer.MIN_VALUE - 1) in the unit: a tag subscription dropped every such message."""
    root = tmp_path / "s"
    with MessageStore.open(root, CONFIG) as store:
        for i in range(4):
            store.put_message(Message("TopicA", f"m{i}".encode(), tags="TagA" if i % 2 else "TagB"))
        store.wait_for_dispatch()
    unit_file = root / "consumequeue" / "TopicA" / "0" / "00000000000000000000"
    data = bytearray(unit_file.read_bytes())
    for n in range(4):
        struct.pack_into(">q", data, n * UNIT.size + 12, -(1 << 31) - 1 - 40 * n)
    unit_file.write_bytes(bytes(data))
    with MessageStore.open(root, CONFIG, read_only=True) as store:
        assert [m.body for m in store.get_message("TopicA", 0, 0, tags="TagA").messages] == [b"m1", b"m3"]
        rows = [b for batch in store.queue_arrow("TopicA", 0, tags="TagB") for b in batch.column("body").to_pylist()]
        assert rows == [b"m0", b"m2"]
    assert verify_store(root, CONFIG).clean


@pytest.mark.parametrize("sparse", [True, False])
def test_the_next_segment_a_broker_creates_ahead_is_neither_damage_nor_kept(tmp_path, caplog, sparse):
    """AllocateMappedFileService creates the next segment before the current one fills: on a running broker's
    store, verify called that "a segment followed by another but with no BLANK record" (exit 1), and a writer's
    open moved it to recovery/ as a torn tail, keeping 1 GiB there for good when its zeros were real."""
    root = tmp_path / "s"
    _store(root)
    ahead = root / "commitlog" / f"{CONFIG.mapped_file_size_commit_log:020d}"
    with open(ahead, "wb") as f:
        if sparse:
            f.truncate(CONFIG.mapped_file_size_commit_log)
        else:
            f.write(bytes(CONFIG.mapped_file_size_commit_log))
    report = verify_store(root, CONFIG)
    assert report.clean, report.problems
    with MessageStore.open(root, CONFIG, read_only=True) as store:
        assert len(list(store.iter_messages())) == 6
    with caplog.at_level("WARNING"), MessageStore.open(root, CONFIG) as store:
        assert len(list(store.iter_messages())) == 6
        store.put_message(Message("TopicA", b"after", queue_id=0))
    assert "torn tail" not in caplog.text and not (root / "recovery").exists()
    assert sorted(p.name for p in (root / "commitlog").iterdir()) == [f"{0:020d}"]  # deleted, as RocketMQ does
    assert verify_store(root, CONFIG).clean


def test_a_broker_conf_whose_commit_log_is_elsewhere_or_split_is_refused_not_read_as_missing(tmp_path):
    """storePathCommitLog was ignored: a log kept outside the store root looked missing (and the error's advice,
    an empty commitlog directory, started it over and dropped the broker's queues), and of a multi-path log only
    the part under the root was read (257 of 700 messages silently missing)."""
    root = tmp_path / "s"
    _store(root)
    before = tree(root)
    cases = {f"storePathCommitLog={tmp_path / 'disk2' / 'commitlog'}": "keeps the commit log at",
             f"storePathCommitLog={tmp_path / 'a' / 'commitlog'},{root / 'commitlog'}": "several directories",
             f"readOnlyCommitLogStorePaths={tmp_path / 'old'}": "several directories"}
    for line, said in cases.items():
        conf = tmp_path / "broker.conf"
        conf.write_text(f"storePathRootDir={root}\n{line}\nmaxHashSlotNum=97\nmaxIndexNum=388\n")
        for command in (["query-by-key", "-t", "TopicA", "-k", "k1"], ["put", "-t", "TopicA", "-p", "x"]):
            done = cli(*command, "--broker-conf", str(conf), check=False)
            assert done.returncode == 1 and said in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert tree(root) == before
    conf.write_text(f"storePathRootDir={root}\nstorePathCommitLog={root / 'commitlog'}\nmaxHashSlotNum=97\n"
                    "maxIndexNum=388\n")
    done = cli("query-by-key", "-t", "TopicA", "-k", "k1", "--broker-conf", str(conf))
    assert len(done.stdout.strip().splitlines()) == 2  # the header and the message
    # what the refusal advises: the log on another disk, linked into the root (and a broker's trailing blank)
    (tmp_path / "disk2").mkdir()
    (root / "commitlog").rename(tmp_path / "disk2" / "commitlog")
    (root / "commitlog").symlink_to(tmp_path / "disk2" / "commitlog")
    conf.write_text(f"storePathRootDir={root} \nstorePathCommitLog={tmp_path / 'disk2' / 'commitlog'}\t\n"
                    "maxHashSlotNum=97\nmaxIndexNum=388\n")
    done = cli("query-by-key", "-t", "TopicA", "-k", "k1", "--broker-conf", str(conf))
    assert len(done.stdout.strip().splitlines()) == 2


def test_an_empty_newest_index_file_is_dropped_not_taken_for_damage(tmp_path, caplog):
    """A broker killed between creating its newest index file and mapping it leaves it empty: a writer set the
    whole index aside and indexed the log again (a broker's 420 MB files each time), read-only views skipped
    nothing else but called it damage."""
    root = tmp_path / "s"
    _store(root)
    (root / "index" / "29991231235959000").touch()
    kept = sorted(p.name for p in (root / "index").iterdir() if p.stat().st_size)
    with MessageStore.open(root, CONFIG, read_only=True) as store:
        assert [m.body for m in store.query_message("TopicA", "k3")] == [b"m3"]
    with caplog.at_level("WARNING"), MessageStore.open(root, CONFIG) as store:
        assert [m.body for m in store.query_message("TopicA", "k3")] == [b"m3"]
    assert "damaged" not in caplog.text and not (root / "recovery").exists()
    assert sorted(p.name for p in (root / "index").iterdir()) == kept
    assert verify_store(root, CONFIG).clean


def _sparsify(path: Path) -> None:
    """The file as a broker leaves it: only its written pages have blocks."""
    data = path.read_bytes()
    with open(path, "wb") as out:
        for page in range(0, len(data), 4096):
            if any(data[page : page + 4096]):
                out.seek(page)
                out.write(data[page : page + 4096])
        out.truncate(len(data))
    assert path.stat().st_blocks * 512 < len(data)


def test_a_writer_reserves_the_blocks_of_a_brokers_sparse_files_as_it_stores_into_them(tmp_path, monkeypatch):
    """A broker's index and queue files are sparse; a store into a hole of their mapping on a full disk killed the
    process with SIGBUS (the disk-full review). The newest index file is reserved at a writer's open (ENOSPC
    there first); a queue file as units are written into it, a step at a time (reserving every queue's last file
    at open allocated 6 MB for each idle queue too: 60 GB for a broker's 10,000 queues)."""
    import dataclasses
    import errno
    import time

    from rocketstore.errors import StoreIOError

    config = dataclasses.replace(CONFIG, mapped_file_size_consume_queue=20 * 4096)  # pages a unit never reached
    root = tmp_path / "s"
    _store(root, config)
    newest_index = sorted((root / "index").iterdir())[-1]
    busy, idle = (root / "consumequeue" / "TopicA" / str(q) / f"{0:020d}" for q in (0, 1))
    for path in (newest_index, busy, idle):
        _sparsify(path)
    before = tree(root)

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patched:
        patched.setattr("os.posix_fallocate", full)
        with pytest.raises(StoreIOError, match=r"cannot reserve the blocks of .*SIGBUS") as caught:
            MessageStore.open(root, config)
    assert caught.value.errno == errno.ENOSPC
    assert {k: v for k, v in tree(root).items() if k != "lock"} == {k: v for k, v in before.items() if k != "lock"}

    def allocated(path: Path) -> bool:
        return path.stat().st_blocks * 512 >= path.stat().st_size

    with MessageStore.open(root, config) as store:
        assert allocated(newest_index) and not allocated(busy) and not allocated(idle)
        with monkeypatch.context() as patched:
            patched.setattr("os.posix_fallocate", full)
            store.put_message(Message("TopicA", b"disk full", keys=["k8"], queue_id=0))  # stored; dispatch waits
            deadline = time.monotonic() + 10
            while store.dispatcher.last_error is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert isinstance(store.dispatcher.last_error, StoreIOError)
            assert store.dispatcher.last_error.errno == errno.ENOSPC
        assert store.wait_for_dispatch(10)  # space again: dispatch goes on
        store.put_message(Message("TopicA", b"more", keys=["k9"], queue_id=0))
        assert store.wait_for_dispatch(10)
        assert allocated(busy) and not allocated(idle)
        assert [m.body for m in store.query_message("TopicA", "k8")] == [b"disk full"]
    assert verify_store(root, config).clean


def test_lmq_queues_are_cut_with_the_log_so_no_unit_points_at_a_later_message(tmp_path):
    """Left alone by a writer, an LMQ queue kept its units past a log cut by recovery: the messages put next took
    those offsets, and the broker served another topic's message to the LMQ's consumers (the self-review)."""
    root = tmp_path / "s"
    results = _store(root)
    queue = _add_lmq(root, results)  # units for records 0, 1 and 2
    segment = root / "commitlog" / f"{0:020d}"
    data = bytearray(segment.read_bytes())
    data[results[1].commit_log_offset + 84 : results[1].commit_log_offset + 88] = b"\xff" * 4  # its body length
    segment.write_bytes(bytes(data))
    (root / "abort").touch()
    with MessageStore.open(root, CONFIG) as store:
        assert store.recovery.end_offset == results[1].commit_log_offset
        new = [store.put_message(Message("Other", f"new{i}".encode())) for i in range(3)]
    units = queue / f"{0:020d}"
    kept = [UNIT.unpack_from(units.read_bytes(), n * UNIT.size) for n in range(3)]
    assert kept[0][0] == results[0].commit_log_offset and kept[1][1] == kept[2][1] == 0  # cut at the log's end
    assert new[0].commit_log_offset == results[1].commit_log_offset


def test_a_rebuild_carries_lmq_queues_with_their_holes_and_cut_at_the_log_end(tmp_path):
    """copytree filled a broker's sparse LMQ files in (6 MB each for one unit: 100,000 MQTT queues would not fit)
    and carried units past a log the rebuild's recovery had cut (the self-review)."""
    import dataclasses

    config = dataclasses.replace(CONFIG, mapped_file_size_consume_queue=20 * 4096)
    root = tmp_path / "s"
    results = _store(root, config)
    queue = _add_lmq(root, results, config)
    _sparsify(queue / f"{0:020d}")
    segment = root / "commitlog" / f"{0:020d}"
    data = bytearray(segment.read_bytes())
    data[results[2].commit_log_offset + 84 : results[2].commit_log_offset + 88] = b"\xff" * 4  # record 2 damaged
    segment.write_bytes(bytes(data))
    (root / "abort").touch()
    rebuild(root, config=config)
    carried = queue / f"{0:020d}"
    assert carried.stat().st_blocks * 512 < carried.stat().st_size  # still sparse
    units = [UNIT.unpack_from(carried.read_bytes(), n * UNIT.size) for n in range(3)]
    assert [u[0] for u in units[:2]] == [results[0].commit_log_offset, results[1].commit_log_offset]
    assert units[2] == (0, 0, 0)  # its record is past the recovered end


def test_serve_answers_a_request_for_an_lmq_topic_as_the_clients_not_a_server_failure():
    """A receive, pull or offset query for a broker's LMQ topic ended as INTERNAL_SERVER_ERROR."""
    pytest.importorskip("grpc")
    from rocketstore.server.service import pb, status_of

    refused = status_of(UnsupportedLayoutError("%LMQ%q1 is a broker's LMQ queue"))
    assert refused.code == pb.Code.BAD_REQUEST and "LMQ" in str(refused)

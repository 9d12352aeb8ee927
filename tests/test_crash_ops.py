"""SIGKILL during the operations the main crash loop does not exercise, two writers through different paths,
and index files whose chains cycle.

Crash part: each cycle runs ``crash_ops_writer.py`` doing one operation in a loop (retention, topic
create/delete, delayed delivery, offset commits) or the Spark rebuild, kills its whole process group at a
random moment (seeded: ``ROCKETSTORE_CRASH_SEED``; the seed is in every assertion message) and reopens the
store here, which runs crash recovery, then checks what that operation promises against what the writer
acknowledged. CI runs a few cycles of each; ``-m slow`` runs ``ROCKETSTORE_CRASH_OPS_CYCLES``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from crash_ops_writer import FAR_FUTURE_MS, store_config, topics_after
from rocketstore import Message, MessageStore, StoreConfig
from rocketstore.brokerconfig import parse_fastjson
from rocketstore.encoder import SCHEDULE_TOPIC
from rocketstore.errors import MessageNotFoundError, StoreLockedError
from rocketstore.index import IndexFile
from rocketstore.index.service import chain_problem
from rocketstore.reads import GetMessageStatus
from rocketstore.schedule import ScheduleMessageService

WRITER = Path(__file__).with_name("crash_ops_writer.py")
SEED = int(os.environ.get("ROCKETSTORE_CRASH_SEED", "7070"))
CI_CYCLES = 3
SLOW_CYCLES = int(os.environ.get("ROCKETSTORE_CRASH_OPS_CYCLES", "30"))
KILL_AFTER = {"retention": (0.02, 0.5), "topics": (0.02, 0.4), "delay": (0.3, 2.5), "offsets": (0.02, 0.5)}
CONFIG_FILES = ("topics.json", "consumerOffset.json", "delayOffset.json", "subscriptionGroup.json")
QUIET = store_config(enable_schedule_message=False)  # reopens between kills: the writer does the delivering


def long_form(request) -> None:
    if "slow" not in request.config.getoption("markexpr") and "ROCKETSTORE_CRASH_OPS_CYCLES" not in os.environ:
        pytest.skip("long form: run with -m slow or set ROCKETSTORE_CRASH_OPS_CYCLES")


# --- the writer process ------------------------------------------------------------------------------------

class OpsWriter:
    """``crash_ops_writer.py`` in its own process group; a thread drains its stdout so it never blocks."""

    def __init__(self, root: Path, op: str, run_id: int, start: int, log: Path) -> None:
        self.log = log
        self.lines: list[dict] = []
        self._opened = threading.Event()
        with open(log, "ab") as err:
            self.proc = subprocess.Popen([sys.executable, str(WRITER), str(root), op, str(run_id), str(start)],
                                         stdout=subprocess.PIPE, stderr=err, start_new_session=True)
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line == b"open\n":
                self._opened.set()
            elif line.endswith(b"\n"):  # a line cut short by the kill acknowledges nothing
                self.lines.append(json.loads(line))
        self._opened.set()

    def kill_after(self, seconds: float) -> list[dict]:
        """Let it work ``seconds`` after its open, SIGKILL its process group, return its acknowledgements."""
        assert self._opened.wait(60), self.log.read_text()[-3000:]
        assert self.proc.poll() is None, f"the writer exited: {self.proc.returncode}: {self.log.read_text()[-3000:]}"
        time.sleep(seconds)  # the random kill moment itself, not a wait for something
        alive = self.proc.poll() is None
        with contextlib.suppress(ProcessLookupError):  # it died on its own: the assert below shows its log
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        self._reader.join(30)
        assert alive, f"the writer died on its own: {self.log.read_text()[-3000:]}"
        return self.lines


def config_files_parse(root: Path, where: str) -> None:
    for name in CONFIG_FILES:
        for path in (root / "config" / name, root / "config" / f"{name}.bak"):
            if path.exists():
                assert isinstance(parse_fastjson(path.read_text(encoding="utf-8")), dict), f"{where}: {path} is torn"


def queue_message(store: MessageStore, topic: str, queue_id: int, queue_offset: int):
    got = store.get_message(topic, queue_id, queue_offset, 1)
    return got.messages[0] if got.status == GetMessageStatus.FOUND and got.messages else None


# --- what each operation promises ----------------------------------------------------------------------------

@dataclass
class OpsLedger:
    """What the writers acknowledged on one store, and the checks after each kill."""

    op: str
    seed: int
    puts: dict[str, dict] = field(default_factory=dict)  # key -> its put line
    floor: int = 0  # the log's min offset can only be at or above this
    topic_ops: int = 0  # topic operations acknowledged
    persisted: dict[tuple[str, int], int] = field(default_factory=dict)
    kills: int = 0
    stats: Counter = field(default_factory=Counter)

    def take(self, lines: list[dict]) -> None:
        self.kills += 1
        for line in lines:
            if "put" in line:
                assert line["status"] == "PUT_OK", line
                self.puts[line["put"]] = line | {"kill": self.kills}
            elif "min" in line:
                self.floor = max(self.floor, line["min"])
            elif "op" in line:
                self.topic_ops = line["op"]
            elif "persisted" in line:
                group, queue_id, offset = line["persisted"]
                self.persisted[(group, queue_id)] = max(offset, self.persisted.get((group, queue_id), -1))

    def check(self, store: MessageStore, where: str) -> None:
        assert store.recovery is not None and store.recovery.abnormal, where
        assert store.wait_for_dispatch(30), where
        getattr(self, f"_check_{self.op}")(store, where)

    def _check_retention(self, store: MessageStore, where: str) -> None:
        low = store.min_phy_offset
        assert low >= self.floor, f"{where}: the log's min offset went back from {self.floor} to {low}"
        self.floor = low
        kept = {key: p for key, p in self.puts.items() if p["phy"] >= low}
        gone = [p for p in self.puts.values() if p["phy"] < low]
        for key, put in kept.items():
            assert store.look_message_by_offset(put["phy"]).keys == [key], where
            assert put["queue_offset"] >= store.get_min_offset_in_queue("R", put["queue_id"]), \
                f"{where}: a live message fell below its queue's min offset"
            msg = queue_message(store, "R", put["queue_id"], put["queue_offset"])
            assert msg is not None and msg.commit_log_offset == put["phy"], f"{where}: {key} lost from its queue"
            assert [m.commit_log_offset for m in store.query_message("R", key)] == [put["phy"]], \
                f"{where}: {key} not found by key"
        for put in random.Random(where).sample(gone, min(len(gone), 100)):
            assert store.query_message("R", put["put"]) == [], f"{where}: an index hit in a deleted segment"
            msg = queue_message(store, "R", put["queue_id"], put["queue_offset"])
            assert msg is None, f"{where}: queue unit {put} points into a deleted segment and was served"
        for queue_id in (0, 1):
            first = store.get_min_offset_in_queue("R", queue_id)
            units = list(store.reader.iter_queue("R", queue_id, first))
            assert all(m.commit_log_offset >= low for m in units), f"{where}: a unit points below the log"
            in_log = [m.commit_log_offset for m in store.iter_messages() if (m.topic, m.queue_id) == ("R", queue_id)]
            assert [m.commit_log_offset for m in units] == in_log, f"{where}: queue R-{queue_id} and the log differ"
        self.stats["deleted puts checked"] += len(gone)

    def _check_topics(self, store: MessageStore, where: str) -> None:
        made = {name: cfg.write_queue_nums for name, cfg in store.topic_config.topics.items()
                if name.startswith("Made")}
        acked, next_op = topics_after(self.topic_ops), topics_after(self.topic_ops + 1)
        assert made in (acked, next_op), \
            f"{where}: topics {made} after {self.topic_ops} acknowledged operations, not {acked} or {next_op}"
        self.stats["unacknowledged topic operation kept"] += made == next_op != acked
        if self.puts:
            assert store.topic_config.get("Keep") is not None, where
        for key, put in self.puts.items():
            msg = queue_message(store, "Keep", 0, put["queue_offset"])
            assert msg is not None and msg.keys == [key] and msg.body == key.encode(), f"{where}: {key} lost"
            assert len(store.query_message("Keep", key)) == 1, f"{where}: {key} not found by key"

    def _check_delay(self, store: MessageStore, where: str) -> None:
        for key, put in self.puts.items():
            assert store.look_message_by_offset(put["phy"]).keys == [key], f"{where}: delayed put {key} lost"
        level_queue = store.queues.get(SCHEDULE_TOPIC, 0)
        persisted = store.delay_offsets.get(1)
        assert 0 <= persisted <= (level_queue.max_offset_in_queue if level_queue else 0), \
            f"{where}: delayOffset.json says {persisted}, past the schedule queue"

    def _check_offsets(self, store: MessageStore, where: str) -> None:
        for (group, queue_id), offset in self.persisted.items():
            now = store.query_offset(group, "C", queue_id)
            assert now >= offset, f"{where}: {group} C-{queue_id} went back from persisted {offset} to {now}"
            assert now <= store.get_max_offset_in_queue("C", queue_id), f"{where}: {group} offset {now} is invalid"

    def delivered(self, store: MessageStore) -> dict[str, list]:
        """Every copy delivered to Late, by key."""
        copies: dict[str, list] = {}
        for queue_id in store.queue_ids("Late"):
            for msg in store.reader.iter_queue("Late", queue_id):
                copies.setdefault(msg.keys[0], []).append(msg)
        return copies


def run_kill_cycles(root: Path, ledger: OpsLedger, cycles: int, log: Path) -> None:
    rng = random.Random(f"{ledger.seed}-{ledger.op}")
    for cycle in range(cycles):
        where = f"seed {ledger.seed}, op {ledger.op}, cycle {cycle} (ROCKETSTORE_CRASH_SEED={ledger.seed} replays)"
        writer = OpsWriter(root, ledger.op, cycle, ledger.topic_ops, log)
        ledger.take(writer.kill_after(rng.uniform(*KILL_AFTER[ledger.op])))
        config_files_parse(root, where)
        with MessageStore.open(root, QUIET) as store:
            ledger.check(store, where)
        config_files_parse(root, where)


def check_every_delay_delivered(root: Path, ledger: OpsLedger) -> None:
    """Deliver what is left, then: every acknowledged delayed message is in Late at least once; a second copy
    only of a message whose delivery a kill cut before delayOffset.json was persisted past it (as RocketMQ,
    which persists that file every flushDelayOffsetInterval), so at most one copy per kill since its put."""
    where = f"seed {ledger.seed}, op delay, final delivery"
    with MessageStore.open(root, QUIET) as store:
        ScheduleMessageService(store, store.delay_offsets).deliver_due(now_ms=FAR_FUTURE_MS)
        assert store.wait_for_dispatch(30)
        copies = ledger.delivered(store)
        uniq = {m.uniq_key for m in store.iter_messages() if m.topic == SCHEDULE_TOPIC}
    missing = sorted(set(ledger.puts) - set(copies))
    assert not missing, f"{where}: {len(missing)} acknowledged delayed messages never delivered: {missing[:5]}"
    for key, msgs in copies.items():
        assert all(m.body == key.encode() and m.uniq_key in uniq for m in msgs), f"{where}: {key} is no copy"
        assert len({m.uniq_key for m in msgs}) == 1, f"{where}: two different messages share key {key}"
        put = ledger.puts.get(key)
        if put is not None:
            assert len(msgs) <= 1 + ledger.kills - put["kill"] + 1, f"{where}: {key} delivered {len(msgs)} times"
        ledger.stats["redelivered after a kill"] += len(msgs) - 1


@pytest.mark.parametrize("op", ["retention", "topics", "delay", "offsets"])
def test_sigkill_during_an_operation_keeps_its_promises(tmp_path, op):
    ledger = OpsLedger(op, SEED)
    run_kill_cycles(tmp_path / "store", ledger, CI_CYCLES, tmp_path / "writer.log")
    if op == "delay":
        check_every_delay_delivered(tmp_path / "store", ledger)


@pytest.mark.slow
@pytest.mark.parametrize("op", ["retention", "topics", "delay", "offsets"])
def test_sigkill_during_an_operation_keeps_its_promises_long(tmp_path, op, request):
    long_form(request)
    ledger = OpsLedger(op, SEED + 1)
    run_kill_cycles(tmp_path / "store", ledger, SLOW_CYCLES, tmp_path / "writer.log")
    if op == "delay":
        check_every_delay_delivered(tmp_path / "store", ledger)
    print(f"{op}: {SLOW_CYCLES} kills, {len(ledger.puts)} puts and {len(ledger.persisted)} offsets acknowledged, "
          f"{dict(ledger.stats)}")


# --- the Spark rebuild ----------------------------------------------------------------------------------------

REBUILD_MESSAGES = 300
MOVED_ASIDE = "recovery/rebuild-*"  # the old consumequeue/ and index/ were swapped out (the rebuild's last step)
BUILDING = ".staging/rebuild-*"  # the new ones are being written aside, the old ones still in place
SWAPPING = ".staging/rebuild-*/swap"  # the new ones are complete: renamed into place, or the next open does it


def wait_for_phase(proc: subprocess.Popen, root: Path, phase: str | None, timeout: float = 120) -> bool:
    """Poll (there is no event to wait on in another process) until ``phase`` shows in the store; False if the
    rebuild finished first."""
    deadline = time.monotonic() + timeout
    while phase is not None and not list(root.glob(phase)):
        if proc.poll() is not None:
            return False
        assert time.monotonic() < deadline, f"the rebuild never reached {phase}"
        time.sleep(0.01)
    return True


def rebuild_kill_cycles(tmp_path: Path, plans: list[tuple[str | None, float]]) -> Counter:
    """The Spark rebuild builds consume queues and index aside and swaps them in when complete; killed at any
    point (``plans``: a phase to reach, then seconds more), the store still has its old queues and index unless
    the swap was under way, and the reopened store has every message in its queue and by key and nothing
    half-built is left behind."""
    pytest.importorskip("pyspark")
    root = tmp_path / "store"
    with MessageStore.open(root, QUIET) as store:
        for i in range(REBUILD_MESSAGES):
            store.put_message(Message(f"T{i % 3}", f"b{i}".encode(), keys=[f"k{i}"], queue_id=i % 4))
    cli = Path(sys.executable).with_name("rocketstore")
    landed: Counter = Counter()
    for cycle, (phase, seconds) in enumerate(plans):
        where = f"seed {SEED}, rebuild killed {seconds:.2f} s after {phase or 'its start'}, cycle {cycle}"
        for old in root.glob(MOVED_ASIDE):
            os.rename(old, tmp_path / f"old-{cycle}-{old.name}")  # so that the next phase is seen anew
        geometry = ["--max-hash-slot-num", str(QUIET.max_hash_slot_num), "--max-index-num", str(QUIET.max_index_num)]
        with open(tmp_path / "rebuild.log", "wb") as err:
            proc = subprocess.Popen([str(cli), "rebuild", "--store", str(root), "--master", "local[1]", *geometry],
                                    stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        try:
            if wait_for_phase(proc, root, phase):
                time.sleep(seconds)  # the random kill moment within the phase
        finally:
            finished = proc.poll() is not None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        assert not finished or proc.returncode == 0, (tmp_path / "rebuild.log").read_text()[-2000:]
        swapping = bool(list(root.glob(SWAPPING)))
        landed["finished before the kill" if finished else "while swapping in" if swapping else
               "while building aside" if list(root.glob(BUILDING)) else "before building"] += 1
        if not swapping:  # a rebuild that did not reach its swap leaves the old set, one that did the new set
            assert (root / "consumequeue").is_dir() and (root / "index").is_dir(), f"{where}: queues or index gone"
        with MessageStore.open(root, QUIET) as store:
            assert store.wait_for_dispatch(30), where
            assert sum(1 for _ in store.iter_messages()) == REBUILD_MESSAGES, f"{where}: the log lost messages"
            for t in range(3):
                for q in range(4):
                    bodies = [m.body for m in store.reader.iter_queue(f"T{t}", q)]
                    want = [f"b{i}".encode() for i in range(REBUILD_MESSAGES) if i % 3 == t and i % 4 == q]
                    assert bodies == want, f"{where}: queue T{t}-{q} holds {len(bodies)} of {len(want)}"
            for i in range(REBUILD_MESSAGES):
                assert [m.body for m in store.query_message(f"T{i % 3}", f"k{i}")] == [f"b{i}".encode()], where
        assert not list(root.glob(BUILDING)), f"{where}: a half-built rebuild was left behind"
    return landed


def test_sigkill_during_a_rebuild_leaves_a_store_that_rebuilds_itself(tmp_path):
    rng = random.Random(f"{SEED}-rebuild")
    landed = rebuild_kill_cycles(tmp_path, [(BUILDING, rng.uniform(0, 1)), (BUILDING, rng.uniform(0, 0.01))])
    assert landed["finished before the kill"] == 0, landed


@pytest.mark.slow
def test_sigkill_during_a_rebuild_long(tmp_path, request):
    long_form(request)
    rng = random.Random(f"{SEED + 1}-rebuild")
    plans = [(None, rng.uniform(0.5, 25)) for _ in range(6)] + [(BUILDING, rng.uniform(0, 0.2)) for _ in range(4)]
    print("rebuild kills landed:", dict(rebuild_kill_cycles(tmp_path, plans)))


# --- retention and dispatch: bugs the loop above found (fixed; these pin them) -----------------------------------

SMALL = StoreConfig(mapped_file_size_commit_log=16 * 1024, mapped_file_size_consume_queue=20 * 40,
                    enable_schedule_message=False)


def test_an_idle_queue_keeps_its_offsets_after_retention_and_a_reopen(tmp_path):
    with MessageStore.open(tmp_path, SMALL) as store:
        for _ in range(10):
            store.put_message(Message("Idle", b"a" * 100))
        for _ in range(100):  # other traffic rolls segments until Idle's records are all in expired ones
            store.put_message(Message("Busy", b"b" * 500))
        assert store.wait_for_dispatch()
        store.delete_expired_files(now_ms=FAR_FUTURE_MS, immediately=True)
        assert store.min_phy_offset > 0 and store.get_max_offset_in_queue("Idle", 0) == 10
    with MessageStore.open(tmp_path, SMALL) as store:
        assert store.get_max_offset_in_queue("Idle", 0) == 10, "the queue was cut"
        assert store.put_message(Message("Idle", b"new")).queue_offset == 10, "queue offsets were reused"


def test_retention_keeps_segments_dispatch_has_not_read(tmp_path):
    """An expired segment the dispatcher has not read to its end stays (its messages would reach no queue and no
    index); once dispatch has read it, the next pass deletes it."""
    with MessageStore.open(tmp_path, SMALL) as store:
        assert store.dispatcher is not None
        with store.dispatcher._round_lock:  # hold dispatch back (the seam a slow round gives) while retention runs
            results = [store.put_message(Message("T", f"m{i}".encode() * 100, keys=[f"k{i}"])) for i in range(100)]
            held = store.dispatcher.reput_from_offset
            report = store.delete_expired_files(now_ms=FAR_FUTURE_MS, immediately=True)
            assert store.min_phy_offset <= held, "retention deleted a segment dispatch had not read"
            assert all(int(name) + SMALL.mapped_file_size_commit_log <= held for name in report.commit_log_files)
        assert store.wait_for_dispatch(2), "dispatch never resumed"
        for i, result in enumerate(results):  # every message reached its queue and the index
            assert [m.commit_log_offset for m in store.query_message("T", f"k{i}")] == [result.commit_log_offset]
            assert store.get_message("T", 0, result.queue_offset, 1).messages[0].commit_log_offset \
                == result.commit_log_offset
        report = store.delete_expired_files(now_ms=FAR_FUTURE_MS, immediately=True)
        assert report.commit_log_files and store.min_phy_offset > 0, "dispatched segments were not deleted"
        newest = list(store.iter_messages())
        assert newest and all(store.query_message("T", m.keys[0]) for m in newest)


def test_readers_racing_retention_get_answers_never_errors_or_wrong_messages(tmp_path, caplog):
    """Queue reads (one by one and as Arrow), key queries and offset lookups while retention deletes the files they
    read (a queue file went before the queue's minimum moved past it: the Arrow read raised): a vanished file
    is 'too small'/'was removing'/not found, never an I/O error, a closed-mapping ValueError or a wrong message,
    nor a record logged as unreadable (a queue read logged each record whose segment went after the read began)."""
    with MessageStore.open(tmp_path, SMALL) as store:
        first = [store.put_message(Message("T", b"x" * 400, keys=[f"k{i}"])) for i in range(600)]
        assert store.wait_for_dispatch()
        stop, failures, served = threading.Event(), Counter(), Counter()

        def reader(seed: int) -> None:
            rng = random.Random(seed)
            while not stop.is_set():  # a spin: lookups keep the GIL, so dispatch and retention still get it
                i = rng.randrange(len(first))
                try:
                    result = store.get_message("T", 0, i, 8)
                    for n, msg in enumerate(result.messages):
                        assert msg.queue_offset >= i and msg.topic == "T"
                        if msg.queue_offset < len(first):
                            assert msg.commit_log_offset == first[msg.queue_offset].commit_log_offset
                        served["queue"] += n == 0
                    for msg in store.query_message("T", f"k{i}"):
                        assert msg.commit_log_offset == first[i].commit_log_offset
                        served["key"] += 1
                    try:
                        assert store.look_message_by_offset(first[i].commit_log_offset).keys == [f"k{i}"]
                        served["offset"] += 1
                    except MessageNotFoundError:
                        pass
                    for batch in store.queue_arrow("T", 0, i, i + 16):
                        for queue_offset, phy in zip(batch.column("queueOffset").to_pylist(),
                                                     batch.column("commitLogOffset").to_pylist(), strict=True):
                            assert queue_offset >= i and (queue_offset >= len(first)
                                                          or phy == first[queue_offset].commit_log_offset)
                            served["arrow"] += 1
                except Exception as exc:  # every other outcome is the failure under test
                    failures[f"{type(exc).__name__}: {exc}"] += 1

        threads = [threading.Thread(target=reader, args=(n,)) for n in range(2)]
        for t in threads:
            t.start()
        try:
            deadline = time.monotonic() + 60  # every kind of read answered once before retention starts (a loaded
            while not all(served[kind] for kind in ("queue", "key", "offset", "arrow")) \
                    and time.monotonic() < deadline:
                time.sleep(0.001)  # machine gave the readers no turn before the first batch had gone)
            for _ in range(40):
                store.put_message(Message("T", b"y" * 400))
                store.delete_expired_files(now_ms=FAR_FUTURE_MS, immediately=True)
                time.sleep(0.002)
            assert store.wait_for_dispatch()  # a segment dispatch had not read yet was kept: delete it now
            store.delete_expired_files(now_ms=FAR_FUTURE_MS, immediately=True)
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert not failures, failures.most_common(5)
        assert not [r.message for r in caplog.records if r.levelno >= logging.ERROR]
        assert store.min_phy_offset > first[-1].commit_log_offset, "retention did not run through the first batch"
        assert served["queue"] and served["key"] and served["offset"] and served["arrow"]


def test_scans_and_lookups_racing_retention_answer_or_raise_a_typed_error(tmp_path):
    """Scans from an offset, many-key and by-time lookups, ids and UNIQ_KEYs while retention deletes segments.
    Retention destroyed a segment before taking it out of the file list, and the list's two arrays were replaced
    one after the other: a read in between met a closed mapping ("ValueError: mmap closed or invalid" out of
    scan_arrow and iter_messages) or the wrong segment, and a lookup by time raised SegmentDeletedError; index
    files (67 entries each here) were destroyed before leaving theirs, so key lookups raised "index file is
    closed" or a ValueError. Now a scan may end with SegmentDeletedError when the segment it was started in goes;
    everything else answers."""
    from rocketstore.errors import RocketStoreError, SegmentDeletedError

    with MessageStore.open(tmp_path, SMALL.replace(max_hash_slot_num=17, max_index_num=68)) as store:
        first = [store.put_message(Message("T", b"x" * 400, keys=[f"k{i}"], queue_id=i % 2)) for i in range(600)]
        assert store.wait_for_dispatch()
        stop, failures, served = threading.Event(), Counter(), Counter()
        kinds = ("scan", "iter", "many", "by time", "by id", "by uniq key", "by key")

        def reader(seed: int) -> None:
            rng = random.Random(seed)
            while not stop.is_set():
                i, kind = rng.randrange(len(first)), kinds[rng.randrange(len(kinds))]
                try:
                    if kind == "scan":
                        for batch in store.scan_arrow(begin=first[i].commit_log_offset, max_rows=16):
                            assert batch.column("commitLogOffset")[0].as_py() >= first[i].commit_log_offset
                            break
                    elif kind == "iter":
                        for n, msg in enumerate(store.iter_messages(first[i].commit_log_offset)):
                            assert msg.commit_log_offset >= first[i].commit_log_offset
                            if n == 16:
                                break
                    elif kind == "many":
                        found = store.query_messages_arrow([("T", f"k{j}") for j in range(i, min(i + 16, 600))])
                        assert set(found.column("commitLogOffset").to_pylist()) <= {
                            r.commit_log_offset for r in first[i : i + 16]}
                    elif kind == "by time":
                        assert store.get_offset_in_queue_by_time("T", i % 2, first[i].store_timestamp) >= 0
                    elif kind == "by id":
                        with contextlib.suppress(MessageNotFoundError):
                            assert store.view_message_by_id(first[i].msg_id).keys == [f"k{i}"]
                    elif kind == "by uniq key":
                        for msg in store.query_message_by_uniq_key("T", first[i].uniq_key):
                            assert msg.commit_log_offset == first[i].commit_log_offset
                    else:
                        for msg in store.query_message("T", f"k{i}"):
                            assert msg.commit_log_offset == first[i].commit_log_offset
                    served[kind] += 1
                except SegmentDeletedError as exc:
                    if kind not in ("scan", "iter"):
                        failures[f"{kind}: {type(exc).__name__}: {exc}"] += 1
                except RocketStoreError as exc:
                    failures[f"{kind}: {type(exc).__name__}: {exc}"] += 1
                except Exception as exc:  # an untyped error, or a wrong answer
                    failures[f"{kind}: {type(exc).__name__}: {exc}"] += 1

        threads = [threading.Thread(target=reader, args=(n,)) for n in range(2)]
        for t in threads:
            t.start()
        try:
            deadline = time.monotonic() + 60
            while not all(served[kind] for kind in kinds) and time.monotonic() < deadline:
                time.sleep(0.001)
            for _ in range(40):
                store.put_message(Message("T", b"y" * 400))
                store.delete_expired_files(now_ms=FAR_FUTURE_MS, immediately=True)
                time.sleep(0.003)
            assert store.wait_for_dispatch()
            store.delete_expired_files(now_ms=FAR_FUTURE_MS, immediately=True)
            time.sleep(0.1)
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert not failures, failures.most_common(5)
        assert all(served[kind] for kind in kinds), served
        assert store.min_phy_offset > first[-1].commit_log_offset, "retention did not run through the first batch"
        assert store.index.files[0].begin_phy_offset > first[-1].commit_log_offset, "index files were not retired"


# --- two writers through different paths -------------------------------------------------------------------------

def path_forms(tmp_path: Path) -> dict[str, Path]:
    """The same store directory named eight ways (the process's working directory is ``tmp_path/sub``)."""
    root = tmp_path / "store"
    return {"absolute": root, "symlink": tmp_path / "link", "other symlink": tmp_path / "link2",
            "symlink to a symlink": tmp_path / "link3", "relative": Path("../store"),
            "with ..": tmp_path / "sub" / ".." / "store", "relative through a symlink": Path("../link/"),
            "doubled slashes": Path(f"{tmp_path}//store//")}


@pytest.fixture
def forms(tmp_path, monkeypatch) -> dict[str, Path]:
    root = tmp_path / "store"
    root.mkdir()
    (tmp_path / "link").symlink_to(root, target_is_directory=True)
    (tmp_path / "link2").symlink_to(root, target_is_directory=True)
    (tmp_path / "link3").symlink_to(tmp_path / "link", target_is_directory=True)
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    return path_forms(tmp_path)


def test_a_second_writer_in_the_process_is_refused_whatever_the_paths(forms):
    for first_name, first in forms.items():
        with MessageStore.open(first, SMALL):
            for second_name, second in forms.items():
                with pytest.raises(StoreLockedError):
                    MessageStore.open(second, SMALL)
                    pytest.fail(f"opened through {second_name!r} while open through {first_name!r}")
        MessageStore.open(first, SMALL).close()  # and the lock was released


HOLD = """
import sys
from rocketstore import MessageStore, StoreConfig
store = MessageStore.open(sys.argv[1], StoreConfig(enable_schedule_message=False))
print("open", flush=True)
sys.stdin.read()
"""
TRY = """
import json, sys
from rocketstore import MessageStore, StoreConfig
from rocketstore.errors import MessageNotFoundError, StoreLockedError
refused = {}
for path in sys.argv[1:]:
    try:
        MessageStore.open(path, StoreConfig(enable_schedule_message=False)).close()
        refused[path] = False
    except StoreLockedError:
        refused[path] = True
print(json.dumps(refused))
"""


def test_a_second_writer_in_another_process_is_refused_whatever_the_paths(forms):
    names = [str(p) for p in forms.values()]
    with MessageStore.open(forms["symlink"], SMALL):  # held here, tried from a child
        done = subprocess.run([sys.executable, "-c", TRY, *names], check=True, capture_output=True, text=True,
                              timeout=60)
        assert json.loads(done.stdout) == dict.fromkeys(names, True), done.stderr
    for held in ("relative through a symlink", "with .."):  # held by a child, tried here
        child = subprocess.Popen([sys.executable, "-c", HOLD, str(forms[held])], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline() == "open\n"
            for name, path in forms.items():
                with pytest.raises(StoreLockedError):
                    MessageStore.open(path, SMALL)
                    pytest.fail(f"opened through {name!r} while a child holds it through {held!r}")
        finally:
            child.communicate("", timeout=30)
    MessageStore.open(forms["absolute"], SMALL).close()


def test_a_second_writer_through_a_bind_mount_is_refused(tmp_path):
    root, bind = tmp_path / "store", tmp_path / "bind"
    root.mkdir()
    bind.mkdir()
    mount = ["mount", "--bind", str(root), str(bind)]
    if os.geteuid() != 0 or subprocess.run(mount, check=False, capture_output=True).returncode:
        pytest.skip("bind mounts need root (CAP_SYS_ADMIN)")
    try:
        with MessageStore.open(root, SMALL):
            with pytest.raises(StoreLockedError):
                MessageStore.open(bind, SMALL)
            done = subprocess.run([sys.executable, "-c", TRY, str(bind)], check=True, capture_output=True, text=True,
                                  timeout=60)
            assert json.loads(done.stdout) == {str(bind): True}, done.stderr
        with MessageStore.open(bind, SMALL), pytest.raises(StoreLockedError):
            MessageStore.open(root, SMALL)
    finally:
        subprocess.run(["umount", str(bind)], check=True)


def test_a_rebuild_through_a_symlink_is_refused_while_a_writer_holds_the_store(forms):
    from rocketstore.spark.jobs import rebuild

    with MessageStore.open(forms["absolute"], SMALL) as store:
        store.put_message(Message("T", b"x"))
        with pytest.raises(StoreLockedError):
            rebuild(forms["symlink to a symlink"], config=SMALL)  # refused before any Spark session starts


# --- index chains that cycle --------------------------------------------------------------------------------------

CHAINS = StoreConfig(mapped_file_size_commit_log=1 << 20, max_hash_slot_num=97, max_index_num=60,
                     enable_schedule_message=False)
SHARED = 50  # messages carrying the key "shared"; with UNIQ_KEY and an own key, 150 entries: three index files


def shared_key_store(root: Path) -> list[Path]:
    with MessageStore.open(root, CHAINS) as store:
        for i in range(SHARED):
            store.put_message(Message("T", f"m{i}".encode(), keys=["shared", f"own{i}"]))
        assert store.wait_for_dispatch()
        assert len(store.query_message("T", "shared")) == SHARED
    files = sorted((root / "index").iterdir())
    assert len(files) == 3, files
    return files


def relink(path: Path, make_prev) -> None:
    """Rewrite the prev pointer of the second entry of "T#shared"'s chain to ``make_prev(head, count)``."""
    index = IndexFile.open(path, CHAINS.max_hash_slot_num, CHAINS.max_index_num)
    try:
        entries_at = 40 + CHAINS.max_hash_slot_num * 4
        head = struct.unpack_from(">i", index.buffer, 40 + index.slot_of("T#shared")[1] * 4)[0]
        older = struct.unpack_from(">i", index.buffer, entries_at + head * 20 + 16)[0]
        assert 0 < older < head
        struct.pack_into(">i", index.buffer, entries_at + older * 20 + 16, make_prev(head, index.index_count))
        index.flush()
        assert chain_problem(index) is not None
    finally:
        index.close()


def digests(root: Path) -> dict[Path, str]:
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()}


def query_in_thread(root: Path, read_only: bool, key: str = "shared") -> tuple[list, MessageStore]:
    """Open and query from another thread, so a walk that never ends fails the test instead of hanging it."""
    out: dict = {}

    def work() -> None:
        with MessageStore.open(root, CHAINS, read_only=read_only) as store:
            out["store"] = store
            assert store.wait_for_dispatch(30)
            out["found"] = store.query_message("T", key, max_num=1000)
            out["own"] = [len(store.query_message("T", f"own{i}")) for i in range(SHARED)]

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "the open or the query hangs"
    return out["found"], out


@pytest.mark.parametrize("damaged", [-1, -2], ids=["newest file", "middle file"])
def test_an_index_chain_that_cycles_is_skipped_read_only_and_rebuilt_by_a_writer(tmp_path, caplog, damaged):
    files = shared_key_store(tmp_path)
    relink(files[damaged], lambda head, count: head)  # older -> head -> older ...: a cycle
    before = digests(tmp_path)
    with caplog.at_level(logging.WARNING, logger="rocketstore.index.service"):
        found, out = query_in_thread(tmp_path, read_only=True)
    assert digests(tmp_path) == before, "a read-only open changed a byte"
    assert out["store"].index.damaged == [files[damaged].name]
    assert files[damaged].name in caplog.text and "read-only" in caplog.text
    # what the other files hold, once each; past the last file left, the view's in-memory index of the log's tail
    assert len(found) == len({m.commit_log_offset for m in found})
    assert (len(found) == SHARED) if damaged == -1 else (len(found) < SHARED)
    found, out = query_in_thread(tmp_path, read_only=False)
    store = out["store"]
    assert store.index.set_aside is not None and (Path(store.index.set_aside) / files[damaged].name).exists()
    assert sorted(m.body for m in found) == sorted(f"m{i}".encode() for i in range(SHARED))
    assert out["own"] == [1] * SHARED  # the oldest file's keys too: the whole log was indexed again
    for path in sorted((tmp_path / "index").iterdir()):
        index = IndexFile.open(path, CHAINS.max_hash_slot_num, CHAINS.max_index_num, read_only=True)
        assert chain_problem(index) is None
        index.close()


def test_a_link_past_the_count_is_damage_too(tmp_path):
    files = shared_key_store(tmp_path)
    relink(files[-1], lambda head, count: count + 3)
    found, out = query_in_thread(tmp_path, read_only=False)
    assert out["store"].index.set_aside is not None and len(found) == SHARED


def test_a_read_only_open_of_a_live_store_takes_a_slot_ahead_of_the_count_for_a_put_in_progress(tmp_path):
    """A writer puts an entry and its slot before the header's count: a reader that opens in between must not
    call the file damaged (a writer open repairs such a slot; a reader just does not follow it)."""
    files = shared_key_store(tmp_path)
    index = IndexFile.open(files[-1], CHAINS.max_hash_slot_num, CHAINS.max_index_num)
    entries_at = 40 + CHAINS.max_hash_slot_num * 4
    key_hash, slot = index.slot_of("T#shared")
    count = index.index_count
    head = struct.unpack_from(">i", index.buffer, 40 + slot * 4)[0]
    struct.pack_into(">iqii", index.buffer, entries_at + count * 20, key_hash, 1 << 40, 0, head)
    struct.pack_into(">i", index.buffer, 40 + slot * 4, count)  # the slot is written, the count is not yet
    index.close()
    assert chain_problem(IndexFile.open(files[-1], CHAINS.max_hash_slot_num, CHAINS.max_index_num,
                                        read_only=True)) is not None  # a writer's open would repair it first
    found, out = query_in_thread(tmp_path, read_only=True)
    assert out["store"].index.damaged == [] and len(found) == SHARED


RETENTION_KILLED = """
import os, sys
from rocketstore import Message, MessageStore, StoreConfig
from rocketstore.consumequeue import ConsumeQueue
store = MessageStore.open(sys.argv[1], StoreConfig(mapped_file_size_commit_log=16 * 1024,
                          mapped_file_size_consume_queue=20 * 40, enable_schedule_message=False))
for i in range(100):
    store.put_message(Message("R", f"m{i}".encode() * 300, keys=[f"k{i}"]))
assert store.wait_for_dispatch(30)
ConsumeQueue.delete_files_before = lambda *args: os._exit(9)  # the kill lands after the segments went
store.delete_expired_files(now_ms=10**15, immediately=True)
"""


def test_a_kill_between_segment_and_queue_deletion_keeps_live_messages_in_their_queue(tmp_path):
    done = subprocess.run([sys.executable, "-c", RETENTION_KILLED, str(tmp_path)], check=False, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 9, done.stderr
    with MessageStore.open(tmp_path, SMALL) as store:
        live = [m for m in store.iter_messages()]
        assert live and store.min_phy_offset > 0
        for msg in live:
            got = queue_message(store, "R", 0, msg.queue_offset)
            assert got is not None and got.commit_log_offset == msg.commit_log_offset, \
                f"queue offset {msg.queue_offset} not served; queue min {store.get_min_offset_in_queue('R', 0)}"

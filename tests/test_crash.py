"""Crash safety: SIGKILL a writer process again and again and check what the store recovers.

Each cycle starts ``crash_writer.py`` on the same store, lets it write for a random moment
(single puts, batches, segment rolls, flushes, dispatch and checkpoints all run continuously),
kills it with SIGKILL and reopens the store here, which runs abnormal recovery. The recovered
store must hold every acknowledged message of every cycle so far, unchanged and where its put
said; every record in the log must decode and be a message some writer really put, each put
whole or not at all; queue offsets must stay dense and the consume queues and the index must
agree with the log; and the space after the log must be zero.

``ROCKETSTORE_CRASH_SEED`` replays a run. The long form (``-m slow``) runs
``ROCKETSTORE_CRASH_CYCLES`` cycles, on a fresh store every ``ROCKETSTORE_CRASH_CYCLES_PER_STORE``
so that checking the whole log after every kill stays affordable.
"""

from __future__ import annotations

import functools
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from crash_writer import (
    SEGMENT_SIZE,
    SEQ_PROPERTY,
    body_digest,
    message_spec,
    parse_seq_id,
    store_config,
    thread_plan,
    written_in_parts,
)
from rocketstore import FlushDiskType, MessageExt, MessageStore, PutMessageStatus
from rocketstore.errors import StoreLockedError
from rocketstore.mapped.file import parse_segment_name, segment_name

WRITER = Path(__file__).with_name("crash_writer.py")
MODES = [FlushDiskType.SYNC_FLUSH.value, FlushDiskType.ASYNC_FLUSH.value]
BASE_SEED = int(os.environ.get("ROCKETSTORE_CRASH_SEED", "20240611"))
CI_CYCLES = 20
SLOW_CYCLES = int(os.environ.get("ROCKETSTORE_CRASH_CYCLES", "500"))
SLOW_CYCLES_PER_STORE = int(os.environ.get("ROCKETSTORE_CRASH_CYCLES_PER_STORE", "50"))
KILL_AFTER = (0.02, 0.35)  # seconds of writing between the first acknowledgement and the kill
EARLY_KILL_AFTER = (0.0, 0.3)  # seconds from a writer's start to its kill: import, open, recovery or writing
EXTRA_RUNS = (0, 0, 1, 2)  # writers killed early before the one whose kill is checked
FIRST_ACK_TIMEOUT = 60.0  # a cold interpreter on a loaded CI machine can be slow
INDEX_CHECKS = 300  # newest messages looked up by key and UNIQ_KEY after a kill (and a third as many older)

Queue = tuple[str, int]  # (topic, queue id)
WriterThread = tuple[int, int]  # (writer seed, thread)
GENERATED_FIELDS = ("seq", "topic", "queue_id", "tags", "keys", "body_len", "body_sha256")


# --- the writer process ------------------------------------------------------------------------

class WriterProcess:
    """``crash_writer.py`` running on a store; a thread drains its stdout so it never blocks on a full pipe.

    Used as a context manager, so the process is killed and reaped whatever happens in the test.
    """

    def __init__(self, root: Path, seed: int, mode: str, log_dir: Path) -> None:
        self.stderr_path = log_dir / f"writer-{seed}.stderr"
        self.lines: list[bytes] = []
        self._acked = threading.Event()
        with open(self.stderr_path, "wb") as stderr:
            self.proc = subprocess.Popen([sys.executable, str(WRITER), str(root), str(seed), mode],
                                         stdout=subprocess.PIPE, stderr=stderr)
        self._reader = threading.Thread(target=self._drain, name=f"crash-writer-{seed}-stdout", daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.endswith(b"\n"):  # a line cut short was never flushed, so it acknowledges nothing
                self.lines.append(line)
                self._acked.set()
        self._acked.set()  # end of file: wake a waiter so it can report the exit

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")[-4000:]

    def wait_first_ack(self, timeout: float = FIRST_ACK_TIMEOUT) -> None:
        if not self._acked.wait(timeout):
            raise AssertionError(f"the writer acknowledged nothing within {timeout} s:\n{self.stderr()}")
        assert self.lines, f"the writer exited with {self.proc.wait()} before acknowledging:\n{self.stderr()}"

    def kill(self) -> list[dict]:
        """SIGKILL the writer (it must still be running) and return its acknowledgements."""
        alive = self.proc.poll() is None
        self.close()
        assert alive, f"the writer died on its own with {self.proc.returncode}:\n{self.stderr()}"
        assert self.proc.returncode == -signal.SIGKILL
        return [json.loads(line) for line in self.lines]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._reader.join()
        assert self.proc.stdout is not None
        self.proc.stdout.close()

    def __enter__(self) -> WriterProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# --- what a stored message must look like ------------------------------------------------------

def describe(msg: MessageExt) -> dict:
    """A stored message in the form of the writer's acknowledgement lines (without ``status``)."""
    return {"seq": msg.properties.get(SEQ_PROPERTY), "topic": msg.topic, "queue_id": msg.queue_id, "tags": msg.tags,
            "keys": msg.keys, "body_len": len(msg.body), "body_sha256": body_digest(msg.body),
            "commit_log_offset": msg.commit_log_offset, "queue_offset": msg.queue_offset, "msg_id": msg.msg_id,
            "uniq_key": msg.uniq_key, "store_size": msg.store_size, "store_timestamp": msg.store_timestamp}


@functools.lru_cache(maxsize=1 << 18)  # the log is walked after every kill: regenerate each body once
def generated(seq: str) -> dict:
    """What the writer's generator puts for ``seq``: the ``GENERATED_FIELDS`` of its message."""
    spec = message_spec(seq)
    return {"seq": seq, "topic": spec.topic, "queue_id": spec.queue_id, "tags": spec.tags, "keys": list(spec.keys),
            "body_len": len(spec.body), "body_sha256": body_digest(spec.body)}


def check_generated(stored: dict) -> None:
    seq = stored["seq"]
    assert seq is not None, f"the record at {stored['commit_log_offset']} was put by no writer: {stored}"
    assert {name: stored[name] for name in GENERATED_FIELDS} == generated(seq), \
        f"the record at {stored['commit_log_offset']} is not the message its writer put"


def check_acknowledged(stored: dict, ack: dict) -> None:
    assert ack["status"] == PutMessageStatus.PUT_OK.value, ack
    assert stored | {"status": ack["status"]} == ack, "an acknowledged message changed"


# --- what was acknowledged, and the checks -----------------------------------------------------

@dataclass
class CrashLedger:
    """The acknowledgements of every cycle on one store, and the checks a recovered store must pass."""

    root: Path
    mode: str
    acks: dict[int, dict] = field(default_factory=dict)  # by commit-log offset
    acked_per_thread: dict[WriterThread, int] = field(default_factory=dict)
    seeds: set[int] = field(default_factory=set)
    new_acks: list[dict] = field(default_factory=list)  # acknowledged since the last check
    new_seeds: list[int] = field(default_factory=list)
    stats: Counter = field(default_factory=Counter)

    def record(self, seed: int, acks: list[dict]) -> None:
        """Take in one writer run's acknowledgements (each thread's come in put order)."""
        self.seeds.add(seed)
        self.new_seeds.append(seed)
        self.new_acks.extend(acks)
        per_thread: dict[int, list[int]] = defaultdict(list)
        for ack in acks:
            ack_seed, thread, n = parse_seq_id(ack["seq"])
            assert ack_seed == seed, ack
            per_thread[thread].append(n)
            assert ack["commit_log_offset"] not in self.acks, f"two puts acknowledged at one offset: {ack}"
            self.acks[ack["commit_log_offset"]] = ack
        for thread, numbers in per_thread.items():
            assert numbers == list(range(len(numbers))), f"thread {thread} acknowledged out of order"
            self.acked_per_thread[(seed, thread)] = len(numbers)
        self.stats["acknowledged"] += len(acks)

    def verify(self, store: MessageStore) -> None:
        """Every check on a store reopened after a kill."""
        report = store.recovery
        assert report is not None and report.abnormal, "a SIGKILLed writer leaves the abort file behind"
        assert report.end_offset == store.max_phy_offset, report
        present, queues, newest = self._check_log(store)
        for writer_thread in self.acked_per_thread.keys() | present.keys():
            self._check_puts_whole(writer_thread, present.get(writer_thread, []))
        for ack in self.new_acks:
            check_acknowledged(describe(store.look_message_by_offset(ack["commit_log_offset"])), ack)
        self._check_zero_after_log(store)
        check_consume_queues(store, queues)
        older = random.Random(len(self.acks)).sample(sorted(self.acks), min(len(self.acks), INDEX_CHECKS // 3))
        check_index(store, newest + [self.acks[phy] for phy in older])
        self.new_acks, self.new_seeds = [], []
        self.stats["cycles"] += 1
        self.stats["torn tails cut"] += report.cut_bytes > 0
        self.stats["segments moved aside"] += sum(p.endswith(".segment") for p in report.salvaged)
        self.stats["largest log (MiB)"] = max(self.stats["largest log (MiB)"], store.max_phy_offset >> 20)

    def _check_log(self, store: MessageStore) -> tuple[dict[WriterThread, list[int]], dict[Queue, list[tuple]],
                                                       list[dict]]:
        """Walk the whole log. Returns the message numbers found per writer thread, the (commit-log
        offset, size) of each queue's messages, both in log order, and the newest messages."""
        present: dict[WriterThread, list[int]] = defaultdict(list)
        queues: dict[Queue, list[tuple]] = defaultdict(list)
        newest: deque[dict] = deque(maxlen=INDEX_CHECKS)
        found_acks = 0
        expected = store.min_phy_offset
        for msg in store.iter_messages():
            phy = msg.commit_log_offset
            assert phy == expected or (phy % SEGMENT_SIZE == 0 and 0 < phy - expected < SEGMENT_SIZE), \
                f"the record at {phy} does not follow the previous one, which ended at {expected}"
            expected = phy + msg.store_size
            queue = (msg.topic, msg.queue_id)
            assert msg.queue_offset == len(queues[queue]), f"queue offsets of {queue} are not dense at {phy}"
            queues[queue].append((phy, msg.store_size))
            stored = describe(msg)
            check_generated(stored)
            newest.append(stored)
            seed, thread, n = parse_seq_id(stored["seq"])
            assert seed in self.seeds, f"the record at {phy} comes from no writer run of this test: {stored}"
            present[(seed, thread)].append(n)
            ack = self.acks.get(phy)
            if ack is not None:
                check_acknowledged(stored, ack)
                found_acks += 1
        assert store.max_phy_offset in (expected, _roll(expected)), \
            f"the log ends at {store.max_phy_offset} but its last record ends at {expected}"
        if found_acks != len(self.acks):
            missing = sorted(self.acks.keys() - {m.commit_log_offset for m in store.iter_messages()})
            raise AssertionError(f"{len(missing)} acknowledged messages are gone, the first: {self.acks[missing[0]]}")
        for queue, records in queues.items():
            assert store.next_queue_offset(*queue) == len(records), queue
        self.stats["records checked"] += sum(len(numbers) for numbers in present.values())
        return present, queues, list(newest)

    def _check_puts_whole(self, writer_thread: WriterThread, present: list[int]) -> None:
        """A thread's messages are in the log in put order with no gap, and each put is there whole or not at all.

        Past its acknowledged messages a thread may have one more put in the log (written, but
        killed before it was acknowledged), and a batch some of whose messages were acknowledged
        must be there entirely.
        """
        seed, thread = writer_thread
        acked = self.acked_per_thread.get(writer_thread, 0)
        assert present == list(range(len(present))), f"writer {writer_thread}: messages missing or out of order"
        pending = next(put for put in thread_plan(seed, thread) if put.stop > acked)
        allowed = {pending.stop} if pending.start < acked else {acked, pending.stop}
        if written_in_parts(pending) and pending.start >= acked:  # a prefix of whole rows, as documented
            allowed = set(range(acked, pending.stop + 1))
            self.stats["tables larger than a segment cut by the kill"] += acked < len(present) < pending.stop
        assert len(present) in allowed, \
            f"writer {writer_thread}: {len(present)} messages in the log, {acked} acknowledged, next put {pending}"
        self.stats["unacknowledged but kept"] += len(present) - acked
        self.stats["batches cut by the kill between acknowledgements"] += pending.start < acked

    def _check_zero_after_log(self, store: MessageStore) -> None:
        """Recovery leaves zeroes after the end (the next append relies on them) and no later segment."""
        end = store.max_phy_offset
        directory = self.root / "commitlog"
        starts = sorted(s for s in map(parse_segment_name, os.listdir(directory)) if s is not None)
        assert starts == list(range(starts[0], starts[-1] + 1, SEGMENT_SIZE)), starts
        assert starts[-1] <= end < starts[-1] + SEGMENT_SIZE, (starts[-1], end)
        tail = (directory / segment_name(starts[-1])).read_bytes()[end - starts[-1]:]
        assert tail.count(0) == len(tail), f"non-zero bytes after the end of the log at {end}"


def _roll(phy: int) -> int:
    return phy - phy % SEGMENT_SIZE + SEGMENT_SIZE


def check_consume_queues(store: MessageStore, queues: dict[Queue, list[tuple]]) -> None:
    """Each consume queue holds exactly the (offset, size) units of its messages in the log, in order."""
    assert store.wait_for_dispatch(timeout=30)
    for topic in store.topics():
        for queue_id in store.queue_ids(topic):
            if (topic, queue_id) not in queues:
                assert store.get_max_offset_in_queue(topic, queue_id) == 0, (topic, queue_id)
    for (topic, queue_id), records in queues.items():
        assert store.get_max_offset_in_queue(topic, queue_id) == len(records), (topic, queue_id)
        consume_queue = store.queues.get(topic, queue_id)
        assert consume_queue is not None
        units: list[tuple] = []
        while len(units) < len(records):
            batch, _ = consume_queue.units_from(len(units), len(records) - len(units))
            assert batch, f"consume queue {topic}-{queue_id} has no unit {len(units)}"
            units.extend((phy, size) for phy, size, _tags_code in batch)
        assert units == records, f"consume queue {topic}-{queue_id} disagrees with the log"
        newest = store.get_message(topic, queue_id, len(records) - 1, max_msgs=1).messages
        assert [m.commit_log_offset for m in newest] == [records[-1][0]], (topic, queue_id)


def check_index(store: MessageStore, messages: list[dict]) -> None:
    """Messages (``describe`` dicts or acknowledgements) can be found by each key, by UNIQ_KEY and by msgId."""
    for msg in messages:
        phy, topic = msg["commit_log_offset"], msg["topic"]
        for key in msg["keys"]:
            assert [m.commit_log_offset for m in store.query_message(topic, key)] == [phy], (key, msg)
        assert phy in [m.commit_log_offset for m in store.query_message_by_uniq_key(topic, msg["uniq_key"])], msg
        assert store.view_message_by_id(msg["msg_id"]).commit_log_offset == phy, msg


# --- the cycles --------------------------------------------------------------------------------

def run_writer(ledger: CrashLedger, seed: int, kill_after: float, log_dir: Path, *, wait_for_ack: bool = True,
               while_running: Callable[[], None] | None = None) -> None:
    """Run a writer on the ledger's store and SIGKILL it ``kill_after`` s after its first acknowledgement
    (or, without ``wait_for_ack``, after its start, so the kill may land in start-up and recovery)."""
    with WriterProcess(ledger.root, seed, ledger.mode, log_dir) as writer:
        if wait_for_ack:
            writer.wait_first_ack()
        if while_running is not None:
            while_running()
        time.sleep(kill_after)
        acks = writer.kill()
    ledger.record(seed, acks)
    ledger.stats["writers killed"] += 1
    ledger.stats["writers killed before acknowledging"] += not acks


def check_recovered(ledger: CrashLedger) -> None:
    """Reopen the store after a kill, check it and close it cleanly."""
    with MessageStore.open(ledger.root, store_config(ledger.mode)) as store:
        try:
            ledger.verify(store)
        except AssertionError as exc:
            exc.add_note(f"mode {ledger.mode}, writer seeds {ledger.new_seeds} (ROCKETSTORE_CRASH_SEED={BASE_SEED}), "
                         f"recovery: {store.recovery}")
            raise
    assert not (ledger.root / "abort").exists(), "a clean close removes the abort file"


def crash_cycle(ledger: CrashLedger, rng: random.Random, cycle: int, log_dir: Path) -> None:
    """One cycle: sometimes one or two writers killed soon after they start, with no check in
    between (so a writer recovers from its predecessor's crash and may be killed while it does),
    then a writer killed while it writes, then the check."""
    seed = BASE_SEED * 10_000_000 + cycle * 10
    for extra in range(rng.choice(EXTRA_RUNS)):
        run_writer(ledger, seed + extra + 1, rng.uniform(*EARLY_KILL_AFTER), log_dir, wait_for_ack=False)
    run_writer(ledger, seed, rng.uniform(*KILL_AFTER), log_dir)
    check_recovered(ledger)


def run_crash_loop(tmp_path: Path, mode: str, cycles: int, cycles_per_store: int | None = None) -> Counter:
    """``cycles`` kill cycles, on one store or on a fresh one every ``cycles_per_store``; returns the stats."""
    rng = random.Random(f"{BASE_SEED}-{mode}")
    per_store = cycles_per_store or cycles
    stats: Counter = Counter()
    started = time.monotonic()
    for first in range(0, cycles, per_store):
        ledger = CrashLedger(tmp_path / f"store-{first}", mode)
        for cycle in range(first, min(first + per_store, cycles)):
            crash_cycle(ledger, rng, cycle, tmp_path)
        largest = max(stats["largest log (MiB)"], ledger.stats["largest log (MiB)"])
        stats += ledger.stats
        stats["largest log (MiB)"] = largest
    stats["seconds"] = round(time.monotonic() - started)
    print(f"\ncrash loop {mode}: {dict(stats)}")
    return stats


@pytest.mark.parametrize("mode", MODES)
def test_acknowledged_messages_survive_sigkill(tmp_path, mode):
    assert run_crash_loop(tmp_path, mode, CI_CYCLES)["cycles"] == CI_CYCLES


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_acknowledged_messages_survive_many_sigkills(tmp_path, mode, request):
    if "slow" not in request.config.getoption("markexpr") and "ROCKETSTORE_CRASH_CYCLES" not in os.environ:
        pytest.skip("long form: run with -m slow or set ROCKETSTORE_CRASH_CYCLES")
    assert run_crash_loop(tmp_path, mode, SLOW_CYCLES, SLOW_CYCLES_PER_STORE)["cycles"] == SLOW_CYCLES


def test_live_writer_locks_out_a_second_writer(tmp_path):
    ledger = CrashLedger(tmp_path / "store", FlushDiskType.SYNC_FLUSH.value)
    config = store_config(ledger.mode)

    def open_while_running() -> None:
        with pytest.raises(StoreLockedError):
            MessageStore.open(ledger.root, config)
        with MessageStore.open(ledger.root, config, read_only=True) as reader:  # documented safe on a live store
            seen = [describe(msg) for msg in reader.iter_messages()]
        assert seen
        for stored in seen:
            check_generated(stored)

    run_writer(ledger, BASE_SEED, 0.2, tmp_path, while_running=open_while_running)
    check_recovered(ledger)

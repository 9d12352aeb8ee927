"""Crash safety: SIGKILL a writer process again and again and check what the store recovers.

Each cycle starts ``crash_writer.py`` on the same store, lets it write for a random moment
(single puts, batches, segment rolls, flushes and checkpoint writes all run continuously), kills
it with SIGKILL and reopens the store here, which runs abnormal recovery. The recovered store
must hold every acknowledged message of every cycle so far, unchanged and where its put said;
every record in the log must decode and be a message some writer really put, each put whole or
not at all; queue offsets must stay dense; and the space after the log must be zero.

``ROCKETSTORE_CRASH_SEED`` replays a run; ``ROCKETSTORE_CRASH_CYCLES`` sets the length of the
slow form (``-m slow``).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
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
)

from rocketstore import FlushDiskType, MessageExt, MessageStore, PutMessageStatus
from rocketstore.errors import StoreLockedError
from rocketstore.mapped.file import segment_name, parse_segment_name

WRITER = Path(__file__).with_name("crash_writer.py")
MODES = [FlushDiskType.SYNC_FLUSH.value, FlushDiskType.ASYNC_FLUSH.value]
BASE_SEED = int(os.environ.get("ROCKETSTORE_CRASH_SEED", "20240611"))
CI_CYCLES = 20
SLOW_CYCLES = int(os.environ.get("ROCKETSTORE_CRASH_CYCLES", "500"))
KILL_AFTER = (0.05, 0.6)  # seconds of writing between the first acknowledgement and the kill
FIRST_ACK_TIMEOUT = 60.0  # a cold interpreter on a loaded CI machine can be slow


# --- the writer process ------------------------------------------------------------------------

class WriterProcess:
    """``crash_writer.py`` running on a store; a thread drains its stdout so it never blocks on a full pipe.

    Used as a context manager, so the process is killed and reaped whatever happens in the test.
    """

    def __init__(self, root: Path, seed: int, mode: str, log_dir: Path) -> None:
        self.seed = seed
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


# --- what was acknowledged, and the checks -----------------------------------------------------

@dataclass
class CrashLedger:
    """The acknowledgements of every cycle on one store, and the checks a recovered store must pass."""

    root: Path
    mode: str
    acks: dict[int, dict] = field(default_factory=dict)  # by commit-log offset
    acked_per_thread: dict[tuple[int, int], int] = field(default_factory=dict)  # (seed, thread) -> count
    seeds: set[int] = field(default_factory=set)
    stats: Counter = field(default_factory=Counter)

    def record(self, seed: int, acks: list[dict]) -> None:
        """Take in one writer run's acknowledgements (each thread's come in put order)."""
        self.seeds.add(seed)
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

    def verify(self, store: MessageStore, new_acks: list[dict]) -> None:
        """Every check on a store reopened after a kill."""
        report = store.recovery
        assert report is not None and report.abnormal, "a SIGKILLed writer leaves the abort file behind"
        assert report.end_offset == store.max_phy_offset, report
        present = self._check_log(store)
        for writer_thread in self.acked_per_thread.keys() | present.keys():
            self._check_puts_whole(writer_thread, present.get(writer_thread, []))
        for ack in new_acks:
            _check_acknowledged(store.look_message_by_offset(ack["commit_log_offset"]), ack)
        self._check_zero_after_log(store)
        self.stats["cycles"] += 1
        self.stats["torn tails cut"] += report.cut_bytes > 0
        self.stats["segments moved aside"] += sum(p.endswith(".segment") for p in report.salvaged)

    def _check_log(self, store: MessageStore) -> dict[tuple[int, int], list[int]]:
        """Walk the whole log; returns the message numbers found per writer thread, in log order."""
        present: dict[tuple[int, int], list[int]] = defaultdict(list)
        next_queue_offset: dict[tuple[str, int], int] = {}
        found_acks = 0
        expected = store.min_phy_offset
        for msg in store.iter_messages():
            phy = msg.commit_log_offset
            assert phy == expected or (phy % SEGMENT_SIZE == 0 and 0 < phy - expected < SEGMENT_SIZE), \
                f"record at {phy} does not follow the previous one, which ended at {expected}"
            expected = phy + msg.store_size
            queue = (msg.topic, msg.queue_id)
            assert msg.queue_offset == next_queue_offset.get(queue, 0), f"queue offsets of {queue} not dense at {phy}"
            next_queue_offset[queue] = msg.queue_offset + 1
            seq = msg.properties.get(SEQ_PROPERTY)
            assert seq is not None, f"record at {phy} was put by no writer: {msg}"
            _check_matches_generator(msg, seq)
            seed, thread, n = parse_seq_id(seq)
            assert seed in self.seeds, f"record at {phy} comes from no writer run of this test: {seq}"
            present[(seed, thread)].append(n)
            ack = self.acks.get(phy)
            if ack is not None:
                _check_acknowledged(msg, ack)
                found_acks += 1
        assert store.max_phy_offset in (expected, _roll(expected)), \
            f"the log ends at {store.max_phy_offset} but its last record ends at {expected}"
        if found_acks != len(self.acks):
            missing = sorted(self.acks.keys() - {m.commit_log_offset for m in store.iter_messages()})
            raise AssertionError(f"{len(missing)} acknowledged messages are gone, first: {self.acks[missing[0]]}")
        for queue, count in next_queue_offset.items():
            assert store.next_queue_offset(*queue) == count, queue
        self.stats["records checked"] += sum(len(numbers) for numbers in present.values())
        return present

    def _check_puts_whole(self, writer_thread: tuple[int, int], present: list[int]) -> None:
        """A thread's messages are in the log in put order with no gap, and each put is there whole or not at all.

        Past its acknowledged messages a thread may have put at most one more call (a put can be
        written and not yet acknowledged when the kill lands), and a batch whose first messages
        were acknowledged must be there entirely.
        """
        seed, thread = writer_thread
        acked = self.acked_per_thread.get(writer_thread, 0)
        assert present == list(range(len(present))), f"writer {writer_thread}: messages missing or out of order"
        pending = next(put for put in thread_plan(seed, thread) if put.stop > acked)
        allowed = {pending.stop} if pending.start < acked else {acked, pending.stop}
        assert len(present) in allowed, \
            f"writer {writer_thread}: {len(present)} messages in the log, {acked} acknowledged, next put {pending}"
        self.stats["unacknowledged but kept"] += len(present) - acked
        self.stats["batches cut by the kill between acknowledgements"] += pending.start < acked

    def _check_zero_after_log(self, store: MessageStore) -> None:
        """Recovery leaves zeroes after the end (the next append relies on it) and no later segment."""
        end = store.max_phy_offset
        directory = self.root / "commitlog"
        starts = sorted(s for s in map(parse_segment_name, os.listdir(directory)) if s is not None)
        assert starts == list(range(starts[0], starts[-1] + 1, SEGMENT_SIZE)), starts
        assert starts[-1] <= end <= starts[-1] + SEGMENT_SIZE, (starts[-1], end)
        tail = (directory / segment_name(starts[-1])).read_bytes()[end - starts[-1]:]
        assert tail.count(0) == len(tail), f"non-zero bytes after the end of the log at {end}"


def _roll(phy: int) -> int:
    return phy - phy % SEGMENT_SIZE + SEGMENT_SIZE


def _check_matches_generator(msg: MessageExt, seq: str) -> None:
    spec = message_spec(seq)
    where = f"record at {msg.commit_log_offset} ({seq})"
    assert (msg.topic, msg.queue_id, msg.tags, tuple(msg.keys)) == (spec.topic, spec.queue_id, spec.tags, spec.keys), \
        where
    assert msg.body == spec.body, f"{where}: body differs from what its writer put"


def _check_acknowledged(msg: MessageExt, ack: dict) -> None:
    assert ack["status"] == PutMessageStatus.PUT_OK.value, ack
    stored = {"seq": msg.properties.get(SEQ_PROPERTY), "topic": msg.topic, "queue_id": msg.queue_id,
              "tags": msg.tags, "keys": msg.keys, "body_len": len(msg.body), "body_sha256": body_digest(msg.body),
              "status": ack["status"], "commit_log_offset": msg.commit_log_offset, "queue_offset": msg.queue_offset,
              "msg_id": msg.msg_id, "uniq_key": msg.uniq_key, "store_size": msg.store_size,
              "store_timestamp": msg.store_timestamp}
    assert stored == ack


# --- the cycles --------------------------------------------------------------------------------

def crash_cycle(ledger: CrashLedger, seed: int, kill_after: float, log_dir: Path, while_running=None) -> None:
    """Run a writer, SIGKILL it ``kill_after`` s after its first acknowledgement, reopen and check the store."""
    with WriterProcess(ledger.root, seed, ledger.mode, log_dir) as writer:
        writer.wait_first_ack()
        if while_running is not None:
            while_running()
        time.sleep(kill_after)
        acks = writer.kill()
    ledger.record(seed, acks)
    config = store_config(ledger.mode)
    with MessageStore.open(ledger.root, config) as store:
        try:
            ledger.verify(store, acks)
        except AssertionError as exc:
            exc.add_note(f"mode {ledger.mode}, writer seed {seed} (replay with ROCKETSTORE_CRASH_SEED={BASE_SEED}), "
                         f"recovery: {store.recovery}")
            raise
    assert not (ledger.root / "abort").exists(), "a clean close removes the abort file"


def run_crash_loop(tmp_path: Path, mode: str, cycles: int) -> CrashLedger:
    root = tmp_path / "store"
    ledger = CrashLedger(root, mode)
    rng = random.Random(f"{BASE_SEED}-{mode}")
    started = time.monotonic()
    for cycle in range(cycles):
        crash_cycle(ledger, BASE_SEED * 100_000 + cycle, rng.uniform(*KILL_AFTER), tmp_path)
    ledger.stats["seconds"] = round(time.monotonic() - started)
    print(f"\ncrash loop {mode}: {dict(ledger.stats)}")
    return ledger


@pytest.mark.parametrize("mode", MODES)
def test_acknowledged_messages_survive_sigkill(tmp_path, mode):
    ledger = run_crash_loop(tmp_path, mode, CI_CYCLES)
    assert ledger.stats["cycles"] == CI_CYCLES


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_acknowledged_messages_survive_many_sigkills(tmp_path, mode):
    ledger = run_crash_loop(tmp_path, mode, SLOW_CYCLES)
    assert ledger.stats["cycles"] == SLOW_CYCLES


def test_live_writer_locks_out_a_second_writer(tmp_path):
    ledger = CrashLedger(tmp_path / "store", FlushDiskType.SYNC_FLUSH.value)
    config = store_config(ledger.mode)

    def second_opens() -> None:
        with pytest.raises(StoreLockedError):
            MessageStore.open(ledger.root, config)
        with MessageStore.open(ledger.root, config, read_only=True) as reader:  # safe on a live store
            seen = list(reader.iter_messages())
            assert seen
            for msg in seen:
                _check_matches_generator(msg, msg.properties[SEQ_PROPERTY])

    crash_cycle(ledger, BASE_SEED, 0.2, tmp_path, while_running=second_opens)

"""The put lock (locks.py): mutual exclusion, other threads waiting by yielding the GIL and giving that up on a
long hold or one marked ``io``, the main thread holding the plain lock so that no interrupt leaves it held,
and producers sharing queues through it."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from rocketstore import Message, MessageStore, StoreConfig
from rocketstore.locks import YieldingLock
from test_store import concurrently


def test_mutual_exclusion_with_the_gil_switching_inside_the_hold():
    guard = YieldingLock()
    shared = {"value": 0, "inside": 0}
    overlaps = []

    def work(_n: int) -> None:
        for _ in range(300):
            with guard.held():
                shared["inside"] += 1
                if shared["inside"] != 1:
                    overlaps.append(shared["inside"])
                value = shared["value"]
                time.sleep(0)  # hand the GIL to the other threads while holding the lock
                shared["value"] = value + 1
                shared["inside"] -= 1

    errors = concurrently(work, 6)
    work(0)  # and the main thread, through the plain lock, against nobody
    assert not errors and overlaps == [] and shared["value"] == 2100


def test_the_main_thread_holds_the_plain_lock_and_others_the_yielding_one():
    guard = YieldingLock()
    assert guard.held() is guard.lock and type(guard.lock) is type(threading.Lock())
    seen = []
    thread = threading.Thread(target=lambda: seen.append(guard.held()))
    thread.start()
    thread.join()
    assert seen == [guard]
    with guard.held():
        assert guard.locked()
    assert not guard.locked()


class RecordedYields:
    """Stands in for ``locks.time``: records when a waiter yielded (``sleep(0)``) and whether ``io`` was set."""

    def __init__(self, guard: YieldingLock) -> None:
        self.guard = guard
        self.yields: list[tuple[float, bool]] = []
        self.monotonic = time.monotonic

    def sleep(self, seconds: float) -> None:
        if seconds == 0:
            self.yields.append((time.monotonic(), self.guard.io))
        time.sleep(seconds)


def hold_and_wait(guard: YieldingLock, hold, seconds: float) -> None:
    """One thread holds the lock (running ``hold()`` first, then sleeping ``seconds``), another (not the main
    thread) waits for it as the commit log does."""
    holding = threading.Event()

    def holder() -> None:
        with guard.held():
            holding.set()
            hold()
            time.sleep(seconds)

    def waiter() -> None:
        holding.wait()
        with guard.held():
            pass

    threads = [threading.Thread(target=holder), threading.Thread(target=waiter)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_a_short_hold_is_waited_for_by_yielding(monkeypatch):
    from rocketstore import locks

    guard = YieldingLock()
    recorded = RecordedYields(guard)
    monkeypatch.setattr(locks, "time", recorded)
    monkeypatch.setattr(locks, "SPIN_SECONDS", 60.0)
    hold_and_wait(guard, lambda: None, 0.05)
    assert recorded.yields and not guard.locked()


def test_a_long_hold_makes_waiters_block_not_spin(monkeypatch):
    """A segment roll holds the put lock for milliseconds: a waiter yields for ``SPIN_SECONDS`` only, then
    sleeps in the kernel."""
    from rocketstore import locks

    guard = YieldingLock()
    recorded = RecordedYields(guard)
    monkeypatch.setattr(locks, "time", recorded)
    hold_and_wait(guard, lambda: None, 0.4)
    times = [when for when, _io in recorded.yields]
    assert times and times[-1] - times[0] < 0.1, "the waiter yielded through the whole hold"


@pytest.mark.parametrize("set_while_waiting", [False, True])
def test_a_hold_marked_io_makes_waiters_sleep_at_once(monkeypatch, set_while_waiting):
    """A holder in a pwrite or a segment roll gives the GIL away itself: yielding would only take it from the
    thread the kernel hands the lock to next. Waiters sleep as soon as they see ``io`` (even with an endless
    yield budget), whether it was set before they came or while they yielded."""
    from rocketstore import locks

    guard = YieldingLock()
    recorded = RecordedYields(guard)
    monkeypatch.setattr(locks, "time", recorded)
    monkeypatch.setattr(locks, "SPIN_SECONDS", 60.0)

    def hold() -> None:
        if set_while_waiting:
            time.sleep(0.05)
        guard.io = True

    hold_and_wait(guard, hold, 0.35)
    after_io = sum(io for _when, io in recorded.yields)
    assert after_io <= 1, f"the waiter yielded {after_io} times while the holder was in a system call"
    assert set_while_waiting == bool(recorded.yields), "it yields while the hold is not marked"


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs interval timers")
# a timer signal every 20 us also lands in finalizers, whose exceptions Python can only report as unraisable
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_an_interrupt_never_leaves_the_lock_held():
    """A signal handler that raises (Ctrl-C) runs in the main thread, anywhere in ``with guard.held():``; there
    the lock is taken and released in C, so no interrupt leaves it held (taking it in Python code leaked it
    within a few interrupts, and every later put and ``close`` hung)."""

    class Interrupted(Exception):
        pass

    armed = [False]

    def handler(*_args) -> None:
        if armed[0]:
            armed[0] = False
            raise Interrupted

    guard = YieldingLock()
    previous = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, 1e-4, 2e-5)
    interrupts = 0
    try:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline and interrupts < 20_000:
            try:
                armed[0] = True
                while True:
                    with guard.held():
                        pass
            except Interrupted:
                interrupts += 1
                assert not guard.locked(), f"an interrupt left the lock held (after {interrupts})"
    finally:
        armed[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert interrupts > 100


def test_producer_threads_share_queues_through_the_put_lock(tmp_path):
    """Eight threads putting single messages and batches into the same four queues: every queue offset is
    taken exactly once, in log order, and each reads back as the message that took it."""
    config = StoreConfig(mapped_file_size_commit_log=48 << 10, max_hash_slot_num=97, max_index_num=5000)
    with MessageStore.open(tmp_path, config) as store:
        def producer(n: int) -> None:
            for i in range(60):
                if i % 3:
                    store.put_message(Message("Shared", f"{n}/{i}".encode(), queue_id=i % 4))
                else:
                    store.put_messages([Message("Shared", f"{n}/{i}/{j}".encode(), queue_id=(i + j) % 4)
                                        for j in range(5)])

        assert not concurrently(producer, 8)
        assert store.wait_for_dispatch(30)
        bodies, phys = [], []
        for q in range(4):
            count = store.get_max_offset_in_queue("Shared", q)
            got = store.get_message("Shared", q, 0, max_msgs=count).messages
            assert [m.queue_offset for m in got] == list(range(count))
            phys.extend(m.commit_log_offset for m in got)
            bodies.extend(m.body for m in got)
            assert [m.commit_log_offset for m in got] == sorted(m.commit_log_offset for m in got)
        expected = {f"{n}/{i}".encode() for n in range(8) for i in range(60) if i % 3}
        expected |= {f"{n}/{i}/{j}".encode() for n in range(8) for i in range(0, 60, 3) for j in range(5)}
        assert sorted(bodies) == sorted(expected) and len(set(phys)) == len(phys)
        assert store.commit_log.mapped_files.files[-1].file_from_offset > 0, "the puts crossed segment rolls"

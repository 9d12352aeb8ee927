"""The put path's lock: mutual exclusion, Lock's interface, blocking (not spinning) on a long hold, and
producers sharing queues through it."""

from __future__ import annotations

import threading
import time

import pytest

from rocketstore import Message, MessageStore, StoreConfig
from rocketstore.locks import YieldingLock
from test_store import concurrently


def test_mutual_exclusion_with_the_gil_switching_inside_the_hold():
    lock = YieldingLock()
    shared = {"value": 0, "inside": 0}
    overlaps = []

    def work(_n: int) -> None:
        for _ in range(300):
            with lock:
                shared["inside"] += 1
                if shared["inside"] != 1:
                    overlaps.append(shared["inside"])
                value = shared["value"]
                time.sleep(0)  # hand the GIL to the other threads while holding the lock
                shared["value"] = value + 1
                shared["inside"] -= 1

    assert not concurrently(work, 6)
    assert overlaps == [] and shared["value"] == 1800


def test_lock_interface():
    lock = YieldingLock()
    assert not lock.locked() and lock.acquire() is True and lock.locked()
    assert lock.acquire(blocking=False) is False
    started = time.monotonic()
    assert lock.acquire(timeout=0.05) is False
    assert time.monotonic() - started >= 0.05
    assert lock.acquire(timeout=0) is False
    lock.release()
    assert lock.acquire(timeout=0.05) is True
    lock.release()
    with pytest.raises(RuntimeError):
        lock.release()  # as threading.Lock: releasing an unlocked lock is a bug, not a no-op
    assert "unlocked" in repr(lock)


class RecordedYields:
    """Stands in for ``locks.time``: records when a waiter yielded (``sleep(0)``) and whether ``io`` was set."""

    def __init__(self, lock: YieldingLock) -> None:
        self.lock = lock
        self.yields: list[tuple[float, bool]] = []
        self.monotonic = time.monotonic

    def sleep(self, seconds: float) -> None:
        if seconds == 0:
            self.yields.append((time.monotonic(), self.lock.io))
        time.sleep(seconds)


def hold_and_wait(lock: YieldingLock, hold, seconds: float) -> None:
    """One thread holds ``lock`` (running ``hold()`` first, then sleeping ``seconds``), another waits for it."""
    holding = threading.Event()

    def holder() -> None:
        with lock:
            holding.set()
            hold()
            time.sleep(seconds)

    def waiter() -> None:
        holding.wait()
        with lock:
            pass

    threads = [threading.Thread(target=holder), threading.Thread(target=waiter)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_a_long_hold_makes_waiters_block_not_spin(monkeypatch):
    """A segment roll holds the put lock for milliseconds: a waiter yields for ``SPIN_SECONDS`` only, then
    sleeps in the kernel."""
    from rocketstore import locks

    lock = YieldingLock()
    recorded = RecordedYields(lock)
    monkeypatch.setattr(locks, "time", recorded)
    hold_and_wait(lock, lambda: None, 0.4)
    times = [when for when, _io in recorded.yields]
    assert times and times[-1] - times[0] < 0.1, "the waiter yielded through the whole hold"


@pytest.mark.parametrize("set_while_waiting", [False, True])
def test_a_hold_marked_io_makes_waiters_sleep_at_once(monkeypatch, set_while_waiting):
    """A holder in a pwrite or a segment roll gives the GIL away itself: yielding would only take it from the
    thread the kernel hands the lock to next. Waiters sleep as soon as they see ``io`` (even with an endless
    yield budget), whether it was set before they came or while they yielded."""
    from rocketstore import locks

    lock = YieldingLock()
    recorded = RecordedYields(lock)
    monkeypatch.setattr(locks, "time", recorded)
    monkeypatch.setattr(locks, "SPIN_SECONDS", 60.0)

    def hold() -> None:
        if set_while_waiting:
            time.sleep(0.05)
        lock.io = True

    hold_and_wait(lock, hold, 0.35)
    after_io = sum(io for _when, io in recorded.yields)
    assert after_io <= 1, f"the waiter yielded {after_io} times while the holder was in a system call"
    assert set_while_waiting == bool(recorded.yields), "it yields while the hold is not marked"


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

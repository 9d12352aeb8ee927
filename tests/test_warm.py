"""Faulting commit-log pages in ahead of the appends (mapped/warm.py): it happens, it changes no byte, it stops
cleanly when the kernel or the file cannot, and it never outlives the mapping it works on."""

from __future__ import annotations

import errno
import logging
import mmap
import struct
import sys
import time

import pytest

from rocketstore import Message, MessageStore, StoreConfig
from rocketstore.mapped import file as mapped_file
from rocketstore.mapped.file import PAGE_SIZE, mapping_address, populate_write
from rocketstore.mapped.warm import WriteAheadWarmer

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")


def mapped_pages(mm: mmap.mmap, start: int, length: int) -> int:
    """How many pages of ``mm[start:start + length]`` this process has mapped (/proc/self/pagemap's present bit:
    a page in the page cache but not yet touched through the mapping, as readahead leaves them, is not)."""
    start -= start % PAGE_SIZE
    with open("/proc/self/pagemap", "rb") as f:
        f.seek((mapping_address(mm) + start) // PAGE_SIZE * 8)
        entries = f.read((length + PAGE_SIZE - 1) // PAGE_SIZE * 8)
    return sum(entry >> 63 for (entry,) in struct.iter_unpack("<Q", entries))


def config(**changes) -> StoreConfig:
    return StoreConfig(**{"mapped_file_size_commit_log": 8 << 20, "max_hash_slot_num": 97, "max_index_num": 5000,
                          "warm_ahead_commit_log": 1 << 20, **changes})


def wait_until(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@linux_only
def test_populate_write_faults_pages_in_and_changes_no_byte(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"\xab" * PAGE_SIZE + bytes(15 * PAGE_SIZE))
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 16 * PAGE_SIZE) as mm:
        if not populate_write(mm, 0, 16 * PAGE_SIZE):
            pytest.skip("this kernel has no MADV_POPULATE_WRITE")
        assert mapped_pages(mm, 0, 16 * PAGE_SIZE) == 16
        assert mm[:PAGE_SIZE] == b"\xab" * PAGE_SIZE and mm[PAGE_SIZE:] == bytes(15 * PAGE_SIZE)


@pytest.fixture(scope="module")
def kernel_warms(tmp_path_factory) -> None:
    """Skip where this kernel has no MADV_POPULATE_WRITE (a fresh mapping says so); elsewhere a warmer that stops
    is a failure."""
    path = tmp_path_factory.mktemp("probe") / "f"
    path.write_bytes(bytes(PAGE_SIZE))
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), PAGE_SIZE) as mm:
        if not populate_write(mm, 0, PAGE_SIZE):
            pytest.skip("this kernel has no MADV_POPULATE_WRITE")


@linux_only
@pytest.mark.usefixtures("kernel_warms")
def test_the_pages_ahead_of_the_write_position_are_faulted_in_and_stay_zero(tmp_path):
    with MessageStore.open(tmp_path, config()) as store:
        log = store.commit_log
        assert log.warmer is not None
        time.sleep(0.7)
        assert log.warmer.warmed_bytes == 0, "an open that writes nothing faults nothing in"
        results = store.put_messages([Message("Warm", b"x" * 500, keys=[f"k{i}"]) for i in range(200)])
        end = log.max_offset
        assert wait_until(lambda: log.warmer.warmed_until >= end + (1 << 19) or log.warmer.stopped_by), \
            "the warmer did not catch up"
        assert log.warmer.stopped_by is None
        assert log.warmer.warmed_until <= log.mapped_files.last.file_end_offset
        segment = log.mapped_files.last
        ahead = segment.wrote_position + PAGE_SIZE
        ahead -= ahead % PAGE_SIZE
        assert mapped_pages(segment.buffer, ahead, 1 << 19) == (1 << 19) // PAGE_SIZE
        assert segment.buffer[segment.wrote_position : segment.wrote_position + (1 << 20)] == bytes(1 << 20)
        assert store.wait_for_dispatch()
        assert [m.body for m in store.query_message("Warm", "k7")] == [b"x" * 500] and results[7].ok


@linux_only
@pytest.mark.parametrize("changes", [{"warm_ahead_commit_log": 0}, {"preallocate": False}])
def test_without_warming_the_pages_ahead_stay_untouched(tmp_path, changes):
    with MessageStore.open(tmp_path, config(**changes)) as store:
        assert store.commit_log.warmer is None, "sparse segments are never warmed: a fault may meet a full disk"
        store.put_messages([Message("Cold", b"x" * 500) for _ in range(20)])
        segment = store.commit_log.mapped_files.last
        assert mapped_pages(segment.buffer, 4 << 20, 1 << 20) == 0, "nothing else faults those pages in"


@pytest.mark.parametrize("failure", ["unsupported", "efault"])
def test_a_kernel_or_file_that_cannot_warm_stops_the_warmer_not_the_store(tmp_path, monkeypatch, caplog, failure):
    def cannot(mm, start, length):
        if failure == "unsupported":
            return False
        raise OSError(errno.EFAULT, "Bad address")

    monkeypatch.setattr(mapped_file, "populate_write", cannot)
    caplog.set_level(logging.INFO, logger="rocketstore.mapped.warm")
    with MessageStore.open(tmp_path, config()) as store:
        store.put_messages([Message("T", b"x" * 100) for _ in range(10)])
        assert wait_until(lambda: store.commit_log.warmer.stopped_by is not None)
        assert ("MADV_POPULATE_WRITE" if failure == "unsupported" else "Bad address") in \
            store.commit_log.warmer.stopped_by
        thread = store.commit_log.warmer._thread
        assert wait_until(lambda: not thread.is_alive()), "the thread ends when warming stops"
        assert all(r.ok for r in store.put_messages([Message("T", b"y" * 100) for _ in range(10)]))
        assert store.wait_for_dispatch()
        assert store.get_message("T", 0, 0, max_msgs=32).messages[-1].body == b"y" * 100
    assert "no longer faulted in ahead" in caplog.text


@linux_only
@pytest.mark.usefixtures("kernel_warms")
@pytest.mark.parametrize("warming", [True, False])
def test_large_appends_copy_into_warmed_pages_and_pwrite_otherwise(tmp_path, monkeypatch, warming):
    """With pages faulted in ahead, a 64 KiB put is a copy into the mapping (no system call handing the GIL to
    the other producers and waiting for it back); without a warmer, or once it stops, it is a pwrite again."""
    pwrites: list[int] = []
    pwrite = mapped_file.os.pwrite

    def counted(fd, data, pos):
        if len(data) > mapped_file.COPY_LIMIT:  # an append's (small ones are other files' bookkeeping)
            pwrites.append(len(data))
        return pwrite(fd, data, pos)

    monkeypatch.setattr(mapped_file.os, "pwrite", counted)
    body = bytes(range(256)) * 256  # 64 KiB
    with MessageStore.open(tmp_path, config(warm_ahead_commit_log=(2 << 20) if warming else 0)) as store:
        files = store.commit_log.mapped_files
        assert files.copy_limit == (mapped_file.WARMED_COPY_LIMIT if warming else mapped_file.COPY_LIMIT)
        results = [store.put_message(Message("Big", body, keys=[f"k{i}"])) for i in range(3)]
        assert (not pwrites) == warming, pwrites
        assert all(f.copy_limit == files.copy_limit for f in files.files)
        if warming:  # the warmer stops for good: the next large put is a pwrite
            store.commit_log.warmer._give_up("a test")
            store.put_message(Message("Big", body))
            assert pwrites and pwrites[0] > len(body)
        assert store.wait_for_dispatch()
        assert [m.body for m in store.query_message("Big", "k2")] == [body] and results[2].ok
        warmer = store.commit_log.warmer
    assert warmer is None or files.copy_limit == mapped_file.COPY_LIMIT


def test_the_copy_limit_stays_within_half_the_warmed_lead(tmp_path):
    """A copy longer than half the lead could reach pages not faulted in yet, and take their faults holding the
    GIL: a small ``warm_ahead_commit_log`` keeps the limit at half of it (never below the ordinary 16 KiB)."""
    cases = ((1 << 20, 1 << 19), (8 << 20, mapped_file.WARMED_COPY_LIMIT), (16 << 10, mapped_file.COPY_LIMIT))
    for ahead, limit in cases:
        with MessageStore.open(tmp_path / str(ahead), config(warm_ahead_commit_log=ahead)) as store:
            store.put_message(Message("T", b"x"))
            assert store.commit_log.mapped_files.copy_limit == limit
            assert store.commit_log.mapped_files.last.copy_limit == limit


def test_close_stops_the_warmer_before_unmapping(tmp_path):
    """Closing while the thread is inside a large warm: it is joined first, so no close meets an exported
    buffer (BufferError) or a warm meets an unmapped segment."""
    for n in range(15):
        cfg = config(warm_ahead_commit_log=8 << 20)
        with MessageStore.open(tmp_path / str(n % 3), cfg) as store:
            store.put_messages([Message("T", b"z" * 300) for _ in range(50)])
            warmer = store.commit_log.warmer
        assert warmer._thread is None and warmer._stop.is_set()
        with MessageStore.open(tmp_path / str(n % 3), cfg, read_only=True) as store:
            assert store.commit_log.warmer is None
            assert store.get_max_offset_in_queue("T", 0) + store.get_max_offset_in_queue("T", 1) > 0


@linux_only
@pytest.mark.usefixtures("kernel_warms")
def test_a_segment_rolled_and_deleted_under_the_warmer_does_not_stop_it(tmp_path, monkeypatch):
    """Between two of the warmer's steps producers fill its segment and retention (under disk pressure) deletes
    it: the round ends, and the next one warms the new newest segment; warming never stops for good."""
    cfg = config(warm_ahead_commit_log=8 << 20, file_reserved_time=0)
    with MessageStore.open(tmp_path, cfg) as store:
        store.commit_log.warmer.stop()  # drive a warmer by hand instead of the store's thread
        store.put_messages([Message("T", b"x" * 1000) for _ in range(10)])
        warmer = WriteAheadWarmer(store.commit_log.mapped_files, cfg.warm_ahead_commit_log)
        real, calls = mapped_file.populate_write, []

        def populate(mm, start, length):
            calls.append(start)
            warmed = real(mm, start, length)
            if len(calls) == 1:  # meanwhile: a roll, and retention deletes the segment being warmed
                while len(store.commit_log.mapped_files.files) < 2:
                    store.put_messages([Message("T", b"y" * 60000) for _ in range(16)])
                assert store.wait_for_dispatch()  # retention keeps what dispatch has not read
                assert store.delete_expired_files(immediately=True).commit_log_files == ["00000000000000000000"]
            return warmed

        monkeypatch.setattr(mapped_file, "populate_write", populate)
        warmer.warm_once()
        assert warmer.stopped_by is None and len(calls) == 1, "the deleted segment was not warmed further"
        newest = store.commit_log.mapped_files.last
        warmer.warm_once()
        assert warmer.stopped_by is None and warmer.warmed_until > newest.file_from_offset + newest.wrote_position


@pytest.mark.parametrize("bad", [-1, (1 << 30) + 1, "8M"])
def test_a_bad_warm_ahead_setting_is_a_typed_error(bad):
    from rocketstore.errors import ConfigError

    with pytest.raises(ConfigError, match="warm_ahead_commit_log"):
        StoreConfig(warm_ahead_commit_log=bad)

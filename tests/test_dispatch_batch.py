"""The batch dispatcher writes the same consume-queue and index bytes as dispatching one record at a time.

Each example stores a generated mix of messages (several topics and queues, tags and keys in and out of
the BMP, empty keys, UNIQ_KEYs, every transaction type, delayed messages, records whose properties are
not valid UTF-8), then re-dispatches the same commit log twice from nothing: once through the batch
path in small batches, once through a reference that calls ``Dispatcher.dispatch`` per record (the
path the batch one replaced), and compares every file.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rocketstore import Message, MessageStore, StoreConfig
from rocketstore import consumequeue as consumequeue_module
from rocketstore import dispatch as dispatch_module
from rocketstore.codec.batch import DispatchBatch, decode_dispatch
from rocketstore.codec.record import read_layout
from rocketstore.dispatch import Dispatcher, dispatch_request
from rocketstore.message import SysFlag
from rocketstore.verify import verify_store

CONFIG = StoreConfig(mapped_file_size_commit_log=32 * 1024, mapped_file_size_consume_queue=20 * 8,
                     max_hash_slot_num=7, max_index_num=23, enable_schedule_message=False)
TEXT = st.sampled_from(["a", "order-1", "订单", "😀x", "Aa", "BB"])
KEYS = st.lists(TEXT, max_size=3) | st.lists(TEXT | st.just(""), max_size=4).map(" ".join)  # a KEYS string: empties
TRANSACTIONS = st.sampled_from([SysFlag.TRANSACTION_NOT_TYPE, SysFlag.TRANSACTION_PREPARED_TYPE,
                                SysFlag.TRANSACTION_COMMIT_TYPE, SysFlag.TRANSACTION_ROLLBACK_TYPE])


@st.composite
def messages(draw) -> Message:
    props = {}
    if draw(st.integers(0, 6)) == 0:
        props["DELAY"] = str(draw(st.integers(1, 4)))
    return Message(draw(st.sampled_from(["T", "Topic-B", "c" * 127])), draw(st.binary(max_size=40)),
                   tags=draw(st.none() | TEXT | st.just("")), keys=draw(KEYS), properties=props or None,
                   queue_id=draw(st.integers(0, 2)), sys_flag=draw(TRANSACTIONS))


def per_record_apply(self: Dispatcher, batch: DispatchBatch, mapped) -> None:
    """The reference: every record through ``dispatch``, as the dispatcher worked before batches."""
    for pos in batch.pos.tolist():
        layout = read_layout(mapped.buffer, pos, mapped.wrote_position)
        self.dispatch(dispatch_request(mapped.buffer, pos, layout, self.config))


def redispatch(source: Path, target: Path, monkeypatch, *, reference: bool, rows: int,
               small_run: int = consumequeue_module.SMALL_RUN) -> dict[str, list[bytes]]:
    target.mkdir()
    shutil.copytree(source / "commitlog", target / "commitlog")
    with monkeypatch.context() as patch:
        patch.setattr(dispatch_module, "DISPATCH_ROWS", rows)
        patch.setattr(consumequeue_module, "SMALL_RUN", small_run)  # whole-array runs or unit by unit
        if reference:
            patch.setattr(Dispatcher, "_apply", per_record_apply)
        MessageStore.open(target, CONFIG).close()  # no queues, no index: the open dispatches the whole log
    files: dict[str, list[bytes]] = {}
    for path in sorted(target.rglob("*")):
        part = path.relative_to(target).parts[0]
        if path.is_file() and part in ("consumequeue", "index"):
            # index files are named by the clock when they are made: compare them in order, by content
            name = "index" if part == "index" else str(path.relative_to(target))
            files.setdefault(name, []).append(path.read_bytes())
    return files


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(messages(), min_size=1, max_size=60), rows=st.integers(1, 9), small_run=st.sampled_from([0, 4]))
def test_batch_dispatch_writes_what_per_record_dispatch_writes(tmp_path_factory, monkeypatch, batch, rows,
                                                                small_run):
    root = tmp_path_factory.mktemp("dispatch")
    with MessageStore.open(root / "src", CONFIG) as store:
        for msg in batch:
            store.put_message(msg)
    got = redispatch(root / "src", root / "batch", monkeypatch, reference=False, rows=rows, small_run=small_run)
    want = redispatch(root / "src", root / "reference", monkeypatch, reference=True, rows=rows)
    assert sorted(got) == sorted(want)
    assert got == want
    report = verify_store(root / "reference", CONFIG)  # verify's batch decode agrees with per-record dispatch
    assert report.clean and report.records == len(batch), report.problems[:3]


def test_records_with_text_that_is_not_utf8_dispatch_one_at_a_time_in_their_place(tmp_path, monkeypatch):
    """Bytes no producer of ours writes but a foreign one might: they take the record codec's 'replace' path."""
    root = tmp_path / "src"
    with MessageStore.open(root, CONFIG) as store:
        for i in range(12):
            store.put_message(Message("T", b"x", tags="TagA", keys=[f"k{i}"], queue_id=i % 2))
    segment = root / "commitlog" / "00000000000000000000"
    data = bytearray(segment.read_bytes())
    damaged = data.find(b"k5")
    data[damaged] = 0xFF  # the KEYS value of record 5 is no longer valid UTF-8 (no CRC covers properties)
    segment.write_bytes(bytes(data))
    got = redispatch(root, tmp_path / "batch", monkeypatch, reference=False, rows=4)
    want = redispatch(root, tmp_path / "reference", monkeypatch, reference=True, rows=4)
    assert got == want
    report = verify_store(tmp_path / "reference", CONFIG)  # verify takes the slow row the same way
    assert report.clean and report.records == 12, report.problems[:3]
    batch, _stop = decode_dispatch(data, 0, len(data), base=0, limit=int(store.commit_log.max_offset))
    assert batch.slow.tolist() == [i == 5 for i in range(12)] and batch.slow_count == 1


@pytest.mark.parametrize("rows", [1, 3, 8192])
def test_a_store_dispatched_in_batches_serves_its_messages(tmp_path, monkeypatch, rows):
    monkeypatch.setattr(dispatch_module, "DISPATCH_ROWS", rows)
    with MessageStore.open(tmp_path, CONFIG) as store:
        results = [store.put_message(Message(f"T{i % 3}", f"b{i}".encode(), tags=f"t{i % 2}", keys=[f"k{i}"],
                                             queue_id=i % 2)) for i in range(200)]
        assert store.wait_for_dispatch()
        for i, put in enumerate(results):
            got = store.get_message(f"T{i % 3}", i % 2, put.queue_offset, 1, tags=f"t{i % 2}").messages
            assert [m.commit_log_offset for m in got] == [put.commit_log_offset]
            assert [m.body for m in store.query_message(f"T{i % 3}", f"k{i}")] == [f"b{i}".encode()]


def plan_reference(batch: dict, lo: int, hi: int, index_from: int):
    """``plan_dispatch`` in plain Python: queued rows grouped by (topic, queue) in order of first appearance,
    log order inside a group; index entries of rows that are not ROLLBACK, at or after ``index_from``."""
    groups: dict[tuple[int, int], list[int]] = {}
    for r in range(lo, hi):
        if batch["sys_flag"][r] & SysFlag.TRANSACTION_MASK in (SysFlag.TRANSACTION_NOT_TYPE,
                                                                SysFlag.TRANSACTION_COMMIT_TYPE):
            groups.setdefault((batch["topic_code"][r], batch["queue_id"][r]), []).append(r)
    units = [[batch[f][r] for rows in groups.values() for r in rows]
             for f in ("queue_offset", "phy", "size", "tags_code")]
    taken = [j for j, r in enumerate(batch["entry_owner"]) if lo <= r < hi and batch["phy"][r] >= index_from
             and batch["sys_flag"][r] & SysFlag.TRANSACTION_MASK != SysFlag.TRANSACTION_ROLLBACK_TYPE]
    entries = [[batch["entry_hash"][j] for j in taken], [batch["phy"][batch["entry_owner"][j]] for j in taken],
               [batch["store_ts"][batch["entry_owner"][j]] for j in taken]]
    follow = not taken or batch["entry_owner"][taken[-1]] < hi - 1
    last = max((r for rows in groups.values() for r in rows), default=-1)
    starts = [0]
    for rows in groups.values():
        starts.append(starts[-1] + len(rows))
    return units, [t for t, _ in groups], [q for _, q in groups], starts, last, entries, follow


@settings(max_examples=200, deadline=None)
@given(data=st.data(), n=st.integers(0, 40))
def test_the_dispatch_plan_kernel_groups_and_filters_as_the_reference_does(data, n):
    import numpy as np

    from rocketstore.codec._kernels import plan_dispatch

    ints = st.integers(-(1 << 40), 1 << 40)
    column = lambda elements: np.array(data.draw(st.lists(elements, min_size=n, max_size=n)), dtype=np.int64)  # noqa: E731
    batch = {"topic_code": column(st.integers(0, 3)), "queue_id": column(st.integers(-1, 2) | st.just(0x7FFFFFFF)),
             "sys_flag": column(st.sampled_from([0, 0x4, 0x8, 0xC, 0x1 | 0x8, 0x2])),
             "queue_offset": column(ints), "phy": np.sort(column(st.integers(0, 1 << 40))), "size": column(ints),
             "tags_code": column(ints), "store_ts": column(ints)}
    owners = sorted(data.draw(st.lists(st.integers(0, n - 1), max_size=3 * n))) if n else []
    batch["entry_owner"] = np.array(owners, dtype=np.int64)
    batch["entry_hash"] = np.array(data.draw(st.lists(ints, min_size=len(owners), max_size=len(owners))),
                                   dtype=np.int64)
    lo = data.draw(st.integers(0, n))
    hi = data.draw(st.integers(lo, n))
    index_from = data.draw(st.sampled_from([0, int(batch["phy"][n // 2]) if n else 0, 1 << 41]))
    names = ("topic_code", "queue_id", "sys_flag", "queue_offset", "phy", "size", "tags_code", "store_ts",
             "entry_owner", "entry_hash")
    units, topic_codes, queue_ids, starts, last, entries, follow = plan_dispatch(
        *(batch[name] for name in names), lo, hi, index_from)
    want = plan_reference(batch, lo, hi, index_from)
    assert units.tolist() == want[0]
    assert (topic_codes.tolist(), queue_ids.tolist(), starts.tolist(), last) == want[1:5]
    assert entries.tolist() == want[5] and follow == want[6]

"""put_hashes (vectorised) writes exactly what the same put_key calls write, byte for byte."""

from __future__ import annotations

import contextlib
import itertools
from concurrent.futures import ThreadPoolExecutor
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rocketstore.index import IndexFile, bulk
from rocketstore.index.bulk import index_key_hashes, put_hashes

KEYS = ["T#a", "T#b", "T#Aa", "T#BB", "polygenelubricants", "T#订单", "T#😀", "U#a", "T#c", "T#d"]
_POOL = ThreadPoolExecutor(3, thread_name_prefix="test-index-bulk")


@contextlib.contextmanager
def sharing_among(workers: int):
    """Bulk puts and hashes of any size split among ``workers`` threads (one: the single kernel call), whatever
    the cores, so small generated inputs take the path big ones take."""
    with mock.patch.object(bulk, "_PARALLEL_MIN", 1), \
            mock.patch.object(bulk, "_workers", lambda: (_POOL, workers) if workers > 1 else (None, 1)):
        yield


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(puts=st.lists(st.tuples(st.sampled_from(KEYS), st.integers(0, 3000)), min_size=1, max_size=80),
       cuts=st.lists(st.integers(1, 80), max_size=6), slots=st.integers(1, 17), entries=st.integers(2, 60),
       inherit=st.booleans(), workers=st.sampled_from([1, 2, 3]))
def test_bulk_equals_sequential(tmp_path_factory, puts, cuts, slots, entries, inherit, workers):
    """Also with the entries shared among threads by slot range (the bytes of one call)."""
    folder = tmp_path_factory.mktemp("bulk")
    end_phy, end_ts = (5000, 1_699_999_990_500) if inherit else (0, 0)
    one = IndexFile.create(folder / "one", slots, entries, end_phy, end_ts)
    many = IndexFile.create(folder / "many", slots, entries, end_phy, end_ts)
    keys, phys, stamps, ts = [], [], [], 1_700_000_000_000
    for i, (key, step) in enumerate(puts):
        ts += step
        keys.append(key)
        phys.append(10_000 + i * 100)
        stamps.append(ts)
    accepted = 0
    for key, phy, stamp in zip(keys, phys, stamps, strict=True):
        if not one.put_key(key, phy, stamp):
            break
        accepted += 1
    hashes, phy_arr, ts_arr = index_key_hashes(keys), np.array(phys), np.array(stamps)
    done, bounds = 0, [*sorted({c for c in cuts if c < len(keys)}), len(keys)]
    with sharing_among(workers):
        for bound in bounds:
            done += put_hashes(many, hashes[done:bound], phy_arr[done:bound], ts_arr[done:bound])
            if done < bound:
                break
    assert done == accepted
    for index in (one, many):
        index.flush()
    assert (folder / "one").read_bytes() == (folder / "many").read_bytes()
    assert (one.index_count, one.hash_slot_count, one.begin_timestamp, one.end_phy_offset) == (
        many.index_count, many.hash_slot_count, many.begin_timestamp, many.end_phy_offset)
    one.close()
    many.close()


def test_bulk_respects_an_invalid_existing_slot_value(tmp_path):
    """A slot holding a number past the count (a torn put) is treated as empty, as put_key does."""
    files = []
    for name in ("one", "many"):
        index = IndexFile.create(tmp_path / name, 5, 20)
        index.put_key("T#a", 0, 1_700_000_000_000)
        slot = index.slot_of("T#b")[1]
        index.buffer[40 + slot * 4 : 44 + slot * 4] = (7).to_bytes(4, "big")
        files.append(index)
    files[0].put_key("T#b", 100, 1_700_000_001_000)
    put_hashes(files[1], index_key_hashes(["T#b"]), np.array([100]), np.array([1_700_000_001_000]))
    for index in files:
        index.flush()
    assert (tmp_path / "one").read_bytes() == (tmp_path / "many").read_bytes()


def reference_build(directory, requests, slots, entries, clock):
    """RocketMQ's buildIndex, literally: one put_key at a time, a new file whenever the last is full."""
    from rocketstore.index.service import build_key, index_file_name

    files: list[IndexFile] = []

    def last_for_write() -> IndexFile:
        if files and not files[-1].is_write_full():
            return files[-1]
        end_phy, end_ts = (files[-1].end_phy_offset, files[-1].end_timestamp) if files else (0, 0)
        files.append(IndexFile.create(directory / index_file_name(clock()), slots, entries, end_phy, end_ts))
        return files[-1]

    for req in requests:
        index = last_for_write()
        if req.phy_offset < index.end_phy_offset or req.sys_flag & 0xC == 0xC:
            continue
        for key in req.index_keys():
            while not index.put_key(build_key(req.topic, key), req.phy_offset, req.store_timestamp):
                index = last_for_write()
    for index in files:
        index.flush()
        index.close()


def counter_clock(start=1_700_000_000_000):
    state = [start]

    def tick() -> int:
        state[0] += 1
        return state[0]

    return tick


requests_strategy = st.lists(
    st.tuples(st.sampled_from(["T", "U"]), st.booleans(), st.lists(st.sampled_from(["a", "Aa", "BB", "k", ""]),
                                                                    max_size=4),
              st.sampled_from([0, 0, 0, 4, 8, 0xC]), st.integers(0, 1500)),
    min_size=1, max_size=60)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(records=requests_strategy, chunks=st.lists(st.integers(1, 20), min_size=1, max_size=8))
def test_index_service_batches_write_what_buildindex_writes(tmp_path_factory, records, chunks):
    from rocketstore import StoreConfig
    from rocketstore.checkpoint import StoreCheckpoint
    from rocketstore.index.service import IndexRequest, IndexService

    root = tmp_path_factory.mktemp("svc")
    requests, ts = [], 1_700_000_000_000
    for i, (topic, has_uniq, keys, sys_flag, step) in enumerate(records):
        ts += step
        requests.append(IndexRequest(topic, 1000 + 300 * i, ts, sys_flag, f"U{i}" if has_uniq else None,
                                     " ".join(keys) or None))
    (root / "ref").mkdir()
    reference_build(root / "ref", requests, 7, 9, counter_clock())
    config = StoreConfig(max_hash_slot_num=7, max_index_num=9)
    service = IndexService(root / "svc", config, StoreCheckpoint(root / "svc-checkpoint"), clock=counter_clock())
    done = 0
    for size in itertools.cycle(chunks):
        if done >= len(requests):
            break
        service.build_index_batch(requests[done : done + size])
        done += size
    service.close()
    ref = {p.name: p.read_bytes() for p in (root / "ref").iterdir()}
    got = {p.name: p.read_bytes() for p in (root / "svc" / "index").iterdir()} if (root / "svc" / "index").exists() \
        else {}
    assert sorted(got) == sorted(ref)
    assert got == ref


@settings(max_examples=300, deadline=None)
@given(keys=st.lists(st.text(max_size=30), max_size=40), prefix=st.text(max_size=8), skip=st.integers(0, 3))
def test_vectorised_hashes_equal_java_string_hash(keys, prefix, skip):
    import pyarrow as pa

    from rocketstore.codec import index_key_hash, java_string_hash
    from rocketstore.index.bulk import java_string_hashes

    assert java_string_hashes(keys).tolist() == [java_string_hash(k) for k in keys]
    assert index_key_hashes(keys).tolist() == [index_key_hash(k) for k in keys]
    expected = [index_key_hash(prefix + k) for k in keys]
    assert index_key_hashes(keys, prefix).tolist() == expected
    column = pa.array(["x"] * skip + keys, pa.string()).slice(skip)  # UTF-8 where it lies, an offset slice too
    assert index_key_hashes(column, prefix).tolist() == expected
    for workers in (2, 3):
        with sharing_among(workers):
            assert index_key_hashes(column, prefix).tolist() == expected
    assert index_key_hashes(pa.chunked_array([column], pa.string()), prefix).tolist() == expected


def test_vectorised_hashes_on_the_spec_examples():
    from rocketstore.index.bulk import java_string_hashes

    keys = ["TopicTest#order-1", "polygenelubricants", "TopicTest#order-achbomgl", "TagA", "Ea#20231001123456",
            "FB#20231001123456", "TopicTest#订单-1", "T#😀", "", "a\x00", "\x00a"]
    assert java_string_hashes(keys).tolist()[:8] == [-1829193424, -2147483648, -2147483648, 2598919, -19583063,
                                                     -19583063, -573861415, 4308978]
    assert index_key_hashes(keys).tolist()[:3] == [1829193424, 0, 0]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(puts=st.lists(st.tuples(st.sampled_from(KEYS), st.integers(0, 3000)), min_size=1, max_size=60),
       slots=st.integers(1, 13), max_num=st.integers(1, 10), window=st.tuples(st.integers(0, 60), st.integers(0, 60)))
def test_select_batch_equals_select_phy_offsets(tmp_path_factory, puts, slots, max_num, window):
    from rocketstore.index.bulk import select_batch

    index = IndexFile.create(tmp_path_factory.mktemp("sel") / "f", slots, 70)
    ts = 1_700_000_000_000
    for i, (key, step) in enumerate(puts):
        ts += step
        index.put_key(key, i * 10, ts)
    begin = 1_700_000_000_000 + min(window) * 1000
    end = 1_700_000_000_000 + max(window) * 1000
    asked = KEYS * 4  # more queries than the walk has lanes (16): lanes refill while others still walk
    queries, phys = select_batch(index, index_key_hashes(asked), max_num, begin, end)
    assert (np.diff(queries) >= 0).all()  # grouped by query, in query order
    for i, key in enumerate(asked):
        assert phys[queries == i].tolist() == index.select_phy_offsets(key, max_num, begin, end), key
    index.close()


def walked_candidates(index: IndexFile, key_hash: int, begin: int) -> list[int]:
    """The model: ``_walk``'s entries of the key's slot that carry its hash."""
    return [phy for hash_read, phy, _ in index._walk(key_hash % index.hash_slot_num, begin) if hash_read == key_hash]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(puts=st.lists(st.tuples(st.sampled_from(KEYS), st.integers(0, 3000)), min_size=0, max_size=60),
       slots=st.integers(1, 13), begin_s=st.integers(0, 60),
       damage=st.lists(st.tuples(st.integers(1, 69), st.sampled_from(["prev", "diff", "slot"]),
                                 st.one_of(st.sampled_from(["itself", "past", -1]), st.integers(-2, 72))),
                       max_size=4))
def test_compiled_candidates_equal_the_walk(tmp_path_factory, puts, slots, begin_s, damage):
    """A query's candidates (one key, and many by hash) are the walk's, on sound and on damaged files
    (links past the count or to themselves, negative time differences, slots past the entries)."""
    from rocketstore.index.bulk import candidates_batch, key_candidates

    index = IndexFile.create(tmp_path_factory.mktemp("cand") / "f", slots, 70)
    ts = 1_700_000_000_000
    for i, (key, step) in enumerate(puts):
        ts += step
        index.put_key(key, i * 10, ts)
    for drawn, field, drawn_value in damage:  # a self-link, a link past the count, a negative time difference
        entry = 1 + drawn % max(1, index.index_count - 1)
        value = {"itself": entry, "past": index.index_count}.get(drawn_value, drawn_value)
        at = {"prev": 40 + slots * 4 + entry * 20 + 16, "diff": 40 + slots * 4 + entry * 20 + 12,
              "slot": 40 + entry % slots * 4}[field]
        index.buffer[at : at + 4] = value.to_bytes(4, "big", signed=True)
    begin = 1_700_000_000_000 + begin_s * 1000
    asked = KEYS * 4  # more queries than the walk has lanes (16)
    hashes = index_key_hashes(asked)
    queries, phys = candidates_batch(index, hashes, begin)
    assert (np.diff(queries) >= 0).all()  # grouped by query, in query order
    for i, (key, key_hash) in enumerate(zip(asked, hashes.tolist(), strict=True)):
        expected = walked_candidates(index, key_hash, begin)
        assert phys[queries == i].tolist() == expected, key
        assert key_candidates(index, key.encode("utf-8", "surrogatepass"), begin) == expected, key
    mapping = index.buffer
    index.close()
    assert mapping.closed  # the array kept for the compiled walks does not keep the file open


def test_the_key_walk_called_without_numbas_dispatcher_answers_as_the_dispatcher_does(tmp_path):
    """``key_candidates`` calls the compiled walk's entry point directly (0.3 us less per key lookup): it is the
    dispatcher's own machine code for ``IndexFile.array``'s type, and it refuses an array of another item size
    and objects of other kinds (it does not check an array's dtype or layout: only index files' arrays go in)."""
    from rocketstore.index.bulk import _compiled_key_walk, key_candidates

    index = IndexFile.create(tmp_path / "f", 11, 40)
    index.put_key("T#k", 1234, 1_700_000_000_000)
    assert key_candidates(index, b"T#k", 0) == [1234]
    args = (b"T#k", index.array, index.hash_slot_num, index.index_num, index.index_count, index.begin_timestamp, 0)
    walk = _compiled_key_walk(args)
    assert walk(*args) == bulk._k.key_candidates(*args)
    array = index.array
    assert array.ndim == 1 and array.dtype == np.uint8 and array.flags.c_contiguous and not array.flags.writeable
    for bad in (np.zeros(index.array.size // 8, dtype=np.int64), "not an array"):
        with pytest.raises(TypeError):
            walk(args[0], bad, *args[2:])
    with pytest.raises(TypeError):
        walk("a str, not the key's bytes", *args[1:])
    index.close()


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("entries", [4500, 6000])
def test_bulk_equals_sequential_across_read_ahead_blocks(tmp_path, entries, workers):
    """More entries than the kernel reads slots ahead for (2048), in one call, with the file filling up in the
    middle of a block or not at all; in one kernel call or two at once."""
    keys = [f"k{i % 1300}" for i in range(5000)]
    phys = np.arange(5000, dtype=np.int64) * 100 + 10_000
    stamps = 1_700_000_000_000 + np.arange(5000, dtype=np.int64) * 7
    one = IndexFile.create(tmp_path / "one", 97, entries, 0, 0)
    many = IndexFile.create(tmp_path / "many", 97, entries, 0, 0)
    accepted = 0
    for key, phy, stamp in zip(keys, phys.tolist(), stamps.tolist(), strict=True):
        if not one.put_key(key, phy, stamp):
            break
        accepted += 1
    with sharing_among(workers):
        assert put_hashes(many, index_key_hashes(keys), phys, stamps) == accepted == min(5000, entries - 1)
    for index in (one, many):
        index.flush()
    assert (tmp_path / "one").read_bytes() == (tmp_path / "many").read_bytes()
    one.close()
    many.close()


def test_a_big_put_on_the_real_cores_writes_what_one_kernel_call_writes(tmp_path):
    """Above the size where puts and hashes are shared among the process's cores (if it has several), with the
    first entry setting the begin timestamp the others' time diffs count from."""
    import pyarrow as pa

    n = bulk._PARALLEL_MIN + 5000
    column = pa.array([f"TopicTest#key-{i % 50_000}" for i in range(n)], pa.string())
    phys = np.arange(n, dtype=np.int64) * 180
    stamps = 1_700_000_000_000 + np.arange(n, dtype=np.int64) * 3
    files = {name: IndexFile.create(tmp_path / name, 40_009, n + 10, 0, 0) for name in ("shared", "one")}
    assert put_hashes(files["shared"], index_key_hashes(column), phys, stamps) == n
    with sharing_among(1):
        hashes = index_key_hashes(column)
        assert put_hashes(files["one"], hashes, phys, stamps) == n
    assert index_key_hashes(column).tolist() == hashes.tolist()
    for index in files.values():
        index.flush()
        index.close()
    assert (tmp_path / "shared").read_bytes() == (tmp_path / "one").read_bytes()


def test_a_forked_child_makes_its_own_threads():
    """The pool's threads do not survive a fork: a child that reused its parent's pool would wait forever for
    its first big hash (PySpark's workers are forked)."""
    import multiprocessing

    import pyarrow as pa

    column = pa.array([f"k{i}" for i in range(bulk._PARALLEL_MIN + 10)], pa.string())
    expected = index_key_hashes(column)  # the parent's pool exists now (on several cores)
    with mock.patch.object(bulk, "_workers", lambda: (bulk._shared_pool(2), 2)):
        index_key_hashes(column)
        child = multiprocessing.get_context("fork").Process(target=_hash_in_child, args=(column, expected))
        child.start()
        child.join(60)
        alive = child.is_alive()
        if alive:
            child.kill()
            child.join()
    assert not alive and child.exitcode == 0


def _hash_in_child(column, expected) -> None:
    assert index_key_hashes(column).tolist() == expected.tolist()


def test_single_key_lookups_keep_the_gil():
    """A lookup's kernel runs for microseconds: giving the GIL away for it let two threads looking keys up in a loop
    starve every other thread of the process (a dispatch round 0.4 ms -> a median 289 ms, a retention pass 23 s)."""
    from rocketstore.index import _kernels

    for name in _kernels.GIL_HELD:
        assert not getattr(_kernels, name).targetoptions.get("nogil"), name
    assert _kernels.chain_offsets.targetoptions.get("nogil"), "many keys' walks still run beside other threads"

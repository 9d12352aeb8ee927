"""Index work on whole arrays: many ``putKey`` calls, many lookups and many key hashes at once, with the
same bytes and the same answers as one at a time (``tests/test_index_bulk.py`` holds them equal).

Each is one compiled loop (``_kernels.py``): an entry's predecessor is what its slot held a moment
before, and a lookup follows a linked list, so the work is sequential by nature and a sort-based
numpy form (the previous one) did several passes where one suffices.
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa

from ..codec import _kernels as _ck
from . import _kernels as _k
from .file import INDEX_ENTRY_SIZE, INT_MAX, IndexFile

ENTRY_DTYPE = np.dtype([("hash", ">i4"), ("phy", ">i8"), ("diff", ">i4"), ("prev", ">i4")])
assert ENTRY_DTYPE.itemsize == INDEX_ENTRY_SIZE


def java_string_hashes(keys: Sequence[str]) -> np.ndarray:
    """``String.hashCode`` of every key as int32, for whole arrays at once.

    The keys are joined and encoded once (ASCII as bytes, anything else as UTF-32 code points, lone
    surrogates kept), and one compiled loop runs Horner's rule over each key's UTF-16 units.
    """
    keys = keys if isinstance(keys, list) else list(keys)
    if not keys:
        return np.zeros(0, dtype=np.int32)
    offsets = np.zeros(len(keys) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, keys), dtype=np.int64, count=len(keys)), out=offsets[1:])
    joined = "".join(keys)
    if joined.isascii():
        units = np.frombuffer(joined.encode("ascii"), dtype=np.uint8)
    else:
        units = np.frombuffer(joined.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    return _k.java_hashes(units, offsets)


def index_key_hashes(keys: Iterable[str] | pa.Array, prefix: str = "") -> np.ndarray:
    """``indexKeyHashMethod`` of every ``prefix + key``: |hashCode|, Integer.MIN_VALUE -> 0; as int64.

    ``keys`` may be an Arrow string column: its UTF-8 bytes are hashed where they lie (one compiled loop, no
    Python string per key), as dispatch hashes keys inside the records.
    """
    if isinstance(keys, pa.ChunkedArray):
        keys = keys.combine_chunks()
    if isinstance(keys, pa.Array):
        if keys.null_count:
            raise ValueError("index keys cannot be null")
        if pa.types.is_large_string(keys.type):
            keys = keys.cast(pa.string())
        if not pa.types.is_string(keys.type):
            raise TypeError(f"index keys must be strings, not {keys.type}")
        offsets = np.frombuffer(keys.buffers()[1], dtype=np.int32, count=len(keys) + 1, offset=keys.offset * 4)
        data_buf = keys.buffers()[2]
        data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, dtype=np.uint8)
        start = 0  # the prefix's hash: Java's hashCode is Horner's rule over UTF-16 units, so it continues
        for unit in np.frombuffer(prefix.encode("utf-16-le", "surrogatepass"), dtype="<u2").tolist():
            start = (start * 31 + unit) & 0xFFFFFFFF
        return _hash_utf8(data, offsets.astype(np.int64), np.int64(start))
    if prefix:
        keys = [prefix + k for k in keys]
    h = java_string_hashes(keys if isinstance(keys, list) else list(keys)).astype(np.int64)
    return np.where(h == -(1 << 31), 0, np.abs(h))


_PARALLEL_MIN = 1 << 16  # entries below which a thread hand-off costs more than sharing the work saves
_MAX_WORKERS = 4  # each worker reads every hash to find its own: more than a few only adds those passes


@functools.cache
def _shared_pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(workers, thread_name_prefix="rocketstore-index")


os.register_at_fork(after_in_child=_shared_pool.cache_clear)  # a forked child has none of its parent's threads


def _workers() -> tuple[ThreadPoolExecutor | None, int]:
    """The shared threads of the bulk kernels (which release the GIL) and how many of them to use: one per
    core this process may run on, or none on one core."""
    usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    n = min(len(usable), _MAX_WORKERS)
    return (_shared_pool(n), n) if n > 1 else (None, 1)


def _hash_utf8(data: np.ndarray, offsets: np.ndarray, prefix: np.int64) -> np.ndarray:
    """The kernel over the whole column, or on several cores over one slice of it per worker at once."""
    out = np.empty(offsets.size - 1, dtype=np.int64)
    pool, n = _workers() if out.size >= _PARALLEL_MIN else (None, 1)
    if pool is None:
        _ck.index_hashes_utf8(data, offsets, prefix, out)
        return out
    bounds = [out.size * w // n for w in range(n + 1)]
    for part in [pool.submit(_ck.index_hashes_utf8, data, offsets[lo:hi + 1], prefix, out[lo:hi])
                 for lo, hi in itertools.pairwise(bounds)]:
        part.result()
    return out


def _put_entries(buf: np.ndarray, index: IndexFile, count: int, begin_ts: int, hashes: np.ndarray,
                 phys: np.ndarray, stamps: np.ndarray) -> tuple[int, int, int]:
    """(entries put, slots newly used, begin timestamp): one kernel call, or on several cores one per range of
    slots at once, each putting the entries of the chains in its range (the same bytes: see the kernel)."""
    slot_num, index_num = index.hash_slot_num, index.index_num
    pool, n = _workers() if hashes.size >= _PARALLEL_MIN else (None, 1)
    if pool is None:
        put, new_slots, begin_ts, _touched = _k.put_entries(buf, slot_num, index_num, count, begin_ts, hashes, phys,
                                                            stamps, 0, slot_num)
        return put, new_slots, begin_ts
    head = max(0, 2 - count)  # the entries at positions 0 and 1 set the begin timestamp the others' diffs use
    put, new_slots, begin_ts, _touched = _k.put_entries(buf, slot_num, index_num, count, begin_ts, hashes[:head],
                                                        phys[:head], stamps[:head], 0, slot_num)
    bounds = [slot_num * w // n for w in range(n + 1)]
    parts = [pool.submit(_k.put_entries, buf, slot_num, index_num, count + head, begin_ts, hashes[head:],
                         phys[head:], stamps[head:], lo, hi) for lo, hi in itertools.pairwise(bounds)]
    for part in parts:
        part_put, part_new, _begin, _touched = part.result()
        put += part_put
        new_slots += part_new
    return put, new_slots, begin_ts


def put_hashes(index: IndexFile, key_hashes: np.ndarray, phy_offsets: np.ndarray, timestamps: np.ndarray) -> int:
    """Append entries as consecutive ``put_key`` calls would; returns how many fit before the file was full."""
    c0 = index.index_count
    m = min(len(key_hashes), max(0, index.index_num - c0))
    if m <= 0:
        return 0
    hashes = np.ascontiguousarray(key_hashes[:m], dtype=np.int64)
    phys = np.ascontiguousarray(phy_offsets[:m], dtype=np.int64)
    stamps = np.ascontiguousarray(timestamps[:m], dtype=np.int64)
    index.reserve_entries(c0 + m)  # a sparse file: blocks before the compiled stores (no SIGBUS)
    buf = np.frombuffer(index.buffer, dtype=np.uint8)
    try:
        put, new_slots, _begin = _put_entries(buf, index, c0, index.begin_timestamp, hashes, phys, stamps)
    finally:
        del buf  # no view of the mapping may outlive the call: the file must stay closable
    if c0 <= 1:
        index._set_i64(16, int(phys[0]))  # beginPhyOffset
        index._set_i64(0, int(stamps[0]))  # beginTimestamp
    index._set_i64(24, int(phys[put - 1]))  # endPhyOffset, before the count: a reader that sees an entry
    index._set_i64(8, int(stamps[put - 1]))  # endTimestamp                 sees its time in the header
    index.hash_slot_count += int(new_slots)
    index.index_count = c0 + int(put)
    index.buffer[32:40] = np.array([index.hash_slot_count, index.index_count], dtype=">i4").tobytes()
    return int(put)


def select_batch(index: IndexFile, key_hashes: np.ndarray, max_num: int, begin: int,
                 end: int) -> tuple[np.ndarray, np.ndarray]:
    """``selectPhyOffset`` for many keys at once: (query number, phyOffset) pairs, each query's newest first,
    grouped by query, with RocketMQ's stop rules and ``max_num`` per query."""
    hashes = np.ascontiguousarray(key_hashes, dtype=np.int64)
    return _walk_chains(index, hashes, np.full(len(hashes), max_num, dtype=np.int64), begin, end, True)


_key_walk: list = []  # ``_k.key_candidates``'s machine code, called without numba's dispatcher


def _compiled_key_walk(args: tuple):
    """The compiled ``_k.key_candidates`` for ``key_candidates``'s argument types, which never change (bytes, an
    index file's ``array``: always 1-D, C-contiguous, read-only uint8; five ints): numba's dispatcher resolves the
    types of every call again, 0.3 us of a 7 us key lookup. The entry point converts each argument to the
    compiled type but checks an array's item size only, not its dtype, dimensions or strides: it is called with
    ``IndexFile.array`` and nothing else."""
    kernel = _k.key_candidates
    kernel(*args)  # compiled, or loaded from numba's cache
    _key_walk[:] = [kernel.overloads[tuple(map(kernel.typeof_pyval, args))].entry_point]
    return _key_walk[0]


def key_candidates(index: IndexFile, key_utf8: bytes, begin: int) -> list[int]:
    """A query's candidates in one file: every offset whose entry has the hash of ``topic#key`` (given as its
    UTF-8), newest first, no count limit, stopping at the first entry older than ``begin``."""
    if index.index_count <= 1:
        return []
    buf = index.array
    walk = _key_walk[0] if _key_walk else _compiled_key_walk(
        (key_utf8, buf, index.hash_slot_num, index.index_num, index.index_count, index.begin_timestamp, begin))
    matches, newest, key_hash = walk(key_utf8, buf, index.hash_slot_num, index.index_num, index.index_count,
                                     index.begin_timestamp, begin)
    if matches <= 1:
        return [newest] if matches else []
    return _k.chain_offsets_held(buf, index.hash_slot_num, index.index_num, index.index_count,
                                 index.begin_timestamp, np.array([key_hash], dtype=np.int64),
                                 np.array([INT_MAX], dtype=np.int64), begin, 0, False)[1].tolist()


def candidates_batch(index: IndexFile, key_hashes: np.ndarray, begin: int) -> tuple[np.ndarray, np.ndarray]:
    """``key_candidates`` for many keys by their hashes: (query number, phyOffset) pairs, each query's newest
    first."""
    hashes = np.ascontiguousarray(key_hashes, dtype=np.int64)
    return _walk_chains(index, hashes, np.full(len(hashes), INT_MAX, dtype=np.int64), begin, 0, False)


def _walk_chains(index: IndexFile, hashes: np.ndarray, limits: np.ndarray, begin: int, end: int,
                 time_filter: bool) -> tuple[np.ndarray, np.ndarray]:
    if index.index_count <= 1 or not len(hashes):
        return np.empty(0, np.int64), np.empty(0, np.int64)
    return _k.chain_offsets(index.array, index.hash_slot_num, index.index_num, index.index_count,
                            index.begin_timestamp, hashes, limits, begin, end, time_filter)

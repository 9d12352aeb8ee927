"""Vectorised index building: many ``putKey`` calls at once, with the same bytes as one at a time.

For a run of new entries numbered ``c0, c0+1, ...`` the only sequential state is each entry's
predecessor in its slot. A stable sort by slot lines the entries of each slot up in put order,
so every entry's predecessor is its left neighbour in that order, or, for the first of a slot,
whatever the slot held before the run. Header updates and time offsets follow from the first
and last entries. ``tests/test_index_bulk.py`` checks the result against ``IndexFile.put_key``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from .file import HASH_SLOT_SIZE, INDEX_ENTRY_SIZE, INDEX_HEADER_SIZE, INT_MAX, IndexFile

ENTRY_DTYPE = np.dtype([("hash", ">i4"), ("phy", ">i8"), ("diff", ">i4"), ("prev", ">i4")])
assert ENTRY_DTYPE.itemsize == INDEX_ENTRY_SIZE


def java_string_hashes(keys: Sequence[str]) -> np.ndarray:
    """``String.hashCode`` of every key as int32, for whole arrays at once.

    Keys are grouped by their length in UTF-16 units; each group's units form an (n x L) matrix and
    Horner's rule runs over its L columns in uint32, which wraps exactly like Java's int. The
    per-key Python work is one length and one join.
    """
    keys = keys if isinstance(keys, list) else list(keys)
    out = np.zeros(len(keys), dtype=np.uint32)
    if not keys:
        return out.view(np.int32)
    ascii_only = "".join(keys).isascii()
    if ascii_only:
        lengths = np.fromiter(map(len, keys), dtype=np.int64, count=len(keys))
    else:
        lengths = np.fromiter((len(k.encode("utf-16-be", "surrogatepass")) // 2 for k in keys), dtype=np.int64,
                              count=len(keys))
    order = np.argsort(lengths, kind="stable")
    sorted_lengths = lengths[order]
    bounds = np.flatnonzero(np.diff(sorted_lengths)) + 1
    for lo, hi in zip(np.concatenate([[0], bounds]), np.concatenate([bounds, [len(keys)]]), strict=True):
        width = int(sorted_lengths[lo])
        if width == 0:
            continue
        members = order[lo:hi]
        joined = "".join([keys[i] for i in members])
        if ascii_only:
            units = np.frombuffer(joined.encode("ascii"), dtype=np.uint8)
        else:
            units = np.frombuffer(joined.encode("utf-16-be", "surrogatepass"), dtype=">u2")
        matrix = units.reshape(len(members), width)
        h = np.zeros(len(members), dtype=np.uint32)
        with np.errstate(over="ignore"):
            for column in matrix.T:
                h = h * np.uint32(31) + column
        out[members] = h
    return out.view(np.int32)


def index_key_hashes(keys: Iterable[str]) -> np.ndarray:
    """``indexKeyHashMethod`` of every key: |hashCode|, Integer.MIN_VALUE -> 0; as int64."""
    h = java_string_hashes(keys if isinstance(keys, list) else list(keys)).astype(np.int64)
    return np.where(h == -(1 << 31), 0, np.abs(h))


def put_hashes(index: IndexFile, key_hashes: np.ndarray, phy_offsets: np.ndarray, timestamps: np.ndarray) -> int:
    """Append entries as consecutive ``put_key`` calls would; returns how many fit before the file was full."""
    c0 = index.index_count
    m = min(len(key_hashes), max(0, index.index_num - c0))
    if m <= 0:
        return 0
    hashes = np.asarray(key_hashes[:m], dtype=np.int64)
    phys = np.asarray(phy_offsets[:m], dtype=np.int64)
    stamps = np.asarray(timestamps[:m], dtype=np.int64)
    numbers = np.arange(c0, c0 + m, dtype=np.int64)
    slots = hashes % index.hash_slot_num

    buf = index.buffer
    slot_table = np.frombuffer(buf, dtype=">i4", count=index.hash_slot_num, offset=INDEX_HEADER_SIZE)
    order = np.argsort(slots, kind="stable")
    sorted_slots = slots[order]
    first_of_slot = np.ones(m, dtype=bool)
    first_of_slot[1:] = sorted_slots[1:] != sorted_slots[:-1]
    prev = np.empty(m, dtype=np.int64)
    prev_sorted = np.empty(m, dtype=np.int64)
    prev_sorted[1:] = numbers[order[:-1]]
    existing = slot_table[sorted_slots].astype(np.int64)
    # the slot's old value counts only if it was valid when this entry was put: 0 < v <= count then
    valid = (existing > 0) & (existing <= numbers[order])
    prev_sorted[first_of_slot] = np.where(valid, existing, 0)[first_of_slot]
    prev[order] = prev_sorted

    begin_ts = index.begin_timestamp
    begin_for = np.full(m, begin_ts, dtype=np.int64)
    if c0 <= 1 and m > 1:
        begin_for[1:] = stamps[0]  # the first put into an empty file sets beginTimestamp
    diff = stamps - begin_for
    diff = np.where(diff < 0, 0, diff // 1000)
    diff = np.where(begin_for <= 0, 0, np.minimum(diff, INT_MAX))

    entries = np.empty(m, dtype=ENTRY_DTYPE)
    entries["hash"] = hashes
    entries["phy"] = phys
    entries["diff"] = diff
    entries["prev"] = prev
    start = INDEX_HEADER_SIZE + index.hash_slot_num * HASH_SLOT_SIZE + c0 * INDEX_ENTRY_SIZE
    buf[start : start + m * INDEX_ENTRY_SIZE] = entries.tobytes()

    last_of_slot = np.ones(m, dtype=bool)
    last_of_slot[:-1] = sorted_slots[1:] != sorted_slots[:-1]
    new_heads = np.zeros(index.hash_slot_num, dtype=bool)
    writable = np.frombuffer(buf, dtype=">i4", count=index.hash_slot_num, offset=INDEX_HEADER_SIZE)
    writable[sorted_slots[last_of_slot]] = numbers[order][last_of_slot]
    del writable, slot_table, new_heads  # release the views of the mapping before it may be closed

    if c0 <= 1:
        index._set_i64(16, int(phys[0]))  # beginPhyOffset
        index._set_i64(0, int(stamps[0]))  # beginTimestamp
    index.hash_slot_count += int(np.count_nonzero(prev == 0))
    index.index_count = c0 + m
    header = np.array([index.hash_slot_count, index.index_count], dtype=">i4").tobytes()
    buf[32:40] = header
    index._set_i64(24, int(phys[-1]))  # endPhyOffset
    index._set_i64(8, int(stamps[-1]))  # endTimestamp
    return m


def select_batch(index: IndexFile, key_hashes: np.ndarray, max_num: int, begin: int,
                 end: int) -> tuple[np.ndarray, np.ndarray]:
    """``selectPhyOffset`` for many keys at once: (query number, phyOffset) pairs, each query's newest first.

    All queries walk their chains in lock-step, one numpy gather per step, with RocketMQ's stop
    rules (chain end, a self-link, a bad link, an entry older than ``begin``) and ``max_num`` per query.
    """
    count = index.index_count
    hashes = np.asarray(key_hashes, dtype=np.int64)
    queries = np.arange(len(hashes))
    if count <= 1 or not len(hashes):
        return np.empty(0, np.int64), np.empty(0, np.int64)
    buf = index.buffer
    slots = np.frombuffer(buf, dtype=">i4", count=index.hash_slot_num, offset=INDEX_HEADER_SIZE)
    entries = np.frombuffer(buf, dtype=ENTRY_DTYPE, count=index.index_num,
                            offset=INDEX_HEADER_SIZE + index.hash_slot_num * HASH_SLOT_SIZE)
    n = slots[hashes % index.hash_slot_num].astype(np.int64)
    found = np.zeros(len(hashes), dtype=np.int64)
    active = (n > 0) & (n <= count)
    out_query, out_phy = [], []
    begin_ts = index.begin_timestamp
    for _ in range(count):
        q = queries[active]
        if not len(q):
            break
        at = n[q]
        step = entries[at]
        diff = step["diff"].astype(np.int64)
        alive = diff >= 0
        q, at, step, diff = q[alive], at[alive], step[alive], diff[alive]
        when = begin_ts + diff * 1000
        hit = (step["hash"].astype(np.int64) == hashes[q]) & (when >= begin) & (when <= end)
        out_query.append(q[hit])
        out_phy.append(step["phy"][hit].astype(np.int64))
        found[q[hit]] += 1
        prev = step["prev"].astype(np.int64)
        go_on = (prev > 0) & (prev <= count) & (prev != at) & (when >= begin) & (found[q] < max_num)
        active[:] = False
        active[q[go_on]] = True
        n[q[go_on]] = prev[go_on]
    del slots, entries
    if not out_query:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    return np.concatenate(out_query), np.concatenate(out_phy)

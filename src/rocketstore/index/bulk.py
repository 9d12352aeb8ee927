"""Vectorised index building: many ``putKey`` calls at once, with the same bytes as one at a time.

For a run of new entries numbered ``c0, c0+1, ...`` the only sequential state is each entry's
predecessor in its slot. A stable sort by slot lines the entries of each slot up in put order,
so every entry's predecessor is its left neighbour in that order, or, for the first of a slot,
whatever the slot held before the run. Header updates and time offsets follow from the first
and last entries. ``tests/test_index_bulk.py`` checks the result against ``IndexFile.put_key``.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ..codec.hashing import index_key_hash
from .file import HASH_SLOT_SIZE, INDEX_ENTRY_SIZE, INDEX_HEADER_SIZE, INT_MAX, IndexFile

ENTRY_DTYPE = np.dtype([("hash", ">i4"), ("phy", ">i8"), ("diff", ">i4"), ("prev", ">i4")])
assert ENTRY_DTYPE.itemsize == INDEX_ENTRY_SIZE


def index_key_hashes(keys: Iterable[str]) -> np.ndarray:
    """``indexKeyHashMethod`` of every key, as int64."""
    return np.fromiter((index_key_hash(k) for k in keys), dtype=np.int64)


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

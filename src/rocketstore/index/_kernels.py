"""numba kernels of the index: the loops that are sequential by nature.

Putting entries is a chain of dependent steps (each entry's predecessor is whatever its slot held a
moment before), a lookup walks a linked list, and ``String.hashCode`` is Horner's rule over UTF-16
units: each is one compiled loop here, with ``IndexFile.put_hash``'s and ``IndexFile._walk``'s rules
in the same order, so the bytes written and the offsets found are those of the one-at-a-time
methods (``tests/test_index_bulk.py`` holds them equal). Kernels take the file as one ``uint8``
array and release the GIL.
"""

from __future__ import annotations

import numpy as np
from numba import njit

# importing the codec's kernels installs the stable cache locator before the kernels below
from ..codec._kernels import _be32, _be64, _put_be32, _put_be64, index_key_hash_utf8

_INT_MAX = 2147483647
_ENTRY = 20


_AHEAD = 2048  # slots read ahead of the chain (32-128 KB of cache lines): independent loads overlap


@njit(cache=True, nogil=True)
def put_entries(buf, slot_num, index_num, count, begin_ts, hashes, phys, stamps, slot_lo, slot_hi):
    """``put_hash`` for each entry in order until the file is full, for the entries whose slot lies in
    ``[slot_lo, slot_hi)``: returns (entries put, slots newly used, the begin timestamp after them, a byte of no
    meaning). Entry ``i`` goes to position ``count + i`` whatever its slot, so disjoint slot ranges can be put by
    concurrent calls and give the bytes of one call over all slots (each chain lives in one range). The caller
    writes the header fields from the results.

    Each entry reads and writes a random slot of a 20 MB table, and the chain's loop, with its stores, keeps
    few of those cache misses in flight; so the slots of the next ``_AHEAD`` entries are read first in a loop
    of independent loads (167 -> 50 ns an entry on a faulted-in file, 228 -> 105 on a fresh one). The byte
    returned is what that loop read, so it is not optimised away."""
    entries_at = 40 + slot_num * 4
    put = 0
    new_slots = 0
    touched = np.uint8(0)
    total = min(hashes.size, max(index_num - count, 0))
    for block in range(0, total, _AHEAD):
        last = min(block + _AHEAD, total)
        for i in range(block, last):
            s = hashes[i] % slot_num
            if s >= slot_lo and s < slot_hi:
                touched ^= buf[40 + s * 4]
        for i in range(block, last):
            h = hashes[i]
            s = h % slot_num
            if s < slot_lo or s >= slot_hi:
                continue
            at = count + i
            slot_pos = 40 + s * 4
            prev = _be32(buf, slot_pos)
            if prev <= 0 or prev > at:
                prev = 0
            diff = np.int64(0)
            if begin_ts > 0:
                d = stamps[i] - begin_ts
                diff = 0 if d < 0 else min(d // 1000, _INT_MAX)
            p = entries_at + at * _ENTRY
            _put_be32(buf, p, h)
            _put_be64(buf, p + 4, phys[i])
            _put_be32(buf, p + 12, diff)
            _put_be32(buf, p + 16, prev)
            _put_be32(buf, slot_pos, at)
            if at <= 1:
                begin_ts = stamps[i]
            if prev == 0:
                new_slots += 1
            put += 1
    return put, new_slots, begin_ts, touched


@njit(cache=True, nogil=True, inline="always")
def _chain_head(buf, slot_num, index_num, count, h):
    """The newest entry of ``h``'s slot that ``count`` covers, 0 when there is none (an empty file, an empty or
    impossible slot).

    A slot may name an entry past ``count``: a live writer's newer one, when this file was opened read-only beside
    it (its count read then), or one a crash tore. Such entries are not answers, but their links lead back to the
    covered entries of the chain (each link names an older entry: a smaller number): returning 0 there lost every
    answer of a read-only store whose writer had since indexed the same key or slot."""
    if count <= 1:
        return 0
    n = _be32(buf, 40 + (h % slot_num) * 4)
    entries_at = 40 + slot_num * 4
    while n > count:
        if n >= index_num:
            return 0
        prev = _be32(buf, entries_at + n * _ENTRY + 16)
        if prev <= 0 or prev >= n:  # not written yet (a writer writes the entry before the slot), or damage
            return 0
        n = prev
    return n if n > 0 else 0


@njit(cache=True, nogil=True, inline="always")
def _chain_entry(buf, entries_at, index_num, count, begin_ts, begin, n):
    """Entry ``n`` of a chain as (valid, keyHash, phyOffset, stored time, next entry), ``_walk``'s rules: not
    valid past the file or with a negative timeDiff (the walk ends before it); next is 0 when the walk ends
    after it (no predecessor, an impossible or self link, or an entry older than ``begin``)."""
    if n >= index_num:
        return False, 0, 0, 0, 0
    p = entries_at + n * _ENTRY
    diff = _be32(buf, p + 12)
    if diff < 0:
        return False, 0, 0, 0, 0
    when = begin_ts + diff * 1000
    prev = _be32(buf, p + 16)
    following = 0 if prev <= 0 or prev > count or prev == n or when < begin else prev
    return True, _be32(buf, p), _be64(buf, p + 4), when, following


_LANES = 16  # chains walked in step: one step of each in turn, so their cache misses overlap


@njit(cache=True, nogil=True)
def chain_offsets(buf, slot_num, index_num, count, begin_ts, hashes, limits, begin, end, time_filter):
    """Walk each hash's chain with ``_walk``'s stop rules: (query number, phyOffset) of the entries with that
    hash (and, with ``time_filter``, a decoded time in [begin, end]), each query's newest first, at most
    ``limits[q]`` per query. Without ``time_filter`` it is a query's candidates: hash only, stop at the first
    entry older than ``begin``.

    Every step of a chain is a cache miss in a 400 MB file that depends on the one before, so one chain at a
    time leaves the memory system idle; ``_LANES`` chains are walked in turn, one step each, and their misses
    overlap. Results arrive interleaved and are put in query order at the end (stable: each chain's own order
    is kept)."""
    entries_at = 40 + slot_num * 4
    queries = hashes.size
    cap = max(16, queries * 2)
    out_q = np.empty(cap, dtype=np.int64)
    out_phy = np.empty(cap, dtype=np.int64)
    m = 0
    lane_q = np.full(_LANES, -1, dtype=np.int64)  # the query a lane walks, -1 when free
    lane_n = np.zeros(_LANES, dtype=np.int64)  # its next entry
    lane_found = np.zeros(_LANES, dtype=np.int64)
    lane_steps = np.zeros(_LANES, dtype=np.int64)  # a chain visits each entry at most once: bounded by count
    next_q = 0
    active = 0
    while True:
        for lane in range(_LANES):
            while lane_q[lane] < 0 and next_q < queries:
                q = next_q
                next_q += 1
                if limits[q] <= 0:
                    continue
                n = _chain_head(buf, slot_num, index_num, count, hashes[q])
                if n == 0:
                    continue
                lane_q[lane] = q
                lane_n[lane] = n
                lane_found[lane] = 0
                lane_steps[lane] = 0
                active += 1
        if active == 0:
            break
        for lane in range(_LANES):
            q = lane_q[lane]
            if q < 0:
                continue
            valid, hash_read, phy, when, n = _chain_entry(buf, entries_at, index_num, count, begin_ts, begin,
                                                          lane_n[lane])
            done = not valid
            if valid and hash_read == hashes[q] and (not time_filter or (begin <= when <= end)):
                if m == cap:
                    cap *= 2
                    grown_q = np.empty(cap, dtype=np.int64)
                    grown_phy = np.empty(cap, dtype=np.int64)
                    grown_q[:m] = out_q[:m]
                    grown_phy[:m] = out_phy[:m]
                    out_q, out_phy = grown_q, grown_phy
                out_q[m] = q
                out_phy[m] = phy
                m += 1
                lane_found[lane] += 1
                if lane_found[lane] >= limits[q]:
                    done = True
            lane_steps[lane] += 1
            if done or n == 0 or lane_steps[lane] >= count:
                lane_q[lane] = -1
                active -= 1
            else:
                lane_n[lane] = n
    # query order, each query's entries in the order its chain gave them: a stable counting sort
    starts = np.zeros(queries + 1, dtype=np.int64)
    for i in range(m):
        starts[out_q[i] + 1] += 1
    for q in range(queries):
        starts[q + 1] += starts[q]
    sorted_q = np.empty(m, dtype=np.int64)
    sorted_phy = np.empty(m, dtype=np.int64)
    for i in range(m):
        at = starts[out_q[i]]
        sorted_q[at] = out_q[i]
        sorted_phy[at] = out_phy[i]
        starts[out_q[i]] = at + 1
    return sorted_q, sorted_phy


# A kernel of a single lookup runs for microseconds; giving the GIL away for that is all cost: two threads calling
# it in a loop starved every other thread of the process (an open store's dispatcher, a producer's sleep(0.01)),
# because each re-took the GIL before a woken waiter could, and the waiter's switch interval began again. A
# round of 30 one-message puts beside two such readers took 16-28 s instead of 0.4 s. Lookups of one key keep the
# GIL (``key_candidates``, ``chain_offsets_held``); batches (``chain_offsets`` of many keys, dispatch) give it up.
GIL_HELD = ("key_candidates", "chain_offsets_held")


@njit(cache=True)  # keeps the GIL: see ``GIL_HELD``
def chain_offsets_held(buf, slot_num, index_num, count, begin_ts, hashes, limits, begin, end, time_filter):
    """``chain_offsets`` for one query's few hashes."""
    return chain_offsets(buf, slot_num, index_num, count, begin_ts, hashes, limits, begin, end, time_filter)


@njit(cache=True)  # keeps the GIL: see ``GIL_HELD``
def key_candidates(key, buf, slot_num, index_num, count, begin_ts, begin):
    """One query's candidates from the UTF-8 of its ``topic#key``: (entries with its hash, the newest one's
    phyOffset, the hash). A key query usually has one candidate, so this answer is three integers, not an
    array (boxing one is half the cost of a call); with more, ``chain_offsets_held`` lists them."""
    h = index_key_hash_utf8(key)
    entries_at = 40 + slot_num * 4
    n = _chain_head(buf, slot_num, index_num, count, h)
    matches = 0
    newest = 0
    for _ in range(count):
        if n == 0:
            break
        valid, hash_read, phy, _when, n = _chain_entry(buf, entries_at, index_num, count, begin_ts, begin, n)
        if not valid:
            break
        if hash_read == h:
            if matches == 0:
                newest = phy
            matches += 1
    return matches, newest, h


@njit(cache=True, nogil=True)
def java_hashes(units, offsets):
    """``String.hashCode`` (int32) of each text ``units[offsets[i]:offsets[i+1]]`` of code points (any unsigned
    width; a code point above U+FFFF counts as its two UTF-16 surrogates, as in Java)."""
    n = offsets.size - 1
    out = np.empty(n, dtype=np.int32)
    for i in range(n):
        h = np.int64(0)
        for j in range(offsets[i], offsets[i + 1]):
            cp = np.int64(units[j])
            if cp >= 0x10000:
                cp -= 0x10000
                h = (h * 31 + (0xD800 + (cp >> 10))) & 0xFFFFFFFF
                h = (h * 31 + (0xDC00 + (cp & 0x3FF))) & 0xFFFFFFFF
            else:
                h = (h * 31 + cp) & 0xFFFFFFFF
        out[i] = h - 0x100000000 if h & 0x80000000 else h
    return out


ENTRY_FINE, ENTRY_WRONG_KEY, ENTRY_NO_RECORD, ENTRY_EXPIRED, ENTRY_AFTER_SNAPSHOT, ENTRY_WRONG_TIME = 0, 1, 2, 3, 4, 5


@njit(cache=True, nogil=True)
def check_entries(buf, entries_at, count, end, log_min, rec_phy, pair_start, key_pairs, covered, begin_ts,
                  rec_store_ts):
    """``verify``'s index pass over the ``count`` entries after the invalid entry 0: whether a record starts at
    each entry's offset and has the entry's hash among its keys (marking that key pair covered), and whether the
    entry's time diff (after entry 1's) is the one ``putKey`` makes of that record's store time and the file's
    ``begin_ts`` (seconds since it, clamped to [0, 2^31-1]; 0 when ``begin_ts`` <= 0), as a code per entry
    (``ENTRY_*``).
    Entries come in log order, so a cursor walks the sorted record offsets and a binary search is needed only
    where the order breaks or jumps."""
    status = np.empty(count, dtype=np.int8)
    m = rec_phy.size
    j = 0
    for i in range(count):
        p = entries_at + (i + 1) * _ENTRY
        h = _be32(buf, p)
        phy = _be64(buf, p + 4)
        if phy >= end:
            status[i] = ENTRY_AFTER_SNAPSHOT
            continue
        if j >= m or rec_phy[j] > phy or (j + 16 < m and rec_phy[j + 16] < phy):
            j = np.searchsorted(rec_phy, phy)
        else:
            while j < m and rec_phy[j] < phy:
                j += 1
        if j < m and rec_phy[j] == phy:
            status[i] = ENTRY_WRONG_KEY
            for k in range(pair_start[j], pair_start[j + 1]):
                if (key_pairs[k] & 0xFFFFFFFF) == h:
                    status[i] = ENTRY_FINE
                    covered[k] = True
                    break
            if status[i] == ENTRY_FINE and i > 0:  # entry 1's diff counts from the file's creation time (putKey
                diff = 0  # sets beginTimestamp after it): only later entries count from beginTimestamp
                if begin_ts > 0 and rec_store_ts[j] > begin_ts:
                    diff = min((rec_store_ts[j] - begin_ts) // 1000, 0x7FFFFFFF)
                if _be32(buf, p + 12) != diff:
                    status[i] = ENTRY_WRONG_TIME
        else:
            status[i] = ENTRY_EXPIRED if phy < log_min else ENTRY_NO_RECORD
    return status


CHAINS_FINE, CHAIN_BAD_HASH, CHAIN_BAD_LINK, CHAIN_BAD_SLOT = 0, 1, 2, 3


@njit(cache=True, nogil=True)
def chain_mismatch(buf, slot_num, index_num, count, live):
    """Where the file's links differ from the ones its entries' order makes, as (``CHAIN_*``, entry or slot
    number, the value expected there): every writer (RocketMQ's ``putKey``, ``put_entries``, a repair) links
    each entry to the previous entry of its slot and leaves each slot naming its newest entry, so anything else
    is damage: a zeroed slot table (every key silently not found), a lost link (a chain cut short), a cycle.
    ``live``: slots past ``count`` are a writer's newer entries (their links are checked when counted)."""
    entries_at = 40 + slot_num * 4
    newest = np.zeros(slot_num, dtype=np.int32)
    for n in range(1, count):
        p = entries_at + n * _ENTRY
        h = _be32(buf, p)
        if h < 0:  # keyHash is non-negative (Math.abs, MIN_VALUE -> 0)
            return CHAIN_BAD_HASH, n, 0
        s = h % slot_num
        if _be32(buf, p + 16) != newest[s]:
            return CHAIN_BAD_LINK, n, newest[s]
        newest[s] = n
    for s in range(slot_num):
        v = _be32(buf, 40 + s * 4)
        if v != newest[s] and not (live and count <= v < index_num):
            return CHAIN_BAD_SLOT, s, newest[s]
    return CHAINS_FINE, 0, 0

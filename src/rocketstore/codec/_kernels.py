"""numba kernels of the batch decoder (``codec/batch.py``): the loops that are sequential by nature.

Every kernel takes the segment as one read-only ``uint8`` array and plain int64 position arrays,
so each compiles once (``cache=True`` keeps the machine code in ``__pycache__`` across processes)
and releases the GIL (``nogil=True``), letting Spark's Python workers or a caller's threads decode
ranges side by side. The layout constants come from ``record.py``: numba freezes module globals
at compile time, so this file holds no second copy of the format.

CRC-32 of a short body (under ``ZLIB_CRC_MIN`` bytes) is table-driven slicing-by-8 in compiled code;
a longer one calls zlib's ``crc32`` from the loop (``numba.types.ExternalFunction``), whose per-call
set-up costs more than it saves on short input. Measured here, GB/s, table against zlib: 100 B 2.2 / 1.0,
256 B 2.25 / 1.96, 320 B 2.2 / 2.9, 1 KiB 2.2 / 3.9, 4 KiB 2.2 / 5.8. zlib's function is registered with
LLVM under a name of rocketstore's own when this module loads, so cached machine code refers to it by
that name and is linked to wherever libz is mapped in each process, never to a baked address.

Byte runs (bodies, topics, properties) are copied by the C library's ``memmove``, registered the same way:
numba's slice assignment builds two array views and a strided loop per copy, which was 40% of encoding a
10,000-row table of 100-byte bodies (1.71 -> 0.99 ms with memmove). Raw copies check no bounds, so every
caller checks its offsets against its buffers first.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import zlib

import numpy as np
from numba import njit, types

from ..message import SysFlag
from ._numba_cache import install as _install_cache_locator
from .record import FIXED_PART_LEN, MAGIC_V1, MAGIC_V2, MIN_RECORD_LEN, PHY_OFFSET_POS, SYSFLAG_POS, V6_EXTRA_LEN

# rows of the field matrix ``walk`` fills: one int64 per record and field
F_POS, F_SIZE, F_MAGIC, F_CRC, F_QUEUE_ID, F_FLAG, F_QUEUE_OFFSET, F_PHY_OFFSET, F_SYS_FLAG, F_BORN_TS = range(10)
F_BORN_HOST, F_STORE_TS, F_STORE_HOST, F_RECONSUME, F_PREPARED, F_BODY_POS, F_BODY_LEN = range(10, 17)
F_TOPIC_POS, F_TOPIC_LEN, F_PROPS_POS, F_PROPS_LEN = range(17, 21)
N_FIELDS = 21

_install_cache_locator()  # before the first cache=True function: a stable cache when shipped in a zip

_BORN_V6 = 0x10
_STORE_V6 = 0x20
_BODY_LEN_POS = FIXED_PART_LEN - 4


def _crc_table() -> np.ndarray:
    """Slicing-by-8 tables of the reflected IEEE polynomial (what zlib.crc32 computes)."""
    table = np.zeros((8, 256), dtype=np.uint32)
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0xEDB88320 if c & 1 else c >> 1
        table[0, i] = c
    for i in range(256):
        c = int(table[0, i])
        for k in range(1, 8):
            c = int(table[0, c & 0xFF]) ^ (c >> 8)
            table[k, i] = c
    return table


CRC_TABLE = _crc_table()
ZLIB_CRC_MIN = 320  # bytes from which zlib's crc32 beats the table (see above)
_ZLIB_CRC32_SYMBOL = "rocketstore_zlib_crc32"


def _register_zlib_crc32() -> None:
    """Make zlib's ``crc32`` (the library Python's ``zlib`` module uses) callable from compiled code."""
    import llvmlite.binding as llvm

    def candidates():  # the usual soname first: find_library runs ldconfig (~16 ms of start-up)
        yield "libz.so.1"
        yield getattr(zlib, "__file__", None)  # the module's own link to libz
        yield ctypes.util.find_library("z")

    for name in candidates():
        if not name:
            continue
        try:
            function = ctypes.CDLL(name).crc32
        except (OSError, AttributeError):
            continue
        llvm.add_symbol(_ZLIB_CRC32_SYMBOL, ctypes.cast(function, ctypes.c_void_p).value)
        return
    raise ImportError("rocketstore needs zlib's shared library (libz) for its compiled CRC-32")


_register_zlib_crc32()
_zlib_crc32 = types.ExternalFunction(_ZLIB_CRC32_SYMBOL, types.uint64(types.uint64, types.voidptr, types.uint32))

_MEMMOVE_SYMBOL = "rocketstore_memmove"


def _register_memmove() -> None:
    """The C library's ``memmove`` (ctypes exports its address on every platform), callable from kernels."""
    import llvmlite.binding as llvm

    llvm.add_symbol(_MEMMOVE_SYMBOL, ctypes.cast(ctypes.memmove, ctypes.c_void_p).value)


_register_memmove()
_memmove = types.ExternalFunction(_MEMMOVE_SYMBOL, types.voidptr(types.voidptr, types.voidptr, types.uint64))


@njit(cache=True, nogil=True, inline="always")
def _contiguous(a):
    """What ``_copy`` needs of an array: its bytes back to back (an empty one may have a zero stride)."""
    return a.size < 2 or a.strides[0] == 1


@njit(cache=True, nogil=True, inline="always")
def _copy(dst, d, src, s, n):
    """``dst[d:d+n] = src[s:s+n]`` for 1-D contiguous uint8 arrays, unchecked: the caller has checked the bounds."""
    if n > 0:
        _memmove(dst.ctypes.data + d, src.ctypes.data + s, np.uint64(n))


@njit(cache=True, nogil=True, inline="always")
def _be16(buf, p):
    v = (np.int64(buf[p]) << 8) | np.int64(buf[p + 1])
    return v - 65536 if v >= 32768 else v


@njit(cache=True, nogil=True, inline="always")
def _be32(buf, p):
    v = (np.int64(buf[p]) << 24) | (np.int64(buf[p + 1]) << 16) | (np.int64(buf[p + 2]) << 8) | np.int64(buf[p + 3])
    return v - 4294967296 if v >= 2147483648 else v


@njit(cache=True, nogil=True, inline="always")
def _be64(buf, p):
    v = np.uint64(0)
    for k in range(8):
        v = (v << np.uint64(8)) | np.uint64(buf[p + k])
    return np.int64(v)


@njit(cache=True, nogil=True)
def crc32(buf, p, n):
    """zlib.crc32 of ``buf[p:p+n]`` (unmasked, as an int64)."""
    if n >= ZLIB_CRC_MIN:
        z = np.uint64(0)
        while n > 0:  # zlib takes a 32-bit length
            step = min(n, 1 << 30)
            z = _zlib_crc32(z, buf[p:].ctypes.data, np.uint32(step))
            p += step
            n -= step
        return np.int64(z)
    t = CRC_TABLE
    c = np.uint32(0xFFFFFFFF)
    e = p + n
    i = p
    while i + 8 <= e:
        lo = c ^ (np.uint32(buf[i]) | (np.uint32(buf[i + 1]) << 8) | (np.uint32(buf[i + 2]) << 16)
                  | (np.uint32(buf[i + 3]) << 24))
        hi = np.uint32(buf[i + 4]) | (np.uint32(buf[i + 5]) << 8) | (np.uint32(buf[i + 6]) << 16) \
            | (np.uint32(buf[i + 7]) << 24)
        c = (t[7, lo & 0xFF] ^ t[6, (lo >> 8) & 0xFF] ^ t[5, (lo >> 16) & 0xFF] ^ t[4, lo >> 24]
             ^ t[3, hi & 0xFF] ^ t[2, (hi >> 8) & 0xFF] ^ t[1, (hi >> 16) & 0xFF] ^ t[0, hi >> 24])
        i += 8
    while i < e:
        c = t[0, (c ^ buf[i]) & 0xFF] ^ (c >> 8)
        i += 1
    return np.int64(c ^ np.uint32(0xFFFFFFFF))


@njit(cache=True, nogil=True, inline="always")
def _put_be32(buf, p, v):
    buf[p] = (v >> 24) & 0xFF
    buf[p + 1] = (v >> 16) & 0xFF
    buf[p + 2] = (v >> 8) & 0xFF
    buf[p + 3] = v & 0xFF


@njit(cache=True, nogil=True, inline="always")
def _put_be64(buf, p, v):
    u = np.uint64(v)
    for k in range(8):
        buf[p + 7 - k] = np.uint8(u & np.uint64(0xFF))
        u = u >> np.uint64(8)


@njit(cache=True)
def stamp_records(data, sizes, store_ts_pos, queue_offsets, phy, store_ts):
    """Fill the three fields known only under the put lock into records back to back in ``data``: each one's
    queue offset, its physical offset (``phy`` for the first) and the store time at ``store_ts_pos[i]``. Holds
    the GIL: it runs for a microsecond under the put lock (~30 us for a 10,000-row ``put_batch``), and giving
    the GIL up there hands it to another thread for up to a switch interval. Returns the bytes covered, or -1
    (nothing written past ``data``) when a record would run past the end or is too short to hold its fields."""
    p = 0
    for i in range(sizes.size):
        if p + sizes[i] > data.size or sizes[i] < store_ts_pos[i] + 8 or store_ts_pos[i] < 36:
            return -1
        _put_be64(data, p + 20, queue_offsets[i])
        _put_be64(data, p + 28, phy + p)
        _put_be64(data, p + store_ts_pos[i], store_ts)
        p += sizes[i]
    return p


@njit(cache=True, nogil=True)
def queue_groups(keys):
    """Number the distinct ``keys`` (a batch's topic and queue of each row, packed in an int64) in order of first
    appearance and rank each row within its key: returns (group per row, rank per row, the keys by group, rows
    per group). A row's queue offset is then its queue's next offset plus its rank: one pass over the rows
    where numpy needed a stable argsort, a gather and a scatter."""
    n = keys.size
    cap = 16
    while cap < 2 * n:
        cap *= 2
    slot_group = np.full(cap, -1, dtype=np.int64)
    group_keys = np.empty(n, dtype=np.int64)
    counts = np.zeros(n, dtype=np.int64)
    group = np.empty(n, dtype=np.int64)
    rank = np.empty(n, dtype=np.int64)
    groups = 0
    mask = cap - 1
    for i in range(n):
        key = keys[i]
        h = (np.uint64(key) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(40)
        s = np.int64(h) & mask
        while True:
            g = slot_group[s]
            if g < 0:
                g = groups
                groups += 1
                slot_group[s] = g
                group_keys[g] = key
                break
            if group_keys[g] == key:
                break
            s = (s + 1) & mask
        group[i] = g
        rank[i] = counts[g]
        counts[g] += 1
    return group, rank, group_keys[:groups], counts[:groups]


@njit(cache=True, nogil=True)
def encode_v1(out, sizes, body_off, body_data, props_off, props_data, topic_off, topic_data, topic_index, queue_ids,
              flags, born_ts, born_hosts, store_host):
    """``_encode_v1`` for ``put_batch``: it releases the GIL, so dispatch runs beside a table's encoding."""
    return _encode_v1(out, sizes, body_off, body_data, props_off, props_data, topic_off, topic_data, topic_index,
                      queue_ids, flags, born_ts, born_hosts, store_host)


_HEX_DIGITS = np.frombuffer(b"0123456789ABCDEF", dtype=np.uint8).copy()
_PLAIN_V1_OVERHEAD = FIXED_PART_LEN + 1 + 2  # two IPv4 hosts, a one-byte topic length, the properties length
_PLAIN_UNIQ = np.frombuffer(b"UNIQ_KEY\x01", dtype=np.uint8).copy()
_PLAIN_TAGS = np.frombuffer(b"TAGS\x01", dtype=np.uint8).copy()
_PLAIN_KEYS = np.frombuffer(b"KEYS\x01", dtype=np.uint8).copy()
PLAIN_PROPS_FIXED = _PLAIN_UNIQ.size + 4 + 1  # UNIQ_KEY\x01, the head, 4 counter digits, \x02
PLAIN_PROP_OVERHEAD = _PLAIN_TAGS.size + 1  # a TAGS or KEYS name, \x01 and \x02 around a value


@njit(cache=True, nogil=True, inline="always")
def _put_plain_prop(props, p, name, blob, start, length):
    """``name`` (with its \x01), ``length`` bytes of ``blob`` from ``start``, and \x02; returns the next position."""
    props[p : p + name.size] = name
    p += name.size
    _copy(props, p, blob, start, length)
    p += length
    props[p] = 2
    return p + 1


@njit(cache=True)
def encode_plain_v1(out, meta, blob, n, topics):
    """``_encode_v1`` for ``put_messages``, fed from Python lists at the least cost: three arrays, as a dispatch
    costs ~0.5 us per array argument. ``meta`` (int64) holds the inputs, seven runs of ``n``: body lengths, tags'
    and joined keys' byte lengths (0: none), topic codes, queue ids, flags, born times; then the ``topics``
    topics' byte lengths, the first UNIQ_KEY counter, how many zero bytes end each properties string (room for
    the property CRC) and the length of the UNIQ_KEYs' head; and room for the outputs: each record's size
    (``n``), each topic's highest queue id (``topics``). ``blob`` is the bodies, tags, joined keys, topics, born
    hosts (8 bytes each), the store host and the UNIQ_KEYs' shared head (ASCII hex), back to back. A row's
    properties string is built here: UNIQ_KEY (the head and the 4 hex digits of (first + row) & 0xFFFF), TAGS
    and KEYS when present, then the zeros; in Python (a string per id and per properties string, then encoded)
    that was a sixth of a put of 32. Returns the bytes written, or -1 (``out`` untouched past its end) when the
    lengths and ``blob`` disagree or a properties string would pass 32767 bytes. Holds the GIL, as
    ``stamp_records`` does: a producer giving the GIL up for ~10 us gets it back only after the dispatcher
    thread's next pause (a switch interval when it runs Python; measured with the loop this replaced, stop 31:
    put_messages(32) 286 -> 310 k msg/s holding it)."""
    if n < 0 or topics < 0 or meta.size != 8 * n + 2 * topics + 3:
        return -1
    body_len = meta[0:n]
    tag_len = meta[n : 2 * n]
    key_len = meta[2 * n : 3 * n]
    codes = meta[3 * n : 4 * n]
    first = meta[7 * n + topics]
    reserve = meta[7 * n + topics + 1]
    head = meta[7 * n + topics + 2]
    sizes = meta[7 * n + topics + 3 : 8 * n + topics + 3]
    highest = meta[8 * n + topics + 3 :]
    topic_off = np.empty(topics + 1, dtype=np.int64)
    topic_off[0] = 0
    for t in range(topics):
        if meta[7 * n + t] < 0:
            return -1
        topic_off[t + 1] = topic_off[t] + meta[7 * n + t]
        highest[t] = -1
    body_off = np.empty(n + 1, dtype=np.int64)
    tag_off = np.empty(n + 1, dtype=np.int64)
    key_off = np.empty(n + 1, dtype=np.int64)
    props_off = np.empty(n + 1, dtype=np.int64)
    body_off[0] = 0
    tag_off[0] = 0
    key_off[0] = 0
    props_off[0] = 0
    for i in range(n):
        if body_len[i] < 0 or tag_len[i] < 0 or key_len[i] < 0:
            return -1
        body_off[i + 1] = body_off[i] + body_len[i]
        tag_off[i + 1] = tag_off[i] + tag_len[i]
        key_off[i + 1] = key_off[i] + key_len[i]
    b = body_off[n]
    g = b + tag_off[n]
    k = g + key_off[n]
    t = k + topic_off[topics]
    if reserve < 0 or first < 0 or first > 0xFFFF or head <= 0 or blob.size != t + 8 * n + 8 + head:
        return -1
    for i in range(n):
        topic = codes[i]
        if topic < 0 or topic >= topics:
            return -1
        highest[topic] = max(highest[topic], meta[4 * n + i])
        size = PLAIN_PROPS_FIXED + head + reserve
        if tag_len[i]:
            size += PLAIN_PROP_OVERHEAD + tag_len[i]
        if key_len[i]:
            size += PLAIN_PROP_OVERHEAD + key_len[i]
        if size > 0x7FFF:  # the record's properties length is a short
            return -1
        props_off[i + 1] = props_off[i] + size
        sizes[i] = _PLAIN_V1_OVERHEAD + body_len[i] + topic_off[topic + 1] - topic_off[topic] + size
    props = np.empty(props_off[n], dtype=np.uint8)
    h0 = t + 8 * n + 8
    for i in range(n):
        p = props_off[i]
        props[p : p + _PLAIN_UNIQ.size] = _PLAIN_UNIQ
        p += _PLAIN_UNIQ.size
        _copy(props, p, blob, h0, head)
        p += head
        counter = (first + i) & 0xFFFF
        for shift in (12, 8, 4, 0):
            props[p] = _HEX_DIGITS[(counter >> shift) & 0xF]
            p += 1
        props[p] = 2
        p += 1
        if tag_len[i]:
            p = _put_plain_prop(props, p, _PLAIN_TAGS, blob, b + tag_off[i], tag_len[i])
        if key_len[i]:
            p = _put_plain_prop(props, p, _PLAIN_KEYS, blob, g + key_off[i], key_len[i])
        for z in range(reserve):
            props[p + z] = 0
    return _encode_v1(out, sizes, body_off, blob[:b], props_off, props, topic_off, blob[k:t], codes,
                      meta[4 * n : 5 * n], meta[5 * n : 6 * n], meta[6 * n : 7 * n],
                      blob[t : t + 8 * n].reshape((n, 8)), blob[t + 8 * n : h0])


@njit(cache=True, nogil=True, inline="always")
def _encode_v1(out, sizes, body_off, body_data, props_off, props_data, topic_off, topic_data, topic_index, queue_ids,
               flags, born_ts, born_hosts, store_host):
    """Records back to back into ``out`` for the common layout (IPv4 hosts, one-byte topic lengths): the fixed
    88 bytes (queue offset, physical offset and store time left zero for the append to fill), body, topic and
    properties, with the 31-bit body CRC computed on the way. The columns are Arrow buffers (data + offsets);
    ``born_hosts`` is (n, 8 or more), a row's first 8 bytes used. Returns the bytes written, or -1 (nothing past
    ``out``'s end touched) when a record's pieces do not add up to its size, an offset or topic code lies
    outside its buffer, a column is shorter than ``sizes`` or a byte buffer is not contiguous."""
    n = sizes.size
    topics = topic_off.size - 1
    if not (_contiguous(out) and _contiguous(body_data) and _contiguous(topic_data) and _contiguous(props_data)):
        return -1
    if (body_off.size <= n or props_off.size <= n or topic_index.size < n or queue_ids.size < n or flags.size < n
            or born_ts.size < n or born_hosts.shape[0] < n or born_hosts.shape[1] < 8 or store_host.size < 8
            or topics < 0 or topic_off[0] < 0 or topic_off[topics] > topic_data.size):
        return -1
    for t in range(topics):
        if topic_off[t + 1] < topic_off[t]:
            return -1
    p = 0
    for i in range(n):
        b0, b1 = body_off[i], body_off[i + 1]
        r0, r1 = props_off[i], props_off[i + 1]
        ti = topic_index[i]
        if (b0 < 0 or b1 < b0 or b1 > body_data.size or r0 < 0 or r1 < r0 or r1 > props_data.size
                or ti < 0 or ti >= topics):
            return -1
        body_len = b1 - b0
        t0, t1 = topic_off[ti], topic_off[ti + 1]
        if 88 + body_len + 1 + t1 - t0 + 2 + r1 - r0 != sizes[i] or p + sizes[i] > out.size:
            return -1
        _put_be32(out, p, sizes[i])
        _put_be32(out, p + 4, MAGIC_V1)
        _put_be32(out, p + 8, crc32(body_data, b0, body_len) & 0x7FFFFFFF if body_len > 0 else 0)
        _put_be32(out, p + 12, queue_ids[i])
        _put_be32(out, p + 16, flags[i])
        for k in range(20, 36):  # queue offset, physical offset: filled under the put lock
            out[p + k] = 0
        _put_be32(out, p + 36, 0)  # sys flag: IPv4 hosts, no transaction
        _put_be64(out, p + 40, born_ts[i])
        for k in range(8):
            out[p + 48 + k] = born_hosts[i, k]
        _put_be64(out, p + 56, 0)  # store time: filled under the put lock
        for k in range(8):
            out[p + 64 + k] = store_host[k]
        _put_be32(out, p + 72, 0)  # reconsume times
        _put_be64(out, p + 76, 0)  # prepared transaction offset
        _put_be32(out, p + 84, body_len)
        q = p + 88
        _copy(out, q, body_data, b0, body_len)
        q += body_len
        out[q] = t1 - t0
        _copy(out, q + 1, topic_data, t0, t1 - t0)
        q += 1 + t1 - t0
        out[q] = ((r1 - r0) >> 8) & 0xFF
        out[q + 1] = (r1 - r0) & 0xFF
        _copy(out, q + 2, props_data, r0, r1 - r0)
        p = q + 2 + r1 - r0
    return p


# the property names a plain row carries, by code: 0 UNIQ_KEY, 1 TAGS, 2 KEYS (``PropertyName``'s values)
_UNIQ_NAME = np.frombuffer(b"UNIQ_KEY", dtype=np.uint8).copy()
_TAGS_NAME = np.frombuffer(b"TAGS", dtype=np.uint8).copy()
_KEYS_NAME = np.frombuffer(b"KEYS", dtype=np.uint8).copy()


@njit(cache=True, nogil=True, inline="always")
def _put_name(out, p, name):
    out[p : p + name.size] = name
    out[p + name.size] = 1
    return p + name.size + 1


@njit(cache=True, nogil=True)
def plain_properties(uniq_raw, tags_off, tags_data, has_tags, list_off, key_off, key_data, has_keys, orders,
                     reserve):
    """Properties strings of rows without user properties, back to back: UNIQ_KEY (the 32 hex digits of the row
    of ``uniq_raw``), TAGS and KEYS (the row's keys joined by spaces) in the order ``orders[combo]`` gives for
    the names present (combo = 2 * has_tags + has_keys: the Java HashMap's order, computed by the caller), then
    ``reserve`` zero bytes (room for ``__CRC32#``). Strings are Arrow buffers: data and offsets, the keys a
    list of strings (``list_off`` into ``key_off``). Returns (offsets int64 [n + 1], data)."""
    n = uniq_raw.shape[0]
    if not (_contiguous(tags_data) and _contiguous(key_data)):
        raise ValueError("plain_properties takes contiguous string data")
    offsets = np.empty(n + 1, dtype=np.int64)
    offsets[0] = 0
    for i in range(n):
        if has_tags[i] and not 0 <= tags_off[i] <= tags_off[i + 1] <= tags_data.size:
            raise ValueError("a tags offset lies outside its Arrow buffer")
        if has_keys[i]:
            for j in range(list_off[i], list_off[i + 1]):
                if not 0 <= key_off[j] <= key_off[j + 1] <= key_data.size:
                    raise ValueError("a key offset lies outside its Arrow buffer")
        size = _UNIQ_NAME.size + 2 + 2 * uniq_raw.shape[1] + reserve
        if has_tags[i]:
            size += _TAGS_NAME.size + 2 + tags_off[i + 1] - tags_off[i]
        if has_keys[i]:
            k0, k1 = list_off[i], list_off[i + 1]
            size += _KEYS_NAME.size + 2 + key_off[k1] - key_off[k0] + k1 - k0 - 1
        offsets[i + 1] = offsets[i] + size
    out = np.empty(offsets[n], dtype=np.uint8)
    for i in range(n):
        p = offsets[i]
        combo = (2 if has_tags[i] else 0) + (1 if has_keys[i] else 0)
        for slot in range(orders.shape[1]):
            name = orders[combo, slot]
            if name == 0:
                p = _put_name(out, p, _UNIQ_NAME)
                for k in range(uniq_raw.shape[1]):
                    out[p] = _HEX_DIGITS[uniq_raw[i, k] >> 4]
                    out[p + 1] = _HEX_DIGITS[uniq_raw[i, k] & 0x0F]
                    p += 2
            elif name == 1:
                p = _put_name(out, p, _TAGS_NAME)
                t0, t1 = tags_off[i], tags_off[i + 1]
                _copy(out, p, tags_data, t0, t1 - t0)
                p += t1 - t0
            elif name == 2:
                p = _put_name(out, p, _KEYS_NAME)
                for j in range(list_off[i], list_off[i + 1]):
                    if j > list_off[i]:
                        out[p] = 32
                        p += 1
                    a, b = key_off[j], key_off[j + 1]
                    _copy(out, p, key_data, a, b - a)
                    p += b - a
            else:
                continue
            out[p] = 2
            p += 1
        for _ in range(reserve):
            out[p] = 0
            p += 1
    return offsets, out


@njit(cache=True)
def put_queue_units(buf, pos, room, queue_offsets, phy, sizes, tags, i):
    """Write consume-queue units (phy i64, size i32, tags i64, big-endian) at ``buf[pos:]`` for rows ``i``,
    ``i + 1``, ... while their queue offsets run on by one and ``room`` units fit; returns how many. Offsets and
    tags codes go in first and the sizes after, so a unit a kill tears in the middle keeps size 0 (invalid).
    Holds the GIL, as ``plan_dispatch`` does: a few microseconds of work, where giving the GIL up would cost the
    dispatcher up to a switch interval to get it back from a producer running Python."""
    n = min(queue_offsets.size - i, room)
    count = 1 if n > 0 else 0
    while count < n and queue_offsets[i + count] == queue_offsets[i + count - 1] + 1:
        count += 1
    for u in range(count):
        p = pos + 20 * u
        _put_be64(buf, p, phy[i + u])
        _put_be32(buf, p + 8, 0)
        _put_be64(buf, p + 12, tags[i + u])
    for u in range(count):
        _put_be32(buf, pos + 20 * u + 8, sizes[i + u])
    return count


@njit(cache=True, nogil=True)
def first_bad_text(offsets, data, check, forbid_space, allow_empty):
    """The first string ``j`` with ``check[j]`` (``data[offsets[j]:offsets[j+1]]``) that holds a property
    separator (\\x01, \\x02), with ``forbid_space`` a space (the KEYS separator), or unless ``allow_empty`` is
    empty; -1 if none."""
    for j in range(check.size):
        if not check[j]:
            continue
        a, b = offsets[j], offsets[j + 1]
        if a == b and not allow_empty:
            return j
        for p in range(a, b):
            c = data[p]
            if c == 1 or c == 2 or (forbid_space and c == 32):  # noqa: PLR1714 - plain compares compile best
                return j
    return -1


@njit(cache=True, nogil=True, inline="always")
def _parse(buf, pos, limit, check_crc):
    """The checks of ``record.read_layout``, in its order, for the record at ``pos``: returns its end and
    the positions the walk keeps, with end -1 when ``read_layout`` would not accept it."""
    bad = (-1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    if limit - pos < 8:
        return bad
    size = _be32(buf, pos)
    magic = _be32(buf, pos + 4)
    if magic != MAGIC_V1 and magic != MAGIC_V2:  # noqa: PLR1714 - plain compares compile best
        return bad
    if size < MIN_RECORD_LEN or size > limit - pos:
        return bad
    stop = pos + size
    sys_flag = _be32(buf, pos + SYSFLAG_POS)
    born_extra = V6_EXTRA_LEN if sys_flag & _BORN_V6 else 0
    store_extra = V6_EXTRA_LEN if sys_flag & _STORE_V6 else 0
    body_len_pos = pos + _BODY_LEN_POS + born_extra + store_extra
    if body_len_pos + 4 > stop:
        return bad
    body_len = _be32(buf, body_len_pos)
    body_pos = body_len_pos + 4
    if body_len < 0 or body_pos + body_len > stop:
        return bad
    topic_len_pos = body_pos + body_len
    if magic == MAGIC_V2:
        if topic_len_pos + 2 > stop:
            return bad
        topic_len = _be16(buf, topic_len_pos)
        topic_pos = topic_len_pos + 2
    else:
        if topic_len_pos + 1 > stop:
            return bad
        topic_len = np.int64(buf[topic_len_pos])
        if topic_len > 127:
            topic_len -= 256
        topic_pos = topic_len_pos + 1
    if topic_len < 0 or topic_pos + topic_len + 2 > stop:
        return bad
    props_len = _be16(buf, topic_pos + topic_len)
    props_pos = topic_pos + topic_len + 2
    if props_len < 0 or props_pos + props_len != stop:
        return bad
    crc = _be32(buf, pos + 8)
    if check_crc and body_len > 0 and (crc32(buf, body_pos, body_len) & 0x7FFFFFFF) != crc:
        return bad
    return (stop, magic, crc, sys_flag, born_extra, body_len_pos, body_len, topic_pos, topic_len, props_pos,
            props_len, size)


@njit(cache=True, nogil=True)
def walk(buf, pos, end, limit, check_crc, max_rows, max_bytes):
    """Validate records from ``pos`` while they start before ``end`` and fit before ``limit``.

    Checks exactly what ``record.read_layout`` checks, in the same order, and stops at the first
    record it would not accept (the caller asks ``read_layout`` why), after ``max_rows`` records
    or once ``max_bytes`` were consumed. Returns (field matrix [N_FIELDS, rows], rows, stop position).
    """
    cap = min(max_rows, (end - pos) // MIN_RECORD_LEN + 1)
    f = np.empty((N_FIELDS, max(cap, 0)), dtype=np.int64)
    first = pos
    n = 0
    while pos < end and n < max_rows and pos - first < max_bytes:
        (stop, magic, crc, sys_flag, born_extra, body_len_pos, body_len, topic_pos, topic_len, props_pos,
         props_len, size) = _parse(buf, pos, limit, check_crc)
        if stop < 0:
            break
        _fill(f, n, buf, pos, magic, crc, sys_flag, born_extra, body_len_pos, body_len, topic_pos, topic_len,
              props_pos, props_len, size)
        n += 1
        pos = stop
    return f, n, pos


@njit(cache=True, nogil=True, inline="always")
def _fill(f, n, buf, pos, magic, crc, sys_flag, born_extra, body_len_pos, body_len, topic_pos, topic_len, props_pos,
          props_len, size):
    """Column ``n`` of the field matrix for the record ``_parse`` accepted at ``pos``."""
    store_ts_pos = pos + 48 + 8 + born_extra
    f[F_POS, n] = pos
    f[F_SIZE, n] = size
    f[F_MAGIC, n] = magic
    f[F_CRC, n] = crc
    f[F_QUEUE_ID, n] = _be32(buf, pos + 12)
    f[F_FLAG, n] = _be32(buf, pos + 16)
    f[F_QUEUE_OFFSET, n] = _be64(buf, pos + 20)
    f[F_PHY_OFFSET, n] = _be64(buf, pos + PHY_OFFSET_POS)
    f[F_SYS_FLAG, n] = sys_flag
    f[F_BORN_TS, n] = _be64(buf, pos + 40)
    f[F_BORN_HOST, n] = pos + 48
    f[F_STORE_TS, n] = _be64(buf, store_ts_pos)
    f[F_STORE_HOST, n] = store_ts_pos + 8
    f[F_RECONSUME, n] = _be32(buf, body_len_pos - 12)
    f[F_PREPARED, n] = _be64(buf, body_len_pos - 8)
    f[F_BODY_POS, n] = body_len_pos + 4
    f[F_BODY_LEN, n] = body_len
    f[F_TOPIC_POS, n] = topic_pos
    f[F_TOPIC_LEN, n] = topic_len
    f[F_PROPS_POS, n] = props_pos
    f[F_PROPS_LEN, n] = props_len


@njit(cache=True, nogil=True)
def parse_at(buf, positions, limit, base, check_crc):
    """``walk`` for scattered records (``CommitLog.locate`` at each position): the field matrix of those that
    ``read_layout`` accepts and whose PHYSICALOFFSET field says ``base + position``; others are left out."""
    f = np.empty((N_FIELDS, positions.size), dtype=np.int64)
    n = 0
    for i in range(positions.size):
        pos = positions[i]
        if pos < 0 or pos >= limit:
            continue
        (stop, magic, crc, sys_flag, born_extra, body_len_pos, body_len, topic_pos, topic_len, props_pos,
         props_len, size) = _parse(buf, pos, limit, check_crc)
        if stop < 0 or _be64(buf, pos + PHY_OFFSET_POS) != base + pos:
            continue
        _fill(f, n, buf, pos, magic, crc, sys_flag, born_extra, body_len_pos, body_len, topic_pos, topic_len,
              props_pos, props_len, size)
        n += 1
    return f, n


@njit(cache=True, nogil=True)
def validate(buf, pos, end, check_crc, base):
    """``walk`` without keeping fields, for recovery's pass over whole segments: returns (position of the first
    record ``read_layout`` would not accept, records accepted, start of the last accepted record or -1).
    With ``base`` >= 0 (the buffer's offset in the log) a record's PHYSICALOFFSET field must say where it is."""
    n = 0
    last = -1
    while pos < end:
        stop = _parse(buf, pos, end, check_crc)[0]
        if stop < 0 or (base >= 0 and _be64(buf, pos + PHY_OFFSET_POS) != base + pos):
            break
        last = pos
        n += 1
        pos = stop
    return pos, n, last


@njit(cache=True, nogil=True)
def _utf8_ok(buf, p, n):
    """Whether ``buf[p:p+n]`` is well-formed UTF-8 (exactly what Python's strict decoder accepts)."""
    e = p + n
    high = 0
    for i in range(p, e):  # the common case, all ASCII: one branch-free (vectorised) pass
        high |= buf[i]
    if high < 0x80:
        return True
    i = p
    while i < e:
        c = buf[i]
        if c < 0x80:
            i += 1
            continue
        if 0xC2 <= c <= 0xDF:
            need, lo, hi = 1, 0x80, 0xBF
        elif c == 0xE0:
            need, lo, hi = 2, 0xA0, 0xBF
        elif 0xE1 <= c <= 0xEC or c == 0xEE or c == 0xEF:  # noqa: PLR1714
            need, lo, hi = 2, 0x80, 0xBF
        elif c == 0xED:
            need, lo, hi = 2, 0x80, 0x9F
        elif c == 0xF0:
            need, lo, hi = 3, 0x90, 0xBF
        elif 0xF1 <= c <= 0xF3:
            need, lo, hi = 3, 0x80, 0xBF
        elif c == 0xF4:
            need, lo, hi = 3, 0x80, 0x8F
        else:
            return False
        if i + need >= e:
            return False
        if not lo <= buf[i + 1] <= hi:
            return False
        for k in range(2, need + 1):
            if not 0x80 <= buf[i + k] <= 0xBF:
                return False
        i += need + 1
    return True


@njit(cache=True, nogil=True)
def text_ok(buf, f, n):
    """Per record: topic and properties are valid UTF-8 (otherwise the record codec's 'replace' decode applies)."""
    ok = np.empty(n, dtype=np.bool_)
    for r in range(n):
        ok[r] = _utf8_ok(buf, f[F_TOPIC_POS, r], f[F_TOPIC_LEN, r]) and \
            _utf8_ok(buf, f[F_PROPS_POS, r], f[F_PROPS_LEN, r])
    return ok


@njit(cache=True, nogil=True)
def gather(buf, starts, lengths):
    """Copy ``buf[starts[i]:starts[i]+lengths[i]]`` end to end: Arrow offsets (int32) and data.

    A negative start is a null row (zero bytes).
    """
    n = starts.size
    offsets = np.empty(n + 1, dtype=np.int32)
    total = 0
    offsets[0] = 0
    for i in range(n):
        if starts[i] >= 0:
            total += lengths[i]
        offsets[i + 1] = total
    data = np.empty(total, dtype=np.uint8)
    if not _contiguous(buf):
        raise ValueError("gather takes a contiguous buffer")
    o = 0
    for i in range(n):
        s = starts[i]
        if s >= 0:
            m = lengths[i]
            if m < 0 or s + m > buf.size:
                raise ValueError("gather: a run lies outside the buffer")
            _copy(data, o, buf, s, m)  # 3 ns for 8 bytes, where a byte loop took 9 and a slice copy more
            o += m
    return offsets, data


@njit(cache=True, nogil=True)
def _same(buf, a, b, n):
    for k in range(n):  # noqa: SIM110 - numba compiles no generators
        if buf[a + k] != buf[b + k]:
            return False
    return True


@njit(cache=True, nogil=True, inline="always")
def _is_name(buf, p, n, name):
    if n != name.size:
        return False
    for k in range(n):  # noqa: SIM110 - numba compiles no generators
        if buf[p + k] != name[k]:
            return False
    return True


@njit(cache=True, nogil=True)
def parse_properties(buf, props_pos, props_len, uniq_name, tags_name, keys_name):
    """``decode_properties`` over bytes, every record at once.

    Pieces end at ``\\x02``; a piece is a pair when its first ``\\x01`` lies strictly after its start
    and before its last byte; a repeated name keeps its first place and its last value (a Python
    dict's behaviour). The separators are ASCII, so byte and character positions split alike.
    Returns pair offsets per record, the pairs' key/value positions, and the UNIQ_KEY, TAGS and
    KEYS values per record (position -1 when absent).
    """
    n = props_pos.size
    cap = 0
    for r in range(n):
        cap += props_len[r] // 3 + 1
    key_pos = np.empty(cap, dtype=np.int64)
    key_len = np.empty(cap, dtype=np.int64)
    val_pos = np.empty(cap, dtype=np.int64)
    val_len = np.empty(cap, dtype=np.int64)
    offsets = np.empty(n + 1, dtype=np.int32)
    found = np.full((3, n), -1, dtype=np.int64)
    found_len = np.zeros((3, n), dtype=np.int64)
    total = 0
    offsets[0] = 0
    for r in range(n):
        first = total
        piece = props_pos[r]
        e = piece + props_len[r]
        sep = -1
        for i in range(piece, e + 1):
            c = buf[i] if i < e else 2
            if c == 1:
                if sep < 0:
                    sep = i
                continue
            if c != 2:
                continue
            if piece < sep < i - 1:
                klen = sep - piece
                dup = -1
                for q in range(first, total):
                    if key_len[q] == klen and _same(buf, key_pos[q], piece, klen):
                        dup = q
                        break
                q = total if dup < 0 else dup
                if dup < 0:
                    key_pos[q] = piece
                    key_len[q] = klen
                    total += 1
                val_pos[q] = sep + 1
                val_len[q] = i - sep - 1
                if _is_name(buf, piece, klen, uniq_name):
                    found[0, r], found_len[0, r] = sep + 1, i - sep - 1
                elif _is_name(buf, piece, klen, tags_name):
                    found[1, r], found_len[1, r] = sep + 1, i - sep - 1
                elif _is_name(buf, piece, klen, keys_name):
                    found[2, r], found_len[2, r] = sep + 1, i - sep - 1
            piece = i + 1
            sep = -1
        offsets[r + 1] = total
    return offsets, key_pos[:total], key_len[:total], val_pos[:total], val_len[:total], found, found_len


@njit(cache=True, nogil=True)
def find_properties(buf, props_pos, props_len, uniq_name, tags_name, keys_name):
    """``parse_properties``' last three results alone (where the UNIQ_KEY, TAGS and KEYS values are: the last
    value of a repeated name, position -1 when absent), without gathering every pair: what dispatch needs.
    The piece loop repeats ``parse_properties``' own: a shared scanner of one piece measured 2x slower (190,000
    records: 0.028 -> 0.048-0.059 s, inlined or not)."""
    n = props_pos.size
    found = np.full((3, n), -1, dtype=np.int64)
    found_len = np.zeros((3, n), dtype=np.int64)
    for r in range(n):
        piece = props_pos[r]
        e = piece + props_len[r]
        sep = -1
        for i in range(piece, e + 1):
            c = buf[i] if i < e else 2
            if c == 1:
                if sep < 0:
                    sep = i
                continue
            if c != 2:
                continue
            if piece < sep < i - 1:
                klen = sep - piece
                if _is_name(buf, piece, klen, uniq_name):
                    found[0, r], found_len[0, r] = sep + 1, i - sep - 1
                elif _is_name(buf, piece, klen, tags_name):
                    found[1, r], found_len[1, r] = sep + 1, i - sep - 1
                elif _is_name(buf, piece, klen, keys_name):
                    found[2, r], found_len[2, r] = sep + 1, i - sep - 1
            piece = i + 1
            sep = -1
    return found, found_len


@njit(cache=True, nogil=True)
def split_keys(buf, keys_pos, keys_len):
    """``split_keys`` of each KEYS value: the non-empty space-separated tokens (an absent value: none)."""
    n = keys_pos.size
    cap = 0
    for r in range(n):
        if keys_pos[r] >= 0:
            cap += keys_len[r] // 2 + 1
    tok_pos = np.empty(cap, dtype=np.int64)
    tok_len = np.empty(cap, dtype=np.int64)
    offsets = np.empty(n + 1, dtype=np.int32)
    offsets[0] = 0
    total = 0
    for r in range(n):
        p = keys_pos[r]
        if p >= 0:
            e = p + keys_len[r]
            i = p
            while i < e:
                j = i
                while j < e and buf[j] != 0x20:
                    j += 1
                if j > i:
                    tok_pos[total] = i
                    tok_len[total] = j - i
                    total += 1
                i = j + 1
        offsets[r + 1] = total
    return offsets, tok_pos[:total], tok_len[:total]


@njit(cache=True, nogil=True, inline="always")
def _put_int(out, o, value):
    """Write ``value`` in decimal at ``out[o]``; returns the new end."""
    if value < 0:
        out[o] = 45  # '-'
        o += 1
        value = -value
    digits = 1
    v = value
    while v >= 10:
        v //= 10
        digits += 1
    for k in range(digits - 1, -1, -1):
        out[o + k] = 48 + value % 10
        value //= 10
    return o + digits


@njit(cache=True, nogil=True)
def render_hosts(buf, host_pos, v6):
    """``str(Host)`` of each host: ``a.b.c.d:port`` or Java's eight lowercase hex groups and the port."""
    n = host_pos.size
    data = np.empty(n * 52, dtype=np.uint8)
    offsets = np.empty(n + 1, dtype=np.int32)
    offsets[0] = 0
    o = 0
    for r in range(n):
        p = host_pos[r]
        if v6[r]:
            for g in range(8):
                if g:
                    data[o] = 58  # ':'
                    o += 1
                group = (np.int64(buf[p + 2 * g]) << 8) | np.int64(buf[p + 2 * g + 1])
                started = False
                for shift in range(12, -1, -4):
                    d = (group >> shift) & 0xF
                    if d or started or shift == 0:
                        data[o] = 48 + d if d < 10 else 87 + d
                        o += 1
                        started = True
            port_at = p + 16
        else:
            for k in range(4):
                if k:
                    data[o] = 46  # '.'
                    o += 1
                o = _put_int(data, o, np.int64(buf[p + k]))
            port_at = p + 4
        data[o] = 58
        o += 1
        o = _put_int(data, o, _be32(buf, port_at))
        offsets[r + 1] = o
    return offsets, data[:o]


@njit(cache=True, nogil=True)
def render_msg_ids(buf, store_host_pos, v6, record_pos):
    """The offset msgId of each record: uppercase hex of the raw store host and the PHYSICALOFFSET bytes."""
    n = store_host_pos.size
    data = np.empty(n * 56, dtype=np.uint8)
    offsets = np.empty(n + 1, dtype=np.int32)
    offsets[0] = 0
    o = 0
    for r in range(n):
        host_len = 20 if v6[r] else 8
        for part in range(2):
            p = store_host_pos[r] if part == 0 else record_pos[r] + PHY_OFFSET_POS
            m = host_len if part == 0 else 8
            for k in range(m):
                b = buf[p + k]
                hi = b >> 4
                lo = b & 0xF
                data[o] = 48 + hi if hi < 10 else 55 + hi
                data[o + 1] = 48 + lo if lo < 10 else 55 + lo
                o += 2
        offsets[r + 1] = o
    return offsets, data[:o]


@njit(cache=True, nogil=True)
def _java_hash_utf8(buf, p, n, h):
    """Continue Java's ``String.hashCode`` (``h``, kept in [0, 2**32)) over the UTF-16 units of valid UTF-8."""
    i = p
    e = p + n
    while i < e:
        c = np.int64(buf[i])
        if c < 0x80:
            cp = c
            i += 1
        elif c < 0xE0:
            cp = ((c & 0x1F) << 6) | (np.int64(buf[i + 1]) & 0x3F)
            i += 2
        elif c < 0xF0:
            cp = ((c & 0x0F) << 12) | ((np.int64(buf[i + 1]) & 0x3F) << 6) | (np.int64(buf[i + 2]) & 0x3F)
            i += 3
        else:
            cp = (((c & 0x07) << 18) | ((np.int64(buf[i + 1]) & 0x3F) << 12)
                  | ((np.int64(buf[i + 2]) & 0x3F) << 6) | (np.int64(buf[i + 3]) & 0x3F))
            i += 4
        if cp >= 0x10000:  # a surrogate pair: two UTF-16 units
            cp -= 0x10000
            h = (h * 31 + (0xD800 + (cp >> 10))) & 0xFFFFFFFF
            h = (h * 31 + (0xDC00 + (cp & 0x3FF))) & 0xFFFFFFFF
        else:
            h = (h * 31 + cp) & 0xFFFFFFFF
    return h


@njit(cache=True, nogil=True, inline="always")
def _signed32(h):
    return h - 0x100000000 if h & 0x80000000 else h


@njit(cache=True, nogil=True)
def index_hashes_utf8(data, offsets, prefix, out):
    """``indexKeyHashMethod`` of ``prefix`` + each UTF-8 text ``data[offsets[i]:offsets[i+1]]`` (an Arrow string
    column's buffers) into ``out[i]``: Java's ``hashCode`` over UTF-16 units, |h|, Integer.MIN_VALUE -> 0."""
    n = offsets.size - 1
    for i in range(n):
        s = _signed32(_java_hash_utf8(data, offsets[i], offsets[i + 1] - offsets[i], prefix))
        out[i] = 0 if s == -0x80000000 else abs(s)
    return out


@njit(cache=True, nogil=True)
def index_key_hash_utf8(data):
    """``indexKeyHashMethod`` of one key given as its UTF-8 bytes (a query's ``topic#key``; lone surrogates as
    ``surrogatepass`` writes them): a query hashes its key on every call, 6x faster here than in Python."""
    s = _signed32(_java_hash_utf8(data, 0, len(data), np.int64(0)))
    return 0 if s == -0x80000000 else abs(s)


@njit(cache=True, nogil=True)
def text_hashes(buf, pos, length):
    """64-bit FNV-1a of each ``buf[pos:pos+length]``: grouping keys for short texts (topics) without Python."""
    n = pos.size
    out = np.empty(n, dtype=np.uint64)
    for r in range(n):
        h = np.uint64(0xCBF29CE484222325)
        for i in range(pos[r], pos[r] + length[r]):
            h = (h ^ np.uint64(buf[i])) * np.uint64(0x100000001B3)
        out[r] = h
    return out


@njit(cache=True, nogil=True)
def same_texts(buf, pos, length, rep_pos, rep_len):
    """Whether each text equals its representative's bytes (a check that grouping by hash was exact)."""
    for r in range(pos.size):  # noqa: SIM110 - a generator does not compile in nopython mode
        if length[r] != rep_len[r] or not _same(buf, pos[r], rep_pos[r], length[r]):
            return False
    return True


# rows of the matrix ``dispatch_walk`` fills: what a dispatch round needs of each record
D_POS, D_PHY, D_SIZE, D_QUEUE_ID, D_QUEUE_OFFSET, D_SYS_FLAG, D_STORE_TS, D_TOPIC, D_TAGS = range(9)
N_DISPATCH_FIELDS = 9


@njit(cache=True, nogil=True, inline="always")
def _name_at(buf, p, e, name):
    """Whether the property piece at ``p`` (ending before ``e``) is ``name`` followed by its \\x01."""
    m = name.size
    if p + m >= e:
        return False
    for k in range(m):
        if buf[p + k] != name[k]:
            return False
    return buf[p + m] == 1


@njit(cache=True, nogil=True)
def dispatch_walk(buf, pos, end, limit, max_rows, max_bytes, uniq_name, tags_name, keys_name):
    """What a dispatch round needs of the records from ``pos`` (``walk`` without CRCs, ``text_ok``,
    ``find_properties``, the KEYS tokens, tags codes and ``indexKeyHashMethod`` of ``topic#key`` for UNIQ_KEY and
    every token) in one pass: each record handled while its bytes are in cache, and one release of the GIL a
    round instead of one per pass (a producer running Python makes each reacquire wait up to the switch
    interval). Six passes took 375 ns a record, this one 215. Topics are numbered by their bytes in order of
    first appearance, each topic's UTF-8 check and key prefix hash made once. Returns (fields
    [N_DISPATCH_FIELDS, rows], rows, stop position, whether a row's text is not UTF-8, how many such rows, topic
    count, each topic's position and length, entry hashes, entry owners); rows whose text is not UTF-8 get tags
    code 0 and no entries."""
    cap = max(min(max_rows, (end - pos) // MIN_RECORD_LEN + 1), 0)
    d = np.empty((N_DISPATCH_FIELDS, cap), dtype=np.int64)
    bad_text = np.empty(cap, dtype=np.bool_)
    bad_count = 0
    rep_pos = np.empty(cap, dtype=np.int64)
    rep_len = np.empty(cap, dtype=np.int64)
    rep_hash = np.empty(cap, dtype=np.int64)
    rep_ok = np.empty(cap, dtype=np.bool_)
    rep_prefix = np.zeros(cap, dtype=np.int64)
    slots = np.full(16, -1, dtype=np.int64)
    topics = 0
    hashes = np.empty(2 * cap + 16, dtype=np.int64)
    owner = np.empty(2 * cap + 16, dtype=np.int64)
    m = 0
    first = pos
    n = 0
    while pos < end and n < max_rows and pos - first < max_bytes:
        (stop, _magic, _crc, sys_flag, born_extra, _body_len_pos, _body_len, topic_pos, topic_len, props_pos,
         props_len, size) = _parse(buf, pos, limit, False)
        if stop < 0:
            break
        d[D_POS, n] = pos
        d[D_PHY, n] = _be64(buf, pos + PHY_OFFSET_POS)
        d[D_SIZE, n] = size
        d[D_QUEUE_ID, n] = _be32(buf, pos + 12)
        d[D_QUEUE_OFFSET, n] = _be64(buf, pos + 20)
        d[D_SYS_FLAG, n] = sys_flag
        d[D_STORE_TS, n] = _be64(buf, pos + 56 + born_extra)
        h = np.int64(0)
        for i in range(topic_pos, topic_pos + topic_len):
            h = h * 31 + np.int64(buf[i])
        mask = slots.size - 1
        s = h & mask
        while True:
            c = slots[s]
            if c < 0:
                c = topics
                rep_pos[c], rep_len[c], rep_hash[c] = topic_pos, topic_len, h
                rep_ok[c] = _utf8_ok(buf, topic_pos, topic_len)
                if rep_ok[c]:  # the index key prefix: hashCode of topic + '#'
                    rep_prefix[c] = (_java_hash_utf8(buf, topic_pos, topic_len, np.int64(0)) * 31 + 0x23) & 0xFFFFFFFF
                topics += 1
                slots[s] = c
                if 2 * topics > slots.size:  # keep the table at most half full
                    slots = np.full(4 * slots.size, -1, dtype=np.int64)
                    mask = slots.size - 1
                    for t in range(topics):
                        s = rep_hash[t] & mask
                        while slots[s] >= 0:
                            s = (s + 1) & mask
                        slots[s] = t
                break
            if rep_hash[c] == h and rep_len[c] == topic_len and _same(buf, rep_pos[c], topic_pos, topic_len):
                break
            s = (s + 1) & mask
        d[D_TOPIC, n] = c
        d[D_TAGS, n] = 0
        text = rep_ok[c] and _utf8_ok(buf, props_pos, props_len)
        bad_text[n] = not text
        if not text:
            bad_count += 1
            n += 1
            pos = stop
            continue
        # one pass over the pieces (``find_properties``: a piece ends at \x02, its name at its first \x01, the
        # last non-empty value of a name counts), looking for the three names by their first byte
        uniq_at = tags_at = keys_at = -1
        uniq_len = tags_len = keys_len = 0
        p = props_pos
        e = props_pos + props_len
        while p < e:
            c0 = buf[p]
            which = 0
            v = p
            if c0 == uniq_name[0] and _name_at(buf, p, e, uniq_name):
                which, v = 1, p + uniq_name.size + 1
            elif c0 == tags_name[0] and _name_at(buf, p, e, tags_name):
                which, v = 2, p + tags_name.size + 1
            elif c0 == keys_name[0] and _name_at(buf, p, e, keys_name):
                which, v = 3, p + keys_name.size + 1
            q = v
            while q < e and buf[q] != 2:
                q += 1
            if q > v:
                if which == 1:
                    uniq_at, uniq_len = v, q - v
                elif which == 2:
                    tags_at, tags_len = v, q - v
                elif which == 3:
                    keys_at, keys_len = v, q - v
            p = q + 1
        if tags_at >= 0:
            d[D_TAGS, n] = _signed32(_java_hash_utf8(buf, tags_at, tags_len, np.int64(0)))
        if uniq_at >= 0 or keys_at >= 0:
            if m + 1 + keys_len // 2 + 1 > hashes.size:
                grown = max(2 * hashes.size, m + keys_len + 2)
                hashes = _grown(hashes, grown, m)
                owner = _grown(owner, grown, m)
            prefix = rep_prefix[c]
            if uniq_at >= 0:
                hashes[m] = _index_hash(_java_hash_utf8(buf, uniq_at, uniq_len, prefix))
                owner[m] = n
                m += 1
            i = keys_at
            ke = keys_at + keys_len
            while i < ke:
                j = i
                while j < ke and buf[j] != 0x20:
                    j += 1
                if j > i:
                    hashes[m] = _index_hash(_java_hash_utf8(buf, i, j - i, prefix))
                    owner[m] = n
                    m += 1
                i = j + 1
        n += 1
        pos = stop
    return d, n, pos, bad_text[:n], bad_count, topics, rep_pos, rep_len, hashes[:m], owner[:m]


_TRAN_MASK = int(SysFlag.TRANSACTION_MASK)
_TRAN_COMMIT = int(SysFlag.TRANSACTION_COMMIT_TYPE)
_TRAN_NOT = int(SysFlag.TRANSACTION_NOT_TYPE)
_TRAN_ROLLBACK = int(SysFlag.TRANSACTION_ROLLBACK_TYPE)


@njit(cache=True)
def plan_dispatch(topic_code, queue_id, sys_flag, queue_offset, phy, size, tags_code, store_ts, entry_owner, entry_hash,
                  lo, hi, index_from):
    """What rows ``lo``..``hi`` of a dispatch batch put where, in one pass that holds the GIL.

    Consume queues take the NOT and COMMIT transaction types: their units (queue offset, phy, size, tags code:
    the four rows of ``units``) grouped by topic and queue, groups in order of first appearance and rows in log
    order within each; group ``g`` is ``topic_codes[g]``, ``queue_ids[g]``, units ``starts[g]:starts[g + 1]``.
    ``last`` is the last such row (-1: none). The index takes every entry of a row that is not a ROLLBACK and
    lies at or after ``index_from`` (before it: indexed already, a re-dispatch): their hashes, their rows' phy
    offsets and store times, and whether rows without entries follow the last one (``records_follow``).

    Why one kernel: the numpy form of this was a dozen calls, each of which may give the GIL up, and under a
    producer that runs Python without pause every reacquire waits up to the switch interval (5 ms): dispatching
    200,000 records took ~0.65 s of wall for ~0.09 s of work, fell megabytes behind, and the producer had to stop
    and wait for it."""
    n = hi - lo
    keys = np.empty(n, dtype=np.int64)
    rows = np.empty(n, dtype=np.int64)
    m = 0
    last = -1
    for r in range(lo, hi):
        tran = sys_flag[r] & _TRAN_MASK
        if tran in (_TRAN_NOT, _TRAN_COMMIT):
            keys[m] = (np.int64(topic_code[r]) << 32) | (queue_id[r] & 0xFFFFFFFF)
            rows[m] = r
            m += 1
            last = r
    group, _rank, group_keys, counts = queue_groups(keys[:m])
    k = group_keys.size
    starts = np.empty(k + 1, dtype=np.int64)
    starts[0] = 0
    for g in range(k):
        starts[g + 1] = starts[g] + counts[g]
    fill = starts[:k].copy()
    units = np.empty((4, m), dtype=np.int64)
    topic_codes = np.empty(k, dtype=np.int64)
    queue_ids = np.empty(k, dtype=np.int64)
    for j in range(m):
        r = rows[j]
        g = group[j]
        u = fill[g]
        if u == starts[g]:  # the group's first row names its queue (as stored: a foreign id may be negative)
            topic_codes[g] = topic_code[r]
            queue_ids[g] = queue_id[r]
        fill[g] += 1
        units[0, u] = queue_offset[r]
        units[1, u] = phy[r]
        units[2, u] = size[r]
        units[3, u] = tags_code[r]
    taken = np.empty(entry_owner.size, dtype=np.int64)
    e = 0
    for j in range(entry_owner.size):
        r = entry_owner[j]
        if lo <= r < hi and sys_flag[r] & _TRAN_MASK != _TRAN_ROLLBACK and phy[r] >= index_from:
            taken[e] = j
            e += 1
    entries = np.empty((3, e), dtype=np.int64)
    for j in range(e):
        r = entry_owner[taken[j]]
        entries[0, j] = entry_hash[taken[j]]
        entries[1, j] = phy[r]
        entries[2, j] = store_ts[r]
    records_follow = e == 0 or entry_owner[taken[e - 1]] < hi - 1
    return units, topic_codes, queue_ids, starts, last, entries, records_follow


@njit(cache=True, nogil=True, inline="always")
def _index_hash(h):
    """``indexKeyHashMethod``'s last step: |signed h|, Integer.MIN_VALUE -> 0."""
    s = _signed32(h)
    return 0 if s == -0x80000000 else abs(s)


@njit(cache=True, nogil=True)
def _grown(a, size, used):
    out = np.empty(size, dtype=a.dtype)
    out[:used] = a[:used]
    return out

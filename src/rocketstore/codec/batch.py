"""The batch decoder: a byte range of a commit-log segment -> one ``pyarrow.RecordBatch``.

The same codec as ``record.py``, whole ranges at a time: the layout constants, the validation
rules, the properties grammar and the host and msgId spellings are ``record.py``'s, and the
hypothesis test ``tests/test_batch_codec.py`` holds every column equal to what
``message_from_layout`` gives record by record. The work is split so that no Python runs per
record on the common path:

1. ``_kernels.walk`` (numba) validates records in order, with body CRCs, and reads every fixed
   field into one int64 matrix;
2. the other kernels parse properties, split KEYS, render hosts and msgIds and copy
   variable-length bytes end to end; Arrow arrays are made from those numpy buffers.

Records the fast path cannot render byte for byte go through the record codec one at a time and
are merged back in log order: a topic or properties string that is not valid UTF-8 (the record
codec decodes it with ``errors="replace"``), a time that does not fit Arrow's microseconds, and,
with ``decompress``, a compressed body.

Columns are RocketMQ's ``MessageExt`` as the Spark source names them (``MESSAGE_FIELDS``).
"""

from __future__ import annotations

import collections
import enum
import functools
import time
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import CorruptDataError, InvalidQueryError, OffsetOutOfRangeError, SegmentDeletedError
from ..message import MessageExt, SysFlag
from . import _kernels as k
from .properties import PropertyName
from .record import BLANK_MAGIC, MAX_TIME_MS, find_record_start, message_from_layout, read_layout

if TYPE_CHECKING:
    from ..commitlog import CommitLog
    from ..mapped.file import MappedFile

_TS = pa.timestamp("us", tz="UTC")
_STRING = pa.string()
MESSAGE_FIELDS: list[tuple[str, pa.DataType]] = [
    ("topic", pa.string()), ("queueId", pa.int32()), ("queueOffset", pa.int64()), ("commitLogOffset", pa.int64()),
    ("msgId", pa.string()), ("uniqKey", pa.string()), ("keys", pa.list_(pa.string())), ("tags", pa.string()),
    ("body", pa.binary()), ("properties", pa.map_(pa.string(), pa.string())), ("bornTimestamp", _TS),
    ("storeTimestamp", _TS), ("bornHost", pa.string()), ("storeHost", pa.string()), ("sysFlag", pa.int32()),
    ("flag", pa.int32()), ("reconsumeTimes", pa.int32()), ("preparedTransactionOffset", pa.int64()),
    ("storeSize", pa.int32()), ("bodyCRC", pa.int32()), ("brokerName", pa.string()),
]
MESSAGE_SCHEMA = pa.schema(MESSAGE_FIELDS)
MESSAGE_COLUMNS: tuple[str, ...] = tuple(name for name, _ in MESSAGE_FIELDS)
DEFAULT_MAX_ROWS = 8192  # measured: 4096-8192 rows keep a batch's buffers in cache (1.6x faster than 65536)
SCAN_BUILD_THREADS = 2  # 2 cores, 256 MB of 400-byte records, quiet prototype: 0 -> 850-930 MB/s, 1 -> 1,190-1,250,
# 2 -> 1,200-1,320, 3 -> 1,290-1,360; `./dev bench scan` beside a busy core: 721 -> 829 (the walk, 40% of the work,
# stays in the caller's thread); on 100-byte records no clear gain
DEFAULT_MAX_BYTES = 64 << 20  # keeps every binary column far below Arrow's 2 GiB int32 offsets

_NAMES = {name: np.frombuffer(name.encode(), dtype=np.uint8)
          for name in (PropertyName.UNIQ_KEY, PropertyName.TAGS, PropertyName.KEYS)}


def message_columns(columns: Iterable[str] | None) -> tuple[str, ...]:
    """The column names a caller asked for, checked, in its order (None: all of ``MESSAGE_FIELDS``)."""
    if columns is None:
        return MESSAGE_COLUMNS
    try:
        names = (columns,) if isinstance(columns, str) else tuple(columns)
    except TypeError:
        raise InvalidQueryError(f"columns must be a column name or a list of them, not {columns!r}") from None
    unknown = [name for name in names if not isinstance(name, str) or name not in MESSAGE_SCHEMA.names]
    if unknown or not names or len(set(names)) != len(names):
        problem = f"unknown column {unknown[0]!r}" if unknown else "no column" if not names else "a column twice"
        raise InvalidQueryError(f"{problem} asked for; the columns are {', '.join(MESSAGE_COLUMNS)}")
    return names


@functools.lru_cache(maxsize=64)
def message_schema(names: tuple[str, ...]) -> pa.Schema:
    """The schema of a batch holding ``names`` (checked by ``message_columns``) in that order."""
    return MESSAGE_SCHEMA if names == MESSAGE_COLUMNS else pa.schema([MESSAGE_SCHEMA.field(n) for n in names])


class StopKind(enum.Enum):
    """Why ``decode_range`` stopped."""

    END = "end"  # the next record would start at or after ``end``
    LIMIT = "limit"  # ``max_rows`` or ``max_bytes`` reached: call again from ``Stop.pos``
    BLANK = "blank"  # the end-of-segment BLANK record is at ``Stop.pos``
    DAMAGE = "damage"  # ``Stop.error`` is what ``read_layout`` raises at ``Stop.pos``


@dataclass(frozen=True, slots=True)
class Stop:
    """Where decoding stopped: ``pos`` in the buffer, ``offset`` in the commit log."""

    kind: StopKind
    pos: int
    offset: int
    error: CorruptDataError | None = None


def decode_range(buf, start: int, end: int, *, base: int, check_crc: bool = True, include_body: bool = True,
                 topics: Collection[str] | None = None, limit: int | None = None, decompress: bool = False,
                 broker_name: str | None = None, path: str | None = None, max_rows: int = DEFAULT_MAX_ROWS,
                 max_bytes: int = DEFAULT_MAX_BYTES, columns: Iterable[str] | None = None
                 ) -> tuple[pa.RecordBatch, Stop]:
    """Decode the records starting in ``buf[start:end]`` into one batch (``MESSAGE_SCHEMA``, or only
    ``columns`` in that order: a column nobody reads is never built, the properties not parsed when no
    column needs them).

    ``buf`` is a segment (mmap, bytes, ...) whose byte 0 is commit-log offset ``base``; a record
    may run past ``end`` up to ``limit`` (default: the buffer's end), as ``read_layout``'s limit.
    ``topics`` keeps only those topics. The returned ``Stop`` says where and why decoding ended,
    so a caller can fail on damage, skip it, or continue after a BLANK or a full batch; the batch
    holds every valid record before that point, never one that failed validation.
    Raises ``OffsetOutOfRangeError`` for a negative ``start`` or an ``end`` before it (the compiled
    walk does no bounds checks of its own, so nothing outside the buffer may reach it).
    """
    if not 0 <= start <= end or max_rows < 1 or max_bytes < 1:
        raise OffsetOutOfRangeError(f"cannot decode the range [{start}, {end}) with max_rows={max_rows}, "
                                    f"max_bytes={max_bytes}")
    names = message_columns(columns)
    walked = _walk_range(buf, start, end, base=base, check_crc=check_crc, limit=limit, path=path, max_rows=max_rows,
                         max_bytes=max_bytes)
    try:
        batch = walked.build(include_body=include_body, topics=topics, decompress=decompress,
                             broker_name=broker_name, names=names)
    finally:
        walked.release()  # no view may outlive the call: an mmap cannot close while one is exported
    return batch, walked.stop


@dataclass
class _Walked:
    """One range walked (records validated, fixed fields read), its Arrow batch not built yet: ``scan_arrow``
    builds it on another thread while the next range is walked. Holds a view of the segment until released."""

    buf: object
    arr: np.ndarray | None
    f: np.ndarray
    limit: int
    base: int
    path: str | None
    stop: Stop

    def build(self, *, include_body: bool, topics: Collection[str] | None, decompress: bool,
              broker_name: str | None, names: tuple[str, ...]) -> pa.RecordBatch:
        assert self.arr is not None
        return _batch(self.buf, self.arr, self.f, include_body=include_body, topics=topics, limit=self.limit,
                      decompress=decompress, broker_name=broker_name, path=self.path, base=self.base, names=names)

    def __len__(self) -> int:
        return self.f.shape[1]

    def release(self) -> None:
        self.arr = self.buf = None


def _walk_range(buf, start: int, end: int, *, base: int, check_crc: bool, limit: int | None, path: str | None,
                max_rows: int, max_bytes: int) -> _Walked:
    arr = as_array(buf)
    try:
        limit = len(arr) if limit is None else min(limit, len(arr))
        f, n, pos = k.walk(arr, start, min(end, limit), limit, check_crc, max_rows, max_bytes)
        stop = _classify(buf, pos, start, end, n, limit, base, check_crc, path, max_rows, max_bytes,
                         int(f[k.F_STORE_TS, n - 1]) if n else None)
    except BaseException:
        del arr
        raise
    f = np.ascontiguousarray(f[:, :n])  # C-contiguous rows: one compiled (and cached) kernel signature
    walked = _Walked(buf, arr, f, limit, base, path, stop)
    del arr  # a damage's traceback keeps this frame, and with it any view left in it, alive
    return walked


def _intern_topics(buf, arr: np.ndarray, pos: np.ndarray, length: np.ndarray) -> tuple[list[str], np.ndarray]:
    """Each record's topic as a number into a list of the distinct topics (decoded with 'replace', as the
    record codec does), grouped by a compiled hash and checked byte for byte."""
    hashes = k.text_hashes(arr, pos, length)
    distinct, first, codes = np.unique(hashes, return_index=True, return_inverse=True)
    if len(distinct) and not k.same_texts(arr, pos, length, pos[first][codes], length[first][codes]):
        texts = [bytes(buf[p : p + n]) for p, n in zip(pos.tolist(), length.tolist(), strict=True)]  # a collision
        numbering: dict[bytes, int] = {}
        codes = np.array([numbering.setdefault(t, len(numbering)) for t in texts], dtype=np.int64)
        return [t.decode("utf-8", "replace") for t in numbering], codes.astype(np.int32)
    topics = [bytes(buf[p : p + n]).decode("utf-8", "replace") for p, n in zip(pos[first].tolist(),
                                                                               length[first].tolist(), strict=True)]
    return topics, codes.astype(np.int32).reshape(-1)


def load_dispatch_kernels() -> None:
    """Load (or compile) the dispatch path's compiled code now: ~0.3 s from the cache, which a writer pays at
    open rather than as dispatch lag behind its first puts."""
    empty = np.zeros(MIN_DISPATCH_PROBE, dtype=np.uint8)
    decode_dispatch(empty, 0, 0, base=0)
    validate_records(empty, 0, 0)
    none = np.zeros(0, dtype=np.int64)
    k.put_queue_units(empty, 0, 0, none, none, none, none, 0)  # consume-queue runs


MIN_DISPATCH_PROBE = 8


def validate_records(buf, pos: int, end: int, *, check_crc: bool = True,
                     base: int | None = None) -> tuple[int, int, int]:
    """Validate consecutive records from ``pos`` in compiled code (recovery's pass over whole segments):
    returns (position of the first record ``read_layout`` would not accept, how many it accepted, start of
    the last accepted one or -1). The caller asks ``read_layout`` at that position why the run ended.
    With ``base`` (the buffer's offset in the log), as ``read_layout(check_offset=True)``, a record must
    also sit where its PHYSICALOFFSET field says."""
    if not 0 <= pos <= end:
        raise OffsetOutOfRangeError(f"cannot validate the range [{pos}, {end})")
    arr = as_array(buf)
    try:
        stop, count, last = k.validate(arr, pos, min(end, len(arr)), check_crc, -1 if base is None else base)
    finally:
        del arr
    return int(stop), int(count), int(last)


def as_array(buf) -> np.ndarray:
    """One read-only uint8 view, so every kernel compiles (and is cached) for a single array type."""
    arr = np.frombuffer(buf, dtype=np.uint8)
    if arr.flags.writeable:
        arr = arr.view()
        arr.flags.writeable = False
    return arr


def _classify(buf, pos: int, start: int, end: int, n: int, limit: int, base: int, check_crc: bool,
              path: str | None, max_rows: int, max_bytes: int, after_ts: int | None = None) -> Stop:
    if pos >= min(end, limit):  # as iter_layouts and the Spark reader: nothing readable starts here
        return Stop(StopKind.END, pos, base + pos)
    if (n >= max_rows or pos - start >= max_bytes) and not (
            n and pos + 8 <= limit and int.from_bytes(buf[pos + 4 : pos + 8], "big", signed=True) == BLANK_MAGIC):
        # (a BLANK right at the limit is classified now, while the record before it is known: the next call would
        # start on it without one, and take a BLANK hiding records for the segment's end)
        return Stop(StopKind.LIMIT, pos, base + pos)
    try:
        layout = read_layout(buf, pos, limit, check_crc=check_crc, path=path, base=base)
    except CorruptDataError as exc:
        return Stop(StopKind.DAMAGE, pos, base + pos, exc)
    if layout is not None:  # pragma: no cover - the kernel and read_layout disagree: a bug, not data
        raise RuntimeError(f"batch decoder stopped at {base + pos} where read_layout accepts a record")
    hidden = record_after_blank(buf, pos, limit, base, after_ts)
    if hidden is not None:
        return Stop(StopKind.DAMAGE, pos, base + pos, CorruptDataError(
            f"a BLANK record with an intact record after it (at {base + hidden}) in its segment", path, base + pos))
    return Stop(StopKind.BLANK, pos, base + pos)


BLANK_PROBE_BYTES = 8 << 20  # past a BLANK, how far a record it hides may start (a record of up to ~8 MB)


def record_after_blank(buf, pos: int, limit: int, base: int, after_ts: int | None, tries: int = 64) -> int | None:
    """Where an intact record (its CRC too) that goes on from the record before the BLANK at ``pos`` starts
    (``after_ts``: that record's store time; None, unknown: None), or None. A segment's closing BLANK is followed by
    zeros (its writer rolls to the next segment), by a torn write's leftovers, or, in a broker's store after a power
    loss, by older records its recovery cut off and did not zero (stored before the record ahead of the BLANK):
    never by a record stored after it. 8 bytes that read as a BLANK in the middle of a segment hid every record
    after them, and a rebuild left those out of every queue and the index with exit 0. Only the first
    ``BLANK_PROBE_BYTES`` after it are looked at: a BLANK closes a segment early when a batch did not fit, and
    its zeros (up to the whole segment) must not be read on every scan that crosses it."""
    if after_ts is None:
        return None
    probe_end = min(limit, pos + 8 + BLANK_PROBE_BYTES)
    tail = np.frombuffer(buf, dtype=np.uint8, count=max(0, probe_end - pos - 8), offset=min(pos + 8, probe_end))
    if not tail.any():
        return None
    at = pos + 8
    for _ in range(tries):
        at = find_record_start(buf, at, probe_end, base, limit, record_limit=limit)
        if at is None:
            return None
        try:
            layout = read_layout(buf, at, limit, check_crc=True)
            if layout is not None and _store_ts(buf, at, layout.sys_flag) >= after_ts:
                return at
        except CorruptDataError:
            pass
        at += 1
    return None


def _store_ts(buf, pos: int, sys_flag: int) -> int:
    """STORETIMESTAMP of the record at ``pos`` (after the born host, 8 or 20 bytes)."""
    at = pos + 56 + (12 if sys_flag & 0x10 else 0)
    return int.from_bytes(buf[at : at + 8], "big", signed=True)


def store_ts_at(buf, pos: int) -> int:
    """STORETIMESTAMP of the record starting at ``pos`` (validated by the caller)."""
    return _store_ts(buf, pos, int.from_bytes(buf[pos + 36 : pos + 40], "big", signed=True))


def _batch(buf, arr: np.ndarray, f: np.ndarray, *, include_body: bool, topics: Collection[str] | None,
           limit: int, decompress: bool, broker_name: str | None, path: str | None, base: int,
           names: tuple[str, ...] = MESSAGE_COLUMNS) -> pa.RecordBatch:
    sys_flag = f[k.F_SYS_FLAG]
    slow = ~k.text_ok(arr, f, f.shape[1])
    slow |= (np.abs(f[k.F_BORN_TS]) > MAX_TIME_MS) | (np.abs(f[k.F_STORE_TS]) > MAX_TIME_MS)
    if decompress:
        slow |= (sys_flag & SysFlag.COMPRESSED) != 0
    fast = f[:, ~slow] if slow.any() else f
    topic = None
    if topics is not None:
        topic = _strings(*k.gather(arr, fast[k.F_TOPIC_POS], fast[k.F_TOPIC_LEN]))
        keep = pc.is_in(topic, value_set=pa.array(sorted(topics), pa.string())).to_numpy(zero_copy_only=False)
        fast, topic = fast[:, keep], topic.filter(pa.array(keep))
    batch = _fast_batch(arr, fast, topic, include_body, broker_name, names)
    if not slow.any():
        return batch
    rows = [_message_of(buf, int(p), limit, include_body, decompress, path, base) for p in f[k.F_POS, slow]]
    kept = [(p, msg) for p, msg in zip(f[k.F_POS, slow], rows, strict=True) if topics is None or msg.topic in topics]
    slow_batch = rows_batch([message_row(msg, include_body, broker_name) for _p, msg in kept]).select(list(names))
    order = np.argsort(np.concatenate([fast[k.F_POS], np.array([p for p, _m in kept], dtype=np.int64)]),
                       kind="stable")
    merged = pa.Table.from_batches([batch, slow_batch]).take(pa.array(order)).combine_chunks()
    return pa.RecordBatch.from_arrays([column.combine_chunks() for column in merged.columns],
                                      schema=message_schema(names))


def _message_of(buf, pos: int, limit: int, include_body: bool, decompress: bool, path: str | None,
                base: int) -> MessageExt:
    layout = read_layout(buf, pos, limit, path=path, base=base)  # validated (and CRC-checked) by the walk
    assert layout is not None
    return message_from_layout(buf, pos, layout, read_body=include_body, decompress=decompress, path=path,
                               base=base)


def _strings(offsets: np.ndarray, data: np.ndarray, kind: pa.DataType = _STRING,
             absent: np.ndarray | None = None) -> pa.Array:
    """An Arrow string/binary array on the kernels' buffers; ``absent`` marks null rows."""
    n = len(offsets) - 1
    validity, nulls = None, 0
    if absent is not None and absent.any():
        validity = pa.py_buffer(np.packbits(~absent, bitorder="little"))
        nulls = int(absent.sum())
    return pa.Array.from_buffers(kind, n, [validity, pa.py_buffer(offsets), pa.py_buffer(data)], null_count=nulls)


def _timestamps(ms: np.ndarray) -> pa.Array:
    return pa.Array.from_buffers(_TS, len(ms), [None, pa.py_buffer(ms * 1000)])


def _fast_batch(arr: np.ndarray, f: np.ndarray, topic: pa.Array | None, include_body: bool,
                broker_name: str | None, names: tuple[str, ...] = MESSAGE_COLUMNS) -> pa.RecordBatch:
    n = f.shape[1]
    sys_flag = f[k.F_SYS_FLAG]
    parsed: list = []

    def properties_found() -> list:  # parsed once, only when a column needs it; the pairs only for the map
        if not parsed:
            names_ = (_NAMES[PropertyName.UNIQ_KEY], _NAMES[PropertyName.TAGS], _NAMES[PropertyName.KEYS])
            if "properties" in names:
                parsed.extend(k.parse_properties(arr, f[k.F_PROPS_POS], f[k.F_PROPS_LEN], *names_))
            else:
                parsed.extend([None] * 5 + list(k.find_properties(arr, f[k.F_PROPS_POS], f[k.F_PROPS_LEN], *names_)))
        return parsed

    def found(i: int) -> pa.Array:  # UNIQ_KEY, TAGS: null where the property is absent
        where, length = properties_found()[5][i], properties_found()[6][i]
        return _strings(*k.gather(arr, where, length), absent=where < 0)

    def keys() -> pa.Array:
        where, length = properties_found()[5][2], properties_found()[6][2]
        key_offsets, token_pos, token_len = k.split_keys(arr, where, length)
        return pa.ListArray.from_arrays(pa.array(key_offsets), _strings(*k.gather(arr, token_pos, token_len)))

    def properties() -> pa.Array:
        pair_offsets, key_pos, key_len, val_pos, val_len = properties_found()[:5]
        return pa.MapArray.from_arrays(pa.array(pair_offsets), _strings(*k.gather(arr, key_pos, key_len)),
                                       _strings(*k.gather(arr, val_pos, val_len)))

    def body() -> pa.Array:
        if include_body:
            return _strings(*k.gather(arr, f[k.F_BODY_POS], f[k.F_BODY_LEN]), pa.binary())
        return pa.nulls(n, pa.binary())

    def host(field: int, v6_flag: int) -> pa.Array:
        return _strings(*k.render_hosts(arr, f[field], (sys_flag & v6_flag) != 0))

    build = {
        "topic": lambda: topic if topic is not None else _strings(*k.gather(arr, f[k.F_TOPIC_POS], f[k.F_TOPIC_LEN])),
        "queueId": lambda: pa.array(f[k.F_QUEUE_ID].astype(np.int32)),
        "queueOffset": lambda: pa.array(f[k.F_QUEUE_OFFSET]),
        "commitLogOffset": lambda: pa.array(f[k.F_PHY_OFFSET]),
        "msgId": lambda: _strings(*k.render_msg_ids(arr, f[k.F_STORE_HOST], (sys_flag & SysFlag.STOREHOST_V6) != 0,
                                                    f[k.F_POS])),
        "uniqKey": lambda: found(0),
        "keys": keys,
        "tags": lambda: found(1),
        "body": body,
        "properties": properties,
        "bornTimestamp": lambda: _timestamps(f[k.F_BORN_TS]),
        "storeTimestamp": lambda: _timestamps(f[k.F_STORE_TS]),
        "bornHost": lambda: host(k.F_BORN_HOST, SysFlag.BORNHOST_V6),
        "storeHost": lambda: host(k.F_STORE_HOST, SysFlag.STOREHOST_V6),
        "sysFlag": lambda: pa.array(sys_flag.astype(np.int32)),
        "flag": lambda: pa.array(f[k.F_FLAG].astype(np.int32)),
        "reconsumeTimes": lambda: pa.array(f[k.F_RECONSUME].astype(np.int32)),
        "preparedTransactionOffset": lambda: pa.array(f[k.F_PREPARED]),
        "storeSize": lambda: pa.array(f[k.F_SIZE].astype(np.int32)),
        "bodyCRC": lambda: pa.array(f[k.F_CRC].astype(np.int32)),
        "brokerName": lambda: _constant(broker_name, n),
    }
    return pa.RecordBatch.from_arrays([build[name]() for name in names], schema=message_schema(names))


def _constant(text: str | None, n: int) -> pa.Array:
    if text is None:
        return pa.nulls(n, pa.string())
    raw = text.encode()
    return _strings((np.arange(n + 1, dtype=np.int32) * len(raw)), np.frombuffer(raw * n, dtype=np.uint8))


def message_row(msg: MessageExt, include_body: bool, broker_name: str | None) -> list:
    """One ``MessageExt`` as the values of ``MESSAGE_FIELDS``: the record-at-a-time reference.

    Raises ``CorruptDataError`` for a time Arrow's microseconds cannot hold (no CRC covers times).
    """
    for stamp in (msg.born_timestamp, msg.store_timestamp):
        if abs(stamp) > MAX_TIME_MS:
            raise CorruptDataError(f"timestamp {stamp} ms is out of range", None, msg.commit_log_offset)
    props = msg.properties
    return [
        msg.topic, msg.queue_id, msg.queue_offset, msg.commit_log_offset, msg.msg_id, props.get(PropertyName.UNIQ_KEY),
        msg.keys, props.get(PropertyName.TAGS), msg.body if include_body else None, list(props.items()),
        msg.born_timestamp * 1000, msg.store_timestamp * 1000, str(msg.born_host), str(msg.store_host), msg.sys_flag,
        msg.flag, msg.reconsume_times, msg.prepared_transaction_offset, msg.store_size, msg.body_crc, broker_name,
    ]


def rows_batch(rows: list[list]) -> pa.RecordBatch:
    """A batch from ``message_row`` values (the slow path, and the reference in tests)."""
    columns = [pa.array([row[i] for row in rows], type=t) for i, (_name, t) in enumerate(MESSAGE_FIELDS)]
    return pa.RecordBatch.from_arrays(columns, schema=MESSAGE_SCHEMA)


@dataclass(frozen=True, slots=True)
class DispatchBatch:
    """What the dispatchers need of a run of records (``DispatchRequest`` for many at once), as arrays in log
    order. ``slow`` rows, a scheduled message (its tags code is a delivery time, its keys belong to its real
    topic) or text that is not valid UTF-8, carry no hashes here: the dispatcher takes them one at a time."""

    pos: np.ndarray
    phy: np.ndarray
    size: np.ndarray
    queue_id: np.ndarray
    queue_offset: np.ndarray
    sys_flag: np.ndarray
    store_ts: np.ndarray
    topic_code: np.ndarray  # index into ``topics``
    topics: list[str]
    tags_code: np.ndarray
    entry_hash: np.ndarray  # index entries of the fast rows, in put order
    entry_owner: np.ndarray  # the row each entry belongs to
    slow: np.ndarray
    slow_count: int  # how many ``slow`` rows (counted by the walk: asking numpy may give the GIL up)

    def __len__(self) -> int:
        return len(self.pos)


def decode_dispatch(buf, start: int, end: int, *, base: int, limit: int | None = None, path: str | None = None,
                    max_rows: int = DEFAULT_MAX_ROWS,
                    slow_topics: Collection[str] = ("SCHEDULE_TOPIC_XXXX", "rmq_sys_wheel_timer"),
                    check_crc: bool = False) -> tuple[DispatchBatch, Stop]:
    """The dispatch fields of the records starting in ``buf[start:end]`` (``decode_range``'s walk, by default
    without body CRCs, as dispatch reads records recovery already validated; ``verify`` checks them), with
    ``Stop`` saying where it ended."""
    if not 0 <= start <= end or max_rows < 1:
        raise OffsetOutOfRangeError(f"cannot decode the range [{start}, {end}) with max_rows={max_rows}")
    arr = as_array(buf)
    try:
        limit = len(arr) if limit is None else min(limit, len(arr))
        fields_end = min(end, limit)
        if check_crc:  # verify's pass: the CRC walk first, then the dispatch fields of what it accepted
            _f, crc_n, crc_pos = k.walk(arr, start, fields_end, limit, True, max_rows, DEFAULT_MAX_BYTES)
            fields_end = min(fields_end, crc_pos)
        d, n, pos, slow, slow_count, count, rep_pos, rep_len, entry_hash, owner = k.dispatch_walk(
            arr, start, fields_end, limit, max_rows, DEFAULT_MAX_BYTES, _NAMES[PropertyName.UNIQ_KEY],
            _NAMES[PropertyName.TAGS], _NAMES[PropertyName.KEYS])
        if check_crc:
            n, pos = crc_n, crc_pos
            slow = slow[:n]
            slow_count = int(np.count_nonzero(slow))
        stop = _classify(buf, pos, start, end, n, limit, base, check_crc, path, max_rows, DEFAULT_MAX_BYTES,
                         int(d[k.D_STORE_TS, n - 1]) if n else None)
    finally:
        del arr
    # views and Python only from here on the usual path: the dispatcher calls this beside a producer running
    # Python, and a numpy call that gives the GIL up may wait a switch interval to get it back
    d = d[:, :n]
    topics = [bytes(buf[p : p + m]).decode("utf-8", "replace")
              for p, m in zip(rep_pos[:count].tolist(), rep_len[:count].tolist(), strict=True)]
    topic_code = d[k.D_TOPIC]
    tags_code = d[k.D_TAGS]
    parked = [topics.index(name) for name in slow_topics if name in topics]
    if parked:  # their tags code and keys are the real topic's: the one-record path makes them
        slow = slow | np.isin(topic_code, parked)
        slow_count = int(np.count_nonzero(slow))
        tags_code = np.where(slow, 0, tags_code)
        keep = ~slow[owner]
        entry_hash, owner = entry_hash[keep], owner[keep]
    batch = DispatchBatch(pos=d[k.D_POS], phy=d[k.D_PHY], size=d[k.D_SIZE], queue_id=d[k.D_QUEUE_ID],
                          queue_offset=d[k.D_QUEUE_OFFSET], sys_flag=d[k.D_SYS_FLAG], store_ts=d[k.D_STORE_TS],
                          topic_code=topic_code, topics=topics, tags_code=tags_code, entry_hash=entry_hash,
                          entry_owner=owner, slow=slow, slow_count=slow_count)
    return batch, stop


def scan_arrow(commit_log: CommitLog, topics: Collection[str] | None = None, begin: int | None = None,
               end: int | None = None, check_crc: bool = True, include_body: bool = True, *,
               broker_name: str | None = None, max_rows: int = DEFAULT_MAX_ROWS,
               columns: Iterable[str] | None = None, threads: int = SCAN_BUILD_THREADS) -> Iterator[pa.RecordBatch]:
    """Every record of ``commit_log`` from ``begin`` (a record start) to ``end``, as batches in log order
    (``columns`` only, when given).

    ``MessageStore.scan_arrow``: the same walk as ``CommitLog.iter_layouts`` (segments up to their
    write position, a BLANK ends a segment), one batch per ``max_rows`` records. Raises the
    ``CorruptDataError`` that ``read_layout`` raises for the first record that does not validate,
    after yielding everything before it. The walk runs in the caller's thread, and up to ``threads`` others
    build the Arrow batches of the ranges walked before (``_built_in_order``); 0 builds each in the caller's.
    """
    wanted = None if topics is None else frozenset([topics] if isinstance(topics, str) else topics)
    names = message_columns(columns)

    def walk(mapped, pos: int, seg_end: int, limit: int) -> tuple[_Walked, Stop]:
        walked = _walk_range(mapped.buffer, pos, seg_end, base=mapped.file_from_offset, check_crc=check_crc,
                             limit=limit, path=str(mapped.path), max_rows=max_rows, max_bytes=DEFAULT_MAX_BYTES)
        return walked, walked.stop

    def build(walked: _Walked) -> pa.RecordBatch:
        try:
            return walked.build(include_body=include_body, topics=wanted, decompress=False,
                                broker_name=broker_name, names=names)
        finally:
            walked.release()

    return _built_in_order(_walk_log(commit_log, begin, end, walk), build, threads)


def _built_in_order(walked: Iterator[_Walked], build, threads: int) -> Iterator[pa.RecordBatch]:
    """``build`` of each walked range, in order, by up to ``threads`` worker threads while the caller walks on.

    At most ``threads + 2`` ranges are held (walked, being built, built and not yet taken). A range is handed to
    a worker only once the next one is walked, so a scan of one batch starts no thread; a worker that cannot be
    started leaves the building to the caller. An error of the walk (damage) is raised after every batch before
    it; one of a build, in its place. The caller takes nothing but C ``SimpleQueue``s between the threads (no
    Python lock a Ctrl-C could leave held: with ``concurrent.futures`` a KeyboardInterrupt inside a future's
    ``with`` hung the worker and the scan's close for good). Stopping early drops what is queued and waits a
    little for the workers; one that does not finish is a daemon holding a view of a segment, never a crash."""
    import queue
    import threading

    jobs: queue.SimpleQueue = queue.SimpleQueue()
    started: list[threading.Thread] = []
    pending: collections.deque[queue.SimpleQueue] = collections.deque()
    stopping = [False]

    def work() -> None:
        while (job := jobs.get()) is not None:
            slot, item = job
            if stopping[0]:
                item.release()
                continue
            try:
                slot.put((True, build(item)))
            except BaseException as exc:  # handed to the caller in its batch's place
                slot.put((False, exc))
            del job, slot, item  # no view of the segment kept while waiting for the next job

    def start_workers() -> int:
        for _ in range(threads):
            worker = threading.Thread(target=work, name="rocketstore-scan-build", daemon=True)
            started.append(worker)  # listed first: a Ctrl-C inside start() leaves no running worker unlisted
            try:
                worker.start()
            except RuntimeError:  # no thread to be had (a thread limit): the caller builds what these would
                started.pop()
                break
        return len(started)

    def taken(slot: queue.SimpleQueue) -> pa.RecordBatch:
        ok, value = slot.get()
        if not ok:
            raise value
        return value

    held: _Walked | None = None
    item: _Walked | None = None
    error: BaseException | None = None
    workers = 0
    tried = False
    try:
        while True:
            try:
                item = next(walked)
            except StopIteration:
                break
            except Exception as exc:  # the walk's (damage): raised after every batch before it
                error = exc
                break
            if held is not None:
                if threads and not tried:  # once: with no thread to be had, not again before every batch
                    tried = True
                    workers = start_workers()
                if workers:
                    slot: queue.SimpleQueue = queue.SimpleQueue()
                    jobs.put((slot, held))
                    pending.append(slot)
                else:
                    batch = build(held)
                    if len(batch):
                        yield batch
                while len(pending) > workers:
                    batch = taken(pending.popleft())
                    if len(batch):
                        yield batch
            held, item = item, None
        while pending:
            batch = taken(pending.popleft())
            if len(batch):
                yield batch
        if held is not None:
            last, held = held, None
            batch = build(last)
            if len(batch):
                yield batch
        if error is not None:
            raise error
    finally:
        close_walk = getattr(walked, "close", None)
        if close_walk is not None:
            close_walk()
        stopping[0] = True
        for _ in started:
            jobs.put(None)
        deadline = time.monotonic() + SCAN_WORKER_GRACE
        for worker in started:
            if worker.is_alive():
                worker.join(max(0.0, deadline - time.monotonic()))
        for left in (held, item):  # an exception leaving the scan keeps this frame: no view may stay in it
            if left is not None:
                left.release()


SCAN_WORKER_GRACE = 5.0  # seconds a closing scan waits for its workers' builds (a build takes milliseconds)


def decode_at(commit_log: CommitLog, offsets, *, check_crc: bool = True, verify_prop_crc: bool = False,
              include_body: bool = True, broker_name: str | None = None) -> pa.RecordBatch:
    """The records that start at ``offsets``, as one batch in offset order (duplicates once): what
    ``CommitLog.get_message`` reads at each, with the same checks. An offset where no readable record starts
    (outside the log, inside a record, damaged, a BLANK, a segment retention deleted) is left out, as the
    lookups that read candidates from the index leave it out."""
    wanted = np.unique(np.asarray(offsets, dtype=np.int64))
    wanted = wanted[(wanted >= commit_log.min_offset) & (wanted < commit_log.max_offset)]
    batches: list[pa.RecordBatch] = []
    i = 0
    while i < len(wanted):
        mapped = commit_log.mapped_files.find(int(wanted[i]))
        if mapped is None:
            i += 1
            continue
        j = int(np.searchsorted(wanted, mapped.file_end_offset))
        base = mapped.file_from_offset
        try:
            buf = mapped.buffer
            arr = as_array(buf)
        except (ValueError, SegmentDeletedError):  # retention deleted it: those messages are gone
            i = j
            continue
        try:
            limit = min(mapped.wrote_position, mapped.file_size)
            f, n = k.parse_at(arr, wanted[i:j] - base, limit, base, check_crc)
            f = np.ascontiguousarray(f[:, :n])
            if verify_prop_crc and n:  # forceVerifyPropCRC: the record codec checks it (rarely on)
                f = f[:, [_prop_crc_ok(buf, int(p), limit, base) for p in f[k.F_POS]]]
            batches.append(_batch(buf, arr, np.ascontiguousarray(f), include_body=include_body, topics=None,
                                  limit=limit, decompress=False, broker_name=broker_name, path=str(mapped.path),
                                  base=base))
        finally:
            del arr
        i = j
    if not batches:
        return pa.RecordBatch.from_pylist([], schema=MESSAGE_SCHEMA)
    if len(batches) == 1:
        return batches[0]
    table = pa.Table.from_batches(batches).combine_chunks()
    return pa.RecordBatch.from_arrays([column.combine_chunks() for column in table.columns], schema=MESSAGE_SCHEMA)


def _prop_crc_ok(buf, pos: int, limit: int, base: int) -> bool:
    try:
        return read_layout(buf, pos, limit, check_crc=False, verify_prop_crc=True, base=base) is not None
    except CorruptDataError:
        return False


def scan_dispatch(commit_log: CommitLog, begin: int | None = None, end: int | None = None, *,
                  check_crc: bool = False, max_rows: int = DEFAULT_MAX_ROWS) -> Iterator[DispatchBatch]:
    """``scan_arrow``'s walk yielding ``DispatchBatch``es: the fixed fields, interned topics and hashes,
    for tools that count or check records rather than show them (stats). Raises on damage, as
    ``scan_arrow`` does, after yielding everything before it."""

    def decode(mapped, pos: int, seg_end: int, limit: int):
        return decode_dispatch(mapped.buffer, pos, seg_end, base=mapped.file_from_offset, limit=limit,
                               path=str(mapped.path), max_rows=max_rows, check_crc=check_crc)

    return _walk_log(commit_log, begin, end, decode)


@dataclass(frozen=True, slots=True)
class RecordRun:
    """Consecutive records of one segment that the compiled walk accepted: where each starts in ``mapped`` and
    the commit-log offset it says it is at, and where the readable bytes end (``read_layout``'s limit)."""

    mapped: MappedFile
    starts: list[int]
    phy_offsets: list[int]
    limit: int

    def __len__(self) -> int:
        return len(self.starts)


def scan_records(commit_log: CommitLog, begin: int | None = None, end: int | None = None, *, check_crc: bool,
                 max_rows: int = 4096) -> Iterator[RecordRun]:
    """``scan_arrow``'s walk yielding the accepted records' positions, ``max_rows`` at a time, for readers that
    build one object per record (``CommitLog.iter_messages``): the checks, CRCs included, are the compiled
    ``walk``'s, and the first record it does not accept raises ``read_layout``'s error after every run before
    it was yielded. No view of a segment is held between runs, so the store can unmap it meanwhile."""

    def decode(mapped, pos: int, seg_end: int, limit: int) -> tuple[RecordRun, Stop]:
        buf = mapped.buffer
        arr = as_array(buf)
        try:
            f, n, stop_pos = k.walk(arr, pos, seg_end, limit, check_crc, max_rows, DEFAULT_MAX_BYTES)
        finally:
            del arr
        stop = _classify(buf, stop_pos, pos, seg_end, n, limit, mapped.file_from_offset, check_crc, str(mapped.path),
                         max_rows, DEFAULT_MAX_BYTES, int(f[k.F_STORE_TS, n - 1]) if n else None)
        return RecordRun(mapped, f[k.F_POS, :n].tolist(), f[k.F_PHY_OFFSET, :n].tolist(), limit), stop

    return _walk_log(commit_log, begin, end, decode)


def _walk_log(commit_log: CommitLog, begin: int | None, end: int | None, decode) -> Iterator:
    """The segments' written bytes from ``begin`` to ``end``, decoded batch by batch by ``decode``."""
    stop_at = commit_log.max_offset if end is None else min(end, commit_log.max_offset)
    offset = commit_log.min_offset if begin is None else max(begin, commit_log.min_offset)
    while offset < stop_at:
        mapped = commit_log.mapped_files.find(offset)
        if mapped is None:
            return
        pos = offset - mapped.file_from_offset
        written = mapped.wrote_position
        limit = written if written < mapped.file_size else mapped.file_size
        seg_end = min(written, stop_at - mapped.file_from_offset)
        while pos < seg_end:
            batch, stop = decode(mapped, pos, seg_end, limit)
            if len(batch):
                yield batch
            if stop.kind is StopKind.DAMAGE:
                assert stop.error is not None
                if isinstance(batch, _Walked) and not len(batch):  # not yielded: its view goes before the error
                    batch.release()  # keeps this frame (a segment stayed mapped after close, the session review)
                batch = None
                raise stop.error
            if stop.kind is not StopKind.LIMIT:
                break
            pos = stop.pos
        offset = mapped.file_end_offset

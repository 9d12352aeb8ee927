"""Encoding a whole table of messages at once: columns in, records back to back out.

The per-message encoder (``rocketstore.encoder``) builds one record with a struct call and a
properties dict per message. Here every step works on whole columns, from the Arrow buffers:
validation (the first bad row is named), UNIQ_KEYs generated as one block, the properties strings
of plain rows (UNIQ_KEY, TAGS, KEYS in the broker's HashMap order) written by one compiled loop
(``_kernels.plain_properties``), and the records (fixed fields, body CRC, body, topic, properties)
by another (``_kernels.encode_v1``). Only rows that carry user properties build their properties
string one by one, through the same function the per-message encoder uses, so both produce the
same bytes (``tests/test_batch_encode.py`` proves it).

The three fields known only under the put lock (queue offset, physical offset, store time) stay
zero; ``CommitLog.append_batch`` fills them in with numpy.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import (
    InvalidFlagError,
    InvalidPropertyError,
    InvalidTopicError,
    MessageIllegalError,
    MessageTooLargeError,
    PropertiesTooLargeError,
)
from ..message import SysFlag
from .hosts import Host
from .properties import PropertyName, _cached_order, encode_properties, split_keys
from .record import (
    CRC32_RESERVED_LEN,
    FIXED_PART_LEN,
    MAGIC_V1,
    MAGIC_V2,
    MAX_PROPERTIES_LEN,
    MAX_TIME_MS,
    MAX_TOPIC_LEN_V1,
)
from .scratch import scratch

_INT32_MAX = (1 << 31) - 1
_HEX = np.frombuffer(b"0123456789ABCDEF", dtype=np.uint8)
OPTIONAL_COLUMNS = ("keys", "tags", "properties", "queue_id", "flag", "born_timestamp", "born_host", "sys_flag",
                    "reconsume_times", "prepared_transaction_offset")
# what a row's sys_flag may set: the body's compression and its type, MULTI_TAGS, a transaction type (a prepared or
# rolled-back record takes no queue offset, as put_message's), an inner batch's two bits (kept from a broker's
# BatchCQ topic by an import); the host bits follow the hosts
_BATCH_SYS_FLAGS = (SysFlag.COMPRESSED | SysFlag.MULTI_TAGS | SysFlag.COMPRESSION_TYPE_MASK
                    | SysFlag.TRANSACTION_MASK | SysFlag.NEED_UNWRAP | SysFlag.INNER_BATCH)


@dataclass(slots=True)
class EncodedBatch:
    """Records ready for ``CommitLog.append_batch``: back to back in ``data``, row order kept."""

    data: bytearray | memoryview
    sizes: np.ndarray  # int64, per record
    topics: list[str]  # distinct stored topics
    topic_index: np.ndarray  # int32 per row, into ``topics``
    queue_ids: np.ndarray  # int32 per row (stored queue: a delayed message's schedule queue)
    store_ts_pos: np.ndarray  # int64 per row: where STORETIMESTAMP is inside the record
    uniq_raw: np.ndarray  # (n, 16 or 28) uint8: the generated UNIQ_KEYs, hex-encoded only when asked for
    uniq_texts: list[str] | None  # every row's UNIQ_KEY when some row brought its own
    wait_store: bool  # some row wants SYNC_FLUSH's wait (WAIT != false)
    queue_checks: list[tuple[str, int]]  # (topic, highest queue id used): the topic rules to apply
    no_offset: np.ndarray | None = None  # rows that take no queue offset (prepared, rolled back); None: none

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def uniq_keys(self) -> pa.StringArray:
        return uniq_key_strings(self.uniq_raw, self.uniq_texts)


def uniq_key_strings(raw: np.ndarray, texts: list[str] | None) -> pa.StringArray:
    """The UNIQ_KEYs of a batch: ``texts`` when some row brought its own, else the generated ``raw`` in hex."""
    return hex_upper(raw) if texts is None else pa.array(texts, pa.string())

    @property
    def starts(self) -> np.ndarray:
        return np.cumsum(self.sizes) - self.sizes


def hex_upper(raw: np.ndarray) -> pa.StringArray:
    """Rows of bytes (an (n, k) uint8 array) as uppercase hex strings, without a Python loop."""
    n, k = raw.shape
    chars = np.empty((n, 2 * k), dtype=np.uint8)
    chars[:, 0::2] = _HEX[raw >> 4]
    chars[:, 1::2] = _HEX[raw & 0x0F]
    offsets = np.arange(0, (n + 1) * 2 * k, 2 * k, dtype=np.int32)
    return pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(chars.tobytes()))


def offset_msg_ids(store_host_raw: bytes, phys: np.ndarray) -> pa.StringArray:
    """Offset msgIds (store host + commit-log offset, uppercase hex) of records at ``phys``."""
    host = np.frombuffer(store_host_raw, dtype=np.uint8)
    raw = np.empty((len(phys), len(host) + 8), dtype=np.uint8)
    raw[:, : len(host)] = host
    raw[:, len(host) :] = np.asarray(phys).astype(">i8").view(np.uint8).reshape(-1, 8)
    return hex_upper(raw)


def _first_true(mask) -> int | None:
    arr = np.asarray(mask.to_numpy(zero_copy_only=False) if isinstance(mask, pa.Array | pa.ChunkedArray) else mask)
    if not arr.size:
        return None
    first = int(arr.argmax())  # a boolean argmax stops at the first True
    return first if arr[first] else None


def _max_by_code(codes: np.ndarray, values: np.ndarray, count: int) -> list[int]:
    """The largest of ``values`` for each code in ``range(count)`` (each occurs at least once)."""
    highest = np.full(count, np.iinfo(np.int64).min, dtype=np.int64)
    np.maximum.at(highest, codes, values)
    return highest.tolist()


def as_array(column) -> pa.Array:
    """One array of a column: a single chunk as it is (``combine_chunks`` copies even one chunk: 1 MB of bodies
    and every string column of a 10,000-row table, a tenth of ``put_batch``)."""
    if isinstance(column, pa.ChunkedArray):
        return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    return column


_TEXT_COLUMNS = {"topic": InvalidTopicError, "tags": InvalidPropertyError, "keys": InvalidPropertyError,
                 "properties": InvalidPropertyError, "born_host": InvalidFlagError}


def _plain(name: str, column: pa.Array) -> pa.Array:
    """A column in the types the encoder reads: dictionary-encoded columns (Parquet's strings often are)
    decoded, large strings and lists of them as the 32-bit-offset kinds; text columns checked to be UTF-8
    (an array built from buffers is not checked by Arrow, and its bytes would go into the log as they are)."""
    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    if _is_string_view(column.type) or (name in ("tags", "born_host") and pa.types.is_large_string(column.type)):
        column = column.cast(pa.string())
    elif name == "body" and _is_binary_view(column.type):
        column = column.cast(pa.binary())
    elif name == "keys" and (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)) and (
            pa.types.is_large_string(column.type.value_type) or pa.types.is_dictionary(column.type.value_type)
            or _is_string_view(column.type.value_type)):
        column = column.cast(pa.list_(pa.string()))
    error = _TEXT_COLUMNS.get(name)
    if error is not None:
        try:
            column.validate(full=True)
        except pa.ArrowInvalid as exc:
            raise error(f"row {_first_invalid_row(column)}: {name} is not a valid Arrow array of UTF-8 strings "
                        f"({exc})") from None
    return column


def _is_string_view(kind: pa.DataType) -> bool:
    return getattr(pa.types, "is_string_view", lambda _t: False)(kind)


def _is_binary_view(kind: pa.DataType) -> bool:
    return getattr(pa.types, "is_binary_view", lambda _t: False)(kind)


def _first_invalid_row(column: pa.Array) -> int:
    """The first row of ``column`` that full validation refuses (the error path only: one check per row)."""
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type) or pa.types.is_map(column.type):
        # a slice of a nested array validates all its children: find the bad child element, then its row
        children = [column.keys, column.items] if pa.types.is_map(column.type) else [column.values]
        bad = [_first_invalid_row(child) for child in children if not _valid(child)]
        if not bad:
            return 0
        offsets = column.offsets.to_numpy(zero_copy_only=False)
        return max(0, int(np.searchsorted(offsets, min(bad), side="right")) - 1)
    for row in range(len(column)):
        if not _valid(column.slice(row, 1)):
            return row
    return 0


def _valid(column: pa.Array) -> bool:
    try:
        column.validate(full=True)
    except pa.ArrowInvalid:
        return False
    return True


class BatchEncoder:
    """Validates and encodes tables of messages for one store (shares the per-message encoder's state:
    store host, UNIQ_KEY generator, topic cache, limits)."""

    def __init__(self, encoder) -> None:
        self.encoder = encoder
        self.config = encoder.config

    def encode(self, table: pa.Table | pa.RecordBatch, *, copied: bool = False) -> EncodedBatch:
        """``copied``: the rows are messages a store held (an import): properties a broker sets, such as
        INNER_MULTI_DISPATCH, are kept as they are instead of refused as a producer's request."""
        if isinstance(table, pa.RecordBatch):
            table = pa.Table.from_batches([table])
        if not isinstance(table, pa.Table):
            raise MessageIllegalError(f"put_batch takes a pyarrow Table or RecordBatch, not {type(table).__name__}")
        for required in ("topic", "body"):
            if required not in table.column_names:
                raise MessageIllegalError(f"put_batch needs a {required!r} column")
        twice = sorted({name for name in table.column_names if table.column_names.count(name) > 1})
        if twice:
            raise MessageIllegalError(f"put_batch got the column {twice[0]!r} twice")
        unknown = set(table.column_names) - {"topic", "body", *OPTIONAL_COLUMNS}
        if unknown:
            raise MessageIllegalError(f"put_batch does not know the column(s) {sorted(unknown)}; "
                                      f"known: topic, body, {', '.join(OPTIONAL_COLUMNS)}")
        n = table.num_rows
        col = {name: _plain(name, as_array(table.column(name))) for name in table.column_names
               if not (pa.types.is_null(table.column(name).type) and name in OPTIONAL_COLUMNS)}
        topics_in, topic_codes = self._topics(col["topic"])
        bodies = self._bodies(col["body"])
        queue_ids = queue_in = self._ints(col, "queue_id", n, 0, (0, _INT32_MAX))
        flags = self._ints(col, "flag", n, 0, (-(1 << 31), _INT32_MAX))
        now = time.time_ns() // 1_000_000
        born_ts = self._ints(col, "born_timestamp", n, now, (-MAX_TIME_MS, MAX_TIME_MS))
        born_raw, born_v6 = self._born_hosts(col.get("born_host"), n)
        user_flags = self._ints(col, "sys_flag", n, 0, (0, _INT32_MAX))
        bad = _first_true(user_flags & ~_BATCH_SYS_FLAGS)
        if bad is not None:
            raise InvalidFlagError(f"row {bad}: sys_flag 0x{int(user_flags[bad]):X} sets bits a row may not set "
                                   f"(allowed: 0x{int(_BATCH_SYS_FLAGS):X})")
        reconsumes = self._ints(col, "reconsume_times", n, 0, (-(1 << 31), _INT32_MAX))
        prepareds = self._ints(col, "prepared_transaction_offset", n, 0, (-(1 << 63), (1 << 63) - 1))
        tags = self._tags(col.get("tags"), n)
        keys = self._keys(col.get("keys"), n)

        uniq_raw = self.encoder.uniq_keys.raw_block(n, now)
        props_off, props_data, stored_topic_names, queue_ids, uniq_texts, wait_rows = self._properties(
            col.get("properties"), tags, keys, uniq_raw, topics_in, topic_codes, queue_ids, copied, user_flags)
        props_len = np.diff(props_off)
        bad = _first_true(props_len > MAX_PROPERTIES_LEN)
        if bad is not None:
            raise PropertiesTooLargeError(f"row {bad}: properties are {props_len[bad]} bytes encoded; "
                                          f"the limit is 32767")

        if stored_topic_names is None:  # no row's properties moved it: the input topics, renumbered sorted
            stored_topics = sorted(topics_in)
            rank = np.empty(len(topics_in), dtype=np.int32)
            rank[np.argsort(np.array(topics_in, dtype=object))] = np.arange(len(topics_in), dtype=np.int32)
            topic_index = rank[topic_codes]
        else:
            stored_topics = sorted(set(stored_topic_names))
            code_of = {t: i for i, t in enumerate(stored_topics)}
            topic_index = np.fromiter((code_of[t] for t in stored_topic_names), dtype=np.int32, count=n) \
                if len(stored_topics) > 1 else np.zeros(n, dtype=np.int32)
        topic_bytes = [t.encode("utf-8") for t in stored_topics]
        if not self.config.auto_message_version_on_topic_len:  # a V1 record's topic length is one signed byte
            for i, name in enumerate(topic_bytes):
                if len(name) > MAX_TOPIC_LEN_V1:
                    raise InvalidTopicError(f"row {int(np.argmax(topic_index == i))}: topic longer than 127 bytes "
                                            "needs auto_message_version_on_topic_len")
        v2 = np.array([self.config.auto_message_version_on_topic_len and len(t) > MAX_TOPIC_LEN_V1
                       for t in stored_topics], dtype=bool)
        row_v2 = v2[topic_index]
        topic_len = np.array([len(b) for b in topic_bytes], dtype=np.int64)[topic_index]
        store_v6 = self.encoder.store_host.is_ipv6
        sys_flags = user_flags | np.where(born_v6, SysFlag.BORNHOST_V6, 0) | (SysFlag.STOREHOST_V6 if store_v6 else 0)
        body_len = pc.binary_length(bodies).to_numpy(zero_copy_only=False).astype(np.int64)
        sizes = (FIXED_PART_LEN + np.where(born_v6, 12, 0) + (12 if store_v6 else 0) + body_len
                 + np.where(row_v2, 2, 1) + topic_len + 2 + props_len)
        bad = _first_true(sizes > self.encoder.max_record_len)
        if bad is not None:
            raise MessageTooLargeError(f"row {bad}: record is {sizes[bad]} bytes; at most "
                                       f"{self.encoder.max_record_len} fit")
        if store_v6 or born_v6.any() or row_v2.any():
            data = self._assemble_general(n, sizes, bodies, topic_bytes, topic_index, row_v2, props_off, props_data,
                                          queue_ids, flags, sys_flags, born_ts, born_raw, reconsumes, prepareds)
        else:
            data = self._assemble_v4(sizes, bodies, topic_bytes, topic_index, props_off, props_data, queue_ids, flags,
                                     born_ts, born_raw)
            _set_rare_fields(data, sizes, user_flags, reconsumes, prepareds)
        store_ts_pos = np.where(born_v6, 68, 56).astype(np.int64)
        checks = dict(zip(topics_in, _max_by_code(topic_codes, queue_in, len(topics_in)), strict=True))
        if stored_topic_names is not None:  # some rows moved (DELAY): their stored topics' queues are checked too
            for t, highest in zip(stored_topics, _max_by_code(topic_index, queue_ids, len(stored_topics)),
                                  strict=True):
                checks[t] = max(checks.get(t, 0), highest)
        # the bit PREPARED and ROLLBACK share: such a record takes no queue offset (0 is written), as put_message's
        no_offset = (user_flags & SysFlag.TRANSACTION_PREPARED_TYPE) != 0
        return EncodedBatch(data, sizes, stored_topics, topic_index, queue_ids.astype(np.int32), store_ts_pos,
                            uniq_raw, uniq_texts, bool(wait_rows), sorted(checks.items()),
                            no_offset if no_offset.any() else None)

    # --- columns -------------------------------------------------------------------------------------

    def _topics(self, column: pa.Array) -> tuple[list[str], np.ndarray]:
        if not pa.types.is_string(column.type) and not pa.types.is_large_string(column.type):
            raise MessageIllegalError(f"column 'topic' must be strings, not {column.type}")
        bad = _first_true(column.is_null()) if column.null_count else None
        if bad is not None:
            raise MessageIllegalError(f"row {bad}: topic is null")
        encoded = column.dictionary_encode()
        names = encoded.dictionary.to_pylist()
        from ..encoder import check_sendable, validate_topic

        codes = encoded.indices.to_numpy(zero_copy_only=False)
        for i, name in enumerate(names):
            try:
                validate_topic(name)
                check_sendable(name)
            except MessageIllegalError as exc:
                raise type(exc)(f"row {int(np.argmax(codes == i))}: {exc}") from None
        return names, codes

    def _bodies(self, column: pa.Array) -> pa.Array:
        if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
            column = column.cast(pa.binary())
        if not pa.types.is_binary(column.type) and not pa.types.is_large_binary(column.type):
            raise MessageIllegalError(f"column 'body' must be binary, not {column.type}")
        bad = _first_true(column.is_null()) if column.null_count else None
        if bad is not None:
            raise MessageIllegalError(f"row {bad}: body is null")
        lengths = pc.binary_length(column).to_numpy(zero_copy_only=False)
        bad = _first_true(lengths > self.config.max_message_size)
        if bad is not None:
            raise MessageTooLargeError(f"row {bad}: body is {lengths[bad]} bytes; max_message_size is "
                                       f"{self.config.max_message_size}")
        return column.cast(pa.binary()) if pa.types.is_large_binary(column.type) else column

    @staticmethod
    def _ints(col: dict, name: str, n: int, default: int, bounds: tuple[int, int]) -> np.ndarray:
        column = col.get(name)
        if column is None:
            return np.full(n, default, dtype=np.int64)
        if not pa.types.is_integer(column.type):
            raise InvalidFlagError(f"column {name!r} must be integers, not {column.type}")
        values = (column.fill_null(default) if column.null_count else column).to_numpy(zero_copy_only=False)
        bad = _first_true((values < bounds[0]) | (values > bounds[1])) if values.dtype != np.uint64 else \
            _first_true(values > bounds[1])
        if bad is not None:
            raise InvalidFlagError(f"row {bad}: {name} must be an integer in [{bounds[0]}, {bounds[1]}], "
                                   f"not {values[bad]}")
        return values.astype(np.int64)

    def _born_hosts(self, column: pa.Array | None, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(n, 20) raw host bytes (first 8 or 20 used) and the IPv6 mask."""
        store = self.encoder.store_host_raw
        if column is None or column.null_count == n:
            raw = np.zeros((n, 20), dtype=np.uint8)
            raw[:, : len(store)] = np.frombuffer(store, dtype=np.uint8)
            return raw, np.full(n, self.encoder.store_host.is_ipv6, dtype=bool)
        if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
            raise InvalidFlagError(f"column 'born_host' must be strings (host:port), not {column.type}")
        encoded = column.cast(pa.string()).dictionary_encode()
        codes = encoded.indices.fill_null(len(encoded.dictionary)).to_numpy(zero_copy_only=False)
        hosts = []
        for i, text in enumerate(encoded.dictionary.to_pylist()):
            try:
                hosts.append(Host.parse(text) if text is not None else self.encoder.store_host)
            except InvalidFlagError as exc:  # named by the first row that holds it
                raise InvalidFlagError(f"row {int(np.flatnonzero(codes == i)[0])}: {exc}") from None
        table = np.zeros((len(hosts) + 1, 20), dtype=np.uint8)
        for i, host in enumerate(hosts):
            b = host.to_bytes()
            table[i, : len(b)] = np.frombuffer(b, dtype=np.uint8)
        table[-1, : len(store)] = np.frombuffer(store, dtype=np.uint8)
        v6 = np.array([h.is_ipv6 for h in hosts] + [self.encoder.store_host.is_ipv6], dtype=bool)
        return table[codes], v6[codes]

    def _tags(self, column: pa.Array | None, n: int) -> _Texts:
        """TAGS per row (an empty tag is none, as in ``Message``)."""
        if column is None:
            return _Texts(np.zeros(n + 1, dtype=np.int32), _NO_BYTES, np.zeros(n, dtype=bool))
        if not pa.types.is_string(column.type):
            raise InvalidPropertyError(f"column 'tags' must be strings, not {column.type}")
        offsets, data = _binary_buffers(column)
        present = np.diff(offsets) > 0
        if column.null_count:
            present &= column.is_valid().to_numpy(zero_copy_only=False)
        bad = _k().first_bad_text(offsets, data, present, False, True)
        if bad >= 0:
            raise InvalidPropertyError(f"row {bad}: tags {column[bad].as_py()!r} is empty or contains a "
                                       f"separator character (\\x01 or \\x02)")
        return _Texts(offsets, data, present)

    def _keys(self, column: pa.Array | None, n: int) -> _Keys:
        """KEYS per row: each row's keys (a list of strings), joined by spaces when written."""
        if column is None:
            return _Keys(np.zeros(n + 1, dtype=np.int32), np.zeros(1, dtype=np.int32), _NO_BYTES,
                         np.zeros(n, dtype=bool))
        if pa.types.is_string(column.type):  # space-separated, as RocketMQ's KEYS property
            column = pa.array([split_keys(text) for text in column.to_pylist()], pa.list_(pa.string()))
        if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)) or \
                not pa.types.is_string(column.type.value_type):
            raise InvalidPropertyError(f"column 'keys' must be list<string> (or space-separated strings), "
                                       f"not {column.type}")
        list_off = column.offsets.to_numpy(zero_copy_only=False)
        values = column.values
        present = np.diff(list_off) > 0
        if column.null_count:
            present &= column.is_valid().to_numpy(zero_copy_only=False)
        check = np.zeros(len(values), dtype=bool)
        first, last = int(list_off[0]), int(list_off[-1])
        check[first:last] = np.repeat(present, np.diff(list_off))
        key_off, key_data = _binary_buffers(values)
        bad = _first_true(check & ~values.is_valid().to_numpy(zero_copy_only=False)) if values.null_count else None
        if bad is None:
            bad = _k().first_bad_text(key_off, key_data, check, True, False)
            bad = None if bad < 0 else bad
        if bad is not None:
            row = int(np.searchsorted(list_off, bad, side="right")) - 1
            raise InvalidPropertyError(f"row {row}: key {values[bad].as_py()!r} is empty or contains a space (the "
                                       f"KEYS separator) or a separator character")
        return _Keys(list_off, key_off, key_data, present)

    def _properties(self, column: pa.Array | None, tags: _Texts, keys: _Keys, uniq_raw: np.ndarray,
                    topics: list[str], topic_codes: np.ndarray, queue_ids: np.ndarray, copied: bool = False,
                    sys_flags: np.ndarray | None = None):
        """Properties strings per row (Arrow-style offsets and bytes, with room for ``__CRC32#`` if the store
        seals records), plus what user properties can change: stored topic and queue (DELAY), UNIQ_KEY (a
        user's own), whether any row waits for the disk."""
        n = len(tags.present)
        has_user = np.zeros(n, dtype=bool)
        if column is not None:
            if not pa.types.is_map(column.type):
                raise InvalidPropertyError(f"column 'properties' must be map<string, string>, not {column.type}")
            has_user = np.diff(column.offsets.to_numpy(zero_copy_only=False)) > 0
            if column.null_count:  # a null row's offsets may still span entries: it has no properties
                has_user &= column.is_valid().to_numpy(zero_copy_only=False)
        reserve = CRC32_RESERVED_LEN if self.config.enabled_append_prop_crc else 0
        offsets, data = _k().plain_properties(uniq_raw, tags.offsets, tags.data, tags.present, keys.list_offsets,
                                              keys.offsets, keys.data, keys.present, _plain_orders(), reserve)
        if not has_user.any():
            return offsets, data, None, queue_ids, None, True  # stored topics are the input topics
        names = [topics[c] for c in topic_codes] if len(topics) > 1 else [topics[0]] * n
        # rows with user properties: the per-message encoder's own rules, row by row
        rows = np.flatnonzero(has_user)
        texts = [data[offsets[i] : offsets[i + 1]].tobytes() for i in range(n)]
        uniq_list = hex_upper(uniq_raw).to_pylist()
        queue_ids = queue_ids.copy()
        wait_any = bool((~has_user).any())
        maps = column.take(pa.array(rows)).to_pylist()
        for row, pairs in zip(rows.tolist(), maps, strict=True):
            user = dict(pairs)
            try:
                props = self.encoder.properties_for(user, tags.text(row), keys.texts(row), uniq_list[row],
                                                    system=copied)
                topic, queue_id = self.encoder.schedule(names[row], int(queue_ids[row]), props,
                                                        0 if sys_flags is None else int(sys_flags[row]))
            except MessageIllegalError as exc:
                raise type(exc)(f"row {row}: {exc}") from None
            names[row], queue_ids[row] = topic, queue_id
            uniq_list[row] = props[PropertyName.UNIQ_KEY]
            wait_any |= props.get(PropertyName.WAIT, "true").lower() != "false"
            texts[row] = encode_properties(props, checked=True).encode("utf-8") + bytes(reserve)
        lengths = np.fromiter((len(t) for t in texts), dtype=np.int64, count=n)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return offsets, np.frombuffer(b"".join(texts), dtype=np.uint8), names, queue_ids, uniq_list, wait_any

    # --- assembly ------------------------------------------------------------------------------------

    def _assemble_v4(self, sizes, bodies, topic_bytes, topic_index, props_off, props_data, queue_ids, flags,
                     born_ts, born_raw) -> memoryview:
        """The common case (IPv4 hosts, V1 topics): every record written by one compiled loop."""
        from ._kernels import encode_v1

        total = int(sizes.sum())
        out = scratch(total)  # this thread's buffer: the records live until the append copies them
        topic_off = np.zeros(len(topic_bytes) + 1, dtype=np.int64)
        np.cumsum([len(t) for t in topic_bytes], out=topic_off[1:])
        topic_data = np.frombuffer(b"".join(topic_bytes), dtype=np.uint8)
        body_off, body_data = _binary_buffers(bodies)
        host = np.frombuffer(self.encoder.store_host_raw[:8].ljust(8, b"\0"), dtype=np.uint8)
        arr = np.frombuffer(out, dtype=np.uint8)
        try:
            written = encode_v1(arr, sizes, body_off, body_data, props_off, props_data, topic_off, topic_data,
                                np.ascontiguousarray(topic_index, dtype=np.int64), queue_ids, flags, born_ts,
                                born_raw, host)  # (n, 20): the kernel reads the first 8 bytes of a row
        finally:
            del arr
        if written != total:  # the sizes computed above disagree with the pieces: a bug, never a torn record
            raise AssertionError(f"encoded {written} bytes for records whose sizes add up to {total}")
        return out

    def _assemble_general(self, n, sizes, bodies, topic_bytes, topic_index, row_v2, props_off, props_data,
                          queue_ids, flags, sys_flags, born_ts, born_raw, reconsumes, prepareds) -> bytearray:
        """IPv6 hosts or V2 topics, rare layouts: each record through the one record encoder."""
        from .record import encode_record

        out = bytearray()
        bodies_py = bodies.to_pylist()
        props_py = [props_data[props_off[i] : props_off[i + 1]].tobytes() for i in range(n)]
        store = self.encoder.store_host_raw
        for i in range(n):  # rare layouts: the one record encoder
            b_len = 20 if sys_flags[i] & SysFlag.BORNHOST_V6 else 8
            out += encode_record(topic=topic_bytes[topic_index[i]], body=bodies_py[i], properties=props_py[i],
                                 queue_id=int(queue_ids[i]), flag=int(flags[i]), sys_flag=int(sys_flags[i]),
                                 born_timestamp=int(born_ts[i]), born_host=born_raw[i, :b_len].tobytes(),
                                 store_host=store, reconsume_times=int(reconsumes[i]),
                                 prepared_transaction_offset=int(prepareds[i]),
                                 version=MAGIC_V2 if row_v2[i] else MAGIC_V1)
        return out


_NO_BYTES = np.zeros(0, dtype=np.uint8)
_SYS_FLAG_POS, _RECONSUME_POS_V4, _PREPARED_POS_V4 = 36, 72, 76  # in a record with IPv4 hosts


def _set_rare_fields(data, sizes: np.ndarray, sys_flags: np.ndarray, reconsumes: np.ndarray,
                     prepareds: np.ndarray) -> None:
    """SYSFLAG, RECONSUMETIMES and PREPAREDTRANSACTIONOFFSET of the rows that have them (copied messages: a
    compressed body, a retry, a committed transaction), written into the IPv4 records the compiled loop made with
    zeros there; no other byte depends on them (the body CRC is of the stored body)."""
    rows = np.flatnonzero(sys_flags | reconsumes | prepareds)
    if not len(rows):
        return
    starts = np.cumsum(sizes) - sizes
    out = np.frombuffer(data, dtype=np.uint8)
    for row in rows.tolist():
        at = int(starts[row])
        out[at + _SYS_FLAG_POS : at + _SYS_FLAG_POS + 4] = np.frombuffer(int(sys_flags[row]).to_bytes(4, "big"),
                                                                         dtype=np.uint8)
        out[at + _RECONSUME_POS_V4 : at + _RECONSUME_POS_V4 + 4] = np.frombuffer(
            int(reconsumes[row]).to_bytes(4, "big", signed=True), dtype=np.uint8)
        out[at + _PREPARED_POS_V4 : at + _PREPARED_POS_V4 + 8] = np.frombuffer(
            int(prepareds[row]).to_bytes(8, "big", signed=True), dtype=np.uint8)


@dataclass(slots=True)
class _Texts:
    """A string column as Arrow buffers, and which rows carry a value."""

    offsets: np.ndarray
    data: np.ndarray
    present: np.ndarray

    def text(self, row: int) -> str | None:
        if not self.present[row]:
            return None
        return self.data[self.offsets[row] : self.offsets[row + 1]].tobytes().decode("utf-8")


@dataclass(slots=True)
class _Keys:
    """A list<string> column as Arrow buffers (list offsets into string offsets), and which rows have keys."""

    list_offsets: np.ndarray
    offsets: np.ndarray
    data: np.ndarray
    present: np.ndarray

    def texts(self, row: int) -> list[str]:
        if not self.present[row]:
            return []
        return [self.data[self.offsets[j] : self.offsets[j + 1]].tobytes().decode("utf-8")
                for j in range(self.list_offsets[row], self.list_offsets[row + 1])]


def _k():
    from . import _kernels

    return _kernels


@functools.cache
def _plain_orders() -> np.ndarray:
    """For each combination of TAGS and KEYS present (2 * tags + keys), the codes (0 UNIQ_KEY, 1 TAGS, 2 KEYS,
    -1 none) in the Java HashMap order the per-message encoder writes them in."""
    code = {PropertyName.UNIQ_KEY: 0, PropertyName.TAGS: 1, PropertyName.KEYS: 2}
    orders = np.full((4, 3), -1, dtype=np.int64)
    for combo in range(4):
        present = [PropertyName.TAGS] * bool(combo & 2) + [PropertyName.KEYS] * bool(combo & 1) \
            + [PropertyName.UNIQ_KEY]
        for slot, name in enumerate(_cached_order(tuple(present))):
            orders[combo, slot] = code[name]
    return orders


def _binary_buffers(column: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, data) of an Arrow binary column, offsets rebased for a sliced column."""
    offsets = np.frombuffer(column.buffers()[1], dtype=np.int32, count=len(column) + 1, offset=column.offset * 4)
    data_buf = column.buffers()[2]
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, dtype=np.uint8)
    # pyarrow checks only an array's last offset (``from_buffers``); the kernels copy and scan by these offsets
    if len(offsets) and (offsets[0] < 0 or offsets[-1] > data.size or (np.diff(offsets) < 0).any()):
        raise MessageIllegalError(f"a {column.type} column is not a valid Arrow array: its offsets leave its data")
    return offsets, data

"""Encoding a whole table of messages at once: columns in, records back to back out.

The per-message encoder (``rocketstore.encoder``) builds one record with a struct call and a
properties dict per message. Here every step works on whole columns: validation with Arrow compute
kernels (the first bad row is named), UNIQ_KEYs generated as one block, properties strings joined
column-wise for each set of property names, and the records (fixed fields, body CRC, body, topic,
properties) written by one compiled loop (``_kernels.encode_v1``). Only rows that
carry user properties build their properties string one by one, through the same function the
per-message encoder uses, so both produce the same bytes (``tests/test_batch_encode.py`` proves it).

The three fields known only under the put lock (queue offset, physical offset, store time) stay
zero; ``CommitLog.append_batch`` fills them in with numpy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import (
    InvalidFlagError,
    InvalidPropertyError,
    MessageIllegalError,
    MessageTooLargeError,
    PropertiesTooLargeError,
)
from ..message import SysFlag
from .hosts import Host
from .properties import PropertyName, encode_properties, split_keys
from .record import (
    CRC32_RESERVED_LEN,
    FIXED_PART_LEN,
    MAGIC_V1,
    MAGIC_V2,
    MAX_PROPERTIES_LEN,
    MAX_TIME_MS,
    MAX_TOPIC_LEN_V1,
)

_INT32_MAX = (1 << 31) - 1
_HEX = np.frombuffer(b"0123456789ABCDEF", dtype=np.uint8)
OPTIONAL_COLUMNS = ("keys", "tags", "properties", "queue_id", "flag", "born_timestamp", "born_host")


@dataclass(slots=True)
class EncodedBatch:
    """Records ready for ``CommitLog.append_batch``: back to back in ``data``, row order kept."""

    data: bytearray
    sizes: np.ndarray  # int64, per record
    topics: list[str]  # distinct stored topics
    topic_index: np.ndarray  # int32 per row, into ``topics``
    queue_ids: np.ndarray  # int32 per row (stored queue: a delayed message's schedule queue)
    store_ts_pos: np.ndarray  # int64 per row: where STORETIMESTAMP is inside the record
    uniq_keys: pa.StringArray
    wait_store: bool  # some row wants SYNC_FLUSH's wait (WAIT != false)
    queue_checks: list[tuple[str, int]]  # (topic, highest queue id used): the topic rules to apply

    def __len__(self) -> int:
        return len(self.sizes)

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


def _first_true(mask) -> int | None:
    arr = np.asarray(mask.to_numpy(zero_copy_only=False) if isinstance(mask, pa.Array | pa.ChunkedArray) else mask)
    hits = np.flatnonzero(arr)
    return int(hits[0]) if len(hits) else None


def as_array(column) -> pa.Array:
    return column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column


class BatchEncoder:
    """Validates and encodes tables of messages for one store (shares the per-message encoder's state:
    store host, UNIQ_KEY generator, topic cache, limits)."""

    def __init__(self, encoder) -> None:
        self.encoder = encoder
        self.config = encoder.config

    def encode(self, table: pa.Table | pa.RecordBatch) -> EncodedBatch:
        if isinstance(table, pa.RecordBatch):
            table = pa.Table.from_batches([table])
        if not isinstance(table, pa.Table):
            raise MessageIllegalError(f"put_batch takes a pyarrow Table or RecordBatch, not {type(table).__name__}")
        for required in ("topic", "body"):
            if required not in table.column_names:
                raise MessageIllegalError(f"put_batch needs a {required!r} column")
        unknown = set(table.column_names) - {"topic", "body", *OPTIONAL_COLUMNS}
        if unknown:
            raise MessageIllegalError(f"put_batch does not know the column(s) {sorted(unknown)}; "
                                      f"known: topic, body, {', '.join(OPTIONAL_COLUMNS)}")
        n = table.num_rows
        col = {name: as_array(table.column(name)) for name in table.column_names
               if not (pa.types.is_null(table.column(name).type) and name in OPTIONAL_COLUMNS)}
        topics_in, topic_codes = self._topics(col["topic"])
        bodies = self._bodies(col["body"])
        queue_ids = queue_in = self._ints(col, "queue_id", n, 0, (0, _INT32_MAX))
        flags = self._ints(col, "flag", n, 0, (-(1 << 31), _INT32_MAX))
        now = time.time_ns() // 1_000_000
        born_ts = self._ints(col, "born_timestamp", n, now, (-MAX_TIME_MS, MAX_TIME_MS))
        born_raw, born_v6 = self._born_hosts(col.get("born_host"), n)
        tags = self._tags(col.get("tags"), n)
        keys = self._keys(col.get("keys"), n)

        uniq = self._uniq_keys(n, now)
        props, stored_topic_names, queue_ids, uniq, wait_rows = self._properties(
            col.get("properties"), tags, keys, uniq, topics_in, topic_codes, queue_ids)
        props_bytes = props.cast(pa.binary())
        if self.config.enabled_append_prop_crc:
            props_bytes = pc.binary_join_element_wise(props_bytes, pa.scalar(b"\0" * CRC32_RESERVED_LEN), b"")
        props_len = pc.binary_length(props_bytes).to_numpy(zero_copy_only=False).astype(np.int64)
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
        v2 = np.array([self.config.auto_message_version_on_topic_len and len(t) > MAX_TOPIC_LEN_V1
                       for t in stored_topics], dtype=bool)
        row_v2 = v2[topic_index]
        topic_len = np.array([len(b) for b in topic_bytes], dtype=np.int64)[topic_index]
        store_v6 = self.encoder.store_host.is_ipv6
        sys_flags = np.where(born_v6, SysFlag.BORNHOST_V6, 0) | (SysFlag.STOREHOST_V6 if store_v6 else 0)
        body_len = pc.binary_length(bodies).to_numpy(zero_copy_only=False).astype(np.int64)
        sizes = (FIXED_PART_LEN + np.where(born_v6, 12, 0) + (12 if store_v6 else 0) + body_len
                 + np.where(row_v2, 2, 1) + topic_len + 2 + props_len)
        bad = _first_true(sizes > self.encoder.max_record_len)
        if bad is not None:
            raise MessageTooLargeError(f"row {bad}: record is {sizes[bad]} bytes; at most "
                                       f"{self.encoder.max_record_len} fit")
        if store_v6 or born_v6.any() or row_v2.any():
            data = self._assemble_general(n, sizes, bodies, body_len, topic_bytes, topic_index, row_v2, props_bytes,
                                          props_len, queue_ids, flags, sys_flags, born_ts, born_raw)
        else:
            data = self._assemble_v4(n, sizes, bodies, body_len, topic_bytes, topic_index, props_bytes, props_len,
                                     queue_ids, flags, born_ts, born_raw)
        store_ts_pos = np.where(born_v6, 68, 56).astype(np.int64)
        checks = {t: int(queue_in[topic_codes == i].max()) for i, t in enumerate(topics_in)}
        for i, t in enumerate(stored_topics):
            checks[t] = max(checks.get(t, 0), int(queue_ids[topic_index == i].max()))
        return EncodedBatch(data, sizes, stored_topics, topic_index, queue_ids.astype(np.int32), store_ts_pos, uniq,
                            bool(wait_rows), sorted(checks.items()))

    # --- columns -------------------------------------------------------------------------------------

    def _topics(self, column: pa.Array) -> tuple[list[str], np.ndarray]:
        if not pa.types.is_string(column.type) and not pa.types.is_large_string(column.type):
            raise MessageIllegalError(f"column 'topic' must be strings, not {column.type}")
        bad = _first_true(column.is_null())
        if bad is not None:
            raise MessageIllegalError(f"row {bad}: topic is null")
        encoded = column.dictionary_encode()
        names = encoded.dictionary.to_pylist()
        from ..encoder import validate_topic

        codes = encoded.indices.to_numpy(zero_copy_only=False)
        for i, name in enumerate(names):
            try:
                validate_topic(name)
            except MessageIllegalError as exc:
                raise type(exc)(f"row {int(np.argmax(codes == i))}: {exc}") from None
        return names, codes

    def _bodies(self, column: pa.Array) -> pa.Array:
        if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
            column = column.cast(pa.binary())
        if not pa.types.is_binary(column.type) and not pa.types.is_large_binary(column.type):
            raise MessageIllegalError(f"column 'body' must be binary, not {column.type}")
        bad = _first_true(column.is_null())
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
        values = column.fill_null(default).to_numpy(zero_copy_only=False)
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
        encoded = column.cast(pa.string()).dictionary_encode()
        hosts = [Host.parse(text) if text is not None else self.encoder.store_host
                 for text in encoded.dictionary.to_pylist()]
        table = np.zeros((len(hosts) + 1, 20), dtype=np.uint8)
        for i, host in enumerate(hosts):
            b = host.to_bytes()
            table[i, : len(b)] = np.frombuffer(b, dtype=np.uint8)
        table[-1, : len(store)] = np.frombuffer(store, dtype=np.uint8)
        v6 = np.array([h.is_ipv6 for h in hosts] + [self.encoder.store_host.is_ipv6], dtype=bool)
        codes = encoded.indices.fill_null(len(hosts)).to_numpy(zero_copy_only=False)
        return table[codes], v6[codes]

    @staticmethod
    def _check_values(values: pa.Array, what: str, rows: np.ndarray | None = None) -> None:
        """No separator characters and nothing empty (``check_property`` for a whole column)."""
        bad_mask = pc.or_(pc.or_(pc.match_substring(values, "\x01"), pc.match_substring(values, "\x02")),
                          pc.equal(pc.utf8_length(values), 0))
        bad = _first_true(bad_mask.fill_null(False))
        if bad is not None:
            row = int(rows[bad]) if rows is not None else bad
            raise InvalidPropertyError(f"row {row}: {what} {values[bad].as_py()!r} is empty or contains a "
                                       f"separator character (\\x01 or \\x02)")

    def _tags(self, column: pa.Array | None, n: int) -> pa.Array:
        """TAGS per row, null where none (an empty tag is none, as in ``Message``)."""
        if column is None:
            return pa.nulls(n, pa.string())
        if not pa.types.is_string(column.type):
            raise InvalidPropertyError(f"column 'tags' must be strings, not {column.type}")
        column = pc.if_else(pc.equal(column, ""), pa.scalar(None, pa.string()), column)
        self._check_values(column.drop_null(), "tags", np.flatnonzero(column.is_valid().to_numpy(
            zero_copy_only=False)))
        return column

    def _keys(self, column: pa.Array | None, n: int) -> pa.Array:
        """KEYS per row (keys joined by spaces), null where none."""
        if column is None:
            return pa.nulls(n, pa.string())
        if pa.types.is_string(column.type):  # space-separated, as RocketMQ's KEYS property
            column = pa.array([split_keys(text) for text in column.to_pylist()], pa.list_(pa.string()))
        if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)) or \
                not pa.types.is_string(column.type.value_type):
            raise InvalidPropertyError(f"column 'keys' must be list<string> (or space-separated strings), "
                                       f"not {column.type}")
        flat = pc.list_flatten(column)
        parents = pc.list_parent_indices(column).to_numpy(zero_copy_only=False)
        bad_mask = pc.or_(pc.or_(pc.match_substring(flat, " "), pc.match_substring(flat, "\x01")),
                          pc.or_(pc.match_substring(flat, "\x02"), pc.equal(pc.utf8_length(flat), 0)))
        bad = _first_true(bad_mask.fill_null(True))
        if bad is not None:
            raise InvalidPropertyError(f"row {int(parents[bad])}: key {flat[bad].as_py()!r} is empty or contains "
                                       f"a space (the KEYS separator) or a separator character")
        joined = pc.binary_join(column, " ")
        return pc.if_else(pc.equal(pc.list_value_length(column).fill_null(0), 0), pa.scalar(None, pa.string()),
                          joined)

    def _uniq_keys(self, n: int, now: int) -> pa.StringArray:
        raw = self.encoder.uniq_keys.raw_block(n, now)
        return hex_upper(raw)

    def _properties(self, column: pa.Array | None, tags: pa.Array, keys: pa.Array, uniq: pa.StringArray,
                    topics: list[str], topic_codes: np.ndarray, queue_ids: np.ndarray):
        """Properties strings per row, plus what user properties can change: stored topic and queue (DELAY),
        UNIQ_KEY (a user's own), whether any row waits for the disk."""
        n = len(tags)
        has_user = np.zeros(n, dtype=bool)
        if column is not None:
            if not pa.types.is_map(column.type):
                raise InvalidPropertyError(f"column 'properties' must be map<string, string>, not {column.type}")
            has_user = np.diff(column.offsets.to_numpy(zero_copy_only=False)) > 0
        out = self._join_plain(tags, keys, uniq)
        if not has_user.any():
            return out, None, queue_ids, uniq, True  # stored topics are the input topics
        names = [topics[c] for c in topic_codes] if len(topics) > 1 else [topics[0]] * n
        # rows with user properties: the per-message encoder's own rules, row by row
        rows = np.flatnonzero(has_user)
        texts = out.to_pylist()
        uniq_list = uniq.to_pylist()
        queue_ids = queue_ids.copy()
        wait_any = bool((~has_user).any())
        tags_py, keys_py = tags.to_pylist(), keys.to_pylist()
        maps = column.take(pa.array(rows)).to_pylist()
        for row, pairs in zip(rows.tolist(), maps, strict=True):
            user = dict(pairs)
            key_list = keys_py[row].split(" ") if keys_py[row] else []
            try:
                props = self.encoder.properties_for(user, tags_py[row], key_list, uniq_list[row])
                topic, queue_id = self.encoder.schedule(names[row], int(queue_ids[row]), props)
            except MessageIllegalError as exc:
                raise type(exc)(f"row {row}: {exc}") from None
            names[row], queue_ids[row] = topic, queue_id
            uniq_list[row] = props[PropertyName.UNIQ_KEY]
            wait_any |= props.get(PropertyName.WAIT, "true").lower() != "false"
            texts[row] = encode_properties(props, checked=True)
        return pa.array(texts, pa.string()), names, queue_ids, pa.array(uniq_list, pa.string()), wait_any

    def _join_plain(self, tags: pa.Array, keys: pa.Array, uniq: pa.StringArray) -> pa.Array:
        """Properties strings of rows without user properties: TAGS, KEYS, UNIQ_KEY in HashMap order, joined
        column-wise for each combination of present names."""
        n = len(uniq)
        has_tags = tags.is_valid().to_numpy(zero_copy_only=False)
        has_keys = keys.is_valid().to_numpy(zero_copy_only=False)
        combo = has_tags.astype(np.int8) * 2 + has_keys.astype(np.int8)
        result = pa.nulls(n, pa.string())
        values = {PropertyName.TAGS: tags, PropertyName.KEYS: keys, PropertyName.UNIQ_KEY: uniq}
        for code in np.unique(combo):
            present = [PropertyName.TAGS] * bool(code & 2) + [PropertyName.KEYS] * bool(code & 1) \
                + [PropertyName.UNIQ_KEY]
            order = _hashmap_order(tuple(present))
            pieces: list = []
            for name in order:
                pieces += [pa.scalar(f"{name}\x01"), values[name], pa.scalar("\x02")]
            joined = pc.binary_join_element_wise(*pieces, "")
            mask = pa.array(combo == code)
            result = pc.if_else(mask, joined, result)
        return result

    # --- assembly ------------------------------------------------------------------------------------

    def _assemble_v4(self, n, sizes, bodies, body_len, topic_bytes, topic_index, props_bytes, props_len,
                     queue_ids, flags, born_ts, born_raw) -> bytearray:
        """The common case (IPv4 hosts, V1 topics): every record written by one compiled loop."""
        from ._kernels import encode_v1

        total = int(sizes.sum())
        out = bytearray(total)
        topic_off = np.zeros(len(topic_bytes) + 1, dtype=np.int64)
        np.cumsum([len(t) for t in topic_bytes], out=topic_off[1:])
        topic_data = np.frombuffer(b"".join(topic_bytes), dtype=np.uint8)
        body_off, body_data = _binary_buffers(bodies)
        props_off, props_data = _binary_buffers(props_bytes)
        host = np.frombuffer(self.encoder.store_host_raw[:8].ljust(8, b"\0"), dtype=np.uint8)
        arr = np.frombuffer(out, dtype=np.uint8)
        try:
            written = encode_v1(arr, sizes, body_off, body_data, props_off, props_data, topic_off, topic_data,
                                np.ascontiguousarray(topic_index, dtype=np.int64), queue_ids, flags, born_ts,
                                np.ascontiguousarray(born_raw[:, :8]), host)
        finally:
            del arr
        if written != total:  # the sizes computed above disagree with the pieces: a bug, never a torn record
            raise AssertionError(f"encoded {written} bytes for records whose sizes add up to {total}")
        return out

    def _assemble_general(self, n, sizes, bodies, body_len, topic_bytes, topic_index, row_v2, props_bytes,
                          props_len, queue_ids, flags, sys_flags, born_ts, born_raw) -> bytearray:
        """IPv6 hosts or V2 topics, rare layouts: each record through the one record encoder."""
        from .record import encode_record

        out = bytearray()
        bodies_py, props_py = bodies.to_pylist(), props_bytes.to_pylist()
        store = self.encoder.store_host_raw
        for i in range(n):  # rare layouts: the one record encoder
            b_len = 20 if sys_flags[i] & SysFlag.BORNHOST_V6 else 8
            out += encode_record(topic=topic_bytes[topic_index[i]], body=bodies_py[i], properties=props_py[i],
                                 queue_id=int(queue_ids[i]), flag=int(flags[i]), sys_flag=int(sys_flags[i]),
                                 born_timestamp=int(born_ts[i]), born_host=born_raw[i, :b_len].tobytes(),
                                 store_host=store, version=MAGIC_V2 if row_v2[i] else MAGIC_V1)
        return out


def _hashmap_order(names: tuple[str, ...]) -> tuple[str, ...]:
    from .properties import _cached_order

    return _cached_order(names)


def _binary_buffers(column: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, data) of an Arrow binary column, offsets rebased for a sliced column."""
    offsets = np.frombuffer(column.buffers()[1], dtype=np.int32, count=len(column) + 1, offset=column.offset * 4)
    data_buf = column.buffers()[2]
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, dtype=np.uint8)
    return offsets, data

"""The batch decoder (``codec/batch.py``) against the record codec and RocketMQ's golden vectors.

The record codec is the reference: for any bytes, ``decode_range`` must give the rows that
``read_layout`` + ``message_from_layout`` give record by record (every column), and stop where
and why that walk stops (END, BLANK, or DAMAGE with the same error class, offset and reason).
"""

from __future__ import annotations

import base64
import functools
import json
import mmap
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rocketstore import Message, MessageStore, StoreConfig
from rocketstore.codec.batch import MESSAGE_SCHEMA, StopKind, decode_range, message_row, rows_batch, scan_arrow
from rocketstore.codec.hosts import Host
from rocketstore.codec.record import (
    CRC32_RESERVED_LEN,
    MAGIC_V1,
    MAGIC_V2,
    blank_record,
    decode_v4_at,
    encode_record,
    message_from_layout,
    read_layout,
    seal_property_crc,
)
from rocketstore.errors import ChecksumError, CorruptDataError, OffsetOutOfRangeError, StoreClosedError
from rocketstore.message import SysFlag

VECTORS = Path(__file__).resolve().parents[2] / "shared" / "vectors"
SEGMENT_NAME = "00000000000000000000"


# --- the reference: the record codec, one record at a time ------------------------------------------

def reference(buf, start: int, end: int, *, check_crc: bool = True, include_body: bool = True,
              decompress: bool = False, topics=None, limit: int | None = None, broker: str | None = None):
    """(rows, stop kind, stop position, error) exactly as the record codec walks ``buf[start:end]``."""
    limit = len(buf) if limit is None else limit
    pos, rows = start, []
    while pos < min(end, limit):
        try:
            layout = read_layout(buf, pos, limit, check_crc=check_crc)
        except CorruptDataError as exc:
            return rows, StopKind.DAMAGE, pos, exc
        if layout is None:
            return rows, StopKind.BLANK, pos, None
        msg = message_from_layout(buf, pos, layout, read_body=include_body, decompress=decompress)
        if topics is None or msg.topic in topics:
            rows.append(message_row(msg, include_body, broker))
        pos += layout.size
    return rows, StopKind.END, pos, None


def plain(batch: pa.RecordBatch | pa.Table) -> list[dict]:
    """Rows with times as epoch microseconds (datetime cannot hold every int64 a record may carry)."""
    columns = [c.cast(pa.int64()) if pa.types.is_timestamp(c.type) else c for c in batch.columns]
    return pa.table(columns, names=batch.schema.names).to_pylist()


def assert_same_as_reference(buf, start: int, end: int, **kwargs) -> None:
    broker = kwargs.get("broker")
    try:
        rows, kind, pos, error = reference(buf, start, end, **kwargs)
    except CorruptDataError as exc:  # a compressed body that does not inflate: both raise
        kwargs.pop("broker", None)
        with pytest.raises(type(exc)) as raised:
            decode_range(buf, start, end, base=0, broker_name=broker, **kwargs)
        assert raised.value.reason == exc.reason
        return
    kwargs.pop("broker", None)
    batch, stop = decode_range(buf, start, end, base=1 << 30, broker_name=broker, **kwargs)
    assert batch.schema == MESSAGE_SCHEMA
    assert plain(batch) == plain(rows_batch(rows))
    assert (stop.kind, stop.pos, stop.offset) == (kind, pos, (1 << 30) + pos)
    if error is None:
        assert stop.error is None
    else:
        assert type(stop.error) is type(error) and stop.error.reason == error.reason
        assert stop.error.offset == (1 << 30) + pos


# --- generated records ----------------------------------------------------------------------------

V4_HOSTS = [Host("10.0.0.1", 10911), Host("192.168.0.10", 0), Host("255.255.255.255", 65535)]
V6_HOSTS = [Host("2001:db8::1", 10911), Host("::", 1), Host("::ffff:1.2.3.4", 40000), Host("fe80::abcd:0:12", 9)]
TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x01\x02"), max_size=12)
NAMES = st.one_of(st.sampled_from(["KEYS", "TAGS", "UNIQ_KEY", "DELAY", "a"]), TEXT)


@st.composite
def property_bytes(draw) -> bytes:
    """Well-formed strings, and the oddities real stores hold: empty pieces, repeats, bad UTF-8."""
    pieces = []
    for _ in range(draw(st.integers(0, 6))):
        name, value = draw(NAMES), draw(st.one_of(TEXT, st.sampled_from([" a  b ", "k1 k2", " ", "x"])))
        pieces.append(f"{name}\x01{value}\x02".encode())
    if draw(st.booleans()):
        pieces.append(draw(st.sampled_from([b"\x02", b"\x01\x02", b"x\x01\x02", b"\x01y\x02", b"ab", b"a\x01b",
                                            b"KEYS\x01dup\x02", b"\xff\x01\xfe\x02", b"T\x01\xe2\x82\x02",
                                            b"a\x01b\x01c\x02", b"\xed\xa0\x80\x01s\x02", b"TAGS\x01t\x01u\x02",
                                            b"TAGSX\x01no\x02", b"KEYS\x02", b"UNIQ_KE\x01no\x02"])))
    draw(st.randoms()).shuffle(pieces)
    return b"".join(pieces)


@st.composite
def records(draw, phy_offset: int) -> bytes:
    born = draw(st.sampled_from(V4_HOSTS + V6_HOSTS))
    store = draw(st.sampled_from(V4_HOSTS + V6_HOSTS))
    topic = draw(st.one_of(st.sampled_from([b"T", b"TopicTest", "主题".encode(), b"X" * 200, b"\xff\xfe"]),
                           TEXT.map(str.encode)))
    version = MAGIC_V2 if len(topic) > 127 or draw(st.booleans()) else MAGIC_V1
    sys_flag = (0x10 if born.is_ipv6 else 0) | (0x20 if store.is_ipv6 else 0) | draw(st.sampled_from([0, 4, 8, 0xC]))
    # short bodies take the table CRC, long ones zlib's (``_kernels.ZLIB_CRC_MIN``): both paths every run
    body = draw(st.one_of(st.binary(max_size=200), st.binary(min_size=300, max_size=1500)))
    if draw(st.integers(0, 4)) == 0:
        body = zlib.compress(body)
        sys_flag |= SysFlag.COMPRESSED | draw(st.sampled_from([0, SysFlag.COMPRESSION_ZLIB]))
    props = draw(property_bytes())
    sealed = draw(st.integers(0, 5)) == 0
    if sealed:
        props += bytes(CRC32_RESERVED_LEN)
    rec = encode_record(
        topic=topic, body=body, properties=props, queue_id=draw(st.integers(-(1 << 31), (1 << 31) - 1)),
        flag=draw(st.integers(-(1 << 31), (1 << 31) - 1)), sys_flag=sys_flag,
        born_timestamp=draw(st.integers(-(1 << 50), 1 << 50)), born_host=born.to_bytes(),
        store_host=store.to_bytes(), reconsume_times=draw(st.integers(0, 16)),
        prepared_transaction_offset=draw(st.integers(-(1 << 63), (1 << 63) - 1)),
        queue_offset=draw(st.integers(0, 1 << 40)), phy_offset=phy_offset,
        store_timestamp=draw(st.sampled_from([1_700_000_000_000, 0, -1, 1 << 50])), version=version)
    if sealed:
        seal_property_crc(rec, 0, len(rec))
    return bytes(rec)


@st.composite
def segments(draw) -> bytes:
    data = bytearray()
    for _ in range(draw(st.integers(0, 8))):
        data += draw(records(len(data)))
    tail = draw(st.sampled_from(["none", "blank", "zeros"]))
    if tail == "blank":
        extra = draw(st.integers(0, 24))
        data += blank_record(8 + extra) + bytes(extra)  # a BLANK claims exactly the bytes left in the segment
    elif tail == "zeros":
        data += bytes(draw(st.integers(1, 64)))
    if data and draw(st.booleans()):  # damage at a random offset
        i = draw(st.integers(0, len(data) - 1))
        data[i] ^= draw(st.integers(1, 255))
    if data and draw(st.integers(0, 5)) == 0:
        data = data[: draw(st.integers(0, len(data)))]
    return bytes(data)


SETTINGS = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@settings(deadline=None)
@given(data=st.binary(min_size=1, max_size=3000), cut=st.tuples(st.integers(0, 3000), st.integers(0, 3000)))
def test_the_compiled_crc_is_zlibs_on_both_sides_of_its_switch(data, cut):
    """Short spans go through the table, long ones through zlib's own function: each equals ``zlib.crc32``."""
    from rocketstore.codec._kernels import ZLIB_CRC_MIN, crc32

    start, stop = sorted(min(c, len(data)) for c in cut)
    arr = np.frombuffer(data, dtype=np.uint8)
    assert crc32(arr, start, stop - start) == zlib.crc32(data[start:stop])
    assert crc32(arr, 0, len(data)) == zlib.crc32(data)
    long = np.frombuffer(data * (ZLIB_CRC_MIN // len(data) + 1), dtype=np.uint8)
    assert crc32(long, 0, len(long)) == zlib.crc32(long.tobytes())


@SETTINGS
@given(data=segments(), check_crc=st.booleans(), include_body=st.booleans(), decompress=st.booleans())
def test_batch_equals_record_codec_on_every_field(data, check_crc, include_body, decompress):
    assert_same_as_reference(data, 0, len(data), check_crc=check_crc, include_body=include_body,
                             decompress=decompress and include_body)


@SETTINGS
@given(data=segments(), picked=st.lists(st.sampled_from(MESSAGE_SCHEMA.names), min_size=1, max_size=8, unique=True),
       topics=st.none() | st.sets(st.sampled_from(["T", "TopicTest", "主题", "x"])))
def test_a_batch_of_some_columns_is_those_columns_of_the_whole_batch(data, picked, topics):
    """Only the columns asked for are built (the properties found without the map, when it is not asked for),
    in the order asked, and they are the whole batch's, slow rows (merged from the record codec) included."""
    try:
        whole, stop = decode_range(data, 0, len(data), base=0, topics=topics, broker_name="b")
    except CorruptDataError as exc:  # a damaged time: the same typed error either way
        with pytest.raises(type(exc)):
            decode_range(data, 0, len(data), base=0, topics=topics, columns=picked)
        return
    some, some_stop = decode_range(data, 0, len(data), base=0, topics=topics, broker_name="b", columns=picked)
    assert some.schema.names == picked
    assert plain(some) == plain(whole.select(picked))
    assert (some_stop.kind, some_stop.pos) == (stop.kind, stop.pos)


def test_unknown_columns_are_a_typed_error_before_any_read(tmp_path):
    from rocketstore.errors import InvalidQueryError

    with MessageStore.open(tmp_path / "s", StoreConfig(mapped_file_size_commit_log=1 << 20)) as store:
        store.put_message(Message("T", b"x", keys=["k"]))
        for bad, reason in ((["topic", "nope"], "unknown column 'nope'"), ([], "no column"),
                            (["tags", "tags"], "a column twice")):
            with pytest.raises(InvalidQueryError, match=reason):
                store.scan_arrow(columns=bad)
        assert [b.to_pylist() for b in store.scan_arrow(columns="keys")] == [[{"keys": ["k"]}]]


def _layout_path(buf: bytes, pos: int, phy_offset: int, check_crc: bool, read_body: bool):
    """``CommitLog.locate`` + ``message_from_layout``: the message at ``pos`` if a record that says it is at
    ``phy_offset`` starts there, else None."""
    try:
        layout = read_layout(buf, pos, len(buf), check_crc=check_crc)
    except CorruptDataError:
        return None
    if layout is None or int.from_bytes(buf[pos + 28 : pos + 36], "big", signed=True) != phy_offset:
        return None
    return message_from_layout(buf, pos, layout, read_body=read_body)


@SETTINGS
@given(data=segments(), check_crc=st.booleans(), read_body=st.booleans(),
       picks=st.lists(st.integers(0, 1 << 16), max_size=6), shift=st.sampled_from([0, 0, 0, 1, -88, 1 << 40]))
def test_a_single_read_accepts_and_decodes_what_the_layout_path_does(data, check_crc, read_body, picks, shift):
    """``get_message``'s one-pass read (``decode_v4_at``) against read_layout + message_from_layout: at every
    record start and at arbitrary positions, with the right and wrong offsets, on damaged bytes. It gives the
    same message for a record with two IPv4 hosts and None for everything else (the caller then asks
    ``locate``, which names the failure)."""
    starts, pos = [], 0
    while pos < len(data):
        try:
            layout = read_layout(data, pos, len(data))
        except CorruptDataError:
            break
        if layout is None:
            break
        starts.append(pos)
        pos += layout.size
    for pos in starts + [p % len(data) for p in picks if data]:
        phy = pos + shift  # each record was encoded with its position as its offset
        fast = decode_v4_at(data, pos, len(data), phy, check_crc=check_crc, read_body=read_body)
        slow = _layout_path(data, pos, phy, check_crc, read_body)
        expected = slow if slow is not None and not slow.sys_flag & (SysFlag.BORNHOST_V6 | SysFlag.STOREHOST_V6) \
            else None
        assert fast == expected, (pos, shift)  # so a fast form that gave up on everything would fail here


@SETTINGS
@given(props=st.lists(property_bytes(), min_size=1, max_size=5))
def test_dispatch_finds_the_properties_the_full_parse_finds(props):
    """``find_properties`` (dispatch: UNIQ_KEY, TAGS, KEYS only) against ``parse_properties`` (every pair) and
    the record codec's ``decode_properties``, on well-formed and odd property bytes side by side."""
    from rocketstore.codec import _kernels as kernels
    from rocketstore.codec.batch import _NAMES
    from rocketstore.codec.properties import PropertyName, decode_properties

    buf = np.frombuffer(b"".join(props) or b"\0", dtype=np.uint8)
    lengths = np.array([len(p) for p in props], dtype=np.int64)
    positions = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    names = [_NAMES[PropertyName.UNIQ_KEY], _NAMES[PropertyName.TAGS], _NAMES[PropertyName.KEYS]]
    found, found_len = kernels.find_properties(buf, positions, lengths, *names)
    *_, full, full_len = kernels.parse_properties(buf, positions, lengths, *names)
    assert found.tolist() == full.tolist() and found_len.tolist() == full_len.tolist()
    for r, raw in enumerate(props):
        decoded = decode_properties(raw.decode("utf-8", "replace"))
        for slot, name in enumerate((PropertyName.UNIQ_KEY, PropertyName.TAGS, PropertyName.KEYS)):
            value = None if found[slot, r] < 0 else \
                buf[found[slot, r] : found[slot, r] + found_len[slot, r]].tobytes().decode("utf-8", "replace")
            assert value == decoded.get(name)


FIELDS = ("size", "magic", "crc", "phy", "sysflag", "body_len", "body", "topic_len", "props_len", "props")


@SETTINGS
@given(record=records(0).filter(lambda r: not r[36 + 3] & 0x30), where=st.sampled_from(FIELDS),
       byte=st.integers(0, 3), value=st.integers(0, 255), tail=st.binary(max_size=300), check_crc=st.booleans(),
       lead=st.integers(0, 64))
def test_a_single_read_refuses_each_damaged_field_as_the_layout_path_does(record, where, byte, value, tail,
                                                                           check_crc, lead):
    """One field of an IPv4 record overwritten (a length made to run short or long, a wrong magic, offset,
    sysflag, body byte), with bytes after it for a grown length to run into."""
    layout = read_layout(record, 0)
    at = {"size": 0, "magic": 4, "crc": 8, "phy": 28, "sysflag": 36, "body_len": 84, "body": 88,
          "topic_len": layout.topic_pos - (2 if layout.magic == MAGIC_V2 else 1), "props_len": layout.props_pos - 2,
          "props": layout.props_pos}[where] + byte
    buf = bytearray(bytes(lead) + record + tail)  # the record at ``lead``, which its PHYSICALOFFSET says
    buf[lead + 28 : lead + 36] = lead.to_bytes(8, "big")
    if at < len(record):
        buf[lead + at] = value
    data = bytes(buf)
    for check in (check_crc, not check_crc):
        slow = _layout_path(data, lead, lead, check, True)
        expected = slow if slow is not None and not slow.sys_flag & 0x30 else None
        assert decode_v4_at(data, lead, len(data), lead, check_crc=check) == expected


@SETTINGS
@given(data=segments(), cut=st.integers(0, 2000), topics=st.sets(st.sampled_from(["T", "TopicTest", "主题", "x"])))
def test_ranges_topics_and_limits_agree(data, cut, topics):
    """A range end inside the data, a read limit before the buffer end, and a topic filter."""
    end = min(cut, len(data))
    assert_same_as_reference(data, 0, end, topics=topics, broker="broker-a")
    assert_same_as_reference(data, 0, len(data), limit=end)


@SETTINGS
@given(data=segments(), rows=st.integers(1, 3))
def test_limit_stops_resume_where_they_stopped(data, rows):
    """Decoding in batches of ``rows`` records, resuming at each LIMIT stop, gives the whole range."""
    try:
        whole, final = decode_range(data, 0, len(data), base=0)
    except CorruptDataError as exc:  # a damaged time: a typed error either way
        with pytest.raises(type(exc)):
            _decode_in_steps(data, rows)
        return
    batches, stop = _decode_in_steps(data, rows)
    assert plain(pa.Table.from_batches(batches, MESSAGE_SCHEMA)) == plain(whole)
    assert (stop.kind, stop.pos) == (final.kind, final.pos)


def _decode_in_steps(data: bytes, rows: int):
    pos, batches = 0, []
    while True:
        batch, stop = decode_range(data, pos, len(data), base=0, max_rows=rows)
        assert batch.num_rows <= rows
        batches.append(batch)
        if stop.kind is not StopKind.LIMIT:
            break
        assert batch.num_rows == rows
        pos = stop.pos
    return batches, stop


def test_blank_damage_and_end_are_reported_with_the_record_codecs_reasons():
    host = Host("10.0.0.1", 10911).to_bytes()
    one = bytes(encode_record(topic=b"T", body=b"payload", properties=b"KEYS\x01k\x02", queue_id=0, flag=0,
                              sys_flag=0, born_timestamp=1, born_host=host, store_host=host))
    seg = one + one + blank_record(8)
    batch, stop = decode_range(seg, 0, len(seg), base=4096)
    assert batch.num_rows == 2 and stop.kind is StopKind.BLANK and stop.offset == 4096 + 2 * len(one)
    bad = bytearray(seg)
    bad[len(one) + 88 + 3] ^= 0x01  # inside the second body (it starts at byte 88 of the record)
    batch, stop = decode_range(bytes(bad), 0, len(bad), base=0)
    assert batch.num_rows == 1 and stop.kind is StopKind.DAMAGE and stop.pos == len(one)
    assert isinstance(stop.error, ChecksumError) and "CRC" in stop.error.reason
    batch, stop = decode_range(bytes(bad), 0, len(bad), base=0, check_crc=False)
    assert batch.num_rows == 2 and stop.kind is StopKind.BLANK
    batch, stop = decode_range(seg, 0, len(one), base=0)
    assert batch.num_rows == 1 and stop.kind is StopKind.END and stop.pos == len(one)


def test_records_the_fast_path_cannot_render_are_merged_back_in_log_order():
    """Bad UTF-8 (the record codec's 'replace' decode) and compressed bodies (decompress) between plain records."""
    host = Host("10.0.0.1", 10911).to_bytes()
    data = b""
    for topic, props, body, sys_flag in [(b"A", b"KEYS\x01a\x02", b"x", 0), (b"\xffB", b"", b"y", 0),
                                         (b"A", b"K\x01\xfe\x02", b"z", 0), (b"A", b"", zlib.compress(b"big"), 1),
                                         (b"A", b"TAGS\x01t\x02", b"w", 0)]:
        data += bytes(encode_record(topic=topic, body=body, properties=props, queue_id=0, flag=0, sys_flag=sys_flag,
                                    born_timestamp=1, born_host=host, store_host=host, phy_offset=len(data)))
    for kwargs in ({}, {"decompress": True}, {"topics": {"A"}}, {"topics": {"\ufffdB"}}):
        assert_same_as_reference(data, 0, len(data), **kwargs)
    batch, _stop = decode_range(data, 0, len(data), base=0, decompress=True)
    assert batch.column("topic").to_pylist() == ["A", "\ufffdB", "A", "A", "A"]
    assert batch.column("body").to_pylist()[3] == b"big"


def test_a_range_outside_the_buffer_is_a_typed_error():
    host = Host("10.0.0.1", 10911).to_bytes()
    data = bytes(encode_record(topic=b"T", body=b"x", properties=b"", queue_id=0, flag=0, sys_flag=0,
                               born_timestamp=1, born_host=host, store_host=host))
    for start, end, rows in ((-8, len(data), 10), (50, 10, 10), (0, len(data), 0)):
        with pytest.raises(OffsetOutOfRangeError):
            decode_range(data, start, end, base=0, max_rows=rows)
    batch, stop = decode_range(data, 0, 1 << 40, base=0)  # an end past the buffer is clamped to it
    assert batch.num_rows == 1 and stop.kind is StopKind.END


def test_an_mmap_can_be_closed_after_decoding_even_on_damage(tmp_path):
    """No numpy view of the mapping survives a call (mmap.close() refuses while one is exported)."""
    path = tmp_path / "seg"
    path.write_bytes(b"\x00\x00\x01\x00\x12\x34\x56\x78" + bytes(1016))
    with open(path, "rb") as file:
        buf = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    batch, stop = decode_range(buf, 0, 1024, base=0)
    assert batch.num_rows == 0 and stop.kind is StopKind.DAMAGE
    buf.close()


# --- golden vectors made by RocketMQ --------------------------------------------------------------

def _vector(name: str) -> tuple[bytes, list[dict]]:
    folder = VECTORS / name
    if not (folder / SEGMENT_NAME).is_file():
        pytest.skip(f"golden vectors not found at {folder}")
    lines = (folder / ("decode.jsonl")).read_text(encoding="utf-8").splitlines()
    return (folder / SEGMENT_NAME).read_bytes(), [json.loads(line) for line in lines if line.strip()]


def _as_java(row: dict) -> dict:
    return {
        "msgId": row["msgId"], "topic": row["topic"], "queueId": row["queueId"], "flag": row["flag"],
        "queueOffset": row["queueOffset"], "commitLogOffset": row["commitLogOffset"], "sysFlag": row["sysFlag"],
        "bornTimestamp": int(row["bornTimestamp"].timestamp() * 1000), "bornHost": row["bornHost"],
        "storeTimestamp": int(row["storeTimestamp"].timestamp() * 1000), "storeHost": row["storeHost"],
        "reconsumeTimes": row["reconsumeTimes"], "preparedTransactionOffset": row["preparedTransactionOffset"],
        "bodyCRC": row["bodyCRC"], "body": row["body"], "properties": dict(row["properties"]),
        "storeSize": row["storeSize"],
    }


@pytest.mark.parametrize("name", ["v4_commitlog", "v6_commitlog_corrupt"])
def test_golden_vectors_decode_as_rocketmq_and_as_the_record_codec(name):
    data, expected = _vector(name)
    assert_same_as_reference(data, 0, len(data))
    batch, stop = decode_range(data, 0, len(data), base=0)
    records = [e for e in expected if "end" not in e]
    assert len(records) == batch.num_rows
    for row, entry in zip(batch.to_pylist(), records, strict=True):
        want = {key: entry[key] for key in _as_java(row)}
        want["body"] = b"" if entry["body"] is None else base64.b64decode(entry["body"])
        assert _as_java(row) == want
        assert row["uniqKey"] == entry["properties"].get("UNIQ_KEY")
        assert row["tags"] == entry["properties"].get("TAGS")
    last = expected[-1]
    assert stop.pos == last["pos"]
    assert stop.kind is (StopKind.BLANK if last["end"] == "blank" else StopKind.DAMAGE)


def test_golden_v4_decompressed_bodies_fall_back_to_the_record_codec():
    data, _ = _vector("v4_commitlog")
    folder = VECTORS / "v4_commitlog"
    expected = [json.loads(line) for line in (folder / "decode_decompress.jsonl").read_text().splitlines() if line]
    batch, _stop = decode_range(data, 0, len(data), base=0, decompress=True)
    records = [e for e in expected if "end" not in e]
    assert [(r["body"], r["sysFlag"]) for r in batch.to_pylist()] == [
        (b"" if e["body"] is None else base64.b64decode(e["body"]), e["sysFlag"]) for e in records]
    assert any(e["sysFlag"] & SysFlag.COMPRESSED for e in _vector("v4_commitlog")[1] if "end" not in e)


# --- the store: scan_arrow over a real commit log -------------------------------------------------

CONFIG = StoreConfig(mapped_file_size_commit_log=16 << 10)


def _scan_rows(store: MessageStore, **kwargs) -> list[dict]:
    batches = list(scan_arrow(store.commit_log, **kwargs))
    return pa.Table.from_batches(batches, MESSAGE_SCHEMA).to_pylist()


@pytest.mark.parametrize("threads", [0, 1, 2, 3])
def test_scan_arrow_reads_a_store_as_iter_messages_does(tmp_path, threads):
    """With batches built by ``threads`` workers while the caller walks on (0: in the caller): the same rows in
    the same order."""
    _store_rows = functools.partial(_scan_rows, threads=threads)
    with MessageStore.open(tmp_path / "s", CONFIG) as store:
        for i in range(0, 300, 10):
            store.put_messages([Message(f"Topic{j % 3}", b"x" * (j % 97), tags=f"T{j % 2}", keys=[f"k{j}", "g"],
                                        properties={"n": str(j)}, queue_id=j % 4) for j in range(i, i + 10)])
        assert len(store.commit_log.mapped_files.files) > 3  # BLANK records between segments
        expected = rows_batch([message_row(m, True, None) for m in store.iter_messages()]).to_pylist()
        assert _store_rows(store, max_rows=7) == expected
        assert _store_rows(store, topics=["Topic1"]) == [r for r in expected if r["topic"] == "Topic1"]
        middle = expected[100]["commitLogOffset"]
        assert _store_rows(store, begin=middle, end=expected[200]["commitLogOffset"]) == expected[100:200]
        assert [r["body"] for r in _store_rows(store, include_body=False)] == [None] * 300


@pytest.mark.parametrize("threads", [0, 2])
def test_scan_arrow_raises_the_record_codecs_error_after_the_good_records(tmp_path, threads):
    """Damage in an old segment (recovery re-checks only the newest) is met by the scan itself, after every batch
    before it (those the workers build too)."""
    with MessageStore.open(tmp_path / "s", CONFIG) as store:
        results = [store.put_message(Message("T", b"body %d" % i * 20)) for i in range(400)]
    assert len(list((tmp_path / "s" / "commitlog").iterdir())) > 4
    victim = results[5]
    segment = tmp_path / "s" / "commitlog" / SEGMENT_NAME
    data = bytearray(segment.read_bytes())
    layout = read_layout(data, victim.commit_log_offset)
    data[layout.body_pos + 3] ^= 0x40
    segment.write_bytes(bytes(data))
    with MessageStore.open(tmp_path / "s", CONFIG, read_only=True) as store:
        seen = []
        with pytest.raises(ChecksumError) as raised:
            for batch in scan_arrow(store.commit_log, max_rows=2, threads=threads):
                seen += batch.column("commitLogOffset").to_pylist()
        with pytest.raises(ChecksumError) as reference_error:
            list(store.commit_log.iter_layouts(check_crc=True))
        assert _assert_iterations_agree(store.commit_log, check_crc=True) == 5
    assert seen == [r.commit_log_offset for r in results[:5]]
    assert (raised.value.offset, raised.value.reason) == (reference_error.value.offset, reference_error.value.reason)


def _scan_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "rocketstore-scan-build"]


def _many_batches(root) -> MessageStore:
    store = MessageStore.open(root, CONFIG)
    for i in range(0, 400, 50):
        store.put_messages([Message("T", b"b%04d" % j, keys=[f"k{j}"]) for j in range(i, i + 50)])
    return store


def test_a_failed_build_is_raised_in_its_batchs_place_and_stops_the_workers(tmp_path, monkeypatch):
    """A worker's error comes out where its batch would have, never after later batches; no worker outlives it."""
    from rocketstore.codec import batch as batch_codec

    with _many_batches(tmp_path / "s") as store:
        real, calls = batch_codec._Walked.build, []

        def build(self, **kwargs):
            calls.append(int(self.f[0, 0]) if self.f.shape[1] else -1)
            if len(calls) == 4:
                raise MemoryError("no room for the fourth batch")
            return real(self, **kwargs)

        monkeypatch.setattr(batch_codec._Walked, "build", build)
        seen = []
        with pytest.raises(MemoryError, match="fourth"):
            for batch in store.scan_arrow(max_rows=10, threads=2):
                seen += batch.column("body").to_pylist()
        assert seen == [b"b%04d" % j for j in range(30)]
        assert _scan_threads() == []


def test_a_scan_stopped_early_leaves_no_worker_and_no_view_of_the_log(tmp_path):
    """Workers hold views of the segments: a caller that stops (break, close) waits for them, and the store's
    mappings close cleanly afterwards; a scan of one batch starts no thread at all."""
    store = _many_batches(tmp_path / "s")
    try:
        scan = store.scan_arrow(max_rows=10, threads=2)
        first = next(scan)
        assert first.column("body").to_pylist()[0] == b"b0000" and _scan_threads()
        scan.close()
        assert _scan_threads() == []
        mappings = [mapped._mm for mapped in store.commit_log.mapped_files.files if mapped._mm is not None]
    finally:
        store.close()
    assert mappings and all(mm.closed for mm in mappings)  # no exported view was left to refuse the close
    started = []
    real_start = threading.Thread.start
    with MessageStore.open(tmp_path / "one", CONFIG) as store:
        store.put_messages([Message("T", b"x")] * 5)
        threading.Thread.start = lambda self: (started.append(self.name), real_start(self))[1]
        try:
            assert sum(b.num_rows for b in store.scan_arrow(threads=2)) == 5
        finally:
            threading.Thread.start = real_start
    assert "rocketstore-scan-build" not in started


def test_a_scan_that_cannot_start_its_workers_builds_in_the_callers_thread(tmp_path, monkeypatch):
    with _many_batches(tmp_path / "s") as store:
        expected = [b.to_pylist() for b in store.scan_arrow(max_rows=10, threads=0)]
        real_start = threading.Thread.start

        def start(self):
            if self.name == "rocketstore-scan-build":
                raise RuntimeError("can't start new thread")
            return real_start(self)

        monkeypatch.setattr(threading.Thread, "start", start)
        assert [b.to_pylist() for b in store.scan_arrow(max_rows=10, threads=2)] == expected
        assert len(expected) == 40 and _scan_threads() == []


def test_a_ctrl_c_in_a_scan_never_hangs_it_nor_leaves_a_worker(tmp_path, monkeypatch):
    """With ``concurrent.futures``, a KeyboardInterrupt inside a future's ``with`` left its lock held: the worker
    blocked in ``set_result`` and the scan's close joined it forever; one landing in ``Thread.start`` after the
    worker ran left it unlisted, waiting for a job forever (the review of this stop's changes: 1 hang in a few
    hundred interrupted scans). Both, deterministically: a Ctrl-C while the caller waits for a slow build, and one
    inside the second worker's start."""
    import signal

    from rocketstore.codec import batch as batch_codec

    with _many_batches(tmp_path / "s") as store:
        expected = sum(b.num_rows for b in store.scan_arrow(max_rows=10, threads=0))
        real_build, release = batch_codec._Walked.build, threading.Event()

        def slow_build(self, **kwargs):
            release.wait(10)
            return real_build(self, **kwargs)

        def interrupt(signum, frame):
            raise KeyboardInterrupt

        previous = signal.signal(signal.SIGALRM, interrupt)
        try:
            monkeypatch.setattr(batch_codec._Walked, "build", slow_build)
            signal.setitimer(signal.ITIMER_REAL, 0.2)  # the caller is waiting for the first worker's batch then
            threading.Timer(0.5, release.set).start()
            started = time.monotonic()
            with pytest.raises(KeyboardInterrupt):
                for _batch in store.scan_arrow(max_rows=10, threads=2):
                    pass
            assert time.monotonic() - started < 5
            monkeypatch.setattr(batch_codec._Walked, "build", real_build)
            real_start, count = threading.Thread.start, [0]

            def start(self):
                real_start(self)
                if self.name == "rocketstore-scan-build":
                    count[0] += 1
                    if count[0] == 2:  # running, and the Ctrl-C lands before start() returns
                        raise KeyboardInterrupt

            monkeypatch.setattr(threading.Thread, "start", start)
            with pytest.raises(KeyboardInterrupt):
                for _batch in store.scan_arrow(max_rows=10, threads=2):
                    pass
            monkeypatch.setattr(threading.Thread, "start", real_start)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        deadline = time.monotonic() + 5
        while _scan_threads() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _scan_threads() == []
        assert sum(b.num_rows for b in store.scan_arrow(max_rows=10, threads=2)) == expected


def _mappings(store: MessageStore) -> list:
    return [mapped._mm for mapped in store.commit_log.mapped_files.files if mapped._mm is not None]


@pytest.mark.parametrize("threads", [0, 2])
def test_no_scan_keeps_a_segment_mapped_past_close(tmp_path, threads):
    """Views of a segment made a store's close leave it mapped (mmap.close refuses while one is exported, and the
    store goes on): a damage met at the first record of a walk held its range in the frame the error keeps, a
    scan paused between batches held its read-ahead (and served batches after the close), an exception thrown
    into a scan held the range walked next (the review of this stop's changes)."""
    with _many_batches(tmp_path / "s") as store:
        offsets = [m.commit_log_offset for m in store.iter_messages()]
    segment = tmp_path / "s" / "commitlog" / SEGMENT_NAME
    data = bytearray(segment.read_bytes())
    layout = read_layout(data, offsets[10])
    data[layout.body_pos] ^= 0x01  # the 11th record: the first of the second walk of 10
    segment.write_bytes(bytes(data))
    store = MessageStore.open(tmp_path / "s", CONFIG, read_only=True)
    with pytest.raises(ChecksumError) as raised:
        for _batch in store.scan_arrow(max_rows=10, threads=threads):
            pass
    maps = _mappings(store)
    store.close()
    assert raised.value.offset == offsets[10] and all(mm.closed for mm in maps)
    del raised
    store = MessageStore.open(tmp_path / "s", CONFIG, read_only=True)
    scan = store.scan_arrow(max_rows=3, threads=threads)
    assert next(scan).num_rows == 3
    maps = _mappings(store)
    store.close()
    assert all(mm.closed for mm in maps)
    with pytest.raises(StoreClosedError):
        next(scan)
    assert _scan_threads() == []
    store = MessageStore.open(tmp_path / "s", CONFIG, read_only=True)
    scan = store.scan_arrow(max_rows=3, threads=threads)
    next(scan)
    with pytest.raises(KeyError):
        scan.throw(KeyError("thrown"))
    maps = _mappings(store)
    store.close()
    assert all(mm.closed for mm in maps)


def test_a_scan_that_cannot_start_a_worker_tries_once(tmp_path, monkeypatch):
    with _many_batches(tmp_path / "s") as store:
        real_start, attempts = threading.Thread.start, []

        def start(self):
            if self.name == "rocketstore-scan-build":
                attempts.append(1)
                raise RuntimeError("can't start new thread")
            return real_start(self)

        monkeypatch.setattr(threading.Thread, "start", start)
        assert sum(1 for _b in store.scan_arrow(max_rows=10, threads=2)) == 40
        assert len(attempts) == 1


def test_scan_arrow_refuses_a_bad_thread_count(tmp_path):
    from rocketstore.errors import InvalidQueryError

    with MessageStore.open(tmp_path / "s", CONFIG) as store:
        for bad in (-1, 1.5, True, "2", 65):
            with pytest.raises(InvalidQueryError, match="threads"):
                store.scan_arrow(threads=bad)


# --- CommitLog.iter_messages: the compiled walk, one MessageExt per record -------------------------------

def _by_layouts(commit_log, from_offset=None, to_offset=None, *, check_crc: bool, read_body: bool = True):
    """The reference: ``iter_layouts`` (``read_layout`` per record) + ``message_from_layout``, and the error."""
    out = []
    try:
        for mapped, pos, layout in commit_log.iter_layouts(from_offset, to_offset, check_crc=check_crc):
            out.append(message_from_layout(mapped.buffer, pos, layout, read_body=read_body, path=str(mapped.path),
                                           base=mapped.file_from_offset))
    except CorruptDataError as exc:
        return out, exc
    return out, None


def _by_iter_messages(commit_log, from_offset=None, to_offset=None, *, check_crc: bool, read_body: bool = True):
    out: list = []
    try:  # extend keeps what the iterator yielded before it raised
        out.extend(commit_log.iter_messages(from_offset, to_offset, check_crc=check_crc, read_body=read_body))
    except CorruptDataError as exc:
        return out, exc
    return out, None


def _assert_iterations_agree(commit_log, from_offset=None, to_offset=None, **kwargs) -> int:
    expected, expected_error = _by_layouts(commit_log, from_offset, to_offset, **kwargs)
    got, error = _by_iter_messages(commit_log, from_offset, to_offset, **kwargs)
    assert got == expected
    assert [m.msg_id for m in got] == [m.msg_id for m in expected]
    if expected_error is None:
        assert error is None
    else:
        assert type(error) is type(expected_error)
        assert (error.offset, error.reason, error.path) == (expected_error.offset, expected_error.reason,
                                                             expected_error.path)
    return len(expected)


@SETTINGS
@given(data=segments(), check_crc=st.booleans(), read_body=st.booleans(), start=st.integers(0, 3))
def test_iter_messages_equals_the_record_at_a_time_walk(tmp_path_factory, data, check_crc, read_body, start):
    """Generated segments (IPv6 hosts, V2 topics, compressed bodies, sealed properties, BLANKs, damage, torn
    tails) in a commit log of two segments: the same messages in the same order and the same error at the same
    offset, from the first record or from a later one."""
    from rocketstore.commitlog import CommitLog

    size = 16 << 10
    root = tmp_path_factory.mktemp("log")
    (root / "commitlog").mkdir()
    for n, content in enumerate([data, data]):
        (root / "commitlog" / f"{n * size:020d}").write_bytes(content.ljust(size, b"\0"))
    log = CommitLog(root, StoreConfig(mapped_file_size_commit_log=size), read_only=True)
    log.load()
    try:
        for mapped in log.mapped_files.files:
            mapped.wrote_position = len(data)  # as recovery would find a writer's position
        starts = [m.commit_log_offset for m in _by_layouts(log, check_crc=False)[0]]
        begin = starts[start] if start < len(starts) else None
        _assert_iterations_agree(log, begin, check_crc=check_crc, read_body=read_body)
    finally:
        log.close()


def test_iter_messages_reads_a_store_as_the_record_walk_does(tmp_path):
    """Several segments (BLANKs at their ends), runs longer than the walk's 4,096 rows, IPv6 born hosts (the
    general form), bounds inside the log."""
    config = StoreConfig(mapped_file_size_commit_log=1 << 20)
    with MessageStore.open(tmp_path / "s", config) as store:
        n = 20_000
        store.put_batch(pa.table({"topic": [f"T{i % 3}" for i in range(n)],
                                  "body": [b"b%d" % i * (i % 7) for i in range(n)],
                                  "keys": [[f"k{i}"] for i in range(n)],
                                  "born_host": ["[2001:db8::1]:10911" if i % 1000 == 3 else None for i in range(n)]}))
        store.put_messages([Message("T0", b"tail", keys=["k"])])
        log = store.commit_log
        assert len(log.mapped_files.files) >= 2
        for check_crc in (False, True):
            assert _assert_iterations_agree(log, check_crc=check_crc) == n + 1
        middle = [m.commit_log_offset for m in _by_layouts(log, check_crc=False)[0]][5000:15000:9999]
        assert _assert_iterations_agree(log, middle[0], middle[1], check_crc=True, read_body=False) == 9999
        assert sum(1 for m in store.iter_messages() if m.born_host.is_ipv6) == 20


# --- the Spark partition reader on the batch decoder ------------------------------------------------

def test_partition_reader_equals_the_per_record_reader_with_filters_skips_and_dispatch_info(tmp_path):
    """read_range (batch decoder) gives what the record codec + MessageColumns gave: same rows, same
    tagsCode and index-key hashes, same skipped damage, on one range with a time window and topics."""
    from rocketstore.codec.record import find_record_start
    from rocketstore.spark.partitions import LogRange, MessageColumns, ScanOptions, append_message, read_range

    with MessageStore.open(tmp_path / "s", StoreConfig(mapped_file_size_commit_log=1 << 20)) as store:
        results = [store.put_message(Message(f"T{i % 3}", b"b%d" % i * 9, tags=f"tag{i % 4}", keys=[f"k{i}", "g"],
                                             properties={"DELAY": "2"} if i % 7 == 0 else None,
                                             sys_flag=0xC if i % 11 == 0 else 0)) for i in range(300)]
    segment = tmp_path / "s" / "commitlog" / SEGMENT_NAME
    data = bytearray(segment.read_bytes())
    for victim in (results[40], results[41], results[200]):
        data[read_layout(data, victim.commit_log_offset).body_pos] ^= 0x10
    segment.write_bytes(bytes(data))
    end = results[-1].commit_log_offset + results[-1].store_size
    options = ScanOptions(topics=frozenset({"T0", "T2", "SCHEDULE_TOPIC_XXXX"}), on_corrupt="skip",
                          dispatch_info=True, starting_timestamp=results[10].store_timestamp,
                          ending_timestamp=results[290].store_timestamp, corrupt_log=str(tmp_path / "bad"))
    got = pa.Table.from_batches(read_range(LogRange(str(tmp_path / "s"), "b", str(segment), 0, 1 << 20, 0, end, end),
                                           options))

    expected, pos, skipped = MessageColumns(True), 0, []
    while pos < end:
        try:
            layout = read_layout(data, pos, end, check_crc=True)
        except CorruptDataError:
            resume = find_record_start(data, pos + 1, end, 0, 1 << 20)
            skipped.append((pos, resume - pos))
            pos = resume
            continue
        msg = message_from_layout(data, pos, layout)
        pos += layout.size
        if msg.topic in options.topics and results[10].store_timestamp <= msg.store_timestamp \
                < results[290].store_timestamp:
            append_message(expected, msg, "b", options)
    assert plain(got) == plain(expected.batch())
    assert got.num_rows > 100 and {r["topic"] for r in got.to_pylist()} >= {"T0", "T2"}
    # a reader schema without the columns the time window, the dispatch rows and their slow rows read
    picked = ["indexKeyHashes", "queueOffset", "tagsCode", "keys"]
    some = pa.Table.from_batches(read_range(
        LogRange(str(tmp_path / "s"), "b", str(segment), 0, 1 << 20, 0, end, end),
        options.with_schema([(name, {"indexKeyHashes": "array<bigint>", "queueOffset": "bigint", "tagsCode": "bigint",
                                     "keys": "array<string>"}[name]) for name in picked])))
    assert some.schema.names == picked
    assert some.to_pylist() == got.select(picked).to_pylist()
    from rocketstore.spark.partitions import corrupt_report

    assert [(item["offset"], item["bytes"]) for item in corrupt_report(tmp_path / "bad")] == skipped
    assert len(skipped) == 3


def test_stores_of_the_same_name_keep_their_own_corrupt_reports(tmp_path):
    """Brokers' stores are all ``<broker>/store``: a skip scan of several into one report directory kept one
    store's report and dropped the others' (the file was named by the root's last component)."""
    from rocketstore.spark.partitions import LogRange, ScanOptions, corrupt_report, read_range

    options = ScanOptions(on_corrupt="skip", corrupt_log=str(tmp_path / "bad"))
    victims = {}
    for broker in ("brokerA", "brokerB"):
        root = tmp_path / broker / "store"
        with MessageStore.open(root, StoreConfig(mapped_file_size_commit_log=1 << 20)) as store:
            results = [store.put_message(Message("T", b"x%d" % i * 9)) for i in range(20)]
        segment = root / "commitlog" / SEGMENT_NAME
        data = bytearray(segment.read_bytes())
        victim = results[5 if broker == "brokerA" else 7]
        data[read_layout(data, victim.commit_log_offset).body_pos] ^= 0x10
        segment.write_bytes(bytes(data))
        end = results[-1].commit_log_offset + results[-1].store_size
        rows = sum(b.num_rows for b in read_range(LogRange(str(root), broker, str(segment), 0, 1 << 20, 0, end, end),
                                                  options))
        assert rows == 19
        victims[str(segment)] = victim.commit_log_offset
    report = corrupt_report(tmp_path / "bad")
    assert sorted((item["segment"], item["offset"]) for item in report) == sorted(victims.items())


@pytest.mark.parametrize("scheduled", [False, True])
@pytest.mark.parametrize("check_crc", [False, True])
def test_a_rebuilds_columns_from_the_dispatch_walk_alone_equal_the_general_reader(tmp_path, monkeypatch, scheduled,
                                                                                  check_crc):
    """Columns the dispatcher's walk has (a rebuild's) skip decode_range; batches holding a record that needs
    the record codec (scheduled messages here) fall back to it. Same rows, same skipped damage either way."""
    from rocketstore.spark import partitions
    from rocketstore.spark.partitions import DISPATCH_ONLY_COLUMNS, LogRange, ScanOptions, read_range

    with MessageStore.open(tmp_path / "s", StoreConfig(mapped_file_size_commit_log=1 << 20)) as store:
        results = [store.put_message(Message(f"T{i % 3}", b"b%d" % i * 9, tags=f"tag{i % 4}", keys=[f"k{i}", "g"],
                                             properties={"DELAY": "2"} if scheduled and i % 7 == 0 else None,
                                             sys_flag=0xC if i % 11 == 0 else 0)) for i in range(3000)]
    segment = tmp_path / "s" / "commitlog" / SEGMENT_NAME
    data = bytearray(segment.read_bytes())
    data[read_layout(data, results[40].commit_log_offset).body_pos] ^= 0x10  # found only by the CRC check
    data[results[2500].commit_log_offset + 4] ^= 0xFF  # a broken magic: found by every walk
    segment.write_bytes(bytes(data))
    end = results[-1].commit_log_offset + results[-1].store_size
    options = ScanOptions(on_corrupt="skip", check_crc=check_crc, starting_timestamp=results[10].store_timestamp,
                          ending_timestamp=results[2900].store_timestamp, corrupt_log=str(tmp_path / "bad"))
    names = sorted(DISPATCH_ONLY_COLUMNS)
    known = dict(partitions.ddl_fields(partitions.MESSAGE_DDL + partitions.DISPATCH_DDL))
    fast = options.with_schema([(name, known[name]) for name in names])
    general = options.with_schema([(name, known[name]) for name in [*names, "bodyCRC"]])
    whole = LogRange(str(tmp_path / "s"), "b", str(segment), 0, 1 << 20, 0, end, end)
    expected = pa.Table.from_batches(read_range(whole, general)).select(names)
    calls = []
    decode_range = partitions.decode_range
    monkeypatch.setattr(partitions, "decode_range", lambda *a, **kw: calls.append(1) or decode_range(*a, **kw))
    got = pa.Table.from_batches(read_range(whole, fast))
    assert got.to_pylist() == expected.to_pylist() and got.schema == expected.schema
    assert 2500 < got.num_rows < 2900
    assert bool(calls) == scheduled  # the general reader only for the batches with scheduled messages
    calls.clear()  # without dispatch columns decode_range alone is the one walk
    plain = options.with_schema([("topic", "string"), ("queueId", "int")])
    got_plain = pa.Table.from_batches(read_range(whole, plain))
    assert got_plain.to_pylist() == expected.select(["topic", "queueId"]).to_pylist()
    assert calls


@SETTINGS
@given(data=segments(), check_crc=st.booleans(), rows=st.integers(1, 9))
def test_dispatch_fields_equal_the_one_record_path(data, check_crc, rows):
    """``decode_dispatch`` (one compiled pass: fields, topics, tags codes, index hashes) against the record codec's
    ``dispatch_request`` for each record the layout walk accepts, on odd properties, foreign text and damage,
    decoded in steps of ``rows``; the stop is the walk's."""
    from rocketstore.codec.batch import decode_dispatch
    from rocketstore.codec.hashing import index_key_hash
    from rocketstore.dispatch import dispatch_request
    from rocketstore.index.service import build_key, index_keys

    config = StoreConfig()
    want, starts, pos = [], [], 0
    while pos < len(data):
        try:
            layout = read_layout(data, pos, len(data), check_crc=check_crc)
        except CorruptDataError:
            break
        if layout is None:
            break
        want.append(dispatch_request(data, pos, layout, config))
        starts.append(pos)
        pos += layout.size
    got, start = [], 0
    while True:
        batch, stop = decode_dispatch(data, start, len(data), base=0, max_rows=rows, check_crc=check_crc)
        owners = batch.entry_owner.tolist()
        for r in range(len(batch)):
            text = data[batch.pos[r]:batch.pos[r] + batch.size[r]]
            got.append((int(batch.pos[r]), int(batch.phy[r]), int(batch.size[r]), int(batch.queue_id[r]),
                        int(batch.queue_offset[r]), int(batch.sys_flag[r]), int(batch.store_ts[r]),
                        batch.topics[batch.topic_code[r]], bool(batch.slow[r]), int(batch.tags_code[r]),
                        [int(h) for h, o in zip(batch.entry_hash.tolist(), owners, strict=True) if o == r], text))
        if stop.kind is not StopKind.LIMIT:
            break
        start = stop.offset
    assert len(got) == len(want)
    assert [row[0] for row in got] == starts
    for row, req in zip(got, want, strict=True):
        pos_, phy, size, queue_id, queue_offset, sys_flag, store_ts, topic, slow, tags_code, hashes, text = row
        assert (pos_, phy, size, queue_id, queue_offset, sys_flag, store_ts, topic) == (
            pos_, req.commit_log_offset, req.size, req.queue_id, req.queue_offset, req.sys_flag, req.store_timestamp,
            req.topic)
        raw = read_layout(data, pos_, len(data))
        props = data[raw.props_pos:raw.props_pos + raw.props_len]
        foreign = True
        try:
            data[raw.topic_pos:raw.topic_pos + raw.topic_len].decode()
            props.decode()
            foreign = False
        except UnicodeDecodeError:
            pass
        assert slow == foreign, text
        if not slow:
            assert tags_code == req.tags_code
            assert hashes == [index_key_hash(build_key(req.index_topic, key))
                              for key in index_keys(req.uniq_key, req.keys)], props
    assert stop.offset == pos  # where the reference walk stopped


def test_dispatch_numbers_many_topics_and_topics_whose_hashes_collide():
    """The compiled topic table grows past its first size, and topics with one hash ("Aa" and "BB" have the same
    ``hashCode``) stay apart; a topic's number is the same everywhere in the batch."""
    from rocketstore.codec.batch import decode_dispatch

    names = [f"t{i}" for i in range(150)] + ["Aa", "BB", "AaAa", "BBBB", "AaBB", "BBAa", ""]
    order = [names[(7 * i) % len(names)] for i in range(3 * len(names))]
    data = bytearray()
    for topic in order:
        data += encode_record(topic=topic.encode(), body=b"x", properties=b"TAGS\x01t\x02", queue_id=0, flag=0,
                              sys_flag=0, born_timestamp=0, born_host=V4_HOSTS[0].to_bytes(),
                              store_host=V4_HOSTS[0].to_bytes(), reconsume_times=0, prepared_transaction_offset=0,
                              queue_offset=0, phy_offset=len(data), store_timestamp=0, version=MAGIC_V1)
    batch, stop = decode_dispatch(bytes(data), 0, len(data), base=0)
    assert stop.kind is StopKind.END and len(batch) == len(order)
    assert [batch.topics[c] for c in batch.topic_code] == order
    assert sorted(batch.topics) == sorted(names)  # each once


def test_zlibs_crc32_is_found_without_the_usual_soname_or_named_when_missing(monkeypatch):
    import ctypes

    from rocketstore.codec import _kernels

    real = ctypes.CDLL
    tried = []

    def only_the_module(name, *args, **kwargs):
        tried.append(name)
        if name == "libz.so.1":
            raise OSError("libz.so.1: cannot open shared object file")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(ctypes, "CDLL", only_the_module)
    _kernels._register_zlib_crc32()  # through the zlib module's own link to libz
    assert tried[:2] == ["libz.so.1", zlib.__file__]
    data = np.frombuffer(bytes(range(256)) * 4, dtype=np.uint8)
    assert _kernels.crc32(data, 0, len(data)) == zlib.crc32(data.tobytes())

    def nothing(name, *args, **kwargs):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", nothing)
    with pytest.raises(ImportError, match="needs zlib's shared library"):
        _kernels._register_zlib_crc32()
    monkeypatch.undo()
    _kernels._register_zlib_crc32()  # leave the usual registration behind


@pytest.mark.parametrize("before_cut", range(0, 9))
def test_a_record_starting_just_before_a_range_end_is_read_by_that_range(tmp_path, before_cut):
    """The search for a range's first record ended 4 bytes past the range, but a magic lies 4-8 bytes into its
    record: a record starting 1-3 bytes before the end, in a range holding no other start (a long record before
    it), was read by neither range (the review of stop 51's long-record fix)."""
    from rocketstore.spark.partitions import LogRange, ScanOptions, read_range

    config = StoreConfig(mapped_file_size_commit_log=1 << 20)
    with MessageStore.open(tmp_path / "s", config) as store:
        results = [store.put_message(Message("T", b"x" * size)) for size in (100, 200_000, 100, 100)]
    segment = tmp_path / "s" / "commitlog" / f"{0:020d}"
    end = results[-1].commit_log_offset + results[-1].store_size
    starts = [r.commit_log_offset for r in results]
    cut = starts[2] + 4 - before_cut  # the third record starts before_cut - 4 bytes past the cut (or before it)
    options = ScanOptions().with_schema([("commitLogOffset", "bigint")])
    found = []
    for start, stop in zip([0, starts[1] + 1, cut], [starts[1] + 1, cut, end], strict=True):
        r = LogRange(str(tmp_path / "s"), "b", str(segment), 0, 1 << 20, start, stop, end)
        found += [row["commitLogOffset"] for b in read_range(r, options) for row in b.to_pylist()]
    assert found == starts, (cut, starts)


def test_a_blank_in_the_middle_of_a_segment_is_damage_not_its_end(tmp_path):
    """8 bytes that read as a BLANK record (its size the segment's rest) in the middle of a segment hid every
    record after them: a rebuild left them out of every queue and the index and exited 0, dump-log showed the
    segment's end (the fuzz review). A BLANK with an intact record after it is damage now; one followed by a torn
    write's leftovers (no whole record) is still the segment's end."""
    import struct

    from rocketstore import Message, MessageStore, StoreConfig
    from rocketstore.codec.batch import StopKind, decode_range
    from rocketstore.codec.record import BLANK_MAGIC

    config = StoreConfig(mapped_file_size_commit_log=8192, max_hash_slot_num=16, max_index_num=64)
    root = tmp_path / "s"
    with MessageStore.open(root, config) as store:
        results = [store.put_message(Message("T", b"x" * 100, keys=[f"k{i}"])) for i in range(20)]
    segment = root / "commitlog" / f"{0:020d}"
    pristine = segment.read_bytes()
    end = results[-1].commit_log_offset + results[-1].store_size
    at = results[5].commit_log_offset

    data = bytearray(pristine)
    data[at:at + 8] = struct.pack(">ii", len(data) - at, BLANK_MAGIC)
    batch, stop = decode_range(bytes(data), 0, len(data), base=0)
    assert batch.num_rows == 5 and stop.kind is StopKind.DAMAGE and stop.pos == at
    assert "intact record after it" in stop.error.reason
    for max_rows in (2, 3, 5):  # a batch that ends right at the BLANK (5) too: the next would not know the record
        pos, rows = 0, 0  # before it (the second review: the BLANK was taken for the segment's end)
        while True:
            batch, stop = decode_range(bytes(data), pos, len(data), base=0, max_rows=max_rows)
            rows += batch.num_rows
            if stop.kind is not StopKind.LIMIT:
                break
            pos = stop.pos
        assert (rows, stop.kind, stop.pos) == (5, StopKind.DAMAGE, at), max_rows
    segment.write_bytes(bytes(data))
    done = subprocess.run([sys.executable, "-m", "rocketstore.cli.app", "dump-log", str(segment)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1 and "intact record after it" in done.stdout + done.stderr, done.stdout[-500:]
    done = subprocess.run([sys.executable, "-m", "rocketstore.cli.app", "rebuild", "--no-spark", "--store", str(root),
                           "--mapped-file-size-commit-log", "8192", "--max-hash-slot-num", "16", "--max-index-num",
                           "64"], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 1 and "intact record after it" in done.stderr, done.stderr
    from rocketstore.errors import DamagedLogError  # the open: damage (recovery took the rest for a torn tail)

    with pytest.raises(DamagedLogError, match="intact record after it"):
        MessageStore.open(root, config.replace(cut_damaged_log=False))
    assert segment.read_bytes() == bytes(data) and not (root / "recovery").exists()
    with MessageStore.open(root, config, read_only=True) as view:
        assert view.recovery.end_offset == at and view.recovery.resumes_at == at + results[5].store_size

    data = bytearray(pristine)  # the real end: a BLANK, then half of a record a torn write left behind
    data[end:end + 8] = struct.pack(">ii", len(data) - end, BLANK_MAGIC)
    data[end + 8:end + 8 + 60] = pristine[at:at + 60]
    batch, stop = decode_range(bytes(data), 0, len(data), base=0)
    assert batch.num_rows == 20 and stop.kind is StopKind.BLANK and stop.pos == end

    # a broker's store after a power loss: its recovery cut at a torn record without zeroing what followed, wrote
    # on, and closed the segment before records stored earlier (the self-review): the segment's end, not damage
    data = bytearray(pristine)
    cut = results[10].commit_log_offset
    before = results[9].commit_log_offset  # written after the recovery: later than everything left behind
    data[before + 56:before + 64] = struct.pack(">q", results[-1].store_timestamp + 60_000)
    data[cut:cut + 8] = struct.pack(">ii", len(data) - cut, BLANK_MAGIC)
    batch, stop = decode_range(bytes(data), 0, len(data), base=0)
    assert batch.num_rows == 10 and stop.kind is StopKind.BLANK and stop.pos == cut
    segment.write_bytes(bytes(data))
    with MessageStore.open(root, config.replace(cut_damaged_log=False), read_only=True) as view:
        assert view.recovery.stop_reason is None and view.recovery.end_offset == cut


def test_a_segment_cut_short_after_the_plan_is_a_typed_error_naming_it(tmp_path):
    """A segment truncated between a Spark job's planning and its task raised mmap's bare ValueError ("mmap length is
    greater than file size"), naming no file (the Spark kill review)."""
    from rocketstore.spark.partitions import LogRange, ScanOptions, read_range

    with MessageStore.open(tmp_path / "s", StoreConfig(mapped_file_size_commit_log=1 << 20)) as store:
        store.put_messages([Message("T", b"x" * 100) for _ in range(10)])
    segment = tmp_path / "s" / "commitlog" / f"{0:020d}"
    with open(segment, "r+b") as f:
        f.truncate(4096)
    with pytest.raises(CorruptDataError, match="segment is 4096 bytes, expected 1048576") as raised:
        list(read_range(LogRange(str(tmp_path / "s"), "b", str(segment), 0, 1 << 20, 0, 1000, 1000), ScanOptions()))
    assert str(segment) in str(raised.value)

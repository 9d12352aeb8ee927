"""Tests of ``rocketstore.codec`` and ``rocketstore.encoder``.

Three sources of truth, in order of authority:

* the golden vectors in ``../shared/vectors`` (produced by RocketMQ's own Java classes),
* the worked examples of STORE_FORMAT.md §12 (and the rules of §2, §3),
* round-trip and robustness properties checked with Hypothesis.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import struct
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from rocketstore.codec import (
    BLANK_MAGIC,
    MAGIC_V1,
    MAGIC_V2,
    Host,
    UniqKeyGenerator,
    blank_record,
    body_crc,
    create_offset_msg_id,
    decode_offset_msg_id,
    decode_properties,
    decode_record,
    decode_uniq_key,
    encode_properties,
    encode_record,
    index_key_hash,
    java_hashmap_order,
    java_string_hash,
    read_layout,
    tags_hash_code,
)
from rocketstore.codec._kernels import index_key_hash_utf8
from rocketstore.codec.properties import property_value
from rocketstore.codec.record import CRC32_RESERVED_LEN, property_crc_suffix, seal_property_crc
from rocketstore.config import StoreConfig
from rocketstore.encoder import MessageEncoder
from rocketstore.errors import (
    ChecksumError,
    CorruptDataError,
    InvalidFlagError,
    InvalidMessageIdError,
    InvalidPropertyError,
    InvalidTopicError,
    MessageTooLargeError,
    PropertiesTooLargeError,
    RocketStoreError,
    UnsupportedFormatError,
)
from rocketstore.message import Message, MessageExt, SysFlag

VECTORS = Path(__file__).resolve().parents[2] / "shared" / "vectors"
V4_DIR = VECTORS / "v4_commitlog"
V6_DIR = VECTORS / "v6_commitlog_corrupt"
SEGMENT_NAME = "00000000000000000000"

INT32 = (-(1 << 31), (1 << 31) - 1)
INT64 = (-(1 << 63), (1 << 63) - 1)

# One moderate profile for every property-based test: no example database (nothing written to disk).
PROPERTY_SETTINGS = settings(max_examples=200, deadline=None, database=None)


# --- golden vector helpers ------------------------------------------------------------------------

def _load_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _golden_params(folder: Path, name: str, **decode_kwargs: Any) -> list[Any]:
    """One pytest param per line of a golden ``.jsonl`` file, or a single skipped param when it is missing."""
    path = folder / name
    if not path.is_file():
        reason = f"golden vectors not found at {path}"
        return [pytest.param(None, decode_kwargs, id=f"{folder.name}/{name}-missing", marks=pytest.mark.skip(reason))]
    return [pytest.param(entry, decode_kwargs, id=f"{folder.name}/{name}@{entry['pos']}")
            for entry in _load_jsonl(path)]


@cache
def _segment_bytes(folder: Path) -> bytes:
    return (folder / SEGMENT_NAME).read_bytes()


def segment(folder: Path) -> bytes:
    """The commit-log segment of a vector folder (read-only); skips the test when the vectors are absent."""
    if not (folder / SEGMENT_NAME).is_file():
        pytest.skip(f"golden vectors not found at {folder / SEGMENT_NAME}")
    return _segment_bytes(folder)


def golden(folder: Path, name: str) -> list[dict[str, Any]]:
    path = folder / name
    if not path.is_file():
        pytest.skip(f"golden vectors not found at {path}")
    return _load_jsonl(path)


def golden_body(entry: dict[str, Any]) -> bytes:
    """The expected body: base64 in the vectors, ``null`` for an empty body."""
    return b"" if entry["body"] is None else base64.b64decode(entry["body"])


def decoded_as_java_fields(msg: MessageExt) -> dict[str, Any]:
    """A decoded message in the vectors' vocabulary (RocketMQ's ``MessageExt`` names and forms)."""
    return {
        "msgId": msg.msg_id,
        "magicCode": msg.magic_code,
        "topic": msg.topic,
        "queueId": msg.queue_id,
        "flag": msg.flag,
        "queueOffset": msg.queue_offset,
        "commitLogOffset": msg.commit_log_offset,
        "sysFlag": msg.sys_flag,
        "bornTimestamp": msg.born_timestamp,
        "bornHost": str(msg.born_host),
        "bornHostHex": msg.born_host.to_bytes().hex().upper(),
        "storeTimestamp": msg.store_timestamp,
        "storeHost": str(msg.store_host),
        "storeHostHex": msg.store_host.to_bytes().hex().upper(),
        "reconsumeTimes": msg.reconsume_times,
        "preparedTransactionOffset": msg.prepared_transaction_offset,
        "bodyCRC": msg.body_crc,
        "body": msg.body,
        "properties": msg.properties,
        "storeSize": msg.store_size,
    }


def assert_matches_golden(msg: MessageExt | None, entry: dict[str, Any]) -> None:
    assert msg is not None, f"decode_record returned None (blank) at {entry['pos']}"
    actual = decoded_as_java_fields(msg)
    expected = {name: entry[name] for name in actual}
    expected["body"] = golden_body(entry)
    assert actual == expected
    expected_crc = entry["crc32OfBody"] if entry["crc32OfBody"] is not None else 0
    assert body_crc(msg.body) == expected_crc


def check_golden_line(data: bytes, entry: dict[str, Any], decode_kwargs: dict[str, Any]) -> None:
    """A record line must decode exactly; a ``{"end": "blank"}`` line must be the segment's BLANK record."""
    pos = entry["pos"]
    if entry.get("end") == "blank":
        assert decode_record(data, pos, **decode_kwargs) is None
        assert read_layout(data, pos) is None
        assert struct.unpack_from(">ii", data, pos) == (entry["storeSize"], BLANK_MAGIC)
        assert data[pos : pos + 8] == blank_record(entry["storeSize"])
        assert pos + entry["storeSize"] == len(data)  # the blank record runs to the end of the segment
        return
    assert "end" not in entry, entry
    assert_matches_golden(decode_record(data, pos, **decode_kwargs), entry)


# --- 1. golden commit-log vectors -----------------------------------------------------------------

V4_CASES = [
    *_golden_params(V4_DIR, "decode.jsonl"),
    *_golden_params(V4_DIR, "decode_checkcrc.jsonl", check_crc=True),
    *_golden_params(V4_DIR, "decode_decompress.jsonl", decompress=True),
]


@pytest.mark.parametrize(("entry", "decode_kwargs"), V4_CASES)
def test_golden_v4_record_decodes_like_rocketmq(entry, decode_kwargs):
    check_golden_line(segment(V4_DIR), entry, decode_kwargs)


def test_golden_v4_records_are_contiguous_and_read_layout_agrees():
    """Walking the segment by TOTALSIZE visits exactly the golden positions, ending at the BLANK record."""
    data = segment(V4_DIR)
    entries = golden(V4_DIR, "decode.jsonl")
    pos = 0
    for entry in entries:
        assert pos == entry["pos"]
        layout = read_layout(data, pos, check_crc=True)
        if entry.get("end") == "blank":
            assert layout is None
            break
        assert layout is not None
        assert layout.size == entry["storeSize"]
        assert layout.magic == entry["magicCode"]
        assert layout.sys_flag == entry["sysFlag"]
        assert data[layout.body_pos : layout.body_pos + layout.body_len] == golden_body(entry)
        assert data[layout.topic_pos : layout.topic_pos + layout.topic_len].decode() == entry["topic"]
        assert layout.props_pos + layout.props_len == pos + layout.size
        pos += layout.size
    else:
        pytest.fail("decode.jsonl has no blank end line")
    assert len([e for e in entries if "end" not in e]) == 8


def test_golden_zlib_body_decompresses_and_clears_the_compressed_bit():
    data = segment(V4_DIR)
    stored_entry = next(e for e in golden(V4_DIR, "decode.jsonl") if e.get("sysFlag", 0) & SysFlag.COMPRESSED)
    inflated_entry = next(e for e in golden(V4_DIR, "decode_decompress.jsonl") if e["pos"] == stored_entry["pos"])
    raw = decode_record(data, stored_entry["pos"])
    inflated = decode_record(data, stored_entry["pos"], decompress=True)
    assert raw is not None
    assert inflated is not None
    assert raw.sys_flag == stored_entry["sysFlag"] == 0x301
    assert raw.body == golden_body(stored_entry)
    assert inflated.body == zlib.decompress(raw.body) == golden_body(inflated_entry)
    assert inflated.sys_flag == raw.sys_flag & ~SysFlag.COMPRESSED == inflated_entry["sysFlag"]
    assert inflated.body_crc == raw.body_crc == body_crc(raw.body)  # the stored CRC is kept
    assert body_crc(inflated.body) == inflated_entry["crc32OfBody"]


def test_golden_corrupt_first_record_still_decodes():
    data = segment(V6_DIR)
    first = golden(V6_DIR, "decode.jsonl")[0]
    assert first["pos"] == 0
    assert_matches_golden(decode_record(data, 0), first)
    assert_matches_golden(decode_record(data, 0, check_crc=True), first)


@pytest.mark.parametrize("check_crc", [False, True])
def test_golden_corrupt_record_raises_corrupt_data_error_at_its_offset(check_crc):
    data = segment(V6_DIR)
    stop = next(e for e in golden(V6_DIR, "decode.jsonl") if e.get("end") == "decode-returned-null")
    pos = stop["pos"]
    # Java read the same size and magic before giving up.
    assert struct.unpack_from(">ii", data, pos) == (stop["storeSize"], stop["magicCode"])
    with pytest.raises(CorruptDataError) as excinfo:
        decode_record(data, pos, check_crc=check_crc)
    assert excinfo.value.offset == pos
    with pytest.raises(CorruptDataError) as excinfo:
        decode_record(data, pos, check_crc=check_crc, path="commitlog/x", base=1 << 30)
    assert excinfo.value.offset == (1 << 30) + pos
    assert excinfo.value.path == "commitlog/x"


@pytest.mark.parametrize(("entry", "decode_kwargs"), _golden_params(V6_DIR, "decode_from_3rd.jsonl"))
def test_golden_corrupt_file_decodes_again_from_the_third_record(entry, decode_kwargs):
    check_golden_line(segment(V6_DIR), entry, decode_kwargs)


def test_golden_record_truncated_anywhere_raises_corrupt_data_error():
    data = segment(V4_DIR)
    size = golden(V4_DIR, "decode.jsonl")[0]["storeSize"]
    record = data[:size]
    assert decode_record(record) is not None
    for cut in range(size):
        with pytest.raises(CorruptDataError):
            decode_record(record[:cut])
        with pytest.raises(CorruptDataError) as excinfo:
            decode_record(data, 0, cut)
        assert excinfo.value.offset == 0


# --- 2. worked examples of STORE_FORMAT.md §12 ------------------------------------------------------

@pytest.mark.parametrize(
    ("text", "jhash", "key_hash"),
    [
        ("TopicTest#order-1", -1829193424, 1829193424),
        ("polygenelubricants", -(1 << 31), 0),  # Integer.MIN_VALUE maps to 0, never negative
        ("TopicTest#order-achbomgl", -(1 << 31), 0),
        ("TagA", 2598919, 2598919),
        ("Ea#20231001123456", -19583063, 19583063),
        ("FB#20231001123456", -19583063, 19583063),
        ("TopicTest#订单-1", -573861415, 573861415),
        ("T#😀", 4308978, 4308978),  # a surrogate pair counts as two UTF-16 units
        ("", 0, 0),
    ],
)
def test_e1_java_string_hash_and_index_key_hash(text, jhash, key_hash):
    assert java_string_hash(text) == jhash
    assert index_key_hash(text) == key_hash


def test_e1_index_slot_positions():
    assert index_key_hash("TopicTest#order-1") % 5_000_000 == 4193424
    assert index_key_hash("Ea#20231001123456") % 5_000_000 == 4583063
    assert 40 + (index_key_hash("TopicTest#订单-1") % 5_000_000) * 4 == 15445700


def test_tags_hash_code_is_sign_extended_hash():
    code = tags_hash_code("Order_Paid")
    assert code == 0xFFFFFFFFA3D7455D - (1 << 64)
    assert struct.pack(">q", code).hex().upper() == "FFFFFFFFA3D7455D"
    assert tags_hash_code("TagA") == 0x27A807
    assert tags_hash_code(None) == 0
    assert tags_hash_code("") == 0


E2_HEX = """
00 00 00 80 da a3 20 a7 77 d1 89 82 00 00 00 00
00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00
00 00 00 00 00 00 00 00 00 00 01 8b cf e5 68 00
c0 a8 00 0a 00 00 d4 31 00 00 01 8b cf e5 68 7b
c0 a8 00 01 00 00 2a 9f 00 00 00 00 00 00 00 00
00 00 00 00 00 00 00 05 48 65 6c 6c 6f 09 54 6f
70 69 63 54 65 73 74 00 17 4b 45 59 53 01 6f 72
64 65 72 2d 31 02 54 41 47 53 01 54 61 67 41 02
"""  # STORE_FORMAT.md §12 E2, verbatim
E2_FIELDS: dict[str, Any] = {
    "topic": b"TopicTest",
    "body": b"Hello",
    "properties": b"KEYS\x01order-1\x02TAGS\x01TagA\x02",
    "queue_id": 0,
    "flag": 0,
    "sys_flag": 0,
    "born_timestamp": 1700000000000,
    "born_host": Host("192.168.0.10", 54321).to_bytes(),
    "store_host": Host("192.168.0.1", 10911).to_bytes(),
    "store_timestamp": 1700000000123,
}


def test_e2_body_crc_of_hello():
    assert body_crc(b"Hello") == 2010220930
    assert f"{body_crc(b'Hello'):08X}" == "77D18982"
    assert zlib.crc32(b"Hello") == 0xF7D18982  # raw CRC-32: the top bit is masked off
    assert body_crc(b"") == 0


def test_e2_v1_record_is_byte_identical():
    record = encode_record(**E2_FIELDS)
    assert bytes(record) == bytes.fromhex(E2_HEX)
    assert len(record) == 128
    msg = decode_record(bytes(record), check_crc=True)
    assert msg is not None
    assert msg.msg_id == "C0A8000100002A9F0000000000000000"
    assert msg.properties == {"KEYS": "order-1", "TAGS": "TagA"}
    assert msg.body_crc == 2010220930
    assert str(msg.born_host) == "192.168.0.10:54321"
    assert str(msg.store_host) == "192.168.0.1:10911"
    assert msg.store_timestamp == 1700000000123


def test_e2_v2_record_has_new_magic_and_two_byte_topic_length():
    v1 = bytes.fromhex(E2_HEX)
    v2 = bytes(encode_record(**E2_FIELDS, version=MAGIC_V2))
    assert len(v2) == 129
    assert v2[:4] == (129).to_bytes(4, "big")
    assert v2[4:8].hex() == "daa320ab"
    assert v2[8:0x5D] == v1[8:0x5D]
    assert v2[0x5D:0x5F] == b"\x00\x09"
    assert v2[0x5F:] == v1[0x5E:]
    msg = decode_record(v2, check_crc=True)
    assert msg is not None
    assert msg.magic_code == MAGIC_V2
    assert msg.topic == "TopicTest"
    assert msg.store_size == 129


def test_host_bytes_example():
    assert Host("192.168.0.1", 10911).to_bytes().hex().upper() == "C0A8000100002A9F"  # §2.3


@pytest.mark.parametrize(
    ("host", "offset", "msg_id"),
    [
        (Host("192.168.0.1", 10911), 0, "C0A8000100002A9F0000000000000000"),
        (Host("192.168.0.1", 10911), 1073741824, "C0A8000100002A9F0000000040000000"),
        (Host("2001:db8::1", 10911), 128, "20010DB800000000000000000000000100002A9F0000000000000080"),
    ],
)
def test_e4_offset_msg_id(host, offset, msg_id):
    assert create_offset_msg_id(host, offset) == msg_id
    assert create_offset_msg_id(host.to_bytes(), offset) == msg_id
    assert decode_offset_msg_id(msg_id) == (host, offset)
    assert decode_offset_msg_id(msg_id.lower()) == (host, offset)


@pytest.mark.parametrize(
    "bad_id",
    ["", "C0A8000100002A9F00000000000000", "C0A8000100002A9F00000000000000000", "Z0A8000100002A9F0000000000000000",
     "C0A8000100002A9FFFFFFFFFFFFFFFFF"],  # the last one holds a negative offset
)
def test_decode_offset_msg_id_rejects_malformed_ids(bad_id):
    with pytest.raises(InvalidMessageIdError):
        decode_offset_msg_id(bad_id)


def test_e4_blank_record_at_file_end():
    assert blank_record(124) == bytes.fromhex("0000007CCBD43194")
    segment_tail = bytes(8) + blank_record(124) + bytes(116)  # the blank record runs to the end of the file
    assert read_layout(segment_tail, 8) is None
    assert decode_record(segment_tail, 8) is None


@pytest.fixture
def local_tz(monkeypatch):
    """Set the process time zone (``TZ`` + ``time.tzset()``); the original zone is restored afterwards."""

    def set_zone(name: str, hour_at_1700000000: int) -> None:
        monkeypatch.setenv("TZ", name)
        time.tzset()
        if time.localtime(1700000000).tm_hour != hour_at_1700000000:
            pytest.skip(f"time zone {name} is not available (no tz database?)")

    yield set_zone
    monkeypatch.undo()
    time.tzset()


E5_KEY = "0A00000530391B6D3586496ED47B0007"
E5_TIMESTAMP = 1700000000123  # 2023-11-15 06:13:20.123 Asia/Shanghai


@pytest.mark.parametrize("now_ms", [E5_TIMESTAMP + 1, E5_TIMESTAMP + 3_600_000, 1702166400000])  # last: 2023-12-10
def test_e5_decode_uniq_key_in_shanghai(local_tz, now_ms):
    local_tz("Asia/Shanghai", 6)
    info = decode_uniq_key(E5_KEY, now_ms=now_ms)
    assert info.ip == "10.0.0.5"
    assert info.pid == 12345
    assert info.class_loader_hash == 0x1B6D3586
    assert info.timestamp == E5_TIMESTAMP
    assert info.counter == 7


def test_e5_uniq_key_time_depends_on_the_local_time_zone(local_tz):
    local_tz("UTC", 22)
    # 1232000123 ms after 2023-11-01 00:00 UTC instead of Asia/Shanghai: 8 hours later.
    assert decode_uniq_key(E5_KEY, now_ms=1700100000000).timestamp == E5_TIMESTAMP + 8 * 3_600_000


def test_e5_uniq_key_not_earlier_than_now_belongs_to_the_previous_month(local_tz):
    local_tz("Asia/Shanghai", 6)
    # At exactly the decoded time the guess is "previous month": 2023-10-01 + 1232000123 ms.
    assert decode_uniq_key(E5_KEY, now_ms=E5_TIMESTAMP).timestamp == 1696089600000 + 1232000123


def test_uniq_key_generator_round_trips_through_decode(local_tz):
    local_tz("Asia/Shanghai", 6)
    generator = UniqKeyGenerator("10.0.0.5", pid=12345, class_loader_hash=0x1B6D3586)
    key = generator.next(now_ms=E5_TIMESTAMP)
    assert re.fullmatch("[0-9A-F]{32}", key)
    assert key[:28] == E5_KEY[:28]  # ip, pid, loader hash and the time part
    info = decode_uniq_key(key, now_ms=E5_TIMESTAMP + 1)
    assert (info.ip, info.pid, info.class_loader_hash, info.timestamp) == ("10.0.0.5", 12345, 0x1B6D3586, E5_TIMESTAMP)
    second = decode_uniq_key(generator.next(now_ms=E5_TIMESTAMP), now_ms=E5_TIMESTAMP + 1)
    assert second.counter == (info.counter + 1) & 0xFFFF
    v6_key = UniqKeyGenerator("2001:db8::1", pid=1, class_loader_hash=-1).next(now_ms=E5_TIMESTAMP)
    assert len(v6_key) == 56
    assert decode_uniq_key(v6_key, now_ms=E5_TIMESTAMP + 1).ip == "2001:db8::1"


LATE_IN_MONTH_MS = 1701259200000  # 2023-11-29 12:00 UTC: more than 2^31 ms after the 1st in every time zone
NOV_2023_SHANGHAI_MS = 1698768000000  # 2023-11-01 00:00 Asia/Shanghai


def test_uniq_key_generator_wraps_late_in_the_month_like_java(local_tz):
    """Regression: after ~24.86 days the ms since the month start no longer fit an i32.

    Java writes ``(int) (now - startTime)`` (wrapping) and reads the 4 bytes back as unsigned.
    """
    local_tz("Asia/Shanghai", 6)
    generator = UniqKeyGenerator("10.0.0.5", pid=1, class_loader_hash=1)
    key = generator.next(now_ms=LATE_IN_MONTH_MS)
    elapsed = struct.unpack(">i", bytes.fromhex(key)[10:14])[0]
    java_int_cast = struct.unpack(">i", ((LATE_IN_MONTH_MS - NOV_2023_SHANGHAI_MS) & 0xFFFFFFFF).to_bytes(4, "big"))[0]
    assert elapsed == java_int_cast == -1803767296
    assert decode_uniq_key(key, now_ms=LATE_IN_MONTH_MS + 1).timestamp == LATE_IN_MONTH_MS


def test_sealed_property_crc_verifies_and_detects_damage():
    fields = {**E2_FIELDS, "properties": E2_FIELDS["properties"] + bytes(CRC32_RESERVED_LEN)}
    record = encode_record(**fields)
    seal_property_crc(record, 0, len(record))
    crc = zlib.crc32(bytes(record[: len(record) - CRC32_RESERVED_LEN])) & 0x7FFFFFFF
    assert bytes(record[-CRC32_RESERVED_LEN:]) == property_crc_suffix(crc)
    msg = decode_record(bytes(record), check_crc=True, verify_prop_crc=True)
    assert msg is not None
    assert msg.properties == {"KEYS": "order-1", "TAGS": "TagA", "__CRC32#": f"{crc:010d}"[::-1]}
    record[20] ^= 1  # QUEUEOFFSET: outside the body, so only the record CRC can notice
    assert decode_record(bytes(record), check_crc=True) is not None
    with pytest.raises(ChecksumError):
        decode_record(bytes(record), check_crc=True, verify_prop_crc=True)
    with pytest.raises(ChecksumError):  # no __CRC32# property at all
        decode_record(bytes.fromhex(E2_HEX), check_crc=True, verify_prop_crc=True)


@pytest.mark.parametrize(
    ("crc", "suffix"),
    [
        (2010220930, b"__CRC32#\x010390220102\x02"),
        (0, b"__CRC32#\x010000000000\x02"),
        (123456789, b"__CRC32#\x019876543210\x02"),
    ],
)
def test_e6_property_crc_suffix(crc, suffix):
    assert property_crc_suffix(crc) == suffix
    assert len(suffix) == 20


# --- 3. properties ----------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", {}),
        ("a\x01b\x02", {"a": "b"}),
        ("a\x01b", {"a": "b"}),  # no trailing separator: the last piece runs to the end
        ("KEYS\x01k1 k2\x02TAGS\x01TagA", {"KEYS": "k1 k2", "TAGS": "TagA"}),
        ("ab\x02", {}),  # piece shorter than 3 characters
        ("a\x01\x02b\x01c\x02", {"b": "c"}),  # "a\x01" is too short
        ("\x01ab\x02", {}),  # empty name
        ("ab\x01\x02", {}),  # empty value
        ("emptyVal\x01\x02KEYS\x01k\x02", {"KEYS": "k"}),  # as in the golden delay record
        ("abc\x02d\x01e\x02", {"d": "e"}),  # "abc": its \x01 search finds one only in a later piece
        ("abc\x02d\x01e", {"d": "e"}),
        ("k\x01v1\x02k\x01v2\x02", {"k": "v2"}),  # a repeated name keeps its last value
        ("a\x01b\x01c\x02", {"a": "b\x01c"}),  # the first \x01 splits
        ("\x02\x02\x02", {}),
        ("键\x01值😀\x02", {"键": "值😀"}),  # character indexes, not bytes
    ],
)
def test_decode_properties_follows_rocketmq_parsing(text, expected):
    assert decode_properties(text) == expected


def _string2message_properties(text: str) -> dict[str, str]:
    """MessageDecoder.string2messageProperties as Java writes it: index arithmetic over the whole string."""
    result: dict[str, str] = {}
    index = 0
    while index < len(text):
        end = text.find("\x02", index)
        end = len(text) if end < 0 else end
        if end - index >= 3:
            sep = text.find("\x01", index)
            if index < sep < end - 1:
                result[text[index:sep]] = text[sep + 1 : end]
        index = end + 1
    return result


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet=st.sampled_from(["\x01", "\x02", "a", "b", "键", "😀"]), max_size=40))
def test_decode_properties_equals_rocketmqs_index_loop(text):
    assert decode_properties(text) == _string2message_properties(text)


@settings(max_examples=800, deadline=None)
@given(st.lists(st.sampled_from(["\x01", "\x02", "K", "EY", "S", "KEYS\x01", "a", " "]), max_size=30).map("".join),
       st.sampled_from(["K", "KEY", "KEYS", "EY", "a", "Ka"]))
@example("KEYS\x01a a", "KEYS")  # one KEYS value with a space: "a a" is no key, "a" is
@example("KEYS\x01a\x02KEYS\x01\x02", "KEYS")  # the last KEYS is empty: the earlier one counts
def test_property_value_is_the_parsed_maps_value(text, name):
    """One value read from the text (what a key query checks) == the full parse's: the last pair wins, an empty
    value falls back to an earlier one, a name inside another name or a value never matches."""
    assert property_value(text, name) == decode_properties(text).get(name)
    ext = MessageExt("T", b"", 0, 0, 0, 0, 0, 0, None, 0, None, 0, 0, 0, text, 0, "ID")
    parsed = MessageExt("T", b"", 0, 0, 0, 0, 0, 0, None, 0, None, 0, 0, 0, decode_properties(text), 0, "ID")
    for key in ("a", "a a", "K", "EY", ""):
        assert ext.has_key(key) == (key in parsed.keys) == parsed.has_key(key)
    assert (ext.keys, ext.tags, ext.uniq_key) == (parsed.keys, parsed.tags, parsed.uniq_key)
    assert ext == parsed and ext.properties == parsed.properties  # the text is parsed on first use


@pytest.mark.parametrize(
    "properties",
    [{"a\x01": "b"}, {"a": "b\x01"}, {"a\x02b": "c"}, {"a": "b\x02"}, {"": "v"}, {"k": ""}, {"ok": "1", "k": ""}],
)
def test_encode_properties_rejects_values_that_would_not_round_trip(properties):
    with pytest.raises(InvalidPropertyError):
        encode_properties(properties)


def test_encode_properties_format_and_order():
    props = {"KEYS": "k", "TAGS": "t", "UNIQ_KEY": "u", "WAIT": "true", "CLUSTER": "c"}
    assert encode_properties({"KEYS": "k", "TAGS": "t"}, java_order=False) == "KEYS\x01k\x02TAGS\x01t\x02"
    assert encode_properties(props) == "UNIQ_KEY\x01u\x02CLUSTER\x01c\x02TAGS\x01t\x02KEYS\x01k\x02WAIT\x01true\x02"
    assert encode_properties({}) == ""


def test_java_hashmap_order_spec_example():
    names = ["KEYS", "TAGS", "UNIQ_KEY", "WAIT", "CLUSTER"]
    assert java_hashmap_order(names) == ["UNIQ_KEY", "CLUSTER", "TAGS", "KEYS", "WAIT"]
    assert java_hashmap_order(reversed(names)) == ["CLUSTER", "UNIQ_KEY", "TAGS", "KEYS", "WAIT"]  # bucket 28 twice


def _order_for_capacity(names: list[str], capacity: int) -> list[str]:
    def bucket(name: str) -> int:
        h = java_string_hash(name) & 0xFFFFFFFF
        return (h ^ (h >> 16)) & (capacity - 1)

    return sorted(names, key=bucket)


@pytest.mark.parametrize(("initial", "count", "capacity"), [(16, 12, 16), (16, 13, 32), (128, 96, 128), (128, 97, 256)])
def test_java_hashmap_order_resizes_past_three_quarters(initial, count, capacity):
    """HashMap resizes when its size exceeds 0.75 x capacity: 13 names need 32 buckets, 97 names need 256."""
    names = [f"prop{i}" for i in range(count)]
    assert _order_for_capacity(names, capacity) != _order_for_capacity(names, capacity // 2)
    assert java_hashmap_order(names, initial_capacity=initial) == _order_for_capacity(names, capacity)


def _stored_property_names(data: bytes, pos: int) -> list[str]:
    layout = read_layout(data, pos)
    assert layout is not None
    text = data[layout.props_pos : layout.props_pos + layout.props_len].decode()
    return [piece.split("\x01", 1)[0] for piece in text.split("\x02") if piece]


def test_golden_properties_are_stored_in_hashmap_order():
    data = segment(V4_DIR)
    assert _stored_property_names(data, 0) == ["KEYS", "UNIQ_KEY", "TAGS"]
    assert java_hashmap_order(["KEYS", "TAGS", "UNIQ_KEY"], initial_capacity=16) == ["KEYS", "UNIQ_KEY", "TAGS"]
    # Every golden record's stored order is a HashMap(16) iteration order (sorting it again changes nothing).
    for entry in golden(V4_DIR, "decode.jsonl"):
        if "end" not in entry:
            names = _stored_property_names(data, entry["pos"])
            assert java_hashmap_order(names, initial_capacity=16) == names


# --- 4. property-based round trips --------------------------------------------------------------------

TOPIC_ALPHABET = "%|abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-"
PROPERTY_TEXT = st.text(st.characters(codec="utf-8", exclude_characters="\x01\x02"), min_size=1, max_size=30)
PROPERTY_DICTS = st.dictionaries(PROPERTY_TEXT, PROPERTY_TEXT, max_size=8)
I32 = st.integers(*INT32)
I64 = st.integers(*INT64)
# Hosts as decoding produces them (from raw bytes), so they are in the one canonical spelling.
HOSTS = st.builds(lambda address, port: Host.from_bytes(address.packed + port.to_bytes(4, "big")),
                  st.ip_addresses(), st.integers(0, 0xFFFF))
SYS_FLAGS = st.builds(
    lambda tx, bits, kind: tx | bits | kind,
    st.sampled_from([SysFlag.TRANSACTION_NOT_TYPE, SysFlag.TRANSACTION_PREPARED_TYPE,
                     SysFlag.TRANSACTION_COMMIT_TYPE, SysFlag.TRANSACTION_ROLLBACK_TYPE]),
    st.sampled_from([0, SysFlag.COMPRESSED, SysFlag.MULTI_TAGS, SysFlag.COMPRESSED | SysFlag.MULTI_TAGS]),
    st.sampled_from([0, SysFlag.COMPRESSION_LZ4, SysFlag.COMPRESSION_ZSTD, SysFlag.COMPRESSION_ZLIB]),
)


@dataclass(frozen=True)
class RecordCase:
    """The inputs of one ``encode_record`` call and the record it produced."""

    fields: dict[str, Any]
    properties: dict[str, str]
    born_host: Host
    store_host: Host
    data: bytes

    @property
    def topic(self) -> str:
        return self.fields["topic"].decode()


@st.composite
def record_cases(draw: st.DrawFn) -> RecordCase:
    # Half the topics are long enough to need the V2 magic (plain text() would almost never draw > 127 chars).
    topic = draw(st.one_of(st.text(TOPIC_ALPHABET, min_size=1, max_size=127),
                           st.text(TOPIC_ALPHABET, min_size=128, max_size=300)))
    properties = draw(PROPERTY_DICTS)
    born_host, store_host = draw(HOSTS), draw(HOSTS)
    sys_flag = draw(SYS_FLAGS)
    if born_host.is_ipv6:
        sys_flag |= SysFlag.BORNHOST_V6
    if store_host.is_ipv6:
        sys_flag |= SysFlag.STOREHOST_V6
    fields = {
        "topic": topic.encode(),
        "body": draw(st.binary(max_size=2000)),
        "properties": encode_properties(properties).encode(),
        "queue_id": draw(I32),
        "flag": draw(I32),
        "sys_flag": sys_flag,
        "born_timestamp": draw(I64),
        "born_host": born_host.to_bytes(),
        "store_host": store_host.to_bytes(),
        "reconsume_times": draw(I32),
        "prepared_transaction_offset": draw(I64),
        "queue_offset": draw(I64),
        "phy_offset": draw(I64),
        "store_timestamp": draw(I64),
        "version": MAGIC_V2 if len(topic) > 127 else MAGIC_V1,
    }
    return RecordCase(fields, properties, born_host, store_host, bytes(encode_record(**fields)))


def assert_decodes_to_case(msg: MessageExt | None, case: RecordCase) -> None:
    f = case.fields
    assert msg is not None
    assert msg.topic == case.topic
    assert msg.body == f["body"]
    assert msg.properties == case.properties
    assert msg.queue_id == f["queue_id"]
    assert msg.flag == f["flag"]
    assert msg.sys_flag == f["sys_flag"]
    assert msg.born_timestamp == f["born_timestamp"]
    assert msg.born_host == case.born_host
    assert msg.born_host.to_bytes() == f["born_host"]
    assert msg.store_timestamp == f["store_timestamp"]
    assert msg.store_host == case.store_host
    assert msg.store_host.to_bytes() == f["store_host"]
    assert msg.reconsume_times == f["reconsume_times"]
    assert msg.prepared_transaction_offset == f["prepared_transaction_offset"]
    assert msg.queue_offset == f["queue_offset"]
    assert msg.commit_log_offset == f["phy_offset"]
    assert msg.body_crc == body_crc(f["body"])
    assert msg.store_size == len(case.data)
    assert msg.magic_code == f["version"]
    assert msg.msg_id == create_offset_msg_id(f["store_host"], f["phy_offset"])


@PROPERTY_SETTINGS
@given(case=record_cases(), prefix=st.integers(0, 40), suffix=st.binary(max_size=16))
def test_record_round_trip(case, prefix, suffix):
    f = case.fields
    expected_size = (88 + 12 * (case.born_host.is_ipv6 + case.store_host.is_ipv6) + len(f["body"])
                     + (2 if f["version"] == MAGIC_V2 else 1) + len(f["topic"]) + 2 + len(f["properties"]))
    assert len(case.data) == expected_size
    buf = bytes(prefix) + case.data + suffix  # the record sits inside a larger buffer
    assert_decodes_to_case(decode_record(buf, prefix, check_crc=True), case)
    layout = read_layout(buf, prefix, check_crc=True)
    assert layout is not None
    assert layout.size == len(case.data)
    assert layout.magic == f["version"]
    assert layout.sys_flag == f["sys_flag"]
    assert buf[layout.body_pos : layout.body_pos + layout.body_len] == f["body"]
    assert buf[layout.topic_pos : layout.topic_pos + layout.topic_len] == f["topic"]
    assert buf[layout.props_pos : layout.props_pos + layout.props_len] == f["properties"]
    assert layout.props_pos + layout.props_len == prefix + layout.size
    if f["phy_offset"] >= 0:
        assert decode_offset_msg_id(create_offset_msg_id(case.store_host, f["phy_offset"])) == (
            case.store_host, f["phy_offset"])


def _expect_only_store_errors(buf: bytes, **kwargs: Any) -> MessageExt | None:
    """Decode damaged bytes: the result may be anything, but the only exceptions allowed are rocketstore's."""
    try:
        return decode_record(buf, **kwargs)
    except RocketStoreError:
        return None


@PROPERTY_SETTINGS
@given(case=record_cases(), data=st.data())
def test_single_byte_mutation_raises_only_rocketstore_errors(case, data):
    layout = read_layout(case.data, 0)
    assert layout is not None
    # Pick the damaged region first, so the body and the variable tail are hit as often as the header.
    regions = {"header": (0, layout.body_pos), "tail": (layout.body_pos + layout.body_len, len(case.data))}
    if layout.body_len:
        regions["body"] = (layout.body_pos, layout.body_pos + layout.body_len)
    low, high = regions[data.draw(st.sampled_from(sorted(regions)), label="region")]
    index = data.draw(st.integers(low, high - 1), label="index")
    buf = bytearray(case.data)
    buf[index] ^= data.draw(st.integers(1, 255), label="xor")
    damaged = bytes(buf)
    padded = damaged + bytes(256)  # room for a TOTALSIZE that grew
    for target in (damaged, padded):
        _expect_only_store_errors(target)
        _expect_only_store_errors(target, decompress=True, max_body_size=1 << 16)
        _expect_only_store_errors(target, check_crc=True, verify_prop_crc=True)
        with contextlib.suppress(RocketStoreError):
            read_layout(target, 0, check_crc=True)
    if index < 4:  # TOTALSIZE no longer matches the parts: a "half message"
        for target in (damaged, padded):
            with pytest.raises(CorruptDataError):
                decode_record(target)
    if layout.body_pos <= index < layout.body_pos + layout.body_len:
        damaged_body = damaged[layout.body_pos : layout.body_pos + layout.body_len]
        if body_crc(damaged_body) != body_crc(case.fields["body"]):
            with pytest.raises(ChecksumError):
                decode_record(damaged, check_crc=True)
        msg = decode_record(damaged)
        assert msg is not None
        assert msg.body == damaged_body


MINIMAL_RECORD = bytes(encode_record(**{**E2_FIELDS, "topic": b"T", "body": b"", "properties": b""}))  # 92 bytes


@pytest.mark.parametrize("record", [MINIMAL_RECORD, bytes.fromhex(E2_HEX)], ids=["minimal-92", "e2-128"])
def test_every_single_byte_mutation_of_small_records_raises_only_rocketstore_errors(record):
    """Exhaustive: every position x every byte value. Small records put every length check near a boundary."""
    assert decode_record(record) is not None
    for index in range(len(record)):
        damaged = bytearray(record)
        for value in range(256):
            damaged[index] = value
            _expect_only_store_errors(damaged, decompress=True)


@pytest.mark.parametrize("v6_bits", [SysFlag.BORNHOST_V6, SysFlag.STOREHOST_V6,
                                     SysFlag.BORNHOST_V6 | SysFlag.STOREHOST_V6])
def test_v6_bits_on_a_record_too_short_for_ipv6_hosts_are_corrupt(v6_bits):
    damaged = bytearray(MINIMAL_RECORD)
    struct.pack_into(">i", damaged, 36, v6_bits)
    with pytest.raises(CorruptDataError):
        decode_record(bytes(damaged))


@pytest.mark.parametrize("size", [0, 4, 8, 12, 36, 40, 47, 84, 90])
def test_record_claiming_fewer_bytes_than_its_header_is_corrupt(size):
    buf = struct.pack(">ii", size, MAGIC_V1) + bytes(max(size - 8, 0))
    with pytest.raises(CorruptDataError) as excinfo:
        decode_record(buf)
    assert excinfo.value.offset == 0


def test_record_with_grown_total_size_is_rejected_even_when_bytes_follow():
    record = bytearray.fromhex(E2_HEX) + bytes(64)
    struct.pack_into(">i", record, 0, 136)
    with pytest.raises(CorruptDataError) as excinfo:
        decode_record(bytes(record))
    assert excinfo.value.offset == 0


def test_v1_topic_length_is_a_signed_byte():
    """A V1 record with a 128..255-byte topic is unreadable for RocketMQ (it reads the length as a signed byte)."""
    record = encode_record(**{**E2_FIELDS, "topic": b"x" * 200}, version=MAGIC_V1)
    with pytest.raises(CorruptDataError):
        decode_record(bytes(record))
    as_v2 = encode_record(**{**E2_FIELDS, "topic": b"x" * 200}, version=MAGIC_V2)
    assert decode_record(bytes(as_v2)).topic == "x" * 200


def test_golden_record_with_a_damaged_body_fails_only_the_crc_check():
    data = bytearray(segment(V4_DIR)[:184])
    layout = read_layout(data, 0)
    assert layout is not None
    data[layout.body_pos] ^= 0x20
    assert decode_record(bytes(data)).body[:1] == b"h"  # "Hello ..." became "hello ..."
    with pytest.raises(ChecksumError) as excinfo:
        decode_record(bytes(data), check_crc=True)
    assert excinfo.value.offset == 0


def _compressed_record(body: bytes, sys_flag: int) -> bytes:
    return bytes(encode_record(**{**E2_FIELDS, "body": body, "sys_flag": sys_flag}))


@pytest.mark.parametrize("sys_flag", [SysFlag.COMPRESSED, SysFlag.COMPRESSED | SysFlag.COMPRESSION_ZLIB])
def test_decompress_zlib_bodies(sys_flag):
    original = b"abcdefg" * 300
    msg = decode_record(_compressed_record(zlib.compress(original), sys_flag), check_crc=True, decompress=True)
    assert msg.body == original
    assert msg.sys_flag == sys_flag & ~SysFlag.COMPRESSED
    with pytest.raises(CorruptDataError):  # inflates beyond the bound
        decode_record(_compressed_record(zlib.compress(original), sys_flag), decompress=True, max_body_size=100)
    with pytest.raises(CorruptDataError):
        decode_record(_compressed_record(b"not zlib at all", sys_flag), decompress=True)
    assert decode_record(_compressed_record(b"not zlib at all", sys_flag)).body == b"not zlib at all"


def test_decompress_unknown_compression_type_is_unsupported():
    with pytest.raises(UnsupportedFormatError):
        decode_record(_compressed_record(b"xyz", SysFlag.COMPRESSED | 0x400), decompress=True)


@PROPERTY_SETTINGS
@given(case=record_cases(), data=st.data())
def test_truncated_record_raises_corrupt_data_error(case, data):
    cut = data.draw(st.integers(0, len(case.data) - 1), label="cut")
    for kwargs in ({}, {"check_crc": True}):
        with pytest.raises(CorruptDataError) as excinfo:
            decode_record(case.data[:cut], **kwargs)
        assert excinfo.value.offset == 0
        with pytest.raises(CorruptDataError):
            decode_record(case.data, 0, cut, **kwargs)
        with pytest.raises(CorruptDataError):
            read_layout(case.data[:cut], 0, **kwargs)


def reference_java_hash(text: str) -> int:
    data = text.encode("utf-16-be", "surrogatepass")
    h = 0
    for (unit,) in struct.iter_unpack(">H", data):
        h = (h * 31 + unit) % (1 << 32)
    return h - (1 << 32) if h >= 1 << 31 else h


JAVA_HASH_TEXT = st.text(st.one_of(st.characters(), st.sampled_from("😀🚀𝄞中文é")), max_size=60)


@PROPERTY_SETTINGS
@given(text=JAVA_HASH_TEXT)
def test_java_string_hash_matches_utf16_reference(text):
    h = java_string_hash(text)
    assert h == reference_java_hash(text)
    assert INT32[0] <= h <= INT32[1]
    assert index_key_hash(text) == (0 if h == INT32[0] else abs(h))
    assert index_key_hash(text) >= 0


@PROPERTY_SETTINGS
@given(text=st.text(st.one_of(st.characters(), st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),
                              st.sampled_from("😀🚀𝄞中文é#")), max_size=60))
def test_compiled_query_key_hash_equals_index_key_hash(text):
    """A query hashes its ``topic#key`` in compiled code from UTF-8 (lone surrogates as surrogatepass writes
    them): the same slot and entry hash as the Python hash the dispatcher's index entries agree with."""
    assert index_key_hash_utf8(text.encode("utf-8", "surrogatepass")) == index_key_hash(text)


@PROPERTY_SETTINGS
@given(properties=PROPERTY_DICTS)
def test_properties_round_trip(properties):
    encoded = encode_properties(properties)
    assert decode_properties(encoded) == properties
    assert decode_properties(encode_properties(properties, java_order=False)) == properties
    assert encoded == "".join(f"{name}\x01{properties[name]}\x02" for name in java_hashmap_order(properties))
    assert sorted(java_hashmap_order(properties)) == sorted(properties)


@PROPERTY_SETTINGS
@given(host=HOSTS)
def test_host_parse_of_str_round_trips(host):
    assert Host.parse(str(host)) == host
    assert Host.parse(host) == host
    assert Host.parse((host.ip, host.port)) == host
    bracketed = f"[{host.ip}]:{host.port}" if host.is_ipv6 else f"{host.ip}:{host.port}"
    assert Host.parse(bracketed) == host
    raw = host.to_bytes()
    assert len(raw) == (20 if host.is_ipv6 else 8)
    assert Host.from_bytes(raw) == host


def test_host_str_is_javas_form():
    assert str(Host.parse("[2001:db8::1]:40000")) == "2001:db8:0:0:0:0:0:1:40000"
    assert str(Host.parse("2001:db8:0:0:0:0:0:1:40000")) == "2001:db8:0:0:0:0:0:1:40000"
    assert str(Host.parse("/10.0.0.1:10911")) == "10.0.0.1:10911"
    assert str(Host.from_bytes(bytes(15) + b"\x01" + (10911).to_bytes(4, "big"))) == "0:0:0:0:0:0:0:1:10911"


@pytest.mark.parametrize("text", ["[::ffff:1.2.3.4]:10911", "[::ffff:102:304]:10911", "[::1.2.3.4]:10911",
                                  "[::102:304]:10911", "0:0:0:0:0:ffff:102:304:10911"])
def test_host_from_bytes_equals_parsed_host(text):
    """Regression: parse() and from_bytes() once spelled IPv4-mapped/-compatible IPv6 addresses differently."""
    host = Host.parse(text)
    assert Host.from_bytes(host.to_bytes()) == host
    assert Host.parse(str(host)) == host


# --- 5. MessageEncoder ----------------------------------------------------------------------------------

MID_MONTH_MS = E5_TIMESTAMP  # the 15th: far from the month end, so the tests never depend on the real date


class FixedClockUniqKeys(UniqKeyGenerator):
    """A UNIQ_KEY generator whose clock is pinned, so encoder tests do not depend on the day of the month."""

    def __init__(self, ip: str, now_ms: int) -> None:
        super().__init__(ip)
        self.now_ms = now_ms

    def next(self, now_ms: int | None = None) -> str:
        return super().next(self.now_ms if now_ms is None else now_ms)


def make_encoder(config: StoreConfig | None = None, now_ms: int = MID_MONTH_MS) -> MessageEncoder:
    encoder = MessageEncoder(config or StoreConfig())
    encoder.uniq_keys = FixedClockUniqKeys(encoder.store_host.ip, now_ms)
    return encoder


def encode_and_decode(encoder: MessageEncoder, message: Message) -> tuple[Any, MessageExt]:
    pending = encoder.encode(message)
    decoded = decode_record(bytes(pending.data), check_crc=True)
    assert decoded is not None
    assert decoded.store_size == pending.size == len(pending.data)
    return pending, decoded


def test_encoder_output_decodes_to_the_message():
    message = Message(topic="TopicTest", body=b"hello world", tags="TagA", keys=["order-1", "订单-2"],
                      properties={"userProp": "值😀", "a": "b=c"}, queue_id=3, flag=7, reconsume_times=2,
                      born_timestamp=1700000000000, born_host="192.168.0.10:54321")
    pending, msg = encode_and_decode(make_encoder(), message)
    assert msg.topic == pending.topic == "TopicTest"
    assert msg.body == b"hello world"
    assert msg.body_crc == body_crc(b"hello world")
    assert msg.tags == "TagA"
    assert msg.keys == ["order-1", "订单-2"]
    assert msg.properties == {"userProp": "值😀", "a": "b=c", "TAGS": "TagA", "KEYS": "order-1 订单-2",
                              "UNIQ_KEY": pending.uniq_key}
    assert (msg.queue_id, msg.flag, msg.reconsume_times, msg.sys_flag) == (3, 7, 2, 0)
    assert msg.born_timestamp == 1700000000000
    assert str(msg.born_host) == "192.168.0.10:54321"
    assert str(msg.store_host) == "127.0.0.1:10911"
    assert msg.magic_code == MAGIC_V1
    # The three fields only known under the put lock are left zero.
    assert (msg.queue_offset, msg.commit_log_offset, msg.store_timestamp) == (0, 0, 0)
    layout = read_layout(bytes(pending.data), 0)
    assert layout is not None
    stored = bytes(pending.data[layout.props_pos : layout.props_pos + layout.props_len]).decode()
    assert stored == encode_properties(msg.properties)  # the broker's HashMap(128) order


def test_encoder_generates_a_uniq_key_when_none_is_given(local_tz):
    local_tz("Asia/Shanghai", 6)
    pending, msg = encode_and_decode(make_encoder(), Message(topic="TopicTest", body=b"x"))
    assert pending.uniq_key == msg.uniq_key
    assert re.fullmatch("[0-9A-F]{32}", msg.uniq_key)
    info = decode_uniq_key(msg.uniq_key, now_ms=MID_MONTH_MS + 1)
    assert info.ip == "127.0.0.1"
    assert info.timestamp == MID_MONTH_MS
    other = make_encoder().encode(Message(topic="TopicTest", body=b"x"))
    assert other.uniq_key != pending.uniq_key


def test_encoder_keeps_a_given_uniq_key():
    pending, msg = encode_and_decode(make_encoder(), Message(topic="T", body=b"x", properties={"UNIQ_KEY": E5_KEY}))
    assert pending.uniq_key == msg.uniq_key == E5_KEY
    assert msg.properties == {"UNIQ_KEY": E5_KEY}


def test_encoder_sets_v6_bits_for_ipv6_hosts():
    encoder = make_encoder(StoreConfig(store_host="[2001:db8::1]:10911"))
    _, msg = encode_and_decode(encoder, Message(topic="T", body=b"x", born_host="[::1]:40000"))
    assert msg.sys_flag == SysFlag.BORNHOST_V6 | SysFlag.STOREHOST_V6
    assert str(msg.store_host) == "2001:db8:0:0:0:0:0:1:10911"
    assert str(msg.born_host) == "0:0:0:0:0:0:0:1:40000"
    assert len(msg.uniq_key) == 56
    _, msg = encode_and_decode(make_encoder(), Message(topic="T", body=b"x", born_host="[::1]:40000"))
    assert msg.sys_flag == SysFlag.BORNHOST_V6


def test_encoder_keeps_user_sys_flag_bits():
    sys_flag = SysFlag.COMPRESSED | SysFlag.COMPRESSION_ZLIB | SysFlag.TRANSACTION_PREPARED_TYPE
    body = zlib.compress(b"abc" * 50)
    _, msg = encode_and_decode(make_encoder(), Message(topic="T", body=body, sys_flag=sys_flag))
    assert msg.sys_flag == sys_flag
    assert msg.body == body
    assert decode_record(bytes(make_encoder().encode(Message(topic="T", body=body, sys_flag=sys_flag)).data),
                         decompress=True).body == b"abc" * 50


@pytest.mark.parametrize("topic", ["", "a/b", "../x", "x" * 128, "with space", "中文", "a.b", "%RETRY%" + "x" * 249])
def test_encoder_rejects_invalid_topics(topic):
    with pytest.raises(InvalidTopicError):
        make_encoder().encode(Message(topic=topic, body=b"x"))


@pytest.mark.parametrize(("topic", "magic"), [
    ("x" * 127, MAGIC_V1),
    ("%RETRY%" + "x" * 200, MAGIC_V2),  # retry topics may have up to 255 characters
    ("%RETRY%" + "x" * 248, MAGIC_V2),
    ("%|a-Z_0", MAGIC_V1),
])
def test_encoder_accepts_valid_topics(topic, magic):
    _, msg = encode_and_decode(make_encoder(), Message(topic=topic, body=b"x"))
    assert msg.topic == topic
    assert msg.magic_code == magic


def test_encoder_rejects_body_larger_than_max_message_size():
    encoder = make_encoder(StoreConfig(max_message_size=1024))
    _, msg = encode_and_decode(encoder, Message(topic="T", body=bytes(1024)))
    assert msg.body == bytes(1024)
    with pytest.raises(MessageTooLargeError):
        encoder.encode(Message(topic="T", body=bytes(1025)))


def test_encoder_rejects_properties_over_32767_bytes():
    # UNIQ_KEY\x01<32 chars>\x02 (42 bytes) + big\x01<n>\x02 (5 + n bytes) = 47 + n bytes
    def message(value: str) -> Message:
        return Message(topic="T", body=b"x", properties={"UNIQ_KEY": E5_KEY, "big": value})

    encoder = make_encoder()
    _, msg = encode_and_decode(encoder, message("v" * (32767 - 47)))
    assert len(msg.properties["big"]) == 32767 - 47
    with pytest.raises(PropertiesTooLargeError):
        encoder.encode(message("v" * (32767 - 46)))
    with pytest.raises(PropertiesTooLargeError):  # the limit counts UTF-8 bytes, not characters
        encoder.encode(message("é" * 16400))


def test_encoder_rejects_records_that_do_not_fit_a_segment():
    # 88 fixed + n body + 1 + 1 ("T") + 2 + 42 (UNIQ_KEY property) = 134 + n; a segment keeps 8 bytes for BLANK.
    encoder = make_encoder(StoreConfig(mapped_file_size_commit_log=4096))
    message = Message(topic="T", body=bytes(4088 - 134), properties={"UNIQ_KEY": E5_KEY})
    _, msg = encode_and_decode(encoder, message)
    assert msg.store_size == 4088
    message.body = bytes(4088 - 133)
    with pytest.raises(MessageTooLargeError):
        encoder.encode(message)


def test_encoder_drops_a_user_crc_property_and_reads_wait():
    pending, msg = encode_and_decode(make_encoder(), Message(
        topic="T", body=b"x", properties={"__CRC32#": "0000000000", "WAIT": "False"}))
    assert "__CRC32#" not in msg.properties
    assert msg.properties["WAIT"] == "False"
    assert pending.wait_store is False
    assert make_encoder().encode(Message(topic="T", body=b"x")).wait_store is True


def test_encoder_rejects_conflicting_tags():
    with pytest.raises(InvalidPropertyError):
        make_encoder().encode(Message(topic="T", body=b"x", tags="A", properties={"TAGS": "B"}))
    _, msg = encode_and_decode(make_encoder(), Message(topic="T", body=b"x", tags="A", properties={"TAGS": "A"}))
    assert msg.tags == "A"


@pytest.mark.parametrize("keys", [["a b"], ["ok", ""], ["ok", "with space"]])
def test_encoder_rejects_bad_keys(keys):
    with pytest.raises(InvalidPropertyError):
        make_encoder().encode(Message(topic="T", body=b"x", keys=keys))


def test_encoder_splits_a_key_string_at_spaces():
    _, msg = encode_and_decode(make_encoder(), Message(topic="T", body=b"x", keys="k1  k2 k3"))
    assert msg.keys == ["k1", "k2", "k3"]


@pytest.mark.parametrize("properties", [{"a": ""}, {"a\x01": "b"}, {"a": "b\x02"}])
def test_encoder_rejects_bad_properties(properties):
    with pytest.raises(InvalidPropertyError):
        make_encoder().encode(Message(topic="T", body=b"x", properties=properties))


@pytest.mark.parametrize("sys_flag", [0x40, 0x80, 0x800, SysFlag.BORNHOST_V6, SysFlag.STOREHOST_V6, -1, 1 << 31])
def test_encoder_rejects_unknown_sys_flag_bits(sys_flag):
    with pytest.raises(InvalidFlagError):
        make_encoder().encode(Message(topic="T", body=b"x", sys_flag=sys_flag))


@pytest.mark.parametrize(("field", "value"), [
    ("flag", 1 << 31), ("flag", -(1 << 31) - 1), ("flag", "1"), ("queue_id", -1), ("reconsume_times", 1 << 31),
    ("prepared_transaction_offset", 1 << 63), ("born_timestamp", -(1 << 63) - 1),
    ("born_timestamp", (2**63 - 1) // 1000 + 1), ("born_timestamp", 1 << 62),  # past a timestamp[us] column
])
def test_encoder_rejects_out_of_range_numbers(field, value):
    with pytest.raises(InvalidFlagError):
        make_encoder().encode(Message(topic="T", body=b"x", **{field: value}))


@pytest.mark.parametrize("field", ["flag", "reconsume_times"])
def test_encoder_accepts_i32_bounds(field):
    for value in INT32:
        _, msg = encode_and_decode(make_encoder(), Message(topic="T", body=b"x", **{field: value}))
        assert getattr(msg, field) == value


def test_encoder_works_late_in_the_month(local_tz):
    """Regression: from ~24.86 days into a month, generating a UNIQ_KEY used to raise struct.error."""
    local_tz("Asia/Shanghai", 6)
    _, msg = encode_and_decode(make_encoder(now_ms=LATE_IN_MONTH_MS), Message(topic="TopicTest", body=b"x"))
    assert decode_uniq_key(msg.uniq_key, now_ms=LATE_IN_MONTH_MS + 1).timestamp == LATE_IN_MONTH_MS


def test_message_ext_is_a_value_record():
    """MessageExt with its properties text unparsed still behaves as the record it was: value equality, a
    copy with changes, pickling (Spark ships them), a repr without magic_code, no hash (it is mutable)."""
    import pickle

    text = "UNIQ_KEY\x01U1\x02KEYS\x01k1 k2\x02"
    m = MessageExt("T", b"b", 1, 0, 2, 3, 0, 4, Host("1.2.3.4", 5), 6, Host("1.2.3.4", 7), 0, 0, 8, text, 9, "ID", 1)
    assert pickle.loads(pickle.dumps(m)) == m
    assert m.replace() == m and m.replace() is not m
    copy = m.replace(topic="U", properties={"a": "b"})
    assert (copy.topic, copy.properties, copy.magic_code) == ("U", {"a": "b"}, 1)
    assert copy != m and m.topic == "T" and m.keys == ["k1", "k2"] and m.uniq_key == "U1"
    with pytest.raises(TypeError, match="nope"):
        m.replace(nope=1)
    assert repr(m).startswith("MessageExt(topic='T', body=b'b', queue_id=1,") and "magic_code" not in repr(m)
    assert "properties={'UNIQ_KEY': 'U1', 'KEYS': 'k1 k2'}" in repr(m)
    assert m != m.replace(magic_code=2)
    m.properties = {"x": "y"}
    assert m.properties == {"x": "y"} and m.keys == [] and m.get_property("x") == "y"
    with pytest.raises(TypeError):
        hash(m)


_IMPORT_EACH_FIRST = """
import os, sys
from pathlib import Path
import numpy, pyarrow, numba  # third-party, loaded once before the forks: each child imports only rocketstore's
import rocketstore  # its __init__ alone: the names below are found in the files, not by importing packages
top = Path(rocketstore.__file__).parent
names = sorted(".".join(("rocketstore",) + p.relative_to(top).with_suffix("").parts).removesuffix(".__init__")
               for p in top.rglob("*.py") if p.name != "__main__.py")
assert [m for m in sys.modules if m.startswith("rocketstore.")] == [], "walked without importing"
failed = []
for name in names:
    pid = os.fork()
    if pid == 0:
        try:
            __import__(name)
        except BaseException as exc:
            print(f"{name}: {type(exc).__name__}: {exc}", flush=True)
            os._exit(1)
        os._exit(0)
    if os.waitpid(pid, 0)[1]:
        failed.append(name)
print("imported", len(names), "failed", failed)
"""


def test_every_module_imports_as_the_first_one_of_the_package():
    """``rocketstore`` loads its names lazily (a forking Spark daemon imports one module of it, not the store), so
    no module may rely on another having been imported first: ``import rocketstore.message`` alone once failed on
    the codec <-> message cycle."""
    done = subprocess.run([sys.executable, "-c", _IMPORT_EACH_FIRST], capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1].endswith("failed []"), done.stdout[-3000:]
    assert int(done.stdout.split("imported ")[1].split()[0]) > 50


NO_CACHE_HOME = """
import os, sys
from numba.core import caching
for name in ("InTreeCacheLocator", "UserWideCacheLocator"):  # as for a user who can write neither
    getattr(caching, name).from_function = classmethod(lambda cls, py_func, py_file: None)
from click.testing import CliRunner
from rocketstore.cli.app import main
print(CliRunner().invoke(main, ["--help"]).exit_code)
from rocketstore.codec._kernels import queue_groups
import numpy as np
print(queue_groups(np.array([3, 1, 3], dtype=np.int64))[1].tolist())
"""


def test_the_kernels_load_for_a_user_who_can_write_no_cache_directory(tmp_path):
    """A service account with no home, running an installed package it cannot write: every numba kernel with
    cache=True raised "no locator available" at import, so every command (--help too) died with a traceback.
    The kernels are cached in a private directory under the temporary one instead."""
    env = {**os.environ, "HOME": "/nonexistent", "TMPDIR": str(tmp_path), "XDG_CACHE_HOME": "/nonexistent"}
    env.pop("NUMBA_CACHE_DIR", None)
    done = subprocess.run([sys.executable, "-c", NO_CACHE_HOME], capture_output=True, text=True, timeout=300,
                          env=env, check=False)
    assert done.returncode == 0 and done.stdout.split() == ["0", "[0,", "0,", "1]"], done.stderr[-3000:]
    private = tmp_path / f"rocketstore-numba-{os.getuid()}"
    assert private.is_dir() and any(private.rglob("*.nbi")) and (private.stat().st_mode & 0o777) == 0o700


def test_a_cache_directory_name_taken_by_another_gives_a_fresh_private_one(tmp_path):
    taken = tmp_path / f"rocketstore-numba-{os.getuid()}"
    taken.mkdir(mode=0o755)
    taken.chmod(0o755)  # open to others: another user's (or a link) would be refused the same way
    env = {**os.environ, "HOME": "/nonexistent", "TMPDIR": str(tmp_path), "XDG_CACHE_HOME": "/nonexistent"}
    env.pop("NUMBA_CACHE_DIR", None)
    done = subprocess.run([sys.executable, "-c", NO_CACHE_HOME], capture_output=True, text=True, timeout=300,
                          env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not any(taken.iterdir())  # never written into
    fresh = [p for p in tmp_path.iterdir() if p.name.startswith("rocketstore-numba-") and p != taken]
    assert fresh and (fresh[0].stat().st_mode & 0o777) == 0o700

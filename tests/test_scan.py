"""validate_records (recovery's compiled pass) agrees with read_layout (the reference validator) on any bytes,
the PHYSICALOFFSET check included."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rocketstore.codec.batch import validate_records
from rocketstore.codec.hosts import Host
from rocketstore.codec.record import MAGIC_V2, blank_record, encode_record, read_layout
from rocketstore.errors import CorruptDataError

V4 = Host("10.0.0.1", 10911).to_bytes()
V6 = Host("2001:db8::1", 10911).to_bytes()


BASE = 1 << 30


@st.composite
def segments(draw):
    records, pos = [], 0
    for _ in range(draw(st.integers(0, 6))):
        v6 = draw(st.booleans())
        misplaced = draw(st.integers(0, 9)) == 0  # a stale or copied record: its field names another place
        body = draw(st.binary(max_size=300))
        topic = draw(st.sampled_from([b"T", b"TopicTest", b"X" * 200]))
        records.append(bytes(encode_record(
            topic=topic, body=body, properties=draw(st.sampled_from([b"", b"KEYS\x01a\x02", b"x\x01y\x02" * 9])),
            queue_id=0, flag=0, sys_flag=0x30 if v6 else 0, born_timestamp=1, born_host=V6 if v6 else V4,
            store_host=V6 if v6 else V4, phy_offset=BASE + pos + (4096 if misplaced else 0),
            version=MAGIC_V2 if len(topic) > 127 else 0xDAA320A7 - (1 << 32))))
        pos += len(records[-1])
    data = bytearray(b"".join(records))
    if draw(st.booleans()):
        data += blank_record(8 + draw(st.integers(0, 40))) + bytes(40)
    data += bytes(draw(st.integers(0, 64)))
    if data and draw(st.booleans()):
        i = draw(st.integers(0, len(data) - 1))
        data[i] = draw(st.integers(0, 255))
    if data and draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]
    return bytes(data)


@settings(max_examples=400, deadline=None)
@given(data=segments(), check_crc=st.booleans(), check_offset=st.booleans())
def test_scan_stops_exactly_where_read_layout_fails(data, check_crc, check_offset):
    stop, count, last = validate_records(data, 0, len(data), check_crc=check_crc,
                                         base=BASE if check_offset else None)
    where = {"base": BASE, "check_offset": check_offset}
    pos, starts = 0, [-1]
    for _ in range(count):
        layout = read_layout(data, pos, len(data), check_crc=check_crc, **where)
        assert layout is not None
        starts.append(pos)
        pos += layout.size
    assert pos == stop and last == starts[-1]
    try:
        layout = read_layout(data, stop, len(data), check_crc=check_crc, **where)
    except CorruptDataError:
        return
    assert layout is None, "the scan stopped before a record read_layout accepts"

"""validate_records (recovery's compiled pass) agrees with read_layout (the reference validator) on any bytes,
the PHYSICALOFFSET check included."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rocketstore import Message, MessageStore, StoreConfig
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


def test_scan_arrow_refuses_bad_arguments_with_typed_errors_before_reading(tmp_path):
    """A float offset reached the compiled walk (numba's TypingError), a non-iterable ``topics`` or ``columns`` a
    TypeError, ``max_rows=2**70`` an OverflowError, and an offset inside a record was reported as damage
    (BadMagicError) where ``iter_messages`` says it is no record start."""
    from rocketstore.errors import InvalidQueryError, MessageNotFoundError, OffsetOutOfRangeError

    with MessageStore.open(tmp_path, StoreConfig(preallocate=False)) as store:
        first = store.put_message(Message("T", b"hello"))
        store.put_message(Message("U", b"world"))
        bad = {
            "begin=1.5": (OffsetOutOfRangeError, dict(begin=1.5)),
            "end=100.5": (OffsetOutOfRangeError, dict(end=100.5)),
            "begin='0'": (OffsetOutOfRangeError, dict(begin="0")),
            "begin inside a record": (MessageNotFoundError, dict(begin=5)),
            "topics=5": (InvalidQueryError, dict(topics=5)),
            "topics=[5]": (InvalidQueryError, dict(topics=[5])),
            "max_rows=None": (InvalidQueryError, dict(max_rows=None)),
            "max_rows=2**70": (InvalidQueryError, dict(max_rows=2 ** 70)),
            "max_rows=0": (InvalidQueryError, dict(max_rows=0)),
            "columns=5": (InvalidQueryError, dict(columns=5)),
            "columns=[5]": (InvalidQueryError, dict(columns=[5])),
        }
        for name, (error, kwargs) in bad.items():
            with pytest.raises(error):
                store.scan_arrow(**kwargs)  # at the call, before any batch is asked for
            with pytest.raises(error):
                list(store.iter_messages(5)) if name == "begin inside a record" else store.scan_arrow(**kwargs)
        rows = [b.to_pylist() for b in store.scan_arrow(topics=("U",), begin=first.commit_log_offset, max_rows=1)]
        assert [r["body"] for batch in rows for r in batch] == [b"world"]
        assert sum(b.num_rows for b in store.scan_arrow(begin=store.max_phy_offset + 1000)) == 0
        with pytest.raises(InvalidQueryError):
            store.queue_arrow("T", 0, max_rows=2 ** 70)

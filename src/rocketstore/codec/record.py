"""The commit-log record: the one encoder and decoder used by the store, the CLI and Spark.

Layout (big-endian; each IPv6 host adds 12 bytes to every later position)::

    0  TOTALSIZE i32        4  MAGICCODE i32       8  BODYCRC i32        12 QUEUEID i32
    16 FLAG i32             20 QUEUEOFFSET i64     28 PHYSICALOFFSET i64 36 SYSFLAG i32
    40 BORNTIMESTAMP i64    48 BORNHOST 8|20       56 STORETIMESTAMP i64 64 STOREHOST 8|20
    72 RECONSUMETIMES i32   76 PREPARED_TX i64     84 BODYLEN i32        88 BODY
       TOPICLEN i8 (V1) | i16 (V2), TOPIC utf-8, PROPLEN i16, PROPERTIES utf-8

A segment ends with an 8-byte BLANK record ``[i32 bytes left in the file][i32 0xCBD43194]``.
Validation mirrors ``CommitLog.checkMessageAndReturnSize`` but reports *why* a record is bad,
and never trusts a length field: every one is bounded by the bytes actually present.
"""

from __future__ import annotations

import struct
import zlib
from typing import Final, NamedTuple

from ..errors import (
    BadMagicError,
    ChecksumError,
    CorruptDataError,
    MisplacedRecordError,
    TruncatedRecordError,
    UnsupportedFormatError,
)
from ..message import MessageExt, SysFlag
from .hashing import body_crc
from .hosts import host_of
from .properties import PropertyName

MAGIC_V1: Final = -626843481  # 0xDAA320A7
MAGIC_V2: Final = -626843477  # 0xDAA320AB
BLANK_MAGIC: Final = -875286124  # 0xCBD43194
BLANK_RECORD_LEN: Final = 8  # END_FILE_MIN_BLANK_LENGTH
FIXED_PART_LEN: Final = 88  # everything but body, topic and properties, with IPv4 hosts
V6_EXTRA_LEN: Final = 12
MIN_RECORD_LEN: Final = FIXED_PART_LEN + 1 + 2
CRC32_RESERVED_LEN: Final = 20  # __CRC32# \x01 10 digits \x02
MAX_TOPIC_LEN_V1: Final = 127
MAX_PROPERTIES_LEN: Final = 32767

QUEUE_OFFSET_POS: Final = 20
PHY_OFFSET_POS: Final = 28
SYSFLAG_POS: Final = 36
BORN_HOST_POS: Final = 48
# The widest time (ms) a timestamp[us] column (Arrow's, Spark's TimestampType) holds: a put refuses a born
# time past it, which no reader could show, and a read of someone else's store treats one as damage.
MAX_TIME_MS: Final = (2**63 - 1) // 1000

HEAD_FMT: Final = ">iiiiiqqiq"  # size, magic, body crc, queue id, flag, queue offset, phy offset, sysflag, born ts
_HEAD = struct.Struct(HEAD_FMT)
_TAIL = struct.Struct(">iqi")  # reconsume times, prepared tx offset, body length
_I64 = struct.Struct(">q")
_I32 = struct.Struct(">i")
_I16 = struct.Struct(">h")
_SIZE_MAGIC = struct.Struct(">ii")
_V4_FIXED = struct.Struct(">iiiiiqqiq8sq8siqi")  # the 88 fixed bytes of a record with two IPv4 hosts
assert _HEAD.size == 48 and _TAIL.size == 16 and _V4_FIXED.size == FIXED_PART_LEN

_V6_BITS = SysFlag.BORNHOST_V6 | SysFlag.STOREHOST_V6
_CRC_PREFIX = f"{PropertyName.CRC32}\x01".encode()


def host_lengths(sys_flag: int) -> tuple[int, int]:
    """(born host length, store host length) for a sysflag."""
    return (20 if sys_flag & SysFlag.BORNHOST_V6 else 8), (20 if sys_flag & SysFlag.STOREHOST_V6 else 8)


def store_timestamp_pos(sys_flag: int) -> int:
    return BORN_HOST_POS + host_lengths(sys_flag)[0]


def record_length(body_len: int, topic_len: int, props_len: int, sys_flag: int, version: int) -> int:
    """``calMsgLength``: the TOTALSIZE a record with these parts must have."""
    born, store = host_lengths(sys_flag)
    return FIXED_PART_LEN + (born - 8) + (store - 8) + body_len + (2 if version == MAGIC_V2 else 1) \
        + topic_len + 2 + props_len


# --- encoding ---------------------------------------------------------------------------------

def encode_v4_record(size: int, crc: int, queue_id: int, flag: int, sys_flag: int, born_timestamp: int,
                     born_host: bytes, store_host: bytes, body: bytes, topic: bytes, properties: bytes,
                     reconsume_times: int = 0, prepared_transaction_offset: int = 0, queue_offset: int = 0,
                     phy_offset: int = 0, store_timestamp: int = 0) -> bytearray:
    """``encode_record`` for a version-1 record with two IPv4 hosts and a ``size`` already computed: one pack
    and four appends, with positional arguments (a single put builds its record here)."""
    out = bytearray(_V4_FIXED.pack(size, MAGIC_V1, crc, queue_id, flag, queue_offset, phy_offset, sys_flag,
                                   born_timestamp, born_host, store_timestamp, store_host, reconsume_times,
                                   prepared_transaction_offset, len(body)))
    out += body
    out.append(len(topic))
    out += topic
    out += _I16.pack(len(properties))
    out += properties
    return out


def encode_record(
    *,
    topic: bytes,
    body: bytes,
    properties: bytes,
    queue_id: int,
    flag: int,
    sys_flag: int,
    born_timestamp: int,
    born_host: bytes,
    store_host: bytes,
    reconsume_times: int = 0,
    prepared_transaction_offset: int = 0,
    queue_offset: int = 0,
    phy_offset: int = 0,
    store_timestamp: int = 0,
    version: int = MAGIC_V1,
    crc: int | None = None,
) -> bytearray:
    """Build one record. Hosts are raw (address + port); the sysflag's V6 bits must match them.

    Field ranges are the caller's responsibility (``struct.error`` otherwise); the store checks
    every user-supplied value before it gets here.
    """
    size = record_length(len(body), len(topic), len(properties), sys_flag, version)
    if len(born_host) == 8 and len(store_host) == 8 and version == MAGIC_V1:  # the common case: one pack
        return encode_v4_record(size, body_crc(body) if crc is None else crc, queue_id, flag, sys_flag,
                                born_timestamp, born_host, store_host, body, topic, properties, reconsume_times,
                                prepared_transaction_offset, queue_offset, phy_offset, store_timestamp)
    out = bytearray(size)
    _HEAD.pack_into(out, 0, size, version, body_crc(body) if crc is None else crc, queue_id, flag,
                    queue_offset, phy_offset, sys_flag, born_timestamp)
    pos = BORN_HOST_POS
    out[pos : pos + len(born_host)] = born_host
    pos += len(born_host)
    _I64.pack_into(out, pos, store_timestamp)
    pos += 8
    out[pos : pos + len(store_host)] = store_host
    pos += len(store_host)
    _TAIL.pack_into(out, pos, reconsume_times, prepared_transaction_offset, len(body))
    pos += 16
    out[pos : pos + len(body)] = body
    pos += len(body)
    if version == MAGIC_V2:
        _I16.pack_into(out, pos, len(topic))
        pos += 2
    else:
        out[pos] = len(topic)
        pos += 1
    out[pos : pos + len(topic)] = topic
    pos += len(topic)
    _I16.pack_into(out, pos, len(properties))
    pos += 2
    out[pos : pos + len(properties)] = properties
    return out


def blank_record(remaining: int) -> bytes:
    """The end-of-file record for a segment with ``remaining`` bytes left."""
    return _SIZE_MAGIC.pack(remaining, BLANK_MAGIC)


def fill_in_place(buf: bytearray | memoryview, pos: int, *, queue_offset: int, phy_offset: int,
                  store_timestamp: int, sys_flag: int) -> None:
    """Write the three fields only known under the put lock (``MessageExtEncoder`` leaves them 0)."""
    _I64.pack_into(buf, pos + QUEUE_OFFSET_POS, queue_offset)
    _I64.pack_into(buf, pos + PHY_OFFSET_POS, phy_offset)
    _I64.pack_into(buf, pos + store_timestamp_pos(sys_flag), store_timestamp)


def property_crc_suffix(crc: int) -> bytes:
    """``__CRC32#\\x01`` + the 10 decimal digits of ``crc`` least-significant first + ``\\x02``."""
    return _CRC_PREFIX + f"{crc:010d}"[::-1].encode() + b"\x02"


def seal_property_crc(buf: bytearray | memoryview, pos: int, size: int) -> None:
    """Fill the 20 reserved bytes at the record's end with the CRC of everything before them."""
    start = pos + size - CRC32_RESERVED_LEN
    crc = zlib.crc32(buf[pos:start]) & 0x7FFFFFFF
    buf[start : pos + size] = property_crc_suffix(crc)


# --- decoding ---------------------------------------------------------------------------------

class RecordLayout(NamedTuple):
    """Where the variable parts of a validated record are (absolute positions in its buffer).

    A tuple rather than a frozen dataclass: every read builds one, and a frozen dataclass's ``__init__``
    costs a ``object.__setattr__`` per field."""

    size: int
    magic: int
    sys_flag: int
    body_pos: int
    body_len: int
    topic_pos: int
    topic_len: int
    props_pos: int
    props_len: int


def read_layout(buf, pos: int, limit: int | None = None, *, check_crc: bool = False,
                verify_prop_crc: bool = False, path: str | None = None, base: int = 0,
                check_offset: bool = False) -> RecordLayout | None:
    """Validate the record at ``buf[pos]`` and return its layout, or ``None`` for a BLANK record.

    ``limit`` is where the readable bytes end (default: the buffer end). ``path`` and ``base``
    (the buffer's offset in the commit log) make error messages point at the right place, and with
    ``check_offset`` the record's PHYSICALOFFSET field must say ``base + pos``.
    Raises ``BadMagicError``, ``TruncatedRecordError``, ``ChecksumError`` or ``MisplacedRecordError``.
    """
    end = len(buf) if limit is None else limit
    where = base + pos
    if end - pos < 8:
        raise TruncatedRecordError(f"only {max(end - pos, 0)} bytes left, no record header", path, where)
    size, magic = _SIZE_MAGIC.unpack_from(buf, pos)
    if magic == BLANK_MAGIC:
        if size < BLANK_RECORD_LEN or size != end - pos:
            raise TruncatedRecordError(f"blank record claims {size} bytes but {end - pos} remain", path, where)
        return None
    if magic not in (MAGIC_V1, MAGIC_V2):
        if size == 0 and magic == 0:
            raise TruncatedRecordError("no record here (zero bytes)", path, where)
        raise BadMagicError(f"bad magic code 0x{magic & 0xFFFFFFFF:08X}", path, where)
    if size < MIN_RECORD_LEN or size > end - pos:
        raise TruncatedRecordError(f"record size {size} does not fit the {end - pos} bytes left", path, where)
    stop = pos + size
    sys_flag = _I32.unpack_from(buf, pos + SYSFLAG_POS)[0]
    born_len, store_len = host_lengths(sys_flag)
    body_len_pos = pos + FIXED_PART_LEN - 4 + (born_len - 8) + (store_len - 8)
    if body_len_pos + 4 > stop:
        raise TruncatedRecordError("record too short for its hosts", path, where)
    body_len = _I32.unpack_from(buf, body_len_pos)[0]
    body_pos = body_len_pos + 4
    if body_len < 0 or body_pos + body_len > stop:
        raise TruncatedRecordError(f"body length {body_len} runs past the record end", path, where)
    topic_len_pos = body_pos + body_len
    if magic == MAGIC_V2:
        if topic_len_pos + 2 > stop:
            raise TruncatedRecordError("record ends inside the topic length", path, where)
        topic_len = _I16.unpack_from(buf, topic_len_pos)[0]
        topic_pos = topic_len_pos + 2
    else:
        if topic_len_pos + 1 > stop:
            raise TruncatedRecordError("record ends inside the topic length", path, where)
        topic_len = buf[topic_len_pos]
        topic_len = topic_len - 256 if topic_len > 127 else topic_len  # Java reads a signed byte
        topic_pos = topic_len_pos + 1
    if topic_len < 0 or topic_pos + topic_len + 2 > stop:
        raise TruncatedRecordError(f"topic length {topic_len} runs past the record end", path, where)
    props_len_pos = topic_pos + topic_len
    props_len = _I16.unpack_from(buf, props_len_pos)[0]
    props_pos = props_len_pos + 2
    if props_len < 0 or props_pos + props_len != stop:
        raise TruncatedRecordError(
            f"record size {size} disagrees with its parts (body {body_len}, topic {topic_len}, "
            f"properties {props_len})", path, where)
    if check_crc:
        if verify_prop_crc:
            _verify_property_crc(buf, pos, size, props_len, path, where)
        elif body_len > 0:
            stored = _I32.unpack_from(buf, pos + 8)[0]
            actual = zlib.crc32(buf[body_pos : body_pos + body_len]) & 0x7FFFFFFF
            if actual != stored:
                raise ChecksumError(f"body CRC {actual} does not match the stored {stored}", path, where)
    if check_offset:
        stored_offset = _I64.unpack_from(buf, pos + PHY_OFFSET_POS)[0]
        if stored_offset != where:
            raise MisplacedRecordError(f"record says it was written at commit-log offset {stored_offset}",
                                       path, where)
    return RecordLayout(size, magic, sys_flag, body_pos, body_len, topic_pos, topic_len, props_pos, props_len)


def _verify_property_crc(buf, pos: int, size: int, props_len: int, path: str | None, where: int) -> None:
    if props_len < CRC32_RESERVED_LEN:
        raise ChecksumError("record has no __CRC32# property", path, where)
    start = pos + size - CRC32_RESERVED_LEN
    suffix = bytes(buf[start : pos + size])
    digits = suffix[len(_CRC_PREFIX) : -1]
    if not suffix.startswith(_CRC_PREFIX) or not digits.isdigit() or suffix[-1:] != b"\x02":
        raise ChecksumError("record has no __CRC32# property", path, where)
    stored = int(digits[::-1])
    actual = zlib.crc32(buf[pos:start]) & 0x7FFFFFFF
    if stored != actual:
        raise ChecksumError(f"record CRC {actual} does not match __CRC32# {stored}", path, where)


def decode_record(buf, pos: int = 0, limit: int | None = None, *, check_crc: bool = False,
                  verify_prop_crc: bool = False, read_body: bool = True, decompress: bool = False,
                  max_body_size: int = 64 << 20, path: str | None = None, base: int = 0) -> MessageExt | None:
    """Decode the record at ``buf[pos]`` (``MessageDecoder.decode``); ``None`` for a BLANK record.

    With ``decompress`` a compressed body is inflated and the COMPRESSED bit cleared, as
    RocketMQ's consumer does; the stored ``body_crc`` is kept. ``max_body_size`` bounds the
    inflated size, so a hostile record cannot exhaust memory.
    """
    layout = read_layout(buf, pos, limit, check_crc=check_crc, verify_prop_crc=verify_prop_crc,
                         path=path, base=base)
    if layout is None:
        return None
    return message_from_layout(buf, pos, layout, read_body=read_body, decompress=decompress,
                               max_body_size=max_body_size, path=path, base=base)


def decode_v4_at(buf, pos: int, limit: int, phy_offset: int, *, check_crc: bool,
                 read_body: bool = True) -> MessageExt | None:
    """The record at ``buf[pos]`` that says it is at ``phy_offset``, checked and decoded from one unpack of its
    88 fixed bytes: the common layout of a single-message read (two IPv4 hosts). ``buf`` is a mapping or
    ``bytes``, whose slices are ``bytes`` already.

    ``None`` whenever this form does not apply or a check fails (an IPv6 host, another offset, a blank, any
    damage): the caller then takes ``read_layout``'s path, which names the failure. What it accepts is exactly
    what ``read_layout`` accepts plus the PHYSICALOFFSET check, decoded as ``message_from_layout`` decodes it
    (``tests/test_codec.py`` holds the two paths equal on damaged records).
    """
    if limit - pos < FIXED_PART_LEN:
        return None
    (size, magic, crc, queue_id, flag, queue_offset, phy, sys_flag, born_ts, born_raw, store_ts,
     store_host_raw, reconsume, prepared, body_len) = _V4_FIXED.unpack_from(buf, pos)
    if phy != phy_offset or sys_flag & _V6_BITS or size < MIN_RECORD_LEN or size > limit - pos:
        return None
    stop = pos + size
    body_pos = pos + FIXED_PART_LEN
    if body_len < 0 or body_pos + body_len > stop:
        return None
    topic_len_pos = body_pos + body_len
    if magic == MAGIC_V1:
        if topic_len_pos + 1 > stop:
            return None
        topic_len = buf[topic_len_pos]
        topic_len = topic_len - 256 if topic_len > 127 else topic_len
        topic_pos = topic_len_pos + 1
    elif magic == MAGIC_V2:
        if topic_len_pos + 2 > stop:
            return None
        topic_len = _I16.unpack_from(buf, topic_len_pos)[0]
        topic_pos = topic_len_pos + 2
    else:
        return None
    if topic_len < 0 or topic_pos + topic_len + 2 > stop:
        return None
    props_pos = topic_pos + topic_len + 2
    if _I16.unpack_from(buf, props_pos - 2)[0] != stop - props_pos:
        return None
    body = buf[body_pos:topic_len_pos] if read_body or check_crc else b""
    if check_crc and body_len > 0 and zlib.crc32(body) & 0x7FFFFFFF != crc:
        return None
    return MessageExt(buf[topic_pos : props_pos - 2].decode("utf-8", "replace"), body if read_body else b"",
                      queue_id, flag, queue_offset, phy, sys_flag, born_ts, host_of(born_raw), store_ts,
                      host_of(store_host_raw), reconsume, prepared, crc,
                      buf[props_pos:stop].decode("utf-8", "replace"), size,  # properties: parsed when used
                      None, magic)  # msg_id: made when read


def message_from_layout(buf, pos: int, layout: RecordLayout, *, read_body: bool = True,
                        decompress: bool = False, max_body_size: int = 64 << 20,
                        path: str | None = None, base: int = 0) -> MessageExt:
    if layout.sys_flag & _V6_BITS:
        (size, _magic, crc, queue_id, flag, queue_offset, phy_offset, sys_flag, born_ts) = _HEAD.unpack_from(buf, pos)
        born_len, store_len = host_lengths(sys_flag)
        born_raw = bytes(buf[pos + BORN_HOST_POS : pos + BORN_HOST_POS + born_len])
        p = pos + BORN_HOST_POS + born_len
        store_ts = _I64.unpack_from(buf, p)[0]
        store_host_raw = bytes(buf[p + 8 : p + 8 + store_len])
        p += 8 + store_len
        reconsume, prepared, _body_len = _TAIL.unpack_from(buf, p)
    else:  # two IPv4 hosts: the 88 fixed bytes in one call
        (size, _magic, crc, queue_id, flag, queue_offset, phy_offset, sys_flag, born_ts, born_raw, store_ts,
         store_host_raw, reconsume, prepared, _body_len) = _V4_FIXED.unpack_from(buf, pos)
    born_host = host_of(born_raw)
    body = bytes(buf[layout.body_pos : layout.body_pos + layout.body_len]) if read_body else b""
    if read_body and decompress and sys_flag & SysFlag.COMPRESSED:
        body = decompress_body(body, sys_flag, max_body_size, path, base + pos)
        sys_flag &= ~SysFlag.COMPRESSED
    topic = bytes(buf[layout.topic_pos : layout.topic_pos + layout.topic_len]).decode("utf-8", "replace")
    props = bytes(buf[layout.props_pos : layout.props_pos + layout.props_len]).decode("utf-8", "replace")
    msg_id = (store_host_raw + bytes(buf[pos + PHY_OFFSET_POS : pos + PHY_OFFSET_POS + 8])).hex().upper()
    return MessageExt(topic, body, queue_id, flag, queue_offset, phy_offset, sys_flag, born_ts, born_host, store_ts,
                      host_of(store_host_raw), reconsume, prepared, crc, props, size, msg_id,
                      layout.magic)  # positional: MessageExt's field order


def decompress_body(body: bytes, sys_flag: int, max_size: int, path: str | None = None,
                    offset: int | None = None) -> bytes:
    """Inflate a body by the sysflag's compression type (0 and 3: zlib, 1: LZ4 frame, 2: zstd)."""
    kind = (sys_flag & SysFlag.COMPRESSION_TYPE_MASK) >> 8
    try:
        if kind in (0, 3):
            inflater = zlib.decompressobj()
            out = inflater.decompress(body, max_size + 1)
        elif kind == 1:
            try:
                import lz4.frame  # type: ignore[import-not-found]
            except ImportError:
                raise UnsupportedFormatError("LZ4 body: install rocketstore[compression]", path, offset) from None
            out = lz4.frame.decompress(body)
        elif kind == 2:
            try:
                import zstandard  # type: ignore[import-not-found]
            except ImportError:
                raise UnsupportedFormatError("zstd body: install rocketstore[compression]", path, offset) from None
            out = zstandard.ZstdDecompressor().decompress(body, max_output_size=max_size + 1)
        else:
            raise UnsupportedFormatError(f"unknown compression type {kind}", path, offset)
    except (zlib.error, RuntimeError, ValueError) as exc:
        raise CorruptDataError(f"compressed body does not inflate: {exc}", path, offset) from None
    except Exception as exc:  # lz4/zstandard raise their own error classes
        if isinstance(exc, CorruptDataError):
            raise
        raise CorruptDataError(f"compressed body does not inflate: {exc}", path, offset) from None
    if len(out) > max_size:
        raise CorruptDataError(f"compressed body inflates beyond {max_size} bytes", path, offset)
    return out


_SYNC_MAGICS = (MAGIC_V1.to_bytes(4, "big", signed=True), MAGIC_V2.to_bytes(4, "big", signed=True),
                BLANK_MAGIC.to_bytes(4, "big", signed=True))


def find_record_start(buf, pos: int, limit: int, segment_start: int, segment_size: int, *,
                      record_limit: int | None = None) -> int | None:
    """The first record (or closing BLANK) at or after ``pos``; None if there is none before ``limit``.

    A record start is a V1/V2 magic whose record validates and whose PHYSICALOFFSET field equals its
    own position (``segment_start + p``): a broker writes every record's position into it, so a
    body that merely contains a magic does not qualify. The record may end past ``limit``, up to
    ``record_limit`` (default ``limit``): a reader of one byte range looks for starts in its range only,
    and a record starting there is whole only past its end.
    """
    record_limit = limit if record_limit is None else record_limit
    while pos < limit:
        candidates = [buf.find(magic, pos + 4, limit) for magic in _SYNC_MAGICS]
        found = [c - 4 for c in candidates if c >= 0]
        if not found:
            return None
        p = min(found)
        magic = int.from_bytes(buf[p + 4 : p + 8], "big", signed=True)
        if magic == BLANK_MAGIC:
            if int.from_bytes(buf[p : p + 4], "big", signed=True) == segment_size - p:
                return p
        elif int.from_bytes(buf[p + PHY_OFFSET_POS : p + PHY_OFFSET_POS + 8], "big", signed=True) == segment_start + p:
            try:
                read_layout(buf, p, record_limit)
                return p
            except CorruptDataError:
                pass
        pos = p + 1
    return None

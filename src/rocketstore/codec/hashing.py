"""Java's hashes, bit for bit: ``String.hashCode`` over UTF-16 units and the masked CRC-32.

RocketMQ derives index slots and consume-queue tags codes from ``String.hashCode``, so a Python
string must be hashed as its UTF-16 code units (a non-BMP character counts twice) with 32-bit
wrap-around, and read back as a signed int.
"""

from __future__ import annotations

import operator
import zlib

_MASK32 = 0xFFFFFFFF
INT_MIN = -(1 << 31)


_POWERS_LEN = 512
_POWERS = [pow(31, i, 1 << 32) for i in range(_POWERS_LEN - 1, -1, -1)]  # 31^(n-1) .. 31^0, mod 2^32


def java_string_hash(text: str) -> int:
    """``String.hashCode()`` as a signed 32-bit int: sum of unit * 31^(n-1-i), mod 2^32.

    The sum of products runs in C (``map``) for text up to 512 units; a query hashes its key on every call.
    """
    if text.isascii():
        units: bytes | list[int] = text.encode("ascii")
    else:
        data = text.encode("utf-16-be", "surrogatepass")
        units = [data[i] << 8 | data[i + 1] for i in range(0, len(data), 2)]
    n = len(units)
    if n <= _POWERS_LEN:
        h = sum(map(operator.mul, units, _POWERS[_POWERS_LEN - n :])) & _MASK32
    else:
        h = 0
        for unit in units:
            h = (31 * h + unit) & _MASK32
    return h - (1 << 32) if h & 0x80000000 else h


def index_key_hash(key: str) -> int:
    """IndexFile's ``indexKeyHashMethod``: |hashCode|, with Integer.MIN_VALUE mapped to 0 (never negative)."""
    h = java_string_hash(key)
    return 0 if h == INT_MIN else abs(h)


def tags_hash_code(tags: str | None) -> int:
    """Consume-queue tags code of a TAGS value: 0 when absent or empty, else its hashCode (sign-extended)."""
    return java_string_hash(tags) if tags else 0


def body_crc(body: bytes | bytearray | memoryview) -> int:
    """RocketMQ's ``UtilAll.crc32``: IEEE CRC-32 masked to 31 bits (CRC of no body is 0)."""
    return zlib.crc32(body) & 0x7FFFFFFF if len(body) else 0

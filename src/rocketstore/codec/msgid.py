"""Message ids: the offset msgId (store host + commit-log offset) and the client UNIQ_KEY.

Offset msgId, 16 or 28 bytes as uppercase hex (32 or 56 chars)::

    store host address (4 | 16)  port i32  commit-log offset i64

UNIQ_KEY (``MessageClientIDSetter``), 16 or 28 bytes as uppercase hex::

    client ip (4 | 16)  pid low 16 bits  class-loader hash i32  ms since month start i32  counter u16

The time part counts from the 1st of the current month, 00:00 local time, so a decoder has to
guess the month: the current one, or the previous one when that would put the id in the future.
"""

from __future__ import annotations

import datetime as dt
import os
import random
import re
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np

from ..errors import InvalidMessageIdError
from .hosts import Host

_OFFSET = struct.Struct(">q")
_HEX_ID = re.compile(r"[0-9A-Fa-f]+")
_UNIQ_TAIL = struct.Struct(">Hiih")  # pid, loader hash, time, counter (written as short)
_ELAPSED = struct.Struct(">i")


def _java_int(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value & 0x80000000 else value


def create_offset_msg_id(store_host: Host | bytes, phy_offset: int) -> str:
    """``MessageDecoder.createMessageId``."""
    raw = store_host if isinstance(store_host, bytes | bytearray) else store_host.to_bytes()
    return (bytes(raw) + _OFFSET.pack(phy_offset)).hex().upper()


def decode_offset_msg_id(msg_id: str) -> tuple[Host, int]:
    """The store host and commit-log offset of an offset msgId; raises ``InvalidMessageIdError``."""
    text = msg_id.strip() if isinstance(msg_id, str) else ""
    if len(text) not in (32, 56):
        raise InvalidMessageIdError(f"a message id has 32 or 56 hex characters, not {len(text)}: {msg_id!r}")
    if not _HEX_ID.fullmatch(text):  # bytes.fromhex would skip inner whitespace and leave too few bytes
        raise InvalidMessageIdError(f"a message id is hexadecimal: {msg_id!r}")
    raw = bytes.fromhex(text)
    host = Host.from_bytes(raw[:-8])
    offset = _OFFSET.unpack_from(raw, len(raw) - 8)[0]
    if offset < 0:
        raise InvalidMessageIdError(f"message id {msg_id!r} holds a negative commit-log offset")
    return host, offset


class UniqKeyInfo(NamedTuple):
    ip: str
    pid: int
    class_loader_hash: int
    timestamp: int  # ms since the epoch, month guessed as described in the module docstring
    counter: int


def _month_start_ms(now_ms: int) -> tuple[int, int]:
    """(start of this month, start of next month) in ms, local time zone."""
    local = dt.datetime.fromtimestamp(now_ms / 1000).astimezone()
    start = local.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    nxt = (start + dt.timedelta(days=32)).replace(day=1)
    # replace() keeps the old UTC offset; re-localise so DST changes inside the month are honoured
    start = start.replace(tzinfo=None).astimezone()
    nxt = nxt.replace(tzinfo=None).astimezone()
    return int(start.timestamp() * 1000), int(nxt.timestamp() * 1000)


class UniqKeyRun(Sequence[str]):
    """``count`` consecutive UNIQ_KEYs of one ``hex_block``, made as strings when read: a put of plain messages
    writes them in its compiled loop, and most puts' results are never read."""

    __slots__ = ("count", "first", "head")

    def __init__(self, head: str, first: int, count: int) -> None:
        self.head, self.first, self.count = head, first, count

    def strings(self) -> list[str]:
        head, first = self.head, self.first
        return [f"{head}{(first + i) & 0xFFFF:04X}" for i in range(self.count)]

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index):
        return self.strings()[index]

    def __iter__(self) -> Iterator[str]:
        return iter(self.strings())


class UniqKeyGenerator:
    """Generates UNIQ_KEYs in RocketMQ's layout, as the broker does for messages that carry none."""

    def __init__(self, ip: str = "127.0.0.1", pid: int | None = None, class_loader_hash: int | None = None):
        host = Host.parse((ip, 0))
        self._prefix = host.to_bytes()[:-4]
        self._pid = (os.getpid() if pid is None else pid) & 0xFFFF
        if class_loader_hash is None:
            class_loader_hash = random.getrandbits(32) - (1 << 31)
        self._loader = class_loader_hash
        self._counter = random.getrandbits(16)
        self._last_ms = -1  # the time field's ms of the last id handed out; -1: none yet
        self._lock = threading.Lock()
        self._month = (0, 0)

    @property
    def state(self) -> tuple[int, int]:
        """(next counter, ms of the last id): what the next ids depend on besides the clock (tests rewind it)."""
        return self._counter, self._last_ms

    @state.setter
    def state(self, value: tuple[int, int]) -> None:
        self._counter, self._last_ms = value

    def _take(self, count: int, now: int, whole: bool = False) -> tuple[int, int, int] | None:
        """(elapsed ms field of the first id, first counter, ms of the first id) for ``count`` consecutive ids.

        Ids are unique while their (time, counter) pairs are: RocketMQ reads the clock for each id, so it repeats
        one only past 65,536 ids in a millisecond, but a block has one time. So ids never go back in time, and
        the id after each counter wrap is a millisecond later than the one before it: id ``i`` of a block is
        ``(first_ms + ((first + i) >> 16), (first + i) & 0xFFFF)``. ``whole``: None (nothing taken) rather
        than a block that wraps (one time field for all of it)."""
        with self._lock:
            first = self._counter
            if whole and first + count > 0x10000:
                return None
            ms = max(now, self._last_ms + (first == 0))  # a wrap just before: a later millisecond
            self._last_ms = ms + ((first + count - 1) >> 16)
            self._counter = (first + count) & 0xFFFF
            start, nxt = self._month
            if not start <= ms < nxt:
                self._month = start, nxt = _month_start_ms(ms)
        elapsed = _java_int(ms - start)  # Java casts to int: wraps after ~24.86 days of a month
        if -1_000_000 < elapsed < 0:
            elapsed = 0
        return elapsed, first, ms

    def next(self, now_ms: int | None = None) -> str:
        now = time.time_ns() // 1_000_000 if now_ms is None else now_ms
        elapsed, count, _ms = self._take(1, now)
        counter = count - 0x10000 if count & 0x8000 else count
        tail = _UNIQ_TAIL.pack(self._pid, self._loader, elapsed, counter)
        return (self._prefix + tail).hex().upper()

    @property
    def head_hex_len(self) -> int:
        """How many hex digits ``hex_block``'s head has (the id's, but the counter's 4)."""
        return 2 * (len(self._prefix) + _UNIQ_TAIL.size - 2)

    def hex_block(self, count: int, now_ms: int | None = None) -> tuple[str, int] | None:
        """``count`` consecutive ids as (hex of everything but the counter, first counter): id ``i`` is
        ``f"{head}{(first + i) & 0xFFFF:04X}"``, what ``next`` would return ``count`` times. None (nothing taken)
        when the counter would wrap within them: their time field is not one (``_take``)."""
        now = time.time_ns() // 1_000_000 if now_ms is None else now_ms
        taken = self._take(count, now, whole=True)
        if taken is None:
            return None
        elapsed, first, _ms = taken
        return (self._prefix + _UNIQ_TAIL.pack(self._pid, self._loader, elapsed, 0)[:-2]).hex().upper(), first

    def raw_block(self, count: int, now_ms: int | None = None) -> np.ndarray:
        """``count`` consecutive ids as raw bytes, one row each (the batch encoder hex-encodes them at once); a
        block of more than 65,536 ids moves its time field on a millisecond at each counter wrap."""
        now = time.time_ns() // 1_000_000 if now_ms is None else now_ms
        elapsed, first, _ms = self._take(count, now)
        head = self._prefix + _UNIQ_TAIL.pack(self._pid, self._loader, 0, 0)[:-6]
        raw = np.empty((count, len(head) + 6), dtype=np.uint8)
        raw[:, : len(head)] = np.frombuffer(head, dtype=np.uint8)
        sequence = np.arange(count, dtype=np.int64) + first
        laps = sequence >> 16
        for lap in range(int(laps[-1]) + 1 if count else 0):  # the time field of each lap's ids
            raw[laps == lap, len(head) : len(head) + 4] = np.frombuffer(
                _ELAPSED.pack(_java_int(elapsed + lap)), dtype=np.uint8)
        counters = sequence & 0xFFFF
        raw[:, -2] = counters >> 8
        raw[:, -1] = counters & 0xFF
        return raw


def decode_uniq_key(uniq_key: str, now_ms: int | None = None) -> UniqKeyInfo:
    """Split a UNIQ_KEY into its parts; raises ``InvalidMessageIdError``."""
    text = uniq_key.strip() if isinstance(uniq_key, str) else ""
    if len(text) not in (32, 56):
        raise InvalidMessageIdError(f"a UNIQ_KEY has 32 or 56 hex characters, not {len(text)}: {uniq_key!r}")
    if not _HEX_ID.fullmatch(text):
        raise InvalidMessageIdError(f"a UNIQ_KEY is hexadecimal: {uniq_key!r}")
    raw = bytes.fromhex(text)
    ip = Host.from_bytes(raw[:-12] + b"\0\0\0\0").ip
    pid, loader, elapsed, counter = _UNIQ_TAIL.unpack_from(raw, len(raw) - 12)
    now = time.time_ns() // 1_000_000 if now_ms is None else now_ms
    start, _ = _month_start_ms(now)
    elapsed &= 0xFFFFFFFF  # undo the int cast: no month is 2^32 ms long
    stamp = start + elapsed
    if stamp >= now:  # not earlier than now: it was made in the previous month
        prev_start, _ = _month_start_ms(start - 1)
        stamp = prev_start + elapsed
    return UniqKeyInfo(ip, pid, loader, stamp, counter & 0xFFFF)

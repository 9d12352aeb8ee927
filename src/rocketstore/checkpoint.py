"""The 4096-byte ``checkpoint`` file (RocketMQ's ``StoreCheckpoint``).

Layout (big-endian i64 fields, the rest of the 4 KiB zero)::

    0  physicMsgTimestamp   store time of the last message known flushed in the commit log
    8  logicsMsgTimestamp   store time of the last message put in a consume queue
    16 indexMsgTimestamp    end time of the last index file known complete on disk
    24 masterFlushedOffset  (HA only)
    32 confirmPhyOffset     confirm offset; normal recovery stores where the last valid record starts

rocketstore adds a seal RocketMQ ignores: bytes 40-43 ``RSCK`` and 44-47 the CRC-32 of bytes
0-39. A checkpoint is trusted when its values are sane. A seal that matches says the values are
the ones rocketstore wrote; a seal that does not match, over sane values, is what a RocketMQ broker
leaves when it takes over a store rocketstore sealed (it rewrites bytes 0-39 in place and never
touches the rest), so the values are trusted as RocketMQ's and the seal is renewed at the next
flush. Only values that cannot be right (negative, or times far in the future) are ignored, and
recovery then starts from the first segment.
"""

from __future__ import annotations

import logging
import os
import struct
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from .errors import StoreIOError
from .mapped.file import pwrite_all

CHECKPOINT_SIZE = 4096
FIELDS_FMT = ">qqqqq"
_FIELDS = struct.Struct(FIELDS_FMT)
_SEAL = struct.Struct(">4sI")
SEAL_MAGIC = b"RSCK"
assert _FIELDS.size == 40

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StoreCheckpoint:
    """In-memory checkpoint values; ``flush()`` makes them durable."""

    path: Path
    physic_msg_timestamp: int = 0
    logics_msg_timestamp: int = 0
    index_msg_timestamp: int = 0
    master_flushed_offset: int = 0
    confirm_phy_offset: int = 0
    read_only: bool = False
    trusted: bool = True  # False when the file on disk was damaged and has been ignored
    rewritten_by_rocketmq: bool = False  # sane values under a stale seal: a broker wrote it last

    @classmethod
    def load(cls, path: Path, *, read_only: bool = False) -> StoreCheckpoint:
        checkpoint = cls(path, read_only=read_only)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return checkpoint
        except OSError as exc:
            raise StoreIOError(exc.errno, f"cannot read {path}: {exc.strerror}") from exc
        if len(data) < _FIELDS.size:
            log.warning("checkpoint %s is only %d bytes; ignoring it", path, len(data))
            checkpoint.trusted = False
            return checkpoint
        values = _FIELDS.unpack_from(data, 0)
        sealed = len(data) >= 48 and data[40:44] == SEAL_MAGIC
        horizon = time.time_ns() // 1_000_000 + 86_400_000
        if any(v < 0 for v in values) or any(v > horizon for v in values[:3]):
            log.warning("checkpoint %s holds impossible values %s; ignoring it", path, values)
            checkpoint.trusted = False
            return checkpoint
        if sealed and _SEAL.unpack_from(data, 40)[1] != zlib.crc32(data[:40]):
            checkpoint.rewritten_by_rocketmq = True
            log.info("checkpoint %s was rewritten since rocketstore sealed it (by a RocketMQ broker); using its "
                     "values %s", path, values)
        (checkpoint.physic_msg_timestamp, checkpoint.logics_msg_timestamp, checkpoint.index_msg_timestamp,
         checkpoint.master_flushed_offset, checkpoint.confirm_phy_offset) = values
        return checkpoint

    def to_bytes(self) -> bytes:
        fields = _FIELDS.pack(self.physic_msg_timestamp, self.logics_msg_timestamp, self.index_msg_timestamp,
                              self.master_flushed_offset, self.confirm_phy_offset)
        return fields + _SEAL.pack(SEAL_MAGIC, zlib.crc32(fields))

    def flush(self) -> None:
        """Write the fields in place and fsync (one 48-byte write inside the first sector)."""
        if self.read_only:
            return
        data = self.to_bytes()
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
            try:
                if os.fstat(fd).st_size != CHECKPOINT_SIZE:
                    os.ftruncate(fd, CHECKPOINT_SIZE)
                pwrite_all(fd, data, 0)  # a short write is not success (the old fields stay, half new)
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise StoreIOError(exc.errno, f"cannot write {self.path}: {exc.strerror}") from exc

    @property
    def min_timestamp(self) -> int:
        """``getMinTimestamp``: a time before which everything is on disk, with 3 s of margin."""
        return max(0, min(self.physic_msg_timestamp, self.logics_msg_timestamp) - 3000)

    @property
    def min_timestamp_index(self) -> int:
        return min(self.min_timestamp, self.index_msg_timestamp)

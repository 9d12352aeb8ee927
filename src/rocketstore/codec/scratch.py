"""Each thread's encode buffer, reused from put to put (RocketMQ's encoders keep one per thread too).

A new buffer per put is new memory: above glibc's mmap threshold it is mapped and unmapped again every
time, and the first write to each of its pages faults (~1.6 us a page on this VM). For ``put_messages`` of
32 records of 16 KiB that was 60% of encoding (21.5 -> 8.7 us a record with the buffer kept).
"""

from __future__ import annotations

import threading

KEEP_MAX = 16 << 20  # a thread keeps at most this much; a larger put gets a buffer of its own


class _Buffers(threading.local):
    def __init__(self) -> None:
        self.buffer = bytearray(0)


_local = _Buffers()


def scratch(size: int) -> memoryview:
    """A writable view of ``size`` bytes that this thread's next call overwrites: for records that do not
    outlive the put encoding them. The bytes are stale, not zeroed; the encoders write every one."""
    if size > KEEP_MAX:
        return memoryview(bytearray(size))
    buffer = _local.buffer
    if len(buffer) < size:
        buffer = _local.buffer = bytearray(max(size, min(2 * len(buffer), KEEP_MAX)))
    return memoryview(buffer)[:size]

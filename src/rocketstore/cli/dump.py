"""Walking commit-log segment files record by record for ``dump-log``, reporting instead of raising."""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from pathlib import Path

from ..codec.record import find_record_start, message_from_layout, read_layout
from ..errors import CorruptDataError, StoreIOError
from ..mapped.file import parse_segment_name


def segment_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(p for p in path.iterdir() if p.is_file() and parse_segment_name(p.name) is not None)
    if not files:
        raise StoreIOError(2, f"{path} holds no commit-log segment files (20-digit names)")
    return files


def dump_records(path: Path, from_offset: int | None = None, *, check_crc: bool = False,
                 decompress: bool = False) -> Iterator[dict]:
    """Events in log order: ``record`` (with ``message``), ``blank``, then ``error`` or ``end`` where decoding stops."""
    segments = segment_files(path)
    for n, segment in enumerate(segments):
        start = parse_segment_name(segment.name) or 0
        size = segment.stat().st_size
        if from_offset is not None and from_offset >= start + size:
            continue
        pos = max(0, from_offset - start) if from_offset is not None else 0
        if size == 0:
            yield {"kind": "end", "pos": start, "segment": segment.name}
            return
        with open(segment, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as buf:
            if pos > 0:  # --from need not be a record start: sync to the first one at or after it
                found = find_record_start(buf, pos, size, start, size)
                if found is None and n < len(segments) - 1:
                    continue  # past the segment's last record (its BLANK tail): the log goes on in the next one
                if found is None:
                    yield {"kind": "end", "pos": start + pos, "segment": segment.name}
                    return
                pos = found
            last_ts = None  # the store time of the segment's last record shown
            while True:
                try:
                    layout = read_layout(buf, pos, size, check_crc=check_crc, path=str(segment), base=start)
                except CorruptDataError as exc:
                    if bytes(buf[pos : pos + 8]) == bytes(8) or pos >= size:
                        yield {"kind": "end", "pos": start + pos, "segment": segment.name}
                    else:
                        yield {"kind": "error", "pos": start + pos, "segment": segment.name, "reason": exc.reason}
                    return
                if layout is None:
                    yield {"kind": "blank", "pos": start + pos, "size": size - pos, "segment": segment.name}
                    from ..codec.batch import record_after_blank  # numba's load: only once a BLANK is met

                    hidden = record_after_blank(buf, pos, size, start, last_ts)
                    if hidden is not None:  # 8 bytes that read as a BLANK, with the segment's records after them
                        yield {"kind": "error", "pos": start + pos, "segment": segment.name,
                               "reason": f"a BLANK record with an intact record after it (at {start + hidden})"}
                        return
                    break
                try:
                    msg = message_from_layout(buf, pos, layout, decompress=decompress, path=str(segment), base=start)
                except CorruptDataError as exc:
                    yield {"kind": "error", "pos": start + pos, "segment": segment.name, "reason": exc.reason}
                    return
                yield {"kind": "record", "pos": start + pos, "message": msg, "segment": segment.name}
                last_ts = msg.store_timestamp
                pos += layout.size

"""Store configuration: RocketMQ's ``MessageStoreConfig`` names in snake_case, with its defaults.

Only settings that change what is written or how it is recovered live here; a value that must
match the files on disk (segment sizes, index geometry) is checked again when a store opens.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import os
import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ConfigError

GIB = 1 << 30
MIB = 1 << 20


class FlushDiskType(enum.StrEnum):
    """``flushDiskType``: when a put is acknowledged."""

    ASYNC_FLUSH = "ASYNC_FLUSH"  # in the page cache: survives a process crash, not a power loss
    SYNC_FLUSH = "SYNC_FLUSH"  # on disk (msync) before the put returns


DEFAULT_DELAY_LEVELS = "1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h"
_DELAY_UNITS_MS = {"s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Settings of one store; the RocketMQ name of each is in its comment."""

    # --- files
    mapped_file_size_commit_log: int = GIB  # mappedFileSizeCommitLog
    mapped_file_size_consume_queue: int = 300_000 * 20  # mappedFileSizeConsumeQueue
    max_hash_slot_num: int = 5_000_000  # maxHashSlotNum
    max_index_num: int = 5_000_000 * 4  # maxIndexNum
    preallocate: bool = True  # rocketstore: reserve segment blocks up front, so a full disk fails
    #                           the roll, not a later write into the mapping (SIGBUS)
    max_open_consume_queue_files: int = 256  # rocketstore: mapped consume-queue files kept open (LRU)
    warm_ahead_commit_log: int = 8 * MIB  # rocketstore: bytes past the write position faulted in before the
    #                                       appends that fill them (mapped/warm.py; 0 turns it off)

    # --- messages
    max_message_size: int = 4 * MIB  # maxMessageSize (body; the record may add 64 KiB)
    auto_message_version_on_topic_len: bool = True  # autoMessageVersionOnTopicLen
    enabled_append_prop_crc: bool = False  # enabledAppendPropCRC
    force_verify_prop_crc: bool = False  # forceVerifyPropCRC
    message_delay_level: str = DEFAULT_DELAY_LEVELS  # messageDelayLevel
    store_host: str = "127.0.0.1:10911"  # brokerIP1 + listenPort: goes into every offset msgId

    # --- flush and durability
    flush_disk_type: FlushDiskType = FlushDiskType.ASYNC_FLUSH  # flushDiskType
    flush_interval_commit_log: int = 500  # flushIntervalCommitLog (ms)
    flush_commit_log_least_pages: int = 4  # flushCommitLogLeastPages
    flush_commit_log_thorough_interval: int = 10_000  # flushCommitLogThoroughInterval (ms)
    sync_flush_timeout: int = 5_000  # syncFlushTimeout (ms)
    flush_interval_consume_queue: int = 1_000  # flushIntervalConsumeQueue (ms)
    flush_consume_queue_least_pages: int = 2  # flushConsumeQueueLeastPages
    flush_consume_queue_thorough_interval: int = 60_000  # flushConsumeQueueThoroughInterval (ms)

    # --- recovery and reads
    check_crc_on_recover: bool = True  # checkCRCOnRecover
    check_crc_on_read: bool = True  # rocketstore: never hand out a record whose body CRC fails
    message_index_enable: bool = True  # messageIndexEnable
    message_index_safe: bool = False  # messageIndexSafe
    max_msgs_num_batch: int = 64  # maxMsgsNumBatch
    default_query_max_num: int = 32  # defaultQueryMaxNum
    recovery_salvage_max_bytes: int = 64 * MIB  # rocketstore: torn-tail bytes kept in recovery/
    # rocketstore: a writer's open ends the log at damage with intact records after it, as RocketMQ's recovery does,
    # and a read-only open answers from the log up to it (``recovery.resumes_at`` says where the intact records
    # resume); False: both raise DamagedLogError, nothing cut (the CLI's way without --allow-damage)
    cut_damaged_log: bool = True

    # --- topics, consumers, delays
    auto_create_topic_enable: bool = True  # autoCreateTopicEnable
    default_topic_queue_nums: int = 8  # defaultTopicQueueNums
    flush_consumer_offset_interval: int = 5_000  # flushConsumerOffsetInterval (ms)
    enable_schedule_message: bool = True  # deliver DELAY and timer messages (ScheduleMessageService, timer wheel)
    timer_max_delay_sec: int = 259_200  # timerMaxDelaySec: how far ahead a TIMER_DELIVER_MS may be

    # --- retention
    file_reserved_time: int = 72  # fileReservedTime (hours)
    delete_when: str = "04"  # deleteWhen: local hours (";"-separated) when expired files are deleted
    disk_max_used_space_ratio: int = 75  # diskMaxUsedSpaceRatio (%)

    _delay_levels_ms: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _delete_hours: frozenset[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.flush_disk_type, str):
            try:
                object.__setattr__(self, "flush_disk_type", FlushDiskType(self.flush_disk_type))
            except ValueError:
                raise ConfigError(
                    f"flush_disk_type must be ASYNC_FLUSH or SYNC_FLUSH, not {self.flush_disk_type!r}"
                ) from None
        _check_range("mapped_file_size_commit_log", self.mapped_file_size_commit_log, 1024, (1 << 31) - 1)
        _check_range("mapped_file_size_consume_queue", self.mapped_file_size_consume_queue, 20, (1 << 31) - 1)
        _check_range("max_open_consume_queue_files", self.max_open_consume_queue_files, 4, 1 << 20)
        _check_range("warm_ahead_commit_log", self.warm_ahead_commit_log, 0, 1 << 30)
        if self.mapped_file_size_consume_queue % 20:
            raise ConfigError("mapped_file_size_consume_queue must be a multiple of 20 (the unit size)")
        _check_range("max_hash_slot_num", self.max_hash_slot_num, 1, 100_000_000)
        _check_range("max_index_num", self.max_index_num, 2, 100_000_000)
        _check_range("max_message_size", self.max_message_size, 1, (1 << 31) - 65_537)
        _check_range("flush_interval_commit_log", self.flush_interval_commit_log, 1, 3_600_000)
        _check_range("sync_flush_timeout", self.sync_flush_timeout, 1, 3_600_000)
        _check_range("max_msgs_num_batch", self.max_msgs_num_batch, 1, 1_000_000)
        _check_range("disk_max_used_space_ratio", self.disk_max_used_space_ratio, 10, 95)
        _check_range("file_reserved_time", self.file_reserved_time, 0, 1_000_000)
        _check_range("timer_max_delay_sec", self.timer_max_delay_sec, 1, 1 << 31)
        parse_store_host(self.store_host)
        object.__setattr__(self, "_delay_levels_ms", parse_delay_levels(self.message_delay_level))
        if not isinstance(self.delete_when, str):
            raise ConfigError(f"delete_when must be a string of hours such as '04' or '1;4', not {self.delete_when!r}")
        object.__setattr__(self, "_delete_hours", parse_delete_hours(self.delete_when))

    @property
    def delete_hours(self) -> frozenset[int]:
        """The local hours of ``delete_when``."""
        return self._delete_hours

    @property
    def delay_levels_ms(self) -> tuple[int, ...]:
        """Delay of level i (1-based) in milliseconds at index i-1."""
        return self._delay_levels_ms

    def replace(self, **changes: object) -> StoreConfig:
        """A copy with some settings changed (the config itself is immutable)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @classmethod
    def from_broker_conf(cls, path: str | Path, **overrides: object) -> StoreConfig:
        """Read the settings this class knows from a RocketMQ ``broker.conf`` (camelCase keys).

        Unknown keys are ignored, as the broker ignores keys of other components.
        """
        values = broker_conf_values(path)
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]


GEOMETRY = ("mapped_file_size_commit_log", "mapped_file_size_consume_queue", "max_hash_slot_num", "max_index_num")


def broker_conf_values(path: str | Path) -> dict[str, object]:
    """The settings ``StoreConfig`` knows that a ``broker.conf`` sets, by field name (what it names explicitly)."""
    # each key exactly as the broker's ``MixAll.properties2Object`` looks it up: its setter's name without "set",
    # first letter lowered (checkCRCOnRecover); checkCrcOnRecover or CheckCRCOnRecover is ignored there, and here
    known = {java_key(f.name): f for f in dataclasses.fields(StoreConfig) if f.init}
    values: dict[str, object] = {}
    for key, value in _conf_settings(path):
        f = known.get(key)
        if f is None:
            continue
        values[f.name] = _coerce(f, value)
    return broker_sizes(values)


def broker_conf_store_root(path: str | Path) -> str | None:
    """The ``storePathRootDir`` a ``broker.conf`` names (the store the broker runs on), or None."""
    found = None
    for key, value in _conf_settings(path):
        if key == "storePathRootDir" and value.strip():
            found = value.strip()  # the last one wins, as in a Properties file; a String setting is trimmed
    return found


def check_commit_log_path(path: str | Path, root: Path) -> None:
    """Refuse a ``broker.conf`` whose commit log is not ``<root>/commitlog``: ``storePathCommitLog`` elsewhere, or
    several paths (RocketMQ's multi-path log, ``MultiPathMappedFileQueue``), or ``readOnlyCommitLogStorePaths``.
    Read from ``<root>/commitlog`` instead, such a log looked missing (or a part of it was all there was)."""
    settings = {key: value.strip() for key, value in _conf_settings(path)}  # String settings: trimmed
    where = settings.get("storePathCommitLog", "")
    extra = settings.get("readOnlyCommitLogStorePaths", "")
    if "," in where or extra:
        raise ConfigError(f"{path} spreads the commit log over several directories (storePathCommitLog "
                          f"{where!r}{', readOnlyCommitLogStorePaths ' + repr(extra) if extra else ''}): rocketstore "
                          "reads one commit-log directory")
    if where and os.path.realpath(where) != os.path.realpath(root / "commitlog"):  # a link there is the log
        raise ConfigError(f"{path} keeps the commit log at {where} (storePathCommitLog), not in the store root "
                          f"{root}: rocketstore reads {root / 'commitlog'}; link it there "
                          f"(ln -s {where} {root / 'commitlog'})")


def _conf_settings(path: str | Path) -> list[tuple[str, str]]:
    """The settings of a ``broker.conf``, read as ``java.util.Properties.load`` reads it (the broker does): ``#``/``!``
    comments, ``=``, ``:`` or blanks between key and value, lines continued by a trailing backslash, escapes. A
    value keeps its trailing blanks, as Java's does: the broker trims a String setting, and cannot parse a number
    with them (named here)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not UTF-8 text (byte {exc.start})") from None
    settings = []
    lines = _LINE_END.split(text)
    i = 0
    while i < len(lines):
        line = lines[i].lstrip(_BLANKS)
        i += 1
        if not line or line[0] in "#!":
            continue
        while _continued(line):
            line = line[:-1] + (lines[i].lstrip(_BLANKS) if i < len(lines) else "")
            i += 1
        settings.append(_key_value(line))
    return settings


_LINE_END = re.compile(r"\r\n|\r|\n")
_BLANKS = " \t\f"
_ESCAPES = {"t": "\t", "n": "\n", "r": "\r", "f": "\f"}


def _continued(line: str) -> bool:
    return (len(line) - len(line.rstrip("\\"))) % 2 == 1


def _key_value(line: str) -> tuple[str, str]:
    """A logical line's key (up to the first unescaped ``=``, ``:`` or blank) and value, both unescaped."""
    pos = 0
    while pos < len(line) and line[pos] not in "=:" + _BLANKS:
        pos += 2 if line[pos] == "\\" else 1
    key, rest = line[:pos], line[pos:].lstrip(_BLANKS)
    if rest[:1] in ("=", ":"):
        rest = rest[1:].lstrip(_BLANKS)
    return _unescape(key), _unescape(rest)


def _unescape(text: str) -> str:
    if "\\" not in text:
        return text
    out, pos = [], 0
    while pos < len(text):
        char = text[pos]
        if char != "\\" or pos + 1 >= len(text):
            out.append(char)
            pos += 1
            continue
        code = text[pos + 1]
        if code == "u" and re.fullmatch(r"[0-9a-fA-F]{4}", text[pos + 2 : pos + 6]):
            out.append(chr(int(text[pos + 2 : pos + 6], 16)))
            pos += 6
        else:
            out.append(_ESCAPES.get(code, code))
            pos += 2
    return "".join(out)


def broker_sizes(values: dict[str, object]) -> dict[str, object]:
    """``values`` with mappedFileSizeConsumeQueue read as a broker reads it: rounded up to whole entries
    (``MessageStoreConfig.getMappedFileSizeConsumeQueue``), so a broker.conf that a broker takes is taken."""
    size = values.get("mapped_file_size_consume_queue")
    if type(size) is int and size > 0:
        values["mapped_file_size_consume_queue"] = -(-size // CQ_UNIT) * CQ_UNIT
    return values


def _sized_by(root: Path, name: str) -> Path:
    """The directory whose files tell ``name``'s sizes: the store's own, or, where a rebuild killed in its swap left
    it missing (``swap.pending_swap``), the new one not yet moved in. A kill between moving the old set aside and the
    new one in left ``name`` missing, and an open or a rebuild that detected sizes then took RocketMQ's defaults: the
    rebuilt queues were set aside as damaged and written again with 6,000,000-byte files, or the index rebuilt as one
    420 MB file (the Spark kill review). Where the store's own is still there, it is what a reader serves."""
    from .mapped.file import STAGING_DIR
    from .swap import pending_swap

    if (root / name).is_dir():
        return root / name
    build = pending_swap(root / STAGING_DIR)
    if build is not None and (build / name).is_dir() and any(os.scandir(build / name)):
        return build / name
    return root / name


def detect_config(root: str | Path, base: StoreConfig | None = None, *,
                  explicit: Iterable[str] | None = None) -> StoreConfig:
    """``base`` with the geometry found on disk: commit-log segment, consume-queue file and index file sizes.

    A setting named in ``explicit`` (default: those in which ``base`` differs from StoreConfig's defaults) is
    never replaced: a file that disagrees with it is damaged, and the store handles it as such (but a queue or
    index setting that more files disagree with than agree is refused as wrong). Otherwise the
    most common size among the files decides (one damaged file never redefines the others, which then are
    reported as damaged; ties go to the size the files' names agree with; a commit-log size nothing confirms is
    refused, see ``detect_segment_size``). Index geometry is inferred when
    it follows RocketMQ's 4 entries per slot; any other size that the configured slots and entries do not
    explain is an error."""
    from .index.file import index_file_size

    root = Path(root)
    config = base or StoreConfig()
    if explicit is None:
        default = StoreConfig()
        explicit = {name for name in GEOMETRY if getattr(config, name) != getattr(default, name)}
    explicit = set(explicit)
    changes: dict[str, object] = {}
    if "mapped_file_size_commit_log" not in explicit:
        segment_size = detect_segment_size(root)
        if segment_size:
            changes["mapped_file_size_commit_log"] = segment_size
    queues = _sized_by(root, "consumequeue")
    if queues.is_dir():
        found = [(Path(dirpath), run) for dirpath, _dirs, _files in os.walk(queues)
                 if (run := _sized_files(Path(dirpath), lambda name: name.isdigit()))]
        runs = [run for _directory, run in found]
        if "mapped_file_size_consume_queue" not in explicit:
            size = _common_size(runs, multiple=CQ_UNIT)
            if size and size != config.mapped_file_size_consume_queue:
                size = _confirmed_queue_size(size, found, config.mapped_file_size_consume_queue)
            if size:
                changes["mapped_file_size_consume_queue"] = size
        else:  # a writer sets a disagreeing queue aside: not every queue because the setting is wrong
            _refuse_a_setting_most_files_disagree_with(
                "consume-queue files", queues, Counter(size for run in runs for _name, size in run),
                config.mapped_file_size_consume_queue, "mappedFileSizeConsumeQueue")
    index = _sized_by(root, "index")
    index_explicit = bool({"max_hash_slot_num", "max_index_num"} & explicit)
    if index.is_dir():
        configured = index_file_size(config.max_hash_slot_num, config.max_index_num)
        sizes = Counter(size for _name, size in _sized_files(index, lambda name: name.isdigit() and len(name) == 17))
        if index_explicit:
            _refuse_a_setting_most_files_disagree_with("index files", index, sizes, configured,
                                                       "maxHashSlotNum and maxIndexNum")
        # the most common size; on a tie the configured one, then one of RocketMQ's 4-entries-per-slot form
        size = max(sizes, key=lambda s: (sizes[s], s == configured, _four_per_slot(s)), default=None)
        if size is not None and size != configured and not index_explicit and _four_per_slot(size):
            # RocketMQ sizes the index as maxIndexNum = 4 * maxHashSlotNum: 40 + 4*S + 20*4*S bytes
            slots = (size - 40) // 84
            changes.update(max_hash_slot_num=slots, max_index_num=4 * slots)
        elif size is not None and size != configured and not index_explicit:
            raise ConfigError(f"index files in {index} are {size} bytes, which max_hash_slot_num="
                              f"{config.max_hash_slot_num} and max_index_num={config.max_index_num} do not "
                              f"give; pass the broker's maxHashSlotNum and maxIndexNum")
    return config.replace(**changes) if changes else config


CQ_UNIT = 20


def _confirmed_queue_size(size: int, found: list[tuple[Path, list[tuple[str, int]]]], configured: int) -> int:
    """The most common consume-queue file size, unless it is not a whole number of entries, or only one file has
    it, no file name confirms it (neighbours that far apart, a non-zero start it divides) and a file has the
    configured size: then the configured size if a file has it, else a ``ConfigError`` until the size is named.

    One file cut short (a bad copy, a full disk) beside one intact queue file won the tie as the smaller size: the
    intact queue was then set aside and rebuilt at the cut size, and every new queue file written at it, which a
    broker refuses to load. A store's only queue file at a size that is a whole number of entries stays its geometry
    (a small store made with that setting looks the same as one cut there)."""
    sizes = [n for _directory, run in found for _name, n in run]
    has_configured = configured in sizes
    starts = [[int(name) for name, _ in run] for _directory, run in found]
    confirmed = not size % CQ_UNIT and (
        not has_configured or sizes.count(size) > 1
        or any(b - a == size for run in starts for a, b in itertools.pairwise(run))
        or any(start > 0 and start % size == 0 for run in starts for start in run))
    if confirmed:
        return size
    if has_configured:
        return configured
    path = next(directory / name for directory, run in found for name, n in run if n == size)
    raise ConfigError(
        f"consume-queue file {path} is {size} bytes, no whole number of {CQ_UNIT}-byte entries: it looks cut short. "
        "Name the broker's mappedFileSizeConsumeQueue (--mapped-file-size-consume-queue or --broker-conf); a queue "
        "file of another size is then handled as damaged")


def _refuse_a_setting_most_files_disagree_with(what: str, where: Path, sizes: Counter, configured: int,
                                               setting: str) -> None:
    """An explicit size that more files disagree on (in one size) than agree with is a wrong setting, not that
    many damaged files: refused before anything is opened, so no file is set aside for it. One file proves
    nothing either way: a lone file cut short is what naming the size is for."""
    agreeing = sizes.get(configured, 0)
    common, count = max(((size, n) for size, n in sizes.items() if size != configured), key=lambda item: item[1],
                        default=(0, 0))
    if count > agreeing and count > 1:
        raise ConfigError(f"{what} in {where} are {common} bytes ({count} of {sum(sizes.values())}), not the "
                          f"{configured} that the configured {setting} give: pass the broker's settings")


def _four_per_slot(size: int) -> bool:
    return size > 40 and (size - 40) % 84 == 0


def _sized_files(directory: Path, named: Callable[[str], bool]) -> list[tuple[str, int]]:
    """(name, size) of the regular files in ``directory`` whose names pass ``named``, by name (directories and
    empty files, a crash during a file's creation, tell nothing)."""
    out = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return out
    for entry in entries:
        try:
            if named(entry.name) and entry.is_file():
                size = entry.stat().st_size
                if size > 0:
                    out.append((entry.name, size))
        except OSError:
            continue
    return sorted(out)


def _common_size(runs: list[list[tuple[str, int]]], multiple: int = 1) -> int | None:
    """The file size of runs of segment files (name = start offset): the most common size, so one damaged
    file is reported as damaged instead of redefining the size of the others. On a tie, a size the names
    agree with (every start a multiple of it, neighbours that far apart) wins, then the larger count of
    neighbours it explains, then the smaller size."""
    sizes = Counter(size for run in runs for _name, size in run)
    if not sizes:
        return None

    def agrees(size: int) -> tuple[bool, int]:
        if size % multiple:
            return False, 0
        starts = [[int(name) for name, _ in run] for run in runs]
        aligned = all(start % size == 0 for run in starts for start in run)
        explained = sum(b - a == size for run in starts for a, b in itertools.pairwise(run))
        gaps = sum(len(run) - 1 for run in starts)
        return aligned and explained == gaps, explained

    return max(sizes, key=lambda s: (sizes[s], *agrees(s), -s))


OS_PAGE_SIZE = 4096  # RocketMQ's MappedFile.OS_PAGE_SIZE


def plausible_segment_size(size: int) -> bool:
    """Whether a broker is plausibly configured with segments of ``size`` bytes: the 1 GiB default, or any
    power-of-two number of 4 KiB pages (what small stores, tests and tools use). A file cut short by a bad copy
    or a full disk almost never is one."""
    pages, rest = divmod(size, OS_PAGE_SIZE)
    return size == GIB or (rest == 0 and pages > 0 and pages & (pages - 1) == 0)


def detect_segment_size(root: str | Path) -> int | None:
    """The commit-log segment size of a store: the most common size among its segment files (so one
    truncated file is reported as damaged instead of redefining the size); None without segments.

    A size only one file has (a store of one segment) is taken only when something confirms it: neighbours'
    names that far apart, a non-zero start it divides, or a plausible configured size (``plausible_segment_size``).
    Otherwise the file is most likely cut short, and the size is refused (``ConfigError``) rather than taken as the
    store's geometry: the broker's mappedFileSizeCommitLog must then be named."""
    directory = Path(root) / "commitlog"
    if not directory.is_dir():
        return None
    segments = _sized_files(directory, lambda name: len(name) == 20 and name.isdigit())
    size = _common_size([segments])
    if size is None or _confirmed(size, segments):
        return size
    name = next(name for name, n in segments if n == size)
    raise ConfigError(
        f"commit-log segment {directory / name} is {size} bytes, a size no other segment or segment name confirms "
        f"and not one a broker is configured with (1 GiB, or a power-of-two number of {OS_PAGE_SIZE}-byte pages): "
        "it looks cut short. Name the broker's mappedFileSizeCommitLog (--mapped-file-size-commit-log or "
        "--broker-conf); a segment of another size is then reported as damaged")


def _confirmed(size: int, segments: list[tuple[str, int]]) -> bool:
    """Whether more than the one file of ``size`` says the store's segments are that large."""
    if sum(n == size for _name, n in segments) > 1 or plausible_segment_size(size):
        return True
    starts = [int(name) for name, _size in segments]
    return any(b - a == size for a, b in itertools.pairwise(starts)) or \
        any(start > 0 and start % size == 0 for start in starts)


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


# the settings whose RocketMQ names spell an acronym in capitals
_JAVA_KEYS = {"check_crc_on_recover": "checkCRCOnRecover", "enabled_append_prop_crc": "enabledAppendPropCRC",
              "force_verify_prop_crc": "forceVerifyPropCRC"}


def java_key(field_name: str) -> str:
    """The ``broker.conf`` key of a ``StoreConfig`` field (``check_crc_on_recover`` -> ``checkCRCOnRecover``)."""
    return _JAVA_KEYS.get(field_name) or _camel(field_name)


_JAVA_INT = re.compile(r"[+-]?[0-9]+")


def _coerce(f: dataclasses.Field, value: str) -> object:
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
    if kind == "bool":
        return value.lower() == "true"
    if kind == "int":
        try:
            if not _JAVA_INT.fullmatch(value):  # Integer.parseInt: no blanks, ASCII digits (int() takes both)
                raise ValueError(value)
            return int(value)
        except ValueError:
            blank = " (the blanks after it too: a broker reads no number there either, and keeps its default)" \
                if value != value.rstrip() else ""
            raise ConfigError(f"{java_key(f.name)} must be an integer, not {value!r}{blank}") from None
    return value.strip()  # properties2Object trims a String setting (not a number's)


def _check_range(name: str, value: int, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ConfigError(f"{name} must be an integer in [{low}, {high}], not {value!r}")


def parse_delete_hours(spec: str) -> frozenset[int]:
    """``delete_when`` (``deleteWhen``) -> the local hours it names: ``"04"``, ``"4"`` and ``"1;4"`` as RocketMQ's
    ``UtilAll.isItTimeToDo`` reads them (each ``;``-separated piece an ``Integer.parseInt`` of an hour of the day).
    RocketMQ throws at every check on a piece that is not an integer, and a number past 23 never matches: both are
    refused here, rather than retention that silently never runs."""
    pieces = spec.split(";")
    while len(pieces) > 1 and not pieces[-1]:  # Java's split drops trailing empty strings
        pieces.pop()
    hours = set()
    for piece in pieces:
        if not _JAVA_INT.fullmatch(piece) or not 0 <= int(piece) <= 23:
            raise ConfigError(f"delete_when takes hours of the day 0-23 separated by ';' (e.g. 04 or 1;4), not "
                              f"{spec!r}")
        hours.add(int(piece))
    return frozenset(hours)


def parse_delay_levels(spec: str) -> tuple[int, ...]:
    """``"1s 5s 1m"`` -> (1000, 5000, 60000), as RocketMQ parses ``messageDelayLevel``."""
    levels = []
    for token in spec.split():
        match = re.fullmatch(r"(\d+)([smhd])", token)
        if not match:
            raise ConfigError(f"message_delay_level: cannot parse {token!r} (expected e.g. 10s, 5m, 2h)")
        levels.append(int(match.group(1)) * _DELAY_UNITS_MS[match.group(2)])
    if not levels:
        raise ConfigError("message_delay_level must name at least one level")
    return tuple(levels)


def parse_store_host(text: str) -> tuple[str, int]:
    """``"10.0.0.1:10911"`` or ``"[2001:db8::1]:10911"`` -> (ip, port), checked."""
    import ipaddress

    if text.startswith("["):
        ip, _, port = text[1:].partition("]:")
    else:
        ip, _, port = text.rpartition(":")
    try:
        ipaddress.ip_address(ip)
        port_number = int(port)
    except ValueError:
        raise ConfigError(f"store_host must look like 10.0.0.1:10911 or [::1]:10911, not {text!r}") from None
    if not 0 <= port_number <= 0xFFFF:
        raise ConfigError(f"store_host port out of range: {text!r}")
    return ip, port_number

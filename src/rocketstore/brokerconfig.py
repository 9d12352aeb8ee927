"""The store's ``config/`` directory: topics, subscription groups, consumer and delay offsets.

RocketMQ's broker writes these JSON files with fastjson, whose output is not quite JSON: maps with
integer keys (queue ids, delay levels) have bare keys, e.g. ``{"offsetTable":{"T@g":{0:250,1:250}}}``.
rocketstore reads both forms and writes RocketMQ's, so a broker can read our files and we can
read the broker's.

Writes (``persist_text``) are atomic and safe from any number of threads: one lock per file serialises
them, the new content goes to a unique ``<file>.tmp.<pid>.<n>`` that is fsynced and renamed over the
file (never deleted first, so a reader always finds a whole file), and ``<file>.bak`` is written first
from content known to be good (the previous file only if it validates), so a crash or a race never
leaves both copies bad. A writer's ``load`` removes temporary files a killed process left behind.

Reads (``load_config``) validate the whole document against the file's schema (below): invalid UTF-8,
bad JSON, nesting, duplicate keys, NaN, and a wrong type or range anywhere are a ``ConfigFileError``
naming the file and the field. A bad file is replaced by its ``.bak`` (with a warning); only when both
copies are bad does ``load`` raise (or, for a read-only store, carry on with an empty configuration).

Files (RocketMQ's names and fields)::

    config/topics.json              {"dataVersion": {...}, "topicConfigTable": {topic: TopicConfig}}
    config/subscriptionGroup.json   {"dataVersion": {...}, "subscriptionGroupTable": {group: {...}}}
    config/consumerOffset.json      {"offsetTable": {"topic@group": {queueId: offset}}}
    config/delayOffset.json         {"offsetTable": {delayLevel: offset}}
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import json
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

from .encoder import _TOPIC_CHARS, validate_topic
from .errors import ConfigError, ConfigFileError, FlushError, StoreIOError
from .mapped.file import fsync_dir

CONFIG_DIR = "config"
TOPIC_GROUP_SEPARATOR = "@"
PERM_READ, PERM_WRITE = 0x4, 0x2
MAX_QUEUE_NUMS = 1024
GROUP_MAX_LENGTH = 255  # Validators.CHARACTER_MAX_LENGTH
MAX_DEPTH = 64  # nesting allowed below a field of free content (RocketMQ's own files nest 4 levels)
_I32_MAX, _I64_MAX = (1 << 31) - 1, (1 << 63) - 1
# A JSON string (also an unterminated one, so that a torn file costs linear time) or a bare integer map key.
_FASTJSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*+(?:"|\\?\Z)|([{,]\s*)(-?\d+)(\s*:)', re.S)
_INT_LITERAL = re.compile(r"-?\d+")
_SURROGATE = re.compile("[\ud800-\udfff]")

log = logging.getLogger(__name__)


# --- fastjson-compatible text -------------------------------------------------------------------------

def parse_fastjson(text: str) -> object:
    """JSON, also accepting fastjson's bare integer map keys (which become int keys).

    As strict as fastjson's writer: a duplicate key, NaN or an infinite number raises ValueError;
    nesting beyond the interpreter's recursion limit raises RecursionError.
    """
    def quote(m: re.Match) -> str:
        return m.group(0) if m.group(1) is None else f'{m.group(1)}"\\u0000{m.group(2)}"{m.group(3)}'

    def hook(pairs: list[tuple[str, object]]) -> dict:
        out: dict = {}
        for name, value in pairs:
            key = int(name[1:]) if name.startswith("\x00") and _INT_LITERAL.fullmatch(name, 1) else name
            if key in out:
                raise ValueError(f"duplicate key {key!r}")
            out[key] = value
        return out

    return json.loads(_FASTJSON_TOKEN.sub(quote, text), object_pairs_hook=hook, parse_constant=_no_constant,
                      parse_float=_finite_float)


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range for a number")
    return value


def to_fastjson(value: object, indent: int = 0) -> str:
    """fastjson's pretty format: tabs, no space after ':', integer map keys bare."""
    pad, inner = "\t" * indent, "\t" * (indent + 1)
    if isinstance(value, dict):
        if not value:
            return "{}"
        items = [f"{inner}{k if isinstance(k, int) else json.dumps(str(k), ensure_ascii=False)}:"
                 f"{to_fastjson(v, indent + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(value, list | tuple):
        return "[" + ",".join(to_fastjson(v, indent + 1) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


# --- schemas: what each file may hold ------------------------------------------------------------------
# A check takes a parsed value and its dotted field name, and returns the value (map keys normalised: a
# queue id written "0" or bare 0 becomes 0) or raises _Invalid. One schema per file is built from them.

Check = Callable[[object, str], object]


class _Invalid(Exception):
    def __init__(self, where: str, reason: str) -> None:
        super().__init__(reason)
        self.where = where
        self.reason = reason


def _show(value: object) -> str:
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _field(where: str, key: object) -> str:
    text = str(key)
    if not text.isprintable():  # a key of control characters or a lone surrogate: shown escaped, so that the
        text = text.encode("unicode_escape").decode("ascii")  # message can be logged and printed as UTF-8
    return f"{where}.{text}" if where else text


def _text(value: str, where: str) -> str:
    if _SURROGATE.search(value):  # json accepts "\ud800"; such a string cannot be written back as UTF-8
        raise _Invalid(where, "holds an unpaired UTF-16 surrogate")
    return value


def integer(lo: int, hi: int) -> Check:
    def check(value: object, where: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise _Invalid(where, f"must be an integer {lo}..{hi}, not {_show(value)}")
        return value
    return check


def boolean(value: object, where: str) -> bool:
    if not isinstance(value, bool):
        raise _Invalid(where, f"must be true or false, not {_show(value)}")
    return value


def string(*choices: str, nonempty: bool = False) -> Check:
    def check(value: object, where: str) -> str:
        if not isinstance(value, str) or (nonempty and not value) or (choices and value not in choices):
            wanted = " or ".join(map(repr, choices)) if choices else "a non-empty string" if nonempty else "a string"
            raise _Invalid(where, f"must be {wanted}, not {_show(value)}")
        return _text(value, where)
    return check


def name_key(key: object, where: str) -> str:
    """A map key naming a topic, group or attribute (fastjson always quotes them; a bare number is kept as text)."""
    if isinstance(key, int):
        return str(key)
    if not key:
        raise _Invalid(where, "is an empty name")
    return _text(key, where)


def int_key(lo: int, hi: int) -> Check:
    """A map key holding a number: fastjson's bare ``0`` or standard JSON's ``"0"``."""
    def check(key: object, where: str) -> int:
        if isinstance(key, str) and _INT_LITERAL.fullmatch(key) and len(key) < 20:
            key = int(key)
        if not isinstance(key, int) or not lo <= key <= hi:
            raise _Invalid(where, f"key must be an integer {lo}..{hi}, not {_show(key)}")
        return key
    return check


def free(value: object, where: str) -> object:
    """Any JSON (fields rocketstore keeps but does not use), nested at most ``MAX_DEPTH`` levels."""
    pending = [(value, where, 0)]
    while pending:
        item, at, depth = pending.pop()
        if depth > MAX_DEPTH:
            raise _Invalid(at, f"nests deeper than {MAX_DEPTH} levels")
        if isinstance(item, str):
            _text(item, at)
        elif isinstance(item, dict):
            for key, inner in item.items():
                if isinstance(key, str):
                    _text(key, at)
                pending.append((inner, _field(at, key), depth + 1))
        elif isinstance(item, list):
            pending.extend((inner, f"{at}[{i}]", depth + 1) for i, inner in enumerate(item))
    return value


def mapping(key: Check, value: Check) -> Check:
    """An object whose keys are data (topics, groups, queue ids), each value checked by ``value``."""
    def check(data: object, where: str) -> dict:
        if not isinstance(data, dict):
            raise _Invalid(where, f"must be an object, not {_show(data)}")
        out: dict = {}
        for k, item in data.items():
            at = _field(where, k)
            normal = key(k, at)
            if normal in out:  # e.g. bare 0 and "0"
                raise _Invalid(at, "appears twice")
            out[normal] = value(item, at)
        return out
    return check


def record(fields: dict[str, Check]) -> Check:
    """An object with named fields; fields not named are kept as they are (``free``)."""
    def check(data: object, where: str) -> dict:
        if not isinstance(data, dict):
            raise _Invalid(where, f"must be an object, not {_show(data)}")
        return {k: fields[k](item, _field(where, k)) if k in fields else free(item, _field(where, k))
                for k, item in data.items()}
    return check


def group_name(value: object, where: str) -> str:
    """RocketMQ's ``Validators.checkGroup``: the topic characters, at most 255 of them."""
    if not isinstance(value, str) or not _TOPIC_CHARS.fullmatch(value) or len(value) > GROUP_MAX_LENGTH:
        raise _Invalid(where, f"must be 1..{GROUP_MAX_LENGTH} letters, digits or %|_- characters, not {_show(value)}")
    return value


def checked(check: Check, value: object, what: str) -> object:
    """``check`` applied to API input: a bad value raises ConfigError before anything is changed or written
    (once written, it would make the file, and the store, fail to load)."""
    try:
        return check(value, what)
    except _Invalid as exc:
        raise ConfigError(f"{exc.where} {exc.reason}") from None


_DATA_VERSION = record({"counter": integer(0, _I64_MAX), "stateVersion": integer(-_I64_MAX - 1, _I64_MAX),
                        "timestamp": integer(-_I64_MAX - 1, _I64_MAX)})
_OFFSET = integer(0, _I64_MAX)
_QUEUE_ID = integer(0, _I32_MAX)
_QUEUE_NUMS = integer(1, MAX_QUEUE_NUMS)  # what a topic is created or updated with here
# what a broker's file may hold: its admin stores any value (updateAndCreateTopic checks no range), and a
# store must not lose every topic over one (0 write queues: a topic closed to producers). Bounded all the same:
# readers walk range(readQueueNums), which 2**31 would hang
MAX_STORED_QUEUE_NUMS = 65_535
_STORED_QUEUE_NUMS = integer(0, MAX_STORED_QUEUE_NUMS)
_PERM = integer(0, 15)
_I32 = integer(-_I32_MAX - 1, _I32_MAX)
TOPICS_SCHEMA = record({
    "dataVersion": _DATA_VERSION,
    "topicConfigTable": mapping(name_key, record({
        "topicName": string(nonempty=True), "readQueueNums": _STORED_QUEUE_NUMS, "writeQueueNums": _STORED_QUEUE_NUMS,
        "perm": _PERM,
        "topicFilterType": string("SINGLE_TAG", "MULTI_TAG"), "topicSysFlag": _I32, "order": boolean,
        "attributes": mapping(name_key, string())})),
})
SUBSCRIPTION_GROUPS_SCHEMA = record({
    "dataVersion": _DATA_VERSION,
    "subscriptionGroupTable": mapping(name_key, record({
        "groupName": string(nonempty=True), "consumeEnable": boolean, "consumeFromMinEnable": boolean,
        "consumeBroadcastEnable": boolean, "consumeMessageOrderly": boolean,
        "notifyConsumerIdsChangedEnable": boolean, "retryQueueNums": integer(0, _I32_MAX), "retryMaxTimes": _I32,
        "brokerId": integer(0, _I64_MAX), "whichBrokerWhenConsumeSlowly": integer(0, _I64_MAX),
        "groupSysFlag": _I32, "consumeTimeoutMinute": _I32})),
})
# a broker stores any committed offset unchecked (commitOffset); a negative one reads as none here, as -1 does
CONSUMER_OFFSETS_SCHEMA = record({"offsetTable": mapping(name_key, mapping(int_key(0, _I32_MAX),
                                                                           integer(-_I64_MAX - 1, _I64_MAX)))})
DELAY_OFFSETS_SCHEMA = record({"offsetTable": mapping(int_key(1, _I32_MAX), _OFFSET)})
def offset_runs(value: object, where: str) -> list[list[int]]:
    """A list of ``[first, count]`` runs of queue offsets, ascending and apart."""
    if not isinstance(value, list):
        raise _Invalid(where, f"must be a list of [first offset, count] runs, not {_show(value)}")
    end = -1
    for i, run in enumerate(value):
        at = f"{where}[{i}]"
        if not (isinstance(run, list) and len(run) == 2):
            raise _Invalid(at, f"must be a [first offset, count] run, not {_show(run)}")
        first, count = _OFFSET(run[0], at), integer(1, _I64_MAX)(run[1], at)
        if first <= end or first + count > _I64_MAX:
            raise _Invalid(at, "runs must be ascending, apart and below 2^63")
        end = first + count
    return value


TIMER_OFFSETS_SCHEMA = record({"offsetTable": mapping(int_key(0, 0), _OFFSET), "deliveredAbove": offset_runs})
TRANSACTION_CHECKS_SCHEMA = record({"offsetTable": mapping(int_key(0, _I64_MAX), integer(1, _I32_MAX))})


# --- reading and writing a file ------------------------------------------------------------------------

def decode_config(path: Path, raw: bytes, schema: Check = free) -> dict | None:
    """The validated document held in ``raw`` (the bytes of ``path``); None when empty (as RocketMQ treats it).

    Raises ConfigFileError naming the file and, for a wrong value, the field.
    """
    if not raw.strip():
        return None
    try:
        data = parse_fastjson(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigFileError(f"is not UTF-8 text (bad byte at {exc.start})", str(path)) from None
    except RecursionError:
        raise ConfigFileError("nests too deeply to be a config file", str(path)) from None
    except ValueError as exc:
        raise ConfigFileError(f"is not valid JSON: {exc}", str(path)) from None
    try:
        checked = schema(data, "")
        if not isinstance(checked, dict):
            raise _Invalid("", f"must be an object, not {_show(data)}")
    except _Invalid as exc:
        raise ConfigFileError(exc.reason, str(path), exc.where) from None
    return checked


_NOT_A_FILE = frozenset({errno.EISDIR, errno.ELOOP, errno.ENOTDIR})


def _read_config(path: Path, schema: Check) -> dict | None:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        if path.is_symlink():  # a link to a disk not mounted, say: not a new store with no such file yet
            raise ConfigFileError("is a symbolic link to a file that does not exist", str(path)) from None
        return None
    except OSError as exc:
        if exc.errno in _NOT_A_FILE:  # a directory or a symlink loop in its place: as bad as bad content
            raise ConfigFileError(f"cannot be read: {exc.strerror}", str(path)) from None
        # EIO, EMFILE, EACCES...: the file may be good. Falling back to the older .bak would run on stale
        # topics or offsets and then write them over the file (found in an audit: an offset went 30 -> 20).
        raise StoreIOError(exc.errno, f"cannot read {path}: {exc.strerror}") from exc
    return decode_config(path, raw, schema)


def load_config(path: Path, schema: Check = free) -> dict | None:
    """The file's validated content, or its ``.bak``'s if the file is bad in any way (logged); None if neither
    holds anything (a new store). Raises ConfigFileError, about the file, when no copy is usable."""
    bak = path.with_name(path.name + ".bak")
    problems: list[ConfigFileError] = []
    for candidate in (path, bak):
        try:
            data = _read_config(candidate, schema)
        except ConfigFileError as exc:
            problems.append(exc)
            continue
        if data is not None:
            if problems:
                log.warning("%s; loaded from its backup %s", problems[0], bak.name)
            return data
    if not problems:
        if path.exists():  # RocketMQ loads an empty file as empty too; an operator should hear of it
            log.warning("%s is empty and has no backup with content: it is loaded as empty", path)
        return None
    if len(problems) == 1:
        raise problems[0]
    first, second = problems
    why = f"{second.field} {second.reason}" if second.field else second.reason
    raise ConfigFileError(f"{first.reason}; and its backup {bak.name} is bad too: {why}", first.path, first.field)


@dataclass
class _FileState:
    """Per file, process-wide: every manager and thread writing the file shares its lock."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    written: bytes = b""  # digest of the content this process last wrote: the file as it is then is good


_FILES: dict[str, _FileState] = {}
_FILES_LOCK = threading.Lock()
_TMP_SEQ = itertools.count()


def _file_state(path: Path) -> _FileState:
    with _FILES_LOCK:
        return _FILES.setdefault(os.path.abspath(path), _FileState())


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _replace_with(target: Path, data: bytes) -> None:
    """Write ``data`` to a unique temporary name, fsync it, and rename it over ``target`` (atomic)."""
    tmp = target.with_name(f"{target.name}.tmp.{os.getpid()}.{next(_TMP_SEQ)}")
    try:
        with open(tmp, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def persist_text(path: Path, text: str, schema: Check = free) -> None:
    """``MixAll.string2File``, made crash- and thread-safe.

    Under the file's lock: the ``.bak`` gets the previous content if it is known good (this process wrote
    it, or it validates against ``schema``), else the new content; then the new content replaces the file.
    Both go through a fsynced temporary file and an atomic rename, so at every instant the file is whole
    and one of the two copies is good. Raises StoreIOError (FlushError when a directory fsync fails).
    """
    data = text.encode("utf-8")
    state = _file_state(path)
    with state.lock:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            backup = _good_backup(path, state, data, schema)
            if backup is not None:
                _replace_with(path.with_name(path.name + ".bak"), backup)
            _replace_with(path, data)
            fsync_dir(path.parent)
        except StoreIOError:
            raise
        except OSError as exc:
            raise StoreIOError(exc.errno, f"cannot write {path}: {exc.strerror}") from exc
        state.written = _digest(data)


def _good_backup(path: Path, state: _FileState, data: bytes, schema: Check) -> bytes | None:
    """What ``.bak`` should hold before ``path`` becomes ``data``: None to leave it (there is no file yet)."""
    try:
        old = path.read_bytes()
    except FileNotFoundError:
        return None
    if state.written and _digest(old) == state.written:
        return old
    try:
        if decode_config(path, old, schema) is not None:
            return old
    except ConfigFileError as exc:
        log.warning("%s; not keeping it as the backup", exc)
    return data


def remove_stale_temps(path: Path) -> None:
    """Delete temporary files of ``path`` that a killed writer left (its own in-flight ones hold the lock)."""
    state = _file_state(path)
    with state.lock:
        for pattern in (f"{path.name}.tmp*", f"{path.name}.bak.tmp*"):
            for stale in path.parent.glob(pattern):
                with contextlib.suppress(FileNotFoundError):
                    stale.unlink()
                    log.info("removed %s, left by an interrupted write", stale)


def data_version(counter: int) -> dict:
    return {"counter": counter, "stateVersion": 0, "timestamp": time.time_ns() // 1_000_000}


class ConfigFile:
    """One file of config/: loaded (or its backup) through ``SCHEMA``, written with ``persist_text``."""

    FILE: ClassVar[str]
    SCHEMA: ClassVar[Check]

    def __init__(self, root: Path, *, read_only: bool = False) -> None:
        self.path = root / CONFIG_DIR / self.FILE
        self.read_only = read_only
        self.load_error: ConfigFileError | None = None  # why the last load found no usable copy
        self._lock = threading.RLock()  # guards the in-memory content

    def load(self, *, empty_if_bad: bool = False) -> None:
        """Read the file, or its ``.bak`` when the file is bad. When both are bad, raise ConfigFileError and
        change nothing, or with ``empty_if_bad`` (read-only stores, which must still serve the messages)
        log a warning and keep the empty configuration."""
        try:
            data = load_config(self.path, self.SCHEMA) or {}
        except (ConfigFileError, StoreIOError) as exc:
            self.load_error = exc if isinstance(exc, ConfigFileError) else None
            if not empty_if_bad:
                raise
            log.warning("%s; using an empty %s", exc, self.FILE)
            return
        with self._lock:
            self._apply(data)
        if not self.read_only:
            remove_stale_temps(self.path)

    def _apply(self, data: dict) -> None:
        raise NotImplementedError

    def _write(self, body: dict) -> None:
        persist_text(self.path, to_fastjson(body), self.SCHEMA)


# --- topics -------------------------------------------------------------------------------------------------

@dataclass
class TopicConfig:
    """RocketMQ's ``TopicConfig`` (unknown fields of a broker's file are kept as they are)."""

    topic_name: str
    read_queue_nums: int = 16
    write_queue_nums: int = 16
    perm: int = PERM_READ | PERM_WRITE
    topic_filter_type: str = "SINGLE_TAG"
    topic_sys_flag: int = 0
    order: bool = False
    attributes: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    _FIELDS: ClassVar[dict[str, str]] = {
        "topicName": "topic_name", "readQueueNums": "read_queue_nums", "writeQueueNums": "write_queue_nums",
        "perm": "perm", "topicFilterType": "topic_filter_type", "topicSysFlag": "topic_sys_flag",
               "order": "order", "attributes": "attributes"}

    @classmethod
    def from_json(cls, data: dict) -> TopicConfig:
        known = {attr: data[name] for name, attr in cls._FIELDS.items() if name in data}
        extra = {k: v for k, v in data.items() if k not in cls._FIELDS}
        return cls(**known, extra=extra)

    def to_json(self) -> dict:
        out = {name: getattr(self, attr) for name, attr in self._FIELDS.items()}
        out.update(self.extra)
        return dict(sorted(out.items(), key=lambda item: str(item[0])))  # fastjson writes fields alphabetically

    @property
    def writable(self) -> bool:
        return bool(self.perm & PERM_WRITE)


class TopicConfigManager(ConfigFile):
    """``TopicConfigManager``: config/topics.json."""

    FILE = "topics.json"
    SCHEMA = staticmethod(TOPICS_SCHEMA)

    def __init__(self, root: Path, *, read_only: bool = False) -> None:
        super().__init__(root, read_only=read_only)
        self.topics: dict[str, TopicConfig] = {}
        self.version = 0
        self.extra: dict = {}

    def _apply(self, data: dict) -> None:
        self.topics = {name: TopicConfig.from_json({"topicName": name, **cfg})
                       for name, cfg in data.get("topicConfigTable", {}).items()}
        self.version = data.get("dataVersion", {}).get("counter", 0)
        self.extra = {k: v for k, v in data.items() if k not in ("topicConfigTable", "dataVersion")}

    def persist(self) -> None:
        if self.read_only:
            return
        with self._lock:
            self.version += 1
            self._write({"dataVersion": data_version(self.version),
                         "topicConfigTable": {name: cfg.to_json() for name, cfg in sorted(self.topics.items())},
                         **self.extra})

    def get(self, topic: str) -> TopicConfig | None:
        return self.topics.get(topic)

    def create_or_update(self, topic: str, *, write_queue_nums: int = 8, read_queue_nums: int | None = None,
                         perm: int = PERM_READ | PERM_WRITE, order: bool = False) -> TopicConfig:
        validate_topic(topic)
        checked(_QUEUE_NUMS, write_queue_nums, "writeQueueNums")
        if read_queue_nums is not None:
            checked(_QUEUE_NUMS, read_queue_nums, "readQueueNums")
        checked(_PERM, perm, "perm")
        checked(boolean, order, "order")
        with self._lock:
            before = self.topics.get(topic)
            cfg = replace(before, attributes=dict(before.attributes), extra=dict(before.extra)) if before \
                else TopicConfig(topic)
            cfg.write_queue_nums = write_queue_nums
            cfg.read_queue_nums = read_queue_nums or write_queue_nums
            cfg.perm, cfg.order = perm, order
            self.topics[topic] = cfg
            try:
                self.persist()
            except FlushError:
                raise  # renamed into place, its directory entry not synced: the file has the change, memory keeps it
            except BaseException:  # a failed write changes nothing: puts must not use what the file lacks
                self._put_back(topic, before)
                raise
        return cfg

    def create_if_absent(self, topic: str, write_queue_nums: int) -> TopicConfig:
        """The topic's config, created with ``write_queue_nums`` queues only if there is none (auto-creation):
        checked and created under the lock ``create_or_update`` takes, so it never replaces a config."""
        with self._lock:  # re-entrant: create_or_update takes it again
            existing = self.topics.get(topic)
            if existing is not None:
                return existing
            return self.create_or_update(topic, write_queue_nums=write_queue_nums)

    def delete(self, topic: str) -> bool:
        """Remove the topic and write the file; a failed write removes nothing."""
        with self._lock:
            before = self.topics.pop(topic, None)
            if before is not None:
                try:
                    self.persist()
                except FlushError:
                    raise  # the file has the change (see create_or_update)
                except BaseException:
                    self._put_back(topic, before)
                    raise
        return before is not None

    def _put_back(self, topic: str, before: TopicConfig | None) -> None:
        if before is None:
            self.topics.pop(topic, None)
        else:
            self.topics[topic] = before


# --- offsets ---------------------------------------------------------------------------------------------------

class OffsetTable(ConfigFile):
    """An ``offsetTable`` file: consumerOffset.json (``topic@group`` -> queue -> offset) or delayOffset.json.

    Commits only take ``_lock`` (short); ``persist`` also holds ``_write_lock`` from the snapshot to the end
    of the write, so that snapshots reach the file in the order they were taken and a later one is never
    overwritten by an earlier one.
    """

    def __init__(self, root: Path, *, read_only: bool = False) -> None:
        super().__init__(root, read_only=read_only)
        self.table: dict = {}
        self.extra: dict = {}
        self.dirty = False
        self._write_lock = threading.Lock()

    def _apply(self, data: dict) -> None:
        self.table = data.get("offsetTable", {})
        self.extra = {k: v for k, v in data.items() if k != "offsetTable"}

    def persist(self, force: bool = False) -> None:
        if self.read_only or not (self.dirty or force):
            return
        with self._write_lock:
            with self._lock:
                if not (self.dirty or force):
                    return  # another thread wrote this content while we waited
                snapshot = {k: dict(sorted(v.items())) if isinstance(v, dict) else v for k, v in self.table.items()}
                body = {"offsetTable": snapshot, **self.extra}
                self.dirty = False
            try:
                self._write(body)
            except BaseException:
                self.dirty = True  # the next persist retries
                raise


class ConsumerOffsetManager(OffsetTable):
    """``ConsumerOffsetManager``: the next offset each group consumes in each queue of a topic."""

    FILE = "consumerOffset.json"
    SCHEMA = staticmethod(CONSUMER_OFFSETS_SCHEMA)

    def commit(self, group: str, topic: str, queue_id: int, offset: int) -> None:
        """Record ``offset`` as the group's next offset in the queue; bad arguments raise and change nothing."""
        checked(_QUEUE_ID, queue_id, "queue id")
        checked(_OFFSET, offset, "offset")
        key = f"{topic}{TOPIC_GROUP_SEPARATOR}{group}"
        if key not in self.table:  # names are checked once per group and topic: commits are frequent
            checked(group_name, group, "group")
            validate_topic(topic)
        with self._lock:
            self.table.setdefault(key, {})[queue_id] = offset
            self.dirty = True

    def reset(self, group: str, topic: str, offsets: dict[int, int]) -> None:
        """Commit a reset's offset of every queue and write the file at once. A write that fails puts the group's
        previous offsets back: left in memory, the store's close (or the next persist) wrote the reset that the
        command had reported failed. A directory fsync that fails (``FlushError``) keeps it: the file has it."""
        key = f"{topic}{TOPIC_GROUP_SEPARATOR}{group}"
        with self._lock:
            before = dict(self.table[key]) if key in self.table else None
        for queue_id, offset in offsets.items():
            self.commit(group, topic, queue_id, offset)
        try:
            self.persist(force=True)
        except FlushError:
            raise
        except BaseException:
            with self._lock:
                if before is None:
                    self.table.pop(key, None)
                else:
                    self.table[key] = before
            raise

    def query(self, group: str, topic: str, queue_id: int) -> int:
        """The committed offset, or -1 when the group never committed one for this queue."""
        return self.table.get(f"{topic}{TOPIC_GROUP_SEPARATOR}{group}", {}).get(queue_id, -1)

    def groups(self, topic: str | None = None) -> list[tuple[str, str]]:
        """(topic, group) pairs with committed offsets."""
        with self._lock:
            keys = list(self.table)
        pairs = []
        for key in keys:
            t, sep, g = key.partition(TOPIC_GROUP_SEPARATOR)
            if sep and (topic is None or t == topic):
                pairs.append((t, g))
        return sorted(pairs)

    def offsets(self, group: str, topic: str) -> dict[int, int]:
        with self._lock:
            return dict(self.table.get(f"{topic}{TOPIC_GROUP_SEPARATOR}{group}", {}))


class NumberTable(OffsetTable):
    """An ``offsetTable`` of numbers by number (a delay level's offset, a half message's check count)."""

    def get(self, key: int) -> int:
        return int(self.table.get(key, 0))

    def set(self, key: int, value: int) -> None:
        with self._lock:
            self.table[key] = value
            self.dirty = True


class DelayOffsetManager(NumberTable):
    """delayOffset.json: how far ``ScheduleMessageService`` has delivered each delay level."""

    FILE = "delayOffset.json"
    SCHEMA = staticmethod(DELAY_OFFSETS_SCHEMA)


class TransactionCheckCounts(NumberTable):
    """transactionChecks.json (rocketstore's own file): how many times each open half message (by commit-log
    offset) has been checked. RocketMQ keeps the count in a property of a copy of the half it stores again at every
    check; kept in memory alone, every restart began each open transaction's count at 0 again, so a half whose
    producer was gone was checked 15 more times after each restart and never parked."""

    FILE = "transactionChecks.json"
    SCHEMA = staticmethod(TRANSACTION_CHECKS_SCHEMA)

    def keep_only(self, open_halves: set[int]) -> None:
        """Forget the counts of halves that are no longer open (ended, parked, or removed by retention)."""
        with self._lock:
            gone = [phy for phy in self.table if phy not in open_halves]
            for phy in gone:
                del self.table[phy]
            self.dirty = self.dirty or bool(gone)


class TimerOffsetManager(DelayOffsetManager):
    """timerOffset.json: the queue offset of ``rmq_sys_wheel_timer`` below which every timer message has been
    delivered (rocketstore's own file: RocketMQ keeps its timer state in ``timerlog/`` and ``timerwheel``)."""

    FILE = "timerOffset.json"
    SCHEMA = staticmethod(TIMER_OFFSETS_SCHEMA)
    MAX_RUNS = 65_536  # beyond, the runs farthest ahead are dropped: those messages come again after a restart

    def __init__(self, root: Path, *, read_only: bool = False) -> None:
        super().__init__(root, read_only=read_only)
        self._delivered: set[int] | None = None

    def delivered_above(self) -> set[int]:
        """Queue offsets above the committed one already delivered (timers fire out of queue order): a clean
        restart must not deliver them again."""
        with self._lock:
            runs = self.extra.get("deliveredAbove", [])
            return {offset for first, count in runs for offset in range(first, first + count)}

    def set_progress(self, committed: int, done: set[int]) -> None:
        """The committed offset, and the wheel's live set of offsets delivered above it: turned into runs when
        the file is written, not at every delivery (a long timer holding the committed offset back while many
        short ones fire would make that quadratic)."""
        with self._lock:
            self.table[0] = committed
            self._delivered = done
            self.dirty = True

    def persist(self, force: bool = False) -> None:
        delivered = self._delivered
        if delivered is not None and not self.read_only and (self.dirty or force):
            runs: list[list[int]] = []
            for offset in sorted(list(delivered)):  # list() copies in one step under the GIL, while the wheel runs
                if runs and runs[-1][0] + runs[-1][1] == offset:
                    runs[-1][1] += 1
                elif len(runs) < self.MAX_RUNS:
                    runs.append([offset, 1])
                else:
                    break
            with self._lock:
                if runs:
                    self.extra["deliveredAbove"] = runs
                else:
                    self.extra.pop("deliveredAbove", None)
        super().persist(force)


class SubscriptionGroupManager(ConfigFile):
    """subscriptionGroup.json, kept as RocketMQ wrote it; groups that consume through rocketstore are added."""

    FILE = "subscriptionGroup.json"
    SCHEMA = staticmethod(SUBSCRIPTION_GROUPS_SCHEMA)

    def __init__(self, root: Path, *, read_only: bool = False) -> None:
        super().__init__(root, read_only=read_only)
        self.groups: dict[str, dict] = {}
        self.extra: dict = {}
        self.version = 0

    def _apply(self, data: dict) -> None:
        self.groups = data.get("subscriptionGroupTable", {})
        self.version = data.get("dataVersion", {}).get("counter", 0)
        self.extra = {k: v for k, v in data.items() if k not in ("subscriptionGroupTable", "dataVersion")}

    def is_orderly(self, group: str) -> bool:
        """consumeMessageOrderly: the group consumes FIFO (one message in flight per message group)."""
        return bool(self.groups.get(group, {}).get("consumeMessageOrderly", False))

    def set_orderly(self, group: str, orderly: bool) -> None:
        """Set consumeMessageOrderly (adding the group if needed) and write the file; a failed write changes nothing."""
        self.ensure(group)
        with self._lock:
            config = self.groups[group]
            before = config.get("consumeMessageOrderly", False)
            if before == orderly:
                return
            config["consumeMessageOrderly"] = orderly
            try:
                self.persist()
            except FlushError:
                raise  # the file has the change (see TopicConfigManager.create_or_update)
            except BaseException:
                config["consumeMessageOrderly"] = before
                raise

    def ensure(self, group: str) -> None:
        """Add ``group`` (RocketMQ's defaults) and write the file, unless it is there; a failed write adds nothing."""
        if self.read_only or group in self.groups:
            return
        checked(group_name, group, "group")
        with self._lock:
            if group in self.groups:
                return
            self.groups[group] = {"brokerId": 0, "consumeBroadcastEnable": True, "consumeEnable": True,
                                  "consumeFromMinEnable": True, "consumeMessageOrderly": False, "groupName": group,
                                  "groupSysFlag": 0, "notifyConsumerIdsChangedEnable": True, "retryMaxTimes": 16,
                                  "retryQueueNums": 1, "whichBrokerWhenConsumeSlowly": 1}
            try:
                self.persist()
            except FlushError:
                raise  # the file has the group (see TopicConfigManager.create_or_update)
            except BaseException:
                del self.groups[group]
                raise

    def persist(self) -> None:
        if self.read_only:
            return
        with self._lock:
            self.version += 1
            self._write({"dataVersion": data_version(self.version), "subscriptionGroupTable": self.groups,
                         **self.extra})

"""The store's ``config/`` directory: topics, subscription groups, consumer and delay offsets.

RocketMQ's broker writes these JSON files with fastjson, whose output is not quite JSON: maps with
integer keys (queue ids, delay levels) have bare keys, e.g. ``{"offsetTable":{"T@g":{0:250,1:250}}}``.
rocketstore reads both forms and writes RocketMQ's, so a broker can read our files and we can
read the broker's. Every write is atomic: the new content goes to ``<file>.tmp`` and is fsynced,
the previous content is kept as ``<file>.bak``, then the temporary file is renamed over the file.
A file that is missing, empty or unreadable is loaded from its ``.bak`` (``ConfigManager.load``).

Files (RocketMQ's names and fields)::

    config/topics.json              {"dataVersion": {...}, "topicConfigTable": {topic: TopicConfig}}
    config/subscriptionGroup.json   {"dataVersion": {...}, "subscriptionGroupTable": {group: {...}}}
    config/consumerOffset.json      {"offsetTable": {"topic@group": {queueId: offset}}}
    config/delayOffset.json         {"offsetTable": {delayLevel: offset}}
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from .errors import ConfigError, StoreIOError
from .mapped.file import fsync_dir

CONFIG_DIR = "config"
TOPIC_GROUP_SEPARATOR = "@"
PERM_READ, PERM_WRITE = 0x4, 0x2
_BARE_INT_KEY = re.compile(r'([{,]\s*)(-?\d+)(\s*:)')

log = logging.getLogger(__name__)


# --- fastjson-compatible text -------------------------------------------------------------------------

def parse_fastjson(text: str) -> object:
    """JSON, also accepting fastjson's bare integer map keys (which become int keys)."""
    quoted = _BARE_INT_KEY.sub(lambda m: f'{m.group(1)}"\\u0000{m.group(2)}"{m.group(3)}', text)

    def hook(pairs: list[tuple[str, object]]) -> dict:
        return {int(k[1:]) if k.startswith("\x00") else k: v for k, v in pairs}

    return json.loads(quoted, object_pairs_hook=hook)


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


def persist_text(path: Path, text: str) -> None:
    """``MixAll.string2File``, made crash-safe: tmp (fsynced), .bak of the old content, atomic rename."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        if path.exists():
            bak = path.with_name(path.name + ".bak")
            bak_tmp = path.with_name(path.name + ".bak.tmp")
            with open(bak_tmp, "wb") as out:
                out.write(path.read_bytes())
                out.flush()
                os.fsync(out.fileno())
            os.replace(bak_tmp, bak)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as exc:
        raise StoreIOError(exc.errno, f"cannot write {path}: {exc.strerror}") from exc


def load_json(path: Path) -> dict | None:
    """The file's content, or its ``.bak`` if the file is missing, empty or unreadable; None if neither."""
    for candidate in (path, path.with_name(path.name + ".bak")):
        try:
            text = candidate.read_text(encoding="utf-8")
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise StoreIOError(exc.errno, f"cannot read {candidate}: {exc.strerror}") from exc
        if not text.strip():
            continue
        try:
            data = parse_fastjson(text)
        except ValueError as exc:
            log.error("%s is not readable JSON (%s); trying its backup", candidate, exc)
            continue
        if isinstance(data, dict):
            return data
    return None


def data_version(counter: int) -> dict:
    return {"counter": counter, "stateVersion": 0, "timestamp": time.time_ns() // 1_000_000}


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
        return dict(sorted(out.items()))  # fastjson writes fields in alphabetical order

    @property
    def writable(self) -> bool:
        return bool(self.perm & PERM_WRITE)


class TopicConfigManager:
    """``TopicConfigManager``: config/topics.json."""

    FILE = "topics.json"

    def __init__(self, root: Path, *, read_only: bool = False) -> None:
        self.path = root / CONFIG_DIR / self.FILE
        self.read_only = read_only
        self.topics: dict[str, TopicConfig] = {}
        self.version = 0
        self.extra: dict = {}
        self._lock = threading.Lock()

    def load(self) -> None:
        data = load_json(self.path) or {}
        for name, cfg in (data.get("topicConfigTable") or {}).items():
            if isinstance(cfg, dict):
                self.topics[str(name)] = TopicConfig.from_json({"topicName": name, **cfg})
        self.version = int((data.get("dataVersion") or {}).get("counter", 0))
        self.extra = {k: v for k, v in data.items() if k not in ("topicConfigTable", "dataVersion")}

    def persist(self) -> None:
        if self.read_only:
            return
        with self._lock:
            self.version += 1
            body = {"dataVersion": data_version(self.version),
                    "topicConfigTable": {name: cfg.to_json() for name, cfg in sorted(self.topics.items())},
                    **self.extra}
            persist_text(self.path, to_fastjson(body))

    def get(self, topic: str) -> TopicConfig | None:
        return self.topics.get(topic)

    def create_or_update(self, topic: str, *, write_queue_nums: int = 8, read_queue_nums: int | None = None,
                         perm: int = PERM_READ | PERM_WRITE, order: bool = False) -> TopicConfig:
        from .encoder import validate_topic

        validate_topic(topic)
        if not 1 <= write_queue_nums <= 1024 or not 1 <= (read_queue_nums or write_queue_nums) <= 1024:
            raise ConfigError("a topic has 1 to 1024 queues")
        cfg = self.topics.get(topic) or TopicConfig(topic)
        cfg.write_queue_nums = write_queue_nums
        cfg.read_queue_nums = read_queue_nums or write_queue_nums
        cfg.perm, cfg.order = perm, order
        self.topics[topic] = cfg
        self.persist()
        return cfg

    def delete(self, topic: str) -> bool:
        existed = self.topics.pop(topic, None) is not None
        if existed:
            self.persist()
        return existed


# --- offsets ---------------------------------------------------------------------------------------------------

class OffsetTable:
    """An ``offsetTable`` file: consumerOffset.json (``topic@group`` -> queue -> offset) or delayOffset.json."""

    def __init__(self, path: Path, *, read_only: bool = False) -> None:
        self.path = path
        self.read_only = read_only
        self.table: dict = {}
        self.extra: dict = {}
        self.dirty = False
        self._lock = threading.Lock()

    def load(self) -> None:
        data = load_json(self.path) or {}
        table = data.get("offsetTable") or {}
        self.table = {k: ({int(q): int(o) for q, o in v.items()} if isinstance(v, dict) else int(v))
                      for k, v in table.items()}
        self.extra = {k: v for k, v in data.items() if k != "offsetTable"}

    def persist(self, force: bool = False) -> None:
        if self.read_only or not (self.dirty or force):
            return
        with self._lock:
            snapshot = {k: dict(sorted(v.items())) if isinstance(v, dict) else v for k, v in self.table.items()}
            self.dirty = False
        persist_text(self.path, to_fastjson({"offsetTable": snapshot, **self.extra}))


class ConsumerOffsetManager(OffsetTable):
    """``ConsumerOffsetManager``: the next offset each group consumes in each queue of a topic."""

    FILE = "consumerOffset.json"

    def __init__(self, root: Path, *, read_only: bool = False) -> None:
        super().__init__(root / CONFIG_DIR / self.FILE, read_only=read_only)

    def commit(self, group: str, topic: str, queue_id: int, offset: int) -> None:
        with self._lock:
            self.table.setdefault(f"{topic}{TOPIC_GROUP_SEPARATOR}{group}", {})[queue_id] = offset
            self.dirty = True

    def query(self, group: str, topic: str, queue_id: int) -> int:
        """The committed offset, or -1 when the group never committed one for this queue."""
        return self.table.get(f"{topic}{TOPIC_GROUP_SEPARATOR}{group}", {}).get(queue_id, -1)

    def groups(self, topic: str | None = None) -> list[tuple[str, str]]:
        """(topic, group) pairs with committed offsets."""
        pairs = []
        for key in self.table:
            t, sep, g = key.partition(TOPIC_GROUP_SEPARATOR)
            if sep and (topic is None or t == topic):
                pairs.append((t, g))
        return sorted(pairs)

    def offsets(self, group: str, topic: str) -> dict[int, int]:
        return dict(self.table.get(f"{topic}{TOPIC_GROUP_SEPARATOR}{group}", {}))


class DelayOffsetManager(OffsetTable):
    """delayOffset.json: how far ``ScheduleMessageService`` has delivered each delay level."""

    FILE = "delayOffset.json"

    def __init__(self, root: Path, *, read_only: bool = False) -> None:
        super().__init__(root / CONFIG_DIR / self.FILE, read_only=read_only)

    def get(self, level: int) -> int:
        return int(self.table.get(level, 0))

    def set(self, level: int, offset: int) -> None:
        with self._lock:
            self.table[level] = offset
            self.dirty = True


class SubscriptionGroupManager:
    """subscriptionGroup.json, kept as RocketMQ wrote it; groups that consume through rocketstore are added."""

    FILE = "subscriptionGroup.json"

    def __init__(self, root: Path, *, read_only: bool = False) -> None:
        self.path = root / CONFIG_DIR / self.FILE
        self.read_only = read_only
        self.groups: dict[str, dict] = {}
        self.extra: dict = {}
        self.version = 0

    def load(self) -> None:
        data = load_json(self.path) or {}
        self.groups = {str(k): v for k, v in (data.get("subscriptionGroupTable") or {}).items()}
        self.version = int((data.get("dataVersion") or {}).get("counter", 0))
        self.extra = {k: v for k, v in data.items() if k not in ("subscriptionGroupTable", "dataVersion")}

    def ensure(self, group: str) -> None:
        if group in self.groups or self.read_only:
            return
        self.groups[group] = {"brokerId": 0, "consumeBroadcastEnable": True, "consumeEnable": True,
                              "consumeFromMinEnable": True, "consumeMessageOrderly": False, "groupName": group,
                              "groupSysFlag": 0, "notifyConsumerIdsChangedEnable": True, "retryMaxTimes": 16,
                              "retryQueueNums": 1, "whichBrokerWhenConsumeSlowly": 1}
        self.version += 1
        persist_text(self.path, to_fastjson({"dataVersion": data_version(self.version),
                                             "subscriptionGroupTable": self.groups, **self.extra}))

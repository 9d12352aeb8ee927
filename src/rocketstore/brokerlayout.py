"""What a RocketMQ 5.x broker can keep in a store directory that rocketstore does not manage, and how each is met.

A broker's ``store/`` is handed to rocketstore as it is, so these must survive untouched and never be answered for
wrongly:

- **LMQ queues** (``enableLmq`` with multi-dispatch): ``consumequeue/%LMQ%<name>/`` whose units point at records of
  *other* topics (the message that named the queue in ``INNER_MULTI_DISPATCH``). They are never loaded, checked or
  rebuilt (a check would call every unit damage and cut it), only cut where recovery cuts the log (as RocketMQ cuts
  every queue) and carried over, holes kept, by a rebuild; a read of one says so, their consumers' offsets are left
  alone, and a put cannot write to one (its units would collide with the broker's).
- **BatchCQ topics** (topic attribute ``queue.type=BatchCQ``, queues in ``batchconsumequeue/``): a writer would
  dispatch their records into ``consumequeue/<topic>``, and a broker refuses to start with such a directory
  (``ConsumeQueueStore.queueTypeShouldBe``). A writer's open is refused; read-only opens serve the rest.
- **A DLedger commit log** (``dledger-<id>/`` instead of ``commitlog/``): refused to every open.
- **Consume queues in RocksDB** (``storeType=defaultRocksDB``: the database sits in ``consumequeue/`` itself): a
  writer would build file queues inside it. Refused; read-only opens say that no queue is read.

The writer's refusal comes before anything is written, so the directory stays as the broker left it.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import UnsupportedLayoutError

LMQ_PREFIX = "%LMQ%"
ROCKSDB_QUEUES = "this store keeps its consume queues in RocksDB (storeType=defaultRocksDB), which rocketstore does " \
                 "not read"
BATCH_QUEUE_DIR = "batchconsumequeue"
QUEUE_TYPE = "queue.type"  # TopicAttributes.QUEUE_TYPE_ATTRIBUTE
BATCH_CQ = "BatchCQ"


def is_lmq(topic: str) -> bool:
    return topic.startswith(LMQ_PREFIX)


def batch_cq_topics(root: Path, topic_config) -> list[str]:
    """Topics configured with ``queue.type=BatchCQ`` (``QueueTypeUtils.getCQType``: exact, case-sensitive) or with
    queues in ``batchconsumequeue/``."""
    configured = {name for name, cfg in topic_config.topics.items()
                  if isinstance(cfg.attributes, dict) and cfg.attributes.get(QUEUE_TYPE) == BATCH_CQ}
    try:
        with os.scandir(root / BATCH_QUEUE_DIR) as entries:
            on_disk = {entry.name for entry in entries}
    except (FileNotFoundError, NotADirectoryError):
        on_disk = set()
    return sorted(configured | on_disk)


def rocksdb_queues(root: Path) -> bool:
    """The consume queues live in a RocksDB database in ``consumequeue/`` (its ``CURRENT`` file names the manifest)."""
    return (root / "consumequeue" / "CURRENT").is_file()


def check_not_dledger(root: Path) -> None:
    """A store without ``commitlog/`` but with ``dledger-<id>/`` is a DLedger broker's (``enableDLegerCommitLog``):
    its log is DLedger's entries, each message inside DLedger's own framing, which rocketstore does not read."""
    try:
        with os.scandir(root) as entries:
            dledger = sorted(entry.name for entry in entries if entry.name.startswith("dledger-") and entry.is_dir())
    except OSError:
        return
    if dledger:
        raise UnsupportedLayoutError(f"{root} holds a DLedger commit log ({', '.join(dledger)}/), not commitlog/: "
                                     "rocketstore does not read DLedger's entries. Nothing was changed")


def check_writer_layout(root: Path, topic_config) -> None:
    """Refuse a writer's open of a store whose queues this store would write wrongly (see the module's docstring)."""
    reasons = []
    batch = batch_cq_topics(root, topic_config)
    if batch:
        reasons.append(f"BatchCQ queues (topics {', '.join(batch[:5])}{', ...' if len(batch) > 5 else ''}): a writer "
                       "would dispatch their records into consumequeue/, which a broker refuses to load")
    if rocksdb_queues(root):
        reasons.append("consume queues in RocksDB (storeType=defaultRocksDB): a writer would build file queues "
                       "inside the database")
    if reasons:
        raise UnsupportedLayoutError(f"{root}: rocketstore does not write a store with {'; and '.join(reasons)}. "
                                     "Nothing was changed; open it read-only to inspect it")


def unmanaged_reason(topic: str, batch_topics: frozenset[str], rocksdb: bool) -> str | None:
    """Why a read of ``topic``'s queues cannot be answered here, or None."""
    if rocksdb:
        return ROCKSDB_QUEUES
    if is_lmq(topic):
        return f"{topic} is a broker's LMQ queue (multi-dispatch), which rocketstore leaves as it is and does not " \
               "serve"
    if topic in batch_topics:
        return f"{topic} is a BatchCQ topic (its queues are in {BATCH_QUEUE_DIR}/), which rocketstore does not read"
    return None

"""rocketstore: Apache RocketMQ's broker store in Python, byte-compatible with RocketMQ 5.x store directories.

>>> import tempfile, rocketstore
>>> with tempfile.TemporaryDirectory() as root:
...     cfg = rocketstore.StoreConfig(mapped_file_size_commit_log=1 << 20)
...     with rocketstore.MessageStore.open(root, cfg) as store:
...         result = store.put_message(rocketstore.Message("TopicTest", b"hello", tags="TagA", keys=["order-1"]))
...         store.look_message_by_offset(result.commit_log_offset).body
b'hello'
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .codec.hosts import Host
    from .config import FlushDiskType, StoreConfig
    from .message import Message, MessageExt, PutBatchResult, PutMessageResult, PutMessageStatus, PutResults, SysFlag
    from .recovery import RecoveryReport
    from .store import MessageStore, StoreNotFoundError

# Names load on first use (PEP 562): a process that needs one module of the package, such as the Spark worker
# daemon (spark/daemon.py, which forks and must not start numpy's threads first), does not import the store.
_HOMES = {
    "Host": ".codec.hosts",
    "FlushDiskType": ".config", "StoreConfig": ".config",
    "Message": ".message", "MessageExt": ".message", "PutBatchResult": ".message", "PutMessageResult": ".message",
    "PutMessageStatus": ".message", "PutResults": ".message", "SysFlag": ".message",
    "RecoveryReport": ".recovery",
    "MessageStore": ".store", "StoreNotFoundError": ".store",
}

__all__ = [
    "FlushDiskType",
    "Host",
    "Message",
    "MessageExt",
    "MessageStore",
    "PutBatchResult",
    "PutMessageResult",
    "PutMessageStatus",
    "PutResults",
    "RecoveryReport",
    "StoreConfig",
    "StoreNotFoundError",
    "SysFlag",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'rocketstore' has no attribute {name!r}")
    for module in dict.fromkeys(_HOMES.values()):  # all at once, in this order: the modules import each other
        loaded = importlib.import_module(module, __name__)
        globals().update({exported: getattr(loaded, exported) for exported, at in _HOMES.items() if at == module})
    return globals()[name]


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])

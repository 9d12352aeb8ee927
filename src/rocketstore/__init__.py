"""rocketstore: Apache RocketMQ's broker store in Python, byte-compatible with RocketMQ 5.x store directories.

>>> import tempfile, rocketstore
>>> with tempfile.TemporaryDirectory() as root:
...     cfg = rocketstore.StoreConfig(mapped_file_size_commit_log=1 << 20)
...     with rocketstore.MessageStore.open(root, cfg) as store:
...         result = store.put_message(rocketstore.Message("TopicTest", b"hello", tags="TagA", keys=["order-1"]))
...         store.look_message_by_offset(result.commit_log_offset).body
b'hello'
"""

from .codec.hosts import Host
from .config import FlushDiskType, StoreConfig
from .message import Message, MessageExt, PutBatchResult, PutMessageResult, PutMessageStatus, PutResults, SysFlag
from .recovery import RecoveryReport
from .store import MessageStore, StoreNotFoundError

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

"""The record format, message ids and hashes: the single codec shared by store, CLI and Spark."""

import importlib
from typing import TYPE_CHECKING

from .hashing import body_crc, index_key_hash, java_string_hash, tags_hash_code
from .hosts import Host
from .properties import (
    KEY_SEPARATOR,
    NAME_VALUE_SEPARATOR,
    PROPERTY_SEPARATOR,
    PropertyName,
    decode_properties,
    encode_properties,
    java_hashmap_order,
    split_keys,
)

if TYPE_CHECKING:
    from .msgid import UniqKeyGenerator, create_offset_msg_id, decode_offset_msg_id, decode_uniq_key
    from .record import (
        BLANK_MAGIC,
        BLANK_RECORD_LEN,
        MAGIC_V1,
        MAGIC_V2,
        RecordLayout,
        blank_record,
        decode_record,
        encode_record,
        read_layout,
    )

# The record codec builds ``message.MessageExt`` and ``message`` imports this package's hosts and properties: the
# record names load on first use, so either side may be imported first (``rocketstore`` itself imports nothing).
# The message id names load on first use too: they need numpy, which the command line's ``--help`` should not wait for.
_LAZY_HOMES = {
    **dict.fromkeys(("BLANK_MAGIC", "BLANK_RECORD_LEN", "MAGIC_V1", "MAGIC_V2", "RecordLayout", "blank_record",
                     "decode_record", "encode_record", "read_layout"), "record"),
    **dict.fromkeys(("UniqKeyGenerator", "create_offset_msg_id", "decode_offset_msg_id", "decode_uniq_key"), "msgid"),
}


def __getattr__(name: str):
    home = _LAZY_HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'rocketstore.codec' has no attribute {name!r}")
    module = importlib.import_module(f".{home}", __name__)
    return getattr(module, name)

__all__ = [
    "BLANK_MAGIC",
    "BLANK_RECORD_LEN",
    "KEY_SEPARATOR",
    "MAGIC_V1",
    "MAGIC_V2",
    "NAME_VALUE_SEPARATOR",
    "PROPERTY_SEPARATOR",
    "Host",
    "PropertyName",
    "RecordLayout",
    "UniqKeyGenerator",
    "blank_record",
    "body_crc",
    "create_offset_msg_id",
    "decode_offset_msg_id",
    "decode_properties",
    "decode_record",
    "decode_uniq_key",
    "encode_properties",
    "encode_record",
    "index_key_hash",
    "java_hashmap_order",
    "java_string_hash",
    "read_layout",
    "split_keys",
    "tags_hash_code",
]

"""The properties string: ``name \\x01 value \\x02`` pairs, and the property names the store uses.

Parsing follows ``MessageDecoder.string2messageProperties`` exactly (pieces without a name or a
value are dropped, a repeated name keeps its last value), because real stores contain such
pieces. Encoding is strict instead: a value that would not survive the round trip is an error.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping

from ..errors import InvalidPropertyError
from .hashing import java_string_hash

NAME_VALUE_SEPARATOR = "\x01"
PROPERTY_SEPARATOR = "\x02"
KEY_SEPARATOR = " "
MAX_PROPERTIES_LENGTH = 32767  # PROPLEN is an i16


class PropertyName:
    """RocketMQ's ``MessageConst`` property names."""

    KEYS = "KEYS"
    TAGS = "TAGS"
    UNIQ_KEY = "UNIQ_KEY"
    WAIT = "WAIT"
    DELAY = "DELAY"
    DUP_INFO = "DUP_INFO"
    INNER_NUM = "INNER_NUM"
    INNER_BASE = "INNER_BASE"
    CRC32 = "__CRC32#"
    REAL_TOPIC = "REAL_TOPIC"
    REAL_QUEUE_ID = "REAL_QID"
    TRANSACTION_PREPARED = "TRAN_MSG"
    PRODUCER_GROUP = "PGROUP"
    RETRY_TOPIC = "RETRY_TOPIC"
    CLUSTER = "CLUSTER"
    INNER_MULTI_DISPATCH = "INNER_MULTI_DISPATCH"
    INNER_MULTI_QUEUE_OFFSET = "INNER_MULTI_QUEUE_OFFSET"
    MSG_REGION = "MSG_REGION"
    TRACE_SWITCH = "TRACE_ON"
    MAX_RECONSUME_TIMES = "MAX_RECONSUME_TIMES"
    ORIGIN_MESSAGE_ID = "ORIGIN_MESSAGE_ID"
    SHARDING_KEY = "__SHARDINGKEY"
    TIMER_DELIVER_MS = "TIMER_DELIVER_MS"
    TIMER_DELAY_SEC = "TIMER_DELAY_SEC"
    TIMER_DELAY_MS = "TIMER_DELAY_MS"
    TIMER_OUT_MS = "TIMER_OUT_MS"


def decode_properties(text: str) -> dict[str, str]:
    """Parse a properties string the way RocketMQ does (lenient; never raises): each ``\x02``-separated part
    with a non-empty name before its first ``\x01`` and a non-empty value after it; a later name wins."""
    return {name: value for name, _, value in (part.partition(NAME_VALUE_SEPARATOR)
                                                for part in text.split(PROPERTY_SEPARATOR)) if name and value}


def property_value(text: str, name: str) -> str | None:
    """``decode_properties(text).get(name)`` without building the map (a query checks one name of each
    candidate): the value of the last ``name`` pair, the earlier ones asked of the full parse only when that
    value is empty."""
    marker = f"{PROPERTY_SEPARATOR}{name}{NAME_VALUE_SEPARATOR}"
    at = text.rfind(marker)
    if at >= 0:
        start = at + len(marker)
    elif text.startswith(marker[1:]):
        start = len(marker) - 1
    else:
        return None
    end = text.find(PROPERTY_SEPARATOR, start)
    value = text[start:] if end < 0 else text[start:end]
    return value if value and name else decode_properties(text).get(name)


def check_property(name: str, value: str) -> None:
    """Raise unless ``name=value`` survives encoding and decoding unchanged."""
    if not isinstance(name, str) or not isinstance(value, str):
        raise InvalidPropertyError(f"property names and values must be str, got {name!r}={value!r}")
    if not name or not value:
        raise InvalidPropertyError(f"property {name!r} has an empty name or value (RocketMQ drops those)")
    for sep in (NAME_VALUE_SEPARATOR, PROPERTY_SEPARATOR):
        if sep in name or sep in value:
            raise InvalidPropertyError(f"property {name!r} contains a separator character (\\x01 or \\x02)")


def encode_properties(properties: Mapping[str, str], *, java_order: bool = True, checked: bool = False) -> str:
    """Serialise properties, in the broker's HashMap order when ``java_order`` (see ``java_hashmap_order``).

    ``checked`` says every pair already passed ``check_property`` (the encoder checks them once).
    """
    names: Iterable[str] = _cached_order(tuple(properties)) if java_order else properties
    if not checked:
        for name in names:
            check_property(name, properties[name])
    return "".join([f"{name}\x01{properties[name]}\x02" for name in names])


@functools.lru_cache(maxsize=4096)
def _cached_order(names: tuple[str, ...]) -> tuple[str, ...]:
    """Messages reuse a few sets of property names: their HashMap order is computed once."""
    return tuple(java_hashmap_order(names))


def java_hashmap_order(names: Iterable[str], initial_capacity: int = 128) -> list[str]:
    """The iteration order of a ``java.util.HashMap`` filled with ``names`` in order.

    The broker (``SendMessageProcessor``) rebuilds every properties string from a HashMap of
    initial capacity 128, so a record is byte-identical to a broker's only in this order:
    ascending bucket ``(h ^ h >>> 16) & (capacity - 1)``, insertion order within a bucket, with
    the capacity doubled whenever the map grows past 3/4 of it. (Buckets of 8 or more names turn
    into trees whose order differs; no real message has that many colliding property names.)
    """
    ordered = list(dict.fromkeys(names))
    capacity = 1
    while capacity < initial_capacity:
        capacity <<= 1
    while len(ordered) > capacity * 3 // 4:
        capacity <<= 1

    def bucket(name: str) -> int:
        h = java_string_hash(name) & 0xFFFFFFFF
        return (h ^ (h >> 16)) & (capacity - 1)

    return sorted(ordered, key=bucket)  # sorted() is stable: insertion order within a bucket


def split_keys(keys: str | None) -> list[str]:
    """The non-empty tokens of a KEYS value, in order (RocketMQ indexes each one)."""
    if not keys:
        return []
    return [k for k in keys.split(KEY_SEPARATOR) if k]

"""Output for the command line: mqadmin's message block, JSON lines with RocketMQ's field names, times.

Kept apart from the commands so the JSON path never needs rich.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import re
import zlib

import click

from ..codec.record import MAGIC_V1, MAGIC_V2
from ..message import MessageExt

# mqadmin's yyyy-MM-dd#HH:mm:ss:SSS as its lenient SimpleDateFormat reads it: a field may have fewer digits, and the
# milliseconds are a count (":5" is 5 ms, ":1234" 1.234 s), not a fraction
_ROCKETMQ_TIME = re.compile(r"(\d{4})-(\d{1,2})-(\d{1,2})#(\d{1,2}):(\d{1,2}):(\d{1,2}):(\d{1,9})", re.ASCII)
_EPOCH = dt.datetime(1970, 1, 1)
_EPOCH_UTC = _EPOCH.replace(tzinfo=dt.UTC)
_MS = dt.timedelta(milliseconds=1)


_EPOCH_MS = re.compile(r"-?[0-9]{1,25}", re.ASCII)


def parse_time(value: str | int | None, name: str = "time") -> int | None:
    """Epoch milliseconds from ms digits, ISO-8601 (naive = local time) or mqadmin's yyyy-MM-dd#HH:mm:ss:SSS."""
    if value is None or value == "":
        return None
    text = str(value).strip()
    if _EPOCH_MS.fullmatch(text):  # ASCII digits only: isdigit() took "²" (then int() failed) and "５0" (50)
        ms = int(text)
        if not -(1 << 63) <= ms < 1 << 63:
            raise click.BadParameter(f"{value!r} is past a Java long's range of epoch milliseconds", param_hint=name)
        return ms
    match = _ROCKETMQ_TIME.fullmatch(text)
    try:
        if match:
            y, mo, d, h, mi, s, ms = map(int, match.groups())
            stamp = dt.datetime(y, mo, d, h, mi, s) + dt.timedelta(milliseconds=ms)
        else:
            stamp = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise click.BadParameter(f"{value!r} is neither epoch milliseconds nor an ISO-8601 time "
                                 f"(e.g. 2026-11-21T09:30:00 or 2026-11-21T09:30:00+08:00)", param_hint=name) from None
    try:
        if stamp.tzinfo is None:
            return _local_ms(stamp)
        return (stamp - _EPOCH_UTC) // _MS  # integers: a float product read some times 1 ms early
    except (ValueError, OverflowError, OSError) as exc:  # year 1 in a zone east of UTC, and the like
        raise click.BadParameter(f"{value!r} is out of range: {exc}", param_hint=name) from None


def _local_ms(stamp: dt.datetime) -> int:
    """Epoch ms of a local wall-clock time as Java's calendar reads it (mqadmin): an hour a DST change shows twice
    is the later one (standard time), an hour it skips is read past the change (02:30 is 03:30 summer time); both
    are the later of Python's two readings (``fold``)."""
    whole = stamp.replace(microsecond=0)
    later = max(whole.replace(fold=0).timestamp(), whole.replace(fold=1).timestamp())  # whole seconds: exact
    offset_s = round((whole - _EPOCH).total_seconds() - later)
    return (stamp - _EPOCH) // _MS - offset_s * 1000


def human_time(ms: int) -> str:
    """``UtilAll.timeMillisToHumanString2``: local time as yyyy-MM-dd HH:mm:ss,SSS."""
    try:
        stamp = dt.datetime.fromtimestamp(ms / 1000)
    except (OverflowError, OSError, ValueError):
        return str(ms)
    return stamp.strftime("%Y-%m-%d %H:%M:%S,") + f"{ms % 1000:03d}"


def java_map(properties: dict[str, str]) -> str:
    return "{" + ", ".join(f"{k}={v}" for k, v in properties.items()) + "}"


def message_block(msg: MessageExt, body: bool = False) -> str:
    """mqadmin's ``printMsg`` block (queryMsgById, queryMsgByOffset, queryMsgByUniqueKey)."""
    rows = [
        ("OffsetID:", msg.msg_id),
        ("Topic:", msg.topic),
        ("Tags:", f"[{msg.tags}]" if msg.tags is not None else "[null]"),
        ("Keys:", f"[{msg.properties['KEYS']}]" if "KEYS" in msg.properties else "[null]"),
        ("Queue ID:", msg.queue_id),
        ("Queue Offset:", msg.queue_offset),
        ("CommitLog Offset:", msg.commit_log_offset),
        ("Reconsume Times:", msg.reconsume_times),
        ("Born Timestamp:", human_time(msg.born_timestamp)),
        ("Store Timestamp:", human_time(msg.store_timestamp)),
        ("Born Host:", msg.born_host),
        ("Store Host:", msg.store_host),
        ("System Flag:", msg.sys_flag),
        ("Properties:", java_map(msg.properties)),
    ]
    if body:
        rows.append(("Message Body:", body_text(msg.body)))
    else:
        rows.append(("Message Body:", f"{len(msg.body)} bytes (--body prints it)"))
    return "\n".join(f"{label:<20} {value}" for label, value in rows)


def body_text(body: bytes, charset: str | None = None) -> str:
    """The body as text: UTF-8, or base64 where it is not; with ``charset`` (mqadmin's ``-c``) decoded as Java's
    ``new String(body, charset)`` does, bytes that charset cannot read shown as U+FFFD."""
    if charset is not None:
        return body.decode(charset, "replace")
    text = body.decode("utf-8", "replace")
    return text if "\ufffd" not in text else "base64:" + base64.b64encode(body).decode()


def message_json(msg: MessageExt, *, body: bool = True) -> dict:
    """A message with RocketMQ's ``MessageExt`` field names (body as base64, null when empty). ``msgId`` is the
    offset id, as ``MessageExt.getMsgId`` on the broker's side; ``uniqKey`` the producer's id (what put's ``msgId``
    and a SendResult's are), so ``jq .uniqKey`` is the same id everywhere."""
    return {
        "msgId": msg.msg_id, "uniqKey": msg.uniq_key, "topic": msg.topic, "queueId": msg.queue_id, "flag": msg.flag,
        "queueOffset": msg.queue_offset, "commitLogOffset": msg.commit_log_offset, "sysFlag": msg.sys_flag,
        "bornTimestamp": msg.born_timestamp, "bornHost": str(msg.born_host), "storeTimestamp": msg.store_timestamp,
        "storeHost": str(msg.store_host), "reconsumeTimes": msg.reconsume_times,
        "preparedTransactionOffset": msg.prepared_transaction_offset, "bodyCRC": msg.body_crc,
        "body": base64.b64encode(msg.body).decode() if body and msg.body else None,
        "properties": msg.properties, "storeSize": msg.store_size,
    }


_JSON_OF_COLUMN = {"msgId": "msgId", "topic": "topic", "queueId": "queueId", "flag": "flag",
                   "queueOffset": "queueOffset", "commitLogOffset": "commitLogOffset", "sysFlag": "sysFlag",
                   "bornHost": "bornHost", "storeHost": "storeHost", "reconsumeTimes": "reconsumeTimes",
                   "preparedTransactionOffset": "preparedTransactionOffset", "bodyCRC": "bodyCRC",
                   "storeSize": "storeSize"}


_JSON_ORDER = ("msgId", "uniqKey", "topic", "queueId", "flag", "queueOffset", "commitLogOffset", "sysFlag",
               "bornTimestamp", "bornHost", "storeTimestamp", "storeHost", "reconsumeTimes",
               "preparedTransactionOffset", "bodyCRC", "body", "properties", "storeSize")


def arrow_message_rows(batch) -> list[dict]:
    """``message_json`` for every row of a batch in the Arrow message columns (``scan_arrow``,
    ``query_messages_arrow``), plus ``queryTopic``/``queryKey`` when the batch has them: read column-wise."""
    rows = arrow_messages(batch)
    for row in rows:
        body = row["body"]
        row["body"] = base64.b64encode(body).decode() if body else None
    return rows


def arrow_messages(batch) -> list[dict]:
    """The rows of a batch in the Arrow message columns as dicts with ``message_json``'s names, bodies raw."""
    import pyarrow as pa
    import pyarrow.compute as pc

    n = batch.num_rows
    columns = {name: batch.column(name).to_pylist() for name in _JSON_OF_COLUMN}
    for name in ("bornTimestamp", "storeTimestamp"):
        micros = pc.cast(batch.column(name), pa.int64()).to_numpy(zero_copy_only=False)
        columns[name] = (micros // 1000).tolist()
    bodies = batch.column("body").to_pylist()
    properties = batch.column("properties").to_pylist()
    extra = [name for name in ("queryTopic", "queryKey") if name in batch.schema.names]
    for name in extra:
        columns[name] = batch.column(name).to_pylist()
    columns["body"] = bodies
    columns["properties"] = [dict(p or ()) for p in properties]
    columns["uniqKey"] = [p.get("UNIQ_KEY") for p in columns["properties"]]
    names = [name for name in _JSON_ORDER if name in columns] + extra
    return [{name: columns[name][i] for name in names} for i in range(n)]


def java_message_lines(batch, *, body: bool, charset: str | None = None) -> list[str]:
    """mqadmin printMsg's line for every row of a batch in the Arrow message columns: ``MSGID: <UNIQ_KEY>``, Java's
    ``MessageExt.toString()`` and the body (or ``NOT PRINT BODY``), joined column by column."""
    import pyarrow as pa
    import pyarrow.compute as pc

    def text(name: str):
        return pc.cast(batch.column(name), pa.string())

    def millis(name: str):
        return pc.cast(pc.divide(pc.cast(batch.column(name), pa.int64()), 1000), pa.string())

    props = batch.column("properties")
    pairs = pc.binary_join_element_wise(props.keys, props.items, "=")
    props_text = pc.binary_join(pa.ListArray.from_arrays(props.offsets, pairs), ", ").fill_null("")
    body_len = pc.cast(pc.binary_length(batch.column("body")).fill_null(0), pa.string())
    if body:
        bodies = pa.array([body_text(b or b"", charset) for b in batch.column("body").to_pylist()], pa.string())
    else:
        bodies = pa.scalar("NOT PRINT BODY")
    # MSGID is what the client's MessageClientExt.getMsgId() answers: the producer's id (UNIQ_KEY), else the offset
    # id; toString()'s msgId= is the offset id (the field the decoder set)
    producer_id = pc.coalesce(batch.column("uniqKey"), text("msgId"))
    pieces = ["MSGID: ", producer_id, " MessageExt [queueId=", text("queueId"), ", storeSize=", text("storeSize"),
              ", queueOffset=", text("queueOffset"), ", sysFlag=", text("sysFlag"), ", bornTimestamp=",
              millis("bornTimestamp"), ", bornHost=/", text("bornHost"), ", storeTimestamp=", millis("storeTimestamp"),
              ", storeHost=/", text("storeHost"), ", msgId=", text("msgId"), ", commitLogOffset=",
              text("commitLogOffset"), ", bodyCRC=", text("bodyCRC"), ", reconsumeTimes=", text("reconsumeTimes"),
              ", preparedTransactionOffset=", text("preparedTransactionOffset"), ", toString()=Message{topic='",
              text("topic"), "', flag=", text("flag"), ", properties={", props_text, "}, body=[", body_len,
              " bytes]}] BODY: ", bodies]
    return pc.binary_join_element_wise(*[pa.scalar(p) if isinstance(p, str) else p for p in pieces], "").to_pylist()


def dump_json(msg: MessageExt, pos: int) -> dict:
    """One ``dump-log --json`` line: the fields of ``decode.jsonl`` from RocketMQ's own decoder."""
    out = {"pos": pos, "msgId": msg.msg_id, "magicCode": msg.magic_code or MAGIC_V1}
    data = message_json(msg)
    data["bornHostHex"] = msg.born_host.to_bytes().hex().upper()
    data["storeHostHex"] = msg.store_host.to_bytes().hex().upper()
    data["crc32OfBody"] = zlib.crc32(msg.body) & 0x7FFFFFFF if msg.body else None
    for key in ("topic", "queueId", "flag", "queueOffset", "commitLogOffset", "sysFlag", "bornTimestamp", "bornHost",
                "bornHostHex", "storeTimestamp", "storeHost", "storeHostHex", "reconsumeTimes",
                "preparedTransactionOffset", "bodyCRC", "body", "crc32OfBody", "properties", "storeSize"):
        out[key] = data[key]
    return out


def version_name(magic: int) -> str:
    return {MAGIC_V1: "V1", MAGIC_V2: "V2"}.get(magic, f"0x{magic & 0xFFFFFFFF:08X}")


def emit_json(obj: dict) -> None:
    click.echo(json.dumps(obj, ensure_ascii=False))

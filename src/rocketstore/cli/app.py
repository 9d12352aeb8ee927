"""``rocketstore``: inspect, query, verify and repair RocketMQ store directories offline.

Every command takes ``--store DIR`` (default ``~/store``, RocketMQ's). Query commands open the
store read-only and never change a byte, so they are safe on a live broker's files. Errors are
one line on stderr and a non-zero exit code.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import logging
import math
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import click

from ..brokerlayout import ROCKSDB_QUEUES, check_not_dledger
from ..config import (
    GEOMETRY,
    StoreConfig,
    broker_conf_store_root,
    broker_conf_values,
    broker_sizes,
    check_commit_log_path,
    detect_config,
)
from ..errors import DamagedLogError, MessageNotFoundError, RocketStoreError, StoredButNotClosedError
from .render import (
    arrow_message_rows,
    arrow_messages,
    dump_json,
    emit_json,
    human_time,
    java_message_lines,
    message_block,
    message_json,
    parse_time,
)

if TYPE_CHECKING:
    from .. import Message, MessageStore

# The store, numpy, pyarrow and numba load inside the commands that use them: ``--help``, ``-h`` and usage errors
# answer without them (0.9 s -> 0.2 s here).

DEFAULT_STORE = "~/store"
STORE_ENV = "ROCKETSTORE_STORE"  # an operator's store for every command of a session, as mqadmin's NAMESRV_ADDR
CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 110}


class _Trimmed(click.ParamType):
    """Text with the spaces around it dropped, as mqadmin's ``getOptionValue(..).trim()``: a pasted
    ``-k 'order-1 '`` finds order-1, and ``-s ' * '`` is every tag."""

    name = "text"

    def convert(self, value, param, ctx):
        return value.strip() if isinstance(value, str) else value


TRIMMED = _Trimmed()


class Failure(click.ClickException):
    """One line on stderr, exit code 1."""

    def show(self, file=None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


def fails_cleanly(command):
    """Turn library errors into one clean line instead of a traceback."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        with _errors_logged_once() as said:
            try:
                return _failing_cleanly(command, args, kwargs)
            except click.ClickException as exc:
                said.append(exc.format_message())
                raise

    return wrapper


@contextlib.contextmanager
def _errors_logged_once() -> Iterator[list[str]]:
    """Hold rocketstore's ERROR records back while a command runs, and print after it only those its error line does
    not say already: a command that failed on a full disk printed the dispatcher's error, the close's, and then its
    own line, all three the same error (the full-disk review). Warnings are printed as they come, as before."""
    handler = logging.lastResort  # the CLI configures no logging: records reach stderr through it
    held: list[logging.LogRecord] = []
    said: list[str] = []

    def hold(record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and record.name.startswith("rocketstore"):
            held.append(record)
            return False
        return True

    if handler is not None:
        handler.addFilter(hold)
    try:
        yield said
    finally:
        if handler is not None:
            handler.removeFilter(hold)
        for record in held:
            if not any(_says_nothing_more(record, line) for line in said):
                logging.getLogger(record.name).handle(record)


def _says_nothing_more(record: logging.LogRecord, line: str) -> bool:
    """Whether a logged error says nothing the command's error ``line`` does not: what follows its lead-in
    ("dispatch failed ...: ", "store ... closed with errors ...: ") is part of the line. A record that also names
    another error, one with nothing after its lead-in, or one with a traceback says more."""
    tail = record.getMessage().split(": ", 1)[-1]
    return bool(tail) and record.exc_info is None and tail in line


def _failing_cleanly(command, args, kwargs):
    """The command, its library errors turned into ``Failure``: one line, exit code 1."""
    try:
        return command(*args, **kwargs)
    except (click.ClickException, click.exceptions.Exit, click.Abort):
        raise
    except BrokenPipeError:  # `| head`: stop quietly, like any Unix tool
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
    except DamagedLogError as exc:  # the store's words, and the command line's way on
        text = str(exc)
        if "onCorrupt" in text:  # a scan's: the command line's flag for it
            text += " (--allow-damage reads up to the damage)"
        elif "--allow-damage" not in text:
            text += " (rocketstore verify shows the damage; --allow-damage goes on with the log cut there, as a " \
                    "broker's restart cuts it)"
        raise Failure(text) from None
    except RocketStoreError as exc:
        raise Failure(str(exc)) from None
    except OSError as exc:
        raise Failure(f"{exc.strerror or exc}: {exc.filename or ''}".rstrip(": ")) from None
    except Exception as exc:  # Spark's wrapped executor failures and others: the line that names the error
        from ..spark.failures import one_line

        raise Failure(one_line(exc)) from None


def _finite(_ctx, param, value):
    """click's FloatRange lets NaN through (every comparison with it is false)."""
    if value is not None and math.isnan(value):
        raise click.BadParameter("not a number", param=param)
    return value


def store_options(command):
    """--store plus the settings that describe a store's geometry."""
    command = click.option("--mapped-file-size-commit-log", type=click.IntRange(1024, (1 << 31) - 1), default=None,
                           help="the broker's mappedFileSizeCommitLog (default: the segments' size; 1073741824)"
                           )(command)
    command = click.option("--mapped-file-size-consume-queue", type=click.IntRange(20, (1 << 31) - 1), default=None,
                           help="the broker's mappedFileSizeConsumeQueue (default: the queue files' size; 6000000)"
                           )(command)
    command = click.option("--max-index-num", type=click.IntRange(2, 100_000_000), default=None,
                           help="the broker's maxIndexNum (default 20000000)")(command)
    command = click.option("--max-hash-slot-num", type=click.IntRange(1, 100_000_000), default=None,
                           help="the broker's maxHashSlotNum (default 5000000)")(command)
    command = click.option("--broker-conf", type=click.Path(dir_okay=False, exists=True),
                           help="read settings (maxHashSlotNum, ..., and storePathRootDir unless --store is "
                           "given) from a broker.conf")(command)
    command = click.option("--allow-damage", is_flag=True,
                           help="go on when the commit log is damaged with intact records after the damage: "
                           "answer from the log up to it, and a writing command cuts the log there as a broker's "
                           "restart does (the cut bytes kept in recovery/); without it such a store is refused "
                           "(rocketstore verify shows the damage)")(command)
    return click.option("--store", "store_dir", default=DEFAULT_STORE, show_default=True, envvar=STORE_ENV,
                        help=f"the store root (RocketMQ's storePathRootDir; ${STORE_ENV} when not given)")(command)


def key_window_options(max_help: str):
    """-b/--begin, -e/--end and -m/--max of the key lookups (``query_message``'s window and limit)."""
    def apply(command):
        command = click.option("-m", "--max", "max_num", type=click.IntRange(1, None), default=64,
                               callback=lambda _ctx, _param, value: min(value, 64), show_default=True,
                               help=f"{max_help} (more is taken as 64, the broker's maxMsgsNumBatch, as mqadmin's "
                               "are)")(command)
        command = click.option("-e", "--end", help="end time, inclusive (epoch ms or ISO-8601; as mqadmin's "
                               "queryMsgByKey)")(command)
        return click.option("-b", "--begin", help="begin time, inclusive (epoch ms or ISO-8601)")(command)
    return apply


def json_option(command):
    return click.option("--json", "as_json", is_flag=True, help="JSON lines with RocketMQ's field names")(command)


def config_for(store_dir: str, broker_conf: str | None, max_hash_slot_num: int | None,
               max_index_num: int | None, mapped_file_size_commit_log: int | None = None,
               mapped_file_size_consume_queue: int | None = None, allow_damage: bool = False, *,
               must_exist: bool = True) -> tuple[Path, StoreConfig]:
    if broker_conf and _defaulted("store_dir"):  # the broker's own storePathRootDir, unless --store names one
        store_dir = broker_conf_store_root(broker_conf) or store_dir
    root = Path(store_dir).expanduser()
    if broker_conf:
        check_commit_log_path(broker_conf, root)
    if must_exist and not (root / "commitlog").is_dir():
        check_not_dledger(root)
        raise Failure(f"{root} holds no store (no commitlog directory); pass --store DIR")
    values = broker_conf_values(broker_conf) if broker_conf else {}
    values.update((k, v) for k, v in (("max_hash_slot_num", max_hash_slot_num), ("max_index_num", max_index_num),
                                      ("mapped_file_size_commit_log", mapped_file_size_commit_log),
                                      ("mapped_file_size_consume_queue", mapped_file_size_consume_queue))
                  if v is not None)
    base = StoreConfig(**broker_sizes(values))  # type: ignore[arg-type]
    # what the broker.conf and the flags name wins over what the files suggest
    config = detect_config(root, base, explicit=values) if root.exists() else base
    # a writer's open refuses to cut intact records off a damaged log unless the operator says so
    return root, config.replace(cut_damaged_log=allow_damage)


def _defaulted(param: str) -> bool:
    """Whether the running command's ``param`` took its default (not given on the command line or in the env)."""
    context = click.get_current_context(silent=True)
    return context is not None and context.get_parameter_source(param) is click.core.ParameterSource.DEFAULT


@contextlib.contextmanager
def writer_store(root: Path, config: StoreConfig) -> Iterator[MessageStore]:
    """The store a writing command opens, created if missing. When the command fails before anything was stored,
    what its open made is removed again: the whole store if this command created it (a refused put on a mistyped
    --store left a directory of a lock and a checkpoint, which later commands took for a store), else the files
    it added beside an empty log (``lock``, ``checkpoint``, ``queueEnds.json``). When the command's work was done
    and only the close failed, that is said (``ChangedButNotClosed``): a plain error had scripts run it again."""
    from .. import MessageStore

    existed = root.exists()
    before = set(os.listdir(root)) if root.is_dir() else set()
    try:
        store = MessageStore.open(root, config)
    except BaseException:
        _remove_what_was_added(root, existed, before)
        raise
    try:
        yield store
    except BaseException:
        with contextlib.suppress(Exception):  # the command's own error is the one to report
            store.close()
        _remove_what_was_added(root, existed, before)
        raise
    try:
        store.close()
    except RocketStoreError as exc:
        raise ChangedButNotClosed(f"the command's change is stored, but closing the store failed: {exc}. Do not "
                                  "run the command again; the store's next open recovers") from None


class ChangedButNotClosed(Failure):
    """A writing command did its work and only the store's close failed: exit code 3, not 1 (running it again
    would put its messages twice)."""

    exit_code = 3


class ChangedButNotSynced(Failure):
    """A config file was replaced with the change, and only the fsync of its directory failed: exit code 3, as a
    change that is stored (exit 1 said nothing changed, while the file had the new topic or offsets)."""

    exit_code = 3


@contextlib.contextmanager
def config_change(name: str) -> Iterator[None]:
    """A command's change to ``config/<name>``: a failed directory fsync after it (``FlushError``) is said as
    stored, exit 3."""
    from ..errors import FlushError

    try:
        yield
    except FlushError as exc:
        raise ChangedButNotSynced(f"the change is in config/{name}, but syncing its directory failed ({exc}): it may "
                                  "not survive a power loss until the file is written again") from None


def _remove_what_was_added(root: Path, existed: bool, before: set[str]) -> None:
    if not root.is_dir() or any((root / "commitlog").glob("[0-9]*")):
        return
    if not existed and not (root / "config").exists():
        shutil.rmtree(root, ignore_errors=True)
    elif existed:
        for name in set(os.listdir(root)) - before - {"config"}:
            added = root / name
            if added.is_dir() and not added.is_symlink():
                shutil.rmtree(added, ignore_errors=True)
            else:
                added.unlink(missing_ok=True)


@contextlib.contextmanager
def read_only_store(options: dict, reports: tuple[type, ...] = ()) -> Iterator[MessageStore]:
    """The store a query opens. A log that recovery ends at damage with intact records after it is refused (every
    answer would silently leave those out) unless --allow-damage. ``reports``: the config files (managers) whose
    content the command reports: one that cannot be read is its error (a read-only open would serve it empty, and
    an empty report reads as "no lag" or "no topics")."""
    from .. import MessageStore
    from ..recovery import damaged_log_error

    root, config = config_for(**options)
    for manager in reports:
        try:
            manager(root, read_only=True).load()
        except RocketStoreError as exc:
            raise Failure(f"cannot report {manager.FILE}: {exc}") from None
    with MessageStore.open(root, config.replace(cut_damaged_log=True), read_only=True) as store:
        report = store.recovery
        if report is not None and report.resumes_at is not None and not config.cut_damaged_log:
            raise damaged_log_error(root, report, "would be left out of every answer: --allow-damage answers from "
                                    "the log up to the damage (rocketstore verify shows it)")
        yield store


def _store_args(kwargs: dict) -> dict:
    return {k: kwargs.pop(k) for k in ("store_dir", "broker_conf", "max_hash_slot_num", "max_index_num",
                                       "mapped_file_size_commit_log", "mapped_file_size_consume_queue",
                                       "allow_damage")}


@contextlib.contextmanager
def progress_bar(description: str) -> Iterator:
    """A rich progress bar on a terminal; nothing when stderr is piped."""
    if not sys.stderr.isatty():
        yield lambda stage, done, total: None
        return
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TimeRemainingColumn(),
                  transient=True, console=_console(err=True)) as bar:
        tasks: dict[str, int] = {}

        def update(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(f"{description}: {stage}", total=total or None)
            bar.update(tasks[stage], completed=done, total=total or None)

        yield update


def _console(err: bool = False):
    from rich.console import Console

    class QuietConsole(Console):
        def on_broken_pipe(self) -> None:
            # rich exits with status 1 on its own; `| head` is no failure: fails_cleanly exits 0 instead
            self.quiet = True
            raise BrokenPipeError(32, "stdout was closed")

    stream = sys.stderr if err else sys.stdout
    return QuietConsole(stderr=err, highlight=False, width=None if stream.isatty() else 200)


def _table(title: str, columns: list[str], rows: list[list]) -> None:
    from rich.table import Table

    table = Table(title=title, title_justify="left", show_lines=False)
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*(str(v) for v in row))
    _console().print(table)


@click.group(context_settings=CONTEXT, help="""\
Inspect, query, verify, repair and write RocketMQ store directories offline, or serve
one to RocketMQ 5's clients (serve).

Every command takes --store DIR (default ~/store, RocketMQ's). Query commands open the store
read-only and never change a byte, so they are safe on a live broker's files. Times are epoch
milliseconds or ISO-8601. Errors are one line on stderr and a non-zero exit code.
""")
@click.version_option(package_name="rocketstore")
def main() -> None:
    pass


# --- writing ---------------------------------------------------------------------------------------

@main.command(epilog="""\b
Examples:
  rocketstore put -t TopicTest -p 'hello' -k order-1 -c TagA        # mqadmin sendMessage's letters
  echo '{"topic":"TopicTest","body":"hi","keys":["k1","k2"],"properties":{"a":"b"}}' | rocketstore put
""")
@store_options
@click.option("-t", "--topic", help="topic (else JSON lines are read from stdin)")
@click.option("-p", "--body", multiple=True, help="message body (UTF-8; mqadmin sendMessage's -p)")
@click.option("-k", "--key", "keys", multiple=True, help="a key (repeatable)")
@click.option("-c", "--tags", help="the message tag (mqadmin's -c)")
@click.option("--property", "props", multiple=True, metavar="NAME=VALUE", help="a user property (repeatable)")
@click.option("-i", "--queue", "queue_id", type=int, default=0, show_default=True, help="queue id (mqadmin's -i)")
@click.option("-b", "--broker", hidden=True, help="mqadmin's broker: refused (this writes to --store)")
@json_option
@fails_cleanly
def put(topic, body, keys, tags, props, queue_id, broker, as_json, **kwargs) -> None:
    """Append messages (from options, or JSON lines on stdin) through the store's single writer."""
    if broker is not None:  # -b was put's body before it took mqadmin's letters: never take a broker for a body
        raise click.UsageError("-b/--broker names a broker to mqadmin sendMessage; put writes to the store --store "
                               "names (the body is -p/--body)")
    if len(body) > 1:  # -p was a property before it was the body: a second one is no body to keep quietly
        raise click.UsageError("the body (-p/--body) is given more than once; a property is --property NAME=VALUE")
    body = body[0] if body else None
    root, config = config_for(**_store_args(kwargs), must_exist=False)
    messages = [_message_from_options(topic, body, keys, tags, props, queue_id)] if topic else list(_stdin_messages())
    if not messages:
        raise Failure("nothing to put: give -t TOPIC -p BODY, or JSON lines on stdin")
    with writer_store(root, config) as store:
        results = store.put_messages(messages)
        for msg, result in zip(messages, results, strict=True):  # before the close: a failing close still shows the ids
            if as_json:
                emit_json({"status": result.status.value, "msgId": result.uniq_key, "uniqKey": result.uniq_key,
                           "offsetMsgId": result.msg_id,
                           "topic": msg.topic, "queueId": msg.queue_id, "queueOffset": result.queue_offset,
                           "commitLogOffset": result.commit_log_offset, "storeTimestamp": result.store_timestamp})
            else:
                click.echo(f"SendResult [sendStatus={result.status.value}, msgId={result.uniq_key}, "
                           f"offsetMsgId={result.msg_id}, messageQueue=[topic={msg.topic}, "
                           f"queueId={msg.queue_id}], queueOffset={result.queue_offset}, "
                           f"commitLogOffset={result.commit_log_offset}]")


def _message_from_options(topic, body, keys, tags, props, queue_id) -> Message:
    from .. import Message

    if body is None:
        raise Failure("-p/--body is required with -t/--topic")
    properties = {}
    for item in props:
        name, sep, value = item.partition("=")
        if not sep:
            raise click.BadParameter(f"{item!r} is not NAME=VALUE", param_hint="--property")
        properties[name] = value
    return Message(topic, body.encode(), tags=tags, keys=list(keys), properties=properties or None,
                   queue_id=queue_id)


_STDIN_FIELDS = frozenset({"topic", "body", "bodyBase64", "keys", "tags", "properties", "queueId", "queue", "flag"})


def _stdin_messages() -> Iterator[Message]:
    """One message per JSON line; anything not a message of these fields is refused, naming the line: a bad
    ``bodyBase64`` was decoded to another body (``!!!``: empty), ``queueId`` 1.9 or true went to queue 1,
    ``keys`` {"a": 1} became the key "a", and unknown fields (``flag``, ``bornTimestamp``) were dropped."""
    if sys.stdin is None or sys.stdin.isatty():
        return
    for n, line in enumerate(sys.stdin, 1):
        if not line.strip():
            continue
        try:
            yield _json_message(json.loads(line))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise Failure(f"stdin line {n} is not a message (JSON with topic and body): {exc}") from None


def _json_message(data) -> Message:
    import base64
    import binascii

    from .. import Message

    if not isinstance(data, dict):
        raise TypeError("not a JSON object")
    unknown = sorted(set(data) - _STDIN_FIELDS)
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(map(repr, unknown))}; known: {', '.join(sorted(_STDIN_FIELDS))}")
    body = data.get("body", "")
    if "bodyBase64" in data:
        if "body" in data:
            raise ValueError("give body or bodyBase64, not both")
        encoded = data["bodyBase64"]
        if not isinstance(encoded, str):
            raise TypeError("bodyBase64 must be a string")
        try:
            body = base64.b64decode(encoded, validate=True)
        except binascii.Error as exc:
            raise ValueError(f"bodyBase64 is not base64 ({exc})") from None
    elif not isinstance(body, str):
        raise TypeError("body must be a string (bodyBase64 for bytes)")
    keys = data.get("keys") or []
    if isinstance(keys, str):
        keys = [keys]
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise TypeError("keys must be a string or a list of strings")
    tags = data.get("tags")
    if tags is not None and not isinstance(tags, str):
        raise TypeError("tags must be a string")
    properties = data.get("properties")
    if properties is not None and (not isinstance(properties, dict)
                                   or not all(isinstance(v, str) for v in properties.values())):
        raise TypeError("properties must be an object of strings")
    if "queue" in data and "queueId" in data:
        raise ValueError("give queueId or queue, not both")
    numbers = {name: data.get(name, 0) for name in ("queueId" if "queueId" in data else "queue", "flag")}
    for name, value in numbers.items():
        if type(value) is not int:
            raise TypeError(f"{name} must be an integer, not {value!r}")
    queue_id, flag = numbers.values()
    return Message(data["topic"], body.encode() if isinstance(body, str) else body, tags=tags, keys=keys,
                   properties=properties, queue_id=queue_id, flag=flag)


# --- queries ---------------------------------------------------------------------------------------

@main.command("query-by-key", epilog="""\b
Examples:
  rocketstore query-by-key -t TopicTest -k order-1
  rocketstore query-by-key -t TopicTest -k order-1 -b 2026-11-21T09:00 -e 2026-11-21T10:00 --json
  rocketstore query-by-key -t TopicTest --keys-file orders.txt --json     # one key per line; - is stdin
""")
@store_options
@click.option("-t", "--topic", type=TRIMMED, required=True, help="topic")
@click.option("-k", "--key", "msg_key", type=TRIMMED, help="message key")
@click.option("--keys-file", type=click.File("r", encoding="utf-8"),
              help="many keys, one per line ('-': stdin), looked up together in batches")
@key_window_options("most messages per key")
@json_option
@fails_cleanly
def query_by_key(topic, msg_key, keys_file, begin, end, max_num, as_json, **kwargs) -> None:
    """Messages with a key (like mqadmin queryMsgByKey), matched exactly: no hash collisions."""
    if (msg_key is None) == (keys_file is None):
        raise click.UsageError("give one of -k/--key and --keys-file")
    start, stop = parse_time(begin, "--begin") or 0, parse_time(end, "--end")
    if keys_file is not None:
        keys = [line.strip() for line in _lines(keys_file) if line.strip()]
        with read_only_store(_store_args(kwargs)) as store:
            found = store.query_messages_arrow([(topic, key) for key in keys], max_num, start, stop)
        if not found.num_rows:  # as query-by-id: nothing found is exit 1 (mqadmin: "... but no message."), and
            # no table header before it (mqadmin throws before printing one)
            raise Failure(f"no message of topic {topic} has any of the {len(keys)} keys")
        _print_found(found, as_json)
        return
    with read_only_store(_store_args(kwargs)) as store:
        found = store.query_message(topic, msg_key, max_num, start, stop)
    if not found:
        raise Failure(f"no message of topic {topic} has the key {msg_key!r}")
    if as_json:
        for msg in found:
            emit_json(message_json(msg))
    else:
        click.echo(f"{'#Message ID':<50} {'#QID':>4} {'#Offset':>40}")
        for msg in found:
            click.echo(f"{msg.uniq_key or msg.msg_id:<50} {msg.queue_id:>4} {msg.queue_offset:>40}")


def _lines(file) -> list[str]:
    """The lines of a --keys-file, or a usage error naming it if it is not UTF-8."""
    try:
        return list(file)
    except UnicodeDecodeError as exc:
        raise click.BadParameter(f"{file.name} is not UTF-8 text ({exc.reason})",
                                 param_hint="--keys-file") from None


def _print_found(found, as_json: bool, *, many_stores: bool = False) -> None:
    """Found messages in the Arrow columns (``query_messages_arrow``, ``find_keys``): the one-key table with the
    key in front (and the topic and broker for many stores), or ``message_json`` lines with ``queryKey``."""
    rows = arrow_message_rows(found)
    if many_stores:
        for row, broker in zip(rows, found.column("brokerName").to_pylist(), strict=True):
            row["brokerName"] = broker
    if as_json:
        for row in rows:
            emit_json(row)
        return
    where = f"{'#Topic':<24} {'#Key':<32} {'#Broker':<16}" if many_stores else f"{'#Key':<32}"
    click.echo(f"{where} {'#Message ID':<50} {'#QID':>4} {'#Offset':>20}")
    for row in rows:
        uniq = row["properties"].get("UNIQ_KEY") or row["msgId"]
        where = f"{row['queryTopic']:<24} {row['queryKey']:<32} {row['brokerName'] or '-':<16}" if many_stores \
            else f"{row['queryKey']:<32}"
        click.echo(f"{where} {uniq:<50} {row['queueId']:>4} {row['queueOffset']:>20}")


def _print_messages(messages, as_json: bool, body: bool) -> None:
    for i, msg in enumerate(messages):
        if as_json:
            emit_json(message_json(msg))
        else:
            if i:
                click.echo()
            click.echo(message_block(msg, body))


@main.command("query-by-id", epilog="""\b
Examples:
  rocketstore query-by-id -i 0A00000100002A9F0000000000000000
  rocketstore query-by-id -i ID1,ID2 --body
""")
@store_options
@click.option("-i", "--msg-id", type=TRIMMED, required=True,
              help="offset message id(s), comma-separated (a UNIQ_KEY works too: its oldest copy)")
@click.option("-t", "--topic", type=TRIMMED, help="the messages' topic (mqadmin's queryMsgById takes it): a UNIQ_KEY "
              "is looked for in it only, and a message of another topic is not found")
@click.option("--body", is_flag=True, help="print the body")
@json_option
@fails_cleanly
def query_by_id(msg_id, topic, body, as_json, **kwargs) -> None:
    """Messages by message id (like mqadmin queryMsgById)."""
    ids = [part.strip() for part in msg_id.split(",") if part.strip()]
    if not ids:
        raise click.BadParameter(f"{msg_id!r} names no message id", param_hint="-i/--msg-id")
    missing = []
    with read_only_store(_store_args(kwargs)) as store:
        found = []
        for one in ids:
            try:
                msg = store.view_message_by_id(one, topic)
            except MessageNotFoundError:
                missing.append(one)
                continue
            if topic is not None and msg.topic != topic:
                missing.append(f"{one} (of topic {msg.topic}, not {topic})")
                continue
            found.append(msg)
    _print_messages(found, as_json, body)
    if missing:
        raise Failure(f"message not found: {', '.join(missing)}")


@main.command("query-by-unique-key", epilog="""\b
Examples:
  rocketstore query-by-unique-key -i 7F0000012BE17705E00568F469B49A2C -t TopicTest
""")
@store_options
@click.option("-i", "--msg-id", "uniq_key", type=TRIMMED, required=True, help="the UNIQ_KEY (the producer's msgId)")
@click.option("-t", "--topic", type=TRIMMED, help="topic (default: search every topic)")
@click.option("--body", is_flag=True, help="print the body")
@json_option
@fails_cleanly
def query_by_unique_key(uniq_key, topic, body, as_json, **kwargs) -> None:
    """Messages by UNIQ_KEY (like mqadmin queryMsgByUniqueKey); a producer retry can store one twice."""
    if not uniq_key.strip():
        raise click.BadParameter("the UNIQ_KEY is empty", param_hint="-i/--msg-id")
    if topic is not None and not topic.strip():
        raise click.BadParameter("the topic is empty (leave -t out to search every topic)", param_hint="-t/--topic")
    with read_only_store(_store_args(kwargs)) as store:
        # every topic with queues, and those only topics.json names yet (a delayed message's, a prepared one's)
        topics = [topic] if topic else sorted({*store.topics(), *store.topic_config.topics})
        # a UNIQ_KEY is any string a producer set, matched as given; a hex msgId typed in lower case is the fallback
        text = uniq_key.strip()
        found = [m for t in topics for m in store.query_message_by_uniq_key(t, text)]
        if not found and text.upper() != text:
            found = [m for t in topics for m in store.query_message_by_uniq_key(t, text.upper())]
    if not found:
        raise Failure(f"no message with UNIQ_KEY {uniq_key}" + (f" in {topic}" if topic else ""))
    _print_messages(found, as_json, body)


@main.command("query-by-offset", epilog="""\b
Examples:
  rocketstore query-by-offset -t TopicTest -q 0 -o 42
""")
@store_options
@click.option("-t", "--topic", type=TRIMMED, required=True, help="topic")
@click.option("-i", "-q", "--queue", "queue_id", type=int, required=True, help="queue id (mqadmin's -i)")
@click.option("-o", "--offset", type=int, required=True, help="queue offset")
@click.option("--body", is_flag=True, help="print the body")
@json_option
@fails_cleanly
def query_by_offset(topic, queue_id, offset, body, as_json, **kwargs) -> None:
    """The message at a queue offset (like mqadmin queryMsgByOffset)."""
    from ..reads import GetMessageStatus

    # statuses of a read that started inside the queue: the unit asked for was there but not served
    unservable = (GetMessageStatus.FOUND, GetMessageStatus.NO_MATCHED_MESSAGE, GetMessageStatus.MESSAGE_WAS_REMOVING,
                  GetMessageStatus.OFFSET_FOUND_NULL)
    with read_only_store(_store_args(kwargs)) as store:
        with _logs_held() as held:  # what get_message logs about this unit is the error's, not lines before it
            result = store.get_message(topic, queue_id, offset, 1)
        exact = [m for m in result.messages if (m.topic, m.queue_id, m.queue_offset) == (topic, queue_id, offset)]
        if not exact and result.status in unservable:  # get_message went on past the unit: say why it cannot
            raise Failure(_unservable_unit(store, topic, queue_id, offset))
        _replay(held)
    if result.status is not GetMessageStatus.FOUND:
        raise Failure(f"{result.status.value}: {topic} queue {queue_id} holds offsets [{result.min_offset}, "
                      f"{result.max_offset})")
    _print_messages(exact, as_json, body)


@contextlib.contextmanager
def _logs_held() -> Iterator[list[logging.LogRecord]]:
    """The records rocketstore's loggers emit inside the block, held back instead of printed: a command whose
    error line already says why (a unit that cannot be served) prints that line alone, with no log lines before
    it. ``_replay`` prints them after all where the command goes on."""
    package = logging.getLogger("rocketstore")
    held: list[logging.LogRecord] = []

    class Hold(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            held.append(record)

    handler, propagate = Hold(), package.propagate
    package.addHandler(handler)
    package.propagate = False
    try:
        yield held
    finally:
        package.removeHandler(handler)
        package.propagate = propagate


def _replay(held: list[logging.LogRecord]) -> None:
    for record in held:
        logging.getLogger(record.name).handle(record)


def _unservable_unit(store: MessageStore, topic: str, queue_id: int, offset: int) -> str:
    """Why the unit at ``offset`` serves no message of its own."""
    where = f"{topic} queue {queue_id} offset {offset}"
    queue = store.queues.get(topic, queue_id)
    unit = queue.get_unit(offset) if queue is not None else None
    if unit is None:
        return f"{where}: its consume-queue file is missing"
    phy, size, _tags = unit
    if phy < store.commit_log.min_offset:
        return f"{where}: its message was removed (commit-log offset {phy} is below the log's start " \
               f"{store.commit_log.min_offset})"
    try:
        msg = store.commit_log.get_message(phy)
    except RocketStoreError as exc:
        return f"{where}: the unit points at commit-log offset {phy} ({size} bytes), where no readable record " \
               f"starts: {exc}"
    return f"{where}: the unit points at commit-log offset {phy}, a record of {msg.topic} queue {msg.queue_id} " \
           f"offset {msg.queue_offset}: the consume queue is damaged (a writer's open or rebuild repairs it)"


@main.command("print-msg", epilog="""\b
Examples:
  rocketstore print-msg -t TopicTest
  rocketstore print-msg -t TopicTest -b 2026-11-21T09:00 -e 2026-11-21T09:05 --body -s 'TagA || TagB'
""")
@store_options
@click.option("-t", "--topic", type=TRIMMED, required=True, help="topic")
@click.option("-b", "--begin", help="begin time, inclusive (epoch ms or ISO-8601)")
@click.option("-e", "--end", help="end time, exclusive: messages stored before it (epoch ms or ISO-8601; as "
              "mqadmin's printMsg)")
@click.option("-s", "--sub-expression", type=TRIMMED, default="*", show_default=True, help="tags, e.g. 'TagA || TagB'")
@click.option("--sql", callback=lambda _ctx, _param, value: _sql_option(value),
              help="an SQL92 filter over the properties instead of tags, e.g. \"region = 'eu' AND amount > 100\"")
@click.option("--body", is_flag=True, help="print bodies")
@click.option("-d", "--print-body", "print_body", metavar="true|false",
              help="mqadmin's letter: 'true' prints bodies as --body does, anything else does not")
@click.option("-c", "--charset", callback=lambda _ctx, _param, value: _charset_option(value), metavar="NAME",
              help="read bodies in this charset, e.g. GBK (default: UTF-8, and base64 for a body that is not UTF-8)")
@json_option
@fails_cleanly
def print_msg(topic, begin, end, sub_expression, sql, body, print_body, charset, as_json, **kwargs) -> None:
    """Every message of a topic, queue by queue, optionally in a time window (like mqadmin printMsg)."""
    from ..reads import parse_tags
    from ..sqlfilter import select_rows

    if print_body is not None:
        body = body or print_body.strip().lower() == "true"
    if sql is not None and sub_expression not in ("", "*"):
        raise click.UsageError("filter by tags (-s) or by --sql, not both")
    start, stop = parse_time(begin, "--begin"), parse_time(end, "--end")
    parse_tags(sub_expression)  # a refused subscription ('||') before any output, not after a queue's header
    with read_only_store(_store_args(kwargs)) as store:
        store.queues.check_managed(topic)  # a broker's LMQ/BatchCQ topic: said, not "no consume queues"
        queue_ids = store.queue_ids(topic)
        if not queue_ids:
            raise Failure(f"topic {topic} has no consume queues in this store")
        for queue_id in queue_ids:
            low = store.get_min_offset_in_queue(topic, queue_id)
            high = store.get_max_offset_in_queue(topic, queue_id)
            if start is not None:
                low = store.get_offset_in_queue_by_time(topic, queue_id, start)
            if stop is not None:
                high = store.get_offset_in_queue_by_time(topic, queue_id, stop)
            if not as_json:
                click.echo(f"minOffset={low}, maxOffset={high}, MessageQueue [topic={topic}, queueId={queue_id}]")
            read_body = body or not as_json  # the text form shows the body's length
            for read in store.queue_arrow(topic, queue_id, low, high, sub_expression, include_body=read_body):
                batch = read if sql is None else select_rows(read, sql)
                if not batch.num_rows:
                    continue
                if as_json:
                    rows = arrow_message_rows(batch) if body else arrow_messages(batch)
                    if not body:  # not read: absent, not null (null is an empty body)
                        for row in rows:
                            del row["body"]
                    click.echo("\n".join(json.dumps(row, ensure_ascii=False) for row in rows))
                else:
                    click.echo("\n".join(java_message_lines(batch, body=body, charset=charset)))
            if not as_json:
                click.echo("-" * 56)


def _charset_option(value: str | None) -> str | None:
    """-c: a charset Python reads (Java's names GBK, UTF-8, ISO-8859-1 are Python's too); an unknown one is a usage
    error (mqadmin prints nothing for it)."""
    if value is None:
        return None
    import codecs

    try:
        return codecs.lookup(value.strip()).name
    except LookupError:
        raise click.BadParameter(f"unknown charset {value.strip()!r}", param_hint="-c/--charset") from None


def _sql_option(value: str | None):
    """--sql compiled once; one that does not parse is a usage error naming where."""
    if value is None:
        return None
    from ..sqlfilter import InvalidFilterError, compile_sql92

    try:
        return compile_sql92(value)
    except InvalidFilterError as exc:
        raise click.BadParameter(str(exc), param_hint="--sql") from None


# --- files -----------------------------------------------------------------------------------------

@main.command("dump-log", epilog="""\b
Examples:
  rocketstore dump-log ~/store/commitlog/00000000000000000000
  rocketstore dump-log ~/store/commitlog --from 1073741824 --check-crc --json
""")
@click.argument("path", type=click.Path(exists=True))
@click.option("--from", "from_offset", type=click.IntRange(min=0), default=None,
              help="start at this commit-log offset (the first record at or after it)")
@click.option("--check-crc", is_flag=True, help="verify body CRCs")
@click.option("--decompress", is_flag=True, help="inflate compressed bodies")
@json_option
@fails_cleanly
def dump_log(path, from_offset, check_crc, decompress, as_json) -> None:
    """Decode a commit-log segment file or directory record by record, blanks and where decoding stops."""
    from .dump import dump_records

    stopped = False
    for event in dump_records(Path(path), from_offset, check_crc=check_crc, decompress=decompress):
        kind, pos = event["kind"], event["pos"]
        if kind == "record":
            if as_json:
                emit_json(dump_json(event["message"], pos))
            else:
                msg = event["message"]
                click.echo(f"{pos:>14} {msg.store_size:>7} {msg.topic} q={msg.queue_id} qo={msg.queue_offset} "
                           f"store={human_time(msg.store_timestamp)} keys={msg.keys} msgId={msg.msg_id}")
        elif kind == "blank":
            if as_json:
                emit_json({"pos": pos, "end": "blank", "storeSize": event["size"]})
            else:
                click.echo(f"{pos:>14} {event['size']:>7} BLANK (end of segment {event['segment']})")
        else:
            stopped = kind == "error"
            if as_json:
                emit_json({"pos": pos, "end": "decode-returned-null" if stopped else "end-of-data",
                           **({"reason": event["reason"]} if stopped else {})})
            else:
                label = f"STOP: {event['reason']}" if stopped else "end of data (zero bytes follow)"
                click.echo(f"{pos:>14} {'':>7} {label}")
    if stopped:  # decoding stopped at bytes that are no record (damage, or not a log): a script must not read "ok"
        raise Failure(f"decoding stopped at offset {pos}: bytes there are no record that decodes")


@main.command(epilog="""\b
Examples:
  rocketstore inspect --store /data/broker-a/store
""")
@store_options
@json_option
@fails_cleanly
def inspect(as_json, **kwargs) -> None:
    """The store at a glance: segments, topics and queues, index files, checkpoint, abort and lock state."""
    from .inspect import inspect_store

    root, config = config_for(**_store_args(kwargs))
    info = inspect_store(root, config)
    if as_json:
        click.echo(json.dumps(info, indent=2, ensure_ascii=False))
        return
    click.echo(f"store {info['root']}: {info['state']}")
    recovery = info["recovery"]
    if recovery["resumesAt"] is not None:
        click.echo(f"commit log DAMAGED at offset {recovery['endOffset']} ({recovery['stopReason']}): "
                   f"{recovery['bytesAfterEnd']} bytes after it, with intact records from offset "
                   f"{recovery['resumesAt']} on, are left out below and of every answer (rocketstore verify shows "
                   "the damage; a writing command refuses the store unless --allow-damage, which cuts them off)")
    elif recovery["stopReason"]:
        click.echo(f"commit log ends at offset {recovery['endOffset']} in {recovery['bytesAfterEnd']} bytes that "
                   f"are no record ({recovery['stopReason']}): a torn tail, which a writer's open cuts")
    unfinished = info["unfinishedImport"]
    if unfinished is not None:
        click.echo(unfinished.get("error") or f"unfinished import of {unfinished['source']}: "
                   f"{unfinished['rowsStored']} rows stored (the same import run again finishes it)")
    _table("commit log", ["segment", "start", "end", "first store time"],
           [[s["name"], s["start"], s["end"], s["firstStoreTime"]] for s in info["segments"]])
    _table("consume queues", ["topic", "queue", "min", "max", "earliest", "latest"],
           [[q["topic"], q["queueId"], q["minOffset"], q["maxOffset"], q["earliest"], q["latest"]]
            for q in info["queues"]])
    _table("index files", ["file", "entries", "slots used", "begin time", "end time", "begin phy", "end phy"],
           [[i["name"], i["indexCount"] - 1, i["hashSlotCount"], i["beginTimestamp"], i["endTimestamp"],
             i["beginPhyOffset"], i["endPhyOffset"]] for i in info["index"]])
    cp = info["checkpoint"]
    click.echo(f"checkpoint: physic {cp['physicMsgTimestamp']}, logics {cp['logicsMsgTimestamp']}, index "
               f"{cp['indexMsgTimestamp']}, confirm offset {cp['confirmPhyOffset']}"
               + ("" if cp["trusted"] else " (damaged: not trusted)"))


@main.command(epilog="""\b
Exit code 0 only when nothing is wrong. A store locked by a running writer is
checked as a snapshot: up to the end of its log when verify starts.
Examples:
  rocketstore verify --store /data/broker-a/store
  rocketstore verify --json | jq .
""")
@store_options
@json_option
@fails_cleanly
def verify(as_json, **kwargs) -> None:
    """Full scan: CRCs of every record, consume queues and index entries against the commit log."""
    from ..verify import verify_store

    root, config = config_for(**_store_args(kwargs))
    with progress_bar("verify") as progress:
        report = verify_store(root, config, progress=progress)
    try:
        for problem in report.problems:
            if as_json:
                emit_json(problem.as_dict())
            else:
                click.echo(str(problem))
        if report.live:
            click.echo(f"store is live (locked by a writer): checked the snapshot up to commit-log offset "
                       f"{report.snapshot_end}", err=as_json)
        if report.unclean:
            lag = (f": {report.not_dispatched} record(s) at the log's end are not in their queues yet and "
                   f"{report.not_indexed} not indexed, which a writer's next open dispatches (as a broker's restart "
                   "does)" if report.not_dispatched or report.not_indexed else "")
            if report.unfinished_bytes:
                lag += (f"{';' if lag else ':'} {report.unfinished_bytes} bytes after the log's end are an append "
                        "the writer did not finish, which a writer's next open zeroes (kept in recovery/)")
            click.echo(f"store was not closed (abort file, no writer){lag}", err=as_json)
        if report.pending_swap:
            click.echo(f"a rebuild stopped while swapping its new consume queues and index in ({report.pending_swap}):"
                       " a writer's next open (or rebuild) finishes the swap; the queues and index checked here are "
                       "what is in place until then", err=as_json)
        for note in report.not_checked:
            click.echo(f"not checked: {note}", err=as_json)
        shown = "" if len(report.problems) == report.problem_count else f" (the first {len(report.problems)} listed)"
        summary = (f"checked {report.records} records, {report.queue_units} queue units, {report.index_entries} "
                   f"index entries: {report.problem_count} problem(s){shown}")
        click.echo(summary, err=as_json)
    except BrokenPipeError:  # `verify | head -1`: the exit status still says whether the store is sound
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if not report.clean:
        sys.exit(1)


# --- topics and consumer groups ------------------------------------------------------------------------

@main.group(epilog="""\b
Examples:
  rocketstore topic list
  rocketstore topic create -t OrderPaid -w 8
  rocketstore topic delete -t OrderPaid
""")
def topic() -> None:
    """Topics in config/topics.json (like mqadmin topicList / updateTopic / deleteTopic)."""


@topic.command("list", epilog="Example:\n  rocketstore topic list --json")
@store_options
@json_option
@fails_cleanly
def topic_list(as_json, **kwargs) -> None:
    """Configured topics with queue counts, plus topics that only have consume queues."""
    from ..brokerconfig import TopicConfigManager

    with read_only_store(_store_args(kwargs), (TopicConfigManager,)) as store:
        names = sorted(set(store.topic_config.topics) | set(store.topics()))
        rows = []
        for name in names:
            cfg = store.topic_config.get(name)
            # None for a broker's LMQ/BatchCQ topic (or queues in RocksDB): not read here, so not 0
            messages = None if store.queues.unmanaged(name) else sum(
                store.get_max_offset_in_queue(name, q) - store.get_min_offset_in_queue(name, q)
                for q in store.queue_ids(name))
            rows.append({"topic": name, "writeQueueNums": cfg.write_queue_nums if cfg else None,
                         "readQueueNums": cfg.read_queue_nums if cfg else None, "perm": cfg.perm if cfg else None,
                         "messages": messages})
    if as_json:
        for row in rows:
            emit_json(row)
    else:
        _table("topics", ["topic", "write queues", "read queues", "perm", "messages"],
               [[r["topic"], *("-" if r[k] is None else r[k] for k in ("writeQueueNums", "readQueueNums", "perm",
                                                                        "messages"))] for r in rows])


@topic.command("create", epilog="Example:\n  rocketstore topic create -t OrderPaid -w 8")
@store_options
@click.option("-t", "--topic", "name", type=TRIMMED, required=True, help="topic")
@click.option("-w", "--write-queues", type=click.IntRange(1, 1024), default=8, show_default=True)
@click.option("-r", "--read-queues", type=click.IntRange(1, 1024), default=None, help="default: as many as -w")
@fails_cleanly
def topic_create(name, write_queues, read_queues, **kwargs) -> None:
    """Create or update a topic."""
    root, config = config_for(**_store_args(kwargs), must_exist=False)
    with writer_store(root, config) as store, config_change("topics.json"):
        store.create_topic(name, write_queues, read_queues=read_queues)
        click.echo(f"create topic {name}: {write_queues} write queues, {read_queues or write_queues} read queues")


@topic.command("delete", epilog="Example:\n  rocketstore topic delete -t OrderPaid")
@store_options
@click.option("-t", "--topic", "name", type=TRIMMED, required=True, help="topic")
@fails_cleanly
def topic_delete(name, **kwargs) -> None:
    """Remove a topic from config/topics.json (its messages stay until retention removes them)."""
    root, config = config_for(**_store_args(kwargs))
    with writer_store(root, config) as store, config_change("topics.json"):
        if not store.delete_topic(name):
            raise Failure(f"topic {name} is not configured")
        click.echo(f"delete topic {name}")


@main.command("consumer-progress", epilog="""\b
Examples:
  rocketstore consumer-progress
  rocketstore consumer-progress -g please_rename_unique_group_name_4 --json
""")
@store_options
@click.option("-g", "--group", type=TRIMMED, help="consumer group (default: every group with committed offsets)")
@json_option
@fails_cleanly
def consumer_progress(group, as_json, **kwargs) -> None:
    """Committed offsets and lag per queue (like mqadmin consumerProgress)."""
    from ..brokerconfig import ConsumerOffsetManager, TopicConfigManager

    with read_only_store(_store_args(kwargs), (ConsumerOffsetManager, TopicConfigManager)) as store:
        pairs = [(t, g) for t, g in store.consumer_offsets.groups() if group is None or g == group]
        if group is not None and not pairs:
            raise Failure(f"consumer group {group} has no committed offsets in this store")
        if store.queues.rocksdb:  # no queue is read: no lag to show, and no empty table for it
            raise Failure(ROCKSDB_QUEUES)
        rows = []
        for topic_name, group_name in pairs:
            reason = store.queues.unmanaged(topic_name)
            if reason is not None:  # a broker's LMQ or BatchCQ queue: said, not shown as a lag of 0
                click.echo(f"{group_name}: not shown: {reason}", err=True)
                continue
            config = store.topic_config.get(topic_name)
            if config is None:  # the broker's getConsumeStats skips a topic it has no config for
                click.echo(f"{group_name}: {topic_name} not shown: the topic is not in topics.json", err=True)
                continue
            committed = store.consumer_offsets.offsets(group_name, topic_name)
            for queue_id in range(config.read_queue_nums):  # as getConsumeStats: each read queue of the topic
                # a queue the group never committed counts from 0, and so does a negative offset a broker stored
                # (getConsumeStats: consumerOffset < 0 -> 0); the diff is not clamped: a negative one is an offset
                # past the queue's end
                offset = max(0, committed.get(queue_id, 0))
                broker = max(0, store.get_max_offset_in_queue(topic_name, queue_id))
                unit = store.queues.get(topic_name, queue_id)
                last = unit.get_unit(offset - 1) if unit is not None and 0 < offset <= broker else None
                rows.append({"group": group_name, "topic": topic_name, "queueId": queue_id, "brokerOffset": broker,
                             "consumerOffset": offset, "diff": broker - offset,
                             "lastTimestamp": store.commit_log.store_time(last[0], last[1]) if last else -1})
    if as_json:
        for row in rows:
            emit_json(row)
        return
    # mqadmin's consumerProgress prints the last time as yyyy-MM-dd HH:mm:ss (UtilAll.YYYY_MM_DD_HH_MM_SS): no ms
    _table("consumer progress", ["#Group", "#Topic", "#QID", "#Broker Offset", "#Consumer Offset", "#Diff",
                                 "#LastTime"],
           [[r["group"], r["topic"], r["queueId"], r["brokerOffset"], r["consumerOffset"], r["diff"],
             human_time(r["lastTimestamp"])[:19] if r["lastTimestamp"] > 0 else "N/A"] for r in rows])
    click.echo(f"Diff Total: {sum(r['diff'] for r in rows)}")


@main.command("reset-offset", epilog="""\b
Examples:
  rocketstore reset-offset -g my_group -t TopicTest -s 2026-11-21T09:00
  rocketstore reset-offset -g my_group -t TopicTest -s earliest
""")
@store_options
@click.option("-g", "--group", type=TRIMMED, required=True, help="consumer group")
@click.option("-t", "--topic", "topic_name", type=TRIMMED, required=True, help="topic")
@click.option("-s", "--timestamp", required=True, help="epoch ms, ISO-8601, 'now', 'earliest' or 'latest' (or -1, "
              "as the broker takes it)")
@fails_cleanly
def reset_offset(group, topic_name, timestamp, **kwargs) -> None:
    """Point a consumer group at a time in every queue (like mqadmin resetOffsetByTime)."""
    if timestamp == "now":  # as mqadmin's resetOffsetByTime
        timestamp = str(time.time_ns() // 1_000_000)
    elif timestamp == "-1":  # the broker's resetOffset: each queue's max offset
        timestamp = "latest"
    target = timestamp if timestamp in ("earliest", "latest") else parse_time(timestamp, "--timestamp")
    root, config = config_for(**_store_args(kwargs))
    with writer_store(root, config) as store:
        if not store.queue_ids(topic_name) and store.topic_config.get(topic_name) is None:
            raise Failure(f"topic {topic_name} does not exist in this store")
        with config_change("consumerOffset.json"):
            offsets = store.reset_offset(group, topic_name, target)
        click.echo(f"{'#QID':<6}{'#Offset':>12}")
        for queue_id, offset in offsets.items():
            click.echo(f"{queue_id:<6}{offset:>12}")


# --- Spark jobs and stats ---------------------------------------------------------------------------

def master_option(command):
    """--master and what a cluster run needs: --ship-env, --verbose."""
    command = click.option("-v", "--verbose", is_flag=True, help="show Spark's warnings and executors' stack "
                           "traces")(command)
    command = click.option("--ship-env", is_flag=True, help="ship this virtual environment to the executors "
                           "(a zip sent with spark.archives): workers then need only Java and the same Python")(command)
    return click.option("--master", default="local[*]", show_default=True,
                        help="Spark master URL, e.g. spark://host:7077")(command)


def _spark(master: str, ship_env: bool, verbose: bool):
    from ..spark.session import is_local, spark_session, stop_quietly, warn_while_starved

    spark = spark_session(master, ship_env=ship_env, verbose=verbose)
    atexit.register(stop_quietly, spark)  # no daemon traceback under the one-line error
    if not is_local(master):
        warn_while_starved(spark, master)
    return spark


@main.command(epilog="""\b
Examples:
  rocketstore rebuild --store /data/broker-a/store
  rocketstore rebuild --no-spark --store /data/broker-a/store
  rocketstore rebuild --master spark://host:7077 --store /shared/broker-a/store
""")
@store_options
@master_option
@click.option("--no-spark", is_flag=True, help="decode the log in this process instead (no JVM; on one machine "
              "the fastest way)")
@fails_cleanly
def rebuild(master, ship_env, verbose, no_spark, **kwargs) -> None:
    """Rebuild consume queues and index files from the commit log (Spark; --no-spark: in this process)."""
    root, config = config_for(**_store_args(kwargs))  # final: what is named, else what the files say
    if no_spark:
        if ship_env or master != "local[*]":
            raise click.UsageError("--no-spark runs no Spark job: leave out --master and --ship-env")
        from ..rebuild import rebuild as run_here

        with progress_bar("rebuild") as progress:
            report = run_here(root, config=config, progress=progress, explicit=GEOMETRY)
        where = f"{report.partitions} range{'s' * (report.partitions != 1)} in this process"
    else:
        from ..lifecycle import StoreLock
        from ..spark.jobs import rebuild as run

        probe = StoreLock(root)  # a store another process writes is refused before a JVM starts (~10 s)
        probe.acquire()
        probe.release()
        spark = _spark(master, ship_env, verbose)
        with progress_bar("rebuild") as progress:
            report = run(root, spark=spark, config=config, progress=progress, explicit=GEOMETRY)
        where = f"{report.partitions} partitions in {report.windows} window{'s' * (report.windows != 1)}"
    click.echo(f"rebuilt {report.queue_units} queue units in {report.queues} queues and {report.index_keys} index "
               f"keys in {report.index_files} index files from {report.records} records ({where}, "
               f"{report.seconds:.1f} s); the old files are in {', '.join(report.moved_aside) or '-'}")


@main.command(epilog="""\b
Examples:
  rocketstore export --out /tmp/messages -t TopicTest -b 2026-11-21T00:00
""")
@store_options
@master_option
@click.option("--out", required=True, type=click.Path(file_okay=False), help="output directory (Parquet)")
@click.option("-t", "--topic", "topics", type=TRIMMED, multiple=True,
              help="a topic to export (repeatable; default all)")
@click.option("-b", "--begin", help="begin time, inclusive (epoch ms or ISO-8601)")
@click.option("-e", "--end", help="end time, exclusive (epoch ms or ISO-8601)")
@click.option("--overwrite", is_flag=True, help="replace what --out holds (only once the new export is complete); "
              "without it a non-empty --out is refused")
@fails_cleanly
def export(master, ship_env, verbose, out, topics, begin, end, overwrite, **kwargs) -> None:
    """Export messages to Parquet, partitioned by topic and date (Spark)."""
    from ..spark.jobs import export_parquet

    root, config = config_for(**_store_args(kwargs))
    start, stop = parse_time(begin, "--begin"), parse_time(end, "--end")
    if not overwrite and os.path.isdir(out) and any(os.scandir(out)):  # before a JVM starts
        raise Failure(f"{out} is not empty: pass --overwrite to replace what it holds")
    spark = _spark(master, ship_env, verbose)
    with progress_bar("export") as progress:
        count = export_parquet(root, out, spark=spark, topics=list(topics) or None, begin=start, end=stop,
                               overwrite=overwrite, progress=progress,
                               mappedFileSizeCommitLog=config.mapped_file_size_commit_log,
                               # --allow-damage: the scan reads up to the damage and says what it leaves out
                               onCorrupt="skip" if config.cut_damaged_log else "fail")
    click.echo(f"exported {count} messages to {out}")


@main.command("import", epilog="""\b
Examples:
  rocketstore import --store /tmp/replay --parquet /tmp/messages
  rocketstore import --store /tmp/replay --parquet /tmp/messages --no-spark
  rocketstore import --store /data/dev/store --parquet hdfs:///exports/orders --master spark://host:7077
""")
@store_options
@master_option
@click.option("--parquet", required=True, help="a Parquet dataset: topic and body columns; keys, tags, "
              "properties, queueId, flag, bornTimestamp and bornHost when present (what export writes); its files "
              "are stored in name order")
@click.option("--from-row", type=click.IntRange(0), default=None,
              help="store the rows from this one on (default: 0, or where an unfinished import of the same dataset "
              "stopped)")
@click.option("--no-spark", is_flag=True, help="read the dataset in this process instead (no JVM; for a dataset "
              "on this machine the fastest way)")
@click.option("--skip-system-topics", is_flag=True, help="pass over rows of the broker's own queues "
              "(SCHEDULE_TOPIC_XXXX, rmq_sys_wheel_timer, RMQ_SYS_TRANS_*: a whole-store export holds them) instead "
              "of refusing the import; delayed messages still waiting there are not carried over, and row numbers "
              "(errors, --from-row) count the other rows only")
@fails_cleanly
def import_command(master, ship_env, verbose, parquet, from_row, no_spark, skip_system_topics, **kwargs) -> None:
    """Append a Parquet dataset of messages to a store (created if missing), each row exactly once (Spark;
    --no-spark: in this process)."""
    root, config = config_for(**_store_args(kwargs), must_exist=False)
    try:
        report = _import(root, config, master, ship_env, verbose, parquet, from_row, no_spark, skip_system_topics)
    except StoredButNotClosedError as exc:  # its rows are stored and its journal says so: exit 3, not 1
        _say_imported(exc.done, root)
        raise ChangedButNotClosed(f"{exc}. Do not run the import again (it would say nothing imported); the store's "
                                  "next open recovers") from None
    _say_imported(report, root)


def _import(root: Path, config: StoreConfig, master, ship_env, verbose, parquet: str, from_row: int | None,
            no_spark: bool, skip_system: bool):
    if no_spark:
        if ship_env or master != "local[*]":
            raise click.UsageError("--no-spark runs no Spark job: leave out --master and --ship-env")
        if "://" in parquet:
            raise click.UsageError("--no-spark reads a dataset on this machine: a URL needs Spark")
        from ..importing import import_parquet

        with progress_bar("import") as progress:
            return import_parquet(parquet, root, config=config, progress=progress, explicit=GEOMETRY,
                                  skip_rows=from_row, skip_system=skip_system)
    from ..spark.jobs import import_messages, read_parquet

    source = parquet if "://" in parquet else os.path.abspath(parquet)  # the JVM's working directory differs
    if "://" not in parquet and not os.path.exists(source):
        raise Failure(f"{parquet} does not exist")
    spark = _spark(master, ship_env, verbose)
    with progress_bar("import") as progress:
        return import_messages(read_parquet(spark, source), root, config=config, progress=progress,
                               explicit=GEOMETRY, skip_rows=from_row, skip_system=skip_system)


def _say_imported(report, root: Path) -> None:
    if report.system_rows:
        skipped = ", ".join(f"{topic} {n}" for topic, n in sorted(report.system_rows.items()))
        click.echo(f"passed over {sum(report.system_rows.values())} rows of the broker's own queues ({skipped})",
                   err=True)
    if report.already_imported:
        click.echo(f"nothing imported: this import finished before, its {report.skipped} rows are in {root} "
                   "(--from-row 0 stores them again)")
        return
    click.echo(f"imported {report.rows} messages in {report.batches} batches into {root}"
               + (f" (rows {report.skipped} on)" if report.skipped else ""))


@main.command("find-keys", epilog="""\b
Examples:
  rocketstore find-keys --store /data/broker-a/store --store /data/broker-b/store -k TopicTest:order-1
  rocketstore find-keys --store '/shared/broker-*/store' -k TopicTest:order-1 -k TopicTest:order-2
  rocketstore find-keys --store /shared/a/store --keys-file orders.txt --master spark://host:7077 --json
""")
@click.option("--store", "stores", multiple=True, required=True, help="a store root or a glob (repeatable)")
@click.option("--broker-conf", type=click.Path(dir_okay=False, exists=True),
              help="read settings (maxHashSlotNum, ...) from a broker.conf, for every store")
@click.option("--max-hash-slot-num", type=click.IntRange(1, 100_000_000), default=None,
              help="the brokers' maxHashSlotNum (default: from the index files' size)")
@click.option("--max-index-num", type=click.IntRange(2, 100_000_000), default=None,
              help="the brokers' maxIndexNum (default: from the index files' size)")
@master_option
@click.option("-k", "--key", "pairs", multiple=True, metavar="TOPIC:KEY", help="a topic and key (repeatable)")
@click.option("--allow-damage", is_flag=True,
              help="answer from a store whose commit log is damaged with intact records after the damage (from the "
              "log up to it); without it such a store is refused (rocketstore verify shows the damage)")
@click.option("--keys-file", type=click.File("r", encoding="utf-8"),
              help="many TOPIC:KEY lines ('-': stdin)")
@key_window_options("most messages per key and store")
@json_option
@fails_cleanly
def find_keys_command(stores, broker_conf, max_hash_slot_num, max_index_num, master, ship_env, verbose, pairs,
                      allow_damage, keys_file, begin, end, max_num, as_json) -> None:
    """Messages by key across many stores, matched exactly, through their indexes (Spark).

    Index geometry comes from the files' size when it follows RocketMQ's 4 entries per slot; a broker with other
    settings names them with --broker-conf or the flags (they apply to every store)."""
    from ..spark.jobs import find_keys
    from ..spark.partitions import resolve_roots

    lines = [*pairs, *(line.strip() for line in (_lines(keys_file) if keys_file else ()) if line.strip())]
    if not lines:
        raise click.UsageError("give -k/--key TOPIC:KEY or --keys-file")
    queries = []
    for line in lines:
        topic, sep, key = line.partition(":")
        if not sep or not topic or not key:
            raise click.BadParameter(f"a key is TOPIC:KEY, not {line!r}", param_hint="-k/--key")
        queries.append((topic, key))
    roots = [str(root) for root in resolve_roots(list(stores))]  # globs too; a missing store fails before Spark
    start, stop = parse_time(begin, "--begin") or 0, parse_time(end, "--end")
    values = broker_conf_values(broker_conf) if broker_conf else {}
    values.update((k, v) for k, v in (("max_hash_slot_num", max_hash_slot_num), ("max_index_num", max_index_num))
                  if v is not None)
    config = StoreConfig(**values)  # type: ignore[arg-type]  # a setting it names is kept over the files' sizes
    if not allow_damage:  # before a JVM starts: a damaged store is refused as query-by-key refuses it
        from ..spark.partitions import ScanOptions, check_log_ends

        check_log_ends(roots, ScanOptions())
    spark = _spark(master, ship_env, verbose)
    found = find_keys(roots, queries, spark=spark, begin=start, end=stop, max_num=max_num, config=config,
                      allow_damage=True) \
        .orderBy("queryTopic", "queryKey", "brokerName", "commitLogOffset").toArrow()
    _print_found(found, as_json, many_stores=True)


@main.command(epilog="""\b
Examples:
  rocketstore stats --store /data/broker-a/store --bucket hour --plot stats.png
""")
@store_options
@click.option("--bucket", type=click.Choice(["second", "minute", "hour", "day"]), default="minute",
              show_default=True, help="time bucket for messages over time")
@click.option("--plot", type=click.Path(dir_okay=False), help="also draw the figures into this PNG")
@json_option
@fails_cleanly
def stats(bucket, plot, as_json, **kwargs) -> None:
    """Messages per topic and over time; index fill ratio and slot chain-length histogram."""
    from ..stats import plot_stats, store_stats

    root, config = config_for(**_store_args(kwargs))
    result = store_stats(root, config, bucket)
    if as_json:
        emit_json({"messages": result.messages, "bytes": result.bytes, "perTopic": result.per_topic,
                   "bucket": bucket, "perBucket": {str(k): v for k, v in result.per_bucket.items()},
                   "index": [{"file": i.name, "entries": i.entries, "capacity": i.capacity,
                              "fillRatio": i.fill_ratio, "usedSlots": i.used_slots, "slots": i.slots,
                              "chainLengths": {str(k): v for k, v in i.chain_lengths.items()}}
                             for i in result.index_files]})
    else:
        click.echo(f"{result.messages} messages, {result.bytes} bytes")
        _table("messages per topic", ["topic", "messages"], [[t, n] for t, n in result.per_topic.items()])
        _table(f"messages per {bucket}", [bucket, "messages"],
               [[human_time(k)[: {"second": 19, "minute": 16, "hour": 13, "day": 10}[bucket]], v]
                for k, v in result.per_bucket.items()])
        _table("index files", ["file", "entries", "fill", "slots used", "longest chain", "chain length: slots"],
               [[i.name, i.entries, f"{i.fill_ratio:.2%}", f"{i.slot_ratio:.2%}", i.longest_chain,
                 " ".join(f"{k}:{v}" for k, v in sorted(i.chain_lengths.items())[:12])] for i in result.index_files])
    if plot:
        try:
            plot_stats(result, plot)
        except ImportError:
            raise Failure("--plot needs matplotlib: pip install 'rocketstore[plot]'") from None
        click.echo(f"wrote {plot}", err=as_json)


@main.command(epilog="""\b
Examples:
  rocketstore serve --store ~/store
  rocketstore serve --store ./dev-store --listen 0.0.0.0:8081 --no-auto-create-topics
Clients: an official RocketMQ 5 client with endpoints 127.0.0.1:8081 (no TLS).
""")
@store_options
@click.option("--listen", default="127.0.0.1:8081", show_default=True,
              help="HOST:PORT (port 0: any free port); routes advertise it (0.0.0.0: the address a client used)")
@click.option("--auto-create-topics/--no-auto-create-topics", default=True, show_default=True,
              help="create a topic on its first route query or send (else TOPIC_NOT_FOUND)")
@click.option("--max-attempts", type=click.IntRange(1, 1000), default=16, show_default=True,
              help="deliveries of a message before it goes to %DLQ%<group>")
@click.option("--sync-flush", is_flag=True, help="acknowledge a send only once it is on disk (SYNC_FLUSH)")
@click.option("--fifo-group", "fifo_groups", multiple=True, metavar="GROUP",
              help="consume in order: one message in flight per message group (consumeMessageOrderly; kept)")
@click.option("--access-key", default=None, help="require calls signed with this access key (ACL) ...")
@click.option("--secret-key", default=None, help="... and this secret key")
@click.option("--accounts-file", type=click.Path(dir_okay=False), default=None,
              help="require signed calls; one 'ACCESS_KEY SECRET_KEY' per line")
@click.option("--transaction-check-seconds", type=click.FloatRange(0.1, 86_400), default=6.0, show_default=True,
              help="ask the producer about a transaction left open this long (then every as long again)")
@click.option("--stats-interval", type=click.FloatRange(0.1, 86_400), default=None, callback=_finite,
              help="seconds between sends/s, receives/s, in-flight lines (default: 5 on a terminal, else off)")
@fails_cleanly
def serve(listen, auto_create_topics, max_attempts, sync_flush, fifo_groups, access_key, secret_key, accounts_file,
          transaction_check_seconds, stats_interval, **kwargs) -> None:
    """Speak RocketMQ 5's gRPC protocol over the store: official clients send to it and consume from it."""
    import faulthandler
    import signal
    import time

    from .. import MessageStore
    from ..config import FlushDiskType
    from ..server import Server
    from .signals import StopSignals

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    from ..server import Accounts

    if (access_key is None) != (secret_key is None):
        raise click.UsageError("--access-key and --secret-key go together")
    accounts = None
    if accounts_file is not None or access_key is not None:
        pairs = Accounts.from_file(accounts_file).secrets if accounts_file is not None else {}
        accounts = Accounts({**pairs, **({access_key: secret_key} if access_key is not None else {})})
    from ..server import parse_listen

    try:
        parse_listen(listen)  # before the store opens: a refused serve changes nothing
    except RocketStoreError as exc:
        raise click.BadParameter(str(exc), param_hint="--listen") from None
    root, config = config_for(**_store_args(kwargs), must_exist=False)
    if sync_flush:
        config = config.replace(flush_disk_type=FlushDiskType.SYNC_FLUSH)
    # A send is ~0.1 ms of Python; under the default 5 ms GIL switch interval a handler waiting behind the
    # dispatcher or a long poll could wait 5 ms (p99 5.3 -> 1.6 ms for one producer thread here).
    sys.setswitchinterval(0.0005)
    # `kill -USR1 <pid>` writes every thread's stack to stderr: what a serve that does not stop is waiting for
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # Before the store opens (and any thread starts): a signal during startup stops it cleanly too, never kills it
    # with the store open; the main thread takes SIGTERM/SIGINT whichever thread the kernel hands them to.
    with StopSignals() as signals, MessageStore.open(root, config) as store:
        if signals.wait(0) is None:
            for group in fifo_groups:
                store.subscription_groups.set_orderly(group, True)
            server = Server(store, listen, auto_create_topics=auto_create_topics, max_attempts=max_attempts,
                            transaction_check_ms=int(transaction_check_seconds * 1000), accounts=accounts).start()
            click.echo(f"rocketstore serve: listening on {server.address} (store {root})", err=True)
            interval = stats_interval if stats_interval is not None else (5.0 if sys.stderr.isatty() else None)
            metrics = server.service.metrics
            last = (time.monotonic(), metrics.sent, metrics.received)
            while signals.wait(interval or 3600) is None:
                if interval:
                    now, sent, received = time.monotonic(), metrics.sent, metrics.received
                    took = now - last[0]
                    click.echo(f"sends/s {(sent - last[1]) / took:,.0f}  receives/s "
                               f"{(received - last[2]) / took:,.0f}  in flight {server.service.pop.in_flight():,}"
                               f"  (sent {sent:,}, received {received:,}, acked {metrics.acked:,})", err=True)
                    last = (now, sent, received)
            click.echo(f"rocketstore serve: {signal.Signals(signals.received[0]).name}, finishing calls and "
                       "closing the store", err=True)
            # a second signal (the stop hangs) exits at once: the store's next open recovers as after a crash
            signals.exit_on_next("exiting now without closing the store")
            server.stop()  # every running call done with the store before it closes (flush, checkpoint, no abort)
        else:
            click.echo(f"rocketstore serve: {signal.Signals(signals.received[0]).name} while starting, closing "
                       "the store", err=True)
            signals.exit_on_next("exiting now without closing the store")
    click.echo("rocketstore serve: stopped, store closed", err=True)


@main.command(epilog="""\b
Examples:
  rocketstore demo
  rocketstore demo --store /tmp/demo --no-spark
""")
@click.option("--store", "store_dir", default="demo-store", show_default=True, help="where to build it")
@click.option("--messages", type=click.IntRange(1, 100_000_000), default=5000, show_default=True,
              help="how many messages")
@master_option
@click.option("--no-spark", is_flag=True, help="skip the Spark step")
@fails_cleanly
def demo(store_dir, messages, master, ship_env, verbose, no_spark) -> None:
    """The README's main job: build a demo store, read it back every way, run the Spark step."""
    from ..demo import run

    sys.exit(run(Path(store_dir), messages, None if no_spark else master, ship_env=ship_env, verbose=verbose))


if __name__ == "__main__":  # pragma: no cover
    main(prog_name=os.path.basename(sys.argv[0]))

"""The rocketstore command line on real stores: in this process through click's runner (the interpreter, numpy
and numba start once, not ~40 times), and as the installed entry point where a process matters (exit codes
and one-line errors without a traceback, a lock another process holds)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import traceback
from pathlib import Path

import click
import pytest

from rocketstore import Message, MessageStore, StoreConfig

CONFIG = StoreConfig(mapped_file_size_commit_log=16 << 10, mapped_file_size_consume_queue=20 * 100,
                     max_hash_slot_num=97, max_index_num=388)  # 388 = 4 x 97: geometry detectable from size
COMMANDS = ["put", "query-by-key", "query-by-id", "query-by-unique-key", "query-by-offset", "print-msg", "dump-log",
            "inspect", "verify", "rebuild", "export", "stats", "demo", "topic", "consumer-progress", "reset-offset",
            "import", "find-keys"]


def cli(*args: str, stdin: str | None = None, check: bool = True, process: bool = False
        ) -> subprocess.CompletedProcess:
    """``rocketstore ARGS``: in this process, or with ``process`` as a subprocess of the installed entry point.
    In this process an exception the command let out is added to stderr as the traceback a process prints."""
    if process:
        env = {**os.environ, "COLUMNS": "200"}
        done = subprocess.run([sys.executable, "-m", "rocketstore.cli.app", *args], capture_output=True, text=True,
                              input=stdin, timeout=300, env=env, check=False)
    else:
        from click.testing import CliRunner

        from rocketstore.cli.app import main

        result = CliRunner().invoke(main, list(args), input=stdin, env={"COLUMNS": "200"}, terminal_width=200)
        stderr = result.stderr
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            stderr += "".join(traceback.format_exception(result.exception))
        done = subprocess.CompletedProcess(list(args), result.exit_code, result.stdout, stderr)
    if check:
        assert done.returncode == 0, done.stderr
    return done


def tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> tuple[Path, list]:
    root = tmp_path_factory.mktemp("cli") / "store"
    with MessageStore.open(root, CONFIG) as s:
        results = [s.put_message(Message(f"Topic{i % 2}", f"message {i}".encode(), tags=f"Tag{i % 3}",
                                         keys=[f"order-{i}", "shared"], queue_id=i % 3)) for i in range(120)]
        results.append(s.put_message(Message("TopicA", b"aa", keys=["Aa"])))
        results.append(s.put_message(Message("TopicA", b"bb", keys=["BB"])))
        s.wait_for_dispatch()
    return root, results


def test_every_command_has_help_with_examples():
    from click.testing import CliRunner

    from rocketstore.cli.app import main

    top = cli("--help", process=True).stdout  # the installed entry point once; each command's help in this process
    for command in COMMANDS:
        assert command in top
        text = CliRunner().invoke(main, [command, "--help"], terminal_width=200).output
        assert "Examples" in text or "Example" in text, command
        assert "--store" in text or command in ("dump-log", "topic"), command
        if command in ("rebuild", "export", "import", "find-keys"):
            assert "--master" in text, command



def test_help_and_usage_errors_answer_without_loading_the_store():
    """``--help``, a command's ``-h`` and a usage error took 0.9 s, importing numpy, pyarrow and numba for nothing."""
    script = """if True:
        import sys
        from rocketstore.cli.app import main
        for args in (["--help"], ["put", "-h"], ["query-by-key", "--bogus"], ["print-msg", "-h"]):
            try:
                main(args, standalone_mode=True)
            except SystemExit as exc:
                assert exc.code in (0, 2), (args, exc.code)
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("numpy", "pyarrow", "numba", "pyspark")
                       or m in ("rocketstore.store", "rocketstore.reads", "rocketstore.encoder"))
        print("heavy:", heavy, file=sys.stderr)
        assert not heavy, heavy
    """
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr

def test_query_by_key_table_and_json_match_the_library(store):
    root, results = store
    before = tree(root)
    table = cli("query-by-key", "--store", str(root), "-t", "Topic1", "-k", "order-7").stdout.splitlines()
    assert table[0].split() == ["#Message", "ID", "#QID", "#Offset"]
    assert table[1].split() == [results[7].uniq_key, "1", str(results[7].queue_offset)]
    lines = cli("query-by-key", "--store", str(root), "-t", "TopicA", "-k", "Aa", "--json").stdout.splitlines()
    assert [json.loads(x)["body"] for x in lines] == ["YWE="], "exact: BB collides with Aa but is not returned"
    shared = [json.loads(x) for x in cli("query-by-key", "--store", str(root), "-t", "Topic0", "-k", "shared", "-m",
                                         "5", "--json").stdout.splitlines()]
    with MessageStore.open(root, CONFIG, read_only=True) as s:
        expected = s.query_message("Topic0", "shared", 5)
    assert [m["msgId"] for m in shared] == [m.msg_id for m in expected]
    assert shared[0]["properties"] == expected[0].properties and shared[0]["storeSize"] == expected[0].store_size
    assert set(shared[0]) >= {"msgId", "topic", "queueId", "queueOffset", "commitLogOffset", "bornTimestamp",
                              "storeTimestamp", "bornHost", "storeHost", "sysFlag", "flag", "reconsumeTimes",
                              "preparedTransactionOffset", "bodyCRC", "storeSize", "properties", "body"}
    window = cli("query-by-key", "--store", str(root), "-t", "Topic0", "-k", "shared", "-b",
                 str(results[-1].store_timestamp + 1), "--json", check=False)
    assert window.stdout == "" and window.returncode == 1  # nothing found: exit 1, as query-by-id
    for form in (["-k", "no-such-key"], ["--keys-file", "-"]):  # and no table header before it, as mqadmin's
        none = cli("query-by-key", "--store", str(root), "-t", "Topic0", *form, stdin="no-such-key\n", check=False)
        assert none.returncode == 1 and none.stdout == "" and "no message of topic" in none.stderr, form
    assert tree(root) == before


def test_query_by_id_offset_and_unique_key_print_mqadmin_blocks(store):
    root, results = store
    before = tree(root)
    r = results[10]
    block = cli("query-by-id", "--store", str(root), "-i", f"{r.msg_id},{results[11].msg_id}").stdout
    first = block.split("\n\n")[0]
    fields = dict(line.split(None, 1) for line in first.splitlines() if line.startswith(("OffsetID:", "Topic:")))
    assert fields["OffsetID:"].strip() == r.msg_id and fields["Topic:"].strip() == "Topic0"
    assert block.count("OffsetID:") == 2 and "Queue Offset:" in block and "Properties:" in block
    by_offset = json.loads(cli("query-by-offset", "--store", str(root), "-t", "Topic0", "-q", "1", "-o", "1",
                               "--json").stdout)
    with MessageStore.open(root, CONFIG, read_only=True) as s:
        assert by_offset == _library_json(s.get_message("Topic0", 1, 1, 1).messages[0])
    uniq = cli("query-by-unique-key", "--store", str(root), "-i", r.uniq_key, "--body").stdout
    assert r.msg_id in uniq and "message 10" in uniq
    assert r.msg_id in cli("query-by-unique-key", "--store", str(root), "-i", r.uniq_key, "-t", "Topic0").stdout
    assert tree(root) == before


def test_query_by_unique_key_matches_a_users_key_as_given(store, tmp_path):
    """The key was upper-cased before the lookup, so a UNIQ_KEY a producer set with lower-case letters was never
    found; a hex msgId typed in lower case is still found."""
    root = tmp_path / "s"
    with MessageStore.open(root, CONFIG) as s:
        s.put_message(Message("TopicU", b"users", properties={"UNIQ_KEY": "order-abc"}))
        s.put_message(Message("TopicU", b"upper", properties={"UNIQ_KEY": "ORDER-ABC"}))
    found = cli("query-by-unique-key", "--store", str(root), "-i", "order-abc", "--body").stdout
    assert "users" in found and "upper" not in found
    assert "upper" in cli("query-by-unique-key", "--store", str(root), "-i", "ORDER-ABC", "--body").stdout
    fixture_root, results = store
    hex_id = results[10].uniq_key
    assert hex_id in cli("query-by-unique-key", "--store", str(fixture_root), "-i", hex_id.lower()).stdout


def _library_json(msg) -> dict:
    from rocketstore.cli.render import message_json

    return json.loads(json.dumps(message_json(msg)))


def test_option_values_are_trimmed_as_mqadmin_trims_them(store):
    """mqadmin trims every option value (``getOptionValue(..).trim()``): a pasted ``-k 'order-5 '`` found nothing
    here and ``-s ' * '`` printed no message (the literal tag "*"); the semantics review."""
    root, results = store
    found = cli("query-by-key", "--store", str(root), "-t", " Topic1 ", "-k", "order-5 ", "--json").stdout
    assert [json.loads(line)["msgId"] for line in found.splitlines()] == [results[5].msg_id]
    rows = cli("print-msg", "--store", str(root), "-t", "Topic1", "-s", " * ", "--json").stdout.splitlines()
    assert len(rows) == 60
    rows = cli("print-msg", "--store", str(root), "-t", "Topic1", "-s", " Tag0 || Tag1 ", "--json").stdout
    assert len(rows.splitlines()) == sum(1 for i in range(120) if i % 2 == 1 and i % 3 != 2)
    found = cli("query-by-id", "--store", str(root), "-i", f" {results[7].msg_id} ", "-t", "Topic1 ", "--json").stdout
    assert [json.loads(line)["msgId"] for line in found.splitlines()] == [results[7].msg_id]


def test_print_msg_walks_every_queue_with_filters(store):
    root, results = store
    out = cli("print-msg", "--store", str(root), "-t", "Topic1", "-s", "Tag0").stdout.splitlines()
    assert [line for line in out if line.startswith("minOffset=")] == [
        f"minOffset=0, maxOffset=20, MessageQueue [topic=Topic1, queueId={q}]" for q in range(3)]
    msgs = [line for line in out if line.startswith("MSGID:")]
    assert len(msgs) == sum(1 for i in range(120) if i % 2 == 1 and i % 3 == 0)
    assert all(line.endswith("BODY: NOT PRINT BODY") for line in msgs)
    bodies = [json.loads(x)["body"] for x in cli("print-msg", "--store", str(root), "-t", "Topic1", "--body", "-b",
                                                 str(results[100].store_timestamp), "--json").stdout.splitlines()]
    assert len(bodies) >= sum(1 for r in results[100:120] if r.store_timestamp >= results[100].store_timestamp) // 2
    out = cli("print-msg", "--store", str(root), "-t", "Topic1", "--json").stdout
    unread = [json.loads(x) for x in out.splitlines()]
    assert len(unread) == 60 and not any("body" in row for row in unread)  # not read: absent ("body": null was empty)


def test_print_msg_filters_by_sql92_over_properties(store):
    root, _results = store

    def lines(*args: str) -> list[str]:
        out = cli("print-msg", "--store", str(root), "-t", "Topic1", *args).stdout.splitlines()
        return [line for line in out if line.startswith("MSGID:")]

    assert lines("--sql", "TAGS = 'Tag0'") == lines("-s", "Tag0") and len(lines("-s", "Tag0")) == 20
    found = [json.loads(x) for x in cli("print-msg", "--store", str(root), "-t", "Topic1", "--json", "--body",
                                        "--sql", "KEYS STARTSWITH 'order-3 ' OR TAGS = 'Nope'").stdout.splitlines()]
    assert [base64.b64decode(row["body"]) for row in found] == [b"message 3"]
    assert lines("--sql", "TAGS IS NULL") == []
    bad = cli("print-msg", "--store", str(root), "-t", "Topic1", "--sql", "TAGS = NULL", check=False)
    assert bad.returncode == 2 and "--sql" in bad.stderr and "Traceback" not in bad.stderr
    both = cli("print-msg", "--store", str(root), "-t", "Topic1", "-s", "Tag0", "--sql", "TAGS = 'x'", check=False)
    assert both.returncode == 2 and "not both" in both.stderr


def test_print_msg_lines_are_javas_message_ext_to_string(store):
    """Each line is mqadmin printMsg's: the producer's message id (MessageClientExt.getMsgId(), the UNIQ_KEY: the
    offset id was printed there, twice on a line), Java's ``MessageExt.toString()``, the body."""
    root, _results = store
    out = [line for line in cli("print-msg", "--store", str(root), "-t", "Topic1", "--body").stdout.splitlines()
           if line.startswith("MSGID:")]
    with MessageStore.open(root, CONFIG, read_only=True) as opened:
        expected = []
        for queue_id in opened.queue_ids("Topic1"):
            for m in opened.get_message("Topic1", queue_id, 0, 1000).messages:
                props = ", ".join(f"{k}={v}" for k, v in m.properties.items())
                expected.append(
                    f"MSGID: {m.uniq_key or m.msg_id} MessageExt [queueId={m.queue_id}, storeSize={m.store_size}, "
                    f"queueOffset={m.queue_offset}, sysFlag={m.sys_flag}, bornTimestamp={m.born_timestamp}, "
                    f"bornHost=/{m.born_host}, storeTimestamp={m.store_timestamp}, storeHost=/{m.store_host}, "
                    f"msgId={m.msg_id}, commitLogOffset={m.commit_log_offset}, bodyCRC={m.body_crc}, "
                    f"reconsumeTimes={m.reconsume_times}, preparedTransactionOffset={m.prepared_transaction_offset}, "
                    f"toString()=Message{{topic='{m.topic}', flag={m.flag}, properties={{{props}}}, "
                    f"body=[{len(m.body)} bytes]}}] BODY: {m.body.decode()}")
    assert out == expected and len(out) == 60


def test_print_msg_takes_mqadmins_charset_and_print_body_letters(tmp_path):
    """mqadmin printMsg's ``-c GBK`` reads a body in that charset and ``-d true|false`` says whether to print it."""
    root = tmp_path / "store"
    with MessageStore.open(root, CONFIG) as s:
        s.put_message(Message("Gbk", "订单已支付".encode("gbk"), tags="T"))
        s.wait_for_dispatch()

    def bodies(*args: str) -> list[str]:
        out = cli("print-msg", "--store", str(root), "-t", "Gbk", *args).stdout.splitlines()
        return [line.rsplit(" BODY: ", 1)[1] for line in out if line.startswith("MSGID:")]

    assert bodies("-c", "GBK", "-d", "true") == ["订单已支付"]
    assert bodies("-c", " gbk ", "--body") == ["订单已支付"]
    assert bodies("-d", "TRUE")[0].startswith("base64:")  # not UTF-8, no charset: base64, as before
    assert bodies("-d", "false") == bodies("-d", "yes") == bodies() == ["NOT PRINT BODY"]
    assert bodies("-c", "UTF-8", "-d", "true") == ["订单已支付".encode("gbk").decode("utf-8", "replace")]
    done = cli("print-msg", "--store", str(root), "-t", "Gbk", "-c", "NoSuchCharset", check=False)
    assert done.returncode == 2 and "unknown charset 'NoSuchCharset'" in done.stderr and not done.stdout


def test_dump_log_json_matches_rocketmqs_decoder(vectors):
    segment = vectors / "v4_commitlog" / "00000000000000000000"
    got = [json.loads(x) for x in cli("dump-log", str(segment), "--json").stdout.splitlines()]
    expected = [json.loads(x) for x in (vectors / "v4_commitlog" / "decode.jsonl").read_text().splitlines()]
    assert got == expected
    crc = [json.loads(x) for x in cli("dump-log", str(segment), "--json", "--check-crc").stdout.splitlines()]
    assert crc == [json.loads(x) for x in (vectors / "v4_commitlog" / "decode_checkcrc.jsonl").read_text().splitlines()]


def test_dump_log_reports_where_decoding_stops(vectors, tmp_path):
    segment = vectors / "v6_commitlog_corrupt" / "00000000000000000000"
    done = cli("dump-log", str(segment), "--json", check=False)
    assert done.returncode == 1  # stopped at bytes that are no record: not an "ok" for a script
    lines = [json.loads(x) for x in done.stdout.splitlines()]
    assert [x["pos"] for x in lines] == [0, 184]
    assert lines[1]["end"] == "decode-returned-null" and "body length" in lines[1]["reason"]
    text = cli("dump-log", str(segment), "--from", "300").stdout
    assert text.split()[0] == "415", "--from syncs to the next record start"
    assert "BLANK" in text


def test_dump_log_walks_a_directory_across_segments(store):
    root, results = store
    lines = [json.loads(x) for x in cli("dump-log", str(root / "commitlog"), "--json").stdout.splitlines()]
    records = [x for x in lines if "msgId" in x]
    assert [x["commitLogOffset"] for x in records] == [r.commit_log_offset for r in results]
    assert sum(1 for x in lines if x.get("end") == "blank") == len(list((root / "commitlog").iterdir())) - 1


def test_dump_log_from_inside_a_segments_tail_goes_on_in_the_next_segment(store):
    """--from past a segment's last record (in its BLANK tail) printed "end of data" and skipped every later
    segment."""
    root, results = store
    second = sorted((root / "commitlog").iterdir())[1]
    tail = int(second.name) - 10
    lines = [json.loads(x) for x in cli("dump-log", str(root / "commitlog"), "--from", str(tail), "--json")
             .stdout.splitlines()]
    assert [x["commitLogOffset"] for x in lines if "msgId" in x] == \
        [r.commit_log_offset for r in results if r.commit_log_offset >= tail]


def test_a_closed_stdout_under_a_table_exits_0_without_a_traceback(monkeypatch):
    """`inspect | head` and `stats | head` exited 1: rich catches the broken pipe itself and exits with 1. A
    closed stdout ends the command as it ends dump-log: status 0, nothing on stderr."""
    from rocketstore.cli import app

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the table is written
    out = os.fdopen(write_end, "w")
    monkeypatch.setattr(sys, "stdout", out)

    @app.fails_cleanly
    def command() -> None:
        app._table("rows", ["n"], [[i] for i in range(100)])

    try:
        with pytest.raises(SystemExit) as exited:
            command()
    finally:
        out.close()  # its descriptor is /dev/null now
    assert exited.value.code == 0


def test_inspect_shows_segments_queues_index_and_checkpoint(store):
    root, _results = store
    before = tree(root)
    info = json.loads(cli("inspect", "--store", str(root), "--json").stdout)
    assert info["state"] == "closed cleanly" and not info["locked"]
    assert [s["start"] for s in info["segments"]] == [i * (16 << 10) for i in range(len(info["segments"]))]
    queues = {(q["topic"], q["queueId"]): (q["minOffset"], q["maxOffset"]) for q in info["queues"]}
    assert queues[("Topic0", 0)] == (0, 20) and queues[("TopicA", 0)] == (0, 2)
    assert info["index"][0]["indexCount"] - 1 == 120 * 3 + 2 * 2  # UNIQ_KEY + keys
    assert info["checkpoint"]["trusted"]
    text = cli("inspect", "--store", str(root)).stdout
    assert "commit log" in text and "index files" in text and "checkpoint:" in text
    assert tree(root) == before


def test_stats_counts_and_plots(store, tmp_path):
    root, _ = store
    data = json.loads(cli("stats", "--store", str(root), "--json").stdout)
    assert data["messages"] == 122 and data["perTopic"] == {"Topic0": 60, "Topic1": 60, "TopicA": 2}
    index = data["index"][0]
    assert index["entries"] == 364 and sum(index["chainLengths"].values()) == 97
    assert sum(int(k) * v for k, v in index["chainLengths"].items()) == 364
    png = tmp_path / "stats.png"
    cli("stats", "--store", str(root), "--plot", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_put_from_options_and_stdin(tmp_path):
    root = tmp_path / "s"
    out = cli("put", "--store", str(root), "-t", "T", "-p", "hello", "-k", "k1", "--tags", "A", "--property",
              "x=y").stdout
    assert out.startswith("SendResult [sendStatus=PUT_OK") and "queueOffset=0" in out
    lines = "\n".join(json.dumps({"topic": "T", "body": f"b{i}", "keys": [f"s{i}"], "queue": 1}) for i in range(3))
    results = [json.loads(x) for x in cli("put", "--store", str(root), "--json", stdin=lines).stdout.splitlines()]
    assert [r["queueOffset"] for r in results] == [0, 1, 2] and all(r["status"] == "PUT_OK" for r in results)
    with MessageStore.open(root, StoreConfig(), read_only=True) as s:
        assert [m.body for m in s.iter_messages()] == [b"hello", b"b0", b"b1", b"b2"]


@pytest.mark.parametrize("args, message", [
    (["query-by-key", "-t", "T", "-k", "k"], "holds no store"),
    (["query-by-id", "-i", "zz"], "message not found: zz"),  # no offset id: a UNIQ_KEY, as mqadmin
    (["query-by-id", "-i", "7F00000100002A9F00000000000FFFFF"], "not found"),
    (["query-by-key", "-t", "Topic0", "-k", "k", "-b", "yesterday"], "ISO-8601"),
    (["query-by-offset", "-t", "Topic0", "-q", "0", "-o", "999"], "OFFSET_OVERFLOW_BADLY"),
    (["query-by-unique-key", "-i", "ABCDEF"], "no message"),
    (["print-msg", "-t", "Nope"], "no consume queues"),
    (["put", "-t", "bad/topic", "-p", "x"], "may contain only"),
    (["put", "-t", "T", "-p", "x", "-k", "has space"], "space"),
    (["put", "-t", "T"], "--body is required"),
    (["stats", "--bucket", "week"], "week"),
])
def test_bad_input_is_one_clear_line_and_changes_nothing(store, tmp_path, args, message):
    root, _ = store
    target = tmp_path / "nothing" if args[0] == "query-by-key" and args[-1] == "k" and "-b" not in args else root
    before = tree(root)
    done = cli(*args, "--store", str(target), check=False, process=args[0] == "put")  # two kinds in a process
    assert done.returncode in (1, 2), done.stdout
    assert message in done.stderr and "Traceback" not in done.stderr
    assert tree(root) == before


@pytest.mark.parametrize("args, message", [
    (["query-by-key", "-t", "Topic0", "-k", "k", "-b", "0001-01-01T00:00"], "out of range"),
    (["query-by-id", "-i", ","], "names no message id"),
    (["query-by-id", "-i", " "], "names no message id"),
    (["inspect", "--max-index-num", "0"], "0 is not in the range"),
    (["inspect", "--max-hash-slot-num", "0"], "0 is not in the range"),
    (["query-by-unique-key", "-t", "", "-i", "ABCDEF"], "the topic is empty"),
    (["query-by-unique-key", "-i", " "], "the UNIQ_KEY is empty"),
    (["query-by-key", "-t", "Topic0", "--keys-file", "KEYS"], "is not UTF-8"),
])
def test_bad_arguments_are_usage_errors(store, tmp_path, args, message):
    """Each of these exited 0 with no output, searched every topic, was silently ignored (0 taken for "not
    given") or failed with exit 1 and a message naming neither the option nor the file."""
    root, _ = store
    keys = tmp_path / "keys.txt"
    keys.write_bytes(b"k1\n\xff\xfe\n")
    args = [str(keys) if a == "KEYS" else a for a in args]
    before = tree(root)
    done = cli(*args, "--store", str(root), check=False)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert message in done.stderr and "Traceback" not in done.stderr
    if "--keys-file" in args:
        assert str(keys) in done.stderr
    assert tree(root) == before


def test_a_broker_conf_that_is_not_utf8_is_named(store, tmp_path):
    root, _ = store
    conf = tmp_path / "broker.conf"
    conf.write_bytes(b"\xff\xfe\n")
    done = cli("inspect", "--store", str(root), "--broker-conf", str(conf), check=False)
    assert done.returncode == 1 and done.stderr == f"error: {conf} is not UTF-8 text (byte 0)\n"


def test_a_broker_conf_names_the_store_unless_store_is_given(store, tmp_path):
    """--broker-conf read the geometry but not storePathRootDir: without --store, commands looked at ~/store."""
    root, results = store
    conf = tmp_path / "broker.conf"
    conf.write_text(f"brokerName=broker-a\nstorePathRootDir={root}\nmaxHashSlotNum={CONFIG.max_hash_slot_num}\n"
                    f"maxIndexNum={CONFIG.max_index_num}\n")
    found = cli("query-by-key", "--broker-conf", str(conf), "-t", "Topic1", "-k", "order-7", "--json").stdout
    assert json.loads(found)["commitLogOffset"] == results[7].commit_log_offset
    done = cli("inspect", "--broker-conf", str(conf), "--store", str(tmp_path / "elsewhere"), check=False)
    assert done.returncode == 1 and "elsewhere holds no store" in done.stderr  # --store wins


def test_the_store_can_come_from_the_environment(store, tmp_path):
    """$ROCKETSTORE_STORE names the store for every command of a session (as NAMESRV_ADDR does for mqadmin);
    --store still wins."""
    from click.testing import CliRunner

    from rocketstore.cli.app import main

    root, results = store
    runner = CliRunner()
    env = {"ROCKETSTORE_STORE": str(root), "COLUMNS": "200"}
    done = runner.invoke(main, ["query-by-key", "-t", "Topic1", "-k", "order-7", "--json"], env=env)
    assert done.exit_code == 0 and json.loads(done.stdout)["commitLogOffset"] == results[7].commit_log_offset
    done = runner.invoke(main, ["inspect", "--store", str(tmp_path / "elsewhere")], env=env)
    assert done.exit_code == 1 and "elsewhere holds no store" in done.output
    assert "ROCKETSTORE_STORE" in runner.invoke(main, ["inspect", "-h"]).output


def test_writer_lock_is_reported(store, tmp_path):
    root = tmp_path / "locked"
    with MessageStore.open(root, CONFIG) as writer:
        writer.put_message(Message("T", b"live"))
        done = cli("put", "--store", str(root), "-t", "T", "-p", "x", check=False, process=True)  # another process
        assert done.returncode == 1 and "locked by another writer" in done.stderr
        assert "open by a writer" in cli("inspect", "--store", str(root)).stdout  # reads still work


def test_dump_log_of_a_missing_path_is_a_usage_error(tmp_path):
    done = cli("dump-log", str(tmp_path / "missing"), check=False)
    assert done.returncode == 2 and "does not exist" in done.stderr


def test_dump_log_refuses_a_negative_start(store):
    """``--from -5`` started at offset 0 without a word."""
    done = cli("dump-log", str(store[0] / "commitlog"), "--from", "-5", check=False)
    assert done.returncode == 2 and "--from" in done.stderr and not done.stdout


def test_query_by_offset_never_serves_another_offsets_message(store, tmp_path):
    """A unit that cannot be served (pointing at another queue's record, or into the middle of a record) made
    query-by-offset print the next servable offset's message with exit 0. Then the reader's log lines about
    the unit (and about the units it read on to) came before the error line: the error is now all there is."""
    copy, results = damaged_copy(store, tmp_path)
    unit_file = copy / "consumequeue" / "Topic1" / "2" / f"{0:020d}"
    data = bytearray(unit_file.read_bytes())
    data[20 * 4 : 20 * 4 + 8] = struct.pack(">q", results[0].commit_log_offset)  # unit 4: a record of Topic0-0
    data[20 * 5 : 20 * 5 + 8] = struct.pack(">q", results[5 + 6 * 5].commit_log_offset + 4)  # unit 5: mid-record
    unit_file.write_bytes(bytes(data))
    before = tree(copy)
    for offset, why in (("4", "a record of Topic0 queue 0 offset 0"), ("5", "where no readable record starts")):
        done = cli("query-by-offset", "--store", str(copy), "-t", "Topic1", "-q", "2", "-o", offset, check=False,
                   process=True)  # a process: what its stderr shows, without pytest's log capture
        assert done.returncode == 1 and done.stdout == "", done.stdout
        assert done.stderr.startswith(f"error: Topic1 queue 2 offset {offset}: the unit points at commit-log offset")
        assert why in done.stderr and done.stderr.count("\n") == 1, done.stderr
    shown = cli("query-by-offset", "--store", str(copy), "-t", "Topic1", "-q", "2", "-o", "6", "--json").stdout
    assert json.loads(shown)["queueOffset"] == 6
    assert tree(copy) == before


# --- verify ------------------------------------------------------------------------------------------

def damaged_copy(store, tmp_path) -> tuple[Path, list]:
    root, results = store
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    return copy, results


def verify_json(root: Path) -> tuple[int, list[dict]]:
    done = cli("verify", "--store", str(root), "--json", check=False)
    return done.returncode, [json.loads(x) for x in done.stdout.splitlines()]


def test_verify_is_clean_on_a_clean_store(store):
    root, _ = store
    assert verify_json(root) == (0, [])
    assert "0 problem(s)" in cli("verify", "--store", str(root)).stdout


def test_verify_finds_a_bad_crc_in_any_segment(store, tmp_path):
    copy, results = damaged_copy(store, tmp_path)
    victim = results[3]  # first segment: normal recovery would not re-check it
    segment = copy / "commitlog" / f"{0:020d}"
    data = bytearray(segment.read_bytes())
    data[victim.commit_log_offset + 90] ^= 0x55  # a body byte
    segment.write_bytes(bytes(data))
    code, problems = verify_json(copy)
    assert code == 1
    assert {"kind": "commitlog", "offset": victim.commit_log_offset} == {k: problems[0][k] for k in ("kind", "offset")}
    assert "CRC" in problems[0]["detail"] and problems[0]["path"].endswith(segment.name)


def test_verify_with_its_output_closed_still_exits_1_on_a_damaged_store(store, tmp_path):
    """`verify | head -1` under pipefail exited 0 on a damaged store: the broken pipe ended the command "quietly,
    like any Unix tool", before the exit status that says whether the store is sound."""
    copy, results = damaged_copy(store, tmp_path)
    segment = copy / "commitlog" / f"{0:020d}"
    data = bytearray(segment.read_bytes())
    data[results[3].commit_log_offset + 90] ^= 0x55
    segment.write_bytes(bytes(data))
    for damaged in (copy, store[0]):
        for form in ([], ["--json"]):
            proc = subprocess.Popen([sys.executable, "-m", "rocketstore.cli.app", "verify", "--store", str(damaged),
                                     *form], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            proc.stdout.close()  # the reader is gone before the first line
            _out, err = proc.communicate(timeout=120)
            assert proc.returncode == (1 if damaged == copy else 0), err
            assert b"Traceback" not in err


def test_verify_finds_a_damaged_queue_unit(store, tmp_path):
    copy, results = damaged_copy(store, tmp_path)
    unit_file = copy / "consumequeue" / "Topic1" / "2" / f"{0:020d}"
    data = bytearray(unit_file.read_bytes())
    data[20 * 4 : 20 * 4 + 8] = struct.pack(">q", results[0].commit_log_offset + 1)  # unit 4 points nowhere
    unit_file.write_bytes(bytes(data))
    code, problems = verify_json(copy)
    assert code == 1
    assert any(p["kind"] == "consumequeue" and p["offset"] == 80 and "no record starts" in p["detail"]
               for p in problems)
    assert any("missing from its queue" in p["detail"] for p in problems)


@pytest.mark.parametrize("damage", ["cut short", "short and not the last"])
def test_verify_names_a_queue_file_of_the_wrong_size(store, tmp_path, damage):
    """A consume-queue file of the wrong size (RocketMQ's load refuses the store) was named nowhere: the read-only
    load skipped its queue with a log line, and verify listed only the queue's records as missing (or nothing, for
    a queue whose records retention removed). An empty last file is a crash while creating it, deleted on load."""
    copy, _results = damaged_copy(store, tmp_path)
    queue = copy / "consumequeue" / "Topic1" / "2"
    damaged = queue / f"{0:020d}"
    size = 1990 if damage == "cut short" else 1980
    os.truncate(damaged, size)
    if damage == "short and not the last":
        (queue / f"{2000:020d}").write_bytes(bytes(2000))
        (queue / f"{4000:020d}").write_bytes(b"")
    code, problems = verify_json(copy)
    assert code == 1
    named = [p for p in problems if Path(p["path"]).parent == queue]  # files; missing records name the queue
    assert [(p["path"], p["offset"]) for p in named] == [(str(damaged), size)]
    assert f"file is {size} bytes" in named[0]["detail"] and "expected 2000 (mappedFileSizeConsumeQueue)" in \
        named[0]["detail"]
    assert ("not a whole number of 20-byte units" in named[0]["detail"]) == (size % 20 != 0)


def test_verify_finds_a_damaged_index_entry(store, tmp_path):
    copy, results = damaged_copy(store, tmp_path)
    index_file = next((copy / "index").iterdir())
    data = bytearray(index_file.read_bytes())
    entry = 40 + 97 * 4 + 5 * 20
    data[entry + 4 : entry + 12] = struct.pack(">q", results[50].commit_log_offset)  # entry 5 -> a foreign record
    index_file.write_bytes(bytes(data))
    code, problems = verify_json(copy)
    assert code == 1
    assert any(p["kind"] == "index" and p["offset"] == entry and "matches no key" in p["detail"] for p in problems)
    assert any("have no index entry" in p["detail"] for p in problems)


def test_verify_finds_garbage_after_the_end(store, tmp_path):
    copy, results = damaged_copy(store, tmp_path)
    last = sorted((copy / "commitlog").iterdir())[-1]
    end = results[-1].commit_log_offset + results[-1].store_size - int(last.name)
    data = bytearray(last.read_bytes())
    data[end + 100 : end + 104] = b"junk"
    last.write_bytes(bytes(data))
    code, problems = verify_json(copy)
    assert code == 1 and any("after the end of the log" in p["detail"] for p in problems)


# --- Spark-backed commands ----------------------------------------------------------------------------

def test_rebuild_and_export_commands(store, tmp_path, spark):
    """In this process, on the suite's session (a subprocess would start a JVM per command: ~25 s each)."""
    from click.testing import CliRunner

    from rocketstore.cli.app import main

    copy, _results = damaged_copy(store, tmp_path)
    shutil.rmtree(copy / "index")
    done = CliRunner().invoke(main, ["rebuild", "--store", str(copy), "--master", "local[2]"])
    assert done.exit_code == 0, done.output
    assert "rebuilt 122 queue units" in done.output and "partitions in 1 window, " in done.output
    assert verify_json(copy) == (0, [])
    exported = tmp_path / "parquet"
    done = CliRunner().invoke(main, ["export", "--store", str(copy), "--master", "local[2]", "--out", str(exported),
                                     "-t", "TopicA"])
    assert done.exit_code == 0, done.output
    assert done.output.strip() == f"exported 2 messages to {exported}"
    assert (exported / "topic=TopicA").is_dir()
    again = ["export", "--store", str(copy), "--master", "local[2]", "--out", str(exported), "-t", "Topic1"]
    done = CliRunner().invoke(main, again)
    assert done.exit_code == 1 and "is not empty: pass --overwrite" in done.output
    done = CliRunner().invoke(main, [*again, "--overwrite"])
    assert done.exit_code == 0, done.output
    assert sorted(p.name for p in exported.iterdir() if p.is_dir()) == ["topic=Topic1"]


def test_rebuild_without_spark_writes_what_the_spark_rebuild_writes(store, tmp_path):
    """``--no-spark``: no JVM, a store ``verify`` finds whole (byte-identity with the store's own dispatch:
    ``test_spark.test_rebuild_in_this_process_is_byte_identical_to_sequential_dispatch``)."""
    from click.testing import CliRunner

    from rocketstore.cli.app import main

    copy, _results = damaged_copy(store, tmp_path)
    shutil.rmtree(copy / "index")
    done = CliRunner().invoke(main, ["rebuild", "--no-spark", "--store", str(copy)])
    assert done.exit_code == 0, done.output
    assert "rebuilt 122 queue units" in done.output and "in this process" in done.output
    assert verify_json(copy) == (0, [])
    bad = CliRunner().invoke(main, ["rebuild", "--no-spark", "--master", "spark://h:7077", "--store", str(copy)])
    assert bad.exit_code == 2 and "--no-spark runs no Spark job" in bad.output


def test_rebuild_of_a_store_being_written_is_refused_before_spark_starts(store, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from rocketstore.cli import app

    copy, _results = damaged_copy(store, tmp_path)
    monkeypatch.setattr(app, "_spark", lambda *a: pytest.fail("a JVM was started for a locked store"))
    with MessageStore.open(copy, CONFIG):
        done = CliRunner().invoke(app.main, ["rebuild", "--store", str(copy)])
    assert done.exit_code == 1 and "already open for writing" in done.output  # the lock, as another process sees it


def test_import_and_find_keys_commands(store, tmp_path, spark):
    """export -> import into a new store, then find-keys over both stores: the same messages, found exactly."""
    from click.testing import CliRunner

    from rocketstore.cli.app import main

    root, results = store
    exported = tmp_path / "parquet"
    run = CliRunner().invoke
    assert run(main, ["export", "--store", str(root), "--master", "local[2]", "--out", str(exported)]).exit_code == 0
    replay = tmp_path / "replay" / "store"
    done = run(main, ["import", "--store", str(replay), "--master", "local[2]", "--parquet", str(exported)])
    assert done.exit_code == 0, done.output
    assert f"imported {len(results)} messages" in done.output
    with MessageStore.open(replay, StoreConfig(), read_only=True) as s:
        assert [m.body for m in s.query_message("Topic1", "order-7")] == [b"message 7"]

    keys_file = tmp_path / "keys.txt"
    keys_file.write_text("Topic1:order-7\nTopicA:BB\n\n")
    done = run(main, ["find-keys", "--store", str(root), "--store", str(replay), "--master", "local[2]",
                      "-k", "Topic0:order-4", "--keys-file", str(keys_file), "--json"])
    assert done.exit_code == 0, done.output
    rows = [json.loads(line) for line in done.output.splitlines()]
    found = sorted((r["queryTopic"], r["queryKey"], base64.b64decode(r["body"])) for r in rows)
    assert found == sorted([("Topic0", "order-4", b"message 4"), ("Topic1", "order-7", b"message 7"),
                            ("TopicA", "BB", b"bb")] * 2)  # "Aa" collides with "BB" and is not returned
    brokers = [r["brokerName"] for r in rows]  # a store's broker is its parent directory (broker-a/store)
    assert sorted(brokers) == sorted([root.parent.name] * 3 + ["replay"] * 3)
    done = run(main, ["find-keys", "--store", str(root), "--master", "local[2]", "-k", "Topic0:order-4"])
    assert done.exit_code == 0, done.output
    table = done.output.splitlines()
    assert table[0].split()[:3] == ["#Topic", "#Key", "#Broker"] and len(table) == 2
    assert table[1].split()[:2] == ["Topic0", "order-4"] and results[4].uniq_key in table[1]

    for args, message in ((["-k", "no-colon"], "TOPIC:KEY"), ([], "give -k/--key")):
        done = run(main, ["find-keys", "--store", str(root), *args])
        assert done.exit_code == 2 and message in done.output  # usage errors

    # a store damaged before intact records: refused, as query-by-key refuses it (it answered from the log up to
    # the damage with exit 0 and not a word: the cluster review); --allow-damage answers from there
    damaged, _ = _damage_before_the_end(store, tmp_path)
    done = run(main, ["find-keys", "--store", str(damaged), "--master", "local[2]", "-k", "Topic0:shared"])
    assert done.exit_code == 1 and "at damage at offset" in done.output, done.output
    done = run(main, ["find-keys", "--store", str(damaged), "--master", "local[2]", "-k", "Topic0:shared", "--json",
                      "--allow-damage"])
    assert done.exit_code == 0 and 0 < len(done.output.splitlines()) < 60, done.output
    done = run(main, ["find-keys", "--store", str(tmp_path / "nothing"), "-k", "T:k"])
    assert done.exit_code == 1 and "holds no store" in done.output
    done = run(main, ["import", "--store", str(tmp_path / "x"), "--parquet", str(tmp_path / "missing")])
    assert done.exit_code == 1 and "does not exist" in done.output and not (tmp_path / "x").exists()


def test_find_keys_takes_the_index_geometry_of_brokers_whose_files_do_not_tell_it(tmp_path, spark):
    """400 entries on 97 slots is not RocketMQ's 4 entries a slot: the index file's size does not tell the
    geometry, so find-keys is told it, by flags or a broker.conf (as every other store command is)."""
    from click.testing import CliRunner

    from rocketstore.cli.app import main

    odd = StoreConfig(mapped_file_size_commit_log=16 << 10, mapped_file_size_consume_queue=20 * 100,
                      max_hash_slot_num=97, max_index_num=400)
    root = tmp_path / "broker-x" / "store"
    with MessageStore.open(root, odd) as s:
        for i in range(30):
            s.put_message(Message("T", f"m{i}".encode(), keys=[f"k{i}"]))
        s.wait_for_dispatch()
    run = CliRunner().invoke
    done = run(main, ["find-keys", "--store", str(root), "--master", "local[2]", "-k", "T:k7"])
    assert done.exit_code == 1 and "Traceback" not in done.output, done.output
    assert "ConfigError" in done.output and "pass the broker's maxHashSlotNum" in done.output
    conf = tmp_path / "broker.conf"
    conf.write_text("maxHashSlotNum=97\nmaxIndexNum=400\n")
    for geometry in (["--max-hash-slot-num", "97", "--max-index-num", "400"], ["--broker-conf", str(conf)]):
        done = run(main, ["find-keys", "--store", str(root), "--master", "local[2]", *geometry, "-k", "T:k7",
                          "--json"])
        assert done.exit_code == 0, done.output
        rows = [json.loads(line) for line in done.output.splitlines()]
        assert [(r["queryKey"], base64.b64decode(r["body"])) for r in rows] == [("k7", b"m7")]


def test_demo_command_runs(tmp_path):
    out = cli("demo", "--store", str(tmp_path / "d"), "--messages", "300", "--no-spark").stdout
    assert "wrote" in out and "all identical" in out
    # order-9 is message 37 (four messages per order, every fourth in OrderPaid): read as a sentence, not a list
    assert "key 'order-9' in OrderPaid -> 1 message: \"OrderPaid #37\" (queue 1, offset " in out and "['" not in out


def test_corrupt_file_is_one_clear_line(store, tmp_path):
    copy, _ = damaged_copy(store, tmp_path)
    segment = sorted((copy / "commitlog").iterdir())[0]
    segment.write_bytes(segment.read_bytes()[:1000])  # a truncated segment
    for args in (["query-by-key", "-t", "Topic0", "-k", "shared"], ["inspect"], ["verify"]):
        done = cli(*args, "--store", str(copy), check=False, process=True)
        assert done.returncode == 1 and "Traceback" not in done.stderr
        assert done.stderr.count("\n") == 1 and "segment is 1000 bytes" in done.stderr


def test_topics_consumer_progress_and_reset_offset(store, tmp_path):
    root, results = damaged_copy(store, tmp_path)  # a private copy: these commands write config/
    assert "create topic Fresh: 3 write queues" in cli("topic", "create", "--store", str(root), "-t", "Fresh", "-w",
                                                       "3").stdout
    topics = {t["topic"]: t for t in map(json.loads, cli("topic", "list", "--store", str(root), "--json")
                                         .stdout.splitlines())}
    assert topics["Fresh"]["writeQueueNums"] == 3 and topics["Topic0"]["messages"] == 60
    with MessageStore.open(root, CONFIG) as s, s.consumer("g1", "Topic0") as consumer:
        assert len(consumer.poll(timeout=1, max_msgs=25)) == 25
        consumer.commit()
    progress = [json.loads(x) for x in cli("consumer-progress", "--store", str(root), "-g", "g1", "--json")
                .stdout.splitlines()]
    assert sum(r["consumerOffset"] for r in progress) == 25 and sum(r["diff"] for r in progress) == 35
    table = cli("consumer-progress", "--store", str(root)).stdout
    assert "Diff Total: 35" in table
    from rocketstore.cli.render import human_time

    last = max(r["lastTimestamp"] for r in progress)  # printed as mqadmin prints it: to the second
    assert human_time(last)[:19] in table and human_time(last) not in table
    middle = results[60].store_timestamp  # a Topic0 message in the middle of the log
    out = cli("reset-offset", "--store", str(root), "-g", "g1", "-t", "Topic0", "-s", str(middle)).stdout
    with MessageStore.open(root, CONFIG, read_only=True) as s:
        expected = {q: s.get_offset_in_queue_by_time("Topic0", q, middle) for q in s.queue_ids("Topic0")}
        assert {q: s.query_offset("g1", "Topic0", q) for q in expected} == expected
    assert out.splitlines()[0].split() == ["#QID", "#Offset"]
    for to_the_end in ("now", "-1"):  # as mqadmin: past every message; -1 is the broker's "latest"
        cli("reset-offset", "--store", str(root), "-g", "g1", "-t", "Topic0", "-s", "earliest")
        cli("reset-offset", "--store", str(root), "-g", "g1", "-t", "Topic0", "-s", to_the_end)
        with MessageStore.open(root, CONFIG, read_only=True) as s:
            assert {q: s.query_offset("g1", "Topic0", q) for q in s.queue_ids("Topic0")} == \
                {q: s.get_max_offset_in_queue("Topic0", q) for q in s.queue_ids("Topic0")}, to_the_end
    assert "deleted" not in cli("topic", "delete", "--store", str(root), "-t", "Fresh").stdout
    bad = cli("reset-offset", "--store", str(root), "-g", "g1", "-t", "Nope", "-s", "earliest", check=False)
    assert bad.returncode == 1 and "does not exist" in bad.stderr
    bad = cli("consumer-progress", "--store", str(root), "-g", "nobody", check=False)
    assert bad.returncode == 1 and "no committed offsets" in bad.stderr


def test_query_by_key_with_a_keys_file_equals_one_query_per_key(store, tmp_path):
    root, _results = store
    keys = ["order-7", "order-9", "shared", "missing", "order-7"]
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text("\n".join(keys) + "\n\n")
    lines = cli("query-by-key", "--store", str(root), "-t", "Topic1", "--keys-file", str(keys_file), "-m", "3",
                "--json").stdout.splitlines()
    got = [json.loads(x) for x in lines]
    singles = [json.loads(x) | {"queryTopic": "Topic1", "queryKey": key} for key in keys
               for x in cli("query-by-key", "--store", str(root), "-t", "Topic1", "-k", key, "-m", "3",
                            "--json", check=False).stdout.splitlines()]
    assert got == singles and len(got) == 1 + 1 + 3 + 0 + 1
    table = cli("query-by-key", "--store", str(root), "-t", "Topic1", "--keys-file", "-", stdin="order-9\n")
    assert table.stdout.splitlines()[1].split()[0] == "order-9"
    both = cli("query-by-key", "--store", str(root), "-t", "Topic1", "-k", "x", "--keys-file", str(keys_file),
               check=False)
    assert both.returncode == 2 and "one of" in both.stderr and "Traceback" not in both.stderr  # a usage error


def test_a_spark_command_stops_its_session_quietly_before_the_process_exits(monkeypatch):
    """Else the JVM dies with the process while the driver's Python daemon still holds idle workers, whose
    BrokenPipeError tracebacks then followed the one-line error on stderr (``test_spark_failures`` runs the
    real thing)."""
    from rocketstore.cli import app
    from rocketstore.spark import session

    registered = []
    monkeypatch.setattr(session, "spark_session", lambda master, **kw: "the session")
    monkeypatch.setattr(app.atexit, "register", lambda fn, *args: registered.append((fn, args)))
    assert app._spark("local[1]", False, False) == "the session"
    assert registered == [(session.stop_quietly, ("the session",))]


def test_refused_writing_commands_on_a_new_path_leave_nothing_and_serve_checks_options_first(tmp_path):
    """A refused put or topic create on a mistyped --store left a directory of a lock and a checkpoint (and beside
    an empty log, the same files in an existing directory); serve with
    a port past 65535 listened on that port modulo 65536, a negative or NaN --stats-interval failed only after the
    store opened (and wrote the transaction topics into it); demo --messages 0 failed with "list index out of
    range" and left a store."""
    new = tmp_path / "new"
    refused = [(["put", "-t", "a/b", "-p", "x"], None), (["topic", "create", "-t", "SCHEDULE_TOPIC_XXXX"], None),
               (["put"], '{"topic": "T", "body": "x", "keys": ["a b"]}\n')]
    for args, stdin in refused:
        done = cli(*args, "--store", str(new), stdin=stdin, check=False)
        assert done.returncode == 1 and done.stderr.startswith("error: "), done.stderr
        assert not new.exists(), args
    empty = tmp_path / "empty"  # a directory with an empty log (an operator's mkdir, a store never written)
    (empty / "commitlog").mkdir(parents=True)
    (empty / "notes.txt").write_text("mine")
    empty_tree = sorted(empty.rglob("*"))
    for args, stdin in refused:
        assert cli(*args, "--store", str(empty), stdin=stdin, check=False).returncode == 1
        assert sorted(empty.rglob("*")) == empty_tree, args  # no lock, checkpoint or queueEnds.json left beside it
    assert cli("put", "-t", "T", "-p", "kept", "--store", str(new)).returncode == 0
    assert cli("put", "-t", "a/b", "-p", "x", "--store", str(new), check=False).returncode == 1
    assert (new / "commitlog").is_dir()  # an existing store stays, of course
    before = tree(new)
    for args in (["--listen", "127.0.0.1:99999"], ["--listen", "256.1.1.1:8081"], ["--stats-interval", "-1"],
                 ["--stats-interval", "nan"]):
        done = cli("serve", *args, "--store", str(new), check=False)
        assert done.returncode in (1, 2) and "Traceback" not in done.stderr, done.stderr
        assert tree(new) == before, args
    done = cli("demo", "--no-spark", "--store", str(tmp_path / "demo"), "--messages", "0", check=False)
    assert done.returncode == 2 and "0 is not in the range" in done.stderr
    assert not (tmp_path / "demo").exists()


def test_put_refuses_json_lines_it_would_have_changed(tmp_path):
    """Bad base64 was decoded to another body ("!!!": empty), queueId 1.9 or true went to queue 1, keys {"a": 1}
    became the key "a", and unknown fields (RocketMQ's flag, bornTimestamp) were dropped: all stored, exit 0."""
    from rocketstore.cli.app import _json_message

    for line, reason in (('{"topic":"T","bodyBase64":"!!!"}', "bodyBase64 is not base64"),
                         ('{"topic":"T","body":"a","bodyBase64":"YQ=="}', "body or bodyBase64, not both"),
                         ('{"topic":"T","body":"c","queueId":1.9}', "queueId must be an integer"),
                         ('{"topic":"T","body":"c","queueId":true}', "queueId must be an integer"),
                         ('{"topic":"T","body":"e","keys":{"a":1}}', "keys must be a string or a list of strings"),
                         ('{"topic":"T","body":"d","bornTimestamp":"x"}', "unknown field(s) 'bornTimestamp'"),
                         ('{"topic":"T","body":5}', "body must be a string"),
                         ('["T"]', "not a JSON object")):
        with pytest.raises((TypeError, ValueError)) as caught:
            _json_message(json.loads(line))
        assert reason in str(caught.value), line
    root = tmp_path / "s"
    cli("put", "-t", "T", "-p", "first", "--store", str(root))
    before = tree(root)
    done = cli("put", "--store", str(root), stdin='{"topic":"T","body":"ok"}\n{"topic":"T","bodyBase64":"!!!"}\n',
               check=False)
    assert done.returncode == 1 and done.stderr.startswith("error: stdin line 2 is not a message"), done.stderr
    assert "bodyBase64 is not base64" in done.stderr
    assert tree(root) == before  # the good first line was not stored either
    out = cli("put", "--store", str(root), "--json",
              stdin='{"topic":"T","bodyBase64":"aGk=","keys":"k1","queueId":1,"flag":7,"tags":"a"}\n').stdout
    assert json.loads(out)["queueId"] == 1
    [msg] = [json.loads(line) for line in cli("print-msg", "--store", str(root), "-t", "T", "--json",
                                              "--body").stdout.splitlines() if json.loads(line)["queueId"] == 1]
    assert (base64.b64decode(msg["body"]), msg["flag"], msg["properties"]["KEYS"], msg["properties"]["TAGS"]) == \
        (b"hi", 7, "k1", "a")


def test_times_are_ascii_epoch_milliseconds_within_a_long_or_iso_8601(store):
    """isdigit() took "²" (int() then failed with Python's own message) and "５0" (50 ms: reset-offset moved every
    queue to its start); a number past a Java long and "--5" went through too (the time-semantics review)."""
    from rocketstore.cli.render import parse_time

    assert parse_time("1700000000000") == 1_700_000_000_000 and parse_time("-5") == -5
    assert parse_time("2026-11-21#09:30:00:123") is not None
    for bad in ("²", "５0", "--5", "99999999999999999999999", "9223372036854775808", "２０２６-11-21#09:30:00:123"):
        with pytest.raises(click.BadParameter):
            parse_time(bad)
    root, _ = store
    done = cli("query-by-key", "--store", str(root), "-t", "Topic1", "-k", "order-1", "-b", "²", check=False)
    assert done.returncode == 2 and "neither epoch milliseconds nor an ISO-8601 time" in done.stderr


def test_a_writing_command_whose_store_path_is_a_file_says_so_and_leaves_it(tmp_path):
    """mkdir's "[Errno 17] File exists" did not say that the path is a file."""
    path = tmp_path / "notes.txt"
    path.write_bytes(b"an operator's file")
    done = cli("put", "-t", "T", "-p", "x", "--store", str(path), check=False)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.rstrip().endswith(f"cannot create store root {path}: it exists and is not a directory")
    assert path.read_bytes() == b"an operator's file"


def test_times_read_as_mqadmin_reads_them_to_the_millisecond_and_across_dst(monkeypatch):
    """A float product read ~20% of the milliseconds of 2004 and 2038-2039 one early (a key query's window left its
    last message out); local times at a DST change were an hour off mqadmin's calendar; mqadmin's milliseconds are
    a count, not a fraction (the time-semantics review, checked against Java's SimpleDateFormat)."""
    import datetime as dt
    import random
    import time

    from rocketstore.cli.render import parse_time

    epoch = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    try:
        assert parse_time("2004-05-19T20:09:43.202Z") == parse_time("2004-05-19#20:09:43:202") == 1084997383202
        rng = random.Random(7)
        for ms in [rng.randrange(946684800000, 4102444800000) for _ in range(5000)]:
            stamp = epoch + dt.timedelta(milliseconds=ms)
            assert parse_time(stamp.isoformat()) == ms
            assert parse_time(stamp.strftime("%Y-%m-%d#%H:%M:%S:") + f"{ms % 1000:03d}") == ms
        monkeypatch.setenv("TZ", "America/New_York")
        time.tzset()
        assert parse_time("2024-11-03#01:30:00:000") == 1730615400000  # shown twice: the later (EST), as Java
        assert parse_time("2024-03-10#02:30:00:000") == 1710055800000  # skipped: 03:30 EDT, as Java
        assert parse_time("2024-03-10T02:30:00") == 1710055800000
        assert parse_time("2024-03-10#12:00:00:5") == parse_time("2024-03-10#12:00:00:005")
        assert parse_time("2024-03-10#12:00:00:1234") == parse_time("2024-03-10#12:00:01:234")
        assert parse_time("2024-03-10#2:00:00:000") == parse_time("2024-03-10#03:00:00:000")
    finally:
        monkeypatch.undo()
        time.tzset()


def test_a_log_damaged_before_intact_records_is_refused_unless_allowed(store, tmp_path):
    """One flipped body byte in an early record: recovery ends the log there. Queries answered from the first
    records with exit 0, and a writing command (reset-offset) cut every intact record after the damage off the
    log. Both are refused now, changing nothing; --allow-damage goes on as a broker's restart would."""
    copy, _results = _damage_before_the_end(store, tmp_path)
    before = tree(copy)
    store_args = ["--store", str(copy)]
    for args in (["query-by-key", "-t", "Topic0", "-k", "shared"], ["print-msg", "-t", "Topic1"],
                 ["topic", "list"], ["consumer-progress"],
                 ["reset-offset", "-g", "G", "-t", "Topic0", "-s", "earliest"], ["put", "-t", "Topic0", "-p", "x"]):
        done = cli(*args, *store_args, check=False)
        assert done.returncode == 1 and "damaged at offset" in done.stderr and "--allow-damage" in done.stderr, \
            (args, done.stderr)
        assert "Traceback" not in done.stderr
        assert tree(copy) == before, args
    text = cli("inspect", *store_args).stdout  # it said "closed cleanly", the damage only in log warnings
    assert "commit log DAMAGED at offset" in text and "intact records from offset" in text, text
    info = json.loads(cli("inspect", "--json", *store_args).stdout)
    assert info["recovery"]["resumesAt"] > info["recovery"]["endOffset"] > 0
    assert tree(copy) == before
    found = cli("query-by-key", "-t", "Topic0", "-k", "shared", "--allow-damage", "--json", *store_args).stdout
    assert 0 < len(found.splitlines()) < 60  # the answers of the log up to the damage
    assert tree(copy) == before
    cli("reset-offset", "-g", "G", "-t", "Topic0", "-s", "earliest", "--allow-damage", *store_args)
    assert list((copy / "recovery").iterdir())  # cut as a broker's restart cuts, the tail kept


def test_the_api_can_refuse_to_cut_a_damaged_log(store, tmp_path):
    from rocketstore.errors import DamagedLogError

    copy, results = _damage_before_the_end(store, tmp_path)
    damaged = results[-8].commit_log_offset
    before = {k: v for k, v in tree(copy).items() if k != "lock"}
    with pytest.raises(DamagedLogError, match=f"damaged at offset {damaged}"):
        MessageStore.open(copy, CONFIG.replace(cut_damaged_log=False))
    assert {k: v for k, v in tree(copy).items() if k != "lock"} == before
    with pytest.raises(DamagedLogError, match=f"damaged at offset {damaged}.*read-only"):
        MessageStore.open(copy, CONFIG.replace(cut_damaged_log=False), read_only=True)
    with MessageStore.open(copy, CONFIG, read_only=True) as view:  # the default answers up to the damage, and says
        assert view.recovery.end_offset == damaged < view.recovery.resumes_at
        assert sum(b.num_rows for b in view.scan_arrow()) == len(results) - 8
    assert {k: v for k, v in tree(copy).items() if k != "lock"} == before
    with MessageStore.open(copy, CONFIG) as opened:  # RocketMQ's way, the default
        assert opened.recovery.end_offset == damaged


def _damage_before_the_end(store, tmp_path, byte: int = 4) -> tuple[Path, list]:
    """A copy of the store with one byte flipped in a record of the newest segment (the one a clean shutdown's
    recovery validates) that has intact records after it: by default its magic code (the record's structure:
    every open stops there); ``byte=90``, a body byte (only a CRC check finds it)."""
    copy, results = damaged_copy(store, tmp_path)
    at = results[-8].commit_log_offset
    size = CONFIG.mapped_file_size_commit_log
    segment = copy / "commitlog" / f"{at // size * size:020d}"
    assert segment == sorted((copy / "commitlog").iterdir())[-1]
    data = bytearray(segment.read_bytes())
    data[at % size + byte] ^= 0x55
    segment.write_bytes(bytes(data))
    return copy, results


def test_a_body_damaged_in_the_newest_segment_is_named_and_skipped_by_queries(store, tmp_path):
    """A read-only open validates the log's structure, not its bodies' CRCs (every read checks those: the walk
    took ~1 s of each query command on a broker's 1 GiB segments). A record whose body fails its CRC is then
    named on stderr and left out, the records after it answered; a writer's open still refuses the log."""
    copy, results = _damage_before_the_end(store, tmp_path, byte=90)
    victim = results[-8]
    before = tree(copy)
    found = cli("query-by-key", "-t", "Topic0", "-k", "shared", "--json", "-m", "64", "--store", str(copy),
                process=True)
    offsets = [json.loads(line)["commitLogOffset"] for line in found.stdout.splitlines()]
    expected = [r.commit_log_offset for i, r in enumerate(results[:120]) if i % 2 == 0 and r != victim]
    assert offsets == expected and len(offsets) == 59  # the records after the damaged one too
    assert str(victim.commit_log_offset) in found.stderr and "CRC" in found.stderr
    printed = cli("print-msg", "-t", "Topic0", "--store", str(copy), process=True)
    assert printed.stdout.count("MSGID:") == 59 and str(victim.commit_log_offset) in printed.stderr
    assert tree(copy) == before
    done = cli("put", "-t", "Topic0", "-p", "x", "--store", str(copy), check=False)
    assert done.returncode == 1 and "damaged at offset" in done.stderr and tree(copy) == before


def test_consumer_progress_reports_as_the_brokers_getconsumestats(tmp_path):
    """Each read queue of the topic (not only those with files or commits), the diff unclamped (negative: an
    offset past the queue's end, which mqadmin shows), a topic without config skipped; an offsets file that cannot
    be read is an error, not a report of no lag."""
    root = tmp_path / "s"
    with MessageStore.open(root, CONFIG) as s:
        s.create_topic("Wide", 4)
        s.put_messages([Message("Wide", b"x", queue_id=1) for _ in range(3)])
        s.put_messages([Message("Gone", b"y", queue_id=0) for _ in range(2)])
        s.wait_for_dispatch()
        s.commit_offset("g", "Wide", 1, 2)
        s.commit_offset("g", "Wide", 2, 7)  # past the queue's end (0 messages)
        s.commit_offset("g", "Gone", 0, 1)
        s.delete_topic("Gone")
    done = cli("consumer-progress", "--store", str(root), "--json")
    rows = [json.loads(x) for x in done.stdout.splitlines()]
    assert [(r["queueId"], r["brokerOffset"], r["consumerOffset"], r["diff"]) for r in rows] == \
        [(0, 0, 0, 0), (1, 3, 2, 1), (2, 0, 7, -7), (3, 0, 0, 0)]
    assert "Gone not shown" in done.stderr
    assert "Diff Total: -6" in cli("consumer-progress", "--store", str(root)).stdout
    for name in ("consumerOffset.json", "consumerOffset.json.bak"):
        (root / "config" / name).write_text('{"offsetTable": {"Wide@g": {')  # cut short, and its backup too
    bad = cli("consumer-progress", "--store", str(root), check=False)
    assert bad.returncode == 1 and "cannot report consumerOffset.json" in bad.stderr and not bad.stdout
    assert len(bad.stderr.strip().splitlines()) == 1


def test_nothing_found_and_a_dump_stopped_at_damage_exit_1(store, tmp_path):
    """As query-by-id: a key nothing has is exit 1 (mqadmin: "query message by key finished, but no message."),
    one line on stderr; dump-log that stops at a record that does not decode exits 1 too (it said 0)."""
    root, results = store
    for args in (["-k", "no-such-key"], ["-k", "no-such-key", "--json"]):
        done = cli("query-by-key", "--store", str(root), "-t", "Topic0", *args, check=False)
        assert done.returncode == 1 and "no-such-key" in done.stderr and "Traceback" not in done.stderr
    assert cli("query-by-key", "--store", str(root), "-t", "Topic0", "-k", "shared").returncode == 0
    copy, _ = damaged_copy(store, tmp_path)
    segment = copy / "commitlog" / f"{0:020d}"
    data = bytearray(segment.read_bytes())
    data[results[3].commit_log_offset + 90] ^= 0x55
    segment.write_bytes(bytes(data))
    done = cli("dump-log", str(segment), "--check-crc", check=False)
    assert done.returncode == 1 and "STOP" in done.stdout and "decoding stopped" in done.stderr
    assert cli("dump-log", str(segment)).returncode == 0  # without the CRC check every record decodes


def test_put_takes_mqadmin_sendmessages_letters_and_refuses_its_broker(tmp_path):
    """-p body, -c tags, -i queue, -k key as mqadmin sendMessage; -b (its broker) was put's body, so
    `put -t T -b broker-a -p amount=100` stored the body broker-a: refused now, writing nothing."""
    root = tmp_path / "s"
    done = cli("put", "--store", str(root), "-t", "T", "-b", "broker-a", "-p", "amount=100", check=False)
    assert done.returncode == 2 and "-b/--broker" in done.stderr and not root.exists()
    cli("put", "--store", str(root), "-t", "T", "-p", "hello", "-c", "TagA", "-i", "1", "-k", "k1",
        "--property", "a=b")
    with MessageStore.open(root, read_only=True) as opened:
        (msg,) = opened.iter_messages()
    assert (msg.body, msg.tags, msg.queue_id, msg.keys, msg.properties["a"]) == (b"hello", "TagA", 1, ["k1"], "b")


def test_query_by_key_takes_more_than_64_as_the_broker_does(store):
    root, _results = store
    many = cli("query-by-key", "--store", str(root), "-t", "Topic0", "-k", "shared", "-m", "100", "--json")
    assert len(many.stdout.splitlines()) == 60  # Topic0 holds 60 with the key; asked 100, capped at 64
    assert cli("query-by-key", "--store", str(root), "-t", "Topic0", "-k", "shared", "-m", "0",
               check=False).returncode == 2


def test_query_by_id_takes_a_topic_and_query_by_offset_mqadmins_queue_letter(store):
    root, results = store
    r = results[11]  # Topic1
    assert cli("query-by-id", "--store", str(root), "-i", r.msg_id, "-t", "Topic1").returncode == 0
    other = cli("query-by-id", "--store", str(root), "-i", r.msg_id, "-t", "Topic0", check=False)
    assert other.returncode == 1 and "of topic Topic1, not Topic0" in other.stderr
    by_i = cli("query-by-offset", "--store", str(root), "-t", "Topic1", "-i", str(11 % 3), "-o",
               str(r.queue_offset), "--json").stdout
    assert json.loads(by_i)["commitLogOffset"] == r.commit_log_offset


def test_put_refuses_a_body_given_twice(tmp_path):
    """-p was a property before it was mqadmin's body: `put --body hello -p color=red` kept the last -p as the body."""
    done = cli("put", "--store", str(tmp_path / "s"), "-t", "T", "--body", "hello", "-p", "color=red", check=False)
    assert done.returncode == 2 and "more than once" in done.stderr and not (tmp_path / "s").exists()


def test_stats_and_export_refuse_a_damaged_log_unless_allowed(store, tmp_path):
    copy, results = _damage_before_the_end(store, tmp_path)
    done = cli("stats", "--store", str(copy), "--json", check=False)
    assert done.returncode == 1 and "damaged at offset" in done.stderr and "--allow-damage" in done.stderr
    counted = json.loads(cli("stats", "--store", str(copy), "--json", "--allow-damage").stdout)
    assert counted["messages"] == len(results) - 8  # up to the damage


def test_every_json_output_names_the_producers_id_uniqkey(tmp_path):
    """put's msgId is the UNIQ_KEY (SendResult's), a message's msgId the offset id (MessageExt's): `jq .msgId`
    piped between commands changed meaning. Both now carry uniqKey."""
    root = tmp_path / "s"
    put = json.loads(cli("put", "--store", str(root), "-t", "T", "-p", "x", "-k", "k", "--json").stdout)
    assert put["uniqKey"] == put["msgId"]
    by_key = json.loads(cli("query-by-key", "--store", str(root), "-t", "T", "-k", "k", "--json").stdout)
    assert by_key["uniqKey"] == put["uniqKey"] and by_key["msgId"] == put["offsetMsgId"]
    (many,) = [json.loads(x) for x in cli("query-by-key", "--store", str(root), "-t", "T", "--keys-file", "-",
                                            "--json", stdin="k\n").stdout.splitlines()]
    assert many["uniqKey"] == put["uniqKey"]
    printed = json.loads(cli("print-msg", "--store", str(root), "-t", "T", "--json").stdout.splitlines()[0])
    assert printed["uniqKey"] == put["uniqKey"]


ERRORS_LOGGED_ONCE = """
import logging, sys
import click
from rocketstore.cli.app import fails_cleanly
from rocketstore.errors import StoreIOError

@click.command()
@click.option("--fail", is_flag=True)
@fails_cleanly
def command(fail):
    logging.getLogger("rocketstore.dispatch").error("dispatch failed (puts are refused until it succeeds): %s",
                                                    "[Errno 28] cannot create segment /s/0: No space left on device")
    logging.getLogger("rocketstore.consumequeue").error("queue T-0 set aside: damaged")
    logging.getLogger("rocketstore.store").warning("a warning, as it comes")
    if fail:
        raise StoreIOError(28, "consume queues or index cannot be written ([Errno 28] cannot create segment /s/0: "
                               "No space left on device)")
    print("done")

command()
"""


@pytest.mark.parametrize("fail", [False, True])
def test_a_failing_command_prints_an_error_once(fail):
    """A command that failed on a full disk printed the dispatcher's error line, the close's, then its own: the
    same error three times (the full-disk review). Logged errors its line says already are not printed; others are,
    before it; warnings come as they come; a command that succeeds prints every error."""
    done = subprocess.run([sys.executable, "-c", ERRORS_LOGGED_ONCE, *(["--fail"] if fail else [])],
                          capture_output=True, text=True, timeout=60, check=False)
    lines = done.stderr.splitlines()
    if fail:
        assert done.returncode == 1
        assert lines == ["a warning, as it comes", "queue T-0 set aside: damaged",
                         "error: [Errno 28] consume queues or index cannot be written ([Errno 28] cannot create "
                         "segment /s/0: No space left on device)"]
    else:
        assert done.returncode == 0 and done.stdout == "done\n"
        assert lines == ["a warning, as it comes",
                         "dispatch failed (puts are refused until it succeeds): [Errno 28] cannot create segment /s/0: "
                         "No space left on device", "queue T-0 set aside: damaged"]


def test_a_logged_error_that_says_more_than_the_commands_line_is_printed(caplog):
    """A close's line naming a second error was dropped because it contained the command's line, and a record with
    nothing after its lead-in was dropped whatever the line (the fix review)."""
    import logging

    from rocketstore.cli.app import _says_nothing_more

    def record(message, exc_info=None):
        return logging.LogRecord("rocketstore.store", logging.ERROR, __file__, 1, message, None, exc_info)

    line = "[Errno 5] msync of commitlog failed: Input/output error"
    assert _says_nothing_more(record(f"store /s closed with errors (the next open runs crash recovery): {line}"), line)
    assert _says_nothing_more(record("dispatch failed (puts are refused until it succeeds): [Errno 5] msync of "
                                     "commitlog failed"), line)
    assert not _says_nothing_more(record(f"store /s closed with errors (the next open runs crash recovery): {line}; "
                                         "[Errno 28] cannot flush index file 2026: No space left on device"), line)
    assert not _says_nothing_more(record("store maintenance (flush) failed, the next pass retries: "), line)
    try:
        raise AssertionError(line)
    except AssertionError:
        import sys

        assert not _says_nothing_more(record(f"dispatch failed: {line}", sys.exc_info()), line)

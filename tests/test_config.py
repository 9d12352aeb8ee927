"""StoreConfig: RocketMQ defaults, validation, broker.conf parsing."""

from __future__ import annotations

import shutil

import pytest

from rocketstore import FlushDiskType, StoreConfig
from rocketstore.config import broker_conf_store_root
from rocketstore.errors import ConfigError
from test_cli import cli, tree


def test_defaults_are_rocketmqs():
    c = StoreConfig()
    assert c.mapped_file_size_commit_log == 1 << 30
    assert c.mapped_file_size_consume_queue == 6_000_000
    assert (c.max_hash_slot_num, c.max_index_num, c.max_msgs_num_batch) == (5_000_000, 20_000_000, 64)
    assert c.max_message_size == 4 << 20 and c.flush_disk_type is FlushDiskType.ASYNC_FLUSH
    assert c.delay_levels_ms[:3] == (1000, 5000, 10_000) and c.delay_levels_ms[-1] == 7_200_000
    assert len(c.delay_levels_ms) == 18


@pytest.mark.parametrize("changes", [
    {"mapped_file_size_commit_log": 10},
    {"mapped_file_size_consume_queue": 1001},
    {"max_message_size": 0},
    {"flush_disk_type": "SOMETIMES"},
    {"store_host": "nowhere"},
    {"store_host": "1.2.3.4:70000"},
    {"message_delay_level": "1s 5x"},
    {"max_index_num": True},
])
def test_bad_values_raise_config_error(changes):
    with pytest.raises(ConfigError):
        StoreConfig(**changes)


def test_from_broker_conf_reads_camel_case_keys(tmp_path):
    conf = tmp_path / "broker.conf"
    conf.write_text("# a RocketMQ broker.conf\nbrokerName = broker-a\nflushDiskType=SYNC_FLUSH\n"
                    "mappedFileSizeCommitLog=1048576\nmaxHashSlotNum = 97\ncheckCRCOnRecover=false\n"
                    "messageDelayLevel=1s 2m\n")
    c = StoreConfig.from_broker_conf(conf, max_index_num=500)
    assert c.flush_disk_type is FlushDiskType.SYNC_FLUSH and c.mapped_file_size_commit_log == 1 << 20
    assert (c.max_hash_slot_num, c.max_index_num, c.check_crc_on_recover) == (97, 500, False)
    assert c.delay_levels_ms == (1000, 120_000)
    conf.write_text("maxHashSlotNum=lots\n")
    with pytest.raises(ConfigError, match="maxHashSlotNum"):
        StoreConfig.from_broker_conf(conf)


def test_replace_keeps_validation():
    with pytest.raises(ConfigError):
        StoreConfig().replace(mapped_file_size_commit_log=3)


def _store(root, segments: int = 2):
    """A store in RocketMQ's 4-entries-per-slot geometry (detectable from its files), ``segments`` commit-log
    segments, consume queues of several files and several index files."""
    from rocketstore import Message, MessageStore

    config = StoreConfig(mapped_file_size_commit_log=1 << 14, mapped_file_size_consume_queue=20 * 20,
                         max_hash_slot_num=7, max_index_num=28)
    with MessageStore.open(root, config) as store:
        i = 0
        while store.commit_log.max_offset <= (segments - 1) << 14:
            store.put_message(Message("T" if i % 3 else "U", b"body-%d" % i, keys=[f"k{i}"], queue_id=i % 2))
            i += 1
    return config


def test_one_damaged_file_never_redefines_the_geometry(tmp_path):
    """The first consume-queue file os.walk met, and the newest index file, decided the store's geometry: one
    truncated file made every other queue look damaged (a writer then set them all aside and rebuilt them at
    the damaged size) or made every command fail."""
    import os

    from rocketstore.config import detect_config

    root = tmp_path / "s"
    config = _store(root)
    first_queue_file = next(os.path.join(d, sorted(f)[0]) for d, _, f in os.walk(root / "consumequeue") if f)
    os.truncate(first_queue_file, 100)
    newest_index = sorted((root / "index").iterdir())[-1]
    assert len(list((root / "index").iterdir())) > 2
    os.truncate(newest_index, 300)
    (root / "index" / "29991231235959999").mkdir()  # a directory is no index file
    found = detect_config(root)
    assert found.mapped_file_size_consume_queue == config.mapped_file_size_consume_queue
    assert (found.max_hash_slot_num, found.max_index_num) == (7, 28)
    assert found.mapped_file_size_commit_log == config.mapped_file_size_commit_log


def test_explicit_geometry_wins_over_a_damaged_single_segment(tmp_path):
    """With one segment, a truncated segment's size overrode even the broker.conf's, and a put then wrote a new
    segment of the damaged size after it."""
    import os

    from rocketstore.config import detect_config

    root = tmp_path / "s"
    config = _store(root, segments=1)
    segment = root / "commitlog" / f"{0:020d}"
    os.truncate(segment, 5000)
    assert detect_config(root, config).mapped_file_size_commit_log == 1 << 14
    assert detect_config(root, StoreConfig(), explicit=["mapped_file_size_commit_log"]) \
        .mapped_file_size_commit_log == 1 << 30
    conf = tmp_path / "broker.conf"
    conf.write_text("mappedFileSizeCommitLog=16384\n")
    before = tree(root)
    done = cli("put", "--store", str(root), "--broker-conf", str(conf), "-t", "T", "-p", "x", check=False)
    assert done.returncode == 1 and "segment is 5000 bytes but the configured size is 16384" in done.stderr
    assert tree(root) == before


def test_a_lone_segment_is_the_geometry_only_at_a_size_a_broker_is_configured_with(tmp_path):
    """With no segment size named, a store's only segment defined the geometry whatever its size: one cut short
    (a bad copy, a full disk) became the segment size, the store opened as whole and a put rolled into a new
    segment of that size. A size is taken when a broker plausibly has it (1 GiB, a power-of-two number of 4 KiB
    pages) or the names confirm it; otherwise it is refused until the size is named."""
    import os

    from rocketstore.config import GIB, detect_config, detect_segment_size

    root = tmp_path / "s"
    config = _store(root, segments=1)
    segment = root / "commitlog" / f"{0:020d}"
    assert detect_config(root).mapped_file_size_commit_log == 1 << 14  # plausible: taken
    lone = tmp_path / "lone"
    (lone / "commitlog").mkdir(parents=True)
    for size, start, taken in ((GIB, 0, True), (1 << 12, 0, True), (3 << 12, 0, False), (3 << 12, 9 << 12, True),
                               (5000, 0, False), (5000, 5000, True)):
        for old in (lone / "commitlog").iterdir():
            old.unlink()
        path = lone / "commitlog" / f"{start:020d}"
        path.touch()
        os.truncate(path, size)  # sparse: 1 GiB costs nothing
        if taken:
            assert detect_segment_size(lone) == size, (size, start)
        else:
            with pytest.raises(ConfigError, match="looks cut short"):
                detect_segment_size(lone)

    os.truncate(segment, 5000)
    before = tree(root)
    with pytest.raises(ConfigError, match=f"segment {segment} is 5000 bytes.*--mapped-file-size-commit-log"):
        detect_config(root)
    assert detect_config(root, config).mapped_file_size_commit_log == 1 << 14  # named: the file is the damaged one
    for command in (["inspect"], ["put", "-t", "T", "-p", "x"]):
        done = cli(*command, "--store", str(root), check=False)
        assert done.returncode == 1 and done.stderr.startswith(f"error: commit-log segment {segment} is 5000 bytes")
        assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    done = cli("inspect", "--store", str(root), "--mapped-file-size-commit-log", "16384", check=False)
    assert done.returncode == 1 and "segment is 5000 bytes but the configured size is 16384" in done.stderr
    assert tree(root) == before


def test_a_queue_file_cut_short_is_not_the_queue_geometry(tmp_path):
    """The most common queue file size was the geometry whatever it was: a store's only queue file cut short took
    a size no broker can have (4,096 bytes: every command failed, even with the size named), and one cut short beside
    one intact file won the tie as the smaller size (the intact queue was then set aside and rebuilt at the cut
    size). The configured size now wins such a tie, and a size that is no whole number of entries is refused until
    named, after which the short file is handled as damaged."""
    import os

    from rocketstore import Message, MessageStore
    from rocketstore.config import detect_config

    lone = tmp_path / "lone"
    for sizes, taken in (({("T", 0, 0): 4096}, None), ({("T", 0, 0): 1200}, 1200), ({("T", 0, 2400): 1200}, 1200),
                         ({("T", 0, 0): 6_000_000, ("T", 1, 0): 1200}, 6_000_000),
                         ({("T", 0, 0): 1200, ("T", 1, 0): 6_000_000}, 6_000_000),
                         ({("T", 0, 0): 1200, ("T", 1, 0): 1200, ("U", 0, 0): 6_000_000}, 1200),
                         ({("T", 0, 0): 1200, ("T", 0, 1200): 1000, ("U", 0, 0): 6_000_000}, 1200),
                         ({("T", 0, 0): 4096, ("U", 0, 0): 6_000_000}, 6_000_000),
                         ({("T", 0, 0): 4096, ("U", 0, 0): 4096}, None)):
        for topic, queue, start in sizes:
            path = lone / "consumequeue" / topic / str(queue) / f"{start:020d}"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()
            os.truncate(path, sizes[topic, queue, start])
        if taken is None:
            with pytest.raises(ConfigError, match="no whole number of 20-byte entries: it looks cut short"):
                detect_config(lone)
        else:
            assert detect_config(lone).mapped_file_size_consume_queue == taken, sizes
        shutil.rmtree(lone / "consumequeue")

    root = tmp_path / "s"
    with MessageStore.open(root) as store:
        store.put_message(Message("T", b"first"))
    queue_file = root / "consumequeue" / "T" / "0" / f"{0:020d}"
    os.truncate(queue_file, 4096)
    before = tree(root)
    for command in (["inspect"], ["put", "-t", "T", "-p", "x"]):
        done = cli(*command, "--store", str(root), check=False)
        assert done.returncode == 1 and done.stderr.startswith(f"error: consume-queue file {queue_file} is 4096 bytes")
        assert "--mapped-file-size-consume-queue" in done.stderr and "Traceback" not in done.stderr
    assert tree(root) == before
    cli("put", "--store", str(root), "--mapped-file-size-consume-queue", "6000000", "-t", "T", "-i", "1",
        "-p", "second")
    with MessageStore.open(root, read_only=True) as store:
        assert [m.body for m in store.get_message("T", 0, 0).messages] == [b"first"]
        assert [m.body for m in store.get_message("T", 1, 0).messages] == [b"second"]
    sizes = {p.relative_to(root / "consumequeue").as_posix(): p.stat().st_size
             for p in (root / "consumequeue").rglob("*") if p.is_file()}
    assert sizes == {f"T/0/{0:020d}": 6_000_000, f"T/1/{0:020d}": 6_000_000}


def test_a_queue_file_size_is_rounded_up_to_whole_entries_as_a_broker_does(tmp_path):
    """A broker reads mappedFileSizeConsumeQueue rounded up to a multiple of 20; a broker.conf it takes was refused."""
    conf = tmp_path / "broker.conf"
    conf.write_text("mappedFileSizeConsumeQueue=1001\n")
    assert StoreConfig.from_broker_conf(conf).mapped_file_size_consume_queue == 1020
    root = tmp_path / "s"
    for option in (["--broker-conf", str(conf)], ["--mapped-file-size-consume-queue", "1001"]):
        cli("put", "--store", str(root), *option, "-t", "T", "-p", "x")
        assert (root / "consumequeue" / "T" / "0" / f"{0:020d}").stat().st_size == 1020
    with pytest.raises(ConfigError, match="multiple of 20"):  # the Python API takes the size as given
        StoreConfig(mapped_file_size_consume_queue=1001)


def test_rebuild_keeps_a_segment_size_the_command_line_named_even_rocketmqs_default(tmp_path):
    """rebuild detected the geometry again from a config whose named values it could no longer tell apart from
    RocketMQ's defaults: a named 1 GiB was replaced by a lone segment's size (or, for a size no broker has, refused
    with an error asking to name the size that was named)."""
    import os

    root = tmp_path / "s"
    _store(root, segments=1)
    os.truncate(root / "commitlog" / f"{0:020d}", 5000)
    done = cli("rebuild", "--no-spark", "--store", str(root), "--mapped-file-size-commit-log", str(1 << 30),
               check=False)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "segment is 5000 bytes but the configured size is 1073741824" in done.stderr, done.stderr


def test_an_oversized_segment_is_the_damaged_one_on_a_tie(tmp_path):
    """Two segments, one grown: the tie went to the larger size, and the healthy segment was named as wrong."""
    import os

    from rocketstore.config import detect_segment_size

    root = tmp_path / "s"
    _store(root, segments=2)
    segments = sorted((root / "commitlog").iterdir())
    assert len(segments) == 2
    for grown in segments:
        os.truncate(grown, 20000)
        assert detect_segment_size(root) == 1 << 14
        os.truncate(grown, 1 << 14)
    (root / "commitlog" / f"{1 << 15:020d}").mkdir()  # a directory named like a segment is no segment
    assert detect_segment_size(root) == 1 << 14


def test_an_explicit_queue_or_index_setting_most_files_disagree_with_is_refused(tmp_path):
    """An explicit size is never replaced, but when the files mostly have another one the setting is what is
    wrong: a writer would otherwise set every queue (or index file) aside as damaged and rebuild it at the
    wrong size."""
    import os

    from rocketstore.config import detect_config
    from rocketstore.errors import ConfigError

    root = tmp_path / "s"
    config = _store(root)
    before = tree(root)
    with pytest.raises(ConfigError, match=r"consume-queue files .* are"):
        detect_config(root, config.replace(mapped_file_size_consume_queue=config.mapped_file_size_consume_queue * 2))
    with pytest.raises(ConfigError, match="index files"):
        detect_config(root, config.replace(max_hash_slot_num=11, max_index_num=44))
    conf = tmp_path / "broker.conf"
    conf.write_text(f"mappedFileSizeConsumeQueue={config.mapped_file_size_consume_queue * 2}\n")
    done = cli("put", "--store", str(root), "--broker-conf", str(conf), "-t", "T", "-p", "x", check=False)
    assert done.returncode == 1 and "consume-queue files" in done.stderr and "Traceback" not in done.stderr
    assert tree(root) == before
    first_queue_file = next(os.path.join(d, sorted(f)[0]) for d, _, f in os.walk(root / "consumequeue") if f)
    os.truncate(first_queue_file, 100)  # one file of many disagreeing: damaged, the setting stands
    assert detect_config(root, config).mapped_file_size_consume_queue == config.mapped_file_size_consume_queue


def test_a_broker_conf_is_read_as_java_properties(tmp_path):
    """The broker reads broker.conf with java.util.Properties.load: ':' and blanks separate keys too, a trailing
    backslash continues a line, escapes are read, and a value keeps its trailing blanks. Only 'key=value' lines
    were read: a storePathRootDir written 'storePathRootDir: /x' or over two lines was not (the disk review)."""
    from rocketstore.config import broker_conf_store_root

    conf = tmp_path / "broker.conf"
    conf.write_text("! a comment\nstorePathRootDir: /data/\\\n    store\nmaxHashSlotNum 97\n"
                    "maxIndex\\u004eum=388\n  # indented comment\n")
    assert broker_conf_store_root(conf) == "/data/store"
    c = StoreConfig.from_broker_conf(conf)
    assert (c.max_hash_slot_num, c.max_index_num) == (97, 388)
    conf.write_text("maxHashSlotNum=97  \n")
    with pytest.raises(ConfigError, match="a broker reads no number there either"):
        StoreConfig.from_broker_conf(conf)
    conf.write_text("storePathRootDir=/data/store \t\n")  # a String setting: the broker trims it
    assert broker_conf_store_root(conf) == "/data/store"


def test_broker_conf_keys_are_matched_as_the_broker_matches_them(tmp_path):
    """``MixAll.properties2Object`` looks each setting up by its exact name (the setter's, first letter lowered): a
    key in another case is ignored by the broker, so it must be here too, or rocketstore would run with a setting
    the broker does not have (a CRC check off, another store root)."""
    conf = tmp_path / "broker.conf"
    conf.write_text("checkcrconrecover=false\nMaxHashSlotNum=97\nSTOREPATHROOTDIR=/elsewhere\n"
                    "fileReservedTime=5\ncheckCRCOnRecover=true\nenabledAppendPropCRC=true\n")
    c = StoreConfig.from_broker_conf(conf)
    assert c.check_crc_on_recover is True and c.max_hash_slot_num == StoreConfig().max_hash_slot_num
    assert (c.file_reserved_time, c.enabled_append_prop_crc) == (5, True)
    assert broker_conf_store_root(conf) is None
    conf.write_text("storePathRootDir = /data/store \n")
    assert broker_conf_store_root(conf) == "/data/store"

"""StoreConfig: RocketMQ defaults, validation, broker.conf parsing."""

from __future__ import annotations

import pytest

from rocketstore import FlushDiskType, StoreConfig
from rocketstore.errors import ConfigError


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

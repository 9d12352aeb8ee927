"""Shared fixtures: small-geometry store configs and the golden vectors directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rocketstore import StoreConfig

VECTORS_DIR = Path(__file__).resolve().parents[2] / "shared" / "vectors"


def pytest_configure(config):
    """In CI the golden vectors must be there: a byte-compatibility suite that skips is not a pass. (Checked at
    configure, which the xdist controller runs too: raised in a worker's collection it was an INTERNALERROR.)"""
    if os.environ.get("CI") and not VECTORS_DIR.is_dir():
        raise pytest.UsageError(f"CI=true but the golden vectors are missing at {VECTORS_DIR}")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """``xdist_group`` must keep a group on one worker (one Spark cluster, one serve fleet): xdist does it by
    renaming items to ``<id>@<group>``, which pytest 9 ignored without a word. Checked in each worker."""
    if getattr(config.option, "loadgroup", False):
        lost = [item.nodeid for item in items if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
        if lost:
            raise pytest.UsageError(f"--dist loadgroup does not group {lost[0]} (pytest and pytest-xdist disagree)")


@pytest.fixture
def vectors() -> Path:
    if not VECTORS_DIR.is_dir():
        pytest.skip(f"golden vectors not found at {VECTORS_DIR}")
    return VECTORS_DIR


@pytest.fixture
def small_config() -> StoreConfig:
    """4 KiB commit-log segments: rolls happen after a handful of messages."""
    return StoreConfig(mapped_file_size_commit_log=4096, mapped_file_size_consume_queue=20 * 50,
                       max_hash_slot_num=97, max_index_num=500, flush_interval_commit_log=10)


@pytest.fixture(scope="session")
def spark():
    """One local[2] SparkSession for the suite (per xdist worker; starting one costs 7-10 s with the class archive)."""
    pytest.importorskip("pyspark")
    from rocketstore.spark import classcache, spark_session

    classcache.record()  # ./dev made it already; a bare pytest run makes it once (a minute) for every JVM after
    session = spark_session("local[2]", "rocketstore-tests", driver_memory="1g", shuffle_partitions=2)
    yield session
    session.stop()

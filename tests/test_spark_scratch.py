"""Spark scratch directories: a killed process's is removed by the next one, a live one's never."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("pyspark")

from rocketstore.spark.session import OWNER_FILE, SCRATCH_PREFIX, sweep_scratch_dirs

MAKE_AND_WAIT = """
import sys, tempfile
tempfile.tempdir = sys.argv[1]
from rocketstore.spark.session import _scratch_dir
print(_scratch_dir(), flush=True)
sys.stdin.read()
"""


def _owner(tmp_path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", MAKE_AND_WAIT, str(tmp_path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


def test_a_killed_owners_directory_goes_and_a_live_ones_stays(tmp_path):
    live, live_dir = _owner(tmp_path)
    killed, killed_dir = _owner(tmp_path)
    try:
        assert os.path.isfile(os.path.join(killed_dir, OWNER_FILE))
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait()
        assert os.path.isdir(killed_dir)  # atexit did not run
        assert sweep_scratch_dirs(str(tmp_path)) == [killed_dir]
        assert not os.path.exists(killed_dir) and os.path.isdir(live_dir)
        assert sweep_scratch_dirs(str(tmp_path)) == []
    finally:
        live.stdin.close()
        live.wait()
    assert not os.path.exists(live_dir)  # its own exit removed it


def test_directories_without_an_owner_file_go_only_when_a_day_old(tmp_path):
    fresh = tmp_path / f"{SCRATCH_PREFIX}fresh"  # being made right now, or an older version's
    old = tmp_path / f"{SCRATCH_PREFIX}old"
    other = tmp_path / "something-else"
    for d in (fresh, old, other):
        d.mkdir()
    day_ago = time.time() - 2 * 24 * 3600
    os.utime(old, (day_ago, day_ago))
    os.utime(other, (day_ago, day_ago))
    assert sweep_scratch_dirs(str(tmp_path)) == [str(old)]
    assert fresh.is_dir() and other.is_dir()

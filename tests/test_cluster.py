"""Spark on a real standalone cluster (a master and one worker on 127.0.0.1), as an operator runs it.

The worker's executors run a virtual environment without rocketstore (its third-party
dependencies only), so every job here proves the package is shipped; paths are relative, as
people type them; one directory is hidden from the worker (a private mount namespace), as on a
host where a store is not mounted. One cluster serves the module; it is stopped by pid.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("pyspark")

import standalone
from rocketstore import MessageStore
from rocketstore.spark.jobs import rebuild
from rocketstore.spark.shipping import ENV_NAME, package_zip, packed_environment
from test_spark import CONFIG, build_store, counter_clock, tree

pytestmark = pytest.mark.xdist_group("cluster")  # one worker starts the module's cluster

ROCKETSTORE = str(Path(sys.executable).with_name("rocketstore"))
TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = standalone.java_missing()
    if why:
        pytest.skip(why)
    base = tmp_path_factory.mktemp("cluster")
    hidden = base / "work" / "hidden" if standalone.can_hide() is None else None
    started = standalone.start(base / "logs", hidden=hidden)
    try:
        yield started, base, hidden
    finally:
        started.stop()


@pytest.fixture(scope="module")
def work(cluster):
    """Stores a and b (and hidden/s when a directory can be hidden), a bare venv for the executors."""
    _, base, hidden = cluster
    work = base / "work"
    work.mkdir(exist_ok=True)
    build_store(work / "a", 300, clock=counter_clock(), seed=0)
    build_store(work / "b", 200, clock=counter_clock(), seed=1)
    if hidden is not None:
        # written around the namespace: the driver sees it, the worker sees an empty tmpfs there
        build_store(hidden / "s", 10)
    (work / "broker.conf").write_text(f"mappedFileSizeConsumeQueue={CONFIG.mapped_file_size_consume_queue}\n"
                                      f"maxHashSlotNum={CONFIG.max_hash_slot_num}\nmaxIndexNum={CONFIG.max_index_num}\n")
    python = standalone.bare_venv(base / "wenv")
    return work, python


def _env(python: Path) -> dict[str, str]:
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=str(python))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS.parent), env.get("PYTHONPATH")]))
    return env


def _run(command: list[str], cwd: Path, env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def _results(stdout: str) -> dict:
    out: dict = {}
    for line in stdout.splitlines():
        if line.startswith("{"):
            out.update(json.loads(line))
    return out


def test_the_bare_worker_python_cannot_import_rocketstore(work):
    _, python = work
    probe = subprocess.run([str(python), "-c", "import numpy, pyarrow, numba; import rocketstore"],
                           capture_output=True, text=True, check=False)
    assert probe.returncode != 0 and "No module named 'rocketstore'" in probe.stderr


def test_every_job_on_the_cluster_with_relative_paths(cluster, work, spark):
    """Data source over two stores, rebuild, export, import, find_keys, and a store the worker cannot see."""
    started, _, hidden = cluster
    root, python = work
    for name in ("r", "local"):  # two copies of store a's log: rebuilt on the cluster and in local mode
        (root / name).mkdir()
        shutil.copytree(root / "a" / "commitlog", root / name / "commitlog")
        shutil.copy(root / "a" / "checkpoint", root / name / "checkpoint")
    result = _run([sys.executable, str(TESTS / "cluster_jobs.py"), started.url], root, _env(python))
    assert result.returncode == 0, result.stderr[-5000:]
    got = _results(result.stdout)
    executables = {python for python, _cwd, _module in got["executors"]}
    assert executables == {str(python)}
    assert all(module.startswith("./rocketstore.zip/") for _, _, module in got["executors"])  # shipped, not installed
    with MessageStore.open(root / "a", CONFIG, read_only=True) as a, MessageStore.open(root / "b", CONFIG,
                                                                                        read_only=True) as b:
        ids_a = [m.msg_id for m in a.iter_messages()]
        ids_b = [m.msg_id for m in b.iter_messages()]
        expected_found = sorted([store, key, m.msg_id] for store, s in (("a", a), ("b", b))
                                for topic, key in (("Topic1", "k0-1"), ("Topic0", "k1-2"), ("Topic0", "g3"))
                                for m in s.query_message(topic, key))
    assert got["rebuilt"] == len(ids_a)
    rebuild(root / "local", spark=spark, config=CONFIG, clock=counter_clock())
    assert tree(root / "r", "consumequeue") == tree(root / "local", "consumequeue") == tree(root / "a", "consumequeue")
    cluster_index = [(root / "r" / "index" / n).read_bytes() for n in sorted(os.listdir(root / "r" / "index"))]
    local_index = [(root / "local" / "index" / n).read_bytes() for n in sorted(os.listdir(root / "local" / "index"))]
    assert len(cluster_index) > 1 and cluster_index == local_index  # names are times; contents must agree
    assert got["per_store"] == {"a": len(ids_a), "b": len(ids_b)}
    assert got["msg_ids"] == sorted(ids_a + ids_b)
    assert got["exported"] == len(ids_a)
    assert got["imported"] == len(ids_a)
    with MessageStore.open(root / "c", read_only=True) as c:
        assert sorted(m.body for m in c.iter_messages()) == sorted(m.body for m in _messages(root / "a"))
    assert got["found"] == expected_found and len(expected_found) >= 3
    if hidden is None:
        pytest.skip(f"store visibility not tested: {standalone.can_hide()}")
    line = got["hidden"]
    assert line.startswith("StoreNotVisibleError: store ") and str(hidden / "s") in line
    assert "mount it at the same path on every worker" in line
    assert re.search(r"\(in partition \d+ of stage \d+, attempt \d+, on host ", line)  # the task that failed first
    # an --out the executors do not share: they wrote the rows on their own disk, and the driver, listing none,
    # reported "exported 0 messages" with exit 0 (the cluster review); refused now, nothing left at --out
    assert "the executors wrote" in got["unshared_out"] and "of which this driver sees 0" in got["unshared_out"]
    assert not (hidden / "exp").exists()


def _messages(root: Path) -> list:
    with MessageStore.open(root, CONFIG, read_only=True) as store:
        return list(store.iter_messages())


def test_an_executor_failure_is_one_line_and_exit_1(cluster, work):
    """What an operator types, with a relative path the driver must make absolute before executors see it."""
    started, _, hidden = cluster
    root, python = work
    if hidden is None:
        pytest.skip(f"needs a directory hidden from the worker: {standalone.can_hide()}")
    result = _run([ROCKETSTORE, "export", "--store", "hidden/s", "--broker-conf", "broker.conf", "--out", "x",
                   "--master", started.url], root, _env(python))
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "is not visible from the executor on host" in errors[0], result.stderr
    assert "\tat " not in result.stderr and "Traceback" not in result.stderr
    assert not (root / "x").exists() or not any((root / "x").rglob("*.parquet"))



@pytest.mark.slow
def test_a_shipped_environment_runs_on_a_worker_without_rocketstore(tmp_path, request):
    """--ship-env: the executors run the packed venv (~800 MB here; 80 s), not the worker's Python."""
    if "slow" not in request.config.getoption("markexpr"):
        pytest.skip("long form: run with -m slow (the quick form unpacks the archive and runs its interpreter)")
    started, _, _ = request.getfixturevalue("cluster")  # after the skip: a skipped test starts no cluster
    root, python = request.getfixturevalue("work")
    env = _env(python)
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    result = _run([sys.executable, str(TESTS / "cluster_jobs.py"), started.url, "--ship-env"], root, env, 600)
    assert result.returncode == 0, result.stderr[-5000:]
    got = _results(result.stdout)
    assert all(exe.endswith(f"/{ENV_NAME}/bin/python") and exe.startswith(cwd) for exe, cwd, _ in got["executors"])
    assert sum(got["per_store"].values()) == len(got["msg_ids"]) == 322 + 222


def test_the_packed_environment_is_an_interpreter_with_the_dependencies(tmp_path):
    """The quick form of the shipped-environment test: unpack the archive as Spark does and run it."""
    archive = packed_environment(tmp_path / "cache")
    assert packed_environment(tmp_path / "cache") == archive  # cached
    with zipfile.ZipFile(archive) as packed:
        names = packed.namelist()
        assert "pyvenv.cfg" in names and "bin/python" in names
        assert not any("/site-packages/pyspark/" in n or n.startswith("lib64/") for n in names)
        assert not any("/site-packages/rocketstore/" in n for n in names)
        wanted = [n for n in names if n in ("pyvenv.cfg", "bin/python") or any(
            f"/site-packages/{p}/" in n for p in ("numpy", "numpy.libs", "pyarrow", "numba", "llvmlite"))]
        packed.extractall(tmp_path / ENV_NAME, wanted)
    interpreter = tmp_path / ENV_NAME / "bin" / "python"
    interpreter.chmod(0o755)
    probe = subprocess.run([str(interpreter), "-c", "import sys, numpy, pyarrow, numba; import rocketstore.codec.batch;"
                            " print(sys.prefix)"], capture_output=True, text=True, check=False,
                           env={"PYTHONPATH": str(package_zip(tmp_path)), "PATH": os.environ.get("PATH", "")})
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == str(tmp_path / ENV_NAME)

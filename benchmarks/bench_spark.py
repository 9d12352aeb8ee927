"""Spark vs the single-process path on the same store: scan MB/s, rebuild keys/s and import rows/s, as ratios.

    ./dev bench spark            # 1,000,000 messages (about 360 MB of commit log)
    ./dev bench spark --quick    # the CI smoke form: a few thousand messages, checks the harness works

Each Spark figure runs in its own process (a JVM keeps its first master), on local[1],
local[2] and (full form) a standalone cluster started here on 127.0.0.1: one master, one worker
with 2 cores, started from the installed pyspark as README "Running on a cluster" shows.
The baselines run in this process on the same store: ``MessageStore.scan_arrow`` (the compiled
decoder the Spark source uses, CRCs checked) and a count per topic (scan), and the store's own
dispatch after removing consume queues and index (rebuild), and ``put_batch`` of the same rows read from the
same Parquet file (import: ``import_messages`` of a Parquet dataset of the store's messages into a new store,
whose every batch ends in one ``put_batch`` on the driver). Results: a table on stdout and
benchmarks/results/spark.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from harness import Result, peak_rss_mb, save

from rocketstore import MessageStore, StoreConfig

CONFIG = StoreConfig(mapped_file_size_commit_log=64 << 20, max_hash_slot_num=500_000, max_index_num=2_000_000)
RESULTS = Path(__file__).parent / "results"
STANDALONE = "standalone"  # a master and one 2-core worker on 127.0.0.1


def messages_table(start: int, stop: int):
    import pyarrow as pa

    i = range(start, stop)
    return pa.table({"topic": [f"Topic{n % 8}" for n in i], "body": [b"x" * 200] * len(i),
                     "tags": [f"T{n % 3}" for n in i], "keys": [[f"order-{n}", f"user-{n % 977}"] for n in i],
                     "queue_id": pa.array([n % 4 for n in i], pa.int32())})


def build(root: Path, count: int) -> int:
    with MessageStore.open(root, CONFIG) as store:
        for start in range(0, count, 10_000):
            store.put_batch(messages_table(start, min(start + 10_000, count)))
        return store.max_phy_offset


def write_dataset(path: Path, count: int) -> Path:
    """The store's messages as one Parquet file in the import's column names (``queueId``)."""
    import pyarrow.parquet as pq

    with pq.ParquetWriter(path, messages_table(0, 1).rename_columns(IMPORT_NAMES).schema) as writer:
        for start in range(0, count, 100_000):
            writer.write_table(messages_table(start, min(start + 100_000, count)).rename_columns(IMPORT_NAMES))
    return path


IMPORT_NAMES = ["topic", "body", "tags", "keys", "queueId"]


def baseline_import(dataset: Path, root: Path) -> float:
    """The import's work in one process without Spark: the Parquet file read in 10,000-row batches, each one
    ``put_batch`` into a new store, dispatch waited for."""
    import pyarrow.parquet as pq

    shutil.rmtree(root, ignore_errors=True)
    started = time.perf_counter()
    with MessageStore.open(root, CONFIG) as store:
        for batch in pq.ParquetFile(dataset).iter_batches(10_000):
            store.put_batch(batch.rename_columns(["topic", "body", "tags", "keys", "queue_id"]))
        store.wait_for_dispatch(600)
    seconds = time.perf_counter() - started
    shutil.rmtree(root)
    return seconds


def no_spark_import(dataset: Path, root: Path) -> float:
    """``rocketstore import --no-spark``: the same dataset read in this process, checked, journalled, stored."""
    from rocketstore.importing import import_parquet

    shutil.rmtree(root, ignore_errors=True)
    started = time.perf_counter()
    report = import_parquet(dataset, root, config=CONFIG)
    with MessageStore.open(root, CONFIG) as store:  # what import_parquet's close left to dispatch is done here
        store.wait_for_dispatch(600)
    seconds = time.perf_counter() - started
    shutil.rmtree(root)
    if report.rows != pq_rows(dataset):
        raise RuntimeError(f"import_parquet stored {report.rows:,} rows of {pq_rows(dataset):,}")
    return seconds


def pq_rows(dataset: Path) -> int:
    import pyarrow.parquet as pq

    return pq.ParquetFile(dataset).metadata.num_rows


SCANS = {"scan": None, "scan topic": ["topic"]}  # every column but the body / the one column a count reads


def baseline_scan(root: Path, columns: list[str] | None) -> float:
    """The Spark job's work in one process: the compiled decoder (CRCs checked, bodies skipped) and a count per
    topic, over the same columns."""
    started = time.perf_counter()
    with MessageStore.open(root, CONFIG, read_only=True) as store:
        topics: dict[str, int] = {}
        for batch in store.scan_arrow(include_body=False, columns=columns):
            for item in batch.column("topic").value_counts().to_pylist():
                topics[item["values"]] = topics.get(item["values"], 0) + item["counts"]
    return time.perf_counter() - started


def baseline_rebuild(root: Path) -> tuple[float, int]:
    for name in ("consumequeue", "index"):
        shutil.rmtree(root / name, ignore_errors=True)
    started = time.perf_counter()
    with MessageStore.open(root, CONFIG) as store:  # re-dispatches the whole log on open
        keys = sum(f.index_count - 1 for f in store.index.files)
    return time.perf_counter() - started, keys


def cpu_snapshot() -> dict[str, float]:
    """CPU seconds used so far by the whole machine (``busy`` of ``all``) and by Spark's JVM and Python workers
    (``/proc``, Linux; empty elsewhere). The machine runs nothing else during a bench, so the busy share over a
    timed job says how many cores it kept working: a local[1] job that already keeps both cores of a 2-core
    machine busy (its task's Python worker decoding while the JVM converts and aggregates the previous batch)
    leaves local[2] nothing to add."""
    try:
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return {}
    hz = os.sysconf("SC_CLK_TCK")
    snap = {"busy": (sum(ticks) - ticks[3] - ticks[4]) / hz, "all": sum(ticks) / hz, "jvm": 0.0, "python_workers": 0.0}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue  # ended meanwhile
        kind = "jvm" if argv[0].endswith(b"/java") else "python_workers" if b"pyspark.daemon" in argv else None
        if kind:
            fields = stat.rsplit(")", 1)[1].split()
            snap[kind] += (int(fields[11]) + int(fields[12])) / hz
    return snap


def cpu_used(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    if not before or not after:
        return {}
    cores = os.cpu_count() or 1
    return {"cores_busy": round((after["busy"] - before["busy"]) / max(after["all"] - before["all"], 1e-9) * cores, 2),
            "jvm_cpu_s": round(after["jvm"] - before["jvm"], 2),
            "python_workers_cpu_s": round(after["python_workers"] - before["python_workers"], 2)}


def spark_child(root: str, master: str, quick: bool = False) -> dict:
    """Runs in a subprocess: the scans (count per topic), rebuild and import on one master, default partitioning
    (as many tasks as cores, at most 64 MiB each), each timed after a warm-up run (until stop 41 the rebuild was
    timed on its first run in the JVM). ``quick`` (the CI smoke form) runs each job once: no warm-ups, no best of
    two, for a figure that only shows the harness works."""
    from rocketstore.spark import spark_session
    from rocketstore.spark.jobs import import_messages, read_store, rebuild

    spark = spark_session(master, "rocketstore-bench", driver_memory="4g")
    read_store(spark, root).count()  # warm the session and workers
    out = {}
    for name, columns in SCANS.items():
        best = float("inf")
        for _ in range(1 if quick else 2):
            before = cpu_snapshot()
            started = time.perf_counter()
            read_store(spark, root, includeBody=False, columns=columns).groupBy("topic").count().collect()
            seconds = time.perf_counter() - started
            if seconds < best:
                best, out[f"{name}_cpu"] = seconds, cpu_used(before, cpu_snapshot())
        out[f"{name}_s"] = best
    if not quick:
        rebuild(root, spark=spark, config=CONFIG)  # warm-up: the first rebuild in a JVM also compiles Spark's paths
    report = rebuild(root, spark=spark, config=CONFIG)
    # The same rebuild in several windows (a store over 1 GiB is read in windows of at least 1 GiB): the
    # driver writes each window's queues while the next one is decoded, continuing every queue.
    from rocketstore.spark import jobs

    with MessageStore.open(root, CONFIG, read_only=True) as store:
        per_task = max(64 << 10, store.max_phy_offset // 32)
    jobs.REBUILD_WINDOW_BYTES = 1  # windows of 4 tasks per core
    windowed = rebuild(root, spark=spark, config=CONFIG, max_bytes_per_partition=per_task)
    dataset = spark.read.parquet(str(Path(root).parent / DATASET))
    imported = Path(root).parent / f"imported-{os.getpid()}"
    if not quick:
        import_messages(dataset.limit(20_000), imported, config=CONFIG)  # warm-up: the import's jobs and the writer
        shutil.rmtree(imported)
    started = time.perf_counter()
    report_import = import_messages(dataset, imported, config=CONFIG)
    import_s = time.perf_counter() - started
    shutil.rmtree(imported)
    return {**out, "rebuild_s": report.seconds, "keys": report.index_keys, "partitions": report.partitions,
            "windowed_s": windowed.seconds, "windows": windowed.windows, "import_s": import_s,
            "imported": report_import.rows, "import_batches": report_import.batches}


DATASET = "messages.parquet"  # beside the store: what the import reads


def _child(root: Path, master: str, env: dict | None = None, quick: bool = False) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", str(root), master, "quick" if quick else "full"],
                         capture_output=True,
                         text=True, check=False, env=env)
    if out.returncode:  # the child's own error, not only its exit status
        raise RuntimeError(f"the {master} child exited with {out.returncode}:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(count: int, cluster: bool, masters: tuple[str, ...] = ("local[1]", "local[2]"), quick: bool = False) -> dict:
    with tempfile.TemporaryDirectory(prefix="rocketstore-bench-") as tmp:
        root = Path(tmp) / "store"
        log_bytes = build(root, count)
        single = {f"{name}_mb_s": log_bytes / 1e6 / min(baseline_scan(root, columns) for _ in range(2))
                  for name, columns in SCANS.items()}
        rebuild_s, keys = baseline_rebuild(root)
        from rocketstore.rebuild import rebuild as rebuild_here

        here = min(rebuild_here(root, config=CONFIG).seconds for _ in range(2))  # rocketstore rebuild --no-spark
        dataset = write_dataset(Path(tmp) / DATASET, count)
        put_s = min(baseline_import(dataset, Path(tmp) / "put-batch") for _ in range(2))
        no_spark_s = min(no_spark_import(dataset, Path(tmp) / "no-spark") for _ in range(2))
        results = {"messages": count, "log_mb": log_bytes / 1e6,
                   "single_process": {**single, "rebuild_keys_s": keys / rebuild_s, "no_spark_keys_s": keys / here,
                                      "import_rows_s": count / put_s, "no_spark_import_rows_s": count / no_spark_s}}
        children = {master: _child(root, master, quick=quick) for master in masters}
        if cluster:
            sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
            import standalone

            started = standalone.start(Path(tmp) / "cluster", cores=2)
            try:
                env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1")
                children[STANDALONE] = _child(root, started.url, env)
            finally:
                started.stop()
        for master, child in children.items():
            results[master] = {**{f"{name}_mb_s": log_bytes / 1e6 / child[f"{name}_s"] for name in SCANS},
                               **{f"{name}_cpu": child[f"{name}_cpu"] for name in SCANS},
                               "rebuild_keys_s": child["keys"] / child["rebuild_s"], "partitions": child["partitions"],
                               "windowed_keys_s": child["keys"] / child["windowed_s"], "windows": child["windows"],
                               "import_rows_s": child["imported"] / child["import_s"],
                               "import_batches": child["import_batches"]}
            if child["imported"] != count:  # a figure for fewer rows than the dataset's would be no figure
                raise RuntimeError(f"{master} imported {child['imported']:,} rows of {count:,}")
    return results


def table(results: dict) -> str:
    base = results["single_process"]
    lines = [f"Spark pipeline, {results['messages']:,} messages ({results['log_mb']:.0f} MB of commit log)",
             f"{'path':<16}" + "".join(f"{name + ' MB/s':>18}{'ratio':>7}" for name in SCANS)
             + f"{'rebuild keys/s':>17}{'ratio':>7}{'import rows/s':>16}{'ratio':>7}"]
    for path in ("single_process", "local[1]", "local[2]", STANDALONE):
        if path not in results:
            continue
        r = results[path]
        lines.append(f"{path:<16}" + "".join(f"{r[f'{n}_mb_s']:>18,.1f}{r[f'{n}_mb_s'] / base[f'{n}_mb_s']:>7.2f}"
                                             for n in SCANS)
                     + f"{r['rebuild_keys_s']:>17,.0f}{r['rebuild_keys_s'] / base['rebuild_keys_s']:>7.2f}"
                     + f"{r['import_rows_s']:>16,.0f}{r['import_rows_s'] / base['import_rows_s']:>7.2f}")
    if "local[1]" not in results:
        return "\n".join(lines)
    two, one = results["local[2]"], results["local[1]"]
    lines.append("2 cores vs 1 core: " + ", ".join(f"{n} x{two[f'{n}_mb_s'] / one[f'{n}_mb_s']:.2f}" for n in SCANS)
                 + f", rebuild x{two['rebuild_keys_s'] / one['rebuild_keys_s']:.2f}"
                 + f", import x{two['import_rows_s'] / one['import_rows_s']:.2f}")
    for master in ("local[1]", "local[2]"):
        for n in SCANS:
            cpu = results[master].get(f"{n}_cpu")
            if cpu:
                lines.append(f"{master} {n}: {cpu['cores_busy']:.2f} of {os.cpu_count()} cores busy; CPU s: JVM "
                             f"{cpu['jvm_cpu_s']:.2f}, Python workers {cpu['python_workers_cpu_s']:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke form for CI")
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--child", nargs=3, metavar=("ROOT", "MASTER", "QUICK"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        root, master, quick = args.child
        print(json.dumps(spark_child(root, master, quick == "quick")))
        return 0
    # The smoke form starts one JVM, not two: it checks the harness, not the scaling.
    results = run(3000 if args.quick else args.messages, cluster=not args.quick,
                  masters=("local[2]",) if args.quick else ("local[1]", "local[2]"), quick=args.quick)
    print(table(results))
    RESULTS.mkdir(exist_ok=True)
    base, two = results["single_process"], results["local[2]"]
    rows = []
    for name in SCANS:
        label = f"{name} (no body)" if name == "scan" else f"{name} (columns=['topic'])"
        if "local[1]" in results:
            one = results["local[1]"]
            rows.append(Result("spark", f"{label} local[2] vs local[1]", two[f"{name}_mb_s"], "MB/s",
                               f"local[1], {one[f'{name}_mb_s']:.1f} MB/s", one[f"{name}_mb_s"], 1.6,
                               notes={"cpu_local[1]": one[f"{name}_cpu"], "cpu_local[2]": two[f"{name}_cpu"]}))
        rows.append(Result("spark", f"{label} local[2] vs one process", two[f"{name}_mb_s"], "MB/s",
                           f"scan_arrow in one process, {base[f'{name}_mb_s']:.1f} MB/s", base[f"{name}_mb_s"], 1.0))
    if "local[1]" in results:
        one = results["local[1]"]
        rows.append(Result("spark", "rebuild local[2] vs local[1]", two["rebuild_keys_s"], "keys/s",
                           f"local[1], {one['rebuild_keys_s']:,.0f} keys/s", one["rebuild_keys_s"], 1.6))
    rows.append(Result("spark", "rebuild local[2] vs one process", two["rebuild_keys_s"], "keys/s",
                       f"single process, {base['rebuild_keys_s']:,.0f} keys/s", base["rebuild_keys_s"]))
    rows.append(Result("spark", "rebuild --no-spark (this process) vs the store's dispatch", base["no_spark_keys_s"],
                       "keys/s", f"the store's own dispatch, {base['rebuild_keys_s']:,.0f} keys/s",
                       base["rebuild_keys_s"]))
    rows.append(Result("spark", f"rebuild local[2] in {two['windows']} windows vs in one", two["windowed_keys_s"],
                       "keys/s", f"one window, {two['rebuild_keys_s']:,.0f} keys/s", two["rebuild_keys_s"]))
    rows.append(Result("spark", "import of a Parquet file, local[2] vs put_batch here", two["import_rows_s"], "rows/s",
                       f"put_batch of its batches, {base['import_rows_s']:,.0f}/s", base["import_rows_s"],
                       notes={"batches": two["import_batches"]}))
    rows.append(Result("spark", "import --no-spark of a Parquet file vs put_batch here", base["no_spark_import_rows_s"],
                       "rows/s", f"put_batch of its batches, {base['import_rows_s']:,.0f}/s", base["import_rows_s"]))
    if STANDALONE in results:
        cluster = results[STANDALONE]
        rows += [
            Result("spark", "scan (no body) standalone (1 worker) vs local[2]", cluster["scan_mb_s"], "MB/s",
                   f"local[2], {two['scan_mb_s']:.1f} MB/s", two["scan_mb_s"]),
            Result("spark", "rebuild standalone (1 worker) vs local[2]", cluster["rebuild_keys_s"], "keys/s",
                   f"local[2], {two['rebuild_keys_s']:,.0f} keys/s", two["rebuild_keys_s"]),
        ]
    save("spark-quick" if args.quick else "spark", rows, {"raw": results, "peak_rss_mb": peak_rss_mb()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

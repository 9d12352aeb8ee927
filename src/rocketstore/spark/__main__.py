"""Run a pipeline job: ``python -m rocketstore.spark JOB ... [--master URL]``.

Jobs::

    summary     STORE...                      messages per topic and per minute
    rebuild     STORE                         consume queues and index files from the commit log
    export      STORE... --out DIR            Parquet, partitioned by topic and date
    import      STORE --parquet DIR           append a Parquet dataset of messages (topic, body, ...)
    find-keys   STORE... --key TOPIC:KEY ...  messages by key across stores (exact)

Progress goes to stderr on a terminal; errors are one line on stderr and exit code 1.
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
from pathlib import Path

from ..config import StoreConfig
from ..errors import RocketStoreError
from .session import DEFAULT_MASTER


def _progress(enabled: bool):
    if not enabled:
        return None

    def show(stage: str, done: int, total: int) -> None:
        suffix = f"{done}/{total} tasks" if total else f"{done}"
        print(f"\r{stage}: {suffix}   ", end="", file=sys.stderr, flush=True)

    return show


def _config(args) -> StoreConfig:
    return StoreConfig(max_hash_slot_num=args.max_hash_slot_num, max_index_num=args.max_index_num)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rocketstore.spark", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:]))
    parser.add_argument("--master", default=DEFAULT_MASTER, help="Spark master URL (default: local[*])")
    parser.add_argument("--ship-env", action="store_true",
                        help="ship this virtual environment to the executors (workers need only Java and Python)")
    parser.add_argument("-v", "--verbose", action="store_true", help="Spark's warnings and executors' stack traces")
    parser.add_argument("--max-hash-slot-num", type=int, default=5_000_000, help="the broker's maxHashSlotNum")
    parser.add_argument("--max-index-num", type=int, default=20_000_000, help="the broker's maxIndexNum")
    jobs = parser.add_subparsers(dest="job", required=True)
    summary = jobs.add_parser("summary", help="messages per topic and per minute")
    summary.add_argument("stores", nargs="+")
    build = jobs.add_parser("rebuild", help="rebuild consume queues and index files")
    build.add_argument("store")
    export = jobs.add_parser("export", help="export to Parquet")
    export.add_argument("stores", nargs="+")
    export.add_argument("--out", required=True)
    export.add_argument("--topics", help="comma-separated topics")
    export.add_argument("--overwrite", action="store_true", help="replace a non-empty --out (once complete)")
    imp = jobs.add_parser("import", help="import a Parquet dataset of messages")
    imp.add_argument("store")
    imp.add_argument("--parquet", required=True)
    keys = jobs.add_parser("find-keys", help="find messages by key across stores")
    keys.add_argument("stores", nargs="+")
    keys.add_argument("--key", action="append", required=True, metavar="TOPIC:KEY")
    args = parser.parse_args(argv)

    pairs = []
    for item in getattr(args, "key", None) or ():
        topic, sep, key = item.partition(":")
        if not sep or not topic or not key:
            parser.error(f"--key takes TOPIC:KEY, not {item!r}")
        pairs.append((topic, key))
    progress = _progress(sys.stderr.isatty())
    try:
        from . import jobs as job
        from .partitions import resolve_roots
        from .session import spark_session, stop_quietly

        for store in getattr(args, "stores", None) or [args.store]:
            if args.job != "import":
                resolve_roots(store)  # a missing store fails here, before a JVM starts
        spark = spark_session(args.master, ship_env=args.ship_env, verbose=args.verbose)
        atexit.register(stop_quietly, spark)  # no daemon traceback after the last line
        if args.job == "summary":
            df = job.read_store(spark, args.stores, columns=["topic", "storeTimestamp"])  # all the summary reads
            per_topic, per_minute = job.messages_per_topic_and_minute(df)
            for row in per_topic.collect():
                print(f"{row.topic}\t{row['count']}")
            for row in per_minute.collect():
                print(f"{row.minute:%Y-%m-%dT%H:%M}\t{row['count']}")
        elif args.job == "rebuild":
            report = job.rebuild(args.store, spark=spark, config=_config(args), progress=progress)
            print(f"rebuilt {report.queue_units} queue units in {report.queues} queues and {report.index_keys} "
                  f"index keys in {report.index_files} files from {report.records} records in {report.seconds:.1f} s")
        elif args.job == "export":
            topics = args.topics.split(",") if args.topics else None
            count = job.export_parquet(args.stores, args.out, spark=spark, topics=topics, overwrite=args.overwrite,
                                       progress=progress)
            print(f"exported {count} messages to {args.out}")
        elif args.job == "import":
            parquet = args.parquet if "://" in args.parquet else os.path.abspath(args.parquet)  # not the JVM's cwd
            report = job.import_messages(job.read_parquet(spark, parquet), Path(args.store), config=_config(args),
                                         progress=progress)
            print(f"imported {report.rows} messages in {report.batches} batches")
        elif args.job == "find-keys":
            for row in job.find_keys(args.stores, pairs, spark=spark, config=_config(args)).collect():
                print(f"{row.queryTopic}\t{row.queryKey}\t{row.brokerName}\t{row.msgId}\t{row.commitLogOffset}")
    except RocketStoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # Spark wraps task failures; show the cause and the task, not a JVM stack
        from .failures import one_line

        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 1
    finally:
        if progress is not None:
            print(file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The driver side of the cluster tests: every pipeline job in one application, relative paths only.

Run as ``python cluster_jobs.py MASTER [--ship-env]`` in a directory holding stores ``a`` and
``b``, the log of ``a`` alone in ``r`` (to rebuild) and ``hidden/s``, which the worker cannot see.
Prints one JSON object per result.
"""

from __future__ import annotations

import json
import os
import sys

from rocketstore import StoreConfig
from rocketstore.spark.failures import one_line
from rocketstore.spark.jobs import export_parquet, find_keys, import_messages, read_store, rebuild
from rocketstore.spark.session import spark_session


def emit(name: str, value) -> None:
    print(json.dumps({name: value}), flush=True)


def main(master: str, ship_env: bool) -> None:
    spark = spark_session(master, "rocketstore-cluster-test", ship_env=ship_env)
    sc = spark.sparkContext
    emit("executors", sorted(set(sc.parallelize(range(4), 4).map(lambda _: tuple(_where())).collect())))
    both = read_store(spark, ["a", "b"])
    emit("per_store", {r.brokerName: r["count"] for r in both.groupBy("brokerName").count().collect()})
    emit("msg_ids", sorted(r.msgId for r in both.select("msgId").collect()))
    if ship_env:
        return
    config = StoreConfig(mapped_file_size_consume_queue=2000, max_hash_slot_num=97, max_index_num=300)
    emit("rebuilt", rebuild("r", spark=spark, config=config).records)
    emit("exported", export_parquet("a", "out", spark=spark))
    report = import_messages(spark.read.parquet("out"), "c")
    emit("imported", report.rows)
    pairs = [("Topic1", "k0-1"), ("Topic0", "k1-2"), ("Topic0", "g3")]
    found = find_keys(["a", "b"], pairs, spark=spark, config=config)
    emit("found", sorted([r.brokerName, r.queryKey, r.msgId] for r in found.collect()))
    try:
        read_store(spark, "hidden/s").count()
        emit("hidden", None)
    except Exception as exc:
        emit("hidden", one_line(exc))
    if os.path.isdir("hidden"):  # an --out the executors do not share: their rows land on their own disks
        try:
            emit("unshared_out", export_parquet("a", "hidden/exp", spark=spark))
        except Exception as exc:
            emit("unshared_out", one_line(exc))


def _where() -> list[str]:
    import os

    import rocketstore

    return [sys.executable, os.getcwd(), rocketstore.__file__]


if __name__ == "__main__":
    main(sys.argv[1], "--ship-env" in sys.argv[2:])

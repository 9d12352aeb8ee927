"""The ``rocketmq`` Spark data source: RocketMQ store directories as DataFrames.

Batch::

    spark.read.format("rocketmq").load("/data/broker-a/store")                  # one store
    spark.read.format("rocketmq").load("/data/broker-*/store")                  # a glob: several brokers
    spark.read.format("rocketmq").option("topics", "TopicA,TopicB")
         .option("startingTimestamp", 1700000000000).load(path)

Streaming (offsets are commit-log offsets per store, so a query can follow a live store)::

    spark.readStream.format("rocketmq").load(path).writeStream...

Columns follow RocketMQ's ``MessageExt`` and Spark's Kafka source: topic, queueId, queueOffset,
commitLogOffset, msgId, uniqKey, keys, tags, body, properties, bornTimestamp, storeTimestamp,
bornHost, storeHost, sysFlag, flag, reconsumeTimes, preparedTransactionOffset, storeSize,
bodyCRC, brokerName. This API has no column pruning, so a scan that needs a few columns should say so
with a schema naming them, in any order (``.schema("topic string, storeTimestamp timestamp")``, or
``read_store(spark, path, columns=[...])``): only those are decoded and handed to Spark (a count per topic
runs ~3x faster than over every column).

Options (all optional; names ignore case; a name not listed here is refused, with the nearest one named):

==========================  ===================================================================
``topics``                  comma-separated topics to keep
``startingTimestamp``       store time, epoch ms, inclusive; ``endingTimestamp`` exclusive
``startingOffset``          commit-log offset, inclusive; ``endingOffset`` exclusive
``validatedLogEnd``         the log's end as a recovery under the store's lock found it (the rebuild
                            passes its own): planning takes it instead of recovering the log again
``maxBytesPerPartition``    bytes of log per task at most (default 64 MiB); tasks are of equal bytes
``minPartitions``           at least this many tasks (``read_store`` passes the session's parallelism)
``checkCRC``                verify body CRCs (default true); a failing record is never returned
``onCorrupt``               ``fail`` (default) or ``skip`` (log it with file and offset, go on)
``corruptLog``              with ``skip``: a directory where tasks list what they skipped
                            (``rocketstore.spark.partitions.corrupt_report`` reads it back)
``includeBody``             false leaves ``body`` null (faster scans)
``brokerName``              the brokerName column for a single store (default: directory name)
``mappedFileSizeCommitLog`` segment size (default: the size of the segment files found)
``dispatchInfo``            true adds tagsCode and indexKeyHashes (used by the rebuild job)
``messageDelayLevel``       the broker's delay levels (``"1s 5s 10s ..."``): a delayed message's tagsCode is
                            its due time (default: RocketMQ's 18 levels)
``columns``                 comma-separated columns to decode, as a schema naming them would
``packArrow``               true returns one row per ~8 MiB of decoded batches: column ``arrow``, an
                            Arrow IPC stream of the columns (for jobs collecting to the driver:
                            ``partitions.unpacked`` reads them back; the JVM never sees the records)
==========================  ===================================================================

Filter pushdown is not used (measured wrong in this Spark build, see SPARK.md); use the options.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from pyspark.sql.datasource import DataSource, DataSourceReader, DataSourceStreamReader, InputPartition

from ..errors import ConfigError
from .failures import in_task
from .heap import settle_after_task
from .partitions import (
    DISPATCH_DDL,
    MESSAGE_DDL,
    PACKED_COLUMN,
    PACKED_DDL,
    LogRange,
    ScanOptions,
    ddl_fields,
    log_bounds,
    packed,
    plan_ranges,
    read_range,
    resolve_roots,
)


@dataclass
class RangePartition(InputPartition):
    """One task's byte ranges, in log order (pickled to the executor)."""

    ranges: list[LogRange]
    options: ScanOptions

    def __init__(self, ranges: list[LogRange], options: ScanOptions) -> None:
        super().__init__(ranges)
        self.ranges = ranges
        self.options = options

    def read(self):
        with in_task():
            batches = (batch for log_range in self.ranges for batch in read_range(log_range, self.options))
            yield from packed(batches, self.options.output_schema) if self.options.packed else batches
        settle_after_task()


class RocketMQDataSource(DataSource):
    """``format("rocketmq")``: see the module docstring."""

    @classmethod
    def name(cls) -> str:
        return "rocketmq"

    def _scan_options(self) -> ScanOptions:
        return ScanOptions.from_options(dict(self.options))

    def _paths(self) -> str:
        path = self.options.get("path") or self.options.get("paths")  # Spark's options are case-insensitive
        if not path:
            raise ValueError("rocketmq source: give the store root(s) as load(path) or option('path', ...)")
        return path

    def schema(self) -> str:
        options = self._scan_options()
        if options.packed:
            return PACKED_DDL
        if options.columns:  # the columns option: the schema names what the tasks return
            types = dict(ddl_fields(MESSAGE_DDL + DISPATCH_DDL))
            return ", ".join(f"{name} {types[name]}" for name in options.columns)
        return MESSAGE_DDL + (DISPATCH_DDL if options.dispatch_info else "")

    def _options_for(self, schema) -> ScanOptions:
        """A schema the user gave (``.schema("topic string, storeTimestamp timestamp")``) picks the columns:
        only those are decoded and handed to Spark (this API has no column pruning of its own)."""
        fields = [(f.name, f.dataType.simpleString()) for f in schema.fields] if hasattr(schema, "fields") else None
        options = self._scan_options()
        if options.packed:  # the schema is the packed one; option columns names what is inside
            if fields and fields != [(PACKED_COLUMN, "binary")]:
                raise ConfigError(f"with packArrow the rocketmq source's schema is {PACKED_DDL!r}; name the "
                                  "columns with the columns option")
            return options
        return options.with_schema(fields) if fields else options

    def reader(self, schema) -> DataSourceReader:
        return RocketMQReader(self._paths(), self._options_for(schema))

    def streamReader(self, schema) -> DataSourceStreamReader:
        return RocketMQStreamReader(self._paths(), self._options_for(schema))


class RocketMQReader(DataSourceReader):
    def __init__(self, paths: str, options: ScanOptions) -> None:
        self.roots = resolve_roots(paths)
        self.options = options

    def partitions(self) -> list[RangePartition]:
        # nothing to read (an empty log, a window past its end): one empty task, not none. Given none, Spark
        # hands read() a bare InputPartition of its own ("'InputPartition' object has no attribute 'read'")
        return [RangePartition(ranges, self.options) for ranges in plan_ranges(self.roots, self.options)] or [
            RangePartition([], self.options)]

    def read(self, partition: RangePartition):
        if isinstance(partition, RangePartition):
            yield from partition.read()


class RocketMQStreamReader(DataSourceStreamReader):
    """Offsets: ``{store root: commit-log offset}``; each micro-batch reads what was appended since."""

    def __init__(self, paths: str, options: ScanOptions) -> None:
        self.roots = resolve_roots(paths)
        self.options = options
        self._ends: dict[str, int] = {}  # each store's last end found: the next trigger validates only what follows

    def _bounds(self) -> dict[str, tuple[int, int]]:
        from ..config import detect_segment_size

        bounds = {}
        for root in self.roots:
            size = self.options.commit_log_file_size or detect_segment_size(root)
            if size is None:
                bounds[str(root)] = (0, 0)
                continue
            commit_log, low, end = log_bounds(root, size, follow_from=self._ends.get(str(root)), options=self.options)
            commit_log.close()
            bounds[str(root)] = (low, end)
            self._ends[str(root)] = end
        return bounds

    def initialOffset(self) -> dict:
        start = self.options.starting_offset
        return {root: max(low, start or 0) for root, (low, _end) in self._bounds().items()}

    def latestOffset(self, start: dict | None = None, limit=None) -> dict:
        return {root: end for root, (_low, end) in self._bounds().items()}

    def partitions(self, start: dict, end: dict) -> list[RangePartition]:
        parts = []
        for root in self.roots:
            key = str(root)
            begin, stop = start.get(key, 0), end.get(key, 0)
            if stop <= begin:
                continue
            # ``stop`` is an end latestOffset validated (records once valid stay so): no second recovery
            tasks = plan_ranges([Path(key)], replace(self.options, starting_offset=begin, ending_offset=stop,
                                                      validated_log_end=stop))
            parts.extend(RangePartition(ranges, self.options) for ranges in tasks)
        return parts

    def read(self, partition: RangePartition):
        if isinstance(partition, RangePartition):
            yield from partition.read()

    def commit(self, end: dict) -> None:
        """Nothing to acknowledge: the store is only read."""

"""The data pipeline on Apache Spark (PySpark): stores as DataFrames, parallel rebuilds, export/import, keys at scale.

Import costs nothing until a function runs: pyspark is loaded lazily.
"""

from __future__ import annotations

from .session import DEFAULT_MASTER, register, spark_session

__all__ = ["DEFAULT_MASTER", "register", "spark_session"]

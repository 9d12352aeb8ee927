"""The benchmark harnesses run (quick smoke forms only: benchmarks are never timed tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_spark_benchmark_smoke():
    pytest.importorskip("pyspark")
    done = subprocess.run([sys.executable, str(BENCHMARKS / "bench_spark.py"), "--quick"], capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "2 cores vs 1 core" in done.stdout
    results = json.loads((BENCHMARKS / "results" / "spark-quick.json").read_text())
    for path in ("single_process", "local[1]", "local[2]"):
        assert results[path]["scan_mb_s"] > 0 and results[path]["rebuild_keys_s"] > 0

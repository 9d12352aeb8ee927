"""The benchmark harness runs end to end (quick smoke forms only: benchmarks are never timed tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize("name", ["append", "index", "recovery", "scan", "tools", "spark", "peers", "serve"])
def test_benchmark_smoke(name):
    if name == "spark":
        pytest.importorskip("pyspark")
    if name == "serve":
        pytest.importorskip("rocketmq")
    done = subprocess.run([sys.executable, str(BENCHMARKS / "run.py"), "--quick", name], capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "benchmark" in done.stdout and "ratio" in done.stdout
    results = json.loads((BENCHMARKS / "results" / f"{name}-quick.json").read_text())["results"]
    assert results and all(r["value"] > 0 and r["baseline_value"] > 0 for r in results)

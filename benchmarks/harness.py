"""Shared benchmark plumbing: results with their baselines, timing, peak memory, table and JSON output.

Every figure is reported with the baseline it is compared against, measured in the same run on the
same data (absolute times drift on shared machines), or against a published reference figure
measured on this machine type (RocketMQ's Java code, ../shared/notes/REFERENCE.md).
"""

from __future__ import annotations

import json
import platform
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

RESULTS = Path(__file__).parent / "results"

# RocketMQ's own Java classes on this machine type (REFERENCE.md)
JAVA_PUTKEY_KEYS_S = 15.2e6
JAVA_SELECT_QUERIES_S = 2.19e6
ROCKETMQ_RECOVERY_MB_S = 200.0


@dataclass
class Result:
    group: str
    name: str
    value: float
    unit: str
    baseline: str
    baseline_value: float
    target: float | None = None  # the ratio the issue asks for, if any
    notes: dict = field(default_factory=dict)
    higher_is_better: bool = True  # latencies: the ratio is baseline / value, so >= 1 is good either way

    @property
    def ratio(self) -> float:
        if not self.baseline_value or not self.value:
            return float("nan")
        return self.value / self.baseline_value if self.higher_is_better else self.baseline_value / self.value

    def as_dict(self) -> dict:
        return {**asdict(self), "ratio": self.ratio}


def peak_rss_mb() -> float:
    """This process's peak resident set size so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed(fn: Callable[[], object], repeat: int = 1) -> float:
    """Median wall time of ``repeat`` calls, in seconds."""
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def run_threads(call: Callable[[int, int], object], threads: int, seconds: float) -> tuple[float, list[float]]:
    """``threads`` threads calling ``call(thread, i)`` in a loop for ``seconds``: (calls/s, every latency in ns)."""
    import threading

    stop = threading.Event()
    latencies: list[list[float]] = [[] for _ in range(threads)]

    def loop(n: int) -> None:
        i = 0
        mine = latencies[n]
        while not stop.is_set():
            started = time.perf_counter_ns()
            call(n, i)
            mine.append(time.perf_counter_ns() - started)
            i += 1

    workers = [threading.Thread(target=loop, args=(n,)) for n in range(threads)]
    started = time.perf_counter()
    for w in workers:
        w.start()
    time.sleep(seconds)
    stop.set()
    for w in workers:
        w.join()
    everything = [x for mine in latencies for x in mine]
    return len(everything) / (time.perf_counter() - started), everything


def table(results: list[Result]) -> str:
    lines = [f"{'benchmark':<44}{'value':>16} {'unit':<9}{'ratio':>8}  {'baseline':<34}{'target':>8}"]
    group = None
    for r in results:
        if r.group != group:
            group = r.group
            lines.append(f"-- {group}")
        target = "" if r.target is None else (f"{'ok' if r.ratio >= r.target else 'MISS'} {r.target:g}")
        lines.append(f"{r.name:<44}{r.value:>16,.1f} {r.unit:<9}{r.ratio:>8.2f}  {r.baseline:<34}{target:>8}")
    return "\n".join(lines)


def save(name: str, results: list[Result], extra: dict | None = None) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": platform.platform(), "python": platform.python_version(),
                                "results": [r.as_dict() for r in results], **(extra or {})}, indent=2))
    return path


def bench_main(name: str, run: Callable[[bool], list[Result]], description: str) -> int:
    """The command line every benchmark shares: ``--quick``, a table, peak RSS, results/<name>.json."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="the smoke form CI runs")
    args = parser.parse_args()
    results = run(args.quick)
    print(table(results))
    print(f"peak RSS {peak_rss_mb():.0f} MB")
    save(f"{name}-quick" if args.quick else name, results, {"peak_rss_mb": peak_rss_mb()})
    return 0

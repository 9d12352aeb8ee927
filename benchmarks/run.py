"""Run every benchmark and print one table: ``./dev bench [--quick]`` (or ``./dev bench NAME``).

Each benchmark runs in its own process, so its peak RSS is its own. Results land in
benchmarks/results/<name>.json (not committed); the README's Performance section quotes a full run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
BENCHMARKS = ["append", "index", "recovery", "scan", "tools", "spark", "peers", "serve"]

sys.path.insert(0, str(HERE))

from harness import RESULTS, Result, table  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke form: tiny data, checks the harness works")
    parser.add_argument("only", nargs="*", choices=[*BENCHMARKS, []], help="benchmarks to run (default: all)")
    args = parser.parse_args()
    names = args.only or BENCHMARKS
    results: list[Result] = []
    memory = {}
    for name in names:
        command = [sys.executable, str(HERE / f"bench_{name}.py"), *(["--quick"] if args.quick else [])]
        print(f"== {name}", file=sys.stderr, flush=True)
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        data = json.loads((RESULTS / f"{name}{'-quick' if args.quick else ''}.json").read_text())
        memory[name] = data.get("peak_rss_mb")
        for r in data.get("results", []):
            r.pop("ratio", None)
            results.append(Result(**r))
    print(table(results))
    print("peak RSS per benchmark process: " + ", ".join(f"{k} {v:.0f} MB" for k, v in memory.items() if v))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

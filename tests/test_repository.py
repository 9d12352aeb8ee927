"""What the repository tracks: the project's files and nothing a run leaves behind.

Two stops committed a tool's stray output at the top level (a process-memory log, a shell error log) with a
``git add -A``; a generated store or a venv would go the same way. Skipped outside a git checkout (an sdist)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOP_LEVEL = {".ci", ".gitignore", "LICENSE", "README.md", "benchmarks", "dev", "pyproject.toml", "src", "tests"}
LARGEST = 512 << 10  # bytes: the biggest tracked file is source; data for tests is built in temporary directories


def tracked() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True).stdout
    return [name for name in out.decode().split("\0") if name]


def test_only_the_projects_files_are_tracked_at_the_top_level():
    assert sorted({name.split("/", 1)[0] for name in tracked()} - TOP_LEVEL) == []


def test_no_tracked_file_is_large():
    sizes = {name: (ROOT / name).stat().st_size for name in tracked() if (ROOT / name).is_file()}
    assert {name: size for name, size in sizes.items() if size > LARGEST} == {}

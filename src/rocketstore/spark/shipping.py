"""What a cluster's executors need from the driver: the rocketstore package, or the whole environment.

Spark runs a job's Python on every executor with the interpreter the driver names
(``PYSPARK_PYTHON`` at session creation; the worker's own setting is not consulted), and the
``rocketmq`` data source also plans on the driver with that same interpreter. Two ways to make
executors able to run rocketstore:

* the package: a zip of the installed ``rocketstore`` package, added with ``addPyFile``. Workers
  then need only rocketstore's third-party dependencies (numpy, pyarrow, numba) for the
  interpreter that runs there. Always done for a non-local master: it is small (~200 KB) and
  keeps executors on the driver's version.
* the environment (``ship_env``): the driver's virtual environment packed into a zip (what
  venv-pack does, done here: venv-pack refuses venvs with editable installs and deflates
  everything) and sent with ``spark.archives``, Spark's documented way for whole environments;
  executors run ``./rocketstore-env/bin/python`` from it,
  so workers need only Java and the same Python version at the same place (the venv's base).
  Spark's own ``pyspark`` is left out: executors import the one of the worker's Spark.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

from ..errors import ConfigError

ENV_NAME = "rocketstore-env"
ENV_PYTHON = f"./{ENV_NAME}/bin/python"
PACKAGE_ROOT = Path(__file__).resolve().parent.parent


def package_zip(directory: str | Path) -> Path:
    """A zip of the running rocketstore package (sources only), for ``SparkContext.addPyFile``."""
    target = Path(directory) / "rocketstore.zip"
    tmp = target.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as archive:
        for path in sorted(PACKAGE_ROOT.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix not in (".pyc", ".nbi", ".nbc"):
                archive.write(path, Path("rocketstore") / path.relative_to(PACKAGE_ROOT))
    os.replace(tmp, target)
    return target


def environment_prefix() -> Path:
    """The running interpreter's virtual environment; packing anything else would ship the wrong one."""
    if sys.prefix == sys.base_prefix:
        raise ConfigError("--ship-env packs the driver's virtual environment, but this Python runs outside one "
                          f"({sys.executable}); create a venv, install rocketstore into it and run from there")
    return Path(sys.prefix)


def _environment_key(prefix: Path) -> str:
    """Changes when a distribution is added, removed or upgraded (their dist-info names carry versions)."""
    site = sorted(prefix.glob("lib/python*/site-packages"))
    names = sorted(p.name for s in site for p in s.glob("*.dist-info"))
    text = "\n".join([sys.version, str(prefix), *names])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def packed_environment(cache_dir: str | Path | None = None) -> Path:
    """The driver's venv as a zip archive for ``spark.archives``, packed once per set of distributions.

    Cached under ``~/.cache/rocketstore`` (a few hundred MB: packing takes seconds, not every run).
    Stored, not deflated: Spark unzips it on the driver and on every executor, and the archive is
    mostly compiled libraries that deflate poorly. Links are stored as the files they name (Spark
    refuses archives whose links point outside them), so ``bin/python`` is a copy of the base
    interpreter, which finds its standard library through ``pyvenv.cfg`` as in the venv itself.
    Left out: ``lib64`` (a link to ``lib``), Spark's own pyspark (executors import their Spark's),
    editable installs (rocketstore from a checkout travels as the package zip), other scripts in bin/.
    """
    prefix = environment_prefix()
    cache = Path(cache_dir or os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rocketstore"
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / f"env-{_environment_key(prefix)}.zip"
    if target.exists():
        return target
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
            for source, name in _environment_files(prefix):
                archive.write(source, name)
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    for old in cache.glob("env-*.zip"):  # one packed environment per cache is enough
        if old != target:
            with contextlib.suppress(OSError):
                old.unlink()
    return target


def _environment_files(prefix: Path) -> Iterator[tuple[Path, str]]:
    """(file, name in the archive) for every file an executor's interpreter needs from the venv."""
    yield prefix / "pyvenv.cfg", "pyvenv.cfg"
    for python in sorted((prefix / "bin").glob("python*")):
        yield python.resolve(), f"bin/{python.name}"
    for site in sorted(prefix.glob("lib/python*/site-packages")):
        for directory, subdirs, files in os.walk(site, followlinks=False):
            here = Path(directory)
            top = here == site
            if top:
                subdirs[:] = [d for d in subdirs if d not in ("pyspark", "rocketstore")]
            subdirs.sort()
            for name in sorted(files):
                if top and name.startswith("__editable__"):
                    continue
                path = here / name
                if path.is_file():  # a link to a file: its content; a dangling link: nothing
                    yield path, path.relative_to(prefix).as_posix()


def driver_directory(scratch: str | Path) -> Path:
    """A working directory for the driver's JVM in which ``./rocketstore-env`` is this venv.

    The data source plans on the driver with the executors' interpreter path; with a shipped
    environment that path is relative, so the JVM starts in a directory where it names the venv
    the archive was packed from.
    """
    directory = Path(scratch) / "driver"
    directory.mkdir(exist_ok=True)
    link = directory / ENV_NAME
    if not link.is_symlink():
        link.symlink_to(environment_prefix())
    return directory


@contextlib.contextmanager
def working_directory(path: Path) -> Iterator[None]:
    """Start a child (the JVM) in ``path``; the Python process returns to where it was."""
    here = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(here)

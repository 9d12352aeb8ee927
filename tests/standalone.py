"""A real Spark standalone cluster on 127.0.0.1 for tests: one master, one worker, ephemeral ports.

Started from the installed pyspark with ``spark-class`` (what an operator types), stopped by pid.
The master's REST server is off (it would bind the fixed port 6066) and every address is loopback.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

MASTER_LINE = re.compile(r"Starting Spark master at (spark://[\d.]+:\d+)")
REGISTERED = "Successfully registered with master"


def java_missing() -> str | None:
    """Why a cluster cannot start here, or None."""
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        return "Java is not installed: a Spark standalone master and worker need a JVM"
    return None


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent


@dataclass
class Standalone:
    url: str
    master: subprocess.Popen
    worker: subprocess.Popen
    logs: Path

    def stop(self) -> None:
        for proc in (self.worker, self.master):
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
        for proc in (self.worker, self.master):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()


def _env(logs: Path, worker_python: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(SPARK_HOME=str(spark_home()), SPARK_LOCAL_IP="127.0.0.1", SPARK_LOG_DIR=str(logs),
               SPARK_MASTER_OPTS="-Dspark.master.rest.enabled=false",
               SPARK_WORKER_OPTS=f"-Djava.io.tmpdir={logs}")
    if worker_python:
        env["PYSPARK_PYTHON"] = worker_python
    return env


def _wait_for(log: Path, proc: subprocess.Popen, pattern: re.Pattern | str, timeout: float) -> re.Match | str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        found = pattern.search(text) if isinstance(pattern, re.Pattern) else (pattern if pattern in text else None)
        if found:
            return found
        if proc.poll() is not None:
            raise RuntimeError(f"{log.name} exited with {proc.returncode}:\n{text[-3000:]}")
        time.sleep(0.2)
    raise RuntimeError(f"{log.name}: no {pattern!r} within {timeout} s:\n{log.read_text(errors='replace')[-3000:]}")


def can_hide() -> str | None:
    """Why a directory cannot be hidden from the worker (a private mount namespace needs privileges), or None."""
    if shutil.which("unshare") is None:
        return "unshare is not installed"
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], check=False, capture_output=True)
    return None if probe.returncode == 0 else f"cannot create a mount namespace: {probe.stderr.decode().strip()}"


def start(logs: Path, *, cores: int = 2, memory: str = "2g", worker_python: str | None = None,
          hidden: Path | None = None, timeout: float = 90) -> Standalone:
    """Start a master and one worker; return when the worker has registered.

    ``hidden``: a directory the worker (and so its executors) sees empty, as on a host where a
    store is not mounted: the worker runs in its own mount namespace with a tmpfs over it.
    """
    logs.mkdir(parents=True, exist_ok=True)
    spark_class = str(spark_home() / "bin" / "spark-class")
    env = _env(logs, worker_python)
    master_log = logs / "master.log"
    with open(master_log, "wb") as out:
        master = subprocess.Popen([spark_class, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                                   "--port", "0", "--webui-port", "0"], stdout=out, stderr=subprocess.STDOUT,
                                  env=env, start_new_session=True)
    worker = None
    try:
        url = _wait_for(master_log, master, MASTER_LINE, timeout).group(1)
        worker_log = logs / "worker.log"
        work_dir = logs / "work"
        command = [spark_class, "org.apache.spark.deploy.worker.Worker", url, "--host", "127.0.0.1", "--port", "0",
                   "--webui-port", "0", "--cores", str(cores), "--memory", memory, "--work-dir", str(work_dir)]
        if hidden is not None:
            hidden.mkdir(parents=True, exist_ok=True)
            script = 'mount -t tmpfs rocketstore-hidden "$1" && shift && exec "$@"'
            command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", str(hidden),
                       *command]
        with open(worker_log, "wb") as out:
            worker = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        _wait_for(worker_log, worker, REGISTERED, timeout)
    except BaseException:
        for proc in (worker, master):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        raise
    return Standalone(url, master, worker, logs)


def bare_venv(path: Path) -> Path:
    """A virtual environment with rocketstore's third-party dependencies but not rocketstore itself.

    The new venv sees this venv's site-packages through a .pth file; .pth files are not read
    recursively, so the editable install's own .pth (which puts src/ on the path) stays out.
    """
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    site = next((path / "lib").glob("python3*/site-packages"))
    here = next(p for p in sys.path if p.endswith("site-packages") and Path(p, "numpy").is_dir())
    (site / "deps.pth").write_text(here + "\n")
    return path / "bin" / "python"


if __name__ == "__main__":  # start a cluster by hand: python tests/standalone.py LOGDIR [HIDDEN_DIR]
    cluster = start(Path(sys.argv[1]), hidden=Path(sys.argv[2]) if len(sys.argv) > 2 else None)
    print(cluster.url, cluster.master.pid, cluster.worker.pid, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stop the cluster on kill, too
    try:
        signal.pause()
    finally:
        cluster.stop()

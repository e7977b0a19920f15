"""A Spark standalone cluster (one master, one worker) on loopback, from the
installed pyspark's own `spark-class`, for the tests that run the job the way a
user runs it on a cluster (tests/integration/spark/test_cluster.py).

SPARK_HOME is a folder of links into the pyspark package, so the worker's work
dirs (executor logs, unpacked archives) and the daemons' logs land under the
test's temporary folder, not in site-packages.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pytest

from devtools.localstack import free_port, wait_for_port

# The worker registers with the master in about a second; an executor takes ~20 s
# to come up once an application asks for one (measured here).
REGISTER_TIMEOUT_S = 60.0
# A JVM's start: the master listened after more than 15 s (the servers' bound,
# devtools/localstack.py) once, in a full suite beside three workers' Spark tests.
MASTER_START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0


def pyspark_home() -> Path:
    """The installed pyspark package folder (it holds bin/, jars/, python/...)."""
    spec = importlib.util.find_spec("pyspark")
    assert spec is not None and spec.submodule_search_locations, "pyspark is not installed"
    return Path(next(iter(spec.submodule_search_locations)))


def linked_spark_home(folder: Path) -> Path:
    """A SPARK_HOME made of links to the pyspark package's entries."""
    folder.mkdir(parents=True, exist_ok=True)
    for entry in pyspark_home().iterdir():
        link = folder / entry.name
        if not link.exists():
            link.symlink_to(entry)
    return folder


def spark_env(spark_home: Path) -> dict[str, str]:
    """This process's environment for Spark commands: loopback only, no leaked
    PYSPARK_* or PYTHONPATH from the test session, logs under SPARK_HOME."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYSPARK_", "PYTHONPATH"))}
    env |= {
        "SPARK_HOME": str(spark_home),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_LOG_DIR": str(spark_home / "logs"),
        "SPARK_NO_DAEMONIZE": "1",
    }
    return env


@dataclass
class StandaloneCluster:
    """One master and one 1-core worker; `url` is what `--master` takes."""

    home: Path
    master_port: int = field(default_factory=free_port)
    master_ui_port: int = field(default_factory=free_port)
    worker_ui_port: int = field(default_factory=free_port)
    _procs: list[tuple[subprocess.Popen[bytes], IO[bytes]]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"spark://127.0.0.1:{self.master_port}"

    @property
    def env(self) -> dict[str, str]:
        return spark_env(self.home)

    @property
    def work_dir(self) -> Path:
        """Where the worker runs executors (one folder per application)."""
        return self.home / "work"

    def start(self) -> None:
        spark_class = str(self.home / "bin" / "spark-class")
        master = self._spawn(
            "master",
            [spark_class, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
             "--port", str(self.master_port), "--webui-port", str(self.master_ui_port)],
        )  # fmt: skip
        wait_for_port(self.master_port, master, "spark master", MASTER_START_TIMEOUT_S)
        worker = self._spawn(
            "worker",
            [spark_class, "org.apache.spark.deploy.worker.Worker", self.url,
             "--host", "127.0.0.1", "--webui-port", str(self.worker_ui_port),
             "--cores", "1", "--memory", "2g", "--work-dir", str(self.work_dir)],
        )  # fmt: skip
        self._wait_for_worker(worker)

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = (self.home / f"{name}.log").open("ab")
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        self._procs.append((proc, log))
        return proc

    def state(self) -> dict[str, Any]:
        """The master's status page as JSON (workers, applications)."""
        url = f"http://127.0.0.1:{self.master_ui_port}/json/"
        with urllib.request.urlopen(url, timeout=5) as reply:
            return json.load(reply)  # type: ignore[no-any-return]

    def _wait_for_worker(self, worker: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + REGISTER_TIMEOUT_S
        while time.monotonic() < deadline:
            if worker.poll() is not None:
                raise RuntimeError(f"spark worker exited ({worker.returncode}): {self.logs()}")
            with contextlib.suppress(OSError, ValueError):
                if any(w.get("state") == "ALIVE" for w in self.state().get("workers", [])):
                    return
            time.sleep(0.2)
        raise RuntimeError(f"no worker registered within {REGISTER_TIMEOUT_S}s: {self.logs()}")

    def logs(self, tail: int = 3000) -> str:
        """The end of the master's and worker's logs, for failure messages."""
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-tail:]}"
            for p in sorted(self.home.glob("*.log"))
        )

    def stop(self) -> None:
        """Worker first (it kills its executors), then the master; by PID; safe twice."""
        for proc, log in reversed(self._procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            log.close()
        self._procs.clear()


@pytest.fixture(scope="session")
def spark_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandaloneCluster]:
    """A standalone master and worker for the whole session."""
    cluster = StandaloneCluster(linked_spark_home(tmp_path_factory.mktemp("spark-home")))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()

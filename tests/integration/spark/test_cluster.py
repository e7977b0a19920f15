"""The job on a real Spark standalone cluster (cluster.py), run both ways
docs/spark-cluster.md gives, with the commands read from that page:
`spark-submit` in client mode with the packed environment and the user's
handler module, and `python -m spark_sink` with `[spark] master`.

Each run reads a fresh clean topic of 40 records (one a duplicate delivery of
another, two failed by the handler) and checks every id written once and one
release command per failed record, with its token."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from prometheus_client.parser import text_string_to_metric_families

from devtools.localstack import free_port
from devtools.topics import create_topics, read_topic
from tests.integration.spark.cluster import StandaloneCluster, spark_cluster
from tests.integration.spark.session import order, produce

__all__ = ["spark_cluster"]

pytestmark = [pytest.mark.spark, pytest.mark.spark_cluster, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[3]
DOC = REPO / "docs" / "spark-cluster.md"
RECORDS = 40
REJECTED = ("o-3", "o-17")
RUN_TIMEOUT_S = 420

HANDLER = f'''
"""The user's handler: every record passes but {REJECTED}."""
from pyspark.sql import functions as F
from spark_sink.handlers import passthrough

def handle(records):
    rejected = F.col("dedup_id").isin({list(REJECTED)!r})
    return passthrough(records).withColumn(
        "reason", F.when(rejected, F.lit("rejected by myhandler"))
    )
'''


def section_blocks(heading: str) -> list[tuple[str, str]]:
    """(language, text) of each fenced block under `## heading` in the page."""
    text = DOC.read_text()
    match = re.search(rf"^## {heading}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"{DOC.name} has no '## {heading}' section"
    return re.findall(r"^```(\w+)\n(.*?)^```", match[1], re.M | re.S)


def shell_commands(block: str) -> list[list[str]]:
    """Each command of an sh block as argv, `&&` chains split, continuations joined."""
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        for part in line.split("&&"):
            if part.strip():
                commands.append(shlex.split(part))
    return commands


@pytest.fixture(scope="module")
def packed_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`make spark-pack`: the script it runs, into a temporary folder."""
    archive = tmp_path_factory.mktemp("pack") / "spark-env.tar.gz"
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PYTHON": sys.executable}
    built = subprocess.run(
        ["bash", str(REPO / "scripts" / "pack-spark-env.sh"), "-o", str(archive)],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    return archive


@pytest.fixture
def job_dir(
    tmp_path: Path, broker: str, names: Callable[[str], str]
) -> Callable[..., tuple[Path, dict[str, str]]]:
    """A folder as a user has it (gateway.toml, myhandler.py) over fresh topics holding
    the test's records; returns (folder, topics)."""

    def make(**spark: str | int) -> tuple[Path, dict[str, str]]:
        topics = {"clean": names("clean"), "failures": names("failures")}
        asyncio.run(create_topics(broker, {topics["clean"]: 2, topics["failures"]: 1}))
        records = [order(n, partitions=2) for n in range(RECORDS - 1)]
        records.append(records[5])  # the gateway's crash window: same token delivered twice
        produce(broker, topics["clean"], records)
        (tmp_path / "myhandler.py").write_text(HANDLER)
        extra = "".join(f"{key} = {json.dumps(value)}\n" for key, value in spark.items())
        (tmp_path / "gateway.toml").write_text(
            f'[kafka]\nbootstrap_servers = "{broker}"\n'
            f'clean_topic = "{topics["clean"]}"\nfailure_topic = "{topics["failures"]}"\n'
            f'[spark]\nhandler = "myhandler:handle"\ncheckpoint_dir = "{tmp_path / "checkpoint"}"\n'
            f'output_path = "{tmp_path / "output"}"\nmax_records_per_batch = 25\n{extra}'
        )
        return tmp_path, topics

    return make


def check_outcome(folder: Path, broker: str, topics: dict[str, str]) -> None:
    """Every id but the rejected ones written exactly once; one release command per
    rejected id, carrying the token of its record."""
    written = pq.read_table(folder / "output", columns=["dedup_id"]).column("dedup_id").to_pylist()
    expected = sorted(f"o-{n}" for n in range(RECORDS - 1) if f"o-{n}" not in REJECTED)
    assert sorted(written) == expected
    released = asyncio.run(read_topic(broker, topics["failures"], min_records=len(REJECTED)))
    commands = [json.loads(r.value) for r in released]
    assert sorted(c["id"] for c in commands) == sorted(REJECTED)
    tokens = {f"o-{n}": order(n, partitions=2).token for n in range(RECORDS - 1)}
    assert all(c["token"] == tokens[c["id"]] for c in commands), commands


def run(argv: list[str], cwd: Path, cluster: StandaloneCluster) -> str:
    ran = subprocess.run(
        argv, cwd=cwd, env=cluster.env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-6000:] + cluster.logs()
    return ran.stdout


def scrape(port: int) -> dict[str, float]:
    """The job's /metrics as {sample name: value} (unlabelled samples only)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.labels
    }


def child_pids(pid: int) -> list[int]:
    """The processes `pid` started (every thread's children, as Linux lists them)."""
    tasks = Path(f"/proc/{pid}/task").iterdir()
    return [int(c) for task in tasks for c in (task / "children").read_text().split()]


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def run_until_metrics(
    argv: list[str], cwd: Path, cluster: StandaloneCluster, port: int, done: dict[str, float]
) -> dict[str, float]:
    """Start the streaming job, wait until its /metrics reach `done` (each sample at
    least its value), then stop it with SIGTERM; returns the last scrape. The job
    must exit 0.

    The signal goes to the Python driver, not to spark-submit's JVM: the driver's
    SparkContext lives in that JVM, and the driver stops the query through it."""
    log = cwd / "driver.log"
    with log.open("w") as out:
        proc = subprocess.Popen(argv, cwd=cwd, env=cluster.env, stdout=out, stderr=out)
        try:
            deadline = time.monotonic() + RUN_TIMEOUT_S
            seen: dict[str, float] = {}
            while not all(seen.get(k, -1) >= v for k, v in done.items()):
                assert proc.poll() is None, f"the job exited: {log.read_text()[-6000:]}"
                assert time.monotonic() < deadline, f"{seen}: {log.read_text()[-6000:]}"
                time.sleep(0.5)  # the job is a separate process: poll its metrics
                try:
                    seen = scrape(port)
                except OSError:
                    continue  # the driver is still starting
            (driver,) = [p for p in child_pids(proc.pid) if "spark_sink" in cmdline(p)]
            os.kill(driver, signal.SIGTERM)
            assert proc.wait(timeout=120) == 0, log.read_text()[-6000:] + cluster.logs()
            return seen
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_spark_submit_in_client_mode_with_the_packed_environment_writes_each_id_once(
    spark_cluster: StandaloneCluster, packed_env: Path, broker: str, job_dir: Any
) -> None:
    port = free_port()
    folder, topics = job_dir(metrics_port=port, metrics_host="127.0.0.1")
    ((lang, block), *_) = section_blocks("Standalone")
    assert lang == "sh"
    commands = shell_commands(block)
    assert commands[0] == ["make", "spark-pack"]  # built by the packed_env fixture
    *prepare, submit = [
        [
            arg.replace("spark://HOST:7077", spark_cluster.url)
            .replace("dist/spark-env.tar.gz", str(packed_env))
            .replace("spark_sink/__main__.py", str(REPO / "spark_sink" / "__main__.py"))
            for arg in argv
        ]
        for argv in commands[1:]
    ]
    for argv in prepare:
        run(argv, folder, spark_cluster)
    assert submit[0] == "spark-submit"
    submit[0] = str(spark_cluster.home / "bin" / "spark-submit")
    written = RECORDS - 1 - len(REJECTED)
    metrics = run_until_metrics(
        submit, folder, spark_cluster, port,
        # Spark's progress report of a batch (input rows) comes after its sink call.
        {"dedup_spark_rows_written_total": written,
         "dedup_spark_release_commands_total": len(REJECTED),
         "dedup_spark_input_rows_total": RECORDS},
    )  # fmt: skip
    check_outcome(folder, broker, topics)
    # The driver's metrics saw it all: every record read (the duplicate too), written but
    # for the rejected ones, and those failed.
    assert metrics["dedup_spark_input_rows_total"] == RECORDS
    assert metrics["dedup_spark_rows_failed_total"] == len(REJECTED)
    assert metrics["dedup_spark_rows_written_total"] == written


def test_python_m_spark_sink_with_a_spark_master_writes_each_id_once(
    spark_cluster: StandaloneCluster, broker: str, job_dir: Any
) -> None:
    blocks = section_blocks("Standalone")
    (toml,) = [text for lang, text in blocks if lang == "toml"]
    command = [text for lang, text in blocks if lang == "sh"][-1]
    folder, topics = job_dir(master=spark_cluster.url)
    # The page's [spark] and [spark.conf] lines, after the test's own [spark] settings.
    spark_lines = [line for line in toml.splitlines()[1:] if not line.startswith("master")]
    spark_lines = [line for line in spark_lines if not line.startswith("handler")]
    with (folder / "gateway.toml").open("a") as f:
        f.write("\n".join(spark_lines) + "\n")
    (argv,) = shell_commands(command)
    assert argv[:3] == ["python", "-m", "spark_sink"]
    out = run([sys.executable, *argv[1:], "--until-idle"], folder, spark_cluster)
    report = json.loads(out.strip().splitlines()[-1])
    assert (report["failed"], report["releases_published"]) == (len(REJECTED), len(REJECTED))
    check_outcome(folder, broker, topics)
    # The executors ran the driver's code from the shipped zip.
    assert list(spark_cluster.work_dir.glob("app-*/*/spark_sink_code.zip"))

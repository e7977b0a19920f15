"""Spark 3.5 runs the whole loop: the job as a user runs it (`python -m spark_sink
--until-idle`) in a venv of pyspark 3.5.7 (compat_env.py, built once into
~/.cache), on Spark's Kafka connector for 3.5.7 (Scala 2.12), reading the clean
topic a gateway of this session writes; a record its handler fails goes back to the
gateway as a release command, and the gateway forwards it again. Without the
connector, Spark 3.5 (no Python Data Source API) stops at start-up with one line
naming `--packages`.

`make spark-compat SPARK=3.5.7` (or 4.0.0, 4.1.1) runs the tests marked spark_compat in such
a venv; this module is the part `make test` runs."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from devtools.harness import Topics, counter_value, eventually, make_settings, redis_urls, running
from devtools.jars import spark_kafka_jars
from devtools.topics import create_topics, read_topic, wait_committed
from devtools.traffic import produce_traffic
from tests.integration.spark.compat_env import compat_venv, job_env, python_of

# Building the venv on a fresh machine: ~45 s for pyspark's 317 MB, plus the rest.
pytestmark = [pytest.mark.spark, pytest.mark.timeout(900)]

SPARK = "3.5.7"
JOB_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def python35() -> Path:
    """The Python of the pyspark 3.5.7 venv, with Spark's connector for it fetched."""
    venv = compat_venv(SPARK)
    spark_kafka_jars(SPARK)
    return python_of(venv)


def write_config(folder: Path, broker: str, topics: Topics, spark: str = "") -> Path:
    path = folder / "gateway.toml"
    path.write_text(
        f'[kafka]\nbootstrap_servers = "{broker}"\nclean_topic = "{topics.clean}"\n'
        f'failure_topic = "{topics.failures}"\n'
        f'[spark]\nmaster = "local[2]"\ncheckpoint_dir = "{folder / "checkpoint"}"\n'
        f'output_path = "{folder / "output"}"\n{spark}'
        '[spark.conf]\n"spark.ui.enabled" = "false"\n"spark.sql.shuffle.partitions" = "2"\n'
    )
    return path


def run_job(python: Path, config: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(python), "-m", "spark_sink", "--config", str(config), "--until-idle"],
        cwd=config.parent, env=job_env(env), capture_output=True, text=True,
        timeout=JOB_TIMEOUT_S,
    )  # fmt: skip


async def test_spark_35_reads_the_gateways_clean_topic_on_its_connector_and_releases_a_failure(
    python35: Path, broker: str, redis_servers: Callable[..., list], names, tmp_path: Path
) -> None:
    topics = Topics(names)
    await topics.create(broker, raw_partitions=2, clean_partitions=2)
    traffic = await produce_traffic(broker, topics.raw, 120, duplicate_share=0.3, seed=35)
    failing = sorted(traffic.unique_ids)[:2]
    settings = make_settings(
        broker, topics, redis_urls(redis_servers(3)),
        failures={"backoff_initial": "10ms", "backoff_max": "20ms"},
    )  # fmt: skip
    handler = (
        'handler = "devtools.handlers:failing_ids"\n'
        f"handler_options = {{ids = {json.dumps(failing)}, up_to_attempt = 1}}\n"
    )
    config = write_config(tmp_path, broker, topics, handler)
    async with running(settings) as gateway:
        await wait_committed(broker, topics.group, topics.raw, traffic.per_partition)
        ran = await asyncio.to_thread(run_job, python35, config)
        assert ran.returncode == 0, ran.stderr[-6000:]
        assert f"reading {topics.clean} with Spark 3.5.7's Kafka connector" in ran.stderr
        report = json.loads(ran.stdout.strip().splitlines()[-1])
        assert report["source"] == "kafka"
        unique = len(traffic.unique_ids)
        assert (report["input_rows"], report["written"]) == (unique, unique - len(failing))
        assert report["failed"] == report["releases_published"] == len(failing)
        # The gateway took the release commands: it forwarded each failed id again.
        await eventually(
            lambda: counter_value(gateway.metrics.retries, "2") == len(failing),
            what="the gateway retried the records Spark 3.5 failed",
        )
    commands = await read_topic(broker, topics.failures, min_records=len(failing))
    assert sorted(json.loads(c.value)["id"] for c in commands) == failing
    written = pq.read_table(tmp_path / "output", columns=["dedup_id"]).column("dedup_id")
    assert sorted(written.to_pylist()) == sorted(traffic.unique_ids - set(failing))


def test_spark_35_without_the_connector_stops_at_start_up_naming_the_packages(
    python35: Path, broker: str, names, tmp_path: Path
) -> None:
    topics = Topics(names)
    asyncio.run(create_topics(broker, {topics.clean: 1, topics.failures: 1}))
    config = write_config(tmp_path, broker, topics)
    ran = run_job(python35, config, DEDUP_JAR_CACHE=str(tmp_path / "no-jars"))
    assert ran.returncode == 2, ran.stderr[-6000:]
    last = ran.stderr.strip().splitlines()[-1]
    assert last.startswith("spark_sink: Spark 3.5.7 has no Kafka connector"), last
    assert "--packages org.apache.spark:spark-sql-kafka-0-10_2.12:3.5.7" in last
    assert not (tmp_path / "checkpoint").exists()

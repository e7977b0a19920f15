"""A fresh user's first run: the example config, plain (not JSON) records. The
default handler passes them all, and a handler that fails most of a batch says
so loudly. `python -m spark_sink --until-idle` before the gateway forwarded anything
reads nothing and says so."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from devtools.topics import create_topics
from spark_sink.config import SinkSettings, load_sink_settings
from spark_sink.handlers import orders
from spark_sink.job import count_output, run_until_idle
from tests.integration.spark.session import Clean, produce, source_token

pytestmark = [pytest.mark.spark, pytest.mark.spark_compat]

EXAMPLE = Path(__file__).resolve().parents[3] / "deploy" / "config" / "gateway.example.toml"


@pytest.fixture
def example_settings(
    broker: str, names: Callable[[str], str], tmp_path: Path
) -> Callable[[], SinkSettings]:
    """The example config as a user copies it, with only the addresses and paths changed;
    a fresh clean topic holding 30 plain-text records."""

    def make() -> SinkSettings:
        clean, failures = names("clean"), names("failures")
        asyncio.run(create_topics(broker, {clean: 2, failures: 1}))
        text = EXAMPLE.read_text()
        for old, new in {
            '"127.0.0.1:9092"': f'"{broker}"',
            'clean_topic = "clean"': f'clean_topic = "{clean}"',
            'failure_topic = "dedup-failures"': f'failure_topic = "{failures}"',
            '"var/spark/checkpoint"': f'"{tmp_path / "checkpoint"}"',
            '"var/spark/output"': f'"{tmp_path / "output"}"',
        }.items():
            assert old in text, old
            text = text.replace(old, new)
        (tmp_path / "gateway.toml").write_text(text)
        records = [
            Clean(id=f"m-{n}", value=f"plain line {n}".encode(), partition=n % 2,
                  token=source_token(n % 2, n), source=f"raw/{n % 2}/{n}")
            for n in range(30)
        ]  # fmt: skip
        produce(broker, clean, records)
        return load_sink_settings(tmp_path / "gateway.toml")

    return make


def test_first_run_with_the_example_config_writes_plain_records_and_releases_none(
    spark, example_settings
):
    settings, registry = example_settings(), CollectorRegistry()
    report = run_until_idle(settings, spark=spark, registry=registry)
    assert (report.input_rows, report.written, report.output_rows) == (30, 30, 30)
    assert (report.failed, report.releases_published) == (0, 0)
    # The job's metrics, fed by Spark's progress reports (a listener on the query).
    assert registry.get_sample_value("dedup_spark_input_rows_total") == 30
    assert registry.get_sample_value("dedup_spark_rows_written_total") == 30
    lag = {
        s.labels["partition"]: s.value
        for family in registry.collect() if family.name == "dedup_spark_source_lag_records"
        for s in family.samples
    }  # fmt: skip
    assert lag == {"0": 0, "1": 0}, "caught up on both partitions"


def test_a_handler_failing_most_of_a_batch_is_logged_as_an_error_with_its_reasons(
    spark, example_settings, caplog
):
    caplog.set_level(logging.ERROR, logger="spark_sink.handlers")
    report = run_until_idle(example_settings(), spark=spark, handler=orders)
    assert report.failed == 30
    alarms = [r.getMessage() for r in caplog.records if "the handler failed" in r.getMessage()]
    assert alarms and all(r.levelno == logging.ERROR for r in caplog.records)
    assert "value is not a JSON object" in alarms[0]


def test_until_idle_on_a_clean_topic_without_records_yet_exits_0_and_counts_nothing(
    broker, names, tmp_path
):
    """The command line, as a user runs it first, with the default (relative) paths:
    nothing to read, no output folder yet; it exited 1 with UNABLE_TO_INFER_SCHEMA."""
    clean, failures = names("clean"), names("failures")
    asyncio.run(create_topics(broker, {clean: 2, failures: 1}))
    (tmp_path / "gateway.toml").write_text(
        f'[kafka]\nbootstrap_servers = "{broker}"\nclean_topic = "{clean}"\n'
        f'failure_topic = "{failures}"\n[spark]\nmaster = "local[1]"\n'
        '[spark.conf]\n"spark.ui.enabled" = "false"\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYSPARK_")}
    ran = subprocess.run(
        [sys.executable, "-m", "spark_sink", "--config", "gateway.toml", "--until-idle"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-4000:]
    report = json.loads(ran.stdout.strip().splitlines()[-1])
    assert report == {"batches": 0, "input_rows": 0, "processed": 0, "failed": 0,
                      "releases_published": 0, "written": 0, "output_rows": 0,
                      "source": "kafka", "delivery_dedup": True}  # fmt: skip
    # Spark's log through the shipped log4j2.properties: nothing below WARN; no stage
    # progress bars (stderr is a pipe here).
    assert not re.search(r"^\d\d/\d\d/\d\d [\d:]{8} (INFO|DEBUG) ", ran.stderr, re.M), ran.stderr
    assert "[Stage " not in ran.stderr
    # Spark's first batch ran, empty: nothing is output, nothing left staged.
    assert list((tmp_path / "var" / "spark" / "output").rglob("batch_id=*")) == []


def test_output_rows_count_the_published_batches_only(spark, tmp_path):
    """A batch staged under `_pending` (its run died before its marker) is not output,
    and Spark's reader cannot infer a schema from an output of nothing else."""
    out = tmp_path / "output"
    rows = spark.createDataFrame([(n,) for n in range(3)], "n int")
    rows.write.parquet(str(out / "_pending" / "batch_id=0"))
    assert count_output(spark, str(out)) == 0
    rows.write.parquet(str(out / "batch_id=1"))
    assert count_output(spark, str(out)) == 3
    assert count_output(spark, str(tmp_path / "nothing-yet")) == 0

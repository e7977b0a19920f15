"""A fresh user's first run: the example config, plain (not JSON) records. The
default handler passes them all, and a handler that fails most of a batch says
so loudly."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from devtools.topics import create_topics
from spark_sink.config import SinkSettings, load_sink_settings
from spark_sink.handlers import orders
from spark_sink.job import run_until_idle
from tests.integration.spark.session import Clean, produce, source_token

pytestmark = pytest.mark.spark

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

"""No client asks for topic auto-creation; a missing topic's /readyz line (issue 58)."""

from __future__ import annotations

from pathlib import Path

import aiokafka.admin.client
import aiokafka.client
from aiokafka.protocol.metadata import MetadataRequest_v1, MetadataRequest_v5

from devtools.harness import Topics, make_settings
from gateway.config import load_sink_settings
from gateway.kafka.clients import NoAutoCreateMetadataRequest
from gateway.rules.missing_topics import missing_line
from gateway.service.topic_watch import TopicWatch, configured_topics
from spark_sink.job import make_sink


def _settings(**sections: object):
    topics = Topics(lambda base: base)
    return make_settings("127.0.0.1:9092", topics, ["redis://127.0.0.1:6379/0"], **sections)


def test_every_aiokafka_metadata_request_refuses_auto_creation():
    # installed when gateway.kafka.clients is imported, before any client is built
    assert aiokafka.client.MetadataRequest is NoAutoCreateMetadataRequest
    assert aiokafka.admin.client.MetadataRequest is NoAutoCreateMetadataRequest
    request = aiokafka.client.MetadataRequest(["ordres"]).build(MetadataRequest_v5)
    assert request.allow_auto_topic_creation is False
    assert aiokafka.client.MetadataRequest(["x"]).build(MetadataRequest_v1).topics == ["x"]


def test_the_spark_jobs_producer_refuses_auto_creation(tmp_path):
    settings = load_sink_settings(
        kafka={"bootstrap_servers": "127.0.0.1:9092"},
        spark={"output_path": str(tmp_path / "out"), "checkpoint_dir": str(tmp_path / "cp")},
    )
    sink = make_sink(settings, handler=lambda rows: None)  # type: ignore[arg-type]
    assert sink.producer_config["allow.auto.create.topics"] == "false"


def test_configured_topics_in_flow_order_with_roles():
    settings = _settings(delay={"enabled": True})
    named = configured_topics(settings)
    assert named == {"raw": "raw", "clean": "clean", "failures": "failure",
                     "quarantine": "quarantine", "dead": "dead-letter"}  # fmt: skip
    with_tiers = configured_topics(settings, tiers=True)
    assert [role for role in with_tiers.values()].count("delay tier") == len(settings.delay.tiers)


def test_the_line_names_the_topic_the_nearest_name_and_the_command():
    existing = ["orders", "orders-clean", "__consumer_offsets", "payments"]
    line = missing_line({"ordres": "raw"}, existing, Path("/etc/gw.toml"))
    assert line == (
        "raw topic 'ordres' does not exist (did you mean 'orders'?): "
        "create it: dedup-gateway topics --create --config /etc/gw.toml"
    )
    line = missing_line({"orders-clen": "clean", "zzz": "failure"}, existing, None)
    assert line == (
        "clean topic 'orders-clen' does not exist (did you mean 'orders-clean'?); "
        "failure topic 'zzz' does not exist: create it: dedup-gateway topics --create "
        "--config FILE"
    )


def test_the_watch_clears_once_every_topic_exists():
    watch = TopicWatch(_settings(), Path("g.toml"))
    assert watch.judge({"raw", "clean", "failures"}, tiers=False) is not None
    assert watch.problem is not None and "'quarantine'" in watch.problem
    assert watch.judge({"raw", "clean", "failures", "quarantine", "dead"}, tiers=False) is None
    assert watch.problem is None

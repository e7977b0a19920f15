"""The sink reads the gateway's TOML file; its own bad settings are named."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from gateway.config import ConfigError
from spark_sink.config import DEFAULT_HANDLER, kafka_client_config, load_sink_settings


def test_defaults():
    settings = load_sink_settings()
    assert settings.spark.handler == DEFAULT_HANDLER
    assert settings.spark.max_records_per_batch == 10_000
    assert settings.spark.trigger_interval == timedelta(seconds=1)
    assert settings.spark.dedup_watermark == timedelta(minutes=10)
    assert settings.spark.source == "auto"


def test_shared_toml_file_gateway_sections_ignored_and_env_overrides(tmp_path: Path, monkeypatch):
    path = tmp_path / "gateway.toml"
    path.write_text(
        '[kafka]\nbootstrap_servers = "k1:9092"\nclean_topic = "orders-clean"\n'
        '[redis]\nnodes = ["redis://h1:7000/0"]\n[dedup]\nid = "key"\n'
        '[spark]\noutput_path = "/data/out"\ndedup_watermark = "30m"\n'
        'handler = "spark_sink.handlers:failing_ids"\nhandler_options = {ids = ["o-1"]}\n'
    )
    monkeypatch.setenv("GATEWAY_SPARK__MAX_RECORDS_PER_BATCH", "500")
    settings = load_sink_settings(path)
    assert settings.kafka.clean_topic == "orders-clean"
    assert settings.spark.output_path == "/data/out"
    assert settings.spark.dedup_watermark == timedelta(minutes=30)
    assert settings.spark.max_records_per_batch == 500
    assert settings.spark.handler_options == {"ids": ["o-1"]}
    assert kafka_client_config(settings.kafka)["bootstrap.servers"] == "k1:9092"


@pytest.mark.parametrize(
    ("spark", "setting", "hint"),
    [
        ({"handler": "no_colon"}, "spark.handler", "module:function"),
        ({"max_records_per_batch": 0}, "spark.max_records_per_batch", "greater than"),
        ({"dedup_watermark": "soon"}, "spark.dedup_watermark", "duration"),
        ({"trigger_interval": "0s"}, "spark.trigger_interval", "positive"),
        ({"source": "jdbc"}, "spark.source", "auto"),
        ({"max_records": 5}, "spark.max_records", "Extra inputs"),
    ],
)
def test_bad_spark_setting_is_named(spark, setting, hint):
    with pytest.raises(ConfigError) as err:
        load_sink_settings(spark=spark)
    assert f"invalid setting {setting}:" in str(err.value)
    assert hint in str(err.value)


def test_missing_file_is_a_config_error(tmp_path: Path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_sink_settings(tmp_path / "nope.toml")


def test_command_line_reports_a_bad_config_and_exits_2(tmp_path: Path, capsys):
    from spark_sink.__main__ import main

    path = tmp_path / "bad.toml"
    path.write_text('[spark]\nsource = "jdbc"\n')
    assert main(["--config", str(path)]) == 2
    assert "invalid setting spark.source" in capsys.readouterr().err

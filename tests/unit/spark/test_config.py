"""The sink reads the gateway's TOML file; its own bad settings are named."""

from __future__ import annotations

import json
import logging
from datetime import timedelta
from pathlib import Path

import pytest

from gateway.config import ConfigError
from gateway.kafka.clients import librdkafka_options
from gateway.logs import UtcJsonFormatter
from spark_sink.config import DEFAULT_HANDLER, load_sink_settings


def test_defaults():
    settings = load_sink_settings()
    assert settings.spark.handler == DEFAULT_HANDLER
    assert settings.spark.max_records_per_batch == 100_000
    assert settings.spark.trigger_interval == timedelta(seconds=5)
    assert settings.spark.dedup_watermark == timedelta(minutes=10)
    assert settings.spark.dedup_redis == ""  # the state store
    assert settings.spark.source == "auto"
    assert settings.spark.delivery_dedup == "auto"
    assert (settings.log.level, settings.log.json_format) == ("INFO", False)


def test_shared_toml_file_gateway_sections_ignored_and_env_overrides(tmp_path: Path, monkeypatch):
    path = tmp_path / "gateway.toml"
    path.write_text(
        '[kafka]\nbootstrap_servers = "k1:9092"\nclean_topic = "orders-clean"\n'
        '[redis]\nnodes = ["redis://h1:7000/0"]\n[dedup]\nid = "key"\n'
        '[spark]\noutput_path = "/data/out"\ndedup_watermark = "30m"\n'
        'handler = "devtools.handlers:failing_ids"\nhandler_options = {ids = ["o-1"]}\n'
    )
    monkeypatch.setenv("GATEWAY_SPARK__MAX_RECORDS_PER_BATCH", "500")
    settings = load_sink_settings(path)
    assert settings.kafka.clean_topic == "orders-clean"
    assert settings.spark.output_path == "/data/out"
    assert settings.spark.dedup_watermark == timedelta(minutes=30)
    assert settings.spark.max_records_per_batch == 500
    assert settings.spark.handler_options == {"ids": ["o-1"]}
    assert librdkafka_options(settings.kafka)["bootstrap.servers"] == "k1:9092"


@pytest.mark.parametrize(
    ("spark", "setting", "hint"),
    [
        ({"handler": "no_colon"}, "spark.handler", "module:function"),
        ({"max_records_per_batch": 0}, "spark.max_records_per_batch", "greater than"),
        ({"dedup_watermark": "soon"}, "spark.dedup_watermark", "duration"),
        ({"trigger_interval": "0s"}, "spark.trigger_interval", "positive"),
        ({"source": "jdbc"}, "spark.source", "auto"),
        ({"delivery_dedup": "yes"}, "spark.delivery_dedup", "auto"),
        ({"dedup_redis": "http://h:6379"}, "spark.dedup_redis", "redis://, rediss:// or unix://"),
        ({"dedup_redis": "redis://:pw@h:port"}, "spark.dedup_redis", "redis://:***@h:port"),
        ({"dedup_redis": "redis://h/zero"}, "spark.dedup_redis", "host[:port][/db]"),
        ({"dedup_redis": "unix://"}, "spark.dedup_redis", "socket's path"),
    ],
)
def test_bad_spark_setting_is_named(spark, setting, hint):
    with pytest.raises(ConfigError) as err:
        load_sink_settings(spark=spark)
    assert f"invalid setting {setting}:" in str(err.value)
    assert hint in str(err.value)
    assert ":pw@" not in str(err.value)  # a password is never printed


def test_missing_file_is_a_config_error(tmp_path: Path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_sink_settings(tmp_path / "nope.toml")


def test_command_line_reports_a_bad_config_and_exits_2(tmp_path: Path, capsys):
    from spark_sink.__main__ import main

    path = tmp_path / "bad.toml"
    path.write_text('[spark]\nsource = "jdbc"\n')
    assert main(["--config", str(path)]) == 2
    assert "invalid setting spark.source" in capsys.readouterr().err


def test_command_line_configures_logging_from_the_log_section(
    tmp_path: Path, monkeypatch, capsys, restore_logging
):
    import spark_sink.__main__ as entry
    from spark_sink import job

    path = tmp_path / "gateway.toml"
    path.write_text('[log]\nlevel = "WARNING"\njson = true\n')
    ran: list[object] = []
    monkeypatch.setattr(job, "run_forever", lambda settings, stop: ran.append(settings))
    assert entry.main(["--config", str(path)]) == 0
    assert len(ran) == 1

    root = logging.getLogger()
    assert root.level == logging.WARNING
    assert [type(h.formatter) for h in root.handlers] == [UtcJsonFormatter]
    logging.getLogger("spark_sink.job").info("not shown")
    logging.getLogger("spark_sink.job").warning("shown")
    lines = capsys.readouterr().err.strip().splitlines()
    assert [(e["level"], e["message"]) for e in map(json.loads, lines)] == [("WARNING", "shown")]

"""`check-config` prints settings that load back to the same settings; compound
durations; `[spark]` validated with the rest; every subcommand's help has an example."""

from __future__ import annotations

import json
import logging
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.cli import build_parser, main
from gateway.config import ConfigError, effective, format_duration, load_settings, parse_duration
from spark_sink.config import load_sink_settings

FULL = """
[kafka]
bootstrap_servers = "k1:9092,k2:9092"
sasl_mechanism = "SCRAM-SHA-512"
security_protocol = "SASL_PLAINTEXT"
sasl_username = "gw"
sasl_password = "kafka-secret"
fetch_max_wait = 0.25
[kafka.client]
"client.id" = "gw-1"
"java.sasl.login.refresh.buffer.seconds" = 60
[redis]
nodes = ["redis://:redis-secret@r0:6379/0", "redis://r1:6379/0", "redis+cluster://c1:7000,c2:7000"]
ttl = "1h30m"
timeout = "750ms"
[delay]
enabled = true
tiers = ["250ms", "4s", "1m30s"]
max_delay = "1h"
[[lanes]]
name = "orders"
raw_topics = ["orders", "orders.eu"]
priority = 2
# no per-lane clean topic: delay tiers deliver to the one clean topic
[[lanes]]
name = "bulk"
raw_topics = ["bulk"]
max_starve = "1m"
[log]
json = true
[spark]
master = "local[2]"
trigger_interval = "2s500ms"
conf = {"spark.sql.shuffle.partitions" = "4"}
handler_options = {"table" = "orders", "weights" = [1, 2]}
"""


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("1h30m", 5400), ("2s500ms", 2.5), ("1d 12h", 129600), ("90s", 90), ("0.5ms", 0.0005)],
)
def test_compound_durations_are_read(text, seconds):
    assert parse_duration(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize("text", ["", "1h30", "h", "1w", "-5s", "1h-30m"])
def test_a_malformed_duration_is_refused(text):
    with pytest.raises(ValueError, match="1h30m"):
        parse_duration(text)


@given(st.integers(0, 400 * 86_400_000_000))
def test_a_duration_spelled_out_reads_back_as_itself(micros):
    duration = timedelta(microseconds=micros)
    spelled = format_duration(duration)
    assert parse_duration(spelled) == duration


def test_durations_are_spelled_as_the_config_takes_them():
    assert [format_duration(timedelta(seconds=s)) for s in (0, 0.1, 5400, 86400 + 1.5)] == [
        "0s",
        "100ms",
        "1h30m",
        "1d1s500ms",
    ]


def check_config(capsys, path: Path, *extra: str) -> str:
    assert main(["check-config", "--config", str(path), *extra]) == 0
    return capsys.readouterr().out


def test_check_config_output_loads_back_to_the_same_settings(tmp_path, capsys):
    original = tmp_path / "gateway.toml"
    original.write_text(FULL)
    printed = check_config(capsys, original)
    assert "PT" not in printed and 'ttl = "1h30m"' in printed and "[[lanes]]" in printed
    again = tmp_path / "effective.toml"
    again.write_text(printed)
    assert check_config(capsys, again) == printed  # a fixed point
    first, second = load_settings(original), load_settings(again)
    assert effective(second) | {"spark": None} == effective(first) | {"spark": None}
    # `[spark]` as the Spark job reads it (the gateway keeps that table as given).
    spark_first, spark_second = load_sink_settings(original), load_sink_settings(again)
    assert spark_second.spark == spark_first.spark
    assert spark_second.spark.trigger_interval == timedelta(seconds=2.5)
    # What differs is only what is masked: the secrets.
    assert "kafka-secret" not in printed and "redis-secret" not in printed
    assert first.redis.ttl == second.redis.ttl == timedelta(minutes=90)
    assert second.lanes == first.lanes and second.delay == first.delay
    assert json.loads(check_config(capsys, again, "--output", "json"))["redis"]["ttl"] == "1h30m"


def test_the_default_settings_round_trip_too(tmp_path, capsys):
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    printed = tmp_path / "printed.toml"
    printed.write_text(check_config(capsys, empty))
    assert effective(load_settings(printed)) | {"spark": None} == effective(
        load_settings(empty)
    ) | {"spark": None}
    assert load_sink_settings(printed).spark == load_sink_settings(empty).spark


def test_a_bogus_key_under_spark_stops_check_config_naming_it(tmp_path, capsys):
    path = tmp_path / "gateway.toml"
    path.write_text('[spark]\nmaster = "local[2]"\nchekpoint_dir = "/tmp/x"\n')
    assert main(["check-config", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "unknown key `chekpoint_dir` in [spark]; did you mean `checkpoint_dir`?" in err


def test_a_bogus_kafka_client_value_stops_start_up_naming_the_table():
    with pytest.raises(ConfigError, match=r"kafka\.client"):
        load_settings(kafka={"client": {"client.id": {"nested": 1}}})


def test_every_subcommand_help_has_an_example():
    parser = build_parser()
    subcommands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert set(subcommands) >= {"run", "check-config", "topics", "inspect", "release",
                                "redrive", "pause", "resume", "rebuild"}  # fmt: skip
    for name, sub in subcommands.items():
        help_text = sub.format_help()
        assert "example" in help_text and f"dedup-gateway {name} " in help_text, name


def test_operator_commands_log_warnings_only_unless_verbose(tmp_path):
    from gateway.cli import _settings

    path = tmp_path / "gateway.toml"
    path.write_text("")
    parser = build_parser()
    _settings(parser.parse_args(["inspect", "x", "--config", str(path)]))
    assert logging.getLogger().level == logging.WARNING
    _settings(parser.parse_args(["inspect", "x", "-v", "--config", str(path)]))
    assert logging.getLogger().level == logging.INFO
    _settings(parser.parse_args(["run", "--config", str(path)]))
    assert logging.getLogger().level == logging.INFO

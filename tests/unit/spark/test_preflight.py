"""What the job checks before its Spark session starts: `[spark] delivery_dedup`
resolved, the broker reached within a second, the `spark` extra and Java present, and
the session's logging (spark_sink/preflight.py, spark_sink/__main__.py, session.session_conf)."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from spark_sink import job, session
from spark_sink.__main__ import main
from spark_sink.config import load_sink_settings
from spark_sink.preflight import decide

NO_TXN = "the broker lacks transactions (Kafka 2.5+ has them)"
ALL_TRANSACTIONAL = {"failures": {"mode": "release"}}


@pytest.mark.parametrize(
    ("exactly_once", "sections", "no_transactions", "dedup"),
    [
        ("on", ALL_TRANSACTIONAL, None, False),
        ("auto", ALL_TRANSACTIONAL, None, False),
        # The gateway would write at-least-once: its own check, asked the same way.
        ("auto", ALL_TRANSACTIONAL, NO_TXN, True),
        ("off", ALL_TRANSACTIONAL, None, True),
        # Paths the gateway runs at-least-once into the clean topic, even transactional.
        ("on", {}, None, True),  # [failures] mode = "retry", the default
        ("on", {**ALL_TRANSACTIONAL, "delay": {"enabled": True}}, None, True),
        ("on", {**ALL_TRANSACTIONAL, "coalesce": {"enabled": True}}, None, True),
    ],
)
def test_auto_turns_the_delivery_dedup_off_only_when_every_path_is_transactional(
    exactly_once: str, sections: dict[str, Any], no_transactions: str | None, dedup: bool
):
    settings = load_sink_settings(kafka={"exactly_once": exactly_once}, **sections)
    decision = decide(settings, no_transactions)
    assert decision.delivery_dedup is dedup
    assert decision.why.startswith("auto: ")


@pytest.mark.parametrize(("mode", "dedup"), [("on", True), ("off", False)])
def test_on_and_off_are_what_they_say_whatever_the_gateway_does(mode: str, dedup: bool):
    for exactly_once in ("on", "off"):
        settings = load_sink_settings(
            kafka={"exactly_once": exactly_once}, spark={"delivery_dedup": mode}
        )
        assert decide(settings, NO_TXN).delivery_dedup is dedup


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_an_unreachable_broker_stops_the_job_in_one_line_before_spark_starts(
    tmp_path: Path, capsys, monkeypatch, restore_logging
):
    def no_session(settings: object) -> None:
        raise AssertionError("the Spark session was started")

    monkeypatch.setattr(job, "build_session", no_session)
    path = tmp_path / "gateway.toml"
    path.write_text(f'[kafka]\nbootstrap_servers = "127.0.0.1:{closed_port()}"\n')
    started = time.monotonic()
    assert main(["--config", str(path), "--until-idle"]) == 3
    assert time.monotonic() - started < 5
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("spark_sink: cannot connect to the broker: [kafka] bootstrap_servers")


def test_without_the_spark_extra_the_job_says_what_to_install(tmp_path: Path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyspark", None)  # find_spec: not installed
    assert main(["--config", str(tmp_path / "none.toml")]) == 2  # the file is checked first
    capsys.readouterr()
    (tmp_path / "gateway.toml").write_text("")
    assert main(["--config", str(tmp_path / "gateway.toml")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "pyspark not installed: install dedup-gateway[spark] and a Java runtime" in line


def test_without_java_the_job_says_so(tmp_path: Path, capsys, monkeypatch):
    monkeypatch.delenv("PYSPARK_GATEWAY_PORT", raising=False)
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "no-jdk"))
    (tmp_path / "gateway.toml").write_text("")
    assert main(["--config", str(tmp_path / "gateway.toml")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "has no bin/java" in line


@pytest.mark.parametrize("terminal", [True, False])
def test_the_session_gets_the_shipped_log4j2_file_and_no_progress_bars_off_a_terminal(
    terminal: bool, monkeypatch
):
    monkeypatch.setattr(session, "jvm_started", lambda: False)
    conf = session.session_conf(load_sink_settings(), terminal)
    assert ("spark.ui.showConsoleProgress" in conf) is not terminal
    if not terminal:
        assert conf["spark.ui.showConsoleProgress"] == "false"
    assert conf[session.DRIVER_JAVA_OPTIONS] == f"-Dlog4j2.configurationFile={session.LOG4J2_CONF}"
    text = session.LOG4J2_CONF.read_text()
    assert "rootLogger.level = warn" in text and "appender.console.target = SYSTEM_ERR" in text


def test_the_users_own_java_options_and_log4j2_file_are_kept(monkeypatch):
    monkeypatch.setattr(session, "jvm_started", lambda: False)
    mine = "-Dlog4j2.configurationFile=/etc/spark/log4j2.properties -Xss4m"
    conf = session.session_conf(
        load_sink_settings(spark={"conf": {session.DRIVER_JAVA_OPTIONS: mine}}), terminal=False
    )
    assert conf[session.DRIVER_JAVA_OPTIONS] == mine
    other = session.session_conf(
        load_sink_settings(spark={"conf": {session.DRIVER_JAVA_OPTIONS: "-Xss4m"}}), terminal=False
    )
    assert (
        other[session.DRIVER_JAVA_OPTIONS]
        == f"-Dlog4j2.configurationFile={session.LOG4J2_CONF} -Xss4m"
    )


@pytest.mark.parametrize(
    ("master", "conf", "bound"),
    [
        (None, {}, "127.0.0.1"),  # Spark's default master is local[*]
        ("local[2]", {}, "127.0.0.1"),
        ("local[2]", {"spark.driver.bindAddress": "0.0.0.0"}, "0.0.0.0"),  # the user's
        ("spark://10.0.0.5:7077", {}, None),  # a cluster's executors reach the driver
    ],
)
def test_the_driver_binds_to_loopback_in_local_mode_unless_told_otherwise(
    master, conf, bound, monkeypatch
):
    monkeypatch.setattr(session, "jvm_started", lambda: False)
    settings = load_sink_settings(spark={"master": master, "conf": conf})
    got = session.session_conf(settings, terminal=False)
    assert got.get("spark.driver.bindAddress") == bound
    if not conf:
        assert got.get("spark.driver.host") == bound


def test_a_session_spark_submit_started_keeps_its_own_addresses(monkeypatch):
    monkeypatch.setattr(session, "jvm_started", lambda: True)
    assert "spark.driver.bindAddress" not in session.session_conf(load_sink_settings(), False)

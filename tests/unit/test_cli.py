"""The command line's own surface: version, config lookup, check-config, argument
checks and confirmations that stop before anything connects."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import types
from importlib import metadata
from pathlib import Path

import pytest

from gateway.cli import _message_id, build_parser, main
from gateway.service import signals

# Unreachable on purpose: a command that got as far as connecting would fail differently.
CONFIG = """
[kafka]
raw_topics = ["orders"]
sasl_mechanism = "PLAIN"
sasl_username = "gw"
sasl_password = "kafka-secret"
[redis]
nodes = ["redis://:redis-secret@127.0.0.1:1/0"]
ttl = "12h"
"""


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "gateway.toml"
    path.write_text(CONFIG)
    return path


def test_version_is_the_installed_package_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"dedup-gateway {metadata.version('dedup-gateway')}"


def test_check_config_reads_gateway_config_when_no_config_is_given_and_masks_secrets(
    config, monkeypatch, capsys
):
    monkeypatch.setenv("GATEWAY_CONFIG", str(config))
    assert main(["check-config", "--output", "json"]) == 0
    out = capsys.readouterr().out
    settings = json.loads(out)
    assert settings["kafka"]["raw_topics"] == ["orders"]
    assert settings["redis"]["nodes"] == ["redis://:***@127.0.0.1:1/0"]
    assert "kafka-secret" not in out and "redis-secret" not in out

    assert main(["check-config"]) == 0
    text = capsys.readouterr().out
    assert '[kafka]\nbootstrap_servers = "127.0.0.1:9092"\nraw_topics = ["orders"]' in text
    assert "# ssl_cafile is not set" in text
    assert "kafka-secret" not in text and "redis-secret" not in text


def test_check_config_masks_a_query_password_and_the_token_command(tmp_path, capsys):
    """A Redis password given as `?password=` (redis-py authenticates with it) and the
    OAUTHBEARER token command (its arguments may carry a credential) were printed."""
    path = tmp_path / "gateway.toml"
    path.write_text(
        '[kafka]\nraw_topics = ["orders"]\nsecurity_protocol = "SASL_SSL"\n'
        '[kafka.client]\n"sasl.mechanism" = "OAUTHBEARER"\n'
        '"sasl.oauthbearer.token.command" = "fetch-token --secret cmd-secret"\n'
        '[redis]\nnodes = ["redis://127.0.0.1:1/0?password=query-secret"]\n'
    )
    for output in ("json", "text"):
        assert main(["check-config", "--config", str(path), "--output", output]) == 0
        out = capsys.readouterr().out
        assert "query-secret" not in out and "cmd-secret" not in out, out
        assert "password=***" in out


def test_check_config_exits_2_with_one_line_naming_the_bad_setting(tmp_path, monkeypatch, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('[redis]\nttl = "forever"\n')
    assert main(["check-config", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dedup-gateway: invalid setting redis.ttl:") and err.count("\n") == 1

    monkeypatch.setenv("GATEWAY_CONFIG", str(tmp_path / "missing.toml"))
    assert main(["check-config"]) == 2
    assert "missing.toml does not exist" in capsys.readouterr().err


def test_an_id_is_taken_as_text_base64_or_hex_and_always_as_exact_bytes():
    parser = build_parser()
    as_text = parser.parse_args(["inspect", "m-1"])
    assert _message_id(as_text) == b"m-1"
    # A command-line argument that is not UTF-8 arrives surrogate-escaped: its own bytes back.
    assert _message_id(parser.parse_args(["inspect", "\udcff\udcfe-bin"])) == b"\xff\xfe-bin"
    assert _message_id(parser.parse_args(["inspect", "--id-b64", "//4tYmlu"])) == b"\xff\xfe-bin"
    assert _message_id(parser.parse_args(["release", "--id-hex", "fffe2d62696e"])) == (
        b"\xff\xfe-bin"
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect"],
        ["inspect", "m-1", "--id-hex", "00"],
        ["inspect", "--id-b64", "not base64!"],
        ["inspect", "--id-b64", ""],
        ["release", "--id-hex", "zz"],
        ["redrive", "--output", "yaml"],
    ],
)
def test_bad_arguments_are_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    assert "usage:" in capsys.readouterr().err


class _Terminal:
    """stdin as a person at a terminal who types `answer`."""

    def __init__(self, answer: str) -> None:
        self.answer = answer

    def isatty(self) -> bool:
        return True

    def readline(self) -> str:
        return self.answer


def test_an_unconditional_release_without_a_terminal_needs_yes(config, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", types.SimpleNamespace(isatty=lambda: False))
    assert main(["release", "m-1", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "pass --yes" in err and "'m-1'" in err and err.count("\n") == 1


def test_an_unconditional_release_declined_at_the_terminal_does_nothing(
    config, monkeypatch, capsys
):
    monkeypatch.setattr(sys, "stdin", _Terminal("n\n"))
    assert main(["release", "m-1", "--config", str(config)]) == 1
    out = capsys.readouterr().out
    assert "whoever holds it? [y/N]" in out and out.rstrip().endswith("not released")


def test_rebuild_passes_its_arguments_to_gateway_rebuild(config, monkeypatch):
    calls = []

    async def rebuild(settings, member, *, source, dry_run, output):
        calls.append((settings.kafka.raw_topics, member, source, dry_run, output))
        return 3

    module = types.ModuleType("gateway.ops.rebuild")
    module.rebuild = rebuild  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "gateway.ops.rebuild", module)
    argv = ["rebuild", "127.0.0.1:6381/0", "--from", "127.0.0.1:6380/0", "--dry-run",
            "--output", "json", "--config", str(config)]  # fmt: skip
    assert main(argv) == 3
    assert calls == [(["orders"], "127.0.0.1:6381/0", "127.0.0.1:6380/0", True, "json")]
    assert build_parser().parse_args(["rebuild", "m"]).source is None


async def test_sigusr1_logs_where_every_asyncio_task_waits(caplog):
    gate = asyncio.Event()

    async def waiting_on_the_gate() -> None:
        await gate.wait()

    task = asyncio.create_task(waiting_on_the_gate(), name="stuck-one")
    await asyncio.sleep(0)  # let it reach its await
    with caplog.at_level(logging.WARNING, logger="gateway"):
        signals.log_tasks()
    gate.set()
    await task
    text = caplog.text
    assert "asyncio tasks" in text
    assert "task stuck-one:" in text and "waiting_on_the_gate" in text

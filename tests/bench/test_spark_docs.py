"""The benchmark commands docs/spark-performance.md shows are ones `python -m bench`
accepts, with the spark variants they name, and the settings they set are the job's."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from bench import run
from spark_sink.config import load_sink_settings

DOC = Path(__file__).resolve().parents[2] / "docs" / "spark-performance.md"
COMMAND = re.compile(r'^\s*((?:[A-Z_]+=\S+\s+)*)make bench ARGS="([^"]*)"', re.MULTILINE)


def test_the_spark_pages_bench_commands_parse_and_name_the_spark_variants(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    commands = COMMAND.findall(DOC.read_text())
    assert len(commands) >= 2, "the page shows its bench commands"
    for env, args in commands:
        options = run.parse_args(shlex.split(args))
        assert {"gateway-3", "spark-job", "spark-floor"} <= set(options.variants)
        for assignment in env.split():
            name, _, value = assignment.partition("=")
            monkeypatch.setenv(name, value)
            section, _, key = name.removeprefix("GATEWAY_").lower().partition("__")
            settings = load_sink_settings()
            assert str(getattr(getattr(settings, section), key)) == value

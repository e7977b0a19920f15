"""The benchmark commands docs/spark-performance.md shows are ones `python -m bench`
accepts, with the spark variants they name."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from bench import run

DOC = Path(__file__).resolve().parents[2] / "docs" / "spark-performance.md"


def test_the_spark_pages_bench_commands_parse_and_name_the_spark_variants() -> None:
    commands = re.findall(r'^\s*make bench ARGS="([^"]*)"', DOC.read_text(), re.MULTILINE)
    assert commands, "the page shows no `make bench` command"
    for args in commands:
        options = run.parse_args(shlex.split(args))
        assert {"gateway-3", "spark-job", "spark-floor"} <= set(options.variants)

"""The benchmark's tests: whole benchmark runs, small.

They run the benchmark under uvloop (`bench.run.main`), whose callbacks swallow the
exception pytest-timeout's default (signal) method raises: a run past its timeout
then hung instead of failing (seen once under heavy load). The thread method ends
the worker instead, which pytest-xdist reports as that test's failure. The runs are
the suite's longest (a few minutes each under load), so their budget is larger.
The spark variants run in their own process (bench/spark.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.spark.session import add_spark_warning_filters

BENCH_TIMEOUT_S = 900


def pytest_configure(config: pytest.Config) -> None:
    add_spark_warning_filters(config)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if item.path.is_relative_to(here):
            item.add_marker(pytest.mark.timeout(BENCH_TIMEOUT_S, method="thread"))

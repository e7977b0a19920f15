"""The benchmark's test runs the spark variants in its own process (bench/spark.py)."""

from __future__ import annotations

import pytest

from tests.integration.spark.session import add_spark_warning_filters


def pytest_configure(config: pytest.Config) -> None:
    add_spark_warning_filters(config)

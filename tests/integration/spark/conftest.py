"""Spark tests share one session (see session.py)."""

from __future__ import annotations

import pytest

from tests.integration.spark.session import add_spark_warning_filters, spark

__all__ = ["spark"]


def pytest_configure(config: pytest.Config) -> None:
    add_spark_warning_filters(config)

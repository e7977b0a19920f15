"""Pure-transform tests run on the same shared SparkSession as the stream tests."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from tests.integration.spark.session import add_spark_warning_filters, spark

__all__ = ["spark"]


def pytest_configure(config: pytest.Config) -> None:
    add_spark_warning_filters(config)


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """The root and py4j loggers as they were (`spark_sink.__main__.main` configures them)."""
    root, py4j = logging.getLogger(), logging.getLogger("py4j")
    handlers, level, py4j_level = root.handlers[:], root.level, py4j.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    py4j.setLevel(py4j_level)

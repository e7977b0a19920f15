"""The versions the docs and deploy files name are the ones the tests run."""

from __future__ import annotations

import re
from importlib.metadata import version

from devtools.jars import KAFKA_VERSION
from tests.deployment.conftest import REPO


def test_the_compose_stack_runs_the_tested_kafka() -> None:
    compose = (REPO / "deploy" / "compose.yaml").read_text()
    assert re.findall(r"image: apache/kafka:(\S+)", compose) == [KAFKA_VERSION]


def test_the_readme_names_the_tested_kafka_and_spark() -> None:
    readme = (REPO / "README.md").read_text()
    assert f"Apache Kafka {KAFKA_VERSION}" in readme
    assert f"Spark {version('pyspark')}" in readme

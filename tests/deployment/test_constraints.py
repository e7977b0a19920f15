"""constraints.txt: the tested versions, used by `make setup`, both images and the
Spark pack; pyproject.toml's bounds admit them; the Spark image runs the Spark
of the pinned pyspark, with the matching Kafka connector."""

from __future__ import annotations

import re
import tomllib
from importlib.metadata import version

import pytest
from packaging.requirements import Requirement

from tests.deployment.conftest import DEPLOY, REPO

CONSTRAINTS = REPO / "constraints.txt"
BOUNDED = ("pyspark", "pyarrow", "pandas", "redis", "aiokafka", "confluent-kafka")


def pins() -> dict[str, str]:
    """name (normalised) -> pinned version."""
    found = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, pinned = line.partition("==")
            assert pinned, f"constraints.txt: {line!r} is not an exact pin"
            found[name.lower().replace("_", "-")] = pinned
    return found


def requirements() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return [Requirement(r) for r in [*project["dependencies"], *extras["spark"]]]


def test_runtime_dependencies_are_bounded_and_admit_the_pinned_versions() -> None:
    pinned = pins()
    reqs = {r.name.lower(): r for r in requirements()}
    for name in BOUNDED:
        spec = reqs[name].specifier
        assert any(s.operator == "<" for s in spec), f"{name} has no upper bound"
        assert spec.contains(pinned[name]), f"{name}=={pinned[name]} is outside {spec}"


@pytest.mark.parametrize("name", BOUNDED)
def test_this_venv_runs_the_pinned_version(name: str) -> None:
    """`make setup` installs with constraints.txt: what runs the tests is what is pinned."""
    assert version(name) == pins()[name]


def test_setup_the_images_and_the_spark_pack_install_with_the_constraints() -> None:
    assert '-c "$(dirname "$0")/../constraints.txt"' in (REPO / "scripts/setup.sh").read_text()
    assert '-c "$REPO/constraints.txt"' in (REPO / "scripts/pack-spark-env.sh").read_text()
    gateway = (DEPLOY / "gateway.Dockerfile").read_text()
    assert "-c constraints.txt" in gateway
    assert "--constraints /wheels/constraints.txt" in (DEPLOY / "spark.Dockerfile").read_text()


def test_the_spark_image_runs_the_pinned_pysparks_spark_and_connector() -> None:
    text = (DEPLOY / "spark.Dockerfile").read_text()
    image = re.search(r"^ARG SPARK_IMAGE=apache/spark:([\d.]+)-", text, re.M)
    connector = re.search(
        r"^ARG KAFKA_CONNECTOR=\S+:spark-sql-kafka-0-10_2\.13:([\d.]+)$", text, re.M
    )
    assert image and connector
    assert image[1] == connector[1] == pins()["pyspark"]
    app = (DEPLOY / "k8s/components/spark-operator/sparkapplication.yaml").read_text()
    assert f'sparkVersion: "{pins()["pyspark"]}"' in app

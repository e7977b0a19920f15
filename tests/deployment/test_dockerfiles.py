"""Both images' Dockerfiles lint clean and keep the properties operators rely on."""

from __future__ import annotations

import subprocess

import pytest

from tests.deployment.conftest import DEPLOY, REPO, tool

DOCKERFILES = ["gateway.Dockerfile", "spark.Dockerfile"]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_lints_clean_with_hadolint(name: str) -> None:
    result = subprocess.run(
        [tool("hadolint"), "--no-color", str(DEPLOY / name)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def _instructions(name: str) -> list[tuple[str, str]]:
    lines = (DEPLOY / name).read_text().replace("\\\n", " ").splitlines()
    pairs = []
    for line in lines:
        if line.strip() and not line.lstrip().startswith("#"):
            word, _, rest = line.strip().partition(" ")
            pairs.append((word.upper(), rest.strip()))
    return pairs


def test_gateway_image_runs_as_non_root_with_a_healthz_check_and_no_build_stage_leftovers() -> None:
    steps = _instructions("gateway.Dockerfile")
    froms = [rest for word, rest in steps if word == "FROM"]
    assert len(froms) == 2 and "AS builder" in froms[0], "multi-stage: builder then runtime"
    final = steps[max(i for i, (w, _) in enumerate(steps) if w == "FROM") :]
    users = [rest for word, rest in final if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    health = [rest for word, rest in final if word == "HEALTHCHECK"]
    assert len(health) == 1 and "/healthz" in health[0] and "9108" in health[0]
    assert ("CMD", '["run", "--config", "/etc/dedup-gateway/gateway.toml"]') in final
    # The default config baked into the image is the one the tests load.
    copied = [rest.split()[0] for word, rest in final if word == "COPY" and "--from" not in rest]
    assert copied == ["deploy/config/gateway.toml"]


def test_spark_image_is_the_official_spark_image_with_the_kafka_connector() -> None:
    text = (DEPLOY / "spark.Dockerfile").read_text()
    assert "ARG SPARK_IMAGE=apache/spark:4." in text and "python3" in text
    assert "ARG KAFKA_CONNECTOR=org.apache.spark:spark-sql-kafka-0-10_2.13:" in text
    steps = _instructions("spark.Dockerfile")
    users = [rest for word, rest in steps if word == "USER"]
    assert users[-1].split(":")[0] not in ("0", "root")


@pytest.mark.parametrize("name", DOCKERFILES)
def test_build_context_ignore_file_sends_only_what_the_image_copies(name: str) -> None:
    ignore = (DEPLOY / f"{name}.dockerignore").read_text().splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert "*" in ignore
    for word, rest in _instructions(name):
        if word == "COPY" and "--from" not in rest:
            for source in (s.rstrip("/") for s in rest.split()[:-1]):
                assert source in allowed, f"{source} is copied but excluded from the context"
                assert (REPO / source).exists(), source

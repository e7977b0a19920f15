"""Every TOML the deployment ships loads through the real config loaders, with
the secrets the deployment injects as environment overrides."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import yaml

from gateway.config import Settings, load_settings
from spark_sink.config import load_sink_settings
from tests.deployment.conftest import DEPLOY, compose, load_yaml_documents

TOML_FILES = sorted(DEPLOY.rglob("*.toml"))
SECRETS = "dedup-gateway-secrets"


def test_the_deployment_ships_the_compose_and_example_configs() -> None:
    names = {p.relative_to(DEPLOY).as_posix() for p in TOML_FILES}
    shipped = {"config/gateway.toml", "config/gateway.k8s.toml", "config/gateway.example.toml"}
    assert shipped <= names


@pytest.mark.parametrize("path", TOML_FILES, ids=lambda p: p.relative_to(DEPLOY).as_posix())
def test_toml_in_deploy_loads_for_the_gateway_and_the_spark_job(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_gateway_env(monkeypatch)
    settings = load_settings(path)
    assert len(settings.redis.nodes) % 2 == 1
    load_sink_settings(path)


def test_compose_config_with_its_env_overrides_names_three_password_protected_members(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _no_gateway_env(monkeypatch)
    env = compose()["services"]["gateway"]["environment"]
    for name, value in env.items():
        monkeypatch.setenv(name, _interpolate(str(value)))
    settings = load_settings(DEPLOY / "config" / "gateway.toml")
    assert [n.hosts()[0]["host"] for n in settings.redis.nodes] == ["redis-0", "redis-1", "redis-2"]
    assert all(n.hosts()[0]["password"] == "dev-only-change-me" for n in settings.redis.nodes)
    assert settings.quorum == 2
    sink = load_sink_settings(DEPLOY / "config" / "gateway.toml")
    assert str(sink.spark.checkpoint_dir).startswith("/var/lib/spark")  # the spark volume


def _secret_values() -> dict[str, str]:
    path = DEPLOY / "k8s" / "components" / "example-secrets" / "secret.example.yaml"
    (secret,) = [d for d in load_yaml_documents(path) if d["metadata"]["name"] == SECRETS]
    values: dict[str, str] = secret["stringData"]
    return values


def test_kubernetes_toml_loads_with_the_example_secrets_env_overrides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _no_gateway_env(monkeypatch)
    deployment = yaml.safe_load((DEPLOY / "k8s" / "deployment.yaml").read_text())
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    secrets = _secret_values()
    for var in container["env"]:
        assert var["valueFrom"]["secretKeyRef"]["name"] == SECRETS
        monkeypatch.setenv(var["name"], secrets[var["valueFrom"]["secretKeyRef"]["key"]])
    settings: Settings = load_settings(DEPLOY / "config" / "gateway.k8s.toml")
    assert settings.kafka.security_protocol == "SASL_SSL"
    assert settings.kafka.sasl_password is not None
    assert settings.kafka.sasl_password.get_secret_value() == "CHANGE-ME"
    assert [n.scheme for n in settings.redis.nodes] == ["rediss"] * 3
    assert all(n.hosts()[0]["username"] == "dedup-gateway" for n in settings.redis.nodes)
    # The secret is the whole list; the TOML's placeholders are replaced, not merged.
    assert len(json.loads(secrets["redis-nodes"])) == len(settings.redis.nodes)
    assert "CHANGE-ME" not in repr(settings.kafka)  # SecretStr masks it


def _no_gateway_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start from no GATEWAY_* variables, whatever the shell running the tests has."""
    for name in [n for n in os.environ if n.startswith("GATEWAY_")]:
        monkeypatch.delenv(name)


def _interpolate(value: str) -> str:
    """Compose's `${VAR:-default}` with VAR unset: the default."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", value)

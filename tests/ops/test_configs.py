"""Every TOML the deployment ships loads through the real config loaders, with
the secrets the deployment injects as environment overrides."""

from __future__ import annotations

import json
import os
import re
import tomllib
from pathlib import Path

import pytest
import yaml

from gateway.config import Settings, load_settings
from spark_sink.config import load_sink_settings
from tests.ops.conftest import DEPLOY, compose, load_yaml_documents

TOML_FILES = sorted(DEPLOY.rglob("*.toml"))


def test_the_deployment_ships_the_compose_and_example_configs() -> None:
    names = {p.relative_to(DEPLOY).as_posix() for p in TOML_FILES}
    assert {"config/gateway.toml", "config/gateway.example.toml"} <= names


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
    assert [n.host for n in settings.redis.nodes] == ["redis-0", "redis-1", "redis-2"]
    assert all(n.password == "dev-only-change-me" for n in settings.redis.nodes)
    assert settings.quorum == 2
    sink = load_sink_settings(DEPLOY / "config" / "gateway.toml")
    assert str(sink.spark.checkpoint_dir).startswith("/var/lib/spark")  # the spark volume


def _configmap_toml() -> str:
    docs = load_yaml_documents(DEPLOY / "k8s" / "configmap.yaml")
    (configmap,) = [d for d in docs if d["kind"] == "ConfigMap"]
    text: str = configmap["data"]["gateway.toml"]
    return text


def _secret_values() -> dict[str, str]:
    docs = load_yaml_documents(DEPLOY / "k8s" / "secret.yaml")
    (secret,) = [d for d in docs if d["metadata"]["name"] == "dedup-gateway-secrets"]
    values: dict[str, str] = secret["stringData"]
    return values


def test_configmap_toml_loads_with_the_secrets_env_overrides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_gateway_env(monkeypatch)
    path = tmp_path / "gateway.toml"
    path.write_text(_configmap_toml())
    tomllib.loads(path.read_text())
    deployment = yaml.safe_load((DEPLOY / "k8s" / "deployment.yaml").read_text())
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    secrets = _secret_values()
    for var in container["env"]:
        monkeypatch.setenv(var["name"], secrets[var["valueFrom"]["secretKeyRef"]["key"]])
    settings: Settings = load_settings(path)
    assert settings.kafka.security_protocol == "SASL_SSL"
    assert settings.kafka.sasl_password is not None
    assert settings.kafka.sasl_password.get_secret_value() == "CHANGE-ME"
    assert [n.scheme for n in settings.redis.nodes] == ["rediss"] * 3
    assert all(n.username == "dedup-gateway" for n in settings.redis.nodes)
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

"""The compose file validates against the compose-spec schema and keeps the
operational properties the runbook (docs/operations.md) relies on. The
Kubernetes manifests: test_kubernetes.py."""

from __future__ import annotations

import importlib.resources
import json
import tomllib
from typing import Any

import jsonschema

from gateway.cli import build_parser
from gateway.config import load_settings
from gateway.ops.topics import needed_topics
from tests.deployment.conftest import DEPLOY, REPO, compose, load_yaml_documents

COMPOSE_CONFIG = DEPLOY / "config" / "gateway.toml"


def compose_schema() -> dict[str, Any]:
    """The compose-spec JSON schema vendored by check-jsonschema (works offline)."""
    vendor = importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
    schema: dict[str, Any] = json.loads((vendor / "compose-spec.json").read_text())
    return schema


def test_compose_file_validates_against_the_compose_spec_schema() -> None:
    validator = jsonschema.Draft202012Validator(compose_schema())
    errors = sorted(validator.iter_errors(compose()), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)


def test_compose_runs_three_persistent_noeviction_redis_members_each_with_its_own_volume() -> None:
    services = compose()["services"]
    members = sorted(name for name in services if name.startswith("redis-"))
    assert members == ["redis-0", "redis-1", "redis-2"]
    volumes = {v for m in members for v in services[m]["volumes"] if v.endswith(":/data")}
    assert len(volumes) == 3, "each member needs its own data volume"
    conf = (DEPLOY / "redis" / "redis.conf").read_text().splitlines()
    settings = dict(line.split(None, 1) for line in conf if line and not line.startswith("#"))
    assert settings["appendonly"] == "yes"
    assert settings["appendfsync"] in ("everysec", "always")
    assert settings["maxmemory-policy"] == "noeviction"


def test_compose_runs_two_gateways_in_one_group_after_the_topics_exist() -> None:
    services = compose()["services"]
    gateway = services["gateway"]
    assert gateway["deploy"]["replicas"] == 2
    assert gateway["depends_on"]["kafka-init"]["condition"] == "service_completed_successfully"
    assert "KAFKA_PROCESS_ROLES" in services["kafka"]["environment"]  # KRaft, no ZooKeeper
    assert services["kafka"]["image"].startswith("apache/kafka:")
    for service in ("gateway", "spark", "prometheus", "grafana"):
        assert service in services


def test_every_file_compose_mounts_from_the_repository_exists() -> None:
    for name, service in compose()["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).resolve().exists(), f"{name} mounts missing {source}"
        build = service.get("build")
        if build:
            assert (DEPLOY / build["context"] / build["dockerfile"]).is_file()


def test_grafana_provisioning_points_at_the_mounted_dashboards_and_datasource_uid() -> None:
    grafana = compose()["services"]["grafana"]
    mounts = dict(v.split(":")[:2] for v in grafana["volumes"] if v.startswith("."))
    (providers,) = load_yaml_documents(REPO / "grafana/provisioning/dashboards/dashboards.yaml")
    path = providers["providers"][0]["options"]["path"]
    assert mounts["../grafana/dashboards"] == path
    (sources,) = load_yaml_documents(REPO / "grafana/provisioning/datasources/prometheus.yaml")
    uid = sources["datasources"][0]["uid"]
    dashboard = json.loads((REPO / "grafana/dashboards/dedup-gateway.json").read_text())
    (ds_var,) = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert ds_var["current"]["value"] == uid
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]


def test_redis_members_run_as_the_images_non_root_redis_user() -> None:
    services = compose()["services"]
    for name in ("redis-0", "redis-1", "redis-2"):
        # uid:gid 999 is `redis` in the official image, which owns /data there.
        assert services[name]["user"] == "999:999", name
        assert services[name]["image"].startswith("redis:")


def test_loadgen_profile_produces_into_the_raw_topic_the_gateways_read() -> None:
    services = compose()["services"]
    loadgen = services["loadgen"]
    assert loadgen["profiles"] == ["loadgen"], "only with --profile loadgen"
    assert all("profiles" not in s for n, s in services.items() if n != "loadgen")
    # The gateway image (it has aiokafka), running the mounted self-contained script.
    assert loadgen["image"] == services["gateway"]["image"]
    assert loadgen["build"] == services["gateway"]["build"]
    mounts = dict(v.split(":")[:2] for v in loadgen["volumes"])
    script = loadgen["entrypoint"][-1]
    assert (DEPLOY / next(src for src, dst in mounts.items() if dst == script)).is_file()
    env = loadgen["environment"]
    config = tomllib.loads((DEPLOY / "config" / "gateway.toml").read_text())
    assert env["LOADGEN_BOOTSTRAP"] == config["kafka"]["bootstrap_servers"]
    assert [env["LOADGEN_TOPIC"]] == config["kafka"]["raw_topics"]
    assert env["LOADGEN_TOPIC"] in {t.name for t in needed_topics(load_settings(COMPOSE_CONFIG))}
    assert loadgen["depends_on"]["kafka-init"]["condition"] == "service_completed_successfully"
    assert config["dedup"]["id"] == "header:message-id"  # the header loadgen.py sets


def test_compose_creates_its_topics_with_the_gateways_own_config() -> None:
    """kafka-init runs `dedup-gateway topics --create` in the gateway image with the
    gateways' gateway.toml: the topics, partitions and configs `topics` prints, not a
    hand-kept list."""
    services = compose()["services"]
    init, gateway = services["kafka-init"], services["gateway"]
    assert (init["image"], init["build"]) == (gateway["image"], gateway["build"])
    assert "entrypoint" not in init, "the image's entry point: dedup-gateway"
    args = build_parser().parse_args(init["command"])
    assert (args.command, args.create, args.dry_run, args.check) == ("topics", True, False, False)
    assert init["volumes"] == gateway["volumes"], "the gateways' own config file"
    assert str(args.config) == gateway["command"][gateway["command"].index("--config") + 1]
    assert init["healthcheck"] == {"disable": True}
    assert init["depends_on"]["kafka"]["condition"] == "service_healthy"
    for name in ("gateway", "spark", "loadgen"):
        assert services[name]["depends_on"]["kafka-init"]["condition"] == (
            "service_completed_successfully"
        )
    assert "kafka-topics.sh" not in json.dumps(services)
    settings = load_settings(COMPOSE_CONFIG)
    specs = {spec.name: spec for spec in needed_topics(settings, args.partitions)}
    assert set(specs) == {
        *settings.kafka.raw_topics, settings.kafka.clean_topic, settings.kafka.failure_topic,
        settings.kafka.quarantine_topic, settings.kafka.dead_letter_topic,
    }  # fmt: skip


def test_compose_spark_job_uses_the_pass_through_handler() -> None:
    config = tomllib.loads((DEPLOY / "config" / "gateway.toml").read_text())
    assert config["spark"]["handler"] == "spark_sink.handlers:passthrough"

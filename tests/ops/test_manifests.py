"""The compose file and the Kubernetes manifests validate against their schemas
and keep the operational properties the runbook (docs/operations.md) relies on."""

from __future__ import annotations

import importlib.resources
import json
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.ops.conftest import DEPLOY, REPO, compose, load_yaml_documents

K8S = DEPLOY / "k8s"
KUBERNETES_VERSION = "1.33.0"
# Validated elsewhere: the operator's CRD, and kustomize's own file.
NOT_CORE = {"ServiceMonitor", "Kustomization"}


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
    script = "\n".join(services["kafka-init"]["command"])
    for topic in ("raw", "clean", "dedup-failures", "dedup-quarantine", "dedup-dead-letter"):
        assert f"create {topic} " in script
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


def k8s_documents() -> list[tuple[Path, dict[str, Any]]]:
    return [(path, doc) for path in sorted(K8S.glob("*.yaml")) for doc in load_yaml_documents(path)]


@pytest.mark.parametrize(
    "path,doc",
    [pytest.param(p, d, id=f"{d['kind']}/{d['metadata']['name']}") for p, d in k8s_documents()
     if d["kind"] not in NOT_CORE],
)  # fmt: skip
def test_kubernetes_manifest_validates_strictly(path: Path, doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def _deployment() -> dict[str, Any]:
    (doc,) = [d for _, d in k8s_documents() if d["kind"] == "Deployment"]
    return doc


def test_deployment_probes_drain_time_and_security_context() -> None:
    pod = _deployment()["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert pod["terminationGracePeriodSeconds"] >= 30
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= container["resources"][kind].keys()
    env = {e["name"]: e for e in container["env"]}
    for name in ("GATEWAY_REDIS__NODES", "GATEWAY_KAFKA__SASL_PASSWORD"):
        assert "secretKeyRef" in env[name]["valueFrom"], f"{name} must come from the Secret"


def test_pdb_service_and_kustomization_select_the_deployments_pods() -> None:
    docs = {d["kind"]: d for _, d in k8s_documents() if d["kind"] != "Secret"}
    labels = docs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    for kind, selector in (
        ("PodDisruptionBudget", docs["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"]),
        ("Service", docs["Service"]["spec"]["selector"]),
    ):
        assert selector.items() <= labels.items(), kind
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    for resource in kustomization["resources"]:
        assert (K8S / resource).is_file()
    assert "servicemonitor.yaml" not in kustomization["resources"]  # a CRD, applied apart

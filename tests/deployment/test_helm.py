"""deploy/helm/dedup-gateway as `helm install` sees it: `helm lint`, `helm template` with
the default values and with every option on, every object validated as the kustomize
base's are (test_kubernetes.validate: core kinds strictly against the Kubernetes
schemas, the operators' kinds against tests/deployment/crd_schemas.py), and the same content
as the kustomize base: the pod, the config, the Secrets, the rules, the scaling.

helm is built from its Go module by scripts/setup-helm.sh (tests/deployment/conftest.py's
`tool` finds it)."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import yaml

from devtools.harness import redis_urls
from gateway.config import env_name, load_settings
from tests.deployment.conftest import ALERTS, DASHBOARD, DEPLOY, REPO, load_yaml_documents, tool
from tests.deployment.test_kubernetes import (
    CONFIG,
    K8S,
    KEDA_SASL,
    by_kind,
    kustomize,
    one,
    validate,
    with_runbook_base,
)
from tests.integration.test_first_hour import bounded, write_config

CHART = DEPLOY / "helm" / "dedup-gateway"
MY_RUNBOOKS = "https://git.example.org/acme/dedup-gateway/blob/v0.1.0"
# Every option on: what a full install on a cluster with the operators would render.
EVERYTHING: dict[str, Any] = {
    "workload": "StatefulSet",
    "staticMembership": {"enabled": True},
    "secrets": {
        "create": True,
        "redisNodes": [
            "rediss://gw:pw@redis-0:6379/0",
            "rediss://gw:pw@redis-1:6379/0",
            "rediss://gw:pw@redis-2:6379/0",
        ],
        "kafkaSaslUsername": "dedup-gateway",
        "kafkaSaslPassword": "pw",
    },
    "tls": {"create": True, "caCrt": "-----BEGIN CERTIFICATE-----\nX\n-----END CERTIFICATE-----\n"},
    "networkPolicy": {"enabled": True},
    "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
    "prometheusRule": {"enabled": True},
    "alerts": {"runbookBaseUrl": MY_RUNBOOKS},
    "keda": {"enabled": True, "sasl": {"enabled": True}},
    "spark": {"enabled": True},
}


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [tool("helm"), *args], capture_output=True, text=True, timeout=120
    )  # fmt: skip


def is_test_hook(doc: dict[str, Any]) -> bool:
    return bool(doc["metadata"].get("annotations", {}).get("helm.sh/hook") == "test")


def render(
    values: dict[str, Any] | None = None,
    release: str = "dedup-gateway",
    tmp: Path | None = None,
    hooks: bool = False,
) -> list[dict[str, Any]]:
    """`helm template RELEASE CHART -f values.yaml`: what `helm install` would send (and,
    with `hooks`, the pods `helm test` creates)."""
    args = ["template", release, str(CHART), "--namespace", "dedup"]
    if values is not None:
        assert tmp is not None
        path = tmp / f"values-{len(list(tmp.iterdir()))}.yaml"
        path.write_text(yaml.safe_dump(values))
        args += ["-f", str(path)]
    result = helm(*args)
    assert result.returncode == 0, result.stderr
    docs = [doc for doc in yaml.safe_load_all(result.stdout) if doc is not None]
    return [doc for doc in docs if hooks or not is_test_hook(doc)]


def refused(values: dict[str, Any], tmp: Path) -> str:
    path = tmp / "bad-values.yaml"
    path.write_text(yaml.safe_dump(values))
    result = helm("template", "x", str(CHART), "-f", str(path))
    assert result.returncode != 0, f"{values} was accepted"
    return result.stderr


@pytest.fixture(scope="module")
def default() -> list[dict[str, Any]]:
    return render()


@pytest.fixture(scope="module")
def everything(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return render(EVERYTHING, tmp=tmp_path_factory.mktemp("values"))


@pytest.fixture(scope="module")
def kustomized() -> list[dict[str, Any]]:
    return kustomize(K8S)


def workload(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    return found


def pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = workload(docs)["spec"]["template"]["spec"]
    return spec


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (found,) = pod(docs)["containers"]
    return found


# --- helm itself ------------------------------------------------------------------


def test_helm_lint_passes_with_the_default_values_and_with_every_option_on(
    tmp_path: Path,
) -> None:
    result = helm("lint", "--strict", str(CHART))
    assert result.returncode == 0, result.stdout + result.stderr
    values = tmp_path / "everything.yaml"
    values.write_text(yaml.safe_dump(EVERYTHING))
    result = helm("lint", "--strict", str(CHART), "-f", str(values))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_helm_the_setup_builds_says_its_version_and_renders_without_flags() -> None:
    """Built without helm's ldflags, helm assumes Kubernetes v1.20.0 and refuses the
    chart's kubeVersion unless --kube-version is passed; `helm version` says v0.0.0."""
    script = (REPO / "scripts" / "setup-helm.sh").read_text()
    pinned = re.search(r"HELM_VERSION:-(v[0-9.]+)", script)
    assert pinned
    result = helm("version", "--template", "{{.Version}}")
    assert result.stdout == pinned[1], "run `bash scripts/setup-helm.sh`: " + result.stdout
    result = helm("template", "x", str(CHART))
    assert result.returncode == 0, result.stderr
    assert "kubeVersion" in (CHART / "Chart.yaml").read_text()


def test_the_notes_name_files_that_exist_and_the_helm_test_command() -> None:
    notes = (CHART / "templates" / "NOTES.txt").read_text()
    mentioned = re.findall(r"\bdocs/[\w.-]+\.md\b", notes)
    assert "docs/runbooks.md" in mentioned
    for path in mentioned:
        assert (REPO / path).is_file(), f"NOTES.txt points at {path}, which does not exist"
    assert "helm test {{ .Release.Name }}" in notes


def test_the_chart_is_the_packages_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert chart["version"] == chart["appVersion"] == version == metadata.version("dedup-gateway")


def test_the_files_the_chart_renders_are_copies_of_their_one_source() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "sync-chart-files.py"), "--check"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def test_values_schema_refuses_a_typo_and_a_value_out_of_its_set(tmp_path: Path) -> None:
    assert "enabeld" in refused({"serviceMonitor": {"enabeld": True}}, tmp_path)
    assert "workload" in refused({"workload": "Deploymnet"}, tmp_path)
    assert "mechanism" in refused({"keda": {"sasl": {"mechanism": "SCRAM-SHA-512"}}}, tmp_path)
    assert "runbookBaseUrl" in refused({"alerts": {"runbookBaseUrl": "example.com"}}, tmp_path)


def test_a_config_that_is_not_toml_is_refused_naming_it(tmp_path: Path) -> None:
    assert "config.toml is not valid TOML" in refused({"config": {"toml": "[kafka\n"}}, tmp_path)


# --- every object -----------------------------------------------------------------


def test_the_default_values_render_what_the_kustomize_base_renders(
    default: list[dict[str, Any]], kustomized: list[dict[str, Any]]
) -> None:
    assert sorted(d["kind"] for d in default) == sorted(d["kind"] for d in kustomized)
    assert "Secret" not in {d["kind"] for d in default}, "Secrets are opt-in"
    validate(default)


def test_every_object_validates_with_every_option_on(everything: list[dict[str, Any]]) -> None:
    assert sorted(d["kind"] for d in everything) == sorted([
        "ConfigMap", "ConfigMap", "StatefulSet", "Service", "PodDisruptionBudget", "Secret",
        "Secret", "NetworkPolicy", "ServiceMonitor", "PodMonitor", "PrometheusRule",
        "ScaledObject", "TriggerAuthentication", "SparkApplication", "PersistentVolumeClaim",
        "ServiceAccount", "Role", "RoleBinding",
    ])  # fmt: skip
    validate(everything)


def test_every_object_and_pod_carries_the_release_version_never_in_a_selector(
    everything: list[dict[str, Any]],
) -> None:
    version = metadata.version("dedup-gateway")
    for doc in everything:
        assert doc["metadata"]["labels"]["app.kubernetes.io/version"] == version
    template = workload(everything)["spec"]["template"]
    assert template["metadata"]["labels"]["app.kubernetes.io/version"] == version
    assert (
        "app.kubernetes.io/version" not in workload(everything)["spec"]["selector"]["matchLabels"]
    )


# --- the pod, as the kustomize base's ------------------------------------------------


def _comparable(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The pod spec without what names it (image, ConfigMap name, label selectors)."""
    spec = copy.deepcopy(pod(docs))
    for c in spec["containers"]:
        c.pop("image")
    for volume in spec["volumes"]:
        volume.get("configMap", {}).pop("name", None)
    for constraint in spec.get("topologySpreadConstraints", []):
        constraint.pop("labelSelector")
    return spec


def test_the_pod_is_the_kustomize_bases_pod(
    default: list[dict[str, Any]], kustomized: list[dict[str, Any]]
) -> None:
    """Probes, security contexts, resources, drain time, ports, env and mounts: the same."""
    assert _comparable(default) == _comparable(kustomized)
    ours, theirs = workload(default)["spec"], one(kustomized, "Deployment")["spec"]
    assert ours["strategy"] == theirs["strategy"] and ours["replicas"] == theirs["replicas"]
    pdb = one(default, "PodDisruptionBudget")["spec"]
    assert pdb["maxUnavailable"] == one(kustomized, "PodDisruptionBudget")["spec"]["maxUnavailable"]


def test_the_config_is_the_kubernetes_toml_and_its_checksum_rolls_the_pods(
    default: list[dict[str, Any]], tmp_path: Path
) -> None:
    (config,) = [d for d in by_kind(default, "ConfigMap") if "gateway.toml" in d["data"]]
    assert config["data"] == {"gateway.toml": CONFIG.read_text()}
    (volume,) = [v for v in pod(default)["volumes"] if v["name"] == "config"]
    assert volume["configMap"]["name"] == config["metadata"]["name"]
    changed = CONFIG.read_text().replace('ttl = "24h"', 'ttl = "12h"')
    assert changed != CONFIG.read_text()
    other = render({"config": {"toml": changed}}, tmp=tmp_path)
    before = workload(default)["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
    after = workload(other)["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
    assert before != after
    (config,) = [d for d in by_kind(other, "ConfigMap") if "gateway.toml" in d["data"]]
    assert config["data"]["gateway.toml"] == changed


def test_an_existing_configmap_is_used_as_it_is(tmp_path: Path) -> None:
    docs = render({"config": {"existingConfigMap": "my-gateway-config"}}, tmp=tmp_path)
    assert not [d for d in by_kind(docs, "ConfigMap") if "gateway.toml" in d.get("data", {})]
    (volume,) = [v for v in pod(docs)["volumes"] if v["name"] == "config"]
    assert volume["configMap"]["name"] == "my-gateway-config"


def test_the_dashboard_configmap_is_the_dashboard_file(default: list[dict[str, Any]]) -> None:
    (dashboard,) = [d for d in by_kind(default, "ConfigMap") if DASHBOARD.name in d["data"]]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["data"] == {DASHBOARD.name: DASHBOARD.read_text()}


# --- Secrets ------------------------------------------------------------------------


def _secret_refs(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [v["valueFrom"]["secretKeyRef"] for v in container(docs)["env"]
            if "secretKeyRef" in v.get("valueFrom", {})]  # fmt: skip


def test_the_secrets_are_optional_and_an_existing_secret_is_named(
    default: list[dict[str, Any]], tmp_path: Path
) -> None:
    refs = _secret_refs(default)
    assert {r["key"] for r in refs} == {"redis-nodes", "kafka-sasl-username", "kafka-sasl-password"}
    assert all(r["optional"] is True and r["name"] == "dedup-gateway-secrets" for r in refs)
    (tls,) = [v for v in pod(default)["volumes"] if "secret" in v]
    assert tls["secret"] == {"secretName": "dedup-gateway-tls", "optional": True}
    mine = render(
        {"secrets": {"existingSecret": "vault-gw"}, "tls": {"existingSecret": "vault-ca"}},
        tmp=tmp_path,
    )
    assert {r["name"] for r in _secret_refs(mine)} == {"vault-gw"}
    (tls,) = [v for v in pod(mine)["volumes"] if "secret" in v]
    assert tls["secret"]["secretName"] == "vault-ca"
    assert not by_kind(mine, "Secret")


def test_created_secrets_hold_every_key_the_pods_and_keda_read(
    everything: list[dict[str, Any]],
) -> None:
    secrets = {d["metadata"]["name"]: d["stringData"] for d in by_kind(everything, "Secret")}
    for ref in _secret_refs(everything):
        assert ref["key"] in secrets[ref["name"]], ref
    nodes = json.loads(secrets[_secret_refs(everything)[0]["name"]]["redis-nodes"])
    assert nodes == EVERYTHING["secrets"]["redisNodes"]
    for ref in one(everything, "TriggerAuthentication")["spec"]["secretTargetRef"]:
        assert ref["key"] in secrets[ref["name"]], ref
    annotations = workload(everything)["spec"]["template"]["metadata"]["annotations"]
    assert "checksum/secrets" in annotations, "a changed Secret rolls the pods"


# --- static membership --------------------------------------------------------------


def test_static_membership_sets_the_group_instance_id_from_the_pod_name(
    default: list[dict[str, Any]], everything: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    variable = env_name("kafka", "group_instance_id")
    assert variable == "GATEWAY_KAFKA__GROUP_INSTANCE_ID"
    assert variable not in {e["name"] for e in container(default)["env"]}, "off by default"
    (env,) = [e for e in container(everything)["env"] if e["name"] == variable]
    assert env["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    # The gateway reads that variable as the setting (a pod named gateway-0).
    monkeypatch.setenv(variable, "dedup-gateway-0")
    assert load_settings(CONFIG).kafka.group_instance_id == "dedup-gateway-0"


def test_a_statefulset_keeps_pod_names_under_the_headless_service(
    everything: list[dict[str, Any]],
) -> None:
    statefulset = one(everything, "StatefulSet")
    service = one(everything, "Service")
    assert statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"
    assert statefulset["spec"]["podManagementPolicy"] == "Parallel"
    assert "replicas" not in statefulset["spec"], "KEDA owns the count"


# --- monitoring ---------------------------------------------------------------------


def test_the_prometheusrule_is_alerts_yml_with_one_runbook_base(
    everything: list[dict[str, Any]],
) -> None:
    (alerts,) = load_yaml_documents(ALERTS)
    rule = one(everything, "PrometheusRule")
    assert rule["spec"] == with_runbook_base(alerts, MY_RUNBOOKS)
    urls = [r["annotations"]["runbook_url"] for g in rule["spec"]["groups"] for r in g["rules"]]
    assert len(urls) >= 18 and all(u.startswith(MY_RUNBOOKS + "/docs/") for u in urls)


def test_the_alerts_find_the_gateways_whatever_the_release_is_called(tmp_path: Path) -> None:
    """The ServiceMonitor takes the job label from the Service's app.kubernetes.io/name,
    so up{job=~"dedup-gateway.*"} (DedupGatewayDown, DedupGatewayAbsent) matches for a
    release named anything."""
    docs = render({"serviceMonitor": {"enabled": True}}, release="prod", tmp=tmp_path)
    monitor, service = one(docs, "ServiceMonitor"), one(docs, "Service")
    assert not service["metadata"]["name"].startswith("dedup-gateway")
    job = service["metadata"]["labels"][monitor["spec"]["jobLabel"]]
    (rule,) = [r for g in load_yaml_documents(ALERTS)[0]["groups"] for r in g["rules"]
               if r["alert"] == "DedupGatewayDown"]  # fmt: skip
    pattern = re.search(r'job=~"([^"]+)"', rule["expr"])
    assert pattern and re.fullmatch(pattern[1], job), (job, rule["expr"])
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )


def test_the_podmonitor_scrapes_the_spark_drivers_metrics_port(
    everything: list[dict[str, Any]],
) -> None:
    app = one(everything, "SparkApplication")["spec"]
    monitor = one(everything, "PodMonitor")["spec"]
    assert monitor["selector"]["matchLabels"].items() <= app["driver"]["labels"].items()
    (port,) = app["driver"]["ports"]
    assert monitor["podMetricsEndpoints"][0]["port"] == port["name"]
    assert port["containerPort"] == tomllib.loads(CONFIG.read_text())["spark"]["metrics_port"]


# --- network policy, KEDA, Spark ----------------------------------------------------------


def test_the_network_policy_opens_the_configs_ports(everything: list[dict[str, Any]]) -> None:
    policy = one(everything, "NetworkPolicy")["spec"]
    settings = load_settings(CONFIG)
    kafka_ports = {int(s.rsplit(":", 1)[1]) for s in settings.kafka.bootstrap_servers.split(",")}
    redis_ports = {h["port"] for n in settings.redis.nodes for h in n.hosts()}
    out = {(p["port"], p["protocol"]) for rule in policy["egress"] for p in rule["ports"]}
    assert out == {(53, "UDP"), (53, "TCP")} | {(p, "TCP") for p in kafka_ports | redis_ports}
    assert policy["podSelector"]["matchLabels"].items() <= (
        workload(everything)["spec"]["template"]["metadata"]["labels"].items()
    )


def test_the_network_policy_reads_a_cluster_members_ports(tmp_path: Path) -> None:
    toml = CONFIG.read_text() + "\n"
    toml = re.sub(
        r"^nodes = .*$",
        'nodes = ["redis+cluster://gw:1234@c1-a:7000,c1-b:7001", "redis://r1/0", '
        '"rediss://gw:99@r2:6380/0"]',
        toml, flags=re.M,
    )  # fmt: skip
    docs = render({"config": {"toml": toml}, "networkPolicy": {"enabled": True}}, tmp=tmp_path)
    (*_, redis) = one(docs, "NetworkPolicy")["spec"]["egress"]
    assert sorted(p["port"] for p in redis["ports"]) == [6379, 6380, 7000, 7001]


def test_keda_takes_brokers_group_and_topic_from_the_config_or_the_values(
    everything: list[dict[str, Any]], tmp_path: Path
) -> None:
    settings = load_settings(CONFIG)
    scaled = one(everything, "ScaledObject")["spec"]
    target = {"kind": "StatefulSet", "name": workload(everything)["metadata"]["name"]}
    assert scaled["scaleTargetRef"] == target
    (trigger,) = scaled["triggers"]
    meta = trigger["metadata"]
    assert meta["bootstrapServers"] == settings.kafka.bootstrap_servers
    assert meta["consumerGroup"] == settings.kafka.group_id
    assert meta["topic"] == settings.kafka.raw_topics[0]
    assert meta["sasl"] == KEDA_SASL[settings.kafka.sasl_mechanism or ""]
    assert meta["tls"] == "enable"  # SASL_SSL
    auth = one(everything, "TriggerAuthentication")
    assert trigger["authenticationRef"]["name"] == auth["metadata"]["name"]
    assert {r["parameter"] for r in auth["spec"]["secretTargetRef"]} == {
        "username",
        "password",
        "ca",
    }
    mine = render(
        {"keda": {"enabled": True, "bootstrapServers": "b-1:9092", "consumerGroup": "g",
                  "topic": "t"}},
        tmp=tmp_path,
    )  # fmt: skip
    (trigger,) = one(mine, "ScaledObject")["spec"]["triggers"]
    assert [trigger["metadata"][k] for k in ("bootstrapServers", "consumerGroup", "topic")] == [
        "b-1:9092", "g", "t",
    ]  # fmt: skip
    assert "sasl" not in trigger["metadata"] and "authenticationRef" not in trigger
    assert not by_kind(mine, "TriggerAuthentication")
    assert one(mine, "ScaledObject")["spec"]["scaleTargetRef"]["kind"] == "Deployment"
    validate(mine)


def test_keda_follows_a_changed_config(tmp_path: Path) -> None:
    toml = (
        CONFIG.read_text()
        .replace('group_id = "dedup-gateway"', 'group_id = "orders-dedup"')
        .replace('raw_topics = ["raw"]', 'raw_topics = ["orders", "payments"]')
        .replace('"SCRAM-SHA-512"', '"SCRAM-SHA-256"')
        .replace('"SASL_SSL"', '"SASL_PLAINTEXT"')
    )
    docs = render(
        {"config": {"toml": toml}, "keda": {"enabled": True, "sasl": {"enabled": True}}},
        tmp=tmp_path,
    )
    (trigger,) = one(docs, "ScaledObject")["spec"]["triggers"]
    meta = trigger["metadata"]
    assert (meta["consumerGroup"], meta["topic"]) == ("orders-dedup", "orders")
    assert (meta["sasl"], meta["tls"]) == ("scram_sha256", "disable")
    refs = one(docs, "TriggerAuthentication")["spec"]["secretTargetRef"]
    assert "ca" not in {r["parameter"] for r in refs}, "no TLS, no CA"


def test_the_spark_job_runs_the_spark_image_with_the_gateways_config(
    everything: list[dict[str, Any]],
) -> None:
    app = one(everything, "SparkApplication")["spec"]
    (config,) = [d for d in by_kind(everything, "ConfigMap") if "gateway.toml" in d["data"]]
    (volume,) = [v for v in app["volumes"] if v["name"] == "config"]
    assert volume["configMap"]["name"] == config["metadata"]["name"]
    (mount,) = [m for m in app["driver"]["volumeMounts"] if m["name"] == "config"]
    assert app["arguments"] == ["--config", mount["mountPath"]]
    assert f":{app['sparkVersion']}-" in (DEPLOY / "spark.Dockerfile").read_text()
    spark = tomllib.loads(config["data"]["gateway.toml"])["spark"]
    (data,) = [m for m in app["driver"]["volumeMounts"] if m["name"] == "data"]
    for path in (spark["checkpoint_dir"], spark["output_path"]):
        assert path.startswith(data["mountPath"] + "/")
    pvc = one(everything, "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    (claim,) = [v for v in app["volumes"] if v["name"] == "data"]
    assert claim["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert app["driver"]["serviceAccount"] == one(everything, "ServiceAccount")["metadata"]["name"]
    assert app["image"].endswith(":" + metadata.version("dedup-gateway"))


def test_the_documented_install_command_renders(tmp_path: Path) -> None:
    """docs/operations.md's `helm install`, as `helm template` with the same flags."""
    text = (REPO / "docs" / "operations.md").read_text()
    section = text.split("### Helm", 1)[1]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block, "the Helm section shows no install command"
    words = block[1].replace("\\\n", " ").split()
    assert words[:4] == ["helm", "install", "dedup-gateway", "deploy/helm/dedup-gateway"]
    config = tmp_path / "gateway.toml"
    config.write_text(CONFIG.read_text())
    args = ["template", *words[2:]]
    args[2] = str(REPO / args[2])
    args = [a.replace("config.toml=gateway.toml", f"config.toml={config}") for a in args]
    result = helm(*[a for a in args if a != "--create-namespace"])
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    assert container(docs)["image"] == "registry.example.com/dedup-gateway:" + (
        metadata.version("dedup-gateway")
    )


# --- `helm test`: check-config --connect -----------------------------------------------


def test_hook(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (found,) = [d for d in docs if is_test_hook(d)]
    assert found["kind"] == "Pod"
    return found


test_hook.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test


def test_the_helm_test_hook_runs_check_config_with_the_gateways_settings(tmp_path: Path) -> None:
    """The hook pod reads the settings as the gateway pods do: same env (the Secret's
    overrides, static membership, extraEnv), same mounts and volumes, same image."""
    values = {**EVERYTHING, "extraEnv": [{"name": "GATEWAY_LOGGING__LEVEL", "value": "DEBUG"}]}
    docs = render(values, tmp=tmp_path, hooks=True)
    hook = test_hook(docs)
    assert hook["metadata"]["annotations"]["helm.sh/hook-delete-policy"] == (
        "before-hook-creation,hook-succeeded"
    )
    spec = hook["spec"]
    assert spec["restartPolicy"] == "Never"
    (check,) = spec["containers"]
    gateway = container(docs)
    assert check["args"][:2] == ["check-config", "--connect"]
    config = check["args"][check["args"].index("--config") + 1]
    assert gateway["args"][gateway["args"].index("--config") + 1] == config
    for key in ("image", "env", "volumeMounts", "securityContext"):
        assert check[key] == gateway[key], key
    assert spec["volumes"] == pod(docs)["volumes"]
    assert spec["securityContext"] == pod(docs)["securityContext"]
    validate([hook])
    assert not any(is_test_hook(d) for d in render(values, tmp=tmp_path)), "install runs no test"


def test_the_hooks_command_passes_on_a_ready_install_and_fails_on_a_missing_topic(
    broker, names, redis_servers, tmp_path: Path
) -> None:
    """The hook's own command line, run against real servers with the config the chart
    mounts: exit 0 when the members answer and the topics exist, non-zero (naming the
    topic) when one is missing, as `helm test` would report."""
    servers = redis_servers(1)
    bounded(servers)  # no maxmemory warning: a warning fails `helm test` too (exit 1)
    prefix = names("hook")
    # Two lanes, their clean topics, failures, quarantine, dead letters (no delay tiers).
    config_toml = write_config(
        tmp_path / "given.toml", broker, prefix, redis_urls(servers)
    ).read_text()
    docs = render({"config": {"toml": config_toml}}, tmp=tmp_path, hooks=True)
    (configmap,) = [d for d in by_kind(docs, "ConfigMap") if "gateway.toml" in d["data"]]
    mounted = tmp_path / "gateway.toml"
    mounted.write_text(configmap["data"]["gateway.toml"])
    (check,) = test_hook(docs)["spec"]["containers"]
    args = [str(mounted) if a == "/etc/dedup-gateway/gateway.toml" else a for a in check["args"]]

    def hook_run() -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "gateway", *args], capture_output=True,
                              text=True, timeout=120, cwd=tmp_path)  # fmt: skip

    missing = hook_run()
    assert missing.returncode != 0, missing.stdout
    assert f"{prefix}-clean" in missing.stdout
    created = subprocess.run(
        [sys.executable, "-m", "gateway", "topics", "--config", str(mounted), "--create",
         "--partitions", "1"], capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert created.returncode == 0, created.stdout + created.stderr
    ready = hook_run()
    assert ready.returncode == 0, ready.stdout + ready.stderr

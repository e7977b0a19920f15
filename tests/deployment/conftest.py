"""Shared helpers for the deployment checks: where the files are, where the
tools are, and which series names the gateway exposes.

The tools are part of the dev setup (hadolint, kubernetes-validate and
check-jsonschema from the `dev` extra; promtool and prometheus from
scripts/setup-ops.sh, helm built by scripts/setup-helm.sh into CACHE_BIN). A
missing tool fails the test with that hint: these checks must not skip silently.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.metrics_core import Metric

from gateway.metrics import Metrics
from spark_sink.metrics import JobMetrics, SinkCountsCollector
from spark_sink.sink import SinkCounts

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
DASHBOARD = REPO / "grafana" / "dashboards" / "dedup-gateway.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
PROMETHEUS_RULE = DEPLOY / "k8s" / "components" / "prometheus-operator" / "prometheusrule.yaml"

METRIC_NAME = re.compile(r"\bdedup_gateway_\w+")
# The Spark job's metrics (spark_sink/metrics.py), checked apart: the live test
# scrapes a gateway only.
SPARK_METRIC_NAME = re.compile(r"\bdedup_spark_\w+")


# Where scripts/setup-helm.sh builds helm (outside the repository).
CACHE_BIN = Path.home() / ".cache" / "dedup-gateway" / "bin"
# The placeholder every alert's runbook_url starts with (deploy/prometheus/alerts.yml):
# <base>/docs/<page>.md#<alert>; the kustomize component and the chart replace it.
RUNBOOK_BASE = "https://dedup-gateway.example.com"


def tool(name: str) -> str:
    """Path of a command-line tool: the venv's bin first, then the tools
    scripts/setup-ops.sh builds, then PATH."""
    for folder in (Path(sys.executable).parent, CACHE_BIN):
        if (folder / name).is_file():
            return str(folder / name)
    found = shutil.which(name)
    if found is None:
        pytest.fail(
            f"{name} is not installed: run `bash scripts/setup-ops.sh` and "
            "`pip install -e '.[dev]'` (the tests in tests/deployment need it)"
        )
    return found


def load_yaml_documents(path: Path) -> list[Any]:
    with path.open() as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def compose() -> dict[str, Any]:
    """deploy/compose.yaml, parsed (YAML anchors and merge keys resolved)."""
    (doc,) = load_yaml_documents(DEPLOY / "compose.yaml")
    assert isinstance(doc, dict)
    return doc


def exposed_series_names(families: Iterator[Metric] | None = None) -> set[str]:
    """Every series name the gateway's registry (or `families`) can expose, by metric
    type (prometheus_client adds `_total` to counters; histograms expose
    `_bucket`/`_sum`/`_count`; both also `_created`)."""
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "gauge": ("",),
    }
    names: set[str] = set()
    for family in _families() if families is None else families:
        names.update(family.name + suffix for suffix in suffixes[family.type])
    return names


def metric_families(families: Iterator[Metric] | None = None) -> dict[str, str]:
    """Family name -> type, as declared in gateway.metrics (or `families`)."""
    return {f.name: f.type for f in (_families() if families is None else families)}


def spark_families() -> Iterator[Metric]:
    """The Spark job's metric families (spark_sink.metrics), from a fresh registry."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    JobMetrics(registry)
    registry.register(SinkCountsCollector(lambda: [SinkCounts()]))
    yield from registry.collect()


def _families() -> Iterator[Metric]:
    # The gateway's own; process_* and python_info come from prometheus_client's collectors.
    yield from (f for f in Metrics().registry.collect() if f.name.startswith("dedup_gateway_"))


def dashboard_exprs() -> list[str]:
    """Every PromQL expression of the dashboard: panel targets and variable queries."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict) and "query" in query:
            exprs.append(query["query"])
    return exprs


def alert_rules() -> list[dict[str, Any]]:
    (doc,) = load_yaml_documents(ALERTS)
    return [rule for group in doc["groups"] for rule in group["rules"]]


def alert_exprs() -> list[str]:
    return [rule["expr"] for rule in alert_rules()]


def queried_series_names() -> set[str]:
    """The `dedup_gateway_*` series names the dashboard and the alert rules query."""
    return {m for expr in [*dashboard_exprs(), *alert_exprs()] for m in METRIC_NAME.findall(expr)}


def as_instant_query(expr: str) -> str:
    """A dashboard expression with Grafana's variables replaced, for Prometheus' API."""
    label_values = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", expr.strip())
    if label_values:  # a Grafana variable query, not PromQL: the series it reads
        return f"count by ({label_values[2]}) ({label_values[1]})"
    return expr.replace("$__rate_interval", "1m").replace("$job", ".+")

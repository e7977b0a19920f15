"""The alert rules and the dashboard query only metrics the gateway exposes,
and Prometheus' own checker accepts the rules and the scrape config."""

from __future__ import annotations

import subprocess

from tests.ops.conftest import (
    ALERTS,
    METRIC_NAME,
    PROMETHEUS_CONFIG,
    REPO,
    alert_exprs,
    alert_rules,
    dashboard_exprs,
    exposed_series_names,
    metric_families,
    queried_series_names,
    tool,
)


def test_promtool_accepts_the_alert_rules() -> None:
    result = subprocess.run(
        [tool("promtool"), "check", "rules", str(ALERTS)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_accepts_the_prometheus_config_and_its_rule_files() -> None:
    result = subprocess.run(
        [tool("promtool"), "check", "config", str(PROMETHEUS_CONFIG)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_metric_the_alert_rules_query_is_exposed_by_the_gateway() -> None:
    exposed = exposed_series_names()
    for expr in alert_exprs():
        unknown = set(METRIC_NAME.findall(expr)) - exposed
        assert not unknown, f"{sorted(unknown)} in alert {expr!r} is not in gateway.metrics"


def test_every_metric_the_dashboard_queries_is_exposed_by_the_gateway() -> None:
    exposed = exposed_series_names()
    for expr in dashboard_exprs():
        unknown = set(METRIC_NAME.findall(expr)) - exposed
        assert not unknown, f"{sorted(unknown)} in panel query {expr!r} is not in gateway.metrics"


def test_the_dashboard_shows_every_metric_the_gateway_declares() -> None:
    queried = {m for expr in dashboard_exprs() for m in METRIC_NAME.findall(expr)}
    for family, kind in metric_families().items():
        variants = {"counter": [f"{family}_total"], "gauge": [family]}.get(
            kind, [f"{family}_bucket", f"{family}_sum", f"{family}_count"]
        )
        assert queried & set(variants), f"no panel shows {family} ({kind})"


def test_the_alerts_cover_quorum_lag_redis_dead_letters_blocking_and_readiness() -> None:
    rules = {rule["alert"]: rule for rule in alert_rules()}
    names_of = {alert: set(METRIC_NAME.findall(rule["expr"])) for alert, rule in rules.items()}
    needed = {
        "dedup_gateway_quorum_healthy", "dedup_gateway_consumer_lag_records",
        "dedup_gateway_redis_up", "dedup_gateway_redis_errors_total",
        "dedup_gateway_records_dead_lettered_total", "dedup_gateway_partitions_blocked",
        "dedup_gateway_ready",
    }  # fmt: skip
    assert needed <= set().union(*names_of.values())
    quorum = rules["DedupGatewayQuorumLost"]
    assert quorum["for"] == "1m" and "== 0" in quorum["expr"]
    assert "deriv(" in rules["DedupGatewayConsumerLagGrowing"]["expr"]
    for rule in rules.values():
        assert rule["labels"]["severity"] in ("critical", "warning", "info")
        assert rule["annotations"]["runbook"].startswith("docs/operations.md#")


def test_every_alert_has_a_runbook_section_in_the_operations_doc() -> None:
    doc = (REPO / "docs" / "operations.md").read_text().lower()
    for rule in alert_rules():
        anchor = rule["annotations"]["runbook"].split("#", 1)[1]
        assert f"### {anchor}" in doc, f"docs/operations.md has no '### {rule['alert']}' section"


def test_queried_names_are_found_at_all() -> None:
    # Guards the regex: an empty set would make the checks above vacuous.
    assert len(queried_series_names()) >= 20

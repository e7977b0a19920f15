"""The alert rules and the dashboard query only metrics the gateway exposes,
and Prometheus' own checker accepts the rules and the scrape config."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from tests.deployment.conftest import (
    ALERTS,
    METRIC_NAME,
    PROMETHEUS_CONFIG,
    PROMETHEUS_RULE,
    REPO,
    RUNBOOK_BASE,
    SPARK_METRIC_NAME,
    alert_exprs,
    alert_rules,
    dashboard_exprs,
    exposed_series_names,
    load_yaml_documents,
    metric_families,
    queried_series_names,
    spark_families,
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
        doc = "spark-cluster" if rule["alert"].startswith("DedupSpark") else "runbooks"
        assert rule["annotations"]["runbook_url"].startswith(f"{RUNBOOK_BASE}/docs/{doc}.md#")
        assert "runbook" not in rule["annotations"]  # the URL only, under the usual name


def test_the_runbook_base_is_documented_where_it_is_set() -> None:
    assert f"RUNBOOK_BASE = {RUNBOOK_BASE} here" in ALERTS.read_text()


def test_every_runbook_url_is_the_one_base_then_a_path_under_docs() -> None:
    """The base is replaced as a whole (the component splits each URL at "/docs/", the
    chart strips the base): one base, nothing else before the path."""
    for rule in alert_rules():
        url = rule["annotations"]["runbook_url"]
        base, rest = url.split("/docs/")
        assert base == RUNBOOK_BASE and "/docs/" not in rest, url


def test_every_alert_has_a_runbook_section_in_the_doc_it_names() -> None:
    for rule in alert_rules():
        url, anchor = rule["annotations"]["runbook_url"].split("#", 1)
        path = url.removeprefix(RUNBOOK_BASE + "/")
        doc = (REPO / path).read_text().lower()
        assert f"### {anchor}" in doc, f"{path} has no '### {rule['alert']}' section"


def test_every_spark_metric_queried_is_exposed_and_every_one_is_on_the_dashboard() -> None:
    exposed = exposed_series_names(spark_families())
    queried = {
        m for e in [*dashboard_exprs(), *alert_exprs()] for m in SPARK_METRIC_NAME.findall(e)
    }
    assert queried, "the dashboard and alerts query no dedup_spark_* series"
    assert queried <= exposed, f"{sorted(queried - exposed)} are not in spark_sink.metrics"
    shown = {m for expr in dashboard_exprs() for m in SPARK_METRIC_NAME.findall(expr)}
    for family, kind in metric_families(spark_families()).items():
        variants = {"counter": [f"{family}_total"], "gauge": [family]}.get(
            kind, [f"{family}_bucket", f"{family}_sum", f"{family}_count"]
        )
        assert shown & set(variants), f"no panel shows {family} ({kind})"


def test_the_alerts_cover_the_spark_job_stalled_and_lagging() -> None:
    rules = {rule["alert"]: rule for rule in alert_rules()}
    stalled, lagging = rules["DedupSparkJobStalled"], rules["DedupSparkJobLagging"]
    assert "dedup_spark_last_progress_timestamp_seconds" in stalled["expr"]
    assert "dedup_spark_query_active" in stalled["expr"]
    assert "dedup_spark_source_lag_records" in lagging["expr"]


def test_queried_names_are_found_at_all() -> None:
    # Guards the regex: an empty set would make the checks above vacuous.
    assert len(queried_series_names()) >= 20


UNIT_TESTS = Path(__file__).with_name("alerts_test.yml")


def test_promtool_unit_tests_of_every_alert_pass(tmp_path: Path) -> None:
    """tests/deployment/alerts_test.yml against alerts.yml with annotations cut to `summary`."""
    (rules,) = load_yaml_documents(ALERTS)
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule["annotations"] = {"summary": rule["annotations"]["summary"]}
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(rules, sort_keys=False))
    shutil.copy(UNIT_TESTS, tmp_path / UNIT_TESTS.name)
    result = subprocess.run(
        [tool("promtool"), "test", "rules", UNIT_TESTS.name],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


def test_promtool_unit_tests_cover_every_alert_firing_and_not_firing() -> None:
    (unit,) = load_yaml_documents(UNIT_TESTS)
    assert unit["rule_files"] == ["alerts.yml"]
    firing: set[str] = set()
    quiet: set[str] = set()
    for case in unit["tests"]:
        for check in case["alert_rule_test"]:
            (firing if check["exp_alerts"] else quiet).add(check["alertname"])
    alerts = {rule["alert"] for rule in alert_rules()}
    assert alerts - firing == set(), "alerts without a case where they fire"
    assert alerts - quiet == set(), "alerts without a case where they stay quiet"
    assert firing | quiet <= alerts, "cases for alerts that do not exist"


def test_redis_down_is_one_alert_per_member_and_a_vanished_gateway_is_noticed() -> None:
    rules = {rule["alert"]: rule for rule in alert_rules()}
    assert rules["DedupGatewayRedisDown"]["expr"].startswith("max by (redis) (")
    absent = rules["DedupGatewayAbsent"]["expr"]
    assert "absent(up{" in absent and "absent(dedup_gateway_ready)" in absent


def test_the_prometheusrule_for_the_operator_carries_exactly_the_alert_rules() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gen-prometheusrule.py"), "--check"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    (rule,) = load_yaml_documents(PROMETHEUS_RULE)
    (alerts,) = load_yaml_documents(ALERTS)
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["kind"] == "PrometheusRule"
    assert rule["spec"] == alerts

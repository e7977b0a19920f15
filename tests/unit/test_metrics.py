"""Metrics tell the truth from the start: build info, process metrics, and every labelled
counter's known series present at zero before the first event."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import gateway
from gateway import errors
from gateway.config import load_settings
from gateway.metrics import Metrics

PACKAGE = Path(gateway.__file__).parent

# Where the code names a reason or kind: (callee name, argument index) -> the metric's
# label and the list in gateway/errors.py it must come from.
REASON_ARGS = {
    ("BadRecord", 0): ("dedup_gateway_records_quarantined", errors.BAD_RECORD_REASONS),
    ("InvalidCommand", 0): ("dedup_gateway_invalid_commands", errors.INVALID_COMMAND_REASONS),
    ("_invalid", 1): ("dedup_gateway_invalid_commands", errors.INVALID_COMMAND_REASONS),
    ("Absent", 0): ("dedup_gateway_invalid_commands", errors.INVALID_COMMAND_REASONS),
    ("failed", 0): ("dedup_gateway_redis_errors", errors.REDIS_ERROR_KINDS),
    ("releases.labels", 0): ("dedup_gateway_releases", errors.RELEASE_RESULTS),
}


def _callee(call: ast.Call) -> str:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        owner = func.value.attr if isinstance(func.value, ast.Attribute) else ""
        return f"{owner}.{func.attr}" if func.attr == "labels" else func.attr
    return ""


def codes_in_the_code() -> dict[str, set[str]]:
    """Every reason or kind literal the gateway passes where a metric label comes from."""
    found: dict[str, set[str]] = defaultdict(set)
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "metrics.py":  # preinit loops over the lists themselves
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            for (callee, index), (metric, _) in REASON_ARGS.items():
                if _callee(node) != callee or len(node.args) <= index:
                    continue
                arg = node.args[index]
                if isinstance(arg, ast.Attribute) and arg.attr == "reason":
                    continue  # passes on a BadRecord's or InvalidCommand's own reason
                assert isinstance(arg, ast.Constant) and isinstance(arg.value, str), (
                    f"{path.name}:{node.lineno}: {callee} needs a literal code from errors.py"
                )
                found[metric].add(arg.value)
    return found


def series(metrics: Metrics) -> dict[str, list[dict[str, str]]]:
    """The label sets of each exported counter (`_total` samples), by metric name."""
    text = generate_latest(metrics.registry).decode()
    out: dict[str, list[dict[str, str]]] = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_total"):
                out[family.name].append(sample.labels)
    return out


def test_every_reason_code_used_in_the_code_is_listed_and_starts_at_zero():
    used = codes_in_the_code()
    # The scan finds what it must (a scan that finds nothing proves nothing).
    assert {"missing_header", "not_json", "bad_id", "too_large", "bad_header"} <= used[
        "dedup_gateway_records_quarantined"
    ]
    assert {"bad_field", "raw_record_gone"} <= used["dedup_gateway_invalid_commands"]
    assert {"timeout", "auth"} <= used["dedup_gateway_redis_errors"]
    assert {"released", "no_quorum"} <= used["dedup_gateway_releases"]

    settings = load_settings()
    metrics = Metrics()
    metrics.preinit(settings)
    exported = series(metrics)
    for metric, listed in REASON_ARGS.values():
        assert used[metric] <= set(listed), (
            f"{metric}: not in errors.py: {used[metric] - {*listed}}"
        )
        values = {next(v for k, v in labels.items() if k in ("reason", "kind", "result"))
                  for labels in exported[metric]}  # fmt: skip
        assert set(listed) <= values, f"{metric} lacks {set(listed) - values}"


def test_series_per_member_topic_and_action_start_at_zero():
    settings = load_settings(
        redis={"nodes": ["redis://a:6379/0", "redis://:pw@b:6380/0", "redis://c:6379/1"]},
        kafka={"raw_topics": ["orders", "payments"]},
    )
    metrics = Metrics()
    metrics.preinit(settings)
    exported = series(metrics)
    errors_seen = {(s["redis"], s["kind"]) for s in exported["dedup_gateway_redis_errors"]}
    members = {"a:6379/0", "b:6380/0", "c:6379/1"}  # never the password
    assert errors_seen == {(m, k) for m in members for k in errors.REDIS_ERROR_KINDS}
    assert {s["topic"] for s in exported["dedup_gateway_records_in"]} == {"orders", "payments"}
    assert {s["action"] for s in exported["dedup_gateway_votes_undecided"]} == {
        "block", "forward", "drop"
    }  # fmt: skip
    assert all(
        sample.value == 0
        for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
        if family.name.startswith("dedup_gateway_") and family.type == "counter"
        for sample in family.samples
        if sample.name.endswith("_total")
    )


def test_build_info_and_process_metrics_in_each_injected_registry():
    first, second = Metrics(CollectorRegistry()), Metrics()  # no clash between registries
    for metrics in (first, second):
        text = generate_latest(metrics.registry).decode()
        assert 'dedup_gateway_build_info{version="0.1.0"} 1.0' in text
        assert "process_cpu_seconds_total" in text
        assert "process_resident_memory_bytes" in text
        assert "python_info{" in text

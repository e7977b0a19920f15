#!/usr/bin/env bash
# Builds helm (the chart checks in tests/deployment: `helm lint`, `helm template`) from its Go
# module with this machine's Go toolchain, into ~/.cache/dedup-gateway/bin/helm (outside
# the repository; tests/deployment/conftest.py's `tool` looks there). Idempotent: returns at
# once when that helm is the pinned version. Called by scripts/setup-ops.sh.
#   HELM_VERSION  the module version to build (default below)
#   HELM_BIN_DIR  where the binary goes (default ~/.cache/dedup-gateway/bin)
set -euo pipefail

HELM_VERSION=${HELM_VERSION:-v3.22.0}
BIN_DIR=${HELM_BIN_DIR:-$HOME/.cache/dedup-gateway/bin}
HELM="$BIN_DIR/helm"

GO=$(command -v go || true)
if [ -z "$GO" ] && [ -x /usr/local/go/bin/go ]; then GO=/usr/local/go/bin/go; fi

# The module version the binary was built from (`go install` sets no ldflags, so
# `helm version` would not say; the binary's build info does).
built_version() {
  "$GO" version -m "$HELM" 2>/dev/null | awk '$1 == "mod" && $2 == "helm.sh/helm/v3" {print $3}'
}

if [ -x "$HELM" ] && [ -n "$GO" ] && [ "$(built_version)" = "$HELM_VERSION" ]; then
  exit 0
fi
if [ -z "$GO" ]; then
  echo "setup-helm: no Go toolchain (go) on PATH or in /usr/local/go/bin: install Go to build helm" >&2
  exit 1
fi

echo "setup-helm: building helm $HELM_VERSION with $("$GO" version | cut -d' ' -f3) into $BIN_DIR"
mkdir -p "$BIN_DIR"
# CGO off: a static binary that needs no C toolchain.
CGO_ENABLED=0 GOBIN="$BIN_DIR" "$GO" install "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
"$HELM" version --short >/dev/null
echo "setup-helm: done ($HELM)"

#!/usr/bin/env bash
# Builds helm (the chart checks in tests/deployment: `helm lint`, `helm template`, the
# `helm test` hook) from its Go module with this machine's Go toolchain, into
# ~/.cache/dedup-gateway/bin/helm (outside the repository; tests/deployment/conftest.py's
# `tool` looks there). It passes the ldflags helm's own Makefile passes: the version
# (`helm version`) and the Kubernetes version helm assumes without a cluster, which
# `helm template` checks the chart's kubeVersion against (without them helm assumes
# v1.20.0 and refuses the chart). Idempotent: returns at once when that helm says it is
# the pinned version. Called by scripts/setup-ops.sh.
#   HELM_VERSION  the module version to build (default below)
#   HELM_BIN_DIR  where the binary goes (default ~/.cache/dedup-gateway/bin)
set -euo pipefail

HELM_VERSION=${HELM_VERSION:-v3.21.4}
BIN_DIR=${HELM_BIN_DIR:-$HOME/.cache/dedup-gateway/bin}
HELM="$BIN_DIR/helm"
MODULE=helm.sh/helm/v3

if [ -x "$HELM" ] && [ "$("$HELM" version --template '{{.Version}}' 2>/dev/null)" = "$HELM_VERSION" ]; then
  exit 0
fi
GO=$(command -v go || true)
if [ -z "$GO" ] && [ -x /usr/local/go/bin/go ]; then GO=/usr/local/go/bin/go; fi
if [ -z "$GO" ]; then
  echo "setup-helm: no Go toolchain (go) on PATH or in /usr/local/go/bin: install Go to build helm" >&2
  exit 1
fi

echo "setup-helm: building helm $HELM_VERSION with $("$GO" version | cut -d' ' -f3) into $BIN_DIR"
mkdir -p "$BIN_DIR"
# Fetch the module first: its go.mod names the client-go it is built with, whose
# version (v0.M.N) is Kubernetes 1.M, the default helm's Makefile bakes in.
"$GO" mod download "$MODULE@$HELM_VERSION"
GOMOD=$("$GO" mod download -json "$MODULE@$HELM_VERSION" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",*$/\1/p')
CLIENT_GO=$(awk '$1 == "k8s.io/client-go" {print $2; exit}' "$GOMOD")
K8S_MINOR=$(echo "$CLIENT_GO" | cut -d. -f2)
if [ -z "$K8S_MINOR" ]; then
  echo "setup-helm: cannot read the k8s.io/client-go version from $GOMOD" >&2
  exit 1
fi
LDFLAGS="-w -s -X $MODULE/internal/version.version=$HELM_VERSION -X $MODULE/internal/version.gitTreeState=clean"
for pkg in pkg/lint/rules pkg/chartutil; do
  LDFLAGS="$LDFLAGS -X $MODULE/$pkg.k8sVersionMajor=1 -X $MODULE/$pkg.k8sVersionMinor=$K8S_MINOR"
done
# CGO off: a static binary that needs no C toolchain.
CGO_ENABLED=0 GOBIN="$BIN_DIR" "$GO" install -trimpath -ldflags "$LDFLAGS" "$MODULE/cmd/helm@$HELM_VERSION"
"$HELM" version --short
echo "setup-helm: done ($HELM)"

#!/usr/bin/env bash
# Installs everything the project needs on a fresh Debian machine:
# redis-server (apt, when missing), Java 17 and Maven (apt, when missing), Apache
# Kafka's broker, Spark's Kafka connector and the table formats (jars from Maven Central, fetched once
# into ~/.cache/dedup-gateway/jars: devtools/jars.py), Prometheus/promtool for the deployment checks (scripts/setup-ops.sh),
# a virtualenv with the package and its dev/test extras, and the native claim (a Redis
# module, gcc from apt when missing) compiled once into ~/.cache/dedup-gateway/redis-module.
set -euo pipefail
VENV=${1:-.venv}

need_apt=()
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
command -v java >/dev/null 2>&1 || need_apt+=(openjdk-17-jdk-headless)
command -v mvn >/dev/null 2>&1 || need_apt+=(maven)
command -v gcc >/dev/null 2>&1 || command -v cc >/dev/null 2>&1 || need_apt+=(gcc libc6-dev)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: installing ${need_apt[*]} with apt-get"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}"
fi

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
# constraints.txt: the versions the project is tested with (also used by the images
# and the Spark pack).
"$VENV/bin/python" -m pip install -q -c "$(dirname "$0")/../constraints.txt" -e ".[dev]"
bash "$(dirname "$0")/setup-ops.sh"
# The JVM engines, fetched once (a second run finds them cached and fetches nothing).
"$VENV/bin/python" -m devtools.jars kafka >/dev/null
"$VENV/bin/python" -m devtools.jars spark-kafka >/dev/null
"$VENV/bin/python" -m devtools.jars tables >/dev/null  # [spark] output_format
# The native claim (gateway/quorum/native): optional for a deployment, but the tests run
# every claim test on it too. Compiled once per source; says why when it cannot.
if ! module=$("$VENV/bin/python" -m gateway.quorum.native); then
  echo "setup: the native claim module could not be built (above); the gateway runs" \
       "without it ([redis] claim = \"auto\" or \"lua\"), the tests of the module do not" >&2
  exit 1
fi
echo "setup: native claim module $module (load it with: redis-server --loadmodule $module)"
echo "setup: done ($VENV)"

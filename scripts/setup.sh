#!/usr/bin/env bash
# Installs what the project needs on a fresh Debian machine, in two parts.
# `setup.sh VENV demo` (what `make demo` needs): redis-server, Java 17 and Maven (apt,
# when missing), a virtualenv with the package and the demo's extras (local, spark,
# demo), Apache Kafka's broker and Spark's Kafka connector (jars from Maven Central,
# fetched once into ~/.cache/dedup-gateway/jars: devtools/jars.py).
# `setup.sh VENV` (what the tests need; the default): the demo's part, then the dev
# and test extras, the table formats' jars, Prometheus/promtool and helm for the
# deployment checks (scripts/setup-ops.sh) and the native claim (a Redis module, gcc
# from apt when missing) compiled once into ~/.cache/dedup-gateway/redis-module.
set -euo pipefail
VENV=${1:-.venv}
PART=${2:-all}

need_apt=()
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
command -v java >/dev/null 2>&1 || need_apt+=(openjdk-17-jdk-headless)
command -v mvn >/dev/null 2>&1 || need_apt+=(maven)
if [ "$PART" != demo ]; then
  command -v gcc >/dev/null 2>&1 || command -v cc >/dev/null 2>&1 || need_apt+=(gcc libc6-dev)
fi
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
if [ "$PART" = demo ]; then
  "$VENV/bin/python" -m pip install -q -c "$(dirname "$0")/../constraints.txt" -e ".[local,spark,demo]"
else
  "$VENV/bin/python" -m pip install -q -c "$(dirname "$0")/../constraints.txt" -e ".[dev]"
fi
# The JVM engines, fetched once (a second run finds them cached and fetches nothing).
"$VENV/bin/python" -m devtools.jars kafka >/dev/null
"$VENV/bin/python" -m devtools.jars spark-kafka >/dev/null
if [ "$PART" = demo ]; then
  echo "setup: the demo's part done ($VENV)"
  exit 0
fi
"$VENV/bin/python" -m devtools.jars tables >/dev/null  # [spark] output_format
bash "$(dirname "$0")/setup-ops.sh"
# The native claim (gateway/quorum/native): optional for a deployment, but the tests run
# every claim test on it too. Compiled once per source; says why when it cannot.
if ! module=$("$VENV/bin/python" -m gateway.quorum.native); then
  echo "setup: the native claim module could not be built (above); the gateway runs" \
       "without it ([redis] claim = \"auto\" or \"lua\"), the tests of the module do not" >&2
  exit 1
fi
echo "setup: native claim module $module (load it with: redis-server --loadmodule $module)"
echo "setup: done ($VENV)"

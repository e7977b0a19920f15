#!/usr/bin/env bash
# Packs the Spark job's Python environment for a cluster (venv-pack):
#
#   scripts/pack-spark-env.sh [-o dist/spark-env.tar.gz] [--dry-run]
#
# A fresh venv gets the product (gateway + spark_sink) and its `spark` extra
# minus pyspark itself: the cluster provides pyspark (spark-submit puts its own
# on the executors' PYTHONPATH, ahead of site-packages), and a second copy
# would be ~430 MB of dead weight. venv-pack then archives the venv; unpacked
# under ./environment by `spark-submit --archives env.tar.gz#environment`, its
# bin/python runs without activation (docs/operations.md, "Spark on a cluster").
#
# The venv's bin/python is a link to the interpreter that built it: build on
# the OS and Python (same minor version) your cluster nodes have, and set
# PYTHON_PREFIX to where that Python lives on the nodes (e.g. /usr for
# /usr/bin/python3.11) when it is not where it lives here.
# --dry-run prints the requirements only. tests/deployment/test_spark_pack.py builds
# the archive and runs it under spark-submit (about 1.5 min to build here).
# Environment: PYTHON (the interpreter to build with, default python3),
# PYTHON_PREFIX (the nodes' Python prefix), PIP_* as usual.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT="$REPO/dist/spark-env.tar.gz"
DRY_RUN=0
while [ $# -gt 0 ]; do
  case "$1" in
    -o|--output) OUT=$2; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "pack-spark-env: unknown argument $1" >&2; exit 2 ;;
  esac
done
PYTHON=${PYTHON:-python3}

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# The spark extra without pyspark, read from pyproject.toml.
mapfile -t EXTRAS < <("$PYTHON" - "$REPO/pyproject.toml" <<'EOF'
import re, sys, tomllib
with open(sys.argv[1], "rb") as f:
    extra = tomllib.load(f)["project"]["optional-dependencies"]["spark"]
for req in extra:
    if re.match(r"pyspark\b", req) is None:
        print(req)
EOF
)

if [ "$DRY_RUN" = 1 ]; then  # what would be installed, one requirement a line
  printf '%s\n' "dedup-gateway (this checkout)" "${EXTRAS[@]}"
  exit 0
fi
echo "pack-spark-env: venv with dedup-gateway and ${EXTRAS[*]}"
# The sources the wheel needs (as the images copy them), so the build leaves
# nothing behind in the checkout.
mkdir -p "$WORK/src"
cp -R "$REPO/pyproject.toml" "$REPO/README.md" "$REPO/gateway" "$REPO/spark_sink" "$WORK/src/"
find "$WORK/src" -name __pycache__ -prune -exec rm -rf {} +

"$PYTHON" -m venv "$WORK/env"
# The tested versions (constraints.txt, shared with `make setup` and the images).
"$WORK/env/bin/python" -m pip install -q --disable-pip-version-check \
  -c "$REPO/constraints.txt" "$WORK/src" "${EXTRAS[@]}"
if "$WORK/env/bin/python" -c "import pyspark" 2>/dev/null; then
  echo "pack-spark-env: pyspark got into the environment; it must come from the cluster" >&2
  exit 1
fi

# venv-pack from the caller's PATH, else in a throwaway venv of its own (not in
# the packed one).
VENV_PACK=$(command -v venv-pack || true)
if [ -z "$VENV_PACK" ]; then
  "$PYTHON" -m venv "$WORK/tool"
  "$WORK/tool/bin/python" -m pip install -q --disable-pip-version-check "venv-pack>=0.2"
  VENV_PACK="$WORK/tool/bin/venv-pack"
fi
# The nodes' Python. Not venv-pack's --python-prefix: version 0.2.0 rewrites
# the link by string prefix and turns bin/python3 -> .../bin/python3 into
# PREFIX/bin/python3.113 (seen here). Every bin/python* link that leaves the
# venv (which one does depends on the Python that made it) is re-pointed; the
# venv stops running here after this.
if [ -n "${PYTHON_PREFIX:-}" ]; then
  PYVER=$("$WORK/env/bin/python" -c 'import sys; print("python%d.%d" % sys.version_info[:2])')
  for link in "$WORK/env/bin/python" "$WORK/env/bin/python3" "$WORK/env/bin/$PYVER"; do
    if [ -L "$link" ] && [[ "$(readlink "$link")" == /* ]]; then
      ln -sfn "${PYTHON_PREFIX%/}/bin/$PYVER" "$link"
    fi
  done
  sed -i "s|^home = .*|home = ${PYTHON_PREFIX%/}/bin|" "$WORK/env/pyvenv.cfg"
fi
mkdir -p "$(dirname "$OUT")"
"$VENV_PACK" --prefix "$WORK/env" --output "$OUT" --force --quiet
echo "pack-spark-env: wrote $OUT ($(du -h "$OUT" | cut -f1))"

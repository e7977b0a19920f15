# One entry point for humans and CI. Every target sets itself up first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The demo's part of the set-up alone (no test tools, helm or Prometheus): a fresh
# machine's first `make demo` waits for what the demo runs, nothing more.
DEMO_STAMP := $(VENV)/.installed-demo

.PHONY: setup demo localstack test test-long lint typecheck format bench dist spark-pack chaos chaos-ci clean

$(DEMO_STAMP): pyproject.toml constraints.txt scripts/setup.sh \
		scripts/jvm/kafka.pom.xml scripts/jvm/spark-kafka.pom.xml devtools/jars.py
	bash scripts/setup.sh $(VENV) demo
	touch $(DEMO_STAMP)

$(STAMP): pyproject.toml constraints.txt scripts/setup.sh scripts/setup-ops.sh scripts/setup-helm.sh \
		scripts/jvm/kafka.pom.xml scripts/jvm/spark-kafka.pom.xml scripts/jvm/spark-table.pom.xml \
		devtools/jars.py gateway/quorum/native/dd_claim.c
	bash scripts/setup.sh $(VENV)
	touch $(DEMO_STAMP) $(STAMP)

setup: $(STAMP)

# A full set-up is a demo set-up too; without one, the demo's part alone.
DEMO_SETUP = $(if $(wildcard $(STAMP)),$(STAMP),$(DEMO_STAMP))

demo: $(DEMO_SETUP)  ## the main job on the embedded local stack
	$(PY) -m devtools.demo $(ARGS)

localstack: $(DEMO_SETUP)  ## Apache Kafka on :9092 and redis-servers on :6379-6381 until Ctrl-C
	$(PY) -m devtools.localstack $(ARGS)

# The suite waits on servers far more than it computes: 4 pytest-xdist workers on 2
# cores; tests sharing an expensive fixture, and the heavy stacks, stay on one worker
# (xdist_group, tests/conftest.py). Serially: make test ARGS="-n0". 6 workers ran in
# 8 min on one 2-core host, but on a host half as fast per operation the Redis
# members' 300 ms test timeout and the Spark tests' waits were overrun (11 of 1,001
# failed); 4 workers: 16.5 min there.
PARALLEL ?= -n 4 --dist loadgroup
# The runs that take minutes each (the seeded chaos schedules, the Spark standalone
# cluster, the benchmark scripts at test size, the native claim's long sanitizer
# fuzz) have a target of their own; CI runs `make test` and then `make test-long`.
# `pytest` alone runs both.
LONG := chaos_schedule or spark_cluster or bench_run or native_fuzz or kafka_cluster or second_engine or release_install
# Each run ends with its 25 slowest tests: where the suite's wall time goes.
test: $(STAMP) lint typecheck  ## lint, strict types, then the suite but its long runs
	$(PY) -m pytest $(PARALLEL) --durations=25 -m "not ($(LONG))" $(ARGS)

test-long: $(STAMP)  ## the chaos schedules, the cluster run and the benchmarks, CI size
	$(PY) -m pytest -n 3 --dist loadgroup -m "$(LONG)" $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) -m bench $(ARGS)

# The sdist and, built from it, the wheel; the version is pyproject.toml's (the one
# source). The build backend is the venv's, pinned in constraints.txt (no download).
dist: $(STAMP)  ## dist/dedup_gateway-VERSION.tar.gz and -py3-none-any.whl, twine-checked
	rm -f dist/dedup_gateway-*
	$(PY) -m build --no-isolation --outdir dist .
	$(VENV)/bin/twine check --strict dist/dedup_gateway-*

spark-pack: $(STAMP)  ## dist/spark-env.tar.gz for spark-submit --archives (docs/operations.md)
	PATH="$(abspath $(VENV))/bin:$$PATH" bash scripts/pack-spark-env.sh $(ARGS)

# The Spark tests marked spark_compat on another pyspark (3.5.x with the Scala 2.12
# connector, 4.0.x, 4.1.x), in a venv of its own under ~/.cache/dedup-gateway/venvs
# (built once: tests/integration/spark/compat_env.py) with Spark's Kafka connector for
# that version: make spark-compat SPARK=4.0.0 ARGS="-x"
SPARK ?= 3.5.7
.PHONY: spark-compat
spark-compat: $(STAMP)  ## the Spark tests on another Spark line (docs/spark-cluster.md)
	$(PY) -m tests.integration.spark.compat_env $(SPARK) --pytest -- $(ARGS)

SEED ?= 1
MINUTES ?= 10
chaos-ci: $(STAMP)  ## the CI-size seeded schedules (tests/chaos/test_chaos.py)
	$(PY) -m pytest -m chaos_schedule tests/chaos $(ARGS)

chaos: $(STAMP)  ## seeded fault schedules, one after another: make chaos SEED=7 MINUTES=30
	$(PY) -m devtools.chaos --seed $(SEED) --minutes $(MINUTES) $(ARGS)

clean:
	rm -rf $(VENV) .state .pytest_cache

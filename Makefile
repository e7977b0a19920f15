# One entry point for humans and CI. Every target sets itself up first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint typecheck format bench clean

$(STAMP): pyproject.toml scripts/setup.sh scripts/setup-ops.sh
	bash scripts/setup.sh $(VENV)
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)  ## the main job on the embedded local stack
	$(VENV)/bin/dedup-gateway demo $(ARGS)

test: $(STAMP)
	$(PY) -m pytest $(ARGS)

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

clean:
	rm -rf $(VENV) .state .pytest_cache

# fedsim: `make run` and `make test` set up .venv themselves; nothing else is needed.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export RAY_USAGE_STATS_ENABLED := 0
export PYTHONUNBUFFERED := 1

.PHONY: help run test test-fast bench bench-scale lint venv clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

$(STAMP): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

venv: $(STAMP)  ## create .venv and install fedsim with its dependencies

run: $(STAMP)  ## the main job: FedAvg on the embedded digits data, with stragglers
	$(BIN)/fedsim run configs/demo.yaml
	$(BIN)/fedsim plot $$(ls -td results/demo-* | head -1)

test: $(STAMP)  ## the whole test suite (slow end-to-end tests included)
	$(BIN)/python -m pytest -q --timeout 900

test-fast: $(STAMP)  ## the suite without the slow end-to-end tests
	$(BIN)/python -m pytest -q -m "not slow"

bench: $(STAMP)  ## fedsim vs the plain loop vs Flower on the shared FedAvg workload
	$(BIN)/python -m bench.fedavg_bench

bench-scale: $(STAMP)  ## fedsim vs Flower at 1k and 10k clients
	$(BIN)/python -m bench.scale_bench

lint: $(STAMP)  ## ruff
	$(BIN)/ruff check fedsim actors jobs tests bench

clean:  ## remove run folders (keeps results/bench)
	find results -mindepth 1 -maxdepth 1 -type d ! -name bench -exec rm -rf {} +

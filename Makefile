# Two commands on a fresh machine: `make demo` (set up + default training run), `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-gpu clean

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

test: setup
	$(BIN)/python -m pytest -q

test-gpu: setup
	$(BIN)/python -m pytest -q -m gpu

clean:
	rm -rf $(VENV) runs .pytest_cache

# Quickstart: `make demo` and `make test`. Both create .venv and install what they need the first time.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_PIP_ARGS ?=

.PHONY: demo test test-fast lint format gpu-test bench clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# torch first, pinned, unless .venv has one: the build pip's configuration offers (a CPU build where it lists
	@# one; from PyPI on Linux, the CUDA build). TORCH_PIP_ARGS picks the index, e.g. PyTorch's CPU wheels (README).
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==2.13.0" $(TORCH_PIP_ARGS) \
		|| $(PY) -m pip install -q torch $(TORCH_PIP_ARGS)
	$(PY) -m pip install -q -e ".[dev,triton]"
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/longctx check
	$(VENV)/bin/longctx demo-memory --lengths 512,1024,2048
	$(VENV)/bin/longctx train --overwrite

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests dev
	$(VENV)/bin/ruff format --check src tests dev

format: $(STAMP)
	$(VENV)/bin/ruff check --fix src tests dev
	$(VENV)/bin/ruff format src tests dev

test: lint
	$(PY) -m pytest -q -n 2 --dist loadgroup tests

test-fast: $(STAMP)
	$(PY) -m pytest -q -x -n 2 --dist loadgroup tests -m "not slow and not distributed and not interpreter"

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache

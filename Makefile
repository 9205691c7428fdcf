# Two entry points for a fresh machine: `make demo` and `make test`. Each installs what it needs
# into .venv (torch pinned to the CPU build through constraints.txt).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip install -q -c constraints.txt

.PHONY: demo test test-fast lint bench install-dev clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(VENV)/.core: $(BIN)/python pyproject.toml constraints.txt
	$(PIP) -e .
	touch $@

$(VENV)/.dev: $(BIN)/python pyproject.toml constraints.txt
	$(PIP) -e ".[dev]"
	touch $(VENV)/.core $@

install-dev: $(VENV)/.dev

demo: $(VENV)/.core
	$(BIN)/torchdebug demo

test: $(VENV)/.dev
	bash scripts/ensure_browser.sh || true
	$(BIN)/python -m pytest -q

test-fast: $(VENV)/.dev
	$(BIN)/python -m pytest -q -m "not slow"

lint: $(VENV)/.dev
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy

bench: $(VENV)/.dev
	$(BIN)/python benchmarks/overhead.py
	$(BIN)/python benchmarks/fault_suite.py
	$(BIN)/python benchmarks/memory_timing_overhead.py
	$(BIN)/python benchmarks/store_throughput.py
	$(BIN)/python benchmarks/dashboard_api.py
	$(BIN)/python benchmarks/sinks.py
	$(BIN)/python benchmarks/view_weight.py
	$(BIN)/python benchmarks/store_scale.py

clean:
	rm -rf $(VENV) build dist .pytest_cache .mypy_cache .ruff_cache

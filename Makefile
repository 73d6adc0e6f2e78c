# powerbatch: `make demo` runs the power-aware proxy on the embedded simulated GPU;
# `make test` runs the test suite. Both install what they need into .venv first.

PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck check bench compare clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/powerbatch demo

test: $(STAMP)
	$(BIN)/pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

check: lint typecheck test

# Issue 2's side-by-side: the same bursty load without and with the proxy.
compare: $(STAMP)
	$(BIN)/powerbatch bench --arms none,dynamic --repeats 1 --out results/compare

bench: $(STAMP)
	$(BIN)/powerbatch bench --out results/bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache out

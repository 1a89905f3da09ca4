# The two commands of the README: `make run` (set up + GRPO demo) and `make test`.
# Both create .venv when missing and are idempotent.

PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
# Re-install when the dependencies change.
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
TORCH  ?= torch==2.13.0
CONFIG ?= configs/tiny-cpu.yaml
PYTEST_ARGS ?=
# Tests run in a loopback-only network namespace where the machine allows it (Ray opens
# ports on every interface; see scripts/loopback.sh).
LOOPBACK ?= scripts/loopback.sh

.PHONY: setup run test test-fast lint clean screenshots

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	@echo ">> installing the CPU torch wheel first ($(TORCH)), so no CUDA build is pulled"
	$(BIN)/python -m pip install -q --disable-pip-version-check $(TORCH)
	$(BIN)/python -m pip install -q --disable-pip-version-check uv
	@echo ">> installing grpoflow and its dependencies"
	$(BIN)/uv pip install -q --python $(BIN)/python -e ".[dev]" \
	  || $(BIN)/python -m pip install -q --disable-pip-version-check -e ".[dev]"
	@rm -f $(VENV)/.installed-*
	@touch $@

setup: $(STAMP)

run: setup
	$(BIN)/grpoflow train $(CONFIG)

test: setup
	$(BIN)/ruff check .
	AWS_EC2_METADATA_DISABLED=true $(LOOPBACK) $(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: setup
	AWS_EC2_METADATA_DISABLED=true $(LOOPBACK) $(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check .

# PNGs of the Prefect and MLflow UIs on a short demo run (docs/img/; scripts/screenshots.py).
screenshots: setup
	$(BIN)/python scripts/screenshots.py

clean:
	rm -rf $(VENV) .cache runs

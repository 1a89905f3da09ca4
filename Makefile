# The two commands of the README: `make run` (set up + GRPO demo) and `make test`.
# Both create .venv when missing and are idempotent. Prerequisites: Linux, Python 3.11 (or 3.12:
# PYTHON=python3.12), make.
#
# `make run` installs what the demo needs (the core dependencies); `make test` and
# `make soak` install everything the tests use (the `dev` extra: Ray, megatron-core, moto,
# verifiers, bitsandbytes, ...).

PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
DEPS   := $(shell cat pyproject.toml | cksum | cut -d' ' -f1)
# Re-install when the dependencies change; the core install is part of the dev one.
CORE   := $(VENV)/.installed-core-$(DEPS)
DEV    := $(VENV)/.installed-dev-$(DEPS)
TORCH  ?= torch==2.13.0
# The CPU build of torch: PyTorch's CPU wheel index first, then the default index (a local
# wheel cache, where pip has one, serves either).
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# A local CPU wheel of it in pip's find-links (PIP_FIND_LINKS), where the machine has one:
# uv installs it in ~3 s (pip unpacks it in ~20 s, on one core).
# Its tag follows PYTHON (python3.11 -> cp311, python3.12 -> cp312).
PYTAG  := cp$(subst .,,$(subst python,,$(notdir $(PYTHON))))
TORCH_WHEEL ?= $(firstword $(wildcard $(addsuffix /$(subst ==,-,$(TORCH))+cpu-$(PYTAG)-*.whl,\
  $(PIP_FIND_LINKS))))
CONFIG ?= configs/tiny-cpu.yaml
PYTEST_ARGS ?=
# Tests run in a loopback-only network namespace where the machine allows it (Ray opens
# ports on every interface; see scripts/loopback.sh).
LOOPBACK ?= scripts/loopback.sh
# The demo and the tests let Python write bytecode even where the environment says not to
# (PYTHONDONTWRITEBYTECODE, as on this machine): the installs do not compile it (uv's
# --compile-bytecode compiled all of torch and every dependency, 30-100 s of a clean setup), so
# the first process to import a module writes its bytecode and the next ones read it; without
# it every worker and child process compiled Prefect, MLflow, transformers and torch again
# (~10 s each). __pycache__/ is git-ignored.
WRITE_BYTECODE := PYTHONDONTWRITEBYTECODE=
PYTEST := AWS_EC2_METADATA_DISABLED=true $(WRITE_BYTECODE) $(LOOPBACK) $(BIN)/python -m pytest

.PHONY: setup setup-dev sandbox-deps cookbook-venv run test test-random soak lint clean screenshots

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Installs without compiling bytecode (see WRITE_BYTECODE above).
define install
	@$(BIN)/python -m pip --version >/dev/null
	$(BIN)/python -m pip install -q --disable-pip-version-check uv
	@echo ">> installing the CPU torch wheel first ($(TORCH)), so no CUDA build is pulled"
	$(if $(TORCH_WHEEL),$(BIN)/uv pip install -q --python $(BIN)/python $(TORCH_WHEEL) ||) \
	$(BIN)/python -m pip install -q --disable-pip-version-check --retries 1 --timeout 20 \
	  --index-url $(TORCH_INDEX) $(TORCH) 2>/dev/null \
	  || $(BIN)/python -m pip install -q --disable-pip-version-check $(TORCH)
	@echo ">> installing grpoflow ($(1))"
	$(BIN)/uv pip install -q --python $(BIN)/python -e "$(1)" \
	  || $(BIN)/python -m pip install -q --disable-pip-version-check -e "$(1)"
endef

$(CORE): pyproject.toml | $(BIN)/python
	$(call install,.)
	@rm -f $(VENV)/.installed-core-*
	@touch $@

$(DEV): pyproject.toml | $(BIN)/python
	$(call install,.[dev])
	@rm -f $(VENV)/.installed-*
	@touch $@ $(CORE)

setup: $(CORE)

setup-dev: $(DEV) sandbox-deps cookbook-venv

# The tinker-cookbook recipes' own venv (tests/test_tinker_cookbook.py drives serve-tinker from
# it, as a user's install would; docs/tinker.md). Built here, outside the tests' loopback-only
# namespace; idempotent (a stamp of its requirement set), 35-150 s the first time.
cookbook-venv: $(DEV)
	bash scripts/tinker_cookbook_env.sh

# The code sandbox (rl_core/rewards/sandbox.py: the `python` tool, `env: code`, `code_tests`)
# runs untrusted code in bubblewrap. Installed here when `bwrap` is missing and apt-get can run as
# root (non-interactive, quiet, each apt call bounded); otherwise this says how. Never fails
# the setup: without bwrap the sandbox refuses to start and names this fix (docs/agents.md).
APT := DEBIAN_FRONTEND=noninteractive timeout 300 apt-get -qq -o Dpkg::Use-Pty=0
sandbox-deps:
	@if command -v bwrap >/dev/null 2>&1; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo ">> installing bubblewrap (the code sandbox)"; \
	  { $(APT) install -y --no-install-recommends bubblewrap >/dev/null 2>&1 \
	    || { $(APT) update >/dev/null && \
	         $(APT) install -y --no-install-recommends bubblewrap >/dev/null; }; } \
	  && command -v bwrap >/dev/null \
	  || echo "!! could not install bubblewrap: run apt-get install -y bubblewrap as root"; \
	else \
	  echo "!! bubblewrap (bwrap) is missing; the code sandbox needs it. Install it: sudo" \
	       "apt-get install bubblewrap (Debian/Ubuntu), sudo dnf install bubblewrap (Fedora)," \
	       "or your distribution's package"; \
	fi

run: setup
	$(WRITE_BYTECODE) $(BIN)/grpoflow train $(CONFIG)

# The suite CI runs (.ci/run): lint, the layer contracts (.importlinter), the 600-line bound
# per file (scripts/loc.py), then every test but the soak tier.
# Three workers on 2 cores (pytest-xdist; each test module runs whole on one worker, the
# longest modules first: tests/conftest.py): with two, about 1.3 cores were busy on average,
# the flow tests waiting on process start-ups, servers and HTTP; a third fills those waits
# (docs/testing.md). A fixed order (pytest-randomly off; `make test-random` shuffles).
XDIST ?= -n 3 --dist loadscope --no-loadscope-reorder
test: setup-dev
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache
	$(BIN)/python scripts/loc.py --max-file 600 --top 0
	$(PYTEST) $(XDIST) -p no:randomly $(PYTEST_ARGS)

# The same suite in a random order (pytest-randomly; its seed is printed:
# make test-random PYTEST_ARGS=--randomly-seed=N replays an order).
test-random: setup-dev
	$(PYTEST) $(XDIST) $(PYTEST_ARGS)

# The long runs (docs/testing.md): full-length learning, kill-anywhere and chaos soaks, on
# two workers (the hour-long chaos soak on one, the rest beside it).
SOAK_XDIST ?= -n 2 --dist loadscope
soak: setup-dev
	GRPOFLOW_SOAK=1 $(PYTEST) $(SOAK_XDIST) -m soak -p no:randomly $(PYTEST_ARGS)

lint: setup-dev
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache
	$(BIN)/python scripts/loc.py --max-file 600 --top 0

# PNGs of the Prefect and MLflow UIs on a short demo run (docs/img/; scripts/screenshots.py).
screenshots: setup
	$(BIN)/python scripts/screenshots.py

clean:
	rm -rf $(VENV) .cache runs

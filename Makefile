# Two commands for a fresh machine (README):  make demo   and   make test
# Everything else here is what they need: system packages, a virtualenv, the Python packages.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
MOSHI_VERSION ?= 0.2.13
# Extra pip arguments for torch, e.g. TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
# for a CPU-only machine without a local CPU wheel (plain PyPI torch brings the CUDA wheels).
TORCH_PIP_ARGS ?=
# The system programs the main job and the tests run for real, as binary:Debian package.
SYSTEM_PACKAGES := redis-server:redis-server espeak-ng:espeak-ng nginx:nginx-light prometheus:prometheus \
	promtool:prometheus prometheus-node-exporter:prometheus-node-exporter \
	prometheus-redis-exporter:prometheus-redis-exporter cloud-init:cloud-init chromium:chromium curl:curl \
	prometheus-alertmanager:prometheus-alertmanager amtool:prometheus-alertmanager certbot:certbot \
	pebble:pebble pebble-challtestsrv:pebble
STAMP := $(VENV)/.installed

.PHONY: setup system-deps deploy-deps demo test lint bench lock clean

setup: system-deps $(STAMP)

# Debian/Ubuntu packages the main job and the tests run for real: Redis, nginx, Prometheus (with promtool)
# and its exporters, Alertmanager (with amtool), certbot and Pebble (Let's Encrypt's test ACME server, with
# its DNS stub pebble-challtestsrv), cloud-init (its schema check), a speech synthesiser. Installed only where missing.
system-deps:
	@missing=""; \
	for pair in $(SYSTEM_PACKAGES); do \
	  command -v "$${pair%%:*}" >/dev/null || missing="$$missing $${pair##*:}"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q $$missing; \
	fi

$(STAMP): pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==$(TORCH_VERSION)" $(TORCH_PIP_ARGS)
	# moshi pins torch<2.10 in its metadata but works with current torch: install it without its
	# dependencies; the runtime extra lists the ones it needs (docs/packaging.md).
	$(BIN)/pip install -q --no-deps "moshi==$(MOSHI_VERSION)"
	$(BIN)/pip install -q -c requirements.lock -e ".[runtime,deploy,dev]"
	touch $(STAMP)

# What a deploy job needs and nothing else (.github/workflows/pulumi-*.yml): the Pulumi program's
# virtualenv with the deploy extra (pulumi, its providers, the node renderers). No system packages (a deploy
# runner must not install or start nginx, Redis or Prometheus), no torch, no dev tools. Its own stamp, so
# that a later `make setup` still installs the rest.
DEPLOY_STAMP := $(VENV)/.deploy-installed
deploy-deps: $(DEPLOY_STAMP)

$(DEPLOY_STAMP): pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c requirements.lock -e ".[deploy]"
	touch $(DEPLOY_STAMP)

# The main job on this machine: the local node (nginx, Redis, Prometheus, exporters, the runtime with the
# tiny model) as real processes on loopback, 5 concurrent speech sessions through wss://, then stopped.
demo: setup
	$(BIN)/duplex node up

test: setup
	$(BIN)/pytest

lint: setup
	$(BIN)/ruff check runtime infra tests
	$(BIN)/ruff format --check runtime infra tests

bench: setup
	$(BIN)/duplex bench --threads 2 --json artifacts/bench-cpu.json

# Re-pin requirements.lock from the current virtualenv (torch and moshi are pinned in this Makefile).
lock:
	$(BIN)/pip freeze --exclude-editable | grep -v -E '^(torch|moshi|pip|setuptools)==' > requirements.lock

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache

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
SYSTEM_PACKAGES := redis-server espeak-ng
STAMP := $(VENV)/.installed

.PHONY: setup system-deps demo test lint bench lock clean

setup: system-deps $(STAMP)

# Debian/Ubuntu packages the demo and the tests run for real: a Redis server and a speech synthesiser.
system-deps:
	@missing=""; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	command -v espeak-ng >/dev/null || missing="$$missing espeak-ng"; \
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
	# dependencies; the runtime extra lists the ones it needs (README, "Packaging").
	$(BIN)/pip install -q --no-deps "moshi==$(MOSHI_VERSION)"
	$(BIN)/pip install -q -c requirements.lock -e ".[runtime,dev]"
	touch $(STAMP)

# The main job on this machine: a local node (tiny model, CPU) serving 5 concurrent speech sessions.
demo: setup
	$(BIN)/duplex demo

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

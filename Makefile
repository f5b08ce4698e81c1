# polytrain: `make demo` trains MNIST across two resource groups; `make test` runs the suite.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install sandbox demo up test lint format bench bench-all bench-quick gpu-check gpu-wheels clean

$(BIN)/python:
	@command -v $(PY) >/dev/null 2>&1 || { echo "need $(PY) (set PY=...)"; exit 1; }
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch is pinned to the CPU build (2.13.0) first, so nothing pulls a multi-GB CUDA build.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	@touch $(STAMP)

# Ranks run under bubblewrap, each as an unprivileged uid of its own in the group of the user
# polytrain-run (docs/security.md).
sandbox:
	@scripts/sandbox_setup.sh

install: $(STAMP) sandbox

demo: install
	$(BIN)/polytrain demo

up: install
	$(BIN)/polytrain up

# scripts/test_setup.sh first installs what the tests need (Chromium, redis-server) or stops
# at once with the command to run, and starts local PostgreSQL/Redis when they are configured.
# Three pytest processes (pytest-xdist), a test file never split between them: most tests
# wait on subprocesses (ranks, agents, a browser), and two left this 2-core host about 60 %
# busy (2026-11-26: user + sys CPU over wall time of a whole run).
test: install
	scripts/test_setup.sh
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 3 --dist loadfile

# CI runs this before the tests (.ci/run); `make format` applies what `ruff format --check` asks.
LINTED := backend worker contracts polytrain examples tests bench scripts migrations
lint: install
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/mypy backend worker contracts polytrain

format: install
	$(BIN)/ruff format $(LINTED)
	$(BIN)/ruff check --fix $(LINTED)

# Benchmarks (docs/benchmarks.md): one JSON line each. bench: the figures with targets, every
# ratio from 5 paired rounds, 2 for the throttled and sharded ones (about 27 minutes on this 2-core
# host: bench/run_all.py); bench-all adds the accuracy runs, the full throttled runs and the earlier
# issues' benchmarks (about 170 minutes in all); bench-quick,
# the engine's core figures, about 6 minutes.
bench: install
	$(BIN)/python -m bench.run_all

bench-all: install
	$(BIN)/python -m bench.run_all --all --out var/bench-all-results.jsonl

bench-quick: install
	$(BIN)/python -m bench.run_all --quick --out var/bench-quick-results.jsonl

# The engine's GPU path (the CUDA tests, a CUDA group beside a CPU group for every strategy, a
# sharded CUDA group): one JSON line, exit 2 without a GPU. Runs on a bare GPU machine with its
# own python3 and CUDA torch, from wheels carried in var/gpu-wheels (gpu-wheels, below).
gpu-check:
	scripts/gpu_check.sh

# The wheels gpu-check needs on a GPU machine without network (Python 3.12 by default), into
# var/gpu-wheels: scripts/gpu_wheels.sh [VERSION].
gpu-wheels:
	scripts/gpu_wheels.sh

clean:
	rm -rf var .pytest_cache

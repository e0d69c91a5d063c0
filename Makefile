# Two commands matter: `make demo` and `make test`. Both build .venv when it is missing.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
BSTAMP  := $(VENV)/.installed-bench

.PHONY: demo test test-all bench tour clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first, pinned, so pip never resolves a multi-GB build for the `torch>=2.4` range.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

# the benchmarks' peers (dask) on top; torch is already pinned by $(STAMP), so pip keeps it
$(BSTAMP): $(STAMP) pyproject.toml
	$(BIN)/pip install -q -e '.[dev,bench]'
	touch $(BSTAMP)

demo: $(STAMP)
	$(BIN)/python -m einjoin demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --durations=15

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup -m '' --durations=15

tour: $(STAMP)
	$(BIN)/python examples/tour.py

bench: $(BSTAMP)
	@ls bench/*.py >/dev/null 2>&1 && for f in bench/*.py; do echo "== $$f"; $(BIN)/python $$f || exit 1; done || echo "no benchmarks yet"

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis

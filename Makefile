# Two commands matter: `make demo` and `make test`. Both build .venv when it is missing.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
BSTAMP  := $(VENV)/.installed-bench

.PHONY: demo lint test test-all cov bench tour clean

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

# ruff (style and likely bugs), mypy (types; strict on einjoin.ir/decomp/planner) and vulture
# (dead code, whitelist in .vulture_whitelist.py); their settings are in pyproject.toml.
# All three run even when one fails, so one pass shows every problem.
lint: $(STAMP)
	@rc=0; \
	echo "== ruff check"; $(BIN)/ruff check || rc=1; \
	echo "== mypy"; $(BIN)/mypy || rc=1; \
	echo "== vulture"; $(BIN)/vulture && echo "vulture: no dead code" || rc=1; \
	exit $$rc

# Coverage of einjoin/ is measured by `make cov` (the default suite under coverage, without the
# linters) and by `make test-all`; both fail below COV_MIN: the TOTAL of the default suite (-n 2)
# at the end of issue 17, rounded down, less one point, because work in progress moves the figure
# a little. Raise it as coverage grows; lower it only with the reason in the commit.
# Measured 2026-12-04 22:42 UTC (pytest -q -n 2 --dist loadgroup --cov=einjoin): TOTAL 93%
# (9990 statements, 679 missed: 93.2%) -> 93 - 1.
# `make test` runs without coverage: on CPython 3.11 (the torch wheel's Python) coverage's line
# tracer doubles the suite's CPU (2026-12-05, user time of tests/test_ops_nn.py 32.7 -> 65.1 s,
# tests/test_transformer_modules.py 24.9 -> 49.9 s), and the suite must fit ten minutes on two
# cores. Run `make cov` before a commit that adds code.
COV_MIN ?= 92
PYTEST_COV := --cov=einjoin --cov-report=term:skip-covered --cov-fail-under=$(COV_MIN)

test: lint
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --durations=15

cov: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup $(PYTEST_COV)

# test-all: the slow tests too, every property test's full hypothesis budget (tests/budget.py),
# under coverage
test-all: lint
	EINJOIN_HYPOTHESIS=full $(BIN)/python -m pytest -q -n 2 --dist loadgroup -m '' --durations=15 $(PYTEST_COV)

tour: $(STAMP)
	$(BIN)/python examples/tour.py

bench: $(BSTAMP)
	@ls bench/*.py >/dev/null 2>&1 && for f in bench/*.py; do echo "== $$f"; $(BIN)/python $$f || exit 1; done || echo "no benchmarks yet"

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis .mypy_cache .ruff_cache .coverage .coverage.*

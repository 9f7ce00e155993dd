# replyd — two commands do everything on a fresh machine:
#   make run    the demo on the embedded default (SQLite + the simulated platform)
#   make test   every test (creates .venv, installs Python and npm dependencies)

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
BSKY   := tests/bsky

RUNS ?= 20
SEED ?= 1
JOBS ?= 1
# pytest-xdist workers for `make test`: more than the 2 cores, as the slow tests mostly sleep; 4 overloaded (README, Tests).
TEST_WORKERS ?= 3
PYTEST_XDIST := -n $(TEST_WORKERS) --dist loadgroup

.PHONY: install install-bench run test test-fast bsky-deps bench chaos clean

# The runtime only (what `make run` needs): no test extras, no -q (pip's lines are the progress).
$(VENV)/.installed-runtime: pyproject.toml
	@echo "make: creating $(VENV) with replyd's runtime dependencies only (the test extras come with make install/test)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -e .
	touch $@

$(VENV)/.installed: $(VENV)/.installed-runtime
	@echo "make: installing the test extras into $(VENV)"
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	touch $@

install: $(VENV)/.installed

# The Bluesky reference network (@atproto/dev-env) for the Bluesky tests.
$(BSKY)/node_modules/.installed: $(BSKY)/package.json $(BSKY)/package-lock.json
	cd $(BSKY) && npm ci --no-audit --no-fund && npm rebuild better-sqlite3
	touch $@

bsky-deps: $(if $(wildcard $(BSKY)/package-lock.json),$(BSKY)/node_modules/.installed)

run: $(VENV)/.installed-runtime
	$(VENV)/bin/replyd demo

test: install bsky-deps
	$(PY) -m pytest -q $(PYTEST_XDIST)

test-fast: install
	$(PY) -m pytest -q $(PYTEST_XDIST) -m "not slow"

$(VENV)/.installed-bench: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $@

install-bench: $(VENV)/.installed-bench

# Costs side by side (writes docs/BENCHMARKS.md); ROWS_MAX=10000000 adds the 10^7 growth row.
bench: install-bench
	$(PY) bench/run.py $(if $(ROWS_MAX),--rows-max $(ROWS_MAX))

# Randomised fault runs of the daemon against the sim; last line is the totals JSON. JOBS=N runs N at once.
chaos: install
	$(PY) -m chaos --runs $(RUNS) --seed $(SEED) --jobs $(JOBS)

clean:
	rm -rf $(VENV) $(BSKY)/node_modules .pytest_cache

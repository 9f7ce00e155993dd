# replyd — two commands do everything on a fresh machine:
#   make run    the demo on the embedded default (SQLite + the simulated platform)
#   make test   every test (creates .venv, installs Python and npm dependencies)
#   make ts-client  the TypeScript client (clients/typescript): npm ci, types check, build, tests
#   make agents-js  replyd's MCP server under LangGraph JS, the OpenAI Agents SDK and Mastra (clients/agents-js)
#   make hermes     hermes-agent's Telegram adapter through replyd (tests/test_hermes.py, in its own venv)
#   make openclaw   openclaw's reconcileUnknownSend and final sends through replyd, on the Telegram fake (clients/openclaw)
#   make chat-sdk   Vercel's Chat SDK on a Telegram fake, naive and through replyd (clients/chat-sdk)

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
BSKY   := tests/bsky
TS     := clients/typescript
AGENTS_JS := clients/agents-js
# hermes-agent pins openai 2.x, websockets 15, pydantic 2.13...: older than the test extras', so its own venv.
HERMES_VENV ?= .venv-hermes
HERMES_VERSION ?= 0.19.0
OPENCLAW := clients/openclaw
CHAT_SDK := clients/chat-sdk

RUNS ?= 20
SEED ?= 1
JOBS ?= 1
# pytest-xdist workers for `make test`: more than the 2 cores, as the slow tests mostly sleep; 4 overloaded (README, Tests).
TEST_WORKERS ?= 3
PYTEST_XDIST := -n $(TEST_WORKERS) --dist loadgroup

.PHONY: install install-bench run test test-fast lint examples bsky-deps bench chaos clean ts-client ts-openapi agents-js hermes openclaw chat-sdk

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
	$(PY) -m pytest -q --durations=25 $(PYTEST_XDIST)

test-fast: install
	$(PY) -m pytest -q $(PYTEST_XDIST) -m "not slow"

# ruff on the whole tree, mypy strict on the core modules (both configured in pyproject.toml).
lint: install
	$(PY) -m ruff check . && $(PY) -m mypy

# Every runnable example of README.md and docs/*.md, as written, from outside the checkout (about a minute).
examples: install
	$(PY) tools/doc_examples.py

# The TypeScript client against a real `replyd run` on the sim: types up to date, build, node --test.
ts-client: $(VENV)/.installed-runtime
	cd $(TS) && npm ci --no-audit --no-fund
	cd $(TS) && npm run generate:check
	cd $(TS) && REPLYD_PYTHON=$(abspath $(PY)) npm test

# The JS agent SDKs over `replyd mcp` (stdio) on the sim: a re-run posting step replies once (node --test).
# It needs the mcp extra, which the test extras include.
agents-js: install
	cd $(AGENTS_JS) && npm ci --no-audit --no-fund
	cd $(AGENTS_JS) && REPLYD_PYTHON=$(abspath $(PY)) npm test

# hermes-agent's real Telegram adapter against the Bot API fake, naive and through replyd.integrations.hermes.
$(HERMES_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(HERMES_VENV)
	$(HERMES_VENV)/bin/python -m pip install -q --disable-pip-version-check -e . \
	  'hermes-agent[messaging]==$(HERMES_VERSION)' 'pytest>=8,<9.2' 'pytest-timeout>=2.3,<3'
	touch $@

hermes: $(HERMES_VENV)/.installed
	REPLYD_HERMES_REQUIRED=1 $(HERMES_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/test_hermes.py tests/test_hermes_discord.py

# openclaw's channel hooks (clients/openclaw) against a real `replyd run` on the Telegram Bot API fake (node --test).
# openclaw is a devDependency for its published types only: it runs on Node 24.16+, not here (docs/INTEGRATIONS.md).
openclaw: $(VENV)/.installed-runtime
	cd $(TS) && npm ci --no-audit --no-fund && npm run build
	cd $(OPENCLAW) && npm ci --no-audit --no-fund
	cd $(OPENCLAW) && REPLYD_PYTHON=$(abspath $(PY)) npm test

# Vercel's Chat SDK (chat + @chat-adapter/telegram) on replyd's Telegram fake: naive posts twice under the SDK's
# retries and redeliveries; through @replyd/client (built from $(TS)) once, a lost answer `unconfirmed` (node --test).
chat-sdk: $(VENV)/.installed-runtime
	cd $(TS) && npm ci --no-audit --no-fund && npm run build
	cd $(CHAT_SDK) && npm ci --no-audit --no-fund
	cd $(CHAT_SDK) && REPLYD_PYTHON=$(abspath $(PY)) npm test

# After an API change: rewrite the client's OpenAPI document and regenerate its types (commit both).
ts-openapi: $(VENV)/.installed-runtime
	$(PY) -c 'import json; from replyd.api.openapi import openapi_document; print(json.dumps(openapi_document(), indent=1))' > $(TS)/openapi.json
	cd $(TS) && npm run generate

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
	rm -rf $(VENV) $(HERMES_VENV) $(BSKY)/node_modules $(TS)/node_modules $(TS)/dist .pytest_cache

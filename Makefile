# kvpager: the two commands a newcomer needs are `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The whole package (torch-free core included) is type-checked with mypy on every test run.
MYPY_TARGETS := kvpager

.PHONY: install serve generate test lint system-deps
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,plot,zstd,remote,ray]'
	touch $@

serve: install
	$(BIN)/kvpager serve

generate: install
	$(BIN)/kvpager generate "And God said"

lint: install
	$(BIN)/ruff check kvpager tests scripts
	$(BIN)/ruff format --check kvpager tests scripts
	$(BIN)/mypy $(MYPY_TARGETS)

# Debian packages the tests use, installed when missing and we may (root with apt-get): chromium and
# chromium-driver for the /kv page's browser test (no browser download), a Redis-protocol server for
# the shared KV store tests. Without them those tests skip, saying why.
SYSTEM_PACKAGES := chromium chromium-driver redis-server
system-deps:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null && \
	    { command -v valkey-server >/dev/null || command -v redis-server >/dev/null; }; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(SYSTEM_PACKAGES); \
	else echo "note: missing some of $(SYSTEM_PACKAGES) (apt-get install -y $(SYSTEM_PACKAGES)); the browser and KV store tests will skip"; fi

test: lint system-deps
	$(BIN)/python -m pytest -q --durations=25

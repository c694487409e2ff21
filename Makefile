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

# A Redis-protocol server for the shared KV store tests (Debian: redis-server; valkey-server where packaged).
system-deps:
	@command -v valkey-server >/dev/null || command -v redis-server >/dev/null || \
	  { if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server; \
	    else echo "note: no valkey-server/redis-server; the shared KV store tests will be skipped (sudo apt-get install redis-server)"; fi; }

test: lint system-deps
	$(BIN)/python -m pytest -q

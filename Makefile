# kvpager: the two commands a newcomer needs are `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The whole package (torch-free core included) is type-checked with mypy on every test run.
MYPY_TARGETS := kvpager

.PHONY: install serve generate test lint browser-deps
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,plot,zstd]'
	touch $@

serve: install
	$(BIN)/kvpager serve

generate: install
	$(BIN)/kvpager generate "And God said"

lint: install
	$(BIN)/ruff check kvpager tests scripts
	$(BIN)/ruff format --check kvpager tests scripts
	$(BIN)/mypy $(MYPY_TARGETS)

# The /kv page's browser test drives Debian's chromium with chromium-driver (no browser download).
# Installed when missing and we may (root with apt-get); otherwise that one test skips, saying why.
browser-deps:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; \
	else echo "note: chromium + chromium-driver missing (apt-get install -y chromium chromium-driver); the /kv browser test will skip"; fi

test: lint browser-deps
	$(BIN)/python -m pytest -q

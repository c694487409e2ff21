# kvpager: the two commands a newcomer needs are `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The whole package (torch-free core included) is type-checked with mypy on every test run.
MYPY_TARGETS := kvpager

.PHONY: install serve generate test lint
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

test: lint
	$(BIN)/python -m pytest -q

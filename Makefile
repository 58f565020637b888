# One venv per checkout; `make test` installs it first, so a fresh clone needs only Python 3.10+.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup test test-slow lint demo clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements/constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade "pip>=24"
	$(BIN)/python -m pip install -q -c requirements/constraints.txt -e '.[dev]'
	touch $(STAMP)

test: setup
	$(BIN)/python -m pytest -q

test-slow: setup
	$(BIN)/python -m pytest -q -m slow

lint: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

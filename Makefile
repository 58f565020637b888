# One venv per checkout; `make test` installs it first, so a fresh clone needs only Python 3.10+.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LINKED := $(VENV)/.linked
# The editable install is setuptools' "strict" mode: a link tree under build/ where src/posttrain,
# flows/ and tasks/ form one package folder (posttrain, posttrain.flows, posttrain.tasks), which
# import-linter needs. A new module needs relinking (5 s): a new file changes its folder's mtime.
PACKAGE_DIRS := $(shell find src/posttrain flows tasks -type d -not -name __pycache__ 2>/dev/null)

.PHONY: setup postgres test test-quick test-slow lint demo mutation clean

setup: $(LINKED)

$(STAMP): pyproject.toml requirements/constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade "pip>=24"
	$(BIN)/python -m pip install -q -c requirements/constraints.txt -e '.[dev]' --config-settings editable_mode=strict
	touch $(STAMP)

$(LINKED): $(STAMP) $(PACKAGE_DIRS)
	$(BIN)/python -m pip install -q --no-deps -e . --config-settings editable_mode=strict
	touch $(LINKED)

# pytest-xdist workers; each takes whole test modules (--dist loadscope), so a module's fixtures (a
# trained tiny model, a store) are built once. TEST_WORKERS=0 runs in one process, =auto one per core.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadscope

test: setup postgres
	$(BIN)/python -m pytest -q $(XDIST)

# PostgreSQL's server for the system tests that run MLflow and Prefect on it (tests/servers.py):
# Debian's package, installed where it is missing and this user may (root, apt-get). Elsewhere those
# tests are skipped with the reason, except under CI, where they fail.
postgres:
	@command -v pg_ctl >/dev/null 2>&1 || command -v pg_ctlcluster >/dev/null 2>&1 || \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null; \
	else echo "PostgreSQL's server not found (Debian: sudo apt-get install postgresql)"; fi

test-quick: setup
	$(BIN)/python -m pytest -q $(XDIST) -m "not system"

test-slow: setup
	$(BIN)/python -m pytest -q -m slow

lint: setup
	$(BIN)/ruff check src flows tasks tests benchmarks tools
	$(BIN)/ruff format --check src flows tasks tests benchmarks tools
	$(BIN)/lint-imports

# The built-in SmolLM2 on real GSM8K, end to end on the CPU (docs/results/*-demo-*.md: what it gives and
# how long it takes). GSM8K's train and test splits are read from GSM8K_DIR, in the clone unless you
# say otherwise, and saved there from the hub first where missing. Without the hub, put a train.jsonl
# and a test.jsonl there yourself (docs/data.md: `posttrain data hold-out` makes a stand-in test split).
GSM8K_DIR ?= data/gsm8k
demo: setup
	$(BIN)/posttrain models pull smollm2-135m-instruct
	$(BIN)/posttrain data fetch gsm8k --dir $(GSM8K_DIR)
	$(BIN)/posttrain run configs/smollm2-gsm8k-cpu.yaml --set data.path=$(GSM8K_DIR)/train.jsonl \
		--set eval.extra_sets.0.path=$(GSM8K_DIR)/test.jsonl
	@echo
	@echo "MLflow UI:  $(BIN)/mlflow ui --backend-store-uri sqlite:///mlflow.db   then open http://127.0.0.1:5000"
	@echo "Prefect UI: PREFECT_HOME=.posttrain/prefect $(BIN)/prefect server start   then open http://127.0.0.1:4200"
	@echo "Compare runs: $(BIN)/posttrain compare --experiment smollm2-gsm8k-cpu"

# Mutation testing of the modules [tool.mutmut] in pyproject.toml names; hours on 2 cores, not in CI.
# MUTANTS narrows it to mutmut's name patterns (MUTANTS='posttrain.evaluation.*'). Prints the score per
# module; `.venv/bin/mutmut results` lists the surviving mutants.
MUTANTS ?=
mutation: setup
	$(BIN)/python -m pip install -q -c requirements/constraints.txt "mutmut==3.8.1"
	rm -rf mutants
	# mutmut imports posttrain from mutants/src; flows/ and tasks/ install as its subpackages. flows/ is
	# linked into src/posttrain for the run, so that mutmut names its mutants posttrain.flows.*.
	mkdir -p mutants/src/posttrain && cp -r flows mutants/src/posttrain/flows && cp -r tasks mutants/src/posttrain/tasks
	ln -sfn ../../flows src/posttrain/flows
	$(BIN)/mutmut run $(MUTANTS) > /dev/null || true; rm -f src/posttrain/flows
	$(BIN)/python tools/mutation_score.py

clean:
	rm -rf $(VENV) build mutants .pytest_cache .ruff_cache .import_linter_cache

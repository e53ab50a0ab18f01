# `make demo`: set up .venv, install, train the tiny default model on CPU (8 virtual devices, FSDP).
# `make test`: set up .venv with the dev extra and run the whole suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CPU_ENV := JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8

.PHONY: demo test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.base-installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e .
	touch $@

$(VENV)/.dev-installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@ $(VENV)/.base-installed

demo: $(VENV)/.base-installed
	rm -rf runs/demo
	$(CPU_ENV) $(BIN)/jaxmem train configs/tiny.yaml out_dir=runs/demo

# The cuDNN library in a side folder: the deviceless cuDNN-attention compile tests run in a subprocess that
# sees it (tests/test_kernels_cudnn.py); the rest of the suite plans without it. No download, no such tests.
CUDNN_SITE := .cache/cudnn-site

$(CUDNN_SITE)/.installed: | $(BIN)/python
	$(BIN)/python -m pip install --quiet --no-deps --target $(CUDNN_SITE) 'nvidia-cudnn-cu12>=9.8,<10' \
		&& touch $@ || echo "cuDNN wheel not installed: its deviceless compile tests will skip"

test: $(VENV)/.dev-installed $(CUDNN_SITE)/.installed
	JAXMEM_TEST_CUDNN_SITE=$(CUDNN_SITE) $(CPU_ENV) $(BIN)/python -m pytest -q -n 2 --dist worksteal --durations=15 tests

clean:
	rm -rf runs .pytest_cache

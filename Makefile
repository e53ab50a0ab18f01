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

test: $(VENV)/.dev-installed
	$(CPU_ENV) $(BIN)/python -m pytest -q -n 2 --dist worksteal --durations=15 tests

clean:
	rm -rf runs .pytest_cache

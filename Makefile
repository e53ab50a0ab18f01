# `make demo`: set up .venv, install, train the tiny default model on CPU (8 virtual devices, FSDP).
# `make test`: set up .venv with the dev extra and run the whole suite: the unit tier on one device (static and
# analytic tests, no multi-device program), then the integration tier on 8 virtual devices (meshes, deviceless
# compiles, training runs, subprocesses). `make test-unit`: the unit tier alone. `make test-fast`: both tiers
# without the tests marked `slow` (long training runs, multi-process and CLI runs, deviceless compiles of big
# models), a developer's inner loop; `make test` runs them all.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CPU_ENV := JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8

.PHONY: demo test test-unit test-integration test-fast test-latest clean

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
# sees it (tests/integration/test_kernels_cudnn.py); the rest of the suite plans without it. No download, no such tests.
CUDNN_SITE := .cache/cudnn-site

$(CUDNN_SITE)/.installed: | $(BIN)/python
	$(BIN)/python -m pip install --quiet --no-deps --target $(CUDNN_SITE) 'nvidia-cudnn-cu12>=9.8,<10' \
		&& touch $@ || echo "cuDNN wheel not installed: its deviceless compile tests will skip"

PYTEST := $(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

test: test-unit test-integration

# One device: a unit test that compiles a multi-device program fails here (tests/conftest.py, JAXMEM_TEST_DEVICES).
test-unit: $(VENV)/.dev-installed
	JAXMEM_TEST_DEVICES=1 JAX_PLATFORMS=cpu $(PYTEST) tests/unit

test-integration: $(VENV)/.dev-installed $(CUDNN_SITE)/.installed
	JAXMEM_TEST_CUDNN_SITE=$(CUDNN_SITE) $(CPU_ENV) $(PYTEST) --durations=15 tests/integration

test-fast: $(VENV)/.dev-installed $(CUDNN_SITE)/.installed
	JAXMEM_TEST_DEVICES=1 JAX_PLATFORMS=cpu $(PYTEST) -m "not slow" tests/unit
	JAXMEM_TEST_CUDNN_SITE=$(CUDNN_SITE) $(CPU_ENV) $(PYTEST) -m "not slow" --durations=15 tests/integration

# `make test-latest`: the compatibility subset on the newest jax pip resolves for Python 3.12 (jax 0.12 today),
# in its own venv, from source; skipped with one line where no `$(PYTHON_LATEST)` runs.
PYTHON_LATEST ?= python3.12
LATEST := .venv-latest
# What runs there and why: the internals shim, host offload, explain's HLO reading and the deviceless kernels
# (code on JAX internals); the update in the backward and the lean update against optax (another fusion order
# gives last-bit fp32 differences, which their tolerances allow); the remat presets' deviceless order (it caught
# the layers' gradients left fp32 on jax 0.12); a host-offload run's init; the optimizer state kinds (codes,
# stochastic rounding, host update, sharded steps); the fused host AdamW kernel, built against the users' jax's
# FFI headers, on one device. test_checkpoint is left out: on jax 0.12 one of its tests (restore onto another
# mesh) aborted in a loaded two-worker run, never alone; it runs in `make test` on the tested jax.
LATEST_ONE_DEVICE := tests/unit/test_host_adamw.py
LATEST_TESTS := tests/unit/test_compat.py tests/unit/test_shim.py tests/integration/test_offload.py tests/integration/test_explain.py \
	tests/unit/test_kernel_checks.py tests/unit/test_doctor.py tests/integration/test_update_in_backward.py \
	tests/integration/test_lean_update.py tests/integration/test_remat.py tests/integration/test_host_init.py \
	tests/unit/test_optim_codes.py tests/unit/test_optim_stochastic_round.py tests/unit/test_optim_host_update.py \
	tests/unit/test_optim_adamw_lowbit.py tests/integration/test_optim_sharded.py

$(LATEST)/.installed: pyproject.toml
	$(PYTHON_LATEST) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install --quiet --upgrade pip
	$(LATEST)/bin/python -m pip install --quiet -e '.[aot]' pytest pytest-xdist filelock zstandard
	touch $@

test-latest:
	@if ! $(PYTHON_LATEST) -c 'import sys' >/dev/null 2>&1; then \
		echo "test-latest: no $(PYTHON_LATEST) on this machine; skipped"; \
	elif ! $(MAKE) --no-print-directory $(LATEST)/.installed; then \
		echo "test-latest: could not install into $(LATEST) (no package index?); skipped"; \
	else \
		$(LATEST)/bin/python -c 'import jax; print("test-latest: jax", jax.__version__)' && \
		$(CPU_ENV) $(LATEST)/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder $(LATEST_TESTS) && \
		JAXMEM_TEST_DEVICES=1 JAX_PLATFORMS=cpu $(LATEST)/bin/python -m pytest -q $(LATEST_ONE_DEVICE); \
	fi

clean:
	rm -rf runs .pytest_cache

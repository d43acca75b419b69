# make test: set up .venv and run the CPU test suite (what CI runs).
# make demo: train the built-in GPT eagerly and with graphstep, side by side.
# make bench: every method side by side on the GPU (writes benchmarks/results/).
#
# Which torch: if $(PY) already imports torch >= 2.6 (a CUDA build on a GPU machine, a conda or venv
# Python), .venv uses that torch: a .pth file adds the site-packages folder holding it (as
# `venv --system-site-packages` would, and also when $(PY) is itself a venv). Nothing is installed over
# it. Otherwise .venv gets the pinned CPU build $(TORCH_CPU). `make clean` to start over.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_CPU ?= torch==2.13.0
# Optional frameworks, optimizer packages and config libraries the tests use (skipped
# when absent): `make test EXTRAS=test,demo` leaves them out.
EXTRAS ?= test,demo,optimizers,configs,lightning,huggingface,deepspeed
TORCH_OK := import sys, torch; sys.exit(tuple(int(v) for v in torch.__version__.split('+')[0].split('.')[:2]) < (2, 6))
TORCH_SITE := import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))
VENV_SITE := import sysconfig; print(sysconfig.get_path('purelib'))
TORCH_SAYS := import torch; print(f'make: torch {torch.__version__} ({\"CUDA \" + torch.version.cuda if torch.version.cuda else \"CPU build\"}) from {torch.__path__[0]}')

# Test processes in parallel (pytest-xdist): "auto" is one per CPU core.
TEST_WORKERS ?= auto

.PHONY: setup test demo bench lint gpu-check clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	@if $(PY) -c "$(TORCH_OK)" 2>/dev/null; then \
		site=$$($(PY) -c "$(TORCH_SITE)") && \
		echo "$$site" > "$$($(BIN)/python -c "$(VENV_SITE)")/graphstep_system_torch.pth" && \
		echo "make: .venv uses the torch of $(PY), in $$site"; \
	fi

# Install torch only when none is importable: a bare `pip install torch` would pull a multi-GB CUDA build.
# Set-up time (2 cores): pip byte-compiles what it installs one file at a time, about half of its
# time, so it installs with --no-compile and compileall does it on every core afterwards (graphstep's
# src too: every process the tests start imports it); and the C++
# guard helper (one core, ~30 s) builds in place while pip installs graphstep and its extras beside
# it (its build is skipped there: GRAPHSTEP_NO_EXTENSION). A helper already built is not rebuilt.
setup: $(BIN)/python
	@$(BIN)/python -c "$(TORCH_OK)" 2>/dev/null || $(BIN)/pip install -q --no-compile $(TORCH_CPU)
	@$(BIN)/python -c "$(TORCH_SAYS)"
	$(BIN)/pip install -q --no-compile "setuptools>=64" wheel
	@# The build sees the torch above and compiles src/graphstep/guards/_fastcheck.cpp (setup.py;
	@# skipped, with a message, where it cannot be built).
	@$(BIN)/python setup.py -q build_ext --inplace > $(VENV)/build_ext.log 2>&1 & build=$$!; \
	GRAPHSTEP_NO_EXTENSION=1 $(BIN)/pip install -q --no-compile --no-build-isolation -e ".[$(EXTRAS)]"; \
	installed=$$?; wait $$build; built=$$?; \
	grep -h "^graphstep:" $(VENV)/build_ext.log || true; \
	[ $$installed -eq 0 ] && [ $$built -eq 0 ] || { cat $(VENV)/build_ext.log; exit 1; }
	@$(BIN)/python -m compileall -q -j 0 "$$($(BIN)/python -c "$(VENV_SITE)")" src > /dev/null || true
	@$(BIN)/python -c "from graphstep.guards import fastcheck; print('make: guards read tensors ' + ('in C++' if fastcheck.helper() else 'from Python (no C++ helper)'))"

test: setup
	$(BIN)/python -m ruff check src tests examples
	@# The guards' tests run on both paths, the C++ helper's and the pure-Python fallback (tests/conftest.py).
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS)

demo: setup
	$(BIN)/graphstep demo

bench: setup
	$(BIN)/graphstep bench

lint: setup
	$(BIN)/python -m ruff check src tests examples
	$(BIN)/python -m ruff format --check src tests examples

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info src/graphstep/*.so src/graphstep/guards/*.so

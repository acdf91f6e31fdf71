# The two set-up commands (README): `make demo` and `make test`. Each creates and fills what it needs
# on first use: .venv (the current torch, for cpu and cuda: a few GB) for both, and for `make test`
# also .venv-xla (torch 2.9.0 + torch_xla 2.9.0, its last release, which needs that torch exactly).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
XLA_VENV := .venv-xla
XLA_STAMP := $(XLA_VENV)/.installed-stamp

.PHONY: demo test test-fast bench clean

# uv fetches and unpacks the few GB in parallel: about a third of pip's time. Each venv keeps
# pip for anyone who installs into it by hand. Bytecode is compiled at install (about 20 s): where
# PYTHONDONTWRITEBYTECODE is set, every process would otherwise compile torch's sources again on
# import (4.4 s instead of 1.9 s here), and the tests start a few hundred such processes.
# From an empty uv cache here: .venv 34 s, .venv-xla 54 s one after the other; 103 s for both with
# `make -j2` (they contend for the disk), so .ci/run fills them in turn.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip uv
	$(BIN)/uv pip install --quiet --compile-bytecode --python $(BIN)/python -e '.[dev]'
	touch $@

$(XLA_STAMP): pyproject.toml
	$(PYTHON) -m venv $(XLA_VENV)
	$(XLA_VENV)/bin/python -m pip install --quiet --upgrade pip uv
	$(XLA_VENV)/bin/uv pip install --quiet --compile-bytecode --python $(XLA_VENV)/bin/python -e '.[xla-dev]'
	touch $@

demo: $(STAMP)  ## train the tiny demo on CPU under the supervisor
	$(BIN)/tpud run configs/jobs/tiny-cpu.yaml --home .tpud

test: $(STAMP) $(XLA_STAMP)  ## the whole test suite (unit and xla-on-CPU side by side, then end-to-end)
	PYTHON=$(BIN)/python XLA_PYTHON=$(XLA_VENV)/bin/python bash tests/run_all.sh

test-fast: $(STAMP)  ## unit tests only
	$(BIN)/python -m pytest -m "not slow and not xla"

bench: $(STAMP)  ## the benchmarks under bench/, results in bench/results/
	$(BIN)/uv pip install --quiet --python $(BIN)/python -e '.[bench]'
	$(BIN)/python bench/train_overhead.py
	$(BIN)/python bench/data.py

clean:
	rm -rf $(VENV) $(XLA_VENV) .tpud .pytest_cache

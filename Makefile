# The two set-up commands (README): `make demo` and `make test`. Each creates and fills the
# virtual environment .venv on first use (torch 2.9.0 + torch_xla 2.9.0: a few GB).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test test-fast bench clean

# uv fetches and unpacks the few GB in parallel: about a third of pip's time. The venv keeps
# pip for anyone who installs into it by hand. Bytecode is compiled at install (about 20 s): where
# PYTHONDONTWRITEBYTECODE is set, every process would otherwise compile torch's sources again on
# import (4.4 s instead of 1.9 s here), and the tests start a few hundred such processes.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip uv
	$(BIN)/uv pip install --quiet --compile-bytecode --python $(BIN)/python -e '.[dev]'
	touch $@

demo: $(STAMP)  ## train the tiny demo on CPU under the supervisor
	$(BIN)/tpud run configs/jobs/tiny-cpu.yaml --home .tpud

test: $(STAMP)  ## the whole test suite (unit and xla-on-CPU side by side, then end-to-end)
	PYTHON=$(BIN)/python bash tests/run_all.sh

test-fast: $(STAMP)  ## unit tests only
	$(BIN)/python -m pytest -m "not slow and not xla"

bench: $(STAMP)  ## the benchmarks under bench/, results in bench/results/
	$(BIN)/uv pip install --quiet --python $(BIN)/python -e '.[bench]'
	$(BIN)/python bench/train_overhead.py
	$(BIN)/python bench/data.py

clean:
	rm -rf $(VENV) .tpud .pytest_cache

# Two entry points: `make demo` (the GPT-2 speedrun recipe on the built-in offline corpus) and
# `make test` (the CPU test suite). Each creates .venv and installs what it needs on first use.
# TORCH picks the torch build: the default pin is the CPU wheel; on a GPU machine use e.g. `make demo TORCH=torch`.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
PYTEST_ARGS ?= -q

.PHONY: demo test lint

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/lightning-opt-gpt2 --config gpt2/demo

test: $(VENV)/.installed
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check lightning_opt tests benchmarks

# Two entry points: `make demo` (the GPT-2 speedrun recipe on the built-in offline corpus) and
# `make test` (the CPU test suite). Each creates .venv and installs what it needs on first use.
# TORCH picks the torch build and TORCH_INDEX an extra index pip may take it from. The default is the CPU build:
# pip looks at PyTorch's CPU wheel index next to PyPI, finds torch 2.13.0+cpu there and prefers it (a local
# version label ranks above PyPI's plain 2.13.0, which on Linux is the CUDA build). Where that index cannot be
# reached (a machine that sees only a PyPI mirror; checked once, 10 s at most) pip takes what its own
# configuration offers: a wheel folder or mirror holding 2.13.0+cpu (e.g. find-links in pip.conf), else PyPI's
# CUDA build, which also runs on a CPU. On a GPU machine: `make demo TORCH=torch TORCH_INDEX=`.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
PYTEST_ARGS ?= -q

.PHONY: demo test lint

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	@if [ -n "$(TORCH_INDEX)" ] && $(PY) -c "import urllib.request as u; u.urlopen('$(TORCH_INDEX)/', timeout=10)" 2>/dev/null; then \
		echo "$(PY) -m pip install -q $(TORCH) --extra-index-url $(TORCH_INDEX)"; \
		$(PY) -m pip install -q "$(TORCH)" --extra-index-url "$(TORCH_INDEX)"; \
	else \
		echo "$(TORCH_INDEX) not reachable: $(TORCH) from pip's own indexes"; \
		$(PY) -m pip install -q "$(TORCH)"; \
	fi
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/lightning-opt-gpt2 --config gpt2/demo

test: $(VENV)/.installed
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check lightning_opt tests benchmarks

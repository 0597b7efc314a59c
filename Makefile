# octlm: every target installs into .venv first when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed

.PHONY: install test lint format generate bench fixtures clean

install: $(STAMP)

# torch is installed on its own first so pip takes the pinned CPU wheel instead of resolving a
# multi-GB CUDA build; an environment that already has torch (Kaggle, Colab) keeps its own.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

fixtures: $(STAMP)
	bash tests/fetch_fixtures.sh

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(STAMP)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

test: lint fixtures
	$(PY) -m pytest

PROMPT ?= Give me a short introduction to large language models.

generate: $(STAMP)
	$(PY) scripts/generate.py model=qwen3 prompt="$(PROMPT)" $(ARGS)

bench: $(STAMP)
	$(PY) scripts/bench.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache outputs

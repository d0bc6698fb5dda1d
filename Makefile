# The README's two commands. Both create .venv on first use (pip takes torch from the local cache if present).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: run test lint bench docs docs-serve

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[dev,flower,docs,medical,sweep,clinical]"
	touch $@

run: $(BIN)/.installed  ## install, then train FedAvg on the embedded digits
	$(BIN)/python train.py --config configs/fedavg_digits.yaml

test: $(BIN)/.installed  ## install, then run the test suite
	$(BIN)/python -m pytest -q

lint: $(BIN)/.installed
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

bench: $(BIN)/.installed  ## the overhead benchmark (Federation vs a plain PyTorch loop)
	$(BIN)/python benchmarks/overhead.py

docs: $(BIN)/.installed  ## build the docs site into site/ (strict: a broken link or a missing API name fails)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-serve: $(BIN)/.installed  ## serve the docs site at http://127.0.0.1:8000, rebuilt on every change
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

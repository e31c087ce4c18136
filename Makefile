# Two commands matter: `make test` and `make serve`. Both build .venv on first use.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test serve lint bench clean-venv

$(BIN)/python:
	$(PY) -m venv $(VENV) || python3 -m venv $(VENV)

# torch first and pinned: an unpinned torch drags in a multi-GB CUDA build.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

serve: $(STAMP)
	$(BIN)/dualread serve

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python -m models.bench

clean-venv:
	rm -rf $(VENV)

# phalanx developer commands. `make test` is what CI runs (via .ci/run).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: venv lint typecheck unit test crd clean

$(BIN)/phalanx: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

venv: $(BIN)/phalanx

crd: venv  ## regenerate crds/ and docs/api.md from the API models
	$(BIN)/phalanx crd
	$(BIN)/phalanx docs

lint: venv
	$(BIN)/ruff check operator tests
	$(BIN)/ruff format --check operator tests

typecheck: venv
	$(BIN)/mypy

unit: venv
	$(BIN)/pytest tests/unit

test: lint typecheck  ## everything CI runs
	$(BIN)/pytest tests

clean:
	rm -rf $(VENV) build dist .mypy_cache .ruff_cache .pytest_cache .hypothesis

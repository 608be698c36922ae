"""End to end on the GPU: the product, not a harness. A real redis-server, a real ``ocrq worker``
(Celery, threads pool, ``engine: transformers``, ``batch: auto`` with a 24 GiB
``memory_cap_bytes``) and the producer client; the bench/gpu_governor.py workload (120× 1024×768,
60× 2048×1536, 20× 600×400, 256 new tokens) written as distinct JPEG files.

Two jobs of 200 distinct images each (distinct bytes, so the content cache cannot answer):
``cold`` on the first worker's first start, then the worker is stopped (SIGTERM) and a new one
starts on the same Redis: ``warm``, whose governor restores the snapshot the first one saved.
Each job is timed from submit to the last image stored; the result is one JSON document.

    python3 -m bench.gpu_worker --out OUT/gpu_worker.json             # on the GPU
    python3 -m bench.gpu_worker --simulated 0.5 --out sim.json        # CPU: simulated 24 GiB engine
    python3 -m bench.gpu_worker --size tiny --images 12 --scale 0.25 --tokens 16 --out x.json  # dry run

Report: docs/bench/gpu-worker.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from bench.services import Spy, free_port, start_redis, start_worker, stop
from ocrq import keys

GIB = 2**30


def _write(args: tuple[Path, int, int, int, int]) -> None:
    """One distinct noise image (a scan-like JPEG; pixels do not change the cost)."""
    import numpy as np
    from PIL import Image

    path, w, h, seed, quality = args
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(path, quality=quality)


def write_workload(root: Path, n: int, seed: int, tag: str, scale: float, offset: int | None = None) -> Path:
    """``n`` distinct JPEGs in ``root/tag``; ``offset`` keeps sets of one seed apart (default: by tag)."""
    from bench.gpu_governor import _images

    sizes = [im.size for im in _images(n, seed)]  # the benchmark's order, image for image
    out = root / tag
    shutil.rmtree(out, ignore_errors=True)  # a folder left by a larger run would add its files to the job
    out.mkdir(parents=True)
    base = seed * 1_000_000 + (offset if offset is not None else 0 if tag == "cold" else 500_000)
    jobs = [(out / f"{i:04d}.jpg", max(32, int(w * scale)), max(32, int(h * scale)), base + i, 90)
            for i, (w, h) in enumerate(sizes)]
    with ProcessPoolExecutor(min(16, os.cpu_count() or 1)) as pool:
        list(pool.map(_write, jobs))
    return out


def run_job(settings: Any, folder: Path, job: str, redis_url: str, worker: str, new_tokens: int,
            priority: int | None = None) -> dict[str, Any]:
    import redis

    from producer.client import Client

    client = Client(settings)
    t0 = time.perf_counter()
    handle = client.submit([str(folder)], job=job, priority=priority)
    counts = handle.wait(timeout=900, poll=0.2)
    elapsed = time.perf_counter() - t0
    records = list(handle.records())
    results = list(handle.results())
    tokens = [o.meta.get("generated_tokens") for r in results for o in r.outputs]
    # each engine call, in the order it ran (ids are "{loop}-{seq}"): its size and its seconds
    # (every image's engine_s is the call's seconds / its size)
    calls: dict[str, tuple[int, float]] = {}
    for rec in records:
        if rec.batch and rec.batch_size:
            calls[rec.batch] = (rec.batch_size, (rec.engine_s or 0.0) * rec.batch_size)
    order = sorted(calls, key=lambda b: int(b.rsplit("-", 1)[1]))
    busy = sum(seconds for _, seconds in calls.values())
    time.sleep(1.5)  # the worker publishes its state once a second
    node = f"{worker}@{socket.gethostname()}"
    state = json.loads(redis.Redis.from_url(redis_url).get(keys.worker_state(node)) or "{}")
    done = counts.get("done", 0)
    return {
        "job": job, "images": len(records), "done": done, "failed": counts.get("failed", 0),
        "cached": counts.get("cached", 0), "elapsed_s": round(elapsed, 2), "img_per_s": round(done / elapsed, 3),
        "all_full_length": bool(tokens) and all(t == new_tokens for t in tokens),
        "batch_sizes": [calls[b][0] for b in order],
        "engine_busy_s": round(busy, 2), "engine_idle_s": round(elapsed - busy, 2),
        "worker_state": {k: state.get(k) for k in (
            "batches", "images", "oom_events", "oom_count", "failed", "max_measured_peak_bytes", "budget_bytes",
            "capacity_bytes", "calibration_error", "observations", "restored_observations", "count_limit",
            "slow_start", "bytes_per_token", "base_bytes", "margin", "prefetch", "token_capacity",
            "kv_usage", "preemptions", "pressure_count", "batch_size", "idle_s", "engine", "gc")},
        "max_measured_peak_gb": round((state.get("max_measured_peak_bytes") or 0) / GIB, 2),
    }


def in_process_simulated(folder: Path, extra: dict[str, Any], tokens: int, cap_gb: float,
                         snapshot: dict[str, Any] | None = None) -> dict[str, Any]:
    """The CPU stand-in for ``bench/gpu_governor.py runs --governor``: the same simulated engine
    and governor as the worker, driven in-process with every image decoded and submitted at once."""
    from PIL import Image

    from ocrq.engine_settings import SimulatedSettings
    from ocrq.settings import BatchSettings
    from worker.context import governor_for
    from worker.engines.base import OcrRequest
    from worker.engines.simulated import SimulatedEngine
    from worker.loop.engine_loop import EngineLoop

    engine = SimulatedEngine.from_settings(SimulatedSettings(kind="simulated", max_new_tokens=tokens, extra=extra))
    governor = governor_for(BatchSettings(mode="auto", max_size=128, memory_cap_bytes=int(cap_gb * GIB)),
                            engine, None)
    if snapshot is not None:
        governor.restore(json.loads(json.dumps(snapshot)))
    reqs = []
    for path in sorted(folder.iterdir()):
        with Image.open(path) as im:
            reqs.append(OcrRequest(key=path.name, image=im.convert("RGB"), task="text"))
    loop = EngineLoop(engine, governor, None, linger_s=0.02)
    t0 = time.perf_counter()
    loop.start()
    done = sum(f.exception() is None for f in loop.submit_many(reqs))
    elapsed = time.perf_counter() - t0
    loop.stop()
    return {"job": f"in-process-{'warm' if snapshot else 'cold'}", "done": done, "elapsed_s": round(elapsed, 2),
            "img_per_s": round(done / elapsed, 3), "batch_sizes": [len(b) for b in engine.batches],
            "snapshot": governor.snapshot()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--size", default="full", choices=["full", "tiny"])
    ap.add_argument("--images", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--cap-gb", type=float, default=24.0)
    ap.add_argument("--scale", type=float, default=1.0, help="shrink the images (CPU dry runs)")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--work", type=Path, default=Path("/tmp/ocrq-gpu-worker"))
    ap.add_argument("--simulated", type=float, default=None, metavar="BATCH_S",
                    help="CPU stand-in: the simulated engine (24 GiB model, each batch takes BATCH_S)")
    ap.add_argument("--sim-padded", action="store_true",
                    help="with --simulated: a batch costs n × its longest page, as the transformers engine's")
    ap.add_argument("--sim-image-s", type=float, default=0.0, metavar="S",
                    help="with --simulated: S more seconds per image in a batch (a GPU-like t(n) = BATCH_S + S·n)")
    ap.add_argument("--spy", type=Path, default=None, metavar="DIR",
                    help="py-spy records the warm worker during its job (DIR/warm.gil.txt: the thread holding "
                         "the GIL; DIR/warm.all.txt: every thread, idle ones too), raw collapsed stacks")
    args = ap.parse_args()

    from ocrq.settings import Settings
    from worker.checkpoint import make_random_checkpoint

    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    # the store keeps the durable result cache: a rerun in the same folder would read it back
    shutil.rmtree(work / "store", ignore_errors=True)
    model = work / f"hunyuan-{args.size}"
    if args.simulated is None and not (model / "config.json").exists():
        import torch

        make_random_checkpoint(model, args.size, seed=0, device="cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    folders = {tag: write_workload(work, args.images, args.seed, tag, args.scale) for tag in ("cold", "warm")}
    print(f"workload written in {time.perf_counter() - t0:.1f}s", flush=True)

    port = free_port()
    redis_url = f"redis://127.0.0.1:{port}/0"
    redis_proc = start_redis(port, work)
    env = {**os.environ, "OCRQ_REDIS__URL": redis_url, "OCRQ_STORE__PATH": str(work / "store"),
           "OCRQ_LIMITS__ALLOWED_ROOTS": json.dumps([str(work)]),
           "OCRQ_ENGINE__KIND": "transformers", "OCRQ_ENGINE__MODEL_DIR": str(model),
           "OCRQ_ENGINE__MAX_NEW_TOKENS": str(args.tokens), "OCRQ_ENGINE__REPETITION_STOP": "0",
           "OCRQ_ENGINE__EXTRA": json.dumps({"ignore_eos": True}),
           "OCRQ_BATCH__MODE": "auto", "OCRQ_BATCH__MAX_SIZE": "128",
           "OCRQ_BATCH__MEMORY_CAP_BYTES": str(int(args.cap_gb * GIB)),
           "OCRQ_QUEUE__CHUNK_SIZE": "32"}
    sim_extra = {"batch_latency_s": args.simulated, "image_latency_s": args.sim_image_s,
                 "output_tokens": args.tokens, "padded": args.sim_padded}
    if args.simulated is not None:
        env.update({"OCRQ_ENGINE__KIND": "simulated", "OCRQ_ENGINE__EXTRA": json.dumps(sim_extra)})
    settings = Settings(redis={"url": redis_url}, store={"kind": "local", "path": work / "store"},
                        limits={"allowed_roots": [work]}, queue={"chunk_size": 32})
    result: dict[str, Any] = {"size": args.size, "images": args.images, "cap_gb": args.cap_gb,
                              "new_tokens": args.tokens, "jobs": []}
    try:
        for name, tag in (("w1", "cold"), ("w2", "warm")):
            t0 = time.perf_counter()
            proc = start_worker(env, name, work / f"worker-{name}.log", redis_url, timeout=300)
            started = time.perf_counter() - t0
            spy = {f"{tag}.gil": (proc.pid, ["--gil"]), f"{tag}.all": (proc.pid, ["--idle"])}
            with Spy(args.spy if tag == "warm" else None, spy, rate=100):
                job = run_job(settings, folders[tag], f"gpu-{tag}", redis_url, name, args.tokens)
            job.update({"start": tag, "worker_ready_s": round(started, 1)})
            result["jobs"].append(job)
            print(json.dumps(job), flush=True)
            args.out.write_text(json.dumps(result, indent=2))
            stop(proc)
    finally:
        redis_proc.terminate()
    if args.simulated is not None:
        # the same engine and governor in-process (cold, then warm from the cold one's snapshot)
        cold = in_process_simulated(folders["cold"], sim_extra, args.tokens, args.cap_gb)
        warm = in_process_simulated(folders["warm"], sim_extra, args.tokens, args.cap_gb, cold.pop("snapshot"))
        warm.pop("snapshot")
        result["in_process"] = [cold, warm]
        result["warm_ratio"] = round(result["jobs"][-1]["img_per_s"] / warm["img_per_s"], 3)
        print(json.dumps({"in_process": result["in_process"], "warm_ratio": result["warm_ratio"]}), flush=True)
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

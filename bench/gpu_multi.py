"""Two GPUs on one host: does a second GPU worker on the same Redis double the throughput?

The product end to end, as bench/gpu_worker.py runs it, with the docs/bench/gpu-governor.md
workload doubled: 400 distinct JPEGs (the same size mix: 60% 1024×768, 30% 2048×1536,
10% 600×400), 256 new tokens each, ``batch: auto`` with a 24 GiB ``memory_cap_bytes`` per GPU.
The workers are the ones ``ocrq up --gpus 0,1`` plans (ocrq.gpus: CUDA_VISIBLE_DEVICES = the
GPU's UUID, node ``gpu{i}@host``, metrics port per GPU), all on one redis-server, fed by the
producer client.

1. ``gpu0`` alone: a warm-up job (100 images, not timed: the governor's slow start), then the
   timed ``one`` job (400 images).
2. ``gpu0`` stops; ``gpu0`` and ``gpu1`` start together and restore the governor snapshot the
   first one saved (identical GPUs share it, docs/gpu.md); once both are ready, the timed ``two``
   job (400 other images, the same sizes in the same order).

Each job is timed from submit to its last image stored. Result (``--out``):
``{"one_gpu_img_s", "two_gpu_img_s", "scaling", "failed", "per_worker_images": [gpu0, gpu1], ...}``
with the details of both jobs. Targets: scaling ≥ 1.9, 0 failed, neither worker above
60% of the images.

    python3 -m bench.gpu_multi --out OUT/gpu-multi.json                   # a host with 2 GPUs
    python3 -m bench.gpu_multi --simulated 0.84 --out sim.json            # CPU: simulated engine

Report: docs/bench/gpu-multi.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.gpu_worker import GIB, write_workload
from bench.services import free_port, start_redis, start_worker, stop
from ocrq import keys
from ocrq_cli.embedded.gpus import Gpu, WorkerPlan, list_gpus, plan_gpu_workers, select_gpus

STATE_FIELDS = ("batches", "images", "oom_events", "failed", "max_measured_peak_bytes", "budget_bytes",
                "capacity_bytes", "calibration_error", "observations", "restored_observations", "count_limit",
                "prefetch")


def timed_job(settings: Any, folder: Path, job: str, redis_url: str, nodes: list[str]) -> dict[str, Any]:
    """Submit ``folder`` as ``job``, wait for every image, and say who did what."""
    import redis

    from producer.client import Client

    client = Client(settings)
    t0 = time.perf_counter()
    handle = client.submit([str(folder)], job=job)
    counts = handle.wait(timeout=1800, poll=0.2)
    elapsed = time.perf_counter() - t0
    records = list(handle.records())
    per_worker = {node: 0 for node in nodes}
    batches: dict[str, set[int]] = {node: set() for node in nodes}
    for result in handle.results():
        node = result.record.worker or "?"
        per_worker[node] = per_worker.get(node, 0) + 1
        batches.setdefault(node, set()).update(o.meta["batch_size"] for o in result.outputs if o.meta.get("batch_size"))
    time.sleep(1.5)  # workers publish their state once a second
    client_redis = redis.Redis.from_url(redis_url)
    states = {}
    for node in nodes:
        state = json.loads(client_redis.get(keys.worker_state(node)) or "{}")
        states[node] = {k: state.get(k) for k in STATE_FIELDS}
    done = counts.get("done", 0)
    return {
        "job": job, "images": len(records), "done": done, "failed": counts.get("failed", 0),
        "cached": counts.get("cached", 0), "elapsed_s": round(elapsed, 2), "img_per_s": round(done / elapsed, 3),
        "per_worker_images": per_worker,
        "batch_sizes": {node: sorted(sizes, reverse=True) for node, sizes in batches.items()},
        "worker_state": states,
    }


def start_workers(env: dict[str, str], plans: list[WorkerPlan], work: Path, redis_url: str) -> list[Any]:
    """Start the planned workers at once (model loads overlap) and return once all are ready."""
    def one(plan: WorkerPlan) -> Any:
        name = plan.node.split("@")[0]
        return start_worker({**env, **plan.env}, name, work / f"worker-{name}.log", redis_url, timeout=600,
                            concurrency=int(env["OCRQ_QUEUE__CONCURRENCY"]))

    with ThreadPoolExecutor(len(plans)) as pool:
        return list(pool.map(one, plans))


def gpus_for(simulated: bool) -> list[Gpu]:
    if simulated:  # CPU dry run: the device names only reach CUDA_VISIBLE_DEVICES, which nothing reads
        return [Gpu(0, "0", "simulated"), Gpu(1, "1", "simulated")]
    return select_gpus("0,1", list_gpus())


def summary(one: dict[str, Any], two: dict[str, Any], nodes: list[str]) -> dict[str, Any]:
    per_worker = [two["per_worker_images"].get(node, 0) for node in nodes]
    scaling = round(two["img_per_s"] / one["img_per_s"], 3) if one["img_per_s"] else 0.0
    failed = one["failed"] + two["failed"]
    share = max(per_worker) / max(1, sum(per_worker))
    return {
        "one_gpu_img_s": one["img_per_s"], "two_gpu_img_s": two["img_per_s"], "scaling": scaling,
        "failed": failed, "per_worker_images": per_worker,
        "targets": {"scaling_ge_1_9": scaling >= 1.9, "no_failed": failed == 0, "max_share_le_0_6": share <= 0.6},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--size", default="full", choices=["full", "tiny"])
    ap.add_argument("--images", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=100, help="images of the untimed warm-up job on gpu0")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--cap-gb", type=float, default=24.0, help="memory budget per GPU")
    ap.add_argument("--scale", type=float, default=1.0, help="shrink the images (CPU dry runs)")
    ap.add_argument("--tokens", type=int, default=256)
    # 8-image chunks: the queue splits 400 images into 50 messages, so two workers can get 25 each
    # (with 32, 13 messages split 7/6 at best: 56% to one GPU caps scaling at 1.79). 32 chunk threads
    # let one worker still hold 256 images, the single-GPU bench's window (8 × 32).
    ap.add_argument("--chunk", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--work", type=Path, default=Path("/tmp/ocrq-gpu-multi"))
    ap.add_argument("--simulated", type=float, default=None, metavar="BATCH_S",
                    help="CPU stand-in: the simulated engine (24 GiB model); a batch of n images takes "
                         "BATCH_S + n × --image-s seconds")
    # 0.84 s + 0.080 s per image fits the H200's static batches of 8, 16 and 32 in gpu-governor.md
    # (1.48, 1.98, 3.40 s per batch); a time per batch alone would make one worker's bigger batches
    # free and understate what a second GPU adds
    ap.add_argument("--image-s", type=float, default=0.08, help="simulated seconds per image of a batch")
    args = ap.parse_args()

    from ocrq.settings import Settings
    from worker.checkpoint import make_random_checkpoint

    simulated = args.simulated is not None
    try:
        gpus = gpus_for(simulated)  # before anything else: a host without two GPUs stops here
    except ValueError as exc:
        raise SystemExit(f"bench.gpu_multi needs GPUs 0 and 1 (or --simulated): {exc}") from exc
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work / "store", ignore_errors=True)  # a previous run's results would be cache hits
    model = work / f"hunyuan-{args.size}"
    if not simulated and not (model / "config.json").exists():
        make_random_checkpoint(model, args.size, seed=0, device="cuda")
    t0 = time.perf_counter()
    folders = {tag: write_workload(work, n, args.seed, tag, args.scale, offset=offset)
               for tag, n, offset in (("warmup", args.warmup, 0), ("one", args.images, 100_000),
                                      ("two", args.images, 200_000))}
    print(f"workload written in {time.perf_counter() - t0:.1f}s", flush=True)

    port = free_port()
    redis_url = f"redis://127.0.0.1:{port}/0"
    redis_proc = start_redis(port, work)
    engine: dict[str, Any] = {"kind": "transformers", "model_dir": str(model), "max_new_tokens": args.tokens,
                              "repetition_stop": 0, "extra": {"ignore_eos": True}}
    if simulated:
        engine = {"kind": "simulated", "max_new_tokens": args.tokens,
                  "extra": {"batch_latency_s": args.simulated, "image_latency_s": args.image_s,
                            "output_tokens": args.tokens}}
    settings = Settings(redis={"url": redis_url}, store={"kind": "local", "path": work / "store"},
                        limits={"allowed_roots": [work]}, engine=engine,
                        queue={"chunk_size": args.chunk, "concurrency": args.concurrency},
                        metrics_port=free_port(), metrics_addr="127.0.0.1")
    env = {**os.environ, "OCRQ_REDIS__URL": redis_url, "OCRQ_STORE__PATH": str(work / "store"),
           "OCRQ_LIMITS__ALLOWED_ROOTS": json.dumps([str(work)]),
           "OCRQ_ENGINE__KIND": engine["kind"], "OCRQ_ENGINE__MAX_NEW_TOKENS": str(args.tokens),
           "OCRQ_ENGINE__EXTRA": json.dumps(engine["extra"]), "OCRQ_ENGINE__REPETITION_STOP": "0",
           "OCRQ_BATCH__MODE": "auto", "OCRQ_BATCH__MAX_SIZE": "128",
           "OCRQ_BATCH__MEMORY_CAP_BYTES": str(int(args.cap_gb * GIB)),
           "OCRQ_QUEUE__CHUNK_SIZE": str(args.chunk), "OCRQ_QUEUE__CONCURRENCY": str(args.concurrency),
           "OCRQ_METRICS_ADDR": "127.0.0.1"}
    env.pop("OCRQ_CONFIG", None)
    if not simulated:
        env["OCRQ_ENGINE__MODEL_DIR"] = str(model)
    plans = plan_gpu_workers(settings, gpus, socket.gethostname())
    nodes = [p.node for p in plans]
    result: dict[str, Any] = {
        "simulated": simulated, "batch_latency_s": args.simulated, "image_latency_s": args.image_s if simulated
        else None, "size": args.size, "images": args.images,
        "cap_gb_per_gpu": args.cap_gb, "new_tokens": args.tokens, "chunk": args.chunk,
        "concurrency": args.concurrency, "scale": args.scale,
        "gpus": [{"index": g.index, "uuid": g.uuid, "name": g.name} for g in gpus], "jobs": [],
    }
    try:
        (first,) = start_workers(env, plans[:1], work, redis_url)
        warm = timed_job(settings, folders["warmup"], "multi-warmup", redis_url, nodes[:1])
        print(json.dumps(warm), flush=True)
        one = timed_job(settings, folders["one"], "multi-one", redis_url, nodes[:1])
        print(json.dumps(one), flush=True)
        stop(first)
        procs = start_workers(env, plans, work, redis_url)
        # each worker reads who else consumes the queue once a second (worker.prefetch): let both
        # see each other before the job lands, as in a running fleet
        time.sleep(2.5)
        try:
            two = timed_job(settings, folders["two"], "multi-two", redis_url, nodes)
            print(json.dumps(two), flush=True)
        finally:
            for proc in procs:
                stop(proc)
        result.update(summary(one, two, nodes))
        result["jobs"] = [warm, one, two]
    finally:
        redis_proc.terminate()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("one_gpu_img_s", "two_gpu_img_s", "scaling", "failed",
                                             "per_worker_images", "targets")}))


if __name__ == "__main__":
    main()

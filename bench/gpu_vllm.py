"""HunyuanOCR on vLLM: plain ``vllm.LLM`` (what a user would otherwise run) vs the ocrq worker
with ``engine: vllm`` / ``engine: vllm-server``, on the docs/bench/gpu-governor.md workload.

Workload: 200 distinct JPEGs (120× 1024×768, 60× 2048×1536, 20× 600×400 in the seed-1234 order of
bench/gpu_governor.py), exactly 256 new tokens each (EOS ignored, no loop stop), a 24 GiB budget
(``gpu_memory_utilization`` = budget / card). Distinct pixels per image, so vLLM's encoder cache
cannot reuse one image's embeddings for another. Each row is one process:

    python3 -m bench.gpu_vllm plain  --name vllm-seeds --max-num-seqs 8 --out DIR   # guides' 24 GB setting
    python3 -m bench.gpu_vllm plain  --name vllm-default --out DIR                  # vLLM's defaults
    python3 -m bench.gpu_vllm worker --name ocrq-vllm --out DIR                     # real worker, Redis, producer
    python3 -m bench.gpu_vllm worker --name ocrq-vllm-server --server --out DIR     # worker + one `vllm serve`
    python3 -m bench.gpu_vllm report --dirs DIR... --transformers gpu_worker.json   # docs/bench/gpu-vllm.*
    # CPU dry run: --size tiny --scale 0.25 --images 12 --tokens 16

``vllm-seeds`` is ``max_num_seqs 8``, the setting that public HunyuanOCR deployment guides recommend for
24 GB cards.

Every row runs three sets of 200 distinct pages on one built engine: the second (warm) set is the
row's img/s, the first is kept as ``first_img_per_s``, and in the third a small job joins the large
one (below), so that its time to first result is measured apart from the throughput. Plain rows
drive ``LLMEngine`` with the chat template's text whose image start/image/end trio is replaced by
the bare image token (the workaround for vLLM 0.26's double image-start, docs/gpu.md) and the ocrq
plugin's fixes switched off: no ocrq code runs there. In the third set, after ``--small-after``
seconds a small job (``--small`` images) joins the large one: plain vLLM queues it behind
everything (FIFO); the ocrq worker gets it at a higher priority (``--big-priority``): its time to
first result shows what bounded admission buys.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Any

from worker.engines.vllm.kv_gate import DEFAULT_OVERCOMMIT

GIB = 2**30
PLAIN_OFF = "image_boundary"  # the plain rows run vLLM as shipped (the CPU build keeps xdrope_cpu)


def _common(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--name", required=True)
    ap.add_argument("--out", type=Path, required=True, help="directory for NAME.json")
    ap.add_argument("--work", type=Path, default=Path("/tmp/ocrq-gpu-vllm"))
    ap.add_argument("--size", default="full", choices=["full", "tiny"])
    ap.add_argument("--images", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--cap-gb", type=float, default=24.0)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--small", type=int, default=8)
    ap.add_argument("--small-after", type=float, default=3.0)


def _setup(args: argparse.Namespace) -> tuple[Path, dict[str, Path], bool]:
    """Checkpoint and workload folders (``big`` and ``small``), built once per --work dir."""
    import torch

    from bench.gpu_worker import write_workload
    from worker.checkpoint import make_random_checkpoint

    cuda = torch.cuda.is_available()
    args.work.mkdir(parents=True, exist_ok=True)
    model = args.work / f"hunyuan-{args.size}"
    if not (model / "model.safetensors").exists():
        make_random_checkpoint(model, args.size, seed=0, device="cuda" if cuda else "cpu")
    folders = {"big": write_workload(args.work, args.images, args.seed, "cold", args.scale),
               "big2": write_workload(args.work, args.images, args.seed, "warm", args.scale),
               "big3": write_workload(args.work, args.images, args.seed, "third", args.scale, offset=700_000),
               "small": write_workload(args.work / "small", args.small, args.seed + 1, "cold", args.scale)}
    return model, folders, cuda


def _utilization(cap_gb: float) -> float:
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    return round(min(0.95, cap_gb * GIB / total), 4)


def _device_used_gb() -> float | None:
    sample = _device_sample()
    return sample[0] if sample else None


def _device_sample() -> tuple[float, dict[str, float]] | None:
    """NVML's used GiB on the device, and per process (pid and name) what NVML charges it: the
    device figure also holds what no process is charged for (the driver's reservations)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(int(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]))
        used = round(int(pynvml.nvmlDeviceGetMemoryInfo(handle).used) / GIB, 2)
        procs: dict[str, float] = {}
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            try:
                name = Path(f"/proc/{p.pid}/cmdline").read_bytes().split(b"\0")[0].decode()[-40:]
            except OSError:
                name = "?"
            procs[f"{p.pid} {name}"] = round(int(p.usedGpuMemory or 0) / GIB, 2)
        return used, procs
    except Exception:
        return None


class _PeakSampler(threading.Thread):
    """The device's NVML 'used' bytes, sampled while a row runs (a worker's engine is another
    process), with the per-process split at the peak."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak: float | None = None
        self.at_peak: dict[str, float] = {}
        self.idle: float | None = _device_used_gb()
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.5):
            sample = _device_sample()
            if sample is not None and sample[0] > (self.peak or 0.0):
                self.peak, self.at_peak = sample

    def report(self) -> dict[str, Any]:
        return {"peak_gb": self.peak, "peak_processes_gb": self.at_peak, "device_idle_gb": self.idle}


def _write(args: argparse.Namespace, row: dict[str, Any]) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(row, indent=2))
    print(json.dumps(row), flush=True)


def _small_set(sets: list[dict[str, Any]]) -> dict[str, Any]:
    """The third set's figures: its img/s with the small job beside it, and the small job's times."""
    if len(sets) < 3:
        return {"small_first_result_s": None, "small_done_s": None}
    third = sets[2]
    return {"third_img_per_s": third["img_per_s"], "small_first_result_s": third.get("small_first_result_s"),
            "small_done_s": third.get("small_done_s")}


# --- plain vLLM ------------------------------------------------------------------------------------


def plain(args: argparse.Namespace) -> None:
    os.environ["OCRQ_VLLM_DISABLE_FIXES"] = PLAIN_OFF
    model, folders, cuda = _setup(args)
    from PIL import Image
    from vllm import LLM, SamplingParams

    from worker.engines import hunyuan

    def load(folder: Path) -> list[Any]:
        return [Image.open(p).convert("RGB") for p in sorted(folder.glob("*.jpg"))]

    cold, warm, third, small = (load(folders[k]) for k in ("big", "big2", "big3", "small"))
    kw: dict[str, Any] = dict(model=str(model), dtype="bfloat16" if cuda else "float32", seed=0,
                              max_model_len=args.max_model_len, limit_mm_per_prompt={"image": 1},
                              enable_prefix_caching=False, mm_processor_cache_gb=0, disable_log_stats=False,
                              max_num_batched_tokens=args.max_num_batched_tokens)
    if args.max_num_seqs:
        kw["max_num_seqs"] = args.max_num_seqs
    if cuda:
        kw["gpu_memory_utilization"] = _utilization(args.cap_gb)
    else:  # CPU dry run: a small KV cache, as the vllm test tier
        kw.update(enforce_eager=True, kv_cache_memory_bytes=256 << 20)
    before = _device_used_gb()
    sampler = _PeakSampler()  # sampled through the run, as in the worker rows
    sampler.start()
    t0 = time.perf_counter()
    llm = LLM(**kw)
    build_s = time.perf_counter() - t0
    tok = llm.get_tokenizer()
    messages = hunyuan.build_messages("text", {}, "1.5")
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    processor = hunyuan.load_processor(model)
    trio = f"{processor.image_start_token}{processor.image_token}{processor.image_end_token}"
    assert trio in text, "the chat template no longer wraps the image in start/image/end"
    prompt = text.replace(trio, processor.image_token)  # vLLM 0.26 adds the wrapper itself
    sp = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    engine = llm.llm_engine

    def job(tag: str, big: list[Any], with_small: bool) -> dict[str, Any]:
        """All of ``big`` added at once; after ``small_after`` s the small job (if any) joins."""
        finished: dict[str, float] = {}
        tokens = 0
        added_small, small_t0 = not with_small, 0.0
        t0 = time.perf_counter()

        def add_small() -> None:
            nonlocal added_small, small_t0
            small_t0 = time.perf_counter() - t0
            for i, im in enumerate(small):
                engine.add_request(f"{tag}-small-{i}", {"prompt": prompt, "multi_modal_data": {"image": im}}, sp)
            added_small = True

        # adding renders in this thread (~17 s for 200 pages) while vLLM's core runs what it has:
        # the small job joins at its time between two adds, queued (FIFO) behind the big requests
        # added so far, as a second client of the same engine would be
        for i, im in enumerate(big):
            engine.add_request(f"{tag}-big-{i}", {"prompt": prompt, "multi_modal_data": {"image": im}}, sp)
            if not added_small and time.perf_counter() - t0 >= args.small_after:
                add_small()
        while engine.has_unfinished_requests() or not added_small:
            now = time.perf_counter() - t0
            if not added_small and (now >= args.small_after or not engine.has_unfinished_requests()):
                add_small()
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = time.perf_counter() - t0
                    tokens += len(out.outputs[0].token_ids)
        big_done = max(v for k, v in finished.items() if "-big-" in k)
        small_times = [v for k, v in finished.items() if "-small-" in k]
        return {"img_per_s": round(len(big) / big_done, 3), "elapsed_s": round(big_done, 2),
                "failed": len(big) + (len(small) if with_small else 0) - len(finished),
                "all_full_length": tokens == args.tokens * len(finished),
                "small_added_s": round(small_t0, 2) if with_small else None,
                "small_first_result_s": round(min(small_times) - small_t0, 2) if small_times else None,
                "small_done_s": round(max(small_times) - small_t0, 2) if small_times else None}

    first = job("cold", cold, with_small=False)
    print(json.dumps({"first": first}), flush=True)
    second = job("warm", warm, with_small=False)
    print(json.dumps({"second": second}), flush=True)
    sets = [first, second]
    if args.small:  # the third set: the small job joins it (time to first result)
        sets.append(job("third", third, with_small=True))
        print(json.dumps({"third": sets[-1]}), flush=True)
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    sampler.stop.set()
    # like the ocrq rows: the second set of 200 on a built engine is the row, the first is kept
    row = {"name": args.name, "kind": "plain-vllm", "max_num_seqs": args.max_num_seqs or "default",
           "max_num_batched_tokens": args.max_num_batched_tokens, "cap_gb": args.cap_gb,
           "images": len(warm), **second, "first_img_per_s": first["img_per_s"],
           **_small_set(sets), "failed": sum(s["failed"] for s in sets),
           "all_full_length": all(s["all_full_length"] for s in sets),
           "preemptions": int(metrics.get("vllm:num_preemptions") or 0), "build_s": round(build_s, 1),
           "device_used_before_gb": before, **sampler.report()}
    _write(args, row)


# --- the ocrq worker -------------------------------------------------------------------------------


def _watch_small(client: Any, folder: Path, delay: float, out: dict[str, Any]) -> None:
    """Submit the small job after ``delay`` s; record when its first image and all are stored."""
    time.sleep(delay)
    t0 = time.perf_counter()
    handle = client.submit([str(folder)], job=f"small-{int(time.time())}", priority=0)
    while True:
        counts = handle.status()
        done = counts["done"] + counts["failed"]
        if done and "first_s" not in out:
            out["first_s"] = round(time.perf_counter() - t0, 2)
        if counts["total"] and done >= counts["total"]:
            out["done_s"] = round(time.perf_counter() - t0, 2)
            return
        time.sleep(0.1)


def _states(redis_url: str, workers: list[str]) -> dict[str, Any]:
    """Each worker's published state (engine counters), by worker name."""
    import redis

    from ocrq import keys

    client = redis.Redis.from_url(redis_url)
    host = socket.gethostname()
    out = {}
    for name in workers:
        state = json.loads(client.get(keys.worker_state(f"{name}@{host}")) or "{}")
        out[name] = {k: state.get(k) for k in ("batches", "images", "preemptions", "kv_usage", "token_capacity",
                                                 "capacity_bytes", "failed", "engine")}
    return out


def worker(args: argparse.Namespace) -> None:
    from bench.gpu_worker import run_job
    from bench.services import free_port, start_redis, start_worker, stop
    from ocrq import keys  # noqa: F401  (run_job reads the worker state through it)
    from ocrq.engine_settings import VllmServerSettings
    from ocrq.settings import Settings
    from ocrq_cli.embedded.gpus import mps_running, share_env
    from producer.client import Client

    model, folders, cuda = _setup(args)
    # a row measures a cold store: a row of the same name run earlier on this machine left its
    # cache there (a second server row on one machine, 2026-12-02, answered every page from it)
    store = args.work / f"store-{args.name}"
    shutil.rmtree(store, ignore_errors=True)
    port = free_port()
    redis_url = f"redis://127.0.0.1:{port}/0"
    redis_proc = start_redis(port, args.work)
    overcommit = DEFAULT_OVERCOMMIT if args.kv_overcommit is None else args.kv_overcommit
    extra: dict[str, Any] = {"ignore_eos": True, "kv_gate": not args.no_kv_gate, "kv_gate_overcommit": overcommit}
    env = {**os.environ, "OCRQ_REDIS__URL": redis_url, "OCRQ_STORE__PATH": str(store),
           "OCRQ_LIMITS__ALLOWED_ROOTS": json.dumps([str(args.work)]), "OCRQ_ENGINE__MODEL_DIR": str(model),
           "OCRQ_ENGINE__KIND": "vllm-server" if args.server else "vllm",
           "OCRQ_ENGINE__MAX_NEW_TOKENS": str(args.tokens), "OCRQ_ENGINE__REPETITION_STOP": "0",
           "OCRQ_ENGINE__MAX_MODEL_LEN": str(args.max_model_len),
           "OCRQ_ENGINE__MAX_NUM_SEQS": str(args.max_num_seqs or 256),
           "OCRQ_ENGINE__MAX_NUM_BATCHED_TOKENS": str(args.max_num_batched_tokens),
           "OCRQ_ENGINE__CONCURRENT_BATCHES": str(args.concurrent_batches),
           "OCRQ_BATCH__MODE": args.batch_mode, "OCRQ_BATCH__MAX_SIZE": "128",
           "OCRQ_BATCH__SIZE": str(args.batch_size),
           "OCRQ_BATCH__MEMORY_CAP_BYTES": str(int(args.cap_gb * GIB)),
           "OCRQ_QUEUE__CHUNK_SIZE": str(args.chunk_size), "OCRQ_METRICS_PORT": "0",
           "OCRQ_ENGINE__VISION_GROUP_PATCHES": str(args.vision_group_patches),
           "OCRQ_ENGINE__VISION_CUDA_GRAPHS": "true" if args.vision_cuda_graphs else "false"}
    server = None
    sampler = _PeakSampler()
    sampler.start()
    if not cuda:  # CPU dry run: small KV, in-process core (as the vllm test tier)
        env.update({"OCRQ_ENGINE__DTYPE": "float32", "OCRQ_ENGINE__ENFORCE_EAGER": "true",
                    "VLLM_CPU_KVCACHE_SPACE": "1"})
    row: dict[str, Any] = {"name": args.name, "kind": "ocrq-" + env["OCRQ_ENGINE__KIND"],
                           "concurrent_batches": args.concurrent_batches,
                           "batch_mode": args.batch_mode, "batch_size": args.batch_size,
                           "vision_group_patches": args.vision_group_patches,
                           "vision_cuda_graphs": args.vision_cuda_graphs, "kv_gate": not args.no_kv_gate,
                           "kv_gate_overcommit": None if args.no_kv_gate or args.server else overcommit, "jobs": []}
    try:
        if args.server:
            from worker.engines.vllm.launcher import api_servers, launch_server

            sport = free_port()
            es = VllmServerSettings(model_dir=model, max_model_len=args.max_model_len, max_num_seqs=256,
                                max_num_batched_tokens=args.max_num_batched_tokens,
                                gpu_memory_utilization=_utilization(args.cap_gb) if cuda else 0.85,
                                dtype="bfloat16" if cuda else "float32", enforce_eager=not cuda,
                                vision_group_patches=args.vision_group_patches, api_servers=args.api_servers,
                                vision_cuda_graphs=args.vision_cuda_graphs)
            row.update(api_servers=api_servers(es), image_transport=es.image_transport)
            t0 = time.perf_counter()
            log_file = (args.work / f"{args.name}-server.log").open("wb")
            server = launch_server(model, sport, es, env=env, log_file=log_file, ready_timeout=500)
            row["server_ready_s"] = round(time.perf_counter() - t0, 1)
            env["OCRQ_ENGINE__ENDPOINTS"] = json.dumps([f"http://127.0.0.1:{sport}/v1"])
        env["OCRQ_ENGINE__EXTRA"] = json.dumps(extra)
        t0 = time.perf_counter()
        procs = []
        # --workers N: N engines on this one GPU, each with 1/N of the budget, as `ocrq up --gpus`
        # plans them (engine.engines_per_gpu); started one after another, as the stack does, so
        # that no engine sizes its KV cache while another is still claiming memory
        share = share_env(Settings(batch={"memory_cap_bytes": int(args.cap_gb * GIB)}), args.workers)
        for k in range(args.workers):
            name = "w1" if k == 0 else f"w1.{k}"
            procs.append(start_worker({**env, **share}, name, args.work / f"{args.name}-{name}-worker.log"
                                      if k else args.work / f"{args.name}-worker.log", redis_url, timeout=600,
                                      concurrency=8))
        row.update(workers=args.workers, chunk_size=args.chunk_size, mps=mps_running(os.environ))
        row["worker_ready_s"] = round(time.perf_counter() - t0, 1)
        settings = Settings(redis={"url": redis_url}, store={"kind": "local", "path": store},
                            limits={"allowed_roots": [args.work]}, queue={"chunk_size": args.chunk_size})
        tags = ("big", "big2", "big3")[: args.jobs] if args.small else ("big", "big2")[: args.jobs]
        for i, tag in enumerate(tags):
            small: dict[str, Any] = {}
            watcher = None
            if tag == "big3":  # the third set: the small job joins it (time to first result)
                watcher = threading.Thread(target=_watch_small, daemon=True,
                                           args=(Client(settings), folders["small"], args.small_after, small))
                watcher.start()
            job = run_job(settings, folders[tag], f"{args.name}-{tag}", redis_url, "w1", args.tokens,
                          priority=args.big_priority)
            if watcher is not None:
                watcher.join(600)
                job["small"] = small
            job["run"] = ("first", "second", "third")[i]
            if args.workers > 1:  # every engine's own counters (run_job read the first one's)
                job["worker_states"] = _states(redis_url, ["w1"] + [f"w1.{k}" for k in range(1, args.workers)])
            row["jobs"].append(job)
            print(json.dumps(job), flush=True)
        for proc in procs:
            stop(proc)
    finally:
        sampler.stop.set()
        if server is not None:
            from worker.engines.vllm.launcher import stop_server

            stop_server(server)
        redis_proc.terminate()
    second = row["jobs"][1] if len(row["jobs"]) > 1 else row["jobs"][0]
    last = row["jobs"][-1]
    states = last.get("worker_states") or {"w1": last.get("worker_state", {})}
    preemptions = [s.get("preemptions") for s in states.values()]
    third = row["jobs"][2] if len(row["jobs"]) > 2 else None
    row.update(cap_gb=args.cap_gb, max_num_batched_tokens=args.max_num_batched_tokens,
               img_per_s=second["img_per_s"], failed=sum(j["failed"] for j in row["jobs"]),
               first_img_per_s=row["jobs"][0]["img_per_s"],
               preemptions=None if None in preemptions else sum(preemptions),
               **sampler.report(), all_full_length=all(j["all_full_length"] for j in row["jobs"]),
               third_img_per_s=third["img_per_s"] if third else None,
               small_first_result_s=third.get("small", {}).get("first_s") if third else None,
               small_done_s=third.get("small", {}).get("done_s") if third else None)
    _write(args, row)


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plain")
    _common(p)
    p.add_argument("--max-num-seqs", type=int, default=0, help="0: vLLM's default")
    w = sub.add_parser("worker")
    _common(w)
    w.add_argument("--server", action="store_true")
    w.add_argument("--jobs", type=int, default=3, choices=[1, 2, 3],
                   help="the row is the second (warm) job; the third has the small job beside it")
    w.add_argument("--max-num-seqs", type=int, default=256)
    w.add_argument("--concurrent-batches", type=int, default=8)
    w.add_argument("--batch-mode", choices=["auto", "fixed"], default="auto",
                   help="fixed: no admission by KV tokens; the batches in flight share a count limit of --batch-size")
    w.add_argument("--batch-size", type=int, default=4, help="fixed mode: the count limit the batches in flight share")
    w.add_argument("--big-priority", type=int, default=9, help="the large job's priority (0 is the highest)")
    w.add_argument("--api-servers", type=int, default=None,
                   help="--server: engine.api_servers (default: one per 4 host cores, 1 to 4)")
    w.add_argument("--chunk-size", type=int, default=32,
                   help="queue.chunk_size: images per message (smaller splits a 200-page set more evenly)")
    w.add_argument("--workers", type=int, default=1,
                   help="workers (engines) on this GPU, each with 1/N of --cap-gb (engine.engines_per_gpu)")
    w.add_argument("--vision-group-patches", type=int, default=0,
                   help="engine.vision_group_patches (0: vLLM's page-by-page vision tower)")
    w.add_argument("--no-kv-gate", action="store_true",
                   help="engine.extra.kv_gate false: requests go to vLLM's scheduler as their batch starts")
    w.add_argument("--kv-overcommit", type=float, default=None,
                   help="engine.extra.kv_gate_overcommit: the gate plans with this many times vLLM's KV blocks "
                        f"(default {DEFAULT_OVERCOMMIT}, the worker's; 1: never preempt)")
    w.add_argument("--vision-cuda-graphs", action="store_true",
                   help="engine.vision_cuda_graphs: the vision tower replayed as CUDA graphs, a page per graph")
    r = sub.add_parser("report")
    r.add_argument("--dirs", type=Path, nargs="+", required=True)
    r.add_argument("--transformers", type=Path, default=None, help="bench.gpu_worker JSON (its warm job)")
    r.add_argument("--out", type=Path, default=Path("docs/bench"))
    args = ap.parse_args()
    if args.cmd == "worker" and args.kv_overcommit is not None and (args.server or args.no_kv_gate):
        ap.error("--kv-overcommit is the in-process KV gate's: not with --server or --no-kv-gate")
    if args.cmd == "report":
        from bench.gpu_vllm_report import report

        report(args.dirs, args.transformers, args.out)
    else:
        {"plain": plain, "worker": worker}[args.cmd](args)
    print(f"host {socket.gethostname()}", flush=True)


if __name__ == "__main__":
    main()

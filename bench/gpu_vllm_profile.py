"""Where plain vLLM's time goes on the docs/bench/gpu-vllm.md workload (every gap between
rows explained by a profile). One process, one engine (its core in this process, so the CUDA profiler and
``apply_model`` see it), the plain rows' settings:

    python3 -m bench.gpu_vllm_profile --name prof-16k --out DIR [--max-num-batched-tokens N] [--kernels]
    python3 -m bench.gpu_vllm_profile --name alone-1000 --images 1000 --engine-only --warmup-images 200 --out DIR
    # CPU dry run: --size tiny --scale 0.25 --images 12 --tokens 16

Phases, each timed on its own:
1. ``render``: vLLM's own input processing of every page (chat prompt → token ids + HF image
   processor), serial, per page size; then the same pages rendered by 4 threads (wall time, and
   whether the results are identical to the serial ones).
2. ``engine``: the 200 pre-rendered requests added at once and stepped to the end, 256 tokens each:
   the GPU-side throughput with no CPU preprocessing in the loop (``engine_cold``: the first time).
3. ``prefill``: the same with 1 new token: the prefill (vision tower + language-model prompt) alone.
4. ``vit``: the vision tower alone on one page of each size (``apply_model``), ms and TFLOP/s.
5. ``--kernels``: the CUDA kernels of a prefill of 8 large pages (torch profiler), top 25.

``--engine-only`` keeps phase 2 alone, for the engine-alone reference beside a worker's row on
many pages: the pages rendered on ``--threads`` threads (timed), the cold run on the first
``--warmup-images`` of them, the warm run on all, each run's preemptions from vLLM's counter.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench.gpu_vllm import PLAIN_OFF, _common, _device_used_gb, _setup, _utilization, _write


def _vit_flops(patches: int, cfg: Any) -> float:
    """Forward FLOPs of the vision tower on one page (linear layers + attention), merger left out."""
    d, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    linear = 2 * patches * (4 * d * d + 2 * d * inter)
    attention = 4 * patches * patches * d
    return float(layers * (linear + attention))


def _preemptions(llm: Any) -> int:
    return int(sum(float(getattr(m, "value", 0) or 0) for m in llm.get_metrics() if m.name == "vllm:num_preemptions"))


def _engine_only(args: argparse.Namespace, llm: Any, render: Any, images: list[Any], row: dict[str, Any]) -> None:
    """The engine alone: every page rendered beforehand, added at once, stepped to the end."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)

    from worker.engines.vllm.render_ahead import one_torch_thread

    def rendered(n: int | None = None) -> list[Any]:
        t0 = time.perf_counter()
        # one torch thread per render thread, as the worker's render threads: each thread's torch
        # ops otherwise bring an OpenMP team of one thread per core (16 threads × 16 on the H100)
        with ThreadPoolExecutor(args.threads, initializer=one_torch_thread) as pool:
            out = list(pool.map(render, images[:n]))
        row.setdefault("render", {})[f"threads{args.threads}_s"] = round(time.perf_counter() - t0, 2)
        return out

    for name in ("engine_cold", "engine"):  # rendered for each run: a run consumes its inputs
        pages = rendered(args.warmup_images or None) if name == "engine_cold" else rendered()
        before = _preemptions(llm)
        row[name] = _run(llm.llm_engine, {f"{name}-{i}": x for i, x in enumerate(pages)}, sp)
        row[name]["preemptions"] = _preemptions(llm) - before
        del pages
        print(name, row[name], flush=True)


def _run(engine: Any, inputs: dict[str, Any], sp: Any) -> dict[str, Any]:
    t0 = time.perf_counter()
    for rid, engine_input in inputs.items():
        engine.add_request(rid, engine_input, sp)
    added = time.perf_counter() - t0
    steps, done, first = 0, 0, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done += 1
                first = first or time.perf_counter() - t0
        steps += 1
    wall = time.perf_counter() - t0
    return {"images": done, "wall_s": round(wall, 2), "img_per_s": round(done / wall, 2),
            "add_s": round(added, 2), "steps": steps, "first_done_s": round(first or 0, 2)}


def _vit_phase(llm: Any, processor: Any, images: list[Any], sizes: list[str], cuda: bool) -> Any:
    """The vision tower alone on one page of each size (``apply_model``): ms and TFLOP/s."""
    import torch

    vcfg = llm.llm_engine.model_config.hf_config.vision_config
    picked: dict[str, Any] = {}
    for im, size in zip(images, sizes, strict=True):
        picked.setdefault(size, im)

    def vit(module: Any) -> dict[str, Any]:
        attn = module.visual.layers[0].self_attn.attn
        out: dict[str, Any] = {"attn_impl": type(attn).__name__,
                               "attn_backend": str(getattr(attn, "attn_backend", "?"))}
        for size, im in picked.items():
            proc = processor.image_processor(images=[im], return_tensors="pt")
            pv, grid = proc["pixel_values"], proc["image_grid_thw"].tolist()
            with torch.inference_mode():
                for _ in range(2):
                    module.visual(pv, grid_thw=grid)
                if cuda:
                    torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(3):
                    module.visual(pv, grid_thw=grid)
                if cuda:
                    torch.cuda.synchronize()
                ms = (time.perf_counter() - t) / 3 * 1000
            patches = int(pv.shape[0])
            out[size] = {"patches": patches, "ms": round(ms, 1),
                         "tflop_s": round(_vit_flops(patches, vcfg) / (ms / 1000) / 1e12, 1)}
        return out

    try:
        return llm.apply_model(vit)[0]
    except Exception as exc:
        return f"failed: {type(exc).__name__}: {exc}"


def _kernel_phase(args: argparse.Namespace, engine: Any, render: Any, images: list[Any], sizes: list[str],
                  sp_one: Any) -> None:
    """The CUDA kernels of a prefill of 8 large pages (torch profiler), top 25 by device time."""
    from torch.profiler import ProfilerActivity, profile

    large = max(set(sizes), key=lambda s: int(s.split("x")[0]))
    batch = [render(im) for im, s in zip(images, sizes, strict=True) if s == large][:8]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _run(engine, {f"k-{i}": x for i, x in enumerate(batch)}, sp_one)
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}-kernels.txt").write_text(table)
    print(table[:6000], flush=True)


def main() -> None:  # noqa: C901  (phases in order, each a few lines)
    ap = argparse.ArgumentParser()
    _common(ap)
    ap.add_argument("--max-num-seqs", type=int, default=0, help="0: vLLM's default")
    ap.add_argument("--kernels", action="store_true", help="also the CUDA kernel table of a large-page prefill")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--vision-cuda-graphs", action="store_true",
                    help="the vision tower as CUDA graphs (engine.vision_cuda_graphs' compilation config)")
    ap.add_argument("--engine-only", action="store_true", help="only the engine runs (cold, then warm)")
    ap.add_argument("--warmup-images", type=int, default=0, help="--engine-only: pages of the cold run (0: all)")
    args = ap.parse_args()
    os.environ["OCRQ_VLLM_DISABLE_FIXES"] = PLAIN_OFF
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the core in this process: profiler + apply_model
    model, folders, cuda = _setup(args)
    import torch
    from PIL import Image
    from vllm import LLM, SamplingParams

    from worker.engines import hunyuan

    paths = sorted(folders["big"].glob("*.jpg"))
    images = [Image.open(p).convert("RGB") for p in paths]
    sizes = [f"{im.width}x{im.height}" for im in images]
    kw: dict[str, Any] = dict(
        model=str(model), dtype="bfloat16" if cuda else "float32", seed=0, max_model_len=args.max_model_len,
        limit_mm_per_prompt={"image": 1}, enable_prefix_caching=False, mm_processor_cache_gb=0,
        disable_log_stats=False, max_num_batched_tokens=args.max_num_batched_tokens)
    if args.max_num_seqs:
        kw["max_num_seqs"] = args.max_num_seqs
    if cuda:
        kw["gpu_memory_utilization"] = _utilization(args.cap_gb)
    if args.vision_cuda_graphs and cuda:
        from ocrq.engine_settings import HunyuanSettings
        from worker.engines.vllm.encoder_graphs import compilation_config

        # these rows pass no mm_processor_kwargs: the processor's own bounds, ocrq's default max_pixels
        kw["compilation_config"] = compilation_config(HunyuanSettings().max_pixels, args.max_model_len)
    t0 = time.perf_counter()
    llm = LLM(**kw)
    row: dict[str, Any] = {"name": args.name, "max_num_batched_tokens": args.max_num_batched_tokens,
                           "vision_cuda_graphs": bool(args.vision_cuda_graphs and cuda),
                           "max_num_seqs": args.max_num_seqs or "default",
                           "build_s": round(time.perf_counter() - t0, 1)}
    tok = llm.get_tokenizer()
    messages = hunyuan.build_messages("text", {}, "1.5")
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    processor = hunyuan.load_processor(model)
    prompt = text.replace(f"{processor.image_start_token}{processor.image_token}{processor.image_end_token}",
                          processor.image_token)

    def render(im: Any) -> Any:
        (engine_input,) = llm._preprocess_cmpl([{"prompt": prompt, "multi_modal_data": {"image": im}}])
        return engine_input

    if args.engine_only:
        row.update(images=len(images), tokens=args.tokens, cap_gb=args.cap_gb)
        _engine_only(args, llm, render, images, row)
        row["peak_gb"] = _device_used_gb()
        _write(args, row)
        return

    # 1. rendering, serial then threaded
    per_size: dict[str, list[float]] = defaultdict(list)
    serial: list[Any] = []
    t0 = time.perf_counter()
    for im, size in zip(images, sizes, strict=True):
        t = time.perf_counter()
        serial.append(render(im))
        per_size[size].append(time.perf_counter() - t)
    serial_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.threads) as pool:
        threaded = list(pool.map(render, images))
    threaded_s = time.perf_counter() - t0

    def same(a: Any, b: Any) -> bool:
        if a.get("prompt_token_ids") != b.get("prompt_token_ids"):
            return False
        ka, kb = a["mm_kwargs"].get_data(), b["mm_kwargs"].get_data()  # type: ignore[union-attr]
        return all(torch.equal(ka[k], kb[k]) for k in ka if isinstance(ka[k], torch.Tensor))

    try:
        identical: Any = all(same(a, b) for a, b in zip(serial, threaded, strict=True))
    except Exception as exc:  # the input type's layout differs between versions: say so, not guess
        identical = f"not compared: {type(exc).__name__}: {exc}"
    row["render"] = {"serial_s": round(serial_s, 2), f"threads{args.threads}_s": round(threaded_s, 2),
                     "threaded_identical": identical,
                     "ms_per_page": {s: round(1000 * statistics.mean(v), 1) for s, v in per_size.items()}}
    print(row["render"], flush=True)

    engine = llm.llm_engine
    sp_full = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    sp_one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    # 2. the engine alone, inputs rendered beforehand: once cold (first work after the build), once warm
    row["engine_cold"] = _run(engine, {f"c-{i}": x for i, x in enumerate(serial)}, sp_full)
    print("engine cold", row["engine_cold"], flush=True)
    row["engine"] = _run(engine, {f"e-{i}": x for i, x in enumerate(threaded)}, sp_full)
    print("engine warm", row["engine"], flush=True)
    # 3. prefill alone
    with ThreadPoolExecutor(args.threads) as pool:
        again = list(pool.map(render, images))
    row["prefill"] = _run(engine, {f"p-{i}": x for i, x in enumerate(again)}, sp_one)
    print("prefill", row["prefill"], flush=True)
    metrics = {}
    for m in llm.get_metrics():
        if hasattr(m, "sum") and hasattr(m, "count") and m.count:
            metrics[m.name] = {"sum": round(float(m.sum), 2), "count": int(m.count)}
        elif getattr(m, "value", None) is not None and "preempt" in m.name:
            metrics[m.name] = m.value
    row["metrics"] = metrics
    row["vit"] = _vit_phase(llm, processor, images, sizes, cuda)
    print("vit", row["vit"], flush=True)
    if args.kernels and cuda:
        _kernel_phase(args, engine, render, images, sizes, sp_one)
    row["peak_gb"] = _device_used_gb()
    _write(args, row)


if __name__ == "__main__":
    main()

"""vLLM options derived from ocrq's engine settings: render threads and the compilation config
(the same for the in-process engine and a launched server), and the in-process ``vllm.LLM``'s
keyword arguments."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from ocrq.engine_settings import VllmSettings
from worker.engines.vllm import compat, encoder_graphs, vision
from worker.engines.vllm.gpu_share import device_memory, gpu_utilization

log = logging.getLogger(__name__)


def render_threads(settings: VllmSettings) -> int:
    """``engine.render_threads``, or half this host's cores (2 to 8): the in-process engine's
    render threads, and a launched server's ``--renderer-num-workers``."""
    if settings.render_threads is not None:
        return settings.render_threads
    return max(2, min(8, (os.cpu_count() or 2) // 2))


def compilation_config(settings: VllmSettings, on_cuda: bool) -> dict[str, Any] | None:
    """vLLM ``compilation_config`` from ocrq's settings: the vision tower's CUDA graphs where asked
    for and possible (CUDA, graphs not switched off by ``enforce_eager``); None: vLLM's own."""
    if not settings.vision_cuda_graphs:
        return None
    if not on_cuda or settings.enforce_eager:
        why = "no CUDA device" if not on_cuda else "enforce_eager is set"
        log.warning("engine.vision_cuda_graphs is ignored: %s", why)
        return None
    return encoder_graphs.compilation_config(settings.max_pixels, settings.max_model_len)


def dtype(settings: VllmSettings) -> str:
    """The dtype vLLM runs in: ``engine.dtype``, or bf16 on CUDA and fp32 on a CPU."""
    if settings.dtype != "auto":
        return settings.dtype
    import torch

    return "bfloat16" if torch.cuda.is_available() else "float32"


def llm_args(settings: VllmSettings, model_dir: Path) -> dict[str, Any]:
    """Keyword arguments for the in-process ``vllm.LLM`` (without the GPU share, sized when the
    engine is built)."""
    s = settings
    args: dict[str, Any] = {
        "model": str(model_dir),
        "dtype": dtype(s),
        "max_model_len": s.max_model_len,
        "max_num_seqs": s.max_num_seqs,
        "max_num_batched_tokens": s.max_num_batched_tokens,
        "enforce_eager": s.enforce_eager,
        "limit_mm_per_prompt": {"image": 1},
        # HunYuanVLImageProcessor's own resize bounds (``size``; min/max_pixels is deprecated)
        "mm_processor_kwargs": {"size": {"shortest_edge": s.min_pixels, "longest_edge": s.max_pixels}},
        # every page is new: prefix caching and the processor cache only cost memory here
        "enable_prefix_caching": False,
        "mm_processor_cache_gb": 0,
        # keeps the Prometheus gauges (KV usage, waiting, preemptions) that ``memory`` reads
        "disable_log_stats": False,
        "scheduling_policy": s.scheduling,
        # vLLM's tokenizer is a pool of deep copies, renderer_num_workers + 1 of them; a thread
        # that finds none free deep-copies the 120k-entry tokenizer (~0.25 s of GIL and 27 MB
        # each). One per render thread; answers are decoded with the engine's own copy
        "renderer_num_workers": render_threads(s),
        "seed": 0,
    }
    import torch

    graphs = compilation_config(s, torch.cuda.is_available())
    if graphs and not compat.family().native_model:  # the graphs patch 0.26's native tower
        log.warning("engine.vision_cuda_graphs is ignored: %s has no native model", compat.family())
    elif graphs:
        args["compilation_config"] = graphs
    args.update(dict(s.extra.get("vllm", {})))
    return args



def sized_llm_args(settings: VllmSettings, model_dir: Path) -> tuple[dict[str, Any], int | None, bool]:
    """(``llm_args`` with the GPU share sized from what the device has free, the bytes vLLM may
    claim (None on a CPU), whether CUDA is there); sets the environment vLLM's processes read."""
    import torch

    args = llm_args(settings, model_dir)
    on_cuda = torch.cuda.is_available()
    capacity: int | None = None
    if on_cuda:
        total, free = device_memory()
        if "gpu_memory_utilization" not in args:
            requested = settings.gpu_memory_utilization
            if settings.memory_cap_bytes:
                requested = min(requested, settings.memory_cap_bytes / total)
            args["gpu_memory_utilization"] = gpu_utilization(requested, total, free)
        capacity = int(args["gpu_memory_utilization"] * total)
        if settings.cuda_alloc_conf:  # read by the engine core process vLLM starts
            os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", settings.cuda_alloc_conf)
    # read per call by the plugin's tower forward, in this process and in vLLM's core
    os.environ[vision.ENV] = str(settings.vision_group_patches)
    if settings.compile_cache_dir is not None:  # read by the engine core process too
        os.environ.setdefault("VLLM_CACHE_ROOT", str(Path(settings.compile_cache_dir).resolve()))
    return args, capacity, on_cuda

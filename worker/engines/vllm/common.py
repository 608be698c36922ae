"""What the two vLLM engines (in-process and server) share: chat messages with a concrete image
part, the loop cut, an answer as ``OcrOutput`` and the GPU share vLLM may claim.

The first three are HunyuanOCR answer shaping the transformers engine does too (its ``_output``
and ``_settle``); they belong next to the prompts in ``hunyuan.py`` once its owner takes them.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ocrq.errors import BadRequest, OcrqError, TooLargeForDevice
from ocrq.settings import EngineSettings
from worker.engines import hunyuan
from worker.engines.base import OcrRequest
from worker.engines.vllm import encoder_graphs

log = logging.getLogger(__name__)

#: device memory left to the CUDA context, other processes' growth and fragmentation when
#: ``gpu_memory_utilization`` is sized from what NVML reports free at start
GPU_RESERVE_BYTES = 1 << 30


def gpu_utilization(requested: float, total: int, free: int, reserve: int = GPU_RESERVE_BYTES) -> float:
    """The ``gpu_memory_utilization`` vLLM can actually get: vLLM claims that fraction of the
    *total* and refuses to start when less is free, so other processes on the GPU are taken out."""
    if total <= 0:
        raise ValueError("device total must be positive")
    fits = (free - reserve) / total
    if fits <= 0.05:
        raise TooLargeForDevice(
            f"only {free / 2**30:.1f} GiB of {total / 2**30:.1f} GiB free on the GPU: no room for vLLM"
        )
    return round(min(requested, fits), 4)


def cut_repetition(tokens: list[int], min_repeats: int) -> tuple[list[int], hunyuan.Repetition | None]:
    """Tokens to keep when the tail loops: everything before the loop plus one copy of the unit
    (the rule and the cut are the transformers engine's, so both engines agree)."""
    rep = hunyuan.detect_repetition(tokens, min_repeats)
    if rep is None:
        return tokens, None
    return tokens[: len(tokens) - rep.span + rep.unit], rep


def answer_meta(
    generated: int, finish: str | None, repetition: hunyuan.Repetition | None, batch_size: int, seconds: float
) -> dict[str, Any]:
    """The meta keys both vLLM engines add to an answer (the transformers engine's names)."""
    return {
        "generated_tokens": generated,
        "stop_reason": "repetition" if repetition else finish,
        "repetition": {"unit": repetition.unit, "repeats": repetition.repeats} if repetition else None,
        "batch_size": batch_size,
        "batch_s": round(seconds, 4),
    }


def image_messages(request: OcrRequest, version: hunyuan.Version, image_part: dict[str, Any]) -> list[Any]:
    """``hunyuan.build_messages`` with its image placeholder replaced by a concrete image part."""
    messages = hunyuan.build_messages(request.task, request.params, version)
    for message in messages:
        if isinstance(message["content"], list):
            message["content"] = [image_part if part.get("type") == "image" else part
                                  for part in message["content"]]
    return messages


def render_threads(settings: EngineSettings) -> int:
    """``engine.render_threads``, or half this host's cores (2 to 8): the in-process engine's
    render threads, and a launched server's ``--renderer-num-workers``."""
    if settings.render_threads is not None:
        return settings.render_threads
    return max(2, min(8, (os.cpu_count() or 2) // 2))


def compilation_config(settings: EngineSettings, on_cuda: bool) -> dict[str, Any] | None:
    """vLLM ``compilation_config`` from ocrq's settings: the vision tower's CUDA graphs where asked
    for and possible (CUDA, graphs not switched off by ``enforce_eager``); None: vLLM's own."""
    if not settings.vision_cuda_graphs:
        return None
    if not on_cuda or settings.enforce_eager:
        why = "no CUDA device" if not on_cuda else "enforce_eager is set"
        log.warning("engine.vision_cuda_graphs is ignored: %s", why)
        return None
    return encoder_graphs.compilation_config(settings.max_pixels, settings.max_model_len)


def device_memory() -> tuple[int, int]:
    """(total, free) bytes of this process's GPU as NVML sees it (every process), else as the
    CUDA driver does."""
    from worker.memory.nvml import NvmlProbe

    probe = NvmlProbe.for_current_device()
    device = probe.read()
    getattr(probe, "close", lambda: None)()
    if device is not None:
        return device.total, device.free
    import torch

    free, total = torch.cuda.mem_get_info()
    return int(total), int(free)


def admission_error(request: OcrRequest, exc: BaseException, max_model_len: int) -> OcrqError:
    """What vLLM's refusal of one request means for that image: too long for the context
    (permanent, ``TooLargeForDevice``), or any other validation error (``BadRequest``)."""
    text = str(exc)
    if "maximum context length" in text or "max_model_len" in text or "maximum model length" in text:
        return TooLargeForDevice(f"{request.key}: prompt exceeds max_model_len {max_model_len}: {text[:200]}")
    return BadRequest(f"{request.key}: vLLM rejected the request: {type(exc).__name__}: {text[:300]}")

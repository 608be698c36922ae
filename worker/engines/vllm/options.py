"""vLLM options derived from ocrq's engine settings, the same for the in-process engine and a
launched server: render threads and the compilation config."""

from __future__ import annotations

import logging
import os
from typing import Any

from ocrq.settings import EngineSettings
from worker.engines.vllm import encoder_graphs

log = logging.getLogger(__name__)


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

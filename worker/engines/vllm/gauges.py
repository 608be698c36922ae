"""vLLM's own load gauges as the in-process engine reads them: KV-cache usage, waiting requests,
cumulative preemptions (the signals paged admission steers by, ``worker.governor.paged_kv``), plus the KV
capacity the engine core sized. Read from ``LLM.get_metrics()``, which walks every metric: at
most every ``METRICS_EVERY_S`` while batches step."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from worker.engines.base import MemorySample

__all__ = ["METRICS_EVERY_S", "Gauges", "kv_blocks", "kv_tokens"]

#: how often the vLLM gauges are read while a batch runs (REGISTRY.collect walks every metric)
METRICS_EVERY_S = 0.25


@dataclass
class _Reading:
    kv_usage: float | None = None
    waiting: int | None = None
    preemptions: int | None = None


class Gauges:
    """The last reading and the peak since ``reset_peak``. Not locked: the engine calls ``read``
    under its own lock (steps and ``memory`` both hold it)."""

    def __init__(self) -> None:
        self._now = _Reading()
        self._peak = _Reading()
        self._last_read = 0.0

    def read(self, llm: Any, force: bool = False) -> None:
        now = time.monotonic()
        if llm is None or (not force and now - self._last_read < METRICS_EVERY_S):
            return
        self._last_read = now
        try:
            metrics = llm.get_metrics()
        except Exception:  # stats disabled or the registry changed: the governor falls back
            return
        values: dict[str, float] = {}
        for metric in metrics:
            value = getattr(metric, "value", None)
            if value is not None:
                values[metric.name] = values.get(metric.name, 0.0) + float(value)
        usage, waiting = values.get("vllm:kv_cache_usage_perc"), values.get("vllm:num_requests_waiting")
        preempted = values.get("vllm:num_preemptions")
        self._now = _Reading(
            kv_usage=usage, waiting=None if waiting is None else int(waiting),
            preemptions=None if preempted is None else int(preempted),
        )
        peak = self._peak
        peak.kv_usage = _max(peak.kv_usage, self._now.kv_usage)
        peak.waiting = None if self._now.waiting is None else int(_max(peak.waiting, self._now.waiting) or 0)

    def sample(self) -> MemorySample:
        """Peak KV usage and waiting since ``reset_peak``; cumulative preemptions now."""
        return MemorySample(kv_usage=self._peak.kv_usage, waiting=self._peak.waiting,
                            preemptions=self._now.preemptions)

    def reset_peak(self) -> None:
        self._peak = _Reading(kv_usage=self._now.kv_usage, waiting=self._now.waiting)

    @property
    def preemptions(self) -> int | None:
        """vLLM's cumulative preemptions at the last reading."""
        return self._now.preemptions


def kv_blocks(llm: Any) -> tuple[int, int] | None:
    """(blocks, tokens a block holds) of the KV cache as the engine core sized it."""
    try:
        cache = llm.llm_engine.vllm_config.cache_config
        blocks = cache.num_gpu_blocks
        return (int(blocks), int(cache.block_size)) if blocks else None
    except Exception:  # older/newer config layout: admission falls back to the byte model
        return None


def kv_tokens(llm: Any) -> int | None:
    """KV-cache capacity in tokens (blocks × block size) as the engine core sized it."""
    sized = kv_blocks(llm)
    return None if sized is None else sized[0] * sized[1]


def _max(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    return a if b is None else max(a, b)

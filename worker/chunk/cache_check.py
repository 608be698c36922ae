"""Step 2: the chunk's cache units checked at once: one Redis round trip for the whole chunk
(files, and PDF pages one by one), then one batched store read for what the hot copy missed
(worker.cache). A hit is neither decoded nor sent to the engine."""

from __future__ import annotations

from dataclasses import replace

from worker.chunk.attempt import Attempt, frozen
from worker.chunk.needs import Worker


def check_cache(ctx: Worker, attempt: Attempt) -> Attempt:
    """The attempt with the outputs of its cache keys that hit (``hits``)."""
    cache_keys = [unit.cache_key for _, _, unit in attempt.units()]
    reads: list[int] = []
    hits = ctx.cache.get_many(cache_keys, reads)
    unit_hits = sum(key in hits for key in cache_keys)
    ctx.metrics.observe_cache(unit_hits, len(cache_keys) - unit_hits)
    return replace(attempt, hits=frozen(hits), unit_hits=unit_hits, store_reads=sum(reads))

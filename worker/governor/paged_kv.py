"""The paged KV cache of an engine like vLLM, as admission sees it (pure): how full the governor
plans it, and what the engine's own gauges (KV usage, waiting queue, preemptions) say about load.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["KV_BOOK", "KV_FILL", "KV_HOLD", "KV_SHRINK", "KvPressure", "Signal"]

#: preemptions or a KV cache this full act like a soft OOM (shrink); above ``KV_HOLD`` hold
KV_SHRINK = 0.95
KV_HOLD = 0.80
#: share of vLLM's KV tokens admission plans to fill. vLLM allocates in blocks (16 tokens), so a
#: request's last block is partly empty: planning to 100 % of the tokens over-commits the cache.
#: Measured on the H200 at 100 %: KV usage ≥ 95 % and preemptions (1 at a 24 GiB budget, 3 at 8)
KV_FILL = 0.90
#: share of the KV tokens admission books when the engine gates its cache itself (in-process vLLM,
#: ``worker.engines.vllm.kv_gate``). The gate runs ~C / (prompt + half the new tokens) pages where
#: admission plans each at prompt + all of them (~1.05 C on the bench's pages), and the rest waits
#: at the gate, rendered: about two batches' worth, so freed blocks are refilled at the next step
KV_BOOK = 1.30

#: what a sample asks of the count limit: shrink it, hold its growth, or nothing
Signal = Literal["shrink", "hold", "none"]


class KvPressure:
    """Reads the gauges after each batch. Not thread-safe: the governor calls it under its lock."""

    def __init__(self) -> None:
        #: the engine's cumulative preemption counter at the last sample (None: no sample yet)
        self.last_preemptions: int | None = None
        #: samples that asked for a shrink
        self.count = 0

    def read(self, kv_usage: float | None, waiting: int | None, preemptions: int | None) -> Signal:
        """New preemptions (``preemptions`` is cumulative; a drop means the engine restarted) or a
        nearly full KV cache: shrink. A busy cache or a waiting queue: hold growth."""
        new_preemptions = 0
        if preemptions is not None:
            last = self.last_preemptions  # None: the first sample is a baseline, not news
            if last is not None:
                new_preemptions = preemptions - last if preemptions >= last else preemptions
            self.last_preemptions = preemptions
        usage = kv_usage or 0.0
        if new_preemptions > 0 or usage >= KV_SHRINK:
            self.count += 1
            return "shrink"
        if usage >= KV_HOLD or (waiting or 0) > 0:
            return "hold"
        return "none"

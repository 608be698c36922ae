"""The governor's AIMD count limit (pure): the most images a batch may hold whatever the memory
model says, so a model that is wrong cannot keep a worker running out of memory.

Slow start (doubling) until the first OOM or pressure signal, halving on OOM, ~1/8 growth after a
run of successes, and only while the limit is what holds batches back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["CountLimit"]


class CountLimit:
    """Not thread-safe: ``worker.governor.governor.Governor`` calls it under its lock."""

    def __init__(self, hard: int, initial: int, *, slow_start: bool, grow_after: int) -> None:
        #: the cap no growth passes (``max_size``; ``size`` in fixed mode)
        self.hard = hard
        self.limit = initial
        self.slow_start = slow_start
        self.grow_after = grow_after
        self.streak = 0
        #: the last plan left images waiting because of the limit: only then does success grow it
        self.limited = False

    def value(self) -> int:
        return max(1, min(self.hard, self.limit))

    def planned(self, chosen: int, cap: int, pending: int) -> None:
        self.limited = chosen >= cap and pending > chosen

    def on_success(self) -> None:
        self.streak += 1
        if not self.limited or self.limit >= self.hard:
            return
        if self.slow_start:
            self.limit = min(self.hard, self.limit * 2)
        elif self.streak >= self.grow_after:
            self.limit = min(self.hard, self.limit + max(1, math.ceil(self.limit / 8)))
            self.streak = 0

    def on_oom(self, images: int) -> None:
        """A batch of ``images`` ran out of memory: halve. A lone image says nothing about how
        many images fit: it only ends slow start."""
        self.streak = 0
        self.slow_start = False
        if images > 1:
            self.limit = max(1, min(self.limit, images // 2))

    def shrink(self, images: int) -> None:
        """A soft OOM (paged-KV pressure): at most ¾ of the ``images`` that were in flight."""
        self.slow_start = False
        self.streak = 0
        self.limit = max(1, min(self.limit, int(max(1, images) * 0.75)))

    def hold(self) -> None:
        """The engine is busy: no growth for now."""
        self.streak = 0
        self.limited = False

    def snapshot(self) -> dict[str, Any]:
        return {"limit": self.limit, "slow_start": self.slow_start}

    def restore(self, snap: Mapping[str, Any]) -> None:
        self.limit = max(1, min(self.hard, int(snap["limit"])))
        self.slow_start = bool(snap["slow_start"])

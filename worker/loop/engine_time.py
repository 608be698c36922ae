"""Where the engine's time goes, for the engine loop: each image's share of the engine seconds
while it was in flight (the cost per job, ``ocrq status``, adds these up), and the seconds no
batch was running (``idle_s``: engine time the worker's intake left unused).

With several batches in flight (vLLM's continuous batching) the engine's time is split over
every image running, not charged to one batch. Not thread-safe: the engine loop calls it under
its own lock.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any


class EngineTime:
    def __init__(self) -> None:
        #: engine seconds each in-flight request has shared so far (keyed by id of the request)
        self._share: dict[int, float] = {}
        self._clock = time.monotonic()
        #: since when no batch has been running (None before the first batch)
        self.idle_since: float | None = None
        self.idle_s = 0.0

    def account(self, inflight: Sequence[Any]) -> None:
        """Split the time since the in-flight set last changed over the requests in it (call it
        before every change of that set)."""
        now = time.monotonic()
        if inflight:
            each = (now - self._clock) / len(inflight)
            for request in inflight:
                key = id(request)
                self._share[key] = self._share.get(key, 0.0) + each
        self._clock = now

    def share(self, request: Any, default: float) -> float:
        return self._share.get(id(request), default)

    def forget(self, requests: Iterable[Any]) -> None:
        for request in requests:
            self._share.pop(id(request), None)

    def started(self) -> None:
        """A batch starts while none was running: the idle gap (if any) ends."""
        if self.idle_since is not None:
            self.idle_s += time.monotonic() - self.idle_since

    def stopped(self) -> None:
        """The last running batch finished: idle from now."""
        self.idle_since = time.monotonic()

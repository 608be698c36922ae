"""A consumer bootstep that makes the broker prefetch window follow the governor.

With the threads pool, ``concurrency`` chunk tasks share one engine loop. Celery would reserve
``concurrency × multiplier`` messages no matter how fast the engine is; instead, once a second,
this step sets the channel's prefetch count to the number of chunk messages needed to keep the
governor's desired backlog of images (≈ two micro-batches), never more than ``concurrency``.
So a slow worker does not hoard the queue (two workers on one queue both get work) and a fast
one never starves its engine. Messages held for a retry countdown (ETA) are added on top, since
Celery counts them as unacked too.
"""

from __future__ import annotations

import json
import logging
import math
import socket
from collections.abc import Callable
from typing import Any

from celery import bootsteps
from celery.worker import state as worker_state

from ocrq import keys

log = logging.getLogger("ocrq.prefetch")


def desired_prefetch(backlog_images: int, chunk_size: int, concurrency: int, eta_held: int) -> int:
    """Messages to reserve: enough chunks for the backlog, within [1, concurrency], plus ETA ones."""
    chunks = math.ceil(max(backlog_images, 1) / max(chunk_size, 1))
    return max(1, min(concurrency, chunks)) + eta_held


def make_prefetch_step(get_state: Callable[[], Any | None], chunk_size: int, concurrency: int,
                       interval: float = 1.0) -> type[bootsteps.StartStopStep]:
    """``get_state`` returns the worker context once it is built (None before)."""

    class GovernorPrefetch(bootsteps.StartStopStep):
        requires = {"celery.worker.consumer.tasks:Tasks"}

        def __init__(self, parent: Any, **kwargs: Any) -> None:
            super().__init__(parent, **kwargs)
            self.tref: Any = None
            self.hostname = getattr(parent, "hostname", None) or socket.gethostname()

        def start(self, c: Any) -> None:
            self.tref = c.timer.call_repeatedly(interval, self.adjust, (c,), priority=10)

        def stop(self, c: Any) -> None:
            if self.tref is not None:
                self.tref.cancel()
                self.tref = None

        def adjust(self, c: Any) -> None:
            ctx = get_state()
            if ctx is None or c.qos is None:
                return
            eta_held = sum(1 for r in list(worker_state.reserved_requests) if getattr(r, "eta", None))
            want = desired_prefetch(ctx.loop.desired_backlog(), chunk_size, concurrency, eta_held)
            with c.qos._mutex:
                if c.qos.value != want:
                    log.debug("prefetch %s -> %s", c.qos.value, want)
                    c.qos.value = want
            c.qos.update()
            self._publish(ctx, want)

        def _publish(self, ctx: Any, prefetch: int) -> None:
            try:
                st = dict(ctx.loop.state())
                st["prefetch"] = prefetch
                key = keys.worker_state(self.hostname)
                ctx.redis.set(key, json.dumps(st, default=str), ex=60)
                ctx.save_governor()
            except Exception:  # metrics and the snapshot are best effort
                log.debug("worker state publish failed", exc_info=True)

    return GovernorPrefetch

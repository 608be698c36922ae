"""A consumer bootstep that makes the broker prefetch window follow the governor.

With the threads pool, ``concurrency`` chunk tasks share one engine loop. Celery would reserve
``concurrency × multiplier`` messages no matter how fast the engine is; instead, once a second,
this step sets the channel's prefetch count to the number of chunk messages needed to keep the
engine loop's desired backlog of images (≈ two micro-batches, or for a fast engine what its
intake must hold to keep it busy: ``worker.loop.pace``), never more than ``concurrency``.
So a slow worker does not hoard the queue (two workers on one queue both get work) and a fast
one never starves its engine. Messages held for a retry countdown (ETA) are added on top, since
Celery counts them as unacked too.

With several workers on a queue (``ocrq:consumers:{queue}``), a worker reserves at most an
equal share of the work there is (messages every worker holds unacked + the queue's ready ones),
never less than an equal share of its own window. So a job submitted to idle GPUs is split
evenly, not by who polled first or who happened to start a small batch. A worker that reserved
its whole share up front cannot be left holding the tail while its peer idles. One worker: the
governor's window, unchanged. A worker that stops leaves the set at once, so a worker restarted
in its place is not held to half a window until the old entry goes stale.
"""

from __future__ import annotations

import logging
import math
import socket
import time
from collections.abc import Callable
from typing import Any

from celery import bootsteps
from celery.worker import state as worker_state

from ocrq import keys
from worker.heartbeat import Heartbeat

log = logging.getLogger("ocrq.prefetch")


def desired_prefetch(backlog_images: int, chunk_size: int, concurrency: int, eta_held: int) -> int:
    """Messages to reserve: enough chunks for the backlog, within [1, concurrency], plus ETA ones."""
    chunks = math.ceil(max(backlog_images, 1) / max(chunk_size, 1))
    return max(1, min(concurrency, chunks)) + eta_held


def fair_share(want: int, unacked: int, ready: int, consumers: int) -> int:
    """Messages to reserve with ``consumers`` workers on the queue: ``want`` capped at an equal
    share of the work there is (``unacked``: held by all workers, ``ready``: in the queue), but
    never below an equal share of ``want`` (idle workers take a fresh job in equal parts)."""
    if consumers <= 1:
        return want
    share = max(math.ceil(want / consumers), math.ceil((unacked + ready) / consumers))
    return max(1, min(want, share))


#: a consumer that has not refreshed its entry for this long no longer counts
CONSUMER_STALE_S = 10


def queue_peers(redis: Any, queues: list[str], hostname: str, now: float) -> tuple[int, int, int]:
    """Register this worker as a consumer of ``queues``; return (messages held unacked by all
    workers, ready messages in ``queues``, live consumers of the most shared one)."""
    from ocrq.metrics.redis_series import queue_depth

    pipe = redis.pipeline(transaction=False)
    for queue in queues:
        key = keys.queue_consumers(queue)
        pipe.zadd(key, {hostname: now})
        pipe.zremrangebyscore(key, "-inf", now - CONSUMER_STALE_S)
        pipe.zcard(key)
        pipe.expire(key, keys.QUEUE_CONSUMERS_TTL_S)
    pipe.hlen(keys.CELERY_UNACKED)
    replies = pipe.execute()
    consumers = max(int(replies[i * 4 + 2]) for i in range(len(queues)))
    return int(replies[-1]), sum(queue_depth(redis, q) for q in queues), consumers


def leave_queues(redis: Any, queues: list[str], hostname: str) -> None:
    """Stop counting as a consumer of ``queues`` (a worker shutting down). Otherwise its entry
    would halve a lone successor's window until it goes stale (``CONSUMER_STALE_S``)."""
    pipe = redis.pipeline(transaction=False)
    for queue in queues:
        pipe.zrem(keys.queue_consumers(queue), hostname)
    pipe.execute()


class GovernorPrefetch(bootsteps.StartStopStep):
    """The step; ``make_prefetch_step`` makes it for one worker (its class attributes)."""

    requires = {"celery.worker.consumer.tasks:Tasks"}
    #: the worker context once it is built (None before)
    get_state: Callable[[], Any | None]
    chunk_size: int
    concurrency: int
    interval: float
    #: the queues this worker consumes (None: no fair share, the window is the governor's alone)
    queues: list[str] | None

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.tref: Any = None
        self.hostname = getattr(parent, "hostname", None) or socket.gethostname()
        self.heartbeat = Heartbeat(self.hostname, self.queues)

    def start(self, c: Any) -> None:
        self.tref = c.timer.call_repeatedly(self.interval, self.adjust, (c,), priority=10)

    def stop(self, c: Any) -> None:
        if self.tref is not None:
            self.tref.cancel()
            self.tref = None
        ctx = self.get_state()
        if self.queues and ctx is not None:
            try:
                leave_queues(ctx.redis, self.queues, self.hostname)
            except Exception:  # Redis away: the entry goes stale on its own
                log.debug("could not leave the queues' consumers", exc_info=True)

    def adjust(self, c: Any) -> None:
        ctx = self.get_state()
        if ctx is None or c.qos is None:
            return
        reserved = list(worker_state.reserved_requests)
        eta_held = sum(1 for r in reserved if getattr(r, "eta", None))
        want = desired_prefetch(ctx.loop.desired_backlog(), self.chunk_size, self.concurrency, 0)
        if self.queues:
            try:
                unacked, ready, consumers = queue_peers(ctx.redis, self.queues, self.hostname, time.time())
                want = fair_share(want, unacked, ready, consumers)
            except Exception:  # Redis away: the governor's window alone
                log.debug("queue peers unavailable", exc_info=True)
        want += eta_held
        with c.qos._mutex:
            if c.qos.value != want:
                log.debug("prefetch %s -> %s", c.qos.value, want)
                c.qos.value = want
        c.qos.update()
        self.heartbeat.beat(ctx, want)  # the worker's state with this window, once a second


def make_prefetch_step(get_state: Callable[[], Any | None], chunk_size: int, concurrency: int,
                       interval: float = 1.0, queues: list[str] | None = None) -> type[bootsteps.StartStopStep]:
    """``get_state`` returns the worker context once it is built (None before); ``queues`` are the
    ones this worker consumes (None: no fair share, the window is the governor's alone)."""

    class Step(GovernorPrefetch):
        # bootsteps name a step by its module and class: the name it always had
        name = f"{__name__}.GovernorPrefetch"

    Step.get_state = staticmethod(get_state)
    Step.chunk_size, Step.concurrency, Step.interval, Step.queues = chunk_size, concurrency, interval, queues
    return Step

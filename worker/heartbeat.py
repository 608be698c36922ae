"""A worker's presence in Redis, refreshed once a second (by the prefetch step, worker.prefetch,
with the window it just set):

- its state (``keys.worker_state``, ``STATE_TTL_S``): the engine loop's and the governor's state
  (metrics, ``ocrq governor``), its prefetch window, GC counters, its start (worker.startup); what
  producers read: the allowed roots they check local refs against (ocrq.refs.effective_roots),
  the store it writes, its engine's capabilities (ocrq.capabilities) and its queues; what the
  jobs page's fleet view shows: its engine, device and device memory; and whose it is, its process
  (host, pid, var dir: ``ocrq up`` elsewhere refuses a second worker of its name on this Redis,
  ``ocrq down`` elsewhere points at its stack, ocrq_cli.embedded.stack);
- what its governor learned (``keys.governor_profile``), saved when it learned something new.
  Workers on identical GPUs share the key (docs/gpu.md): the snapshot that has seen the most
  batches stays (one script), so a worker that started cold next to a warm one does not replace
  the warm one's learning with its first few batches.

Best effort: a Redis away costs a beat, never the worker.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from typing import Any

from ocrq import keys
from ocrq.broker import scripts
from ocrq.refs import effective_roots
from worker import gcwatch

log = logging.getLogger("ocrq.prefetch")

#: a worker whose state has not been refreshed for this long is gone
STATE_TTL_S = 60


def worker_state(ctx: Any, queues: list[str] | None, prefetch: int) -> dict[str, Any]:
    """What the worker says of itself (``ctx``: its ``WorkerContext``)."""
    st = dict(ctx.loop.state())
    st["prefetch"] = prefetch
    st["gc"] = gcwatch.snapshot()
    st["start"] = ctx.startup.state()  # where the worker's start went (worker.startup)
    # producers check local refs against these before publishing (producer.intake)
    st["allowed_roots"] = [str(r) for r in effective_roots(ctx.settings.limits)]
    st["store"] = ctx.store.location  # and read results from where workers write them
    # what its engine honours, and where: producers refuse a task no live worker of the job's
    # queue can run (ocrq.capabilities); and what the jobs page's fleet view shows: the engine,
    # the device and its memory
    st["capabilities"] = ctx.capabilities()
    st["queues"] = list(queues or [ctx.settings.queue.name])
    st["engine_kind"] = ctx.settings.engine.kind
    probe = getattr(ctx.loop, "probe", None)
    st["device"] = getattr(probe, "device", None)
    mem = probe.read() if probe is not None else None
    st["device_memory"] = {"used": mem.used, "total": mem.total} if mem is not None else None
    # whose this worker is: `ocrq up` elsewhere refuses a second worker of this name on this
    # Redis, `ocrq down` elsewhere points at this stack (ocrq_cli.embedded.stack)
    st["process"] = {"host": socket.gethostname(), "pid": os.getpid(),
                     "var_dir": str(ctx.settings.var_dir.resolve())}
    return st


def save_snapshot(client: Any, key: str, snapshot: dict[str, Any], observations: int) -> bool:
    """Store a governor snapshot unless the key holds one that has seen more batches (one atomic
    script, so two workers saving at once cannot interleave). Returns whether it was written."""
    return bool(client.eval(scripts.source("governor_save"), 1, key, json.dumps(snapshot), observations,
                            keys.GOVERNOR_PROFILE_TTL_S))


class Heartbeat:
    """The beat of worker ``hostname`` consuming ``queues``."""

    def __init__(self, hostname: str, queues: list[str] | None) -> None:
        self.hostname = hostname
        self.queues = queues
        self._saved_observations = -1

    def beat(self, ctx: Any, prefetch: int) -> None:
        """Its state, then its governor's snapshot when there is news."""
        try:
            state = worker_state(ctx, self.queues, prefetch)
            ctx.redis.set(keys.worker_state(self.hostname), json.dumps(state, default=str), ex=STATE_TTL_S)
            self.save_governor(ctx)
        except Exception:  # metrics and the snapshot are best effort
            log.debug("worker state publish failed", exc_info=True)

    def save_governor(self, ctx: Any) -> None:
        """Persist what the governor learned, when it learned something new (the key's TTL is
        refreshed then too)."""
        governor = ctx.loop.governor
        seen = governor.calibrator.observations
        if ctx.governor_key is None or seen in (0, self._saved_observations):
            return
        save_snapshot(ctx.redis, ctx.governor_key, governor.snapshot(), seen)
        self._saved_observations = seen

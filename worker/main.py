"""Start a worker process: settings → Celery app → tasks → engine (before consuming) → consume."""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

from celery import Celery, signals

from ocrq.broker import publish
from ocrq.broker.queue import make_celery
from ocrq.jobs.feed import Feed
from ocrq.settings import Settings
from worker import gcwatch
from worker.context import WorkerContext, build_context
from worker.export_sweep import ExportSweep, ExportSweeper
from worker.feeder import Feeder
from worker.memory.nvml import pin_pci_order
from worker.prefetch import make_prefetch_step
from worker.reaper import make_reaper_step
from worker.startup import StartupClock
from worker.tasks import register_tasks

log = logging.getLogger("ocrq.worker")


def run_worker(settings: Settings, *, queues: list[str] | None = None, hostname: str | None = None,
               concurrency: int | None = None) -> None:
    startup = StartupClock()
    startup.mark("interpreter")
    pin_pci_order(os.environ)  # before any engine initialises CUDA
    gcwatch.install()
    app = make_celery(settings)
    holder: dict[str, WorkerContext] = {}

    def get_ctx() -> WorkerContext:
        return holder["ctx"]

    register_tasks(app, get_ctx)
    # only ocrq's two tasks run here: Celery's built-ins (chords, map/starmap, result cleanup) are
    # no part of ocrq, and a message naming one is refused as unregistered like any other name
    for name in [n for n in app.tasks if n.startswith("celery.")]:
        del app.tasks[name]
    conc = concurrency or settings.queue.concurrency
    app.steps["consumer"].add(make_prefetch_step(lambda: holder.get("ctx"), settings.queue.chunk_size, conc,
                                                 queues=queues or [settings.queue.name]))
    app.steps["consumer"].add(make_reaper_step(
        lambda: ctx.redis if (ctx := holder.get("ctx")) else None,
        settings.redis.dead_worker_s, settings.redis.reaper_interval_s,
    ))

    @signals.worker_init.connect(weak=False)
    def _start_engine(sender: Any = None, **_: Any) -> None:
        # which device this process was given, in its log: Celery's process title (setproctitle)
        # overwrites /proc/<pid>/environ, so the log is where ops (and tests) can read it back
        log.info("device: CUDA_VISIBLE_DEVICES=%s CUDA_DEVICE_ORDER=%s metrics port %s",
                 os.environ.get("CUDA_VISIBLE_DEVICES", "-"), os.environ.get("CUDA_DEVICE_ORDER", "-"),
                 settings.metrics_port or "-")
        startup.mark("celery")
        # the engine is ready before the consumer takes its first message
        # (the worker's node name, as Celery expanded it: what its records name)
        ctx = holder["ctx"] = _context_or_exit(settings, queues, startup, getattr(sender, "hostname", None))
        start_services(app, ctx, startup, hostname)

    @signals.worker_ready.connect(weak=False)
    def _ready(**_: Any) -> None:
        startup.ready()
        log.info("worker %s", startup.summary())
        if (ctx := holder.get("ctx")) is not None:
            ctx.metrics.observe_start(startup)

    @signals.worker_shutdown.connect(weak=False)
    def _stop_engine(**_: Any) -> None:
        ctx = holder.pop("ctx", None)
        if ctx is not None:
            ctx.close()

    name = hostname or f"ocrq-{settings.engine.kind}@{socket.gethostname()}"
    app.worker_main(argv=[
        "worker", "--pool=threads", f"--concurrency={conc}", "-Q", ",".join(queues or [settings.queue.name]),
        "-n", name, "-E", f"--loglevel={settings.log_level}", "--without-gossip", "--without-mingle",
    ])


def _context_or_exit(settings: Settings, queues: list[str] | None, startup: StartupClock,
                     node: str | None) -> WorkerContext:
    """The worker's context, or exit 1 with the reason: Celery logs what a start signal's handler
    raises and consumes anyway, and a worker without its engine would say "ready" and fail every task."""
    try:
        return build_context(settings, queues, startup, node)
    except Exception as exc:
        log.critical("worker cannot start: %s", exc, exc_info=True)
        raise SystemExit(1) from exc


def start_services(app: Celery, ctx: WorkerContext, startup: StartupClock, hostname: str | None) -> None:
    """The worker's services (the feeder, the export sweep), its engine started; then its heap
    frozen. ``hostname``: the ``--name`` it was given."""
    settings = ctx.settings
    q = settings.queue
    ctx.feeder = Feeder(Feed(ctx.redis, ctx.store, ctx.index, app, window=q.window, chunk_size=q.chunk_size,
                             max_message_bytes=q.max_message_bytes))
    ctx.feeder.start()
    ctx.sweeper = ExportSweeper(ExportSweep(
        ctx.redis, ctx.index, lambda job, tid, queue: publish.finish(app, job, tid, queue, declare=False),
        interval_s=settings.redis.export_sweep_s, stale_s=settings.redis.export_stale_s,
        ttl=settings.redis.job_ttl, default_queue=q.name, owner=hostname or socket.gethostname()))
    ctx.sweeper.start()
    startup.mark("services")
    # what exists now (vLLM, torch, the engine: millions of objects) lives as long as the
    # process: out of the collector's reach, a full collection no longer walks it with the GIL
    # held (the H200 worker: 10 full collections, 9.6 s, by the end of its first job)
    log.info("gc: %d objects frozen after the engine start", gcwatch.freeze())
    startup.mark("gc")

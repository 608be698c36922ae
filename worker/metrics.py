"""What one worker process serves on ``OCRQ_METRICS_PORT`` (prometheus-client, own registry).

Fed by events: the chunk task reports every image record it writes (``observe_records``) and
every cache lookup; the engine loop reports every engine call (``observe_batch``). Read at scrape
time: OOMs and the governor's budget / predicted / measured peak (``EngineLoop.state``), device
memory from NVML (``device="none"`` and 0 on a host without a GPU), ``ocrq_queue_depth`` of
the queues this worker consumes and the broker Redis's memory against its
maxmemory. Series names are a contract with ops/alerts.yml and the
Grafana dashboard (ops/grafana/); tests/integration/test_prometheus.py checks them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ocrq.errors import Permanent, Retryable
from ocrq.messages import TASKS
from ocrq.metrics import server as metrics_server
from ocrq.metrics.redis_series import queue_depth_family, redis_memory_families, replication_families
from ocrq.results import ImageRecord, ImageStatus
from ocrq.settings import RedisSettings
from worker.memory.nvml import MemoryProbe
from worker.startup import StartupClock

log = logging.getLogger("ocrq.worker.metrics")

_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class _LiveCollector(Collector):
    """Series whose truth lives elsewhere, read on each scrape (no copies to keep in step)."""

    def __init__(self, state: Callable[[], dict[str, Any]], probe: MemoryProbe, device: str,
                 redis: Any, queues: list[str], rs: RedisSettings | None = None) -> None:
        self.state = state
        self.rs = rs
        self.probe = probe
        self.device = device
        self.redis = redis
        self.queues = queues

    def collect(self) -> Iterator[Metric]:
        st = self.state()
        yield CounterMetricFamily("ocrq_oom", "Engine calls that ran out of device memory.",
                                  value=float(st.get("oom_events", 0)))
        for name, field, help_ in (
            ("budget", "budget_bytes", "Device bytes the VRAM governor may plan a batch into."),
            ("predicted_peak", "predicted_peak_bytes", "Peak bytes the governor predicted for its last batch."),
            ("measured_peak", "measured_peak_bytes", "Peak bytes the engine measured for its last batch."),
        ):
            yield GaugeMetricFamily(f"ocrq_governor_{name}_bytes", help_, value=float(st.get(field) or 0))
        mem = self.probe.read()
        device = self.device if mem is not None else "none"
        used = GaugeMetricFamily("ocrq_gpu_memory_used_bytes", "Device memory in use (NVML, all processes).",
                                 labels=["device"])
        total = GaugeMetricFamily("ocrq_gpu_memory_total_bytes", "Device memory size (NVML).", labels=["device"])
        used.add_metric([device], float(mem.used if mem else 0))
        total.add_metric([device], float(mem.total if mem else 0))
        yield used
        yield total
        try:
            yield queue_depth_family(self.redis, self.queues)
            yield from redis_memory_families(self.redis, "broker")
            yield from replication_families(self.redis, self.rs)
        except Exception as exc:  # Redis away: the worker's own series still scrape
            log.debug("queue depth unavailable: %s", exc)


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.images = Counter("ocrq_images", "Images finished by this worker, by task and outcome "
                              "(done: the engine ran; cached: a cache hit; failed: for good).",
                              ["task", "outcome"], registry=r)
        self.retries = Counter("ocrq_retries", "Image attempts handed back for a retry, by error type.",
                               ["reason"], registry=r)
        self.failures = Counter("ocrq_image_failures", "Images failed for good, by error type.",
                                ["reason"], registry=r)
        self.dropped = Counter("ocrq_messages_dropped", "Broker messages (chunk, finish) or chunk items (item) "
                               "dropped unread: no job name or image id ocrq writes (a message not from its "
                               "producer).", ["what"], registry=r)
        for what in ("chunk", "finish", "item"):
            self.dropped.labels(what)
        self.cache_hits = Counter("ocrq_cache_hits", "Cache lookups that found a result.", registry=r)
        self.cache_misses = Counter("ocrq_cache_misses", "Cache lookups that went to the engine.", registry=r)
        self.batch_size = Histogram("ocrq_batch_size", "Images per engine call.", buckets=_BATCH_SIZES,
                                    registry=r)
        self.batch_seconds = Histogram("ocrq_batch_seconds", "Seconds per engine call.", buckets=_SECONDS,
                                       registry=r)
        self.image_seconds = Histogram("ocrq_image_seconds", "Seconds from a chunk's start to an image's "
                                       "result being stored (fetch, decode, queueing, inference, store).",
                                       buckets=_SECONDS, registry=r)
        # every known label value shows (at 0) before it first happens, so rate() and increase()
        # see the first failure of a fresh worker (a series born at 1 has no increase)
        for task in TASKS:
            for outcome in ("done", "cached", "failed"):
                self.images.labels(task, outcome)
        for retryable in Retryable.__subclasses__():
            self.retries.labels(retryable.__name__)
        for permanent in Permanent.__subclasses__():
            self.failures.labels(permanent.__name__)
        self.start_seconds = Gauge("ocrq_worker_start_seconds", "Seconds of this worker's start, by phase "
                                   "(worker.startup; engine.* are the engine's own parts of its phase).",
                                   ["phase"], registry=r)
        self.ready_seconds = Gauge("ocrq_worker_ready_seconds", "Seconds from this worker's process start "
                                   "to taking work.", registry=r)
        self._server: Any = None

    def watch(self, state: Callable[[], dict[str, Any]], probe: MemoryProbe, device: str, redis: Any,
              queues: list[str], rs: RedisSettings | None = None) -> None:
        self.registry.register(_LiveCollector(state, probe, device, redis, queues, rs))

    # ---- events -------------------------------------------------------------------------------

    def observe_start(self, startup: StartupClock) -> None:
        for phase, seconds in {**startup.phases, **startup.detail}.items():
            self.start_seconds.labels(phase).set(seconds)
        self.ready_seconds.set(startup.ready_s or 0.0)

    def observe_batch(self, size: int, seconds: float) -> None:
        self.batch_size.observe(size)
        self.batch_seconds.observe(seconds)

    def observe_dropped(self, what: str, n: int) -> None:
        self.dropped.labels(what).inc(n)

    def observe_cache(self, hits: int, misses: int) -> None:
        self.cache_hits.inc(hits)
        self.cache_misses.inc(misses)

    def observe_records(self, task: str, records: Iterable[ImageRecord], seconds: float | None = None) -> None:
        for rec in records:
            if rec.status == ImageStatus.retrying:
                self.retries.labels(rec.error.type if rec.error else "unknown").inc()
            elif rec.status == ImageStatus.failed:
                self.images.labels(task, "failed").inc()
                self.failures.labels(rec.error.type if rec.error else "unknown").inc()
            elif rec.status == ImageStatus.done:
                self.images.labels(task, "cached" if rec.cached else "done").inc()
                if seconds is not None:
                    self.image_seconds.observe(seconds)

    # ---- serving ------------------------------------------------------------------------------

    def serve(self, addr: str, port: int, credentials: str | None = None) -> bool:
        """Start the HTTP server (a daemon thread; ``credentials``: basic auth, ocrq.metrics.server).
        A port already taken is logged, not fatal: the worker's job is OCR, and its state still
        reaches Redis for ``ocrq metrics``."""
        try:
            self._server, _ = metrics_server.start(self.registry, addr, port, credentials)
        except OSError as exc:
            log.warning("metrics server on %s:%d not started: %s", addr, port, exc)
            return False
        log.info("serving worker metrics on http://%s:%d/metrics%s", addr, port,
                 " (basic auth)" if credentials else "")
        return True

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None

"""Prometheus series read from Redis: queue depth (priority levels summed), unacked messages, failed
images and per-job status counts of the most recent jobs, the broker's memory against its
maxmemory, and every live worker's governor state.

    ocrq metrics --port 9808        # then scrape http://host:9808/metrics

One exporter per Redis is enough for these fleet-level series (they read shared state). Each
worker also serves its own counters and histograms on ``OCRQ_METRICS_PORT`` (worker.metrics),
including ``ocrq_queue_depth`` of the queues it consumes. prometheus-client writes the format
(types, HELP, escaping, OpenMetrics negotiation) and runs the HTTP server.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from redis.exceptions import RedisError

from ocrq import keys
from ocrq.broker import redis_conn
from ocrq.jobs.index import COST_FIELDS
from ocrq.metrics import server as metrics_server
from ocrq.settings import RedisSettings

log = logging.getLogger("ocrq.metrics")

#: kombu's Redis transport keeps priority n > 0 of queue Q in the list Q + "\x06\x16" + n
_PRIORITY_SEP = "\x06\x16"
#: governor/engine state fields exported as gauges (others are informational)
_WORKER_GAUGES = (
    "batch_size", "count_limit", "capacity_bytes", "budget_bytes", "predicted_peak_bytes",
    "measured_peak_bytes", "calibration_error", "oom_count", "oom_events", "pressure_count",
    "prefetch", "pending", "inflight", "images", "batches", "too_large", "engine_errors",
)
#: per-job counts are exported for the most recent jobs only (bounded label cardinality)
_RECENT_JOBS = 50


def queue_depth(redis: Any, queue: str) -> int:
    names = [queue] + [f"{queue}{_PRIORITY_SEP}{p}" for p in range(1, 10)]
    pipe = redis.pipeline(transaction=False)
    for name in names:
        pipe.llen(name)
    return int(sum(pipe.execute()))


def queue_depth_family(redis: Any, queues: Iterable[str]) -> GaugeMetricFamily:
    fam = GaugeMetricFamily("ocrq_queue_depth", "Messages (chunks of refs) waiting in a broker queue.",
                            labels=["queue"])
    for q in queues:
        fam.add_metric([q], queue_depth(redis, q))
    return fam


def redis_memory_families(redis: Any, role: str) -> Iterator[GaugeMetricFamily]:
    """The Redis server's ``used_memory`` and ``maxmemory`` (0: no limit), labelled by its role
    (``broker``, ``cache``): what the broker-memory alert compares (ops/alerts.yml)."""
    info = redis.info("memory")
    for name, field, help_ in (("used", "used_memory", "Bytes the Redis server holds (INFO used_memory)."),
                               ("max", "maxmemory", "The Redis server's maxmemory (0: no limit).")):
        fam = GaugeMetricFamily(f"ocrq_redis_memory_{name}_bytes", help_, labels=["role"])
        fam.add_metric([role], float(info.get(field, 0)))
        yield fam


def replication_families(redis: Any, rs: RedisSettings | None) -> Iterator[GaugeMetricFamily]:
    """The broker's master (an info series: its address and replication id, which change at a
    failover), Sentinel's config epoch for it (it grows by one per failover; 0 without Sentinel),
    its replicas in sync and each one's lag in bytes and seconds (ops/alerts.yml)."""
    info = redis.info("replication")
    found = redis_conn.master_address(rs) if rs is not None else None
    if found is None:  # a plain URL: the server this client talks to
        kwargs = getattr(getattr(redis, "connection_pool", None), "connection_kwargs", {})
        found = (kwargs.get("host", ""), kwargs.get("port", 0))
    address = "{}:{}".format(*found)
    master = GaugeMetricFamily("ocrq_redis_master", "The broker's master (1): address (Sentinel's) and "
                               "replication id; a new series at each failover.", labels=["address", "replid"])
    master.add_metric([address, str(info.get("master_replid", ""))], 1.0)
    yield master
    epoch = 0.0
    if rs is not None and redis_conn.is_sentinel(rs.url):
        for sentinel in redis_conn.sentinel_for(rs).sentinels:  # the first that answers
            try:
                state = sentinel.sentinel_master(rs.master_name)
            except RedisError:
                continue
            if isinstance(state, dict):
                epoch = float(state.get("config-epoch", 0))
                break
    yield GaugeMetricFamily("ocrq_redis_sentinel", "1 when the broker's URL names Sentinels.",
                            value=1.0 if rs is not None and redis_conn.is_sentinel(rs.url) else 0.0)
    yield GaugeMetricFamily("ocrq_redis_config_epoch", "Sentinel's configuration epoch of the broker's master "
                            "(+1 per failover; 0 without Sentinel).", value=epoch)
    yield GaugeMetricFamily("ocrq_redis_connected_replicas", "Replicas connected to the broker's master.",
                            value=float(info.get("connected_slaves", 0)))
    lag_bytes = GaugeMetricFamily("ocrq_redis_replica_lag_bytes", "Replication offset a replica is behind "
                                  "the master by.", labels=["replica"])
    lag_s = GaugeMetricFamily("ocrq_redis_replica_lag_seconds", "Seconds since a replica last acknowledged "
                              "the replication stream.", labels=["replica"])
    offset = int(info.get("master_repl_offset", 0))
    for name, value in sorted(info.items()):
        if name.startswith("slave") and isinstance(value, dict):
            replica = f"{value.get('ip')}:{value.get('port')}"
            lag_bytes.add_metric([replica], float(max(0, offset - int(value.get("offset", 0)))))
            lag_s.add_metric([replica], float(value.get("lag", 0)))
    yield lag_bytes
    yield lag_s


class RedisCollector(Collector):
    """Reads the shared state on every scrape. A Redis that is down makes the scrape fail
    (prometheus-client answers 500), so ``up`` stays 1 but the series go stale: alert on absence."""

    def __init__(self, redis: Any, queues: list[str], rs: RedisSettings | None = None) -> None:
        self.redis = redis
        self.queues = queues
        self.rs = rs

    def collect(self) -> Iterator[Metric]:
        r = self.redis
        yield queue_depth_family(r, self.queues)
        yield GaugeMetricFamily("ocrq_unacked_messages", "Messages delivered to workers and not yet acknowledged.",
                                value=int(r.hlen(keys.CELERY_UNACKED)))
        jobs = GaugeMetricFamily("ocrq_job_images", "Images of a job by status (most recent jobs).",
                                 labels=["job", "status"])
        failed = 0
        for raw in r.zrevrange(keys.JOBS, 0, _RECENT_JOBS - 1):
            job = raw.decode()
            for status, n in sorted(r.hgetall(keys.job_counts(job)).items()):
                name = status.decode()
                if name in COST_FIELDS:
                    continue
                jobs.add_metric([job, name], int(n))
                failed += int(n) if name == "failed" else 0
        yield GaugeMetricFamily("ocrq_failed_images", "Failed images of the most recent jobs (ocrq failed / "
                                "ocrq reprocess).", value=failed)
        yield jobs
        yield from redis_memory_families(r, "broker")
        yield from replication_families(r, self.rs)
        workers = GaugeMetricFamily("ocrq_worker", "Governor and engine-loop state of each live worker.",
                                    labels=["worker", "field"])
        for key in sorted(r.scan_iter(keys.worker_state("*"), count=200)):
            raw_state = r.get(key)
            if not raw_state:
                continue
            node = key.decode()[len(keys.worker_state("")):]
            state = json.loads(raw_state)
            for name in _WORKER_GAUGES:
                value = state.get(name)
                if isinstance(value, int | float) and not isinstance(value, bool):
                    workers.add_metric([node, name], value)
        yield workers


def serve(redis: Any, queues: list[str], host: str, port: int, rs: RedisSettings | None = None,
          credentials: str | None = None) -> None:
    """Serve the exporter until the process is stopped (``rs``: the settings, for Sentinel's
    view of the master; ``credentials``: basic auth, ocrq.metrics.server)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RedisCollector(redis, queues, rs))
    server, thread = metrics_server.start(registry, host, port, credentials)
    log.info("serving metrics on http://%s:%d/metrics%s", host, port, " (basic auth)" if credentials else "")
    try:
        thread.join()
    finally:
        server.shutdown()

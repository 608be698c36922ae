"""Prometheus metrics for the fleet, read from Redis: queue depth (Flower has none), unacked
messages, the failed registry, per-job status counts and every live worker's governor state.

    ocrq metrics --port 9808        # then scrape http://host:9808/metrics

One exporter per Redis is enough (it reads shared state; workers need no HTTP port).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ocrq import keys

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


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _line(name: str, value: float, **labels: str) -> str:
    inner = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
    return f"{name}{{{inner}}} {value}" if inner else f"{name} {value}"


def queue_depth(redis: Any, queue: str) -> int:
    names = [queue] + [f"{queue}{_PRIORITY_SEP}{p}" for p in range(1, 10)]
    pipe = redis.pipeline(transaction=False)
    for name in names:
        pipe.llen(name)
    return int(sum(pipe.execute()))


def render(redis: Any, queues: Iterable[str]) -> str:
    out = [
        "# HELP ocrq_queue_depth Messages (chunks of refs) waiting in a broker queue.",
        "# TYPE ocrq_queue_depth gauge",
    ]
    out += [_line("ocrq_queue_depth", queue_depth(redis, q), queue=q) for q in queues]
    out += [
        "# HELP ocrq_unacked_messages Messages delivered to workers and not yet acknowledged.",
        "# TYPE ocrq_unacked_messages gauge",
        _line("ocrq_unacked_messages", int(redis.hlen("unacked"))),
        "# HELP ocrq_failed_images Images in the failed registry (ocrq failed / ocrq reprocess).",
        "# TYPE ocrq_failed_images gauge",
        _line("ocrq_failed_images", int(redis.zcard(keys.FAILED))),
        "# HELP ocrq_job_images Images of a job by status (most recent jobs).",
        "# TYPE ocrq_job_images gauge",
    ]
    for raw in redis.zrevrange(keys.JOBS, 0, _RECENT_JOBS - 1):
        job = raw.decode()
        counts = redis.hgetall(keys.job_counts(job))
        for status, n in sorted(counts.items()):
            out.append(_line("ocrq_job_images", int(n), job=job, status=status.decode()))
    out += ["# HELP ocrq_worker Governor and engine-loop state of each live worker.",
            "# TYPE ocrq_worker gauge"]
    for key in sorted(redis.scan_iter(keys.worker_state("*"), count=200)):
        raw_state = redis.get(key)
        if not raw_state:
            continue
        node = key.decode()[len(keys.worker_state("")):]
        state = json.loads(raw_state)
        for field in _WORKER_GAUGES:
            value = state.get(field)
            if isinstance(value, int | float) and not isinstance(value, bool):
                out.append(_line("ocrq_worker", value, worker=node, field=field))
    return "\n".join(out) + "\n"


def serve(redis: Any, queues: list[str], host: str, port: int) -> None:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if self.path.split("?")[0] not in ("/metrics", "/"):
                self.send_error(404)
                return
            try:
                body = render(redis, queues).encode()
            except Exception as exc:  # Redis down: say so with a 503, keep serving
                log.warning("metrics render failed: %s", exc)
                self.send_error(503, str(exc))
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    log.info("serving metrics on http://%s:%d/metrics", host, port)
    server.serve_forever()

"""The fleet as its page shows it: each live worker (what it publishes every second under
``keys.worker_state``: engine, device, the governor's budget and batch sizes), each queue's depth
per priority level, and the broker's memory against its ``maxmemory``.

Only what a tenant may see of the fleet: no paths (roots, store, var dir), no process ids, no
URL of Redis. Cost: one ``SCAN`` of the worker states and one ``MGET``, one pipeline of the queue
lengths (ten lists a queue: kombu keeps priority n > 0 of queue Q in ``Q\\x06\\x16n``), one
``INFO memory``.
"""

from __future__ import annotations

import json
import time
from typing import Any

from api import pages_format as fmt
from api.service import Service
from ocrq import keys
from ocrq.redact import redact_url

#: kombu's list of priority level n > 0 of a queue (ocrq.metrics.redis_series reads the same)
PRIORITY_SEP = "\x06\x16"
PRIORITIES = range(10)


def _workers(svc: Service) -> list[tuple[str, dict[str, Any]]]:
    found = sorted(svc.redis.scan_iter(keys.worker_state("*"), count=200))
    out = []
    for key, raw in zip(found, svc.redis.mget(found) if found else [], strict=True):
        try:
            state = json.loads(raw) if raw else None
        except ValueError:
            continue
        if isinstance(state, dict):
            out.append((key.decode()[len(keys.worker_state("")):], state))
    return out


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def worker_row(name: str, st: dict[str, Any]) -> dict[str, Any]:
    """One worker's cells (every value shown as text: a worker's state is read as untrusted)."""
    def num(field: str) -> float | None:
        return _number(st.get(field))

    mem = st.get("device_memory")
    used, total = (_number(mem.get("used")), _number(mem.get("total"))) if isinstance(mem, dict) else (None, None)
    start = st.get("start")
    ready = _number(start.get("ready_s")) if isinstance(start, dict) else None
    queues: list[Any] = st["queues"] if isinstance(st.get("queues"), list) else []
    device = str(st.get("device") or "") or "none"
    budget, capacity = num("budget_bytes"), num("capacity_bytes")
    return {
        "key": name, "name": name[:200],
        "engine": str(st.get("engine_kind") or "?")[:40],
        "device": device[:80] if device != "none" else "CPU (no GPU)",
        "device_memory": f"{fmt.size(used)} / {fmt.size(total)}" if total else "–",
        "mode": str(st.get("mode") or "?")[:20],
        "budget": f"{fmt.size(budget)} / {fmt.size(capacity)}" if budget else "–",
        "batch": f"{fmt.count(num('batch_size'))} (limit {fmt.count(num('count_limit'))})",
        "peaks": f"{fmt.size(num('predicted_peak_bytes'))} / {fmt.size(num('measured_peak_bytes'))}",
        "inflight": f"{fmt.count(num('inflight'))} + {fmt.count(num('pending'))}",
        "images": fmt.count(num("images")), "batches": fmt.count(num("batches")),
        "rate": fmt.rate(num("engine_img_s")), "ooms": fmt.count(num("oom_events")),
        "queues": ", ".join(str(q)[:60] for q in queues)[:200] or "–",
        "ready": fmt.duration(ready),
    }


def queue_names(svc: Service, workers: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """The configured queue, those the workers say they consume, and those with consumers."""
    found = {svc.settings.queue.name}
    for _, st in workers:
        queues = st.get("queues")
        if isinstance(queues, list):
            found.update(q for q in queues if isinstance(q, str))
    prefix = keys.queue_consumers("")
    found.update(k.decode()[len(prefix):] for k in svc.redis.scan_iter(keys.queue_consumers("*"), count=200))
    return sorted(q for q in found if q and len(q) <= 200)


def queue_rows(svc: Service, queues: list[str]) -> list[dict[str, Any]]:
    """Each queue's messages by priority level (levels with none left out), then its total."""
    pipe = svc.redis.pipeline(transaction=False)
    for q in queues:
        for p in PRIORITIES:
            pipe.llen(q if p == 0 else f"{q}{PRIORITY_SEP}{p}")
    lengths = pipe.execute()
    rows = []
    for i, q in enumerate(queues):
        levels = [int(n) for n in lengths[i * len(PRIORITIES):(i + 1) * len(PRIORITIES)]]
        for p, n in zip(PRIORITIES, levels, strict=True):
            if n:
                rows.append({"key": f"{q}:{p}", "queue": q, "priority": f"{p}" + (" (most urgent)" if p == 0 else ""),
                             "messages": fmt.count(n), "total": False})
        rows.append({"key": f"{q}:all", "queue": q, "priority": "all", "messages": fmt.count(sum(levels)),
                     "total": True})
    return rows


def memory(svc: Service) -> dict[str, Any]:
    """The broker's ``used_memory`` against its ``maxmemory`` (0: no limit), and where
    submissions start being refused (``redis.refuse_submit_at``)."""
    info = svc.redis.info("memory")
    used, limit = int(info.get("used_memory", 0)), int(info.get("maxmemory", 0))
    refuse = svc.settings.redis.refuse_submit_at
    return {"used": used, "max": limit, "refuse_at": refuse,
            "used_text": fmt.size(used), "max_text": fmt.size(limit) if limit else "no limit",
            "share": f"{used / limit:.0%}" if limit else "–",
            "policy": str(info.get("maxmemory_policy", ""))[:40],
            "refuse_text": f"new submissions are refused from {refuse:.0%} of it ({fmt.size(refuse * limit)})"
            if limit else "no maxmemory: Redis may grow until the host runs out"}


def fleet_page(svc: Service) -> dict[str, Any]:
    workers = _workers(svc)
    queues = queue_names(svc, workers)
    api = svc.settings.api
    return {
        "workers": [worker_row(n, st) for n, st in workers],
        "queues": queue_rows(svc, queues),
        "unacked": fmt.count(svc.redis.hlen(keys.CELERY_UNACKED)),
        "memory": memory(svc),
        "links": {"flower": redact_url(api.flower_url) if api.flower_url else None,
                  "prometheus": redact_url(api.prometheus_url) if api.prometheus_url else None},
        "read_at": fmt.clock(time.time()), "chunk_size": svc.settings.queue.chunk_size,
    }

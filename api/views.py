"""What the API (and the jobs page) says of a job: its state, counts, progress, rate, cost and
export, built from what the job index holds. A page of jobs is read in one Redis pipeline (three
commands a job), so listing costs the same whatever the number of jobs the tenant has.

States:

    queued      nothing of it is final yet, nothing running
    running     images in flight
    finalizing  every image final, its export being written
    succeeded   exported, every image done
    partial     exported, some images failed
    failed      exported, every image failed
    cancelling  cancelled, images it had started still running
    cancelled   cancelled and exported (what finished is in the export)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ocrq import keys, names
from ocrq.jobs.cost import cost_of
from ocrq.jobs.index import finished, parse_cost, parse_counts, parse_meta, settled
from ocrq.jobs.progress import RawProgress
from ocrq.jobs.progress import parse as parse_progress
from ocrq.redact import redact_url
from ocrq.settings import Settings
from producer.progress import summarise

STATES = ("queued", "running", "finalizing", "succeeded", "partial", "failed", "cancelling", "cancelled")
#: states a job stays in (the rest move on)
FINAL_STATES = ("succeeded", "partial", "failed", "cancelled")


def state(counts: dict[str, int], meta: dict[str, Any], submitting: bool) -> str:
    done_all = finished(counts) and not submitting
    exported = "archived" in meta
    if "cancelled" in meta:
        return "cancelled" if done_all and exported else "cancelling"
    if not done_all:
        started = settled(counts) + counts.get("running", 0) + counts.get("retrying", 0)
        return "running" if started or submitting else "queued"
    if not exported:
        return "finalizing"
    if counts["failed"] == 0:
        return "succeeded"
    return "failed" if counts["failed"] >= counts["total"] else "partial"


def read_raw(redis: Any, jobs: list[str], first: Callable[[Any], None] | None = None,
             then: Callable[[list[Any]], list[Any]] | None = None
             ) -> list[tuple[dict[bytes, bytes], dict[bytes, bytes], bool, dict[bytes, bytes]]]:
    """(meta, counts, submitting, progress) of each job, in one pipeline; ``first(pipe)`` queues commands
    before them (the request's rate count), whose answers ``then(answers)`` takes off."""
    pipe = redis.pipeline(transaction=False)
    if first is not None:
        first(pipe)
    for job in jobs:
        pipe.hgetall(keys.job(job))
        pipe.hgetall(keys.job_counts(job))
        pipe.exists(keys.job_submitting(job))
        pipe.hgetall(keys.job_progress(job))
    out = pipe.execute()
    if then is not None:
        out = then(out)
    return [(out[i], out[i + 1], bool(out[i + 2]), out[i + 3]) for i in range(0, len(out), 4)]


def job_views(redis: Any, settings: Settings, jobs: list[str], location: str,
              first: Callable[[Any], None] | None = None, then: Callable[[list[Any]], list[Any]] | None = None
              ) -> list[dict[str, Any] | None]:
    """The view of each job (None for one that has no meta: expired or never made)."""
    return [job_view(settings, job, parse_meta(meta), parse_counts(counts), parse_cost(counts), submitting,
                     location, parse_progress(progress)) if meta else None
            for job, (meta, counts, submitting, progress) in zip(jobs, read_raw(redis, jobs, first, then),
                                                                strict=True)]


def job_view(settings: Settings, job: str, meta: dict[str, Any], counts: dict[str, int], cost: dict[str, float],
             submitting: bool, location: str, raw: RawProgress | None = None) -> dict[str, Any]:
    created = float(meta.get("created") or 0)
    api = meta.get("api") or {}
    job_state = state(counts, meta, submitting)
    moving = summarise(job, counts, raw or RawProgress(0, {}), created, int(cost.get("engine_images", 0)),
                       cost.get("last_done") or None)
    rate = None if moving.img_per_s <= 0 and not moving.final else round(moving.img_per_s, 3)
    eta = 0.0 if job_state in FINAL_STATES or job_state == "finalizing" else (
        None if moving.eta_s is None else round(moving.eta_s, 1))
    spent = cost_of(counts, cost, meta, settings.gpu_hour_usd, settings.store.put_usd_per_1000,
                    settings.store.get_usd_per_1000, settings.cpu_hour_usd)
    total = counts["total"]
    view: dict[str, Any] = {
        "id": names.split(job)[1],
        "object": "job",
        "state": job_state,
        "created_at": int(created),
        "task": meta.get("task", "text"),
        "params": meta.get("params", {}),
        "priority": meta.get("priority"),
        "counts": {**{k: counts.get(k, 0) for k in ("total", "done", "cached", "failed", "cancelled", "queued",
                                                      "running", "retrying")},
                   "skipped": int(meta.get("skipped", 0))},
        "progress": round(moving.finished / total, 6) if total else (1.0 if job_state in FINAL_STATES else 0.0),
        "average_images_per_second": round(moving.avg_img_per_s, 3),
        "images_per_second": rate,
        "eta_seconds": eta,
        "cost": {"engine_seconds": round(spent.engine_seconds, 3), "unit": spent.unit, "device": spent.device,
                 "usd": round(spent.usd, 6),
                 "usd_per_1000_images": round(spent.usd_per_1000_images, 6),
                 "store_usd_per_1000_images": round(spent.store_usd_per_1000_images, 6)},
        "export": {"location": location + keys.export_prefix(job), "written": "archived" in meta,
                   "files": [keys.EXPORT_JSONL] + ([keys.EXPORT_PARQUET] if "parquet" in meta.get("exports", [])
                                                   else [])},
        "metadata": api.get("metadata") or {},
        "webhook_url": redact_url(meta["webhook"]) if meta.get("webhook") else None,
        "cancelled_at": meta.get("cancelled"),
        "finished_at": cost.get("last_done") or None if job_state in FINAL_STATES else None,
    }
    return view

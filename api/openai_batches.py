"""``/v1/batches`` as OpenAI serves it: a batch is a job made from an uploaded input file, one
image per line (``producer.openai_batch``: the same path as ``ocrq submit --openai-batch``, so
resume, partial output and per-line errors behave the same); its output and error files are the
job's OpenAI Batch export.

Status: ``in_progress`` while its images run, ``finalizing`` while its export is written, then
``completed`` (lines that failed are in the error file, as OpenAI's are); ``cancelling`` and
``cancelled`` (what finished is in the output file); ``failed`` when no line of the file could run
(``errors`` says why, line by line).
"""

from __future__ import annotations

import secrets
import time
from typing import Any, Literal

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, ConfigDict, Field

from api.auth import Caller, caller
from api.models import ERRORS
from api.openai_files import open_content, output_id
from api.service import Service
from api.uploads import InvalidRequest
from api.views import job_views
from api.webhooks import check_url
from ocrq import keys, names
from ocrq.jobs.events import Outbox
from producer.errors import UnknownJob
from producer.openai_batch import plan_batch, submit_batch

router = APIRouter(prefix="/v1/batches", tags=["openai batches"])

ENDPOINTS = ("/v1/chat/completions",)
_STATUS = {"queued": "in_progress", "running": "in_progress", "finalizing": "finalizing", "succeeded": "completed",
           "partial": "completed", "failed": "completed", "cancelling": "cancelling", "cancelled": "cancelled"}


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="allow")

    input_file_id: str = Field(max_length=64)
    endpoint: str
    completion_window: Literal["24h"] = "24h"
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    #: not OpenAI's: where this batch's webhooks go (else the tenant's webhook_url)
    webhook_url: str | None = Field(default=None, max_length=2048)


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]]


class Batch(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                    "cancelled"]
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    metadata: dict[str, str] | None


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Batch]
    has_more: bool
    first_id: str | None = None
    last_id: str | None = None


def batch_view(svc: Service, job: str) -> dict[str, Any]:
    found = job_views(svc.redis, svc.settings, [job], svc.client.store.location)[0]
    if found is None:
        raise UnknownJob(names.split(job)[1], "batch")
    batch = svc.client.index.meta(job).get("batch") or {}
    if not batch:
        raise UnknownJob(names.split(job)[1], "batch")
    return _shape(found, batch)


def _shape(job: dict[str, Any], batch: dict[str, Any]) -> dict[str, Any]:
    counts = job["counts"]
    status = "failed" if batch.get("failed") else _STATUS[job["state"]]
    exported = job["export"]["written"] or status == "failed"
    created = int(job["created_at"])
    finished = int(job["finished_at"]) if job["finished_at"] else None
    cancelled = int(job["cancelled_at"]) if job["cancelled_at"] else None
    rejected = int(batch.get("rejected", 0))
    return {
        "id": job["id"], "object": "batch", "endpoint": batch["endpoint"], "input_file_id": batch["input_file_id"],
        "errors": {"object": "list", "data": batch["errors"]} if batch.get("errors") else None,
        "completion_window": batch.get("completion_window", "24h"), "status": status,
        "output_file_id": output_id(job["id"], "output") if exported and status != "failed" else None,
        "error_file_id": output_id(job["id"], "errors") if exported and status != "failed" else None,
        "created_at": created, "in_progress_at": created if status != "failed" else None,
        "expires_at": created + 86_400, "finalizing_at": finished if status in ("finalizing", "completed") else None,
        "completed_at": finished if status == "completed" else None,
        "failed_at": created if status == "failed" else None, "expired_at": None,
        "cancelling_at": cancelled, "cancelled_at": (finished or cancelled) if status == "cancelled" else None,
        "request_counts": {"total": counts["total"] + rejected, "completed": counts["done"],
                           "failed": counts["failed"] + rejected},
        "metadata": batch.get("metadata"),
    }


@router.post("", response_model=Batch, responses=ERRORS)
def create(spec: BatchCreate, who: Caller = Depends(caller)) -> dict[str, Any]:
    """A batch from an uploaded input file (``purpose=batch``): every line is read and checked
    now; the lines that can run are submitted as one job, the others are in its error file."""
    svc, tenant = who.svc, who.tenant
    if spec.endpoint not in ENDPOINTS:
        raise InvalidRequest(f"endpoint {spec.endpoint!r}: ocrq serves {', '.join(ENDPOINTS)}")
    webhook = spec.webhook_url or tenant.settings.webhook_url
    if webhook:
        check_url(svc.settings, webhook)
    fh = open_content(svc, tenant.name, spec.input_file_id)
    name = "batch_" + secrets.token_hex(12)
    job = names.qualify(tenant.name, name)
    try:
        plan = plan_batch(svc.client, spec.input_file_id, job=job, read=fh.read,
                          limits=tenant.limits(svc.settings.limits))
    finally:
        fh.close()
    info: dict[str, Any] = {"endpoint": spec.endpoint, "input_file_id": spec.input_file_id,
                            "completion_window": spec.completion_window, "metadata": spec.metadata,
                            "rejected": len(plan.rejected)}
    meta: dict[str, Any] = {"object": "batch", "batch": info, "api": {"metadata": spec.metadata or {}}}
    if webhook:
        meta["webhook"] = webhook
    now = time.time()
    svc.redis.zadd(keys.tenant_batches(tenant.name), {name: now})
    if plan.plan.accepted == 0:  # nothing can run: the batch failed validation, said line by line
        plan.plan.close()
        info.update(failed=True, errors=[{"code": e["error"]["code"], "message": e["error"]["message"],
                                          "line": e["error"].get("line"), "param": None} for e in plan.rejected[:100]])
        svc.client.index.create(job, {**meta, "batch": info, "task": "text", "params": {}, "exports": []})
        if webhook:
            Outbox(svc.redis, svc.settings.redis.job_ttl).add(job, "batch.failed", webhook)
        return batch_view(svc, job)
    svc.check_in_flight(tenant, plan.plan.accepted)
    svc.mark_active(tenant, job)
    submit_batch(svc.client, plan, job=job, meta=meta)
    return batch_view(svc, job)


@router.get("", response_model=BatchList, responses=ERRORS)
def list_batches(who: Caller = Depends(caller), limit: int = Query(20, ge=1, le=100),
                 after: str | None = Query(None, max_length=64)) -> dict[str, Any]:
    svc, tenant = who.svc, who.tenant.name
    key = keys.tenant_batches(tenant)
    start = 0
    if after is not None:
        rank = svc.redis.zrevrank(key, after)
        if rank is None:
            raise UnknownJob(after, "batch")
        start = int(rank) + 1
    window = [b.decode() for b in svc.redis.zrevrange(key, start, start + limit)]
    data = []
    for name in window[:limit]:
        try:
            data.append(batch_view(svc, names.qualify(tenant, name)))
        except UnknownJob:
            continue
    return {"object": "list", "data": data, "has_more": len(window) > limit,
            "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}


def _job(who: Caller, batch_id: str) -> str:
    if not batch_id.startswith("batch_") or not names.job_ok(batch_id):
        raise UnknownJob(batch_id, "batch")
    job = names.qualify(who.tenant.name, batch_id)
    if not who.svc.client.index.exists(job):
        raise UnknownJob(batch_id, "batch")
    return job


@router.get("/{batch_id}", response_model=Batch, responses=ERRORS)
def get_batch(batch_id: str, who: Caller = Depends(caller)) -> dict[str, Any]:
    return batch_view(who.svc, _job(who, batch_id))


@router.post("/{batch_id}/cancel", response_model=Batch, responses=ERRORS)
def cancel(batch_id: str, who: Caller = Depends(caller)) -> dict[str, Any]:
    """Requests not started never run; the batch ends ``cancelled`` with the output of those that
    finished."""
    job = _job(who, batch_id)
    if not who.svc.client.index.meta(job).get("batch", {}).get("failed"):
        who.svc.client.cancel(job)
    return batch_view(who.svc, job)

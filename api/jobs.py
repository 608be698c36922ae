"""``/v1/jobs``: create (a JSON list of refs, or a manifest upload), list, get, results, failed,
reprocess, cancel and deliveries. Each is the producer's own call (``producer.Client``/``Job``):
intake, accounting, export and cancel live there once, for the CLI, Python and HTTP alike."""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from api import idempotency, uploads
from api.auth import Caller, caller, unmetered
from api.models import ERRORS, DeliveryList, FailedList, Job, JobCreate, JobList, Reprocessed
from api.service import Service
from api.views import STATES, job_views
from api.webhooks import check_url
from ocrq import keys, names
from ocrq.jobs.failed import registered
from ocrq.results import json_line
from producer.errors import Conflict, UnknownJob
from producer.intake import Uploaded
from producer.name_filter import NameFilter
from producer.progress import job_progress

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

#: jobs a list request looks at, at most, to fill a page of one state
_SCAN = 2000
#: bytes of result lines per write of a results stream
_STREAM_BYTES = 256 * 1024

_CREATE_BODY = {
    "requestBody": {"required": True, "content": {
        "application/json": {"schema": JobCreate.model_json_schema()},
        "multipart/form-data": {"schema": {
            "type": "object", "required": ["manifest"],
            "properties": {"manifest": {"type": "string", "format": "binary",
                                        "description": "a JSONL or CSV manifest (as `ocrq submit` reads one)"},
                           "options": {"type": "string", "description": "JobCreate's fields but refs, as JSON"}}}},
    }}}


def view(svc: Service, job: str) -> dict[str, Any]:
    found = job_views(svc.redis, svc.settings, [job], svc.client.store.location)[0]
    if found is None:
        raise UnknownJob(names.split(job)[1])
    return found


@router.post("", status_code=201, response_model=Job, responses=ERRORS, openapi_extra=_CREATE_BODY)
async def create(request: Request, response: Response, who: Caller = Depends(caller),
                 idempotency_key: str | None = Header(None, max_length=255)) -> dict[str, Any]:
    """A new job. JSON: ``{"refs": [...], ...}``; multipart: a ``manifest`` file (JSONL or CSV,
    any size: spooled to disk, never held whole) and ``options``. With an ``Idempotency-Key``,
    the same key and body return the same job; another body with that key is 409."""
    from starlette.concurrency import run_in_threadpool

    async with uploads.body(request, who.svc.settings.api.max_upload_bytes) as (options, manifest, digest):
        try:
            spec = JobCreate.model_validate({**options, **({"refs": ["-"]} if manifest is not None else {})})
        except ValidationError as exc:
            raise uploads.invalid(exc) from None
        out, replayed = await run_in_threadpool(_create, who, spec, manifest, digest, idempotency_key)
    response.status_code = 200 if replayed else 201
    if replayed:
        response.headers["Idempotent-Replayed"] = "true"
    response.headers["Location"] = f"/v1/jobs/{out['id']}"
    return out


def _create(who: Caller, spec: JobCreate, manifest: Uploaded | None, digest: str, key: str | None
            ) -> tuple[dict[str, Any], bool]:
    svc, tenant = who.svc, who.tenant
    name = spec.name or (f"job-{hashlib.sha256(key.encode()).hexdigest()[:20]}" if key
                         else f"job-{secrets.token_hex(10)}")
    with idempotency.claim(svc, tenant, key, digest, name) as prior:
        replayed = prior is not None
        name = prior or name
        job = svc.job_name(tenant, name)
        if not replayed and svc.client.index.exists(job):
            raise Conflict(f"a job named {name!r} exists: pick another name (or send the Idempotency-Key of the "
                           "request that made it to get it again)")
        webhook = spec.webhook_url or tenant.settings.webhook_url
        if webhook:
            check_url(svc.settings, webhook)
        refs = [] if manifest is not None else spec.refs
        plan = svc.client.plan(refs, limits=tenant.limits(svc.settings.limits), uploaded=manifest,
                               match=NameFilter.of(spec.match))
        try:
            svc.check_in_flight(tenant, plan.accepted)
        except Exception:
            plan.close()
            raise
        meta: dict[str, Any] = {"object": "job", "api": {"metadata": spec.metadata}}
        if webhook:
            meta["webhook"] = webhook
        svc.mark_active(tenant, job)
        # a replay submits the same again: a no-op for a submission written whole, the rest of one
        # a killed process left half written (ocrq.jobs.feed: a submission is known by its content)
        svc.client.submit(plan, job=job, task=spec.task, params=spec.params, priority=spec.priority,
                          parquet=spec.parquet, meta=meta)
        return view(svc, job), replayed


@router.get("", response_model=JobList, responses=ERRORS)
def list_jobs(who: Caller = Depends(caller),
              state: str | None = Query(None, description=" | ".join(STATES)),
              limit: int = Query(20, ge=1, le=200),
              after: str | None = Query(None, max_length=200, description="the last job id of the page before")
              ) -> dict[str, Any]:
    """The tenant's jobs, newest first."""
    svc, index = who.svc, who.svc.client.index
    if state is not None and state not in STATES:
        raise uploads.bad_query("state", f"one of {', '.join(STATES)}")
    start = 0
    if after is not None:
        rank = svc.redis.zrevrank(keys.tenant_jobs(who.tenant.name), svc.job_name(who.tenant, after)) \
            if names.job_ok(after) else None
        if rank is None:
            raise UnknownJob(after)
        start = int(rank) + 1
    found: list[dict[str, Any]] = []
    looked = 0
    more = False
    while len(found) < limit and looked < _SCAN:
        batch = index.jobs_of(who.tenant.name, start + looked, limit if state is None else 200)
        if not batch:
            break
        looked += len(batch)
        views = job_views(svc.redis, svc.settings, [j for j, _ in batch], svc.client.store.location)
        for v in views:
            if v is not None and (state is None or v["state"] == state):
                found.append(v)
        more = index.jobs_count(who.tenant.name) > start + looked
    if len(found) > limit:
        found, more = found[:limit], True
    return {"object": "list", "data": found, "has_more": more, "next": found[-1]["id"] if more and found else None}


@router.get("/{job_id}", response_model=Job, responses=ERRORS)
async def get_job(job_id: str, who: Caller = Depends(unmetered)) -> Response:
    # the hot path of every poller: on the event loop, one Redis round trip (the rate count rides
    # in the view's pipeline), the view already the schema's shape (tests check every answer
    # against it), serialized once
    svc, tenant = who.svc, who.tenant
    job = svc.job_name(tenant, job_id)
    found = job_views(svc.redis, svc.settings, [job], svc.client.store.location,
                      lambda pipe: svc.count_request(pipe, tenant), lambda out: svc.rate_said(tenant, out))[0]
    if found is None:
        raise UnknownJob(job_id)
    return JSONResponse(found)


@router.get("/{job_id}/progress", responses=ERRORS)
def progress(job_id: str, who: Caller = Depends(caller)) -> dict[str, Any]:
    """How far the job is and how fast it goes: finished (image by image, ahead of its records),
    images a second now and on average, ETA, and images a second per 5 s window of the last
    10 minutes (``series``: [window start, rate])."""
    job = who.svc.existing(who.tenant, job_id)
    out = job_progress(who.svc.redis, who.svc.client.index, job).as_dict()
    out["job"] = job_id
    return out


@router.get("/{job_id}/results", responses={**ERRORS, 200: {
    "content": {"application/x-ndjson": {"schema": {"type": "string"}}},
    "description": "one JSON line per image, as `ocrq results` writes them; header Ocrq-Next-After: the "
                   "`after` of the next page when `limit` lines came"}})
def results(job_id: str, who: Caller = Depends(caller), after: int = Query(0, ge=0, le=10**9),
            limit: int | None = Query(None, ge=1, le=1_000_000)) -> StreamingResponse:
    """Every image of the job, in submission order, from line ``after`` on (``limit`` of them)."""
    handle = who.svc.client.job(who.svc.existing(who.tenant, job_id))
    seen = 0

    def skip(_: str) -> bool:
        nonlocal seen
        seen += 1
        return seen <= after

    def lines() -> Iterator[bytes]:
        # about 256 KB a write: each item of a sync iterator is a hop to a thread and back
        sent, block, size = 0, [], 0
        for result in handle.results(skip=skip if after else None):
            line = json_line(result.to_line()) + b"\n"
            block.append(line)
            size += len(line)
            sent += 1
            if limit is not None and sent >= limit:
                break
            if size >= _STREAM_BYTES:
                yield b"".join(block)
                block, size = [], 0
        if block:
            yield b"".join(block)

    headers = {"Ocrq-Next-After": str(after + limit)} if limit is not None else {}
    return StreamingResponse(lines(), media_type="application/x-ndjson", headers=headers)


@router.get("/{job_id}/export/{name}", responses={**ERRORS, 200: {
    "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    "description": "a file of the job's export (results.jsonl, results.parquet, _SUCCESS)"}})
def export_file(job_id: str, name: str, who: Caller = Depends(caller)) -> StreamingResponse:
    """A file of the finished job's export, streamed from the store (404 until it is written)."""
    job = who.svc.existing(who.tenant, job_id)
    if name not in (keys.EXPORT_JSONL, keys.EXPORT_PARQUET, keys.EXPORT_SUCCESS):
        raise UnknownJob(name, "export file")
    fh = who.svc.client.store.open_file(keys.export_object(job, name))
    if fh is None:
        raise UnknownJob(f"{job_id}/{name}", "export file (not written yet)")
    media = {keys.EXPORT_JSONL: "application/x-ndjson", keys.EXPORT_PARQUET: "application/vnd.apache.parquet"}
    return StreamingResponse(uploads.chunks(fh), media_type=media.get(name, "application/json"))


@router.get("/{job_id}/failed", response_model=FailedList, responses=ERRORS)
def failed(job_id: str, who: Caller = Depends(caller), limit: int = Query(100, ge=1, le=1000),
           error: str | None = Query(None, max_length=64, description="only this error type")) -> dict[str, Any]:
    """The job's failed images with their typed errors, oldest first."""
    svc = who.svc
    job = svc.existing(who.tenant, job_id)
    found = list(registered(svc.client.index, svc.client.store, job, error, limit=limit + 1))
    data = [{"id": f.record.id, "ref": f.record.ref, "attempts": f.record.attempts, "failed_at": f.failed_at,
             "error": f.record.error.model_dump() if f.record.error else None, "row": f.record.row}
            for f in found[:limit]]
    return {"object": "list", "data": data, "has_more": len(found) > limit}


@router.post("/{job_id}/reprocess", response_model=Reprocessed, responses=ERRORS)
def reprocess(job_id: str, who: Caller = Depends(caller),
              error: str | None = Query(None, max_length=64, description="only failures of this error type")
              ) -> dict[str, Any]:
    """Run the job's failed images again (and, without ``error``, the ones a cancel stopped)."""
    svc = who.svc
    job = svc.existing(who.tenant, job_id)
    svc.mark_active(who.tenant, job)
    return {"id": job_id, "reprocessed": svc.client.reprocess_failed(job, error=error)}


@router.post("/{job_id}/cancel", response_model=Job, responses=ERRORS)
def cancel(job_id: str, who: Caller = Depends(caller)) -> dict[str, Any]:
    """Images not started never run; running ones finish and are kept; the job ends
    ``cancelled`` with an export of what finished. A job already final is left as it is."""
    job = who.svc.existing(who.tenant, job_id)
    who.svc.client.cancel(job)
    return view(who.svc, job)


@router.get("/{job_id}/deliveries", response_model=DeliveryList, responses=ERRORS)
def deliveries(job_id: str, who: Caller = Depends(caller)) -> dict[str, Any]:
    """The job's webhook attempts, newest first, and its events not delivered yet."""
    from ocrq.jobs.events import Outbox

    job = who.svc.existing(who.tenant, job_id)
    outbox = Outbox(who.svc.redis, who.svc.settings.redis.job_ttl)
    pending = [{k: v for k, v in e.items() if k in ("id", "type", "attempts", "created")}
               for e in outbox.pending(job)]
    return {"object": "list", "data": outbox.deliveries(job), "pending": json.loads(json.dumps(pending))}

"""``/v1/files`` as OpenAI serves it: upload a batch input file, list, get, download, delete.

An upload is streamed to the store (``keys.uploaded_file``: the tenant's own folder) and
described in Redis (``keys.file_meta``); a batch's output and error files are its job's OpenAI
Batch export, named ``file-{batch}-output`` and ``file-{batch}-errors``, served from there.
"""

from __future__ import annotations

import secrets
import time
from typing import Any, Literal

from fastapi import APIRouter, Depends, File, Form, Query, UploadFile
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from api import uploads
from api.auth import Caller, caller
from api.models import ERRORS
from api.service import Service
from ocrq import keys, names
from producer.errors import UnknownJob

router = APIRouter(prefix="/v1/files", tags=["openai files"])

PURPOSES = ("batch", "batch_output", "user_data")
_OUTPUT = {"output": keys.OPENAI_OUTPUT, "errors": keys.OPENAI_ERRORS}


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    has_more: bool
    first_id: str | None = None
    last_id: str | None = None


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


def output_id(batch: str, which: str) -> str:
    return f"file-{batch}-{which}"


def _batch_file(svc: Service, tenant: str, file_id: str) -> tuple[str, str] | None:
    """(the batch's job, the export file) of a batch's output or error file id."""
    if not file_id.startswith("file-batch_"):
        return None
    batch, _, which = file_id[len("file-"):].rpartition("-")
    if which not in _OUTPUT or not names.job_ok(batch):
        return None
    return names.qualify(tenant, batch), _OUTPUT[which]


def file_object(svc: Service, tenant: str, file_id: str) -> dict[str, Any]:
    found = _batch_file(svc, tenant, file_id)
    if found is not None:
        job, name = found
        marker = svc.client.store.get_json(keys.openai_export_object(job, keys.EXPORT_SUCCESS))
        if not isinstance(marker, dict):
            raise UnknownJob(file_id, "file")
        created = int(float(svc.client.index.meta(job).get("created") or time.time()))
        return {"id": file_id, "object": "file", "bytes": int((marker.get("bytes") or {}).get(name, 0)),
                "created_at": created, "filename": name, "purpose": "batch_output", "status": "processed"}
    raw = svc.redis.hgetall(keys.file_meta(tenant, file_id)) if names.job_ok(file_id) else {}
    if not raw:
        raise UnknownJob(file_id, "file")
    meta = {k.decode(): v.decode() for k, v in raw.items()}
    return {"id": file_id, "object": "file", "bytes": int(meta["bytes"]), "created_at": int(float(meta["created"])),
            "filename": meta["filename"], "purpose": meta["purpose"], "status": "processed"}


def open_content(svc: Service, tenant: str, file_id: str) -> Any:
    """The file's bytes as a stream (``UnknownJob`` when there is no such file of the tenant)."""
    found = _batch_file(svc, tenant, file_id)
    path = keys.openai_export_object(*found) if found is not None else keys.uploaded_file(tenant, file_id)
    if found is None:
        file_object(svc, tenant, file_id)  # (known to this tenant)
    fh = svc.client.store.open_file(path)
    if fh is None:
        raise UnknownJob(file_id, "file")
    return fh


@router.post("", response_model=FileObject, responses=ERRORS)
async def upload(file: UploadFile = File(...), purpose: str = Form(...),
                 who: Caller = Depends(caller)) -> dict[str, Any]:
    """Upload a file (``purpose=batch``: an OpenAI Batch input file, one request per line)."""
    if purpose not in PURPOSES:
        raise uploads.InvalidRequest(f"purpose {purpose!r}: one of {', '.join(PURPOSES)}")
    svc = who.svc
    return await run_in_threadpool(_store, svc, who.tenant.name, file, purpose)


def _store(svc: Service, tenant: str, file: UploadFile, purpose: str) -> dict[str, Any]:
    path, _, size = uploads.spool_file(file.file, svc.settings.api.max_upload_bytes)
    try:
        file_id = "file-" + secrets.token_hex(12)
        svc.client.store.put_file(keys.uploaded_file(tenant, file_id), path, "application/jsonl")
    finally:
        path.unlink(missing_ok=True)
    now = time.time()
    name = (file.filename or "upload.jsonl")[-255:]
    pipe = svc.redis.pipeline()
    pipe.hset(keys.file_meta(tenant, file_id), mapping={"filename": name, "bytes": size, "purpose": purpose,
                                                         "created": now})
    pipe.expire(keys.file_meta(tenant, file_id), svc.settings.redis.job_ttl)
    pipe.zadd(keys.tenant_files(tenant), {file_id: now})
    pipe.zremrangebyscore(keys.tenant_files(tenant), "-inf", now - svc.settings.redis.job_ttl)
    pipe.execute()
    return file_object(svc, tenant, file_id)


@router.get("", response_model=FileList, responses=ERRORS)
def list_files(who: Caller = Depends(caller), purpose: str | None = Query(None, max_length=32),
               limit: int = Query(100, ge=1, le=10_000), after: str | None = Query(None, max_length=64),
               order: Literal["asc", "desc"] = "desc") -> dict[str, Any]:
    svc, tenant = who.svc, who.tenant.name
    key = keys.tenant_files(tenant)
    start = 0
    if after is not None:
        rank = svc.redis.zrevrank(key, after) if order == "desc" else svc.redis.zrank(key, after)
        if rank is None:
            raise UnknownJob(after, "file")
        start = int(rank) + 1
    window = svc.redis.zrevrange(key, start, start + limit) if order == "desc" else \
        svc.redis.zrange(key, start, start + limit)
    data = []
    for raw in window[:limit]:
        try:
            found = file_object(svc, tenant, raw.decode())
        except UnknownJob:
            continue  # (its meta expired)
        if purpose is None or found["purpose"] == purpose:
            data.append(found)
    return {"object": "list", "data": data, "has_more": len(window) > limit,
            "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}


@router.get("/{file_id}", response_model=FileObject, responses=ERRORS)
def get_file(file_id: str, who: Caller = Depends(caller)) -> dict[str, Any]:
    return file_object(who.svc, who.tenant.name, file_id)


@router.get("/{file_id}/content", responses={**ERRORS, 200: {
    "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    "description": "the file's bytes"}})
def content(file_id: str, who: Caller = Depends(caller)) -> StreamingResponse:
    fh = open_content(who.svc, who.tenant.name, file_id)
    return StreamingResponse(uploads.chunks(fh), media_type="application/octet-stream")


@router.delete("/{file_id}", response_model=FileDeleted, responses=ERRORS)
def delete_file(file_id: str, who: Caller = Depends(caller)) -> dict[str, Any]:
    svc, tenant = who.svc, who.tenant.name
    if _batch_file(svc, tenant, file_id) is not None:
        raise uploads.InvalidRequest("a batch's output and error files go with the batch's job")
    file_object(svc, tenant, file_id)
    svc.client.store.delete_file(keys.uploaded_file(tenant, file_id))
    pipe = svc.redis.pipeline()
    pipe.delete(keys.file_meta(tenant, file_id))
    pipe.zrem(keys.tenant_files(tenant), file_id)
    pipe.execute()
    return {"id": file_id, "object": "file", "deleted": True}

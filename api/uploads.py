"""Request bodies in, files out: a JSON body or a multipart upload (spooled to disk, never held
whole), the digest that identifies it (for ``Idempotency-Key``), and store files streamed back."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import IO, Any

from fastapi import Request
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from producer.errors import ClientError, Refused
from producer.intake import Uploaded

#: a JSON body larger than this is refused (a list of refs that long belongs in a manifest)
MAX_JSON_BYTES = 16 * 1024 * 1024
_CHUNK = 1 << 20


class InvalidRequest(Refused):
    code = "invalid_request"


class TooLargeUpload(ClientError):
    http_status = 413
    code = "too_large"


def invalid(exc: ValidationError) -> InvalidRequest:
    """A body that does not match its schema, as one readable line per problem."""
    problems = [f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()[:10]]
    return InvalidRequest("; ".join(problems))


def bad_query(name: str, expected: str) -> InvalidRequest:
    return InvalidRequest(f"query parameter {name}: expected {expected}")


def _check_length(request: Request, cap: int) -> None:
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > cap:
        raise TooLargeUpload(f"a body of {int(length):,} bytes is over api.max_upload_bytes ({cap:,})")


async def json_body(request: Request) -> tuple[dict[str, Any], bytes]:
    _check_length(request, MAX_JSON_BYTES)
    raw = b""
    async for part in request.stream():
        raw += part
        if len(raw) > MAX_JSON_BYTES:
            raise TooLargeUpload(f"a JSON body over {MAX_JSON_BYTES:,} bytes: upload a manifest instead")
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise InvalidRequest(f"the body is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidRequest("the body must be a JSON object")
    return doc, raw


@contextlib.asynccontextmanager
async def body(request: Request, cap: int) -> AsyncIterator[tuple[dict[str, Any], Uploaded | None, str]]:
    """(the options, the uploaded manifest or None, the body's digest); the manifest's spool file
    is removed on leaving."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "multipart/form-data":
        doc, raw = await json_body(request)
        yield doc, None, hashlib.sha256(raw).hexdigest()
        return
    _check_length(request, cap)
    form = await request.form(max_files=1, max_fields=8)
    try:
        upload = form.get("manifest")
        if not isinstance(upload, UploadFile):
            raise InvalidRequest("a multipart job needs a `manifest` file part (JSONL or CSV)")
        text = form.get("options")
        try:
            options = json.loads(text) if isinstance(text, str) and text.strip() else {}
        except ValueError as exc:
            raise InvalidRequest(f"options is not JSON: {exc}") from None
        if not isinstance(options, dict):
            raise InvalidRequest("options must be a JSON object")
        if "refs" in options:
            raise InvalidRequest("a multipart job's refs are its manifest's lines: leave refs out of options")
        name = upload.filename or "manifest.jsonl"
        csv = name.lower().endswith(".csv") or (upload.content_type or "").startswith("text/csv")
        path, digest = await run_in_threadpool(_spool, upload.file, ".csv" if csv else ".jsonl", cap)
        try:
            whole = hashlib.sha256(json.dumps(options, sort_keys=True).encode() + digest.encode()).hexdigest()
            yield options, Uploaded(path, csv, f"the uploaded manifest {Path(name).name!r}"), whole
        finally:
            path.unlink(missing_ok=True)
    finally:
        await form.close()


def _spool(src: IO[bytes], suffix: str, cap: int) -> tuple[Path, str]:
    """``src`` copied to a named temporary file (the intake reads a manifest by path), hashed."""
    fd, name = tempfile.mkstemp(prefix="ocrq-upload-", suffix=suffix)
    digest = hashlib.sha256()
    size = 0
    try:
        with os.fdopen(fd, "wb") as out:
            while block := src.read(_CHUNK):
                size += len(block)
                if size > cap:
                    raise TooLargeUpload(f"an upload over api.max_upload_bytes ({cap:,} bytes)")
                digest.update(block)
                out.write(block)
    except BaseException:
        os.unlink(name)
        raise
    return Path(name), digest.hexdigest()


def spool_file(src: IO[bytes], cap: int) -> tuple[Path, str, int]:
    """An uploaded file to a temporary one: (path, sha256, bytes)."""
    path, digest = _spool(src, ".upload", cap)
    return path, digest, path.stat().st_size


def chunks(fh: IO[bytes]) -> Iterator[bytes]:
    """A store file's bytes, a megabyte at a time, then closed."""
    try:
        while block := fh.read(_CHUNK):
            yield block
    finally:
        fh.close()


def copy(src: IO[bytes], dst: IO[bytes]) -> None:
    shutil.copyfileobj(src, dst, _CHUNK)

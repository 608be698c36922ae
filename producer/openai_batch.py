"""Submitting an OpenAI Batch input file, and writing its output and error files.

    batch = plan_batch(client, "requests.jsonl", job="invoices")   # reads and checks every line
    handle = submit_batch(client, batch, job="invoices")            # its accepted lines, one image each
    write_files(client, "invoices", Path("out/"), follow=True)      # out/output.jsonl, errors.jsonl, _SUCCESS

Each line is parsed (``producer.openai_requests``); its image becomes a ref (a ``data:`` URI written
once to the store, ``producer.inline_images``; a URL, ``s3://`` key or path checked as any ref is), its
``custom_id`` the image's manifest row, its task and params the image's own. A line that cannot
run gets an error line (``ocrq.output.openai_responses.rejected_line``) written to the store before
anything is published; the others run. The accepted lines are one submission (``Client.submit``),
identified by its content: the same file again is a no-op for lines already done, and resumes a
submission a killed producer left half written.
"""

from __future__ import annotations

import hashlib
import io
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from ocrq import keys, names
from ocrq.capabilities import refusal
from ocrq.errors import OcrqError, RefusedRef, TooLarge
from ocrq.jobs.index import finished
from ocrq.net.fetch import fetch
from ocrq.output.openai_responses import BatchFiles, custom_ids, final_lines, rejected, rejected_line
from ocrq.refs import parse
from ocrq.results import json_line
from ocrq.s3errors import s3_error
from ocrq.settings import LimitSettings
from producer.client import Client
from producer.errors import InvalidName, UnsupportedTask
from producer.inline_images import InlineImages, is_data_uri
from producer.intake import IntakePlan, check_ref
from producer.job import Job
from producer.lines import LongLine, capped_lines
from producer.openai_requests import DuplicateCustomId, InvalidLine, custom_id_of, parse_line

#: the largest input file read from a URL (OpenAI's own limit for a batch file)
MAX_URL_FILE_BYTES = 200 * 1024 * 1024
#: the longest custom_id accepted (it is the image's manifest row)
MAX_CUSTOM_ID_CHARS = 1024


@dataclass
class BatchPlan:
    """An input file read: its accepted lines (``plan``) and the error lines of the others."""

    source: str
    #: sha256[:16] of the file's bytes: names its rejected lines in the store
    digest: str
    plan: IntakePlan
    #: the job it was planned for (its inline images are that job's)
    job: str = ""
    lines: int = 0
    rejected: list[dict[str, Any]] = field(default_factory=list)

    def summary(self) -> str:
        return f"{self.lines} lines: {self.plan.accepted} accepted, {len(self.rejected)} rejected"


def read_lines(client: Client, source: str, cap: int = MAX_URL_FILE_BYTES,
               digest: Any | None = None) -> tuple[Iterator[bytes | LongLine], Path | str | None]:
    """The lines of ``source`` (a path, ``s3://bucket/key`` or an http(s) URL) and where a relative
    image path in it resolves (the file's directory, or its S3 "folder"). A line over ``cap``
    bytes is a ``LongLine``, read through, never held (``producer.lines``); ``digest`` (hashlib) is
    fed every byte of the file."""
    if source.startswith("s3://"):
        ref = parse(source, client.settings.limits)
        try:
            body = client.s3.get_object(Bucket=ref.bucket, Key=ref.key)["Body"]
        except (BotoCoreError, ClientError) as exc:  # NoSuchKey -> MissingObject, ...
            raise s3_error(exc, source) from exc
        folder = ref.key.rpartition("/")[0]
        return capped_lines(body.read, cap, digest), f"s3://{ref.bucket}/{folder + '/' if folder else ''}"
    if source.startswith(("http://", "https://")):
        limits = client.settings.limits.model_copy(update={"max_bytes": MAX_URL_FILE_BYTES})
        return capped_lines(io.BytesIO(fetch(source, limits)).read, cap, digest), None
    path = Path(source)

    def local() -> Iterator[bytes | LongLine]:
        with path.open("rb") as fh:
            yield from capped_lines(fh.read, cap, digest)

    if not path.is_file():
        raise RefusedRef(f"no such file: {source}")
    return local(), path.resolve().parent


@dataclass
class _LineCheck:
    """One line of a batch checked, and accepted into the plan (else a typed error): what the
    lines share (the rules, the live workers' roots and engines, the job's inline images) and what
    they have seen so far (custom ids, hosts checked)."""

    limits: LimitSettings
    workers: list[Path]
    engines: list[dict[str, Any]]
    inline: InlineImages
    base: Path | str | None
    #: sha256[:8] of each custom_id -> its line
    seen: dict[bytes, int] = field(default_factory=dict)
    hosts: dict[tuple[str, int], str | None] = field(default_factory=dict)

    def accept(self, plan: IntakePlan, raw: bytes, n: int) -> None:
        req = parse_line(raw)
        if len(req.custom_id) > MAX_CUSTOM_ID_CHARS:
            raise InvalidLine(f"custom_id of {len(req.custom_id)} characters (at most {MAX_CUSTOM_ID_CHARS})")
        key = hashlib.sha256(req.custom_id.encode()).digest()[:8]
        if key in self.seen:
            raise DuplicateCustomId(f"custom_id {req.custom_id!r} repeats line {self.seen[key]}: the first runs")
        self.seen[key] = n
        why = refusal(req.task, req.params, self.engines)
        if why is not None:
            raise UnsupportedTask(why)
        if is_data_uri(req.image):
            ref = self.inline.ref(req.image)
        else:
            ref = parse(req.image, self.limits, self.base).value
            reason = check_ref(ref, self.limits, self.workers, self.hosts)
            if reason is not None:
                raise RefusedRef(reason)
        plan.accept(ref, {"custom_id": req.custom_id}, req.spec())


def plan_batch(client: Client, source: str, *, job: str, read: Callable[[int], bytes] | None = None,
               limits: LimitSettings | None = None) -> BatchPlan:
    """Read and check every line of ``source`` for job ``job``; nothing is published (inline images
    are written to the store, under the job and their content's name: only the job's chunks may
    read them, so the plan is for that job alone, ``submit_batch``). ``read``: the file's bytes,
    from elsewhere (an upload: a relative image path then has no folder); ``limits``: other
    rules than the settings' (a tenant's)."""
    if not names.qualified_ok(job):
        raise InvalidName(f"job name {names.shown(job)}: use letters, digits, '.', '_', '-' (≤ 128), "
                          "starting with a letter or digit")
    limits = limits if limits is not None else client.settings.limits
    workers = client.worker_roots()
    if not limits.allowed_roots and workers:
        limits = limits.model_copy(update={"allowed_roots": workers})
    inline = InlineImages(client.store, limits.max_bytes, job)
    # (a data: URI is base64: 4/3 of its bytes; the rest of a line is small)
    max_line = limits.max_bytes * 4 // 3 + (1 << 20)
    digest = hashlib.sha256()
    base: Path | str | None = None
    if read is None:
        lines, base = read_lines(client, source, max_line, digest)
    else:
        lines = capped_lines(read, max_line, digest)
    plan = IntakePlan.new()
    batch = BatchPlan(source, "", plan, job=job)
    # a line no live engine can honour is rejected
    check = _LineCheck(limits, workers, client.engine_capabilities(), inline, base)
    failures: list[tuple[str, int, OcrqError]] = []
    for n, raw in enumerate(lines, 1):
        if isinstance(raw, LongLine):  # read through, never held
            batch.lines += 1
            failures.append(("", n, TooLarge(f"a line of {raw.length:,} bytes (an image over limits.max_bytes,"
                                              f" {limits.max_bytes:,})")))
            continue
        if not raw.strip():
            continue
        batch.lines += 1
        try:
            check.accept(plan, raw, n)
        except OcrqError as exc:
            failures.append((custom_id_of(raw), n, exc))
    inline.flush()  # every inline image is in the store before any ref to it is published
    batch.digest = digest.hexdigest()[:16]
    batch.rejected = [rejected_line(cid, n, batch.digest, exc) for cid, n, exc in failures]
    return batch


def submit_batch(client: Client, batch: BatchPlan, *, job: str, priority: int | None = None,
                 progress: Callable[[str, int, int], None] | None = None,
                 meta: dict[str, Any] | None = None) -> Job:
    """Record the rejected lines' errors in the store, then submit the accepted lines as one
    submission of ``job`` (each image with its own task and params), the job it was planned for."""
    if batch.job != job:
        raise ValueError(f"the batch was planned for job {batch.job!r}, not {job!r} (its inline images are that job's)")
    if batch.rejected:
        body = b"".join(json_line(line) + b"\n" for line in batch.rejected)
        client.store.put_many([(keys.openai_rejected(job, batch.digest), body)])
    return client.submit(batch.plan, job=job, priority=priority, progress=progress, openai_batch=True, meta=meta)


def write_files(client: Client, job: str, out: Path, *, follow: bool = False, poll: float = 1.0,
                timeout: float | None = None) -> dict[str, Any]:
    """Write ``out/output.jsonl`` and ``out/errors.jsonl`` (every line final now) and, when every
    line is final, ``out/_SUCCESS`` last. ``follow``: append lines as images finish (the files
    are readable meanwhile) until the job is finished; ``TimeoutError`` after ``timeout`` s."""
    out.mkdir(parents=True, exist_ok=True)
    success = out / keys.EXPORT_SUCCESS
    success.unlink(missing_ok=True)
    handle = client.job(job)
    deadline = None if timeout is None else time.monotonic() + timeout
    written: set[str] = set()
    with (out / keys.OPENAI_OUTPUT).open("wb") as fo, (out / keys.OPENAI_ERRORS).open("wb") as fe:
        files = BatchFiles(fo, fe)
        # known at submit: first (but lines that ran since, from the file fixed)
        for envelope in rejected(client.store, job, custom_ids(handle.results())):
            files.add(True, envelope)
        while True:
            counts = handle.status()  # before reading: all final then means all read final
            done = finished(counts) and not handle.submitting()
            # only the parts of images not written yet are read (parts never change): a pass
            # costs the job's markers and refs shards, not its documents
            for image_id, is_error, envelope in final_lines(handle.results(skip=written.__contains__)):
                if image_id not in written:
                    written.add(image_id)
                    files.add(is_error, envelope)
            files.flush()
            if done or not follow:
                break
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job}: {counts}")
            # each pass reads every image's marker: a large job is polled less often (1 s per 200,000)
            time.sleep(max(poll, counts["total"] / 200_000))
    marker = {"job": job, "complete": done, "lines": files.lines, "error_lines": files.error_lines,
              "counts": counts, "files": [keys.OPENAI_OUTPUT, keys.OPENAI_ERRORS]}
    if done:
        tmp = out / f".{keys.EXPORT_SUCCESS}.tmp"
        tmp.write_bytes(json_line(marker) + b"\n")
        os.replace(tmp, success)
    return marker

"""The chunk task: the life of a message, top to bottom.

    fetch + hash → cache check → decode (misses only) → infer (engine loop) → store → ack
    (→ the job's export, by whichever chunk finishes the job: ``finish_job``, ocrq.output.export)

``process_chunk`` makes ONE attempt at every image of a chunk, one step after another, each a
module of worker.chunk taking the attempt and returning it one step on (worker.chunk.attempt), one
log line each; the retry policy (worker.chunk.retry) decides what goes back to the broker. Results
are written to the store and the job index before the function returns, and Celery acks only
after it returns (acks_late).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import redis
from celery import Celery, Task
from celery.exceptions import Reject, Retry
from celery.worker.request import Request

from ocrq import keys, names
from ocrq.broker import publish
from ocrq.errors import OcrqError, StorageUnavailable
from ocrq.messages import (
    FINISH_JOB_TASK,
    OCR_CHUNK_TASK,
    Chunk,
    ReadChunk,
    UnreadableMessage,
    read_chunk,
    read_job_name,
)
from ocrq.output.export import export_job, request_export
from ocrq.redact import redact_message
from ocrq.results import ImageStatus
from worker.chunk.attempt import Attempt
from worker.chunk.cache_check import check_cache
from worker.chunk.decode import decode
from worker.chunk.fetch import fetch
from worker.chunk.infer import infer
from worker.chunk.records import image_record
from worker.chunk.report import ChunkReport
from worker.chunk.retry import countdown, outage_wait
from worker.chunk.store import store
from worker.chunk.whole import retry_all
from worker.context import WorkerContext
from worker.loop.intake import Intake

log = logging.getLogger("ocrq.task")


def process_chunk(ctx: WorkerContext, chunk: Chunk, refused: dict[str, OcrqError] | None = None) -> ChunkReport:
    """One attempt at a chunk read from the broker (``refused``: its images the message itself
    refused, ``ocrq.messages.read_chunk``: recorded failed, never fetched)."""
    tag = f"job={chunk.job} n={len(chunk.items)}"
    running = ctx.index.record([image_record(chunk, it, ImageStatus.running, worker=ctx.hostname)
                                for it in chunk.items])
    skipped = running.count(False)
    if skipped:
        # done already (a redelivery of a chunk whose results were written before its ack was
        # lost), its job archived, or cancelled: the result stands, the image is not run (again)
        log.info("→ skip %s: %d image(s) already done, cancelled, or their job archived", tag, skipped)
        chunk = chunk.model_copy(update={"items": [it for it, ok in zip(chunk.items, running, strict=True) if ok]})
        if not chunk.items:
            return ChunkReport(skipped=skipped)
    # while its images are fetched and decoded, an idle engine waits for them rather than run
    # the chunks that came first alone (worker.loop.engine_loop: expecting)
    with ctx.loop.expecting(len(chunk.items)) as intake:
        report = _attempt(ctx, Attempt.begin(chunk, refused), intake)
    return replace(report, skipped=skipped)


def _attempt(ctx: WorkerContext, a: Attempt, intake: Intake) -> ChunkReport:
    """The attempt, step by step (worker.chunk), one log line each."""
    a = fetch(ctx, a)
    log.info("→ fetch %s ok=%d bad=%d refused=%d %.2fs", a.tag, len(a.images), len(a.errors), a.refused,
             a.elapsed())
    a = check_cache(ctx, a)
    units = sum(len(im.units) for im in a.images.values())
    log.info("→ cache %s hits=%d misses=%d", a.tag, a.unit_hits, units - a.unit_hits)
    t, failed = time.monotonic(), len(a.errors)
    a = decode(ctx, a)
    log.info("→ decode %s misses=%d bad=%d %.2fs", a.tag, a.decoded, len(a.errors) - failed, time.monotonic() - t)
    t = time.monotonic()
    a = infer(ctx, a, intake)
    log.info("→ infer %s units=%d shared=%d %.2fs", a.tag, a.engine_units - len(a.shared), len(a.shared),
             time.monotonic() - t)
    stored = store(ctx, a)
    log.info("→ store %s docs=%d %s", a.tag, stored.documents, ctx.store.location)
    # ack (by returning) — or hand the retryable images back to the broker, alone
    report = stored.report
    if report.retry:
        report = replace(report, countdown=countdown(ctx.settings.queue, report.retry))
    log.info("← ack %s done=%d cached=%d failed=%d retry=%d %.2fs", a.tag, report.done, report.cached,
             report.failed, len(report.retry), a.elapsed())
    return report


class RedactedRequest(Request):
    """A task request whose arguments, as the worker logs them and its events carry them to
    Flower, are redacted and cut (ocrq.redact): the publisher wrote that text, and a message from
    elsewhere than ocrq's producer may hold a URL's password or be megabytes long."""

    @property
    def argsrepr(self) -> str:
        return redact_message(str(super().argsrepr or ""), 4000)

    @property
    def kwargsrepr(self) -> str:
        return redact_message(str(super().kwargsrepr or ""), 1000)


def register_tasks(app: Celery, get_ctx: Callable[[], WorkerContext]) -> Task:
    """Register the chunk task on ``app``; the context is built once per worker process."""

    # ignore_result: the outcome is the job's records and documents, and Flower shows each
    # chunk's summary from its task events; a result backend write is a write that a full
    # broker Redis refuses, and the STARTED one (track_started) before the task body runs
    @app.task(name=OCR_CHUNK_TASK, bind=True, max_retries=None, ignore_result=True, Request=RedactedRequest)
    def ocr_chunk(self: Task, message: Any) -> dict[str, Any]:
        ctx = get_ctx()
        read = _read(ctx, message, self.request.id)
        if read is None or not read.chunk.items:
            return ChunkReport().summary()
        chunk = read.chunk
        try:
            report = process_chunk(ctx, chunk, refused=read.refused)
        except OcrqError as exc:  # the store or Redis went away mid-chunk: retry every image
            report = retry_all(ctx, chunk, exc)
        if ctx.feeder is not None:  # room in the job's window: the next shard may go out
            ctx.feeder.poke(chunk.job)
        # this chunk may have finished the job (a cancelled one: by skipping): export it once
        if report.done or report.failed or report.skipped or report.retry:
            try:
                _ask_export(app, ctx, chunk.job, self.request)
            except Exception:  # the results stand; the export sweep asks again (worker.export_sweep)
                log.exception("! could not publish the export of job=%s (the export sweep asks again)", chunk.job)
        if report.retry:
            _hand_back(self, chunk, report)  # raises Retry (or Reject)
        return report.summary()

    @app.task(name=FINISH_JOB_TASK, bind=True, max_retries=None, ignore_result=True, Request=RedactedRequest)
    def finish_job(self: Task, job: Any, outage_since: Any = None) -> dict[str, Any]:
        ctx = get_ctx()
        try:
            job = read_job_name(job)
        except UnreadableMessage as exc:
            return _drop(ctx, "finish", self.request.id, exc)
        since = outage_since if type(outage_since) in (int, float) else None
        try:
            marker = export_job(ctx.index, ctx.store, job)
            log.info("← export job=%s %s", job, marker)
            current = not marker.get("exported") or _archive(ctx, job, marker["counts"]["total"])
        except (OcrqError, redis.RedisError) as exc:
            # the store or Redis away: wait it out as a chunk does (outage_wait), or the job,
            # finished, would never get its export (no chunk is left to ask for it again)
            err = exc if isinstance(exc, OcrqError) else StorageUnavailable(f"Redis: {exc}")
            wait = outage_wait(ctx.settings.queue, err, since)
            if wait is not None:
                publish.retry_finish(self, job, since or time.time(), wait)  # raises Retry
            _forget_request(ctx, job)  # the export sweep, a finishing chunk or `ocrq export` asks again
            raise
        if not current:
            # images came in while it ran (redelivered chunks whose records Redis lost): export again
            ctx.redis.delete(keys.job_finishing(job))
            _ask_export(app, ctx, job, self.request)
        return marker

    return ocr_chunk


def _hand_back(task: Task, chunk: Chunk, report: ChunkReport) -> None:
    """Re-publish the chunk's retryable images alone, with their countdown (raises ``Retry``)."""
    try:
        publish.retry_chunk(task, chunk, report.retry, report.countdown, report.outage_since)
    except Retry:
        raise
    except Exception as exc:
        # could not publish the retry (broker down): give the message back, lose nothing
        raise Reject(f"retry publish failed: {exc}", requeue=True) from exc


def _ask_export(app: Celery, ctx: WorkerContext, job: str, request: Any) -> bool:
    """Publish ``job``'s export if it is finished and nobody did (ocrq.output.export.request_export), to
    the queue the asking message came from."""
    queue = (request.delivery_info or {}).get("routing_key") or ctx.settings.queue.name
    return request_export(ctx.redis, ctx.index, job,
                          lambda tid: publish.finish(app, job, tid, queue, declare=False), ctx.settings.redis.job_ttl)


def _forget_request(ctx: WorkerContext, job: str) -> None:
    """An export given up: its request flag goes, so the next sweep asks at once (not once it
    is ``redis.export_stale_s`` old). Redis may be what is away: then the flag ages out."""
    try:
        ctx.redis.delete(keys.job_finishing(job))
    except redis.RedisError:
        log.warning("! export of job=%s given up; its request is asked again once stale", job)


def _read(ctx: WorkerContext, message: Any, task_id: object) -> ReadChunk | None:
    """A chunk message read against the producer's grammar (``ocrq.messages.read_chunk``: a
    message on the broker may come from anyone who can reach Redis); None when nothing in it can
    be recorded (dropped, counted, logged)."""
    try:
        read = read_chunk(message, ctx.settings.queue.max_message_bytes)
    except UnreadableMessage as exc:
        _drop(ctx, "chunk", task_id, exc)
        return None
    if read.dropped:
        ctx.metrics.observe_dropped("item", read.dropped)
        log.warning("! job=%s: %d item(s) dropped: no image id ocrq makes (or the same one twice)",
                    read.chunk.job, read.dropped)
    return read


def _drop(ctx: WorkerContext, kind: str, task_id: object, why: UnreadableMessage) -> dict[str, Any]:
    """A message nothing in which can be recorded (its job name is none ocrq writes): counted
    (``ocrq_messages_dropped``), logged cut and redacted, acked, never acted on."""
    ctx.metrics.observe_dropped(kind, 1)
    text = redact_message(str(why), 300)
    log.warning("! dropped a %s message (task id %s): %s", kind, names.shown(task_id, 60), text)
    return {"dropped": text}


def _archive(ctx: WorkerContext, job: str, exported_total: int) -> bool:
    """A finished job's export is written: its per-image records leave Redis (its documents are
    all in the store), and its refs shards (presigned URLs among them) the store. False when the
    export is stale: the job's total moved while it ran."""
    archived = ctx.index.archive(job, exported_total)
    if archived < 0:
        log.warning("! export job=%s covered %d images, the job has more now: exporting again", job,
                    exported_total)
        return False
    if archived == 0:
        return True  # new work came in since its export was asked for: archived after the next one
    shards = list(ctx.store.list(keys.refs_prefix(job)))
    ctx.store.delete_many(shards)
    log.info("← archive job=%s (%d refs shards deleted)", job, len(shards))
    return True

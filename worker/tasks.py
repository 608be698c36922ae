"""The chunk task: the life of a message, top to bottom.

    fetch + hash → cache check → decode (misses only) → plan batch + infer (engine loop) → store → ack
    (→ the job's export, by whichever chunk finishes the job: ``finish_job``, ocrq.output.export)

``process_chunk`` makes ONE attempt at every image of a chunk and reports per image (its steps:
worker.chunk_steps; its records: worker.records); the retry policy (worker.retry) decides what
goes back to the broker. Results are written to the store and the job index before the function
returns, and Celery acks only after it returns (acks_late).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
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
from ocrq.results import ImageRecord, ImageResult, ImageStatus
from worker import chunk_steps as steps
from worker.chunk_report import ChunkReport
from worker.context import WorkerContext
from worker.loop.intake import Intake
from worker.records import image_record, settle, store_documents
from worker.retry import backoff

log = logging.getLogger("ocrq.task")


def process_chunk(ctx: WorkerContext, chunk: Chunk, worker: str | None = None,
                  refused: dict[str, OcrqError] | None = None) -> ChunkReport:
    """One attempt at a chunk read from the broker (``refused``: its images the message itself
    refused, ``ocrq.messages.read_chunk``: recorded failed, never fetched)."""
    tag = f"job={chunk.job} n={len(chunk.items)}"
    running = ctx.index.record([image_record(chunk, it, ImageStatus.running, worker=worker) for it in chunk.items])
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
        report = _process_chunk(ctx, chunk, worker, intake, refused or {})
    report.skipped = skipped
    return report


def _process_chunk(ctx: WorkerContext, chunk: Chunk, worker: str | None, intake: Intake,
                   refused: dict[str, OcrqError]) -> ChunkReport:
    """One attempt at the chunk's images, step by step (worker.chunk_steps), one log line each."""
    t0 = time.monotonic()
    tag = f"job={chunk.job} n={len(chunk.items)}"

    fetched = steps.fetch(ctx, chunk, refused)
    log.info("→ fetch %s ok=%d bad=%d refused=%d %.2fs", tag, len(fetched.prepared), len(fetched.errors),
             len(refused), time.monotonic() - t0)

    cache = steps.check_cache(ctx, fetched.prepared)
    log.info("→ cache %s hits=%d misses=%d", tag, cache.n_hits, len(cache.units) - cache.n_hits)

    t_decode = time.monotonic()
    decoded = steps.decode_misses(ctx, fetched.prepared, cache)
    errors = fetched.errors | decoded.errors
    log.info("→ decode %s misses=%d bad=%d %.2fs", tag, decoded.misses, len(decoded.errors),
             time.monotonic() - t_decode)

    t_infer = time.monotonic()
    inferred = steps.infer(ctx, chunk, fetched.prepared, cache, errors, intake,
                           deadline=t0 + ctx.settings.queue.time_limit)
    log.info("→ infer %s units=%d shared=%d %.2fs", tag, inferred.units - len(inferred.shared), len(inferred.shared),
             time.monotonic() - t_infer)

    stored = steps.store(ctx, chunk, worker, fetched.prepared, cache, inferred, errors | inferred.errors, t0)
    log.info("→ store %s docs=%d %s", tag, stored.documents, ctx.store.location)

    # ack (by returning) — or hand the retryable images back to the broker, alone
    report = stored.report
    _set_countdown(ctx, report)
    log.info("← ack %s done=%d cached=%d failed=%d retry=%d %.2fs", tag, report.done, report.cached,
             report.failed, len(report.retry), time.monotonic() - t0)
    return report


def _set_countdown(ctx: WorkerContext, report: ChunkReport) -> None:
    if report.retry:
        q = ctx.settings.queue
        report.countdown = backoff(min(i.attempt for i in report.retry) - 1, q.backoff_base, q.backoff_max)


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
            report = process_chunk(ctx, chunk, worker=self.request.hostname, refused=read.refused)
        except OcrqError as exc:  # the store or Redis went away mid-chunk: retry every image
            report = _retry_all(ctx, chunk, exc, self.request.hostname)
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
            # the store or Redis away: wait it out as a chunk does (_outage_wait), or the job,
            # finished, would never get its export (no chunk is left to ask for it again)
            err = exc if isinstance(exc, OcrqError) else StorageUnavailable(f"Redis: {exc}")
            wait = _outage_wait(ctx, err, since)
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


def _outage_wait(ctx: WorkerContext, err: OcrqError, since: float | None) -> float | None:
    """Seconds to wait before trying again through an outage of ocrq's own store or Redis (a
    retryable error that is not the image's), or None once it lasted ``queue.outage_retry_s``.
    The wait grows with the outage, never below ``backoff_base`` (no spin) nor above
    ``backoff_max``."""
    q = ctx.settings.queue
    lasted = 0.0 if since is None else time.time() - since
    if not err.retryable or lasted >= q.outage_retry_s:
        return None
    return backoff(1, max(q.backoff_base, min(q.backoff_max, lasted)), q.backoff_max)


def _retry_all(ctx: WorkerContext, chunk: Chunk, err: OcrqError, worker: str | None) -> ChunkReport:
    log.warning("! chunk job=%s failed as a whole: %s", chunk.job, err)
    report = ChunkReport()
    wait = _outage_wait(ctx, err, chunk.outage_since)
    if wait is not None:
        # ocrq's own store or Redis is away, not the images: they go back with their attempts
        # unspent (a 10 s S3 outage used to exhaust some images' four attempts)
        report.retry = list(chunk.items)
        report.outage_since = chunk.outage_since if chunk.outage_since is not None else time.time()
        report.countdown = wait
        _record_all(ctx, chunk, [image_record(chunk, it, ImageStatus.retrying, err, worker=worker)
                                 for it in chunk.items])
        return report
    records = [settle(ctx, chunk, it, err, None, worker, report) for it in chunk.items]
    failed = [rec for rec in records if rec.status is ImageStatus.failed]
    part = None
    try:
        part, _ = store_documents(ctx, chunk, [ImageResult(record=rec) for rec in failed],
                                  lambda writes, new: ctx.store.put_many(writes, new=new))
    except Exception as exc:
        # the final failures cannot be written (the store is what is down): acking them now would
        # leave them "running" for good. They go back as they are, their attempt not counted
        # again: the next attempt records them, or succeeds if the store is back.
        log.warning("! could not store the failure of %d image(s) of job=%s, handed back: %s",
                    len(failed), chunk.job, exc)
        back = {rec.id for rec in failed}
        report.retry += [it for it in chunk.items if it.id in back]
        report.failed, report.failures = 0, []
        records = [image_record(chunk, it, ImageStatus.retrying, err, worker=worker) if it.id in back else rec
                   for it, rec in zip(chunk.items, records, strict=True)]
    _set_countdown(ctx, report)
    _record_all(ctx, chunk, records, part)
    return report


def _record_all(ctx: WorkerContext, chunk: Chunk, records: list[ImageRecord], part: int | None = None) -> None:
    """A whole-chunk failure's records: counted, then indexed (Redis may be what is away: the
    retry message still carries the images)."""
    ctx.metrics.observe_records(chunk.task, records)
    try:
        ctx.index.record(records, part=part)
    except Exception:
        log.exception("! could not record chunk failure for job=%s", chunk.job)

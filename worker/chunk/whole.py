"""A chunk that failed as a whole (the store or Redis went away mid-attempt): what its images
become, when no step can say it image by image.

Through an outage of ocrq's own store or Redis (``worker.chunk.retry.outage_wait``) the images go
back with their attempts unspent (a 10 s S3 outage used to exhaust some images' four attempts).
Past ``queue.outage_retry_s``, each image's error is settled as any other; the final failures'
documents are stored, and when even that fails (the store is what is down) they go back as
they are rather than be acked "running" for good.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from ocrq.errors import OcrqError
from ocrq.messages import Chunk
from ocrq.results import ImageRecord, ImageResult, ImageStatus
from worker.chunk.needs import Worker
from worker.chunk.records import image_record, settle
from worker.chunk.report import ChunkReport, failure
from worker.chunk.retry import countdown, outage_wait
from worker.chunk.store import write_documents

log = logging.getLogger("ocrq.task")


def retry_all(ctx: Worker, chunk: Chunk, err: OcrqError) -> ChunkReport:
    """The report of ``chunk`` failed as a whole with ``err`` (its records written, best effort)."""
    log.warning("! chunk job=%s failed as a whole: %s", chunk.job, err)
    wait = outage_wait(ctx.settings.queue, err, chunk.outage_since)
    if wait is not None:
        # ocrq's own store or Redis is away, not the images: they go back with their attempts unspent
        since = chunk.outage_since if chunk.outage_since is not None else time.time()
        record_all(ctx, chunk, [image_record(chunk, it, ImageStatus.retrying, err, worker=ctx.hostname)
                                for it in chunk.items])
        return ChunkReport(retry=tuple(chunk.items), outage_since=since, countdown=wait)
    settled = [settle(ctx.settings.queue.max_attempts, chunk, it, err, None, ctx.hostname) for it in chunk.items]
    report = ChunkReport(retry=tuple(s.retry for s in settled if s.retry is not None),
                         failures=tuple(failure(it, s.failure) for it, s in zip(chunk.items, settled, strict=True)
                                        if s.failure is not None))
    report = replace(report, failed=len(report.failures))
    records = [s.record for s in settled]
    failed = [rec for rec in records if rec.status is ImageStatus.failed]
    part = None
    try:
        part, _ = write_documents(ctx, chunk, [ImageResult(record=rec) for rec in failed],
                                  lambda writes, new: ctx.store.put_many(writes, new=new))
    except Exception as exc:
        # the final failures cannot be written (the store is what is down): acking them now would
        # leave them "running" for good. They go back as they are, their attempt not counted
        # again: the next attempt records them, or succeeds if the store is back.
        log.warning("! could not store the failure of %d image(s) of job=%s, handed back: %s",
                    len(failed), chunk.job, exc)
        back = {rec.id for rec in failed}
        report = replace(report, retry=report.retry + tuple(it for it in chunk.items if it.id in back),
                         failed=0, failures=())
        records = [image_record(chunk, it, ImageStatus.retrying, err, worker=ctx.hostname) if it.id in back else rec
                   for it, rec in zip(chunk.items, records, strict=True)]
    record_all(ctx, chunk, records, part)
    return replace(report, countdown=countdown(ctx.settings.queue, report.retry)) if report.retry else report


def record_all(ctx: Worker, chunk: Chunk, records: list[ImageRecord], part: int | None = None) -> None:
    """A whole-chunk failure's records: counted, then indexed (Redis may be what is away: the
    retry message still carries the images)."""
    ctx.metrics.observe_records(chunk.task, records)
    try:
        ctx.index.record(records, part=part)
    except Exception:
        log.exception("! could not record chunk failure for job=%s", chunk.job)

"""The chunk task: the life of a message, top to bottom.

    fetch + hash → cache check → decode (misses only) → plan batch + infer (engine loop) → store → ack
    (→ the job's export, by whichever chunk finishes the job: ``finish_job``, ocrq.export)

``process_chunk`` makes ONE attempt at every image of a chunk and reports per image; the retry
policy (worker.retry) decides what goes back to the broker. Results are written to the store and
the job index before the function returns, and Celery acks only after it returns (acks_late).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from celery import Celery, Task
from celery.exceptions import Reject, Retry

from ocrq import keys
from ocrq.errors import EngineTimeout, OcrqError, TooLarge, classify
from ocrq.export import export_job, request_export
from ocrq.messages import FINISH_JOB_TASK, OCR_CHUNK_TASK, Chunk, Item, chunk_argsrepr, message_bytes
from ocrq.redact import redact_url
from ocrq.results import ErrorInfo, ImageRecord, ImageResult, ImageStatus, OcrOutput
from worker.context import WorkerContext
from worker.engines.base import OcrRequest
from worker.fanout import fan_out
from worker.loop.intake import Intake
from worker.prepare import Prepared, assemble, decode_misses, fetch_groups, on_page, prepare
from worker.retry import backoff, final_error

log = logging.getLogger("ocrq.task")


#: failed images named one by one in a chunk's result (Flower's task page); the rest are counted
_NAMED_FAILURES = 8


@dataclass
class ChunkReport:
    done: int = 0
    cached: int = 0
    failed: int = 0
    retry: list[Item] = field(default_factory=list)
    countdown: float = 0.0
    #: the retry message's ``Chunk.outage_since`` (None: not an outage hand-back)
    outage_since: float | None = None
    #: (ref, error type, message) of each image that failed for good in this attempt
    failures: list[tuple[str, str, str]] = field(default_factory=list)
    #: images not run: done already, or their job archived (a late redelivery)
    skipped: int = 0

    def fail(self, item: Item, err: OcrqError) -> None:
        self.failed += 1
        self.failures.append((redact_url(item.ref), type(err).__name__, err.to_dict()["message"]))

    def summary(self) -> dict[str, Any]:
        """The chunk task's result, as Flower's task list and task page show it: ``outcome``
        first, so a chunk with failed images reads as such although its state is SUCCESS."""
        total = self.done + self.failed + len(self.retry)
        by_type: dict[str, int] = {}
        for _, kind, _ in self.failures:
            by_type[kind] = by_type.get(kind, 0) + 1
        if self.failed:
            outcome = f"FAILED {self.failed}/{total}: " + ", ".join(f"{k}×{n}" for k, n in sorted(by_type.items()))
        elif self.retry:
            outcome = f"RETRY {len(self.retry)}/{total}"
        else:
            outcome = f"ok {self.done}/{total}"
        if not total and self.skipped:
            outcome = f"skipped {self.skipped}: done already"
        out: dict[str, Any] = {"outcome": outcome, "done": self.done, "cached": self.cached,
                               "failed": self.failed, "retry": len(self.retry)}
        if self.skipped:
            out["skipped"] = self.skipped
        if self.failures:
            out["errors"] = [{"ref": ref, "type": kind, "message": msg[:300]}
                             for ref, kind, msg in self.failures[:_NAMED_FAILURES]]
        return out


def process_chunk(ctx: WorkerContext, chunk: Chunk, worker: str | None = None) -> ChunkReport:
    tag = f"job={chunk.job} n={len(chunk.items)}"
    running = ctx.index.record([_record(chunk, it, ImageStatus.running, worker=worker) for it in chunk.items])
    skipped = running.count(False)
    if skipped:
        # done already (a redelivery of a chunk whose results were written before its ack was
        # lost), or its job archived: the result stands, the image is not run again
        log.info("→ skip %s: %d image(s) already done or their job archived", tag, skipped)
        chunk = chunk.model_copy(update={"items": [it for it, ok in zip(chunk.items, running, strict=True) if ok]})
        if not chunk.items:
            return ChunkReport(skipped=skipped)
    # while its images are fetched and decoded, an idle engine waits for them rather than run
    # the chunks that came first alone (worker.loop.engine_loop: expecting)
    with ctx.loop.expecting(len(chunk.items)) as intake:
        report = _process_chunk(ctx, chunk, worker, intake)
    report.skipped = skipped
    return report


def _process_chunk(ctx: WorkerContext, chunk: Chunk, worker: str | None, intake: Intake) -> ChunkReport:  # noqa: C901
    t0 = time.monotonic()
    tag = f"job={chunk.job} n={len(chunk.items)}"

    # 1. fetch + hash (PDFs rendered: their pages are the cache units) — in the fetch pool, a few
    # groups per chunk (worker.fanout), overlapping other chunks' inference
    prepared: dict[str, Prepared] = {}
    errors: dict[str, OcrqError] = {}
    fetched = fan_out(ctx.fetch_pool, fetch_groups(ctx, chunk), lambda it: prepare(ctx, chunk, it), chunk.items)
    for it, outcome in zip(chunk.items, fetched, strict=True):
        if isinstance(outcome, Exception):  # typed errors from refs/documents; anything else is classified
            errors[it.id] = classify(outcome)
        else:
            prepared[it.id] = outcome
    log.info("→ fetch %s ok=%d bad=%d %.2fs", tag, len(prepared), len(errors), time.monotonic() - t0)

    # 2. cache check: one MGET for the chunk (files, and PDF pages one by one); hits are neither
    # decoded nor sent to the engine
    units = [(item_id, n, unit) for item_id, prep in prepared.items() for n, unit in enumerate(prep.units)]
    reads: list[int] = []  # the store requests this attempt makes, for the job's cost
    hits = ctx.cache.get_many([unit.cache_key for _, _, unit in units], reads)
    n_hits = sum(unit.cache_key in hits for _, _, unit in units)
    ctx.metrics.observe_cache(n_hits, len(units) - n_hits)
    log.info("→ cache %s hits=%d misses=%d", tag, n_hits, len(units) - n_hits)

    # 3. validate (decode) the plain images that missed, in the fetch pool and through the
    # isolated decoder (worker.decoding.decode: a few batches per chunk); a bad image fails here, typed
    misses = [p for p in prepared.values() if not p.document and p.units[0].cache_key not in hits]
    for p in prepared.values():
        if p.data and p.units[0].cache_key in hits:
            p.data = b""  # a hit is never decoded: its bytes can go now
    for prep, bad in zip(misses, decode_misses(ctx, misses), strict=True):
        if bad is not None:
            errors[prep.item.id] = classify(bad)

    # 4. plan + infer: every page goes to the engine loop (one hand-off for the chunk), whose
    # governor forms the micro-batches
    t1 = time.monotonic()
    todo = [(i, n, unit) for i, n, unit in units if unit.cache_key not in hits and i not in errors]
    to_run = [(i, n, k, unit.cache_key, pg) for i, n, unit in todo for k, pg in enumerate(unit.pages)]
    submitted = ctx.submit_once_many([
        (f"{key}#{k}", OcrRequest(f"{i}#{pg.index}", pg.image, *chunk.spec(prepared[i].item),
                                   priority=chunk.priority))
        for i, _, k, key, pg in to_run])
    intake.close()
    pending: dict[tuple[str, int], list[Future[OcrOutput]]] = {(i, n): [] for i, n, _ in todo}
    # same content already in flight (here or in another chunk): the engine runs once, the rest are hits
    all_shared = dict.fromkeys(pending, True)
    for (i, n, _, _, _), (fut, was_shared) in zip(to_run, submitted, strict=True):
        pending[(i, n)].append(fut)
        all_shared[(i, n)] = all_shared[(i, n)] and was_shared
    shared = {u for u, was in all_shared.items() if was}
    computed: dict[tuple[str, int], list[OcrOutput]] = {}
    # the threads pool has no Celery time limits: the chunk's own deadline bounds the wait, and
    # an image still in the engine then is retried (its retry joins the same in-flight future)
    deadline = t0 + ctx.settings.queue.time_limit
    # one wake-up when the chunk's last page is done (not one per engine batch: with batches of 4,
    # the thread slept and woke for every 4 images)
    wait([f for futures in pending.values() for f in futures], timeout=max(0.0, deadline - time.monotonic()))
    for (item_id, n), page_futures in pending.items():
        if item_id in errors:  # another page of this document already failed
            continue
        try:
            computed[(item_id, n)] = [
                on_page(f.result(timeout=max(0.0, deadline - time.monotonic())), pg.index)
                for f, pg in zip(page_futures, prepared[item_id].units[n].pages, strict=True)
            ]
        except FutureTimeout:
            errors[item_id] = EngineTimeout(f"no engine result within {ctx.settings.queue.time_limit}s")
        except Exception as exc:
            errors[item_id] = classify(exc)
    log.info("→ infer %s units=%d shared=%d %.2fs", tag, len(pending) - len(shared), len(shared),
             time.monotonic() - t1)

    # 5. store: cache entries (durable + hot) and one result document per image (one store call),
    # then the job index (pages computed for a document whose other page failed are cached too:
    # its retry hits them; the outputs carry their page numbers: an entry is stored as computed)
    computed_units: dict[str, list[int]] = {}
    for i, n in computed:
        computed_units.setdefault(i, []).append(n)
    report = ChunkReport()
    records: list[ImageRecord] = []
    docs: list[ImageResult] = []
    max_pages = ctx.settings.limits.max_pages
    for item in chunk.items:
        got = prepared.get(item.id)
        if item.id in errors:
            rec = _settle(ctx, chunk, item, errors[item.id], got, worker, report)
            if rec.status is ImageStatus.failed:
                docs.append(ImageResult(record=rec))
        else:
            assert got is not None
            mine = computed_units.get(item.id, [])
            outs, cached = assemble(got, hits, {n: computed[(item.id, n)] for n in mine},
                                    {n for n in mine if (item.id, n) in shared}, max_pages)
            rec = _record(chunk, item, ImageStatus.done, None, got, cached=cached, pages=len(outs),
                          worker=worker, **({} if cached else _engine_share(outs)))
            report.done += 1
            report.cached += cached
            docs.append(ImageResult(record=rec, outputs=outs))
        records.append(rec)
    part, writes = _documents(ctx, chunk, docs)
    entries = {prepared[i].units[n].cache_key: outs for (i, n), outs in computed.items() if (i, n) not in shared}
    ctx.cache.put_many(entries, documents=writes)
    ctx.index.record(records, requests=(len(entries) + len(writes), sum(reads)), part=part)
    ctx.metrics.observe_records(chunk.task, records, time.monotonic() - t0)
    log.info("→ store %s docs=%d %s", tag, len(docs), ctx.store.location)

    # 6. ack (by returning) — or hand the retryable images back to the broker, alone
    _set_countdown(ctx, report)
    log.info("← ack %s done=%d cached=%d failed=%d retry=%d %.2fs", tag, report.done, report.cached,
             report.failed, len(report.retry), time.monotonic() - t0)
    return report


def _documents(ctx: WorkerContext, chunk: Chunk, docs: list[ImageResult]) -> tuple[int | None, list[tuple[str, Any]]]:
    """The store writes of a chunk's final images: one result part holding their documents
    (ocrq.parts; its number goes into their markers) and, per failed image, the failed registry's
    durable mirror (losing Redis does not lose what failed)."""
    if not docs:
        return None, []
    epoch, part = ctx.index.new_part(chunk.job)
    path = keys.result_part(chunk.job, epoch, part)
    writes: list[tuple[str, Any]] = [(path, b"\n".join(d.model_dump_json().encode() for d in docs) + b"\n")]
    items = {it.id: it for it in chunk.items}
    writes += [(keys.failed_object(d.record.job, d.record.id), _failed_entry(chunk, items[d.record.id], d.record, path))
               for d in docs if d.record.status == ImageStatus.failed]
    return part, writes


def _settle(ctx: WorkerContext, chunk: Chunk, item: Item, err: OcrqError, prep: Prepared | None,
            worker: str | None, report: ChunkReport) -> ImageRecord:
    """The one place an image's error becomes either another attempt (queued on ``report``,
    recorded ``retrying``) or its final ``failed`` record (the permanent error, or
    ``RetriesExhausted`` naming the last cause once the attempt budget is spent)."""
    final = final_error(err, item.attempt, ctx.settings.queue.max_attempts)
    if final is None:
        report.retry.append(item.model_copy(update={"attempt": item.attempt + 1}))
        return _record(chunk, item, ImageStatus.retrying, err, prep, worker=worker)
    report.fail(item, final)
    return _record(chunk, item, ImageStatus.failed, final, prep, worker=worker)


def _failed_entry(chunk: Chunk, item: Item, rec: ImageRecord, document: str) -> dict[str, Any]:
    """The failed registry's durable mirror of one image (what ``ocrq failed --from-store`` reads,
    and ``ocrq reprocess`` re-runs with the image's own task and params); ``document``: the result
    part holding its document (``ocrq failed show`` reads it there)."""
    task, params = chunk.spec(item)
    return {"record": rec.model_dump(mode="json"), "task": task, "params": params,
            "failed_at": time.time(), "document": document}


def _set_countdown(ctx: WorkerContext, report: ChunkReport) -> None:
    if report.retry:
        q = ctx.settings.queue
        report.countdown = backoff(min(i.attempt for i in report.retry) - 1, q.backoff_base, q.backoff_max)


def _record(chunk: Chunk, item: Item, status: ImageStatus, error: OcrqError | None = None,
            prep: Prepared | None = None, cached: bool = False, pages: int = 0,
            worker: str | None = None, **engine: Any) -> ImageRecord:
    return ImageRecord(
        id=item.id, job=chunk.job, ref=redact_url(item.ref), status=status, attempts=item.attempt,
        cached=cached, pages=pages, worker=worker, row=item.row, updated=time.time(),
        sha256=prep.sha256 if prep else None, cache_key=prep.cache_key if prep else None,
        error=ErrorInfo(**error.to_dict()) if error else None, **engine,
    )


def _engine_share(outputs: list[OcrOutput]) -> dict[str, Any]:
    """The engine seconds an image shared (its pages' batch time / batch size) and its batch."""
    shares = [o.meta["batch"] for o in outputs if isinstance(o.meta.get("batch"), dict)]
    if not shares:
        return {}
    return {"engine_s": round(sum(float(b.get("engine_s", 0)) for b in shares), 6),
            "batch": shares[0].get("id"), "batch_size": shares[0].get("size")}


def register_tasks(app: Celery, get_ctx: Callable[[], WorkerContext]) -> Task:
    """Register the chunk task on ``app``; the context is built once per worker process."""

    # ignore_result: the outcome is the job's records and documents, and Flower shows each
    # chunk's summary from its task events; a result backend write is a write that a full
    # broker Redis refuses, and the STARTED one (track_started) before the task body runs
    @app.task(name=OCR_CHUNK_TASK, bind=True, max_retries=None, ignore_result=True)
    def ocr_chunk(self: Task, message: dict[str, Any]) -> dict[str, Any]:
        chunk = Chunk.model_validate(message)
        ctx = get_ctx()
        size, cap = message_bytes(message), ctx.settings.queue.max_message_bytes
        try:
            if size > cap:  # not from our producer (it refuses these): fail its images, typed
                raise TooLarge(f"chunk message of {size} bytes exceeds queue.max_message_bytes ({cap})")
            report = process_chunk(ctx, chunk, worker=self.request.hostname)
        except OcrqError as exc:  # the store or Redis went away mid-chunk: retry every image
            report = _retry_all(ctx, chunk, exc, self.request.hostname)
        if ctx.feeder is not None:  # room in the job's window: the next shard may go out
            ctx.feeder.poke(chunk.job)
        if report.done or report.failed:  # this chunk may have finished the job: export it once
            queue = (self.request.delivery_info or {}).get("routing_key") or ctx.settings.queue.name
            try:
                request_export(ctx.redis, ctx.index, chunk.job, lambda tid: app.send_task(
                    FINISH_JOB_TASK, args=[chunk.job], task_id=tid, queue=queue), ctx.settings.redis.job_ttl)
            except Exception:  # the results stand; `ocrq export JOB` writes the export later
                log.exception("! could not publish the export of job=%s", chunk.job)
        if report.retry:
            retry_msg = chunk.model_copy(update={"items": report.retry,
                                                 "outage_since": report.outage_since}).to_message()
            try:
                self.retry(args=(retry_msg,), countdown=report.countdown,  # raises Retry
                           argsrepr=chunk_argsrepr(retry_msg))
            except Retry:
                raise
            except Exception as exc:
                # could not publish the retry (broker down): give the message back, lose nothing
                raise Reject(f"retry publish failed: {exc}", requeue=True) from exc
        return report.summary()

    @app.task(name=FINISH_JOB_TASK, bind=True, max_retries=None, ignore_result=True)
    def finish_job(self: Task, job: str, outage_since: float | None = None) -> dict[str, Any]:
        ctx = get_ctx()
        try:
            marker = export_job(ctx.index, ctx.store, job)
        except OcrqError as exc:
            # the store or Redis away: wait it out as a chunk does (_outage_wait), or the job,
            # finished, would never get its export (no chunk is left to ask for it again)
            wait = _outage_wait(ctx, exc, outage_since)
            if wait is not None:
                since = outage_since if outage_since is not None else time.time()
                raise self.retry(args=(job,), kwargs={"outage_since": since}, countdown=wait) from exc
            ctx.redis.delete(keys.job_finishing(job))  # the next finishing chunk or `ocrq export` retries
            raise
        log.info("← export job=%s %s", job, marker)
        if marker.get("exported") and not _archive(ctx, job, marker["counts"]["total"]):
            # images came in while it ran (redelivered chunks whose records Redis lost): export again
            ctx.redis.delete(keys.job_finishing(job))
            queue = (self.request.delivery_info or {}).get("routing_key") or ctx.settings.queue.name
            request_export(ctx.redis, ctx.index, job, lambda tid: app.send_task(
                FINISH_JOB_TASK, args=[job], task_id=tid, queue=queue), ctx.settings.redis.job_ttl)
        return marker

    return ocr_chunk


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
        _record_all(ctx, chunk, [_record(chunk, it, ImageStatus.retrying, err, worker=worker)
                                 for it in chunk.items])
        return report
    records = [_settle(ctx, chunk, it, err, None, worker, report) for it in chunk.items]
    failed = [rec for rec in records if rec.status is ImageStatus.failed]
    part = None
    try:
        part, writes = _documents(ctx, chunk, [ImageResult(record=rec) for rec in failed])
        ctx.store.put_many(writes)
    except Exception as exc:
        # the final failures cannot be written (the store is what is down): acking them now would
        # leave them "running" for good. They go back as they are, their attempt not counted
        # again: the next attempt records them, or succeeds if the store is back.
        log.warning("! could not store the failure of %d image(s) of job=%s, handed back: %s",
                    len(failed), chunk.job, exc)
        back = {rec.id for rec in failed}
        report.retry += [it for it in chunk.items if it.id in back]
        report.failed, report.failures = 0, []
        records = [_record(chunk, it, ImageStatus.retrying, err, worker=worker) if it.id in back else rec
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

"""The chunk task: the life of a message, top to bottom.

    fetch → validate (decode) → cache check → plan batch + infer (engine loop) → store → ack
    (→ the job's export, by whichever chunk finishes the job: ``finish_job``, ocrq.export)

``process_chunk`` makes ONE attempt at every image of a chunk and reports per image; the retry
policy (worker.retry) decides what goes back to the broker. Results are written to the store and
the job index before the function returns, and Celery acks only after it returns (acks_late).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from celery import Celery, Task
from celery.exceptions import Reject, Retry

from ocrq import keys
from ocrq.errors import EngineTimeout, OcrqError, TooLarge, classify
from ocrq.export import export_job, request_export
from ocrq.fetch import fetch
from ocrq.messages import FINISH_JOB_TASK, OCR_CHUNK_TASK, Chunk, Item, chunk_argsrepr, message_bytes
from ocrq.redact import redact_url
from ocrq.results import ErrorInfo, ImageRecord, ImageResult, ImageStatus, OcrOutput
from worker.context import WorkerContext
from worker.engines.base import OcrRequest
from worker.images import Page, decode, sha256_hex
from worker.retry import backoff, final_error

log = logging.getLogger("ocrq.task")


@dataclass
class Unit:
    """What one cache entry covers: a whole image file (all its frames), or one PDF page."""

    cache_key: str
    pages: list[Page]


@dataclass
class Prepared:
    item: Item
    sha256: str
    units: list[Unit]

    @property
    def cache_key(self) -> str | None:
        """The file's cache key (None for a PDF: each page has its own, in its output's meta)."""
        return self.units[0].cache_key if len(self.units) == 1 and self.units[0].pages[0].digest is None else None


#: failed images named one by one in a chunk's result (Flower's task page); the rest are counted
_NAMED_FAILURES = 8


@dataclass
class ChunkReport:
    done: int = 0
    cached: int = 0
    failed: int = 0
    retry: list[Item] = field(default_factory=list)
    countdown: float = 0.0
    #: (ref, error type, message) of each image that failed for good in this attempt
    failures: list[tuple[str, str, str]] = field(default_factory=list)

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
        out: dict[str, Any] = {"outcome": outcome, "done": self.done, "cached": self.cached,
                               "failed": self.failed, "retry": len(self.retry)}
        if self.failures:
            out["errors"] = [{"ref": ref, "type": kind, "message": msg[:300]}
                             for ref, kind, msg in self.failures[:_NAMED_FAILURES]]
        return out


def _prepare(ctx: WorkerContext, chunk: Chunk, item: Item) -> Prepared:
    data = fetch(item.ref, ctx.settings.limits, s3_client=ctx.s3_client)
    pages = ctx.decoder.decode(data) if ctx.decoder else decode(data, ctx.settings.limits)
    sha = sha256_hex(data)

    def key(content: str) -> str:
        return keys.cache_key(content, ctx.engine.revision, chunk.task, chunk.params)

    if all(pg.digest for pg in pages):  # PDF pages: cached page by page, by their pixels
        return Prepared(item, sha, [Unit(key(pg.digest or ""), [pg]) for pg in pages])
    return Prepared(item, sha, [Unit(key(sha), pages)])


def process_chunk(ctx: WorkerContext, chunk: Chunk, worker: str | None = None) -> ChunkReport:  # noqa: C901
    t0 = time.monotonic()
    tag = f"job={chunk.job} n={len(chunk.items)}"
    ctx.index.record([_record(chunk, it, ImageStatus.running, worker=worker) for it in chunk.items])

    # 1-2. fetch + validate: bytes, decode, hash — in the fetch pool, overlapping other chunks' inference
    futures = {it.id: ctx.fetch_pool.submit(_prepare, ctx, chunk, it) for it in chunk.items}
    prepared: dict[str, Prepared] = {}
    errors: dict[str, OcrqError] = {}
    for item_id, fut in futures.items():
        try:
            prepared[item_id] = fut.result()
        except Exception as exc:  # typed errors from refs/images; anything else is classified
            errors[item_id] = classify(exc)
    log.info("→ fetch %s ok=%d bad=%d %.2fs", tag, len(prepared), len(errors), time.monotonic() - t0)

    # 3. cache check: one MGET for the chunk (files, and PDF pages one by one); hits never reach the engine
    units = [(item_id, n, unit) for item_id, prep in prepared.items() for n, unit in enumerate(prep.units)]
    hits = ctx.cache.get_many([unit.cache_key for _, _, unit in units])
    n_hits = sum(unit.cache_key in hits for _, _, unit in units)
    ctx.metrics.observe_cache(n_hits, len(units) - n_hits)
    log.info("→ cache %s hits=%d misses=%d", tag, n_hits, len(units) - n_hits)

    # 4. plan + infer: every page goes to the engine loop, whose governor forms the micro-batches
    t1 = time.monotonic()
    pending: dict[tuple[str, int], list[Future[OcrOutput]]] = {}
    shared: set[tuple[str, int]] = set()  # same content already in flight: the engine runs once, this is a hit
    for item_id, n, unit in units:
        if unit.cache_key not in hits:
            subs = [ctx.submit_once(f"{unit.cache_key}#{i}",
                                    OcrRequest(f"{item_id}#{pg.index}", pg.image, chunk.task, chunk.params))
                    for i, pg in enumerate(unit.pages)]
            pending[(item_id, n)] = [f for f, _ in subs]
            if all(was_shared for _, was_shared in subs):
                shared.add((item_id, n))
    computed: dict[tuple[str, int], list[OcrOutput]] = {}
    # the threads pool has no Celery time limits: the chunk's own deadline bounds the wait, and
    # an image still in the engine then is retried (its retry joins the same in-flight future)
    deadline = t0 + ctx.settings.queue.time_limit
    for (item_id, n), page_futures in pending.items():
        if item_id in errors:  # another page of this document already failed
            continue
        try:
            computed[(item_id, n)] = [f.result(timeout=max(0.0, deadline - time.monotonic()))
                                      for f in page_futures]
        except FutureTimeout:
            errors[item_id] = EngineTimeout(f"no engine result within {ctx.settings.queue.time_limit}s")
        except Exception as exc:
            errors[item_id] = classify(exc)
    log.info("→ infer %s units=%d shared=%d %.2fs", tag, len(pending) - len(shared), len(shared),
             time.monotonic() - t1)

    # 5. store: cache entries (durable + hot), one result document per image, then the job index
    # (pages computed for a document whose other page failed are cached too: its retry hits them)
    fresh = {prepared[i].units[n].cache_key: [o.model_copy(update={"page": pg.index}) for o, pg in
                                              zip(outs, prepared[i].units[n].pages, strict=True)]
             for (i, n), outs in computed.items() if (i, n) not in shared}
    ctx.cache.put_many(fresh)
    report = ChunkReport()
    records: list[ImageRecord] = []
    docs: list[ImageResult] = []
    for item in chunk.items:
        got = prepared.get(item.id)
        if item.id in errors:
            rec = _settle(ctx, chunk, item, errors[item.id], got, worker, report)
            if rec.status is ImageStatus.failed:
                docs.append(ImageResult(record=rec))
        else:
            assert got is not None
            outs, cached = _assemble(item.id, got, hits, computed, shared)
            rec = _record(chunk, item, ImageStatus.done, None, got, cached=cached, pages=len(outs),
                          worker=worker)
            if not cached:
                rec = rec.model_copy(update=_engine_share(outs))
            report.done += 1
            report.cached += cached
            docs.append(ImageResult(record=rec, outputs=outs))
        records.append(rec)
    writes = [(keys.result_object(d.record.job, d.record.id), d.model_dump(mode="json")) for d in docs]
    # the failed registry's durable mirror: losing Redis does not lose what failed
    writes += [(keys.failed_object(d.record.job, d.record.id), _failed_entry(chunk, d.record))
               for d in docs if d.record.status == ImageStatus.failed]
    list(ctx.fetch_pool.map(lambda w: ctx.store.put_json(*w), writes))
    ctx.index.record(records)
    ctx.metrics.observe_records(chunk.task, records, time.monotonic() - t0)
    log.info("→ store %s docs=%d %s", tag, len(docs), ctx.store.location)

    # 6. ack (by returning) — or hand the retryable images back to the broker, alone
    _set_countdown(ctx, report)
    log.info("← ack %s done=%d cached=%d failed=%d retry=%d %.2fs", tag, report.done, report.cached,
             report.failed, len(report.retry), time.monotonic() - t0)
    return report


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


def _failed_entry(chunk: Chunk, rec: ImageRecord) -> dict[str, Any]:
    """The failed registry's durable mirror of one image (what ``ocrq failed --from-store`` reads)."""
    return {"record": rec.model_dump(mode="json"), "task": chunk.task, "params": chunk.params,
            "failed_at": time.time()}


def _set_countdown(ctx: WorkerContext, report: ChunkReport) -> None:
    if report.retry:
        q = ctx.settings.queue
        report.countdown = backoff(min(i.attempt for i in report.retry) - 1, q.backoff_base, q.backoff_max)


def _assemble(item_id: str, prep: Prepared, hits: dict[str, list[OcrOutput]],
              computed: dict[tuple[str, int], list[OcrOutput]],
              shared: set[tuple[str, int]]) -> tuple[list[OcrOutput], bool]:
    """An image's outputs in page order, and whether none of them ran the engine for it."""
    outs: list[OcrOutput] = []
    cached = True
    for n, unit in enumerate(prep.units):
        if unit.cache_key in hits:
            source = hits[unit.cache_key]
        else:
            source = computed[(item_id, n)]
            cached = cached and (item_id, n) in shared
        # a cached file entry may hold fewer frames than max_pages now allows: it is used as is
        for out, pg in zip(source, unit.pages, strict=False):
            meta = {**out.meta, "cache_key": unit.cache_key} if pg.digest else out.meta
            outs.append(out.model_copy(update={"page": pg.index, "meta": meta}))
    return outs, cached


def _record(chunk: Chunk, item: Item, status: ImageStatus, error: OcrqError | None = None,
            prep: Prepared | None = None, cached: bool = False, pages: int = 0,
            worker: str | None = None) -> ImageRecord:
    return ImageRecord(
        id=item.id, job=chunk.job, ref=redact_url(item.ref), status=status, attempts=item.attempt,
        cached=cached, pages=pages, worker=worker, row=item.row,
        sha256=prep.sha256 if prep else None, cache_key=prep.cache_key if prep else None,
        error=ErrorInfo(**error.to_dict()) if error else None,
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

    @app.task(name=OCR_CHUNK_TASK, bind=True, max_retries=None)
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
        if report.done or report.failed:  # this chunk may have finished the job: export it once
            queue = (self.request.delivery_info or {}).get("routing_key") or ctx.settings.queue.name
            try:
                request_export(ctx.redis, ctx.index, chunk.job, lambda tid: app.send_task(
                    FINISH_JOB_TASK, args=[chunk.job], task_id=tid, queue=queue), ctx.settings.redis.job_ttl)
            except Exception:  # the results stand; `ocrq export JOB` writes the export later
                log.exception("! could not publish the export of job=%s", chunk.job)
        if report.retry:
            retry_msg = chunk.model_copy(update={"items": report.retry}).to_message()
            try:
                self.retry(args=(retry_msg,), countdown=report.countdown,  # raises Retry
                           argsrepr=chunk_argsrepr(retry_msg))
            except Retry:
                raise
            except Exception as exc:
                # could not publish the retry (broker down): give the message back, lose nothing
                raise Reject(f"retry publish failed: {exc}", requeue=True) from exc
        return report.summary()

    @app.task(name=FINISH_JOB_TASK, bind=True, max_retries=None)
    def finish_job(self: Task, job: str) -> dict[str, Any]:
        ctx = get_ctx()
        try:
            marker = export_job(ctx.index, ctx.store, job, ctx.fetch_pool)
        except OcrqError as exc:
            q = ctx.settings.queue
            if exc.retryable and self.request.retries + 1 < q.max_attempts:
                raise self.retry(countdown=backoff(self.request.retries, q.backoff_base, q.backoff_max)) from exc
            ctx.redis.delete(keys.job_finishing(job))  # the next finishing chunk or `ocrq export` retries
            raise
        log.info("← export job=%s %s", job, marker)
        return marker

    return ocr_chunk


def _retry_all(ctx: WorkerContext, chunk: Chunk, err: OcrqError, worker: str | None) -> ChunkReport:
    log.warning("! chunk job=%s failed as a whole: %s", chunk.job, err)
    report = ChunkReport()
    records = [_settle(ctx, chunk, it, err, None, worker, report) for it in chunk.items]
    _set_countdown(ctx, report)
    ctx.metrics.observe_records(chunk.task, records)
    try:
        for rec in records:
            if rec.status is ImageStatus.failed:
                ctx.store.put_json(keys.result_object(rec.job, rec.id), ImageResult(record=rec).model_dump(mode="json"))
                ctx.store.put_json(keys.failed_object(rec.job, rec.id), _failed_entry(chunk, rec))
        ctx.index.record(records)
    except Exception:
        log.exception("! could not record chunk failure for job=%s", chunk.job)
    return report

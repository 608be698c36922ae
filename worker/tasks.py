"""The chunk task: the life of a message, top to bottom.

    fetch + hash → cache check → decode (misses only) → plan batch + infer (engine loop) → store → ack

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
from ocrq.errors import EngineTimeout, OcrqError, classify
from ocrq.fetch import fetch
from ocrq.messages import OCR_CHUNK_TASK, Chunk, Item
from ocrq.results import ErrorInfo, ImageRecord, ImageResult, ImageStatus, OcrOutput
from worker.context import WorkerContext
from worker.engines.base import OcrRequest
from worker.fanout import fan_out
from worker.images import Page, decode, sha256_hex
from worker.retry import backoff, final_error

log = logging.getLogger("ocrq.task")


@dataclass
class Prepared:
    item: Item
    sha256: str
    pages: list[Page]
    cache_key: str
    #: the fetched bytes until they are decoded (only cache misses are; then released)
    data: bytes = b""


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
        self.failures.append((item.ref, type(err).__name__, str(err)))

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
    """Fetch and hash; decoding waits for the cache check, so a hit never decodes."""
    data = fetch(item.ref, ctx.settings.limits, s3_client=ctx.s3_client)
    sha = sha256_hex(data)
    return Prepared(item, sha, [], keys.cache_key(sha, ctx.engine.revision, chunk.task, chunk.params), data)


def _decode(ctx: WorkerContext, prep: Prepared) -> None:
    prep.pages = decode(prep.data, ctx.settings.limits)
    prep.data = b""


def process_chunk(ctx: WorkerContext, chunk: Chunk, worker: str | None = None) -> ChunkReport:  # noqa: C901
    t0 = time.monotonic()
    tag = f"job={chunk.job} n={len(chunk.items)}"
    ctx.index.record([_record(chunk, it, ImageStatus.running, worker=worker) for it in chunk.items])

    # 1. fetch + hash — in the fetch pool, overlapping other chunks' inference
    threads = ctx.settings.limits.fetch_threads
    prepared: dict[str, Prepared] = {}
    errors: dict[str, OcrqError] = {}
    fetched = fan_out(ctx.fetch_pool, threads, lambda it: _prepare(ctx, chunk, it), chunk.items)
    for it, outcome in zip(chunk.items, fetched, strict=True):
        if isinstance(outcome, Exception):  # typed errors from refs; anything else is classified
            errors[it.id] = classify(outcome)
        else:
            prepared[it.id] = outcome
    log.info("→ fetch %s ok=%d bad=%d %.2fs", tag, len(prepared), len(errors), time.monotonic() - t0)

    # 2. cache check: one MGET for the chunk; hits are neither decoded nor sent to the engine
    hits = ctx.cache.get_many([p.cache_key for p in prepared.values()])
    n_hits = sum(p.cache_key in hits for p in prepared.values())
    ctx.metrics.observe_cache(n_hits, len(prepared) - n_hits)
    log.info("→ cache %s hits=%d misses=%d", tag, n_hits, len(prepared) - n_hits)

    # 3. validate (decode) the misses, in the fetch pool; a bad image fails here, typed
    misses = [p for p in prepared.values() if p.cache_key not in hits]
    for prep, bad in zip(misses, fan_out(ctx.fetch_pool, threads, lambda p: _decode(ctx, p), misses), strict=True):
        if isinstance(bad, Exception):
            errors[prep.item.id] = classify(bad)

    # 4. plan + infer: every page goes to the engine loop, whose governor forms the micro-batches
    t1 = time.monotonic()
    pending: dict[str, list[Future[OcrOutput]]] = {
        i: [] for i, p in prepared.items() if p.cache_key not in hits and i not in errors}
    to_run = [(i, pg) for i in pending for pg in prepared[i].pages]
    submitted = ctx.submit_once_many([
        (f"{prepared[i].cache_key}#{pg.index}", OcrRequest(f"{i}#{pg.index}", pg.image, chunk.task, chunk.params))
        for i, pg in to_run])
    # same bytes already in flight (here or in another chunk): the engine runs once, the rest are hits
    all_shared = dict.fromkeys(pending, True)
    for (i, _), (fut, was_shared) in zip(to_run, submitted, strict=True):
        pending[i].append(fut)
        all_shared[i] = all_shared[i] and was_shared
    shared = {i for i, was in all_shared.items() if was}
    outputs: dict[str, list[OcrOutput]] = {}
    # the threads pool has no Celery time limits: the chunk's own deadline bounds the wait, and
    # an image still in the engine then is retried (its retry joins the same in-flight future)
    deadline = t0 + ctx.settings.queue.time_limit
    for item_id, page_futures in pending.items():
        try:
            outputs[item_id] = [
                _on_page(f.result(timeout=max(0.0, deadline - time.monotonic())), pg.index)
                for f, pg in zip(page_futures, prepared[item_id].pages, strict=True)
            ]
        except FutureTimeout:
            errors[item_id] = EngineTimeout(f"no engine result within {ctx.settings.queue.time_limit}s")
        except Exception as exc:
            errors[item_id] = classify(exc)
    log.info("→ infer %s images=%d shared=%d %.2fs", tag, len(pending) - len(shared), len(shared),
             time.monotonic() - t1)

    # 5. store: cache entries (durable + hot), one result document per image, then the job index
    fresh = {prepared[i].cache_key: outs for i, outs in outputs.items() if i not in shared}
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
            outs = hits[got.cache_key] if got.cache_key in hits else outputs[item.id]
            cached = got.cache_key in hits or item.id in shared
            rec = _record(chunk, item, ImageStatus.done, None, got, cached=cached, pages=len(outs),
                          worker=worker, **({} if cached else _engine_share(outs)))
            report.done += 1
            report.cached += cached
            docs.append(ImageResult(record=rec, outputs=outs))
        records.append(rec)
    writes: list[tuple[str, Any]] = [(keys.result_object(d.record.job, d.record.id), d.model_dump_json().encode())
                                     for d in docs]
    # the failed registry's durable mirror: losing Redis does not lose what failed
    writes += [(keys.failed_object(d.record.job, d.record.id), _failed_entry(chunk, d.record))
               for d in docs if d.record.status == ImageStatus.failed]
    ctx.store.put_many(writes)
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


def _record(chunk: Chunk, item: Item, status: ImageStatus, error: OcrqError | None = None,
            prep: Prepared | None = None, cached: bool = False, pages: int = 0,
            worker: str | None = None, **engine: Any) -> ImageRecord:
    return ImageRecord(
        id=item.id, job=chunk.job, ref=item.ref, status=status, attempts=item.attempt,
        cached=cached, pages=pages, worker=worker,
        sha256=prep.sha256 if prep else None, cache_key=prep.cache_key if prep else None,
        error=ErrorInfo(**error.to_dict()) if error else None, **engine,
    )


def _on_page(output: OcrOutput, page: int) -> OcrOutput:
    """The engine's output as page ``page`` of its image (copied only when the index differs:
    a shared in-flight future's output is never mutated)."""
    return output if output.page == page else output.model_copy(update={"page": page})


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
        try:
            report = process_chunk(ctx, chunk, worker=self.request.hostname)
        except OcrqError as exc:  # the store or Redis went away mid-chunk: retry every image
            report = _retry_all(ctx, chunk, exc, self.request.hostname)
        if report.retry:
            retry_msg = chunk.model_copy(update={"items": report.retry}).to_message()
            try:
                self.retry(args=(retry_msg,), countdown=report.countdown)  # raises Retry
            except Retry:
                raise
            except Exception as exc:
                # could not publish the retry (broker down): give the message back, lose nothing
                raise Reject(f"retry publish failed: {exc}", requeue=True) from exc
        return report.summary()

    return ocr_chunk


def _retry_all(ctx: WorkerContext, chunk: Chunk, err: OcrqError, worker: str | None) -> ChunkReport:
    log.warning("! chunk job=%s failed as a whole: %s", chunk.job, err)
    report = ChunkReport()
    records = [_settle(ctx, chunk, it, err, None, worker, report) for it in chunk.items]
    _set_countdown(ctx, report)
    ctx.metrics.observe_records(chunk.task, records)
    try:
        failed = [rec for rec in records if rec.status is ImageStatus.failed]
        ctx.store.put_many([(keys.result_object(rec.job, rec.id), ImageResult(record=rec).model_dump(mode="json"))
                            for rec in failed] + [(keys.failed_object(rec.job, rec.id), _failed_entry(chunk, rec))
                                                  for rec in failed])
        ctx.index.record(records)
    except Exception:
        log.exception("! could not record chunk failure for job=%s", chunk.job)
    return report

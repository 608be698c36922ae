"""A chunk's images as the job index and the store keep them: each image's record, the settling
of an error (another attempt, or failed for good), and the documents written for final images
(one result part, plus the failed registry's durable mirror)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from typing import Any

from ocrq import keys
from ocrq.errors import NameTaken, OcrqError
from ocrq.messages import Chunk, Item
from ocrq.redact import redact_url
from ocrq.results import ErrorInfo, ImageRecord, ImageResult, ImageStatus, OcrOutput
from worker.chunk_report import ChunkReport
from worker.context import WorkerContext
from worker.prepare import Prepared
from worker.retry import final_error

log = logging.getLogger("ocrq.worker")


def image_record(chunk: Chunk, item: Item, status: ImageStatus, error: OcrqError | None = None,
            prep: Prepared | None = None, cached: bool = False, pages: int = 0,
            worker: str | None = None, **engine: Any) -> ImageRecord:
    return ImageRecord(
        id=item.id, job=chunk.job, ref=redact_url(item.ref), status=status, attempts=item.attempt,
        cached=cached, pages=pages, worker=worker, row=item.row, updated=time.time(),
        sha256=prep.sha256 if prep else None, cache_key=prep.cache_key if prep else None,
        error=ErrorInfo(**error.to_dict()) if error else None, **engine,
    )


def engine_share(outputs: list[OcrOutput]) -> dict[str, Any]:
    """The engine seconds an image shared (its pages' batch time / batch size) and its batch."""
    shares = [o.meta["batch"] for o in outputs if isinstance(o.meta.get("batch"), dict)]
    if not shares:
        return {}
    return {"engine_s": round(sum(float(b.get("engine_s", 0)) for b in shares), 6),
            "batch": shares[0].get("id"), "batch_size": shares[0].get("size")}


def settle(ctx: WorkerContext, chunk: Chunk, item: Item, err: OcrqError, prep: Prepared | None,
            worker: str | None, report: ChunkReport) -> ImageRecord:
    """The one place an image's error becomes either another attempt (queued on ``report``,
    recorded ``retrying``) or its final ``failed`` record (the permanent error, or
    ``RetriesExhausted`` naming the last cause once the attempt budget is spent)."""
    final = final_error(err, item.attempt, ctx.settings.queue.max_attempts)
    if final is None:
        report.retry.append(item.model_copy(update={"attempt": item.attempt + 1}))
        return image_record(chunk, item, ImageStatus.retrying, err, prep, worker=worker)
    report.fail(item, final)
    return image_record(chunk, item, ImageStatus.failed, final, prep, worker=worker)


#: part numbers tried before a chunk's documents give up (and the chunk is retried): a number is
#: taken only where Redis handed it out before and then lost its counter (a failover, a crash)
PART_TRIES = 64


def store_documents(ctx: WorkerContext, chunk: Chunk, docs: list[ImageResult],
                    put: Callable[[list[tuple[str, Any]], Collection[str]], None]
                    ) -> tuple[int | None, list[tuple[str, Any]]]:
    """Store a chunk's final images: one result part holding their documents (ocrq.output.parts; its
    number goes into their markers, returned) and, per failed image, the failed registry's durable
    mirror (losing Redis does not lose what failed); (the part's number, the writes stored).
    ``put(writes, new)`` writes them, ``new``
    (the part) only where its name is free: a name another chunk's documents hold is never
    replaced, the next number is taken."""
    if not docs:
        put([], ())
        return None, []
    body = b"\n".join(d.document_json() for d in docs) + b"\n"
    items = {it.id: it for it in chunk.items}
    for _ in range(PART_TRIES):
        epoch, part = ctx.index.new_part(chunk.job)
        path = keys.result_part(chunk.job, epoch, part)
        writes: list[tuple[str, Any]] = [(path, body)]
        writes += [(keys.failed_object(d.record.job, d.record.id), failed_entry(chunk, items[d.record.id], d.record,
                                                                                 path))
                   for d in docs if d.record.status == ImageStatus.failed]
        try:
            put(writes, (path,))
            return part, writes
        except NameTaken as exc:
            log.warning("! result part %s of job=%s is taken (Redis set its counter back): the next one, %s",
                        part, chunk.job, exc)
    raise NameTaken(f"job={chunk.job}: {PART_TRIES} result part numbers in a row were taken")


def failed_entry(chunk: Chunk, item: Item, rec: ImageRecord, document: str) -> dict[str, Any]:
    """The failed registry's durable mirror of one image (what ``ocrq failed --from-store`` reads,
    and ``ocrq reprocess`` re-runs with the image's own task and params); ``document``: the result
    part holding its document (``ocrq failed show`` reads it there)."""
    task, params = chunk.spec(item)
    return {"record": rec.model_dump(mode="json"), "task": task, "params": params,
            "failed_at": time.time(), "document": document}

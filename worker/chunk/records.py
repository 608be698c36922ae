"""A chunk's images as the job index keeps them: each image's record, and the settling of an
error: another attempt, or failed for good (the retry policy: worker.chunk.retry)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ocrq.errors import OcrqError
from ocrq.messages import Chunk, Item
from ocrq.redact import redact_url
from ocrq.results import ErrorInfo, ImageRecord, ImageStatus, OcrOutput
from worker.chunk.attempt import Fetched
from worker.chunk.retry import final_error


def image_record(chunk: Chunk, item: Item, status: ImageStatus, error: OcrqError | None = None,
                 image: Fetched | None = None, cached: bool = False, pages: int = 0,
                 worker: str | None = None, **engine: Any) -> ImageRecord:
    return ImageRecord(
        id=item.id, job=chunk.job, ref=redact_url(item.ref), status=status, attempts=item.attempt,
        cached=cached, pages=pages, worker=worker, row=item.row, updated=time.time(),
        sha256=image.sha256 if image else None, cache_key=image.cache_key if image else None,
        error=ErrorInfo(**error.to_dict()) if error else None, **engine,
    )


def engine_share(outputs: list[OcrOutput]) -> dict[str, Any]:
    """The engine seconds an image shared (its pages' batch time / batch size) and its batch."""
    shares = [o.meta["batch"] for o in outputs if isinstance(o.meta.get("batch"), dict)]
    if not shares:
        return {}
    return {"engine_s": round(sum(float(b.get("engine_s", 0)) for b in shares), 6),
            "batch": shares[0].get("id"), "batch_size": shares[0].get("size")}


@dataclass(frozen=True)
class Settled:
    """An image's error settled: its record, and either its next attempt or its final error."""

    record: ImageRecord
    #: the image with its next attempt (None: it failed for good)
    retry: Item | None = None
    #: the error it failed with for good (None: it gets another attempt)
    failure: OcrqError | None = None


def settle(max_attempts: int, chunk: Chunk, item: Item, err: OcrqError, image: Fetched | None,
           worker: str | None) -> Settled:
    """The one place an image's error becomes either another attempt (recorded ``retrying``)
    or its final ``failed`` record (the permanent error, or ``RetriesExhausted`` naming the last
    cause once the attempt budget is spent)."""
    final = final_error(err, item.attempt, max_attempts)
    if final is None:
        return Settled(image_record(chunk, item, ImageStatus.retrying, err, image, worker=worker),
                       retry=item.model_copy(update={"attempt": item.attempt + 1}))
    return Settled(image_record(chunk, item, ImageStatus.failed, final, image, worker=worker), failure=final)

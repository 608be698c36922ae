"""Result schema shared by the worker (writes) and the producer (reads).

Two shapes:
- ``OcrOutput``: what an engine returns for one image (text, lines with pixel boxes).
  Content-addressed: stored once per cache key, reused by every job that submits the same bytes.
- ``ImageRecord``: one image of one job (ref, status, attempts, error, cache key). Its compact
  form lives in Redis (job index); the full JSON (record + output) in the durable store.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, Field
from pydantic_core import to_json


class ImageStatus(StrEnum):
    #: submitted, waiting in the broker
    queued = "queued"
    #: a worker is on it
    running = "running"
    #: a retryable error happened; another attempt is scheduled
    retrying = "retrying"
    #: OCR output stored (from the engine or from the cache)
    done = "done"
    #: permanent error, or attempts exhausted; listed in the failed registry
    failed = "failed"
    #: its job was cancelled before a worker started on it: it never ran (``ocrq reprocess``
    #: runs it again)
    cancelled = "cancelled"

    @property
    def final(self) -> bool:
        return self in (ImageStatus.done, ImageStatus.failed, ImageStatus.cancelled)


class OcrLine(BaseModel):
    text: str
    #: polygon in pixel coordinates of the decoded (EXIF-rotated) image: [[x, y], ...]
    box: list[list[float]] | None = None
    confidence: float | None = None


class OcrOutput(BaseModel):
    text: str
    lines: list[OcrLine] = Field(default_factory=list)
    #: engine family ("rapidocr", "transformers", "vllm", "vllm-server")
    engine: str
    #: model revision: part of the cache key
    model: str
    #: decoded image size the boxes refer to
    width: int = 0
    height: int = 0
    #: pages of a multi-frame source are OCRed separately; page index within the source
    page: int = 0
    #: engine-specific facts (tokens generated, repetition stop, timings, parsed JSON fields)
    meta: dict[str, Any] = Field(default_factory=dict)


class ErrorInfo(BaseModel):
    type: str
    message: str
    retryable: bool = False


class ImageRecord(BaseModel):
    """One image of one job. ``id`` derives from (job, ref); ``cache_key`` from the content."""

    id: str
    job: str
    ref: str
    status: ImageStatus
    attempts: int = 0
    cached: bool = False
    cache_key: str | None = None
    sha256: str | None = None
    error: ErrorInfo | None = None
    #: pages produced by this ref (PDF pages, multi-frame TIFF/GIF frames); text joins them
    pages: int = 0
    #: Celery node name of the worker that wrote this record
    worker: str | None = None
    #: engine seconds this image shared (its batch's time / batch size; pages summed); None for
    #: cache hits and failures. Summed per job for GPU-seconds and cost (``ocrq status``)
    engine_s: float | None = None
    #: the engine call (batch) that read it and how many images that call held
    batch: str | None = None
    batch_size: int | None = None
    #: the manifest row's other columns (``id``, ``metadata``, ...), unchanged, for joining
    row: dict[str, Any] | None = None
    updated: float = 0.0


class ImageResult(BaseModel):
    """The full durable document of one image of one job (``results/{job}/{id}.json``)."""

    record: ImageRecord
    outputs: list[OcrOutput] = Field(default_factory=list)
    #: a cancelled image's own task and params (``{"task", "params"}``: an OpenAI Batch line's),
    #: kept so ``ocrq reprocess`` runs it as submitted; None otherwise (left out of its JSON)
    spec: dict[str, Any] | None = None

    @property
    def text(self) -> str:
        return "\n\f\n".join(o.text for o in self.outputs)

    def document_json(self) -> bytes:
        """The document as a result part's line holds it (``spec`` only when set)."""
        return self.model_dump_json(exclude=None if self.spec is not None else {"spec"}).encode()

    def to_line(self) -> dict[str, Any]:
        """The flat line `ocrq submit --out` and `ocrq results` write."""
        rec = self.record
        return {
            "id": rec.id,
            "job": rec.job,
            "ref": rec.ref,
            "status": rec.status.value,
            "text": self.text,
            "cached": rec.cached,
            "attempts": rec.attempts,
            "error": rec.error.model_dump() if rec.error else None,
            "sha256": rec.sha256,
            "pages": rec.pages,
            "page_texts": [o.text for o in self.outputs],
            "lines": [{**ln.model_dump(), "page": o.page} for o in self.outputs for ln in o.lines],
            "engine": self.outputs[0].engine if self.outputs else None,
            "model": self.outputs[0].model if self.outputs else None,
            "row": rec.row,
        }


def json_line(line: dict[str, Any]) -> bytes:
    """A result line (``ImageResult.to_line``) as compact UTF-8 JSON, as the job's export and
    ``ocrq results --out`` write it (pydantic's serializer: a quarter of ``json.dumps``'s time,
    the largest part of exporting a job)."""
    return to_json(line, fallback=str)

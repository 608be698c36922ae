"""A finished job's results as files an ETL can wait on and load: one JSONL file (and a Parquet
file when the job asked for it) under ``results/{job}/export/``, then a ``_SUCCESS`` marker,
the convention Spark, Airflow and Glue sensors wait for (paths: ``ocrq.keys``).

Once the export is written, the job is archived (``JobIndex.archive``): its per-image records
leave Redis, and readers take it from the store.

Who writes it: the worker whose chunk completes the job (done + failed = total) sets
``ocrq:job:{job}:finishing`` (SET NX, so one of several workers finishing at once) and publishes
the ``ocrq.finish_job`` task; any worker runs it (acks late: a worker killed while exporting gives
the message back). A submit that publishes new work, or a reprocess, clears the flag and removes
the old ``_SUCCESS`` first, so a sensor never sees a marker older than the job's results; and a
submit records all its images before publishing any, so a job is never finished half-submitted. Every
write is whole-object and idempotent; ``_SUCCESS`` is written only after the data files.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable, Iterator
from itertools import islice
from pathlib import Path
from typing import Any

from ocrq import gcpause, keys
from ocrq.feed import Line, shard_lines, submissions
from ocrq.jobs import MARKS, JobIndex
from ocrq.redact import redact_url
from ocrq.results import ImageRecord, ImageResult, ImageStatus, json_line
from ocrq.scripts import set_nx
from ocrq.storage import ResultStore

#: rows per Parquet row group (bounded memory for jobs of millions of images)
_PARQUET_ROWS = 10_000
_LOAD_BATCH = 512


def finished(counts: dict[str, int]) -> bool:
    return counts["done"] + counts["failed"] >= counts["total"]


def request_export(redis: Any, index: JobIndex, job: str, send: Callable[[str], None], ttl: int) -> bool:
    """Publish the export of ``job`` once, if it is finished. ``send(task_id)`` publishes it."""
    if not finished(index.counts(job)):
        return False
    if not set_nx(redis, keys.job_finishing(job), "1", ttl):  # (past maxmemory: finishes accepted work)
        return False  # someone else published it already
    try:
        send(f"finish-{job}-{time.time_ns()}")
    except Exception:
        redis.delete(keys.job_finishing(job))  # let the next finishing chunk try again
        raise
    return True


def invalidate(redis: Any, store: ResultStore, job: str) -> None:
    """The job gets new work: its export is stale (the marker goes first)."""
    store.delete(keys.export_object(job, keys.EXPORT_SUCCESS))
    redis.delete(keys.job_finishing(job))


def results(index: JobIndex, store: ResultStore, job: str, batch: int = _LOAD_BATCH) -> Iterator[ImageResult]:
    """Every image of the job. A finished job's come from the store (every final image's document
    is written before its record, and an archived job has no records left in Redis). A running
    job's are walked in submission order (its refs shards, ``ocrq.feed``): a final image with its
    stored document, one a worker is on as its record, a queued one as a record made from its
    shard line. Documents are read ``batch`` at a time (one store ``get_many``: one SQLite query,
    or S3 GETs in parallel) and parsed from their raw bytes, the collector held off
    (``ocrq.gcpause``)."""
    if finished(index.counts(job)):
        yield from stored_results(store, job, batch)
        return
    for sub in submissions(index.redis, job):
        for window in range(sub.written):
            lines = shard_lines(store, job, sub, window)
            for start in range(0, len(lines), batch):
                yield from _running_part(index, store, job, lines[start:start + batch])


def _running_part(index: JobIndex, store: ResultStore, job: str, lines: list[Line]) -> list[ImageResult]:
    values = index.raw(job, [i for i, _, _ in lines])
    final = {i: keys.result_object(job, i) for (i, _, _), v in zip(lines, values, strict=True)
             if v is not None and v[:1] in (b"d", b"c", b"f")}
    # the store read runs with the collector on: S3 GETs may take seconds, other threads go on
    docs = store.get_many(final.values(), raw=True) if final else {}
    parsed: list[ImageResult] = []
    with gcpause.paused():
        for (image_id, ref, row), value in zip(lines, values, strict=True):
            raw = docs.get(final[image_id]) if image_id in final else None
            if raw is not None:
                parsed.append(ImageResult.model_validate_json(raw))
            elif value is not None and value[:1] == b"{":
                parsed.append(ImageResult(record=ImageRecord.model_validate_json(value)))
            else:  # queued (or final without its document): what the shard says
                status = MARKS.get(value.decode()[:1], ImageStatus.queued) if value else ImageStatus.queued
                parsed.append(ImageResult(record=ImageRecord(id=image_id, job=job, ref=redact_url(ref),
                                                             status=status, row=row)))
    return parsed


def stored_results(store: ResultStore, job: str, batch: int = _LOAD_BATCH) -> Iterator[ImageResult]:
    """The job's result documents as the store holds them (one per image that reached a final
    state), listed then read ``batch`` at a time: no Redis needed."""
    export = keys.export_prefix(job)
    paths = (p for p in store.list(keys.results_prefix(job)) if not p.startswith(export))
    while part := list(islice(paths, batch)):
        docs = store.get_many(part, raw=True)
        with gcpause.paused():
            parsed = [ImageResult.model_validate_json(docs[p]) for p in part if p in docs]
        yield from parsed


def export_job(index: JobIndex, store: ResultStore, job: str) -> dict[str, Any]:
    """Write the job's export and then its ``_SUCCESS`` marker; returns what the marker says."""
    counts = index.counts(job)
    if not finished(counts):
        return {"job": job, "exported": False, "reason": "not finished", "counts": counts}
    meta = index.meta(job)
    parquet = "parquet" in meta.get("exports", [])
    files = [keys.EXPORT_JSONL] + ([keys.EXPORT_PARQUET] if parquet else [])
    with tempfile.TemporaryDirectory(prefix="ocrq-export-") as tmp:
        jsonl = Path(tmp) / keys.EXPORT_JSONL
        writer = _ParquetWriter(Path(tmp) / keys.EXPORT_PARQUET) if parquet else None
        lines = 0
        with jsonl.open("wb") as fh:
            for result in results(index, store, job):
                line = result.to_line()
                fh.write(json_line(line) + b"\n")
                if writer is not None:
                    writer.add(line)
                lines += 1
        store.put_file(keys.export_object(job, keys.EXPORT_JSONL), jsonl, "application/x-ndjson")
        if writer is not None:
            writer.close()
            store.put_file(keys.export_object(job, keys.EXPORT_PARQUET), writer.path,
                           "application/vnd.apache.parquet")
    marker = {"job": job, "exported": True, "lines": lines, "counts": counts, "files": files,
              "written": time.time()}
    store.put_json(keys.export_object(job, keys.EXPORT_SUCCESS), marker)
    # its store requests, as S3 bills them: a GET per document, a LIST per 1,000, a PUT per file
    index.add_requests(job, len(files) + 1 + -(-lines // 1000), lines)
    return marker


class _ParquetWriter:
    """Result lines as Parquet rows; nested fields (``row``, ``lines``, ``error``) as JSON text, so
    the schema never depends on what a manifest carried."""

    def __init__(self, path: Path) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.path = path
        self._pa = pa
        self.schema = pa.schema([
            ("id", pa.string()), ("job", pa.string()), ("ref", pa.string()), ("status", pa.string()),
            ("text", pa.string()), ("page_texts", pa.list_(pa.string())), ("pages", pa.int32()),
            ("cached", pa.bool_()), ("attempts", pa.int32()), ("error_type", pa.string()),
            ("error_message", pa.string()), ("sha256", pa.string()), ("engine", pa.string()),
            ("model", pa.string()), ("row_id", pa.string()), ("row", pa.string()), ("lines", pa.string()),
        ])
        self._writer = pq.ParquetWriter(str(path), self.schema)
        self._rows: list[dict[str, Any]] = []

    def add(self, line: dict[str, Any]) -> None:
        error = line.get("error") or {}
        row = line.get("row")
        row_id = row.get("id") if isinstance(row, dict) else None
        self._rows.append({
            **{k: line.get(k) for k in ("id", "job", "ref", "status", "text", "page_texts", "pages",
                                        "cached", "attempts", "sha256", "engine", "model")},
            "error_type": error.get("type"), "error_message": error.get("message"),
            "row_id": None if row_id is None else str(row_id),
            "row": None if row is None else json.dumps(row, ensure_ascii=False),
            "lines": json.dumps(line.get("lines", []), ensure_ascii=False),
        })
        if len(self._rows) >= _PARQUET_ROWS:
            self._flush()

    def _flush(self) -> None:
        if self._rows:
            self._writer.write_table(self._pa.Table.from_pylist(self._rows, schema=self.schema))
            self._rows = []

    def close(self) -> None:
        self._flush()
        self._writer.close()

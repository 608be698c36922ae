"""A finished job's results as files an ETL can wait on and load: one JSONL file (and a Parquet
file when the job asked for it) under ``results/{job}/export/``, then a ``_SUCCESS`` marker,
the convention Spark, Airflow and Glue sensors wait for (paths: ``ocrq.keys``).

Before the marker, the export writes the job's results index (``ocrq.output.parts``): which result parts
hold its current documents. Once the export is written, the job is archived
(``JobIndex.archive``): its per-image records leave Redis, and readers take it from the store
through that index.

Who writes it: the worker whose chunk completes the job (done + failed = total) sets
``ocrq:job:{job}:finishing`` (SET NX, so one of several workers finishing at once) and publishes
the ``ocrq.finish_job`` task; any worker runs it (acks late: a worker killed while exporting gives
the message back). A submit that publishes new work, or a reprocess, clears the flag and removes
the old ``_SUCCESS`` first, so a sensor never sees a marker older than the job's results; and a
submit holds ``ocrq:job:{job}:submitting`` while it writes (workers run its first windows
meanwhile), so a job is never finished half-submitted. Every
write is whole-object and idempotent; ``_SUCCESS`` is written only after the data files.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ocrq import keys
from ocrq.broker.scripts import set_nx
from ocrq.errors import NameTaken
from ocrq.jobs.feed import submissions
from ocrq.jobs.index import JobIndex, finished
from ocrq.output.openai_responses import export_to_store
from ocrq.output.parts import IndexWriter, Located, Parts, located
from ocrq.output.parts import results as results  # re-exported: the readers' entry point
from ocrq.results import ImageResult, ImageStatus, json_line
from ocrq.store.storage import ResultStore

#: rows per Parquet row group (bounded memory for jobs of millions of images)
_PARQUET_ROWS = 10_000
#: cancelled images' documents per result part written at export (bounded memory)
CANCELLED_PART_LINES = 4096


def request_export(redis: Any, index: JobIndex, job: str, send: Callable[[str], None], ttl: int) -> bool:
    """Publish the export of ``job`` once, if it is finished and no submission of it is being
    written (``keys.job_submitting``). ``send(task_id)`` publishes it."""
    if not finished(index.counts(job)) or redis.exists(keys.job_submitting(job)):
        return False
    # (past maxmemory: finishes accepted work); its value says when (worker.export_sweep)
    if not set_nx(redis, keys.job_finishing(job), repr(time.time()), ttl):
        return False  # someone else published it already
    try:
        send(f"finish-{job}-{time.time_ns()}")
    except Exception:
        redis.delete(keys.job_finishing(job))  # let the next finishing chunk try again
        raise
    return True


def invalidate(redis: Any, store: ResultStore, job: str) -> None:
    """The job gets new work: its export is stale (the markers go first: its own, and that of its
    OpenAI Batch files)."""
    store.delete_many([keys.export_object(job, keys.EXPORT_SUCCESS),
                       keys.openai_export_object(job, keys.EXPORT_SUCCESS)])
    redis.delete(keys.job_finishing(job))


def export_job(index: JobIndex, store: ResultStore, job: str) -> dict[str, Any]:
    """Write the job's export and then its ``_SUCCESS`` marker; returns what the marker says."""
    counts = index.counts(job)
    if not finished(counts):
        return {"job": job, "exported": False, "reason": "not finished", "counts": counts}
    if index.redis.exists(keys.job_submitting(job)):
        return {"job": job, "exported": False, "reason": "a submission is being written", "counts": counts}
    meta = index.meta(job)
    cancelled_at = index.cancelled_at(job)
    parquet = "parquet" in meta.get("exports", [])
    files = [keys.EXPORT_JSONL] + ([keys.EXPORT_PARQUET] if parquet else [])
    parts = Parts(store)
    taken = IndexWriter(job)
    # (a submission counts once every shard of it is written: one cut short is not listed)
    subs = [s for s in submissions(index.redis, job) if s.written >= s.windows]
    # a cancelled image has no document: the export gives it one (in parts of its own), so the job
    # reads whole once archived, and a reprocess finds it
    unrun = _CancelledParts(index, store, job, parts, taken)
    with tempfile.TemporaryDirectory(prefix="ocrq-export-") as tmp:
        jsonl = Path(tmp) / keys.EXPORT_JSONL
        writer = _ParquetWriter(Path(tmp) / keys.EXPORT_PARQUET) if parquet else None
        lines = 0
        with jsonl.open("wb") as fh:
            for found in located(index, store, job, parts=parts):
                if found.where is None and found.result.record.status is ImageStatus.cancelled:
                    unrun.add(found.result)  # (in the index once its part is written)
                else:
                    taken.add(found)
                line = found.result.to_line()
                fh.write(json_line(line) + b"\n")
                if writer is not None:
                    writer.add(line)
                lines += 1
        unrun.close()
        store.put_file(keys.export_object(job, keys.EXPORT_JSONL), jsonl, "application/x-ndjson")
        if writer is not None:
            writer.close()
            store.put_file(keys.export_object(job, keys.EXPORT_PARQUET), writer.path,
                           "application/vnd.apache.parquet")
    if "openai-batch" in meta.get("exports", []):  # a job submitted from an OpenAI Batch file
        export_to_store(index, store, job)
    # the results index before the marker: a job read through its index is exported whole
    store.put_json(keys.results_index(job), taken.document(parts, subs))
    marker = {"job": job, "exported": True, "lines": lines, "counts": counts, "files": files,
              "written": time.time()}
    if cancelled_at is not None:  # what finished is here; the rest never ran
        marker["cancelled"] = True
        marker["cancelled_at"] = cancelled_at
    store.put_json(keys.export_object(job, keys.EXPORT_SUCCESS), marker)
    # its store requests, as S3 bills them: a PUT per file (the index, the marker, the cancelled
    # images' parts), a GET per part read (and the index)
    index.add_requests(job, len(files) + 2 + unrun.written, len(parts.sizes) - unrun.written + 1)
    return marker


class _CancelledParts:
    """Cancelled images' documents (their records: ref, row, own task and params), written as
    result parts of ``CANCELLED_PART_LINES`` lines as the export walks the job."""

    def __init__(self, index: JobIndex, store: ResultStore, job: str, parts: Parts, taken: IndexWriter) -> None:
        self.index, self.store, self.job, self.parts, self.taken = index, store, job, parts, taken
        self.written = 0
        self._pending: list[ImageResult] = []

    def add(self, result: ImageResult) -> None:
        """``result`` into the part being filled (written once it is full, or at ``close``)."""
        self._pending.append(result)
        if len(self._pending) >= CANCELLED_PART_LINES:
            self._write()

    def close(self) -> None:
        if self._pending:
            self._write()

    def _write(self) -> None:
        body = b"\n".join(r.document_json() for r in self._pending) + b"\n"
        for _ in range(64):  # a number Redis handed out twice (a failover) is taken: the next one
            epoch, n = self.index.new_part(self.job)
            path = keys.result_part(self.job, epoch, n)
            try:
                self.store.put_many([(path, body)], new=(path,))
                break
            except NameTaken:
                continue
        else:
            raise NameTaken(f"job={self.job}: no free result part for its cancelled images")
        for line, result in enumerate(self._pending):
            self.taken.add(Located(result, (path, line)))
        self.parts.sizes[path] = len(self._pending)
        self.written += 1
        self._pending = []


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

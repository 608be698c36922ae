"""A finished job's results as files an ETL can wait on and load: one JSONL file (and a Parquet
file when the job asked for it) under ``results/{job}/export/``, then a ``_SUCCESS`` marker,
the convention Spark, Airflow and Glue sensors wait for (paths: ``ocrq.keys``).

Before the marker, the export writes the job's results index (``ocrq.parts``): which result parts
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
from ocrq.feed import submissions
from ocrq.jobs import JobIndex
from ocrq.openai_responses import export_to_store
from ocrq.parts import IndexWriter, Parts, located
from ocrq.parts import results as results  # re-exported: the readers' entry point
from ocrq.results import json_line
from ocrq.scripts import set_nx
from ocrq.storage import ResultStore

#: rows per Parquet row group (bounded memory for jobs of millions of images)
_PARQUET_ROWS = 10_000


def finished(counts: dict[str, int]) -> bool:
    return counts["done"] + counts["failed"] >= counts["total"]


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
    parquet = "parquet" in meta.get("exports", [])
    files = [keys.EXPORT_JSONL] + ([keys.EXPORT_PARQUET] if parquet else [])
    parts = Parts(store)
    taken = IndexWriter(job)
    # (a submission counts once every shard of it is written: one cut short is not listed)
    subs = [s for s in submissions(index.redis, job) if s.written >= s.windows]
    with tempfile.TemporaryDirectory(prefix="ocrq-export-") as tmp:
        jsonl = Path(tmp) / keys.EXPORT_JSONL
        writer = _ParquetWriter(Path(tmp) / keys.EXPORT_PARQUET) if parquet else None
        lines = 0
        with jsonl.open("wb") as fh:
            for found in located(index, store, job, parts=parts):
                taken.add(found)
                line = found.result.to_line()
                fh.write(json_line(line) + b"\n")
                if writer is not None:
                    writer.add(line)
                lines += 1
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
    store.put_json(keys.export_object(job, keys.EXPORT_SUCCESS), marker)
    # its store requests, as S3 bills them: a PUT per file (the index, the marker), a GET per
    # part read (and the index)
    index.add_requests(job, len(files) + 2, len(parts.sizes) + 1)
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

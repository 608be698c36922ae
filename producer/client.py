"""The producer API: submit references, follow a job, read its results.

    client = Client(settings)
    job = client.submit(["s3://bucket/scans/", "manifest.jsonl"], job="invoices-2026-11")
    job.wait()
    for result in job.results(): ...

Submitting streams the references (millions are fine), records each image as ``queued`` in the
job index and publishes chunks of ``queue.chunk_size`` refs per broker message. Image ids derive
from (job, ref), and chunk task ids from their contents, so submitting the same job again only
re-publishes images that are not finished; finished ones are left alone.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from typing import Any

import redis

from ocrq import keys
from ocrq.jobs import JobIndex
from ocrq.messages import OCR_CHUNK_TASK, Chunk, Item
from ocrq.queue import make_celery
from ocrq.refs import expand
from ocrq.results import ImageRecord, ImageResult, ImageStatus
from ocrq.settings import Settings
from ocrq.storage import ResultStore, make_s3_client, make_store

JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
#: refs expanded and recorded per round trip while submitting
_WINDOW = 4096


class Client:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.redis = redis.Redis.from_url(settings.redis.url)
        self.index = JobIndex(self.redis, settings.redis.job_ttl)
        self._app: Any = None
        self._s3: Any = None
        self._store: ResultStore | None = None

    @property
    def app(self) -> Any:
        if self._app is None:
            self._app = make_celery(self.settings)
        return self._app

    @property
    def s3(self) -> Any:
        if self._s3 is None:
            self._s3 = make_s3_client(self.settings.store)
        return self._s3

    @property
    def store(self) -> ResultStore:
        if self._store is None:
            self._store = make_store(self.settings.store, self.s3 if self.settings.store.kind == "s3" else None)
        return self._store

    def submit(self, refs: Iterable[str], *, job: str, task: str = "text",
               params: dict[str, Any] | None = None, priority: int | None = None,
               queue: str | None = None) -> Job:
        if not JOB_NAME.match(job):
            raise ValueError(f"job name {job!r}: use letters, digits, '.', '_', '-' (≤128)")
        params = params or {}
        # queue and priority are kept so `ocrq reprocess` re-publishes where the job ran
        self.index.create(job, {"task": task, "params": params, "queue": queue or self.settings.queue.name,
                                "priority": priority})
        size = self.settings.queue.chunk_size
        stream = expand(refs, self.settings.limits, s3_client=self.s3)
        published = 0
        with self.app.producer_or_acquire() as producer:
            while window := list(islice(stream, _WINDOW)):
                items = [Item(id=keys.image_id(job, r), ref=r) for r in dict.fromkeys(window)]
                queued = [ImageRecord(id=it.id, job=job, ref=it.ref, status=ImageStatus.queued) for it in items]
                todo = [it for it, need in zip(items, self.index.record(queued, mode="submit"), strict=True)
                        if need]
                for start in range(0, len(todo), size):
                    part = todo[start:start + size]
                    chunk = Chunk(job=job, task=task, params=params, items=part)
                    self.app.send_task(
                        OCR_CHUNK_TASK, args=[chunk.to_message()],
                        task_id=keys.chunk_id(job, part[0].id, len(part)),
                        queue=queue or self.settings.queue.name, priority=priority, producer=producer,
                    )
                    published += len(part)
        return Job(self, job, published=published)

    def reprocess_failed(self, job: str | None = None, *, error: str | None = None,
                         dry_run: bool = False) -> int:
        """Re-publish failed images (optionally one error type) with a fresh attempt budget, on
        each job's own queue and priority; returns how many (would be, with ``dry_run``)."""
        from ocrq.failed import from_redis

        by_job: dict[str, list[ImageRecord]] = {}
        for f in from_redis(self.index, job, error):
            by_job.setdefault(f.record.job, []).append(f.record)
        if dry_run:
            return sum(len(recs) for recs in by_job.values())
        n = 0
        stamp = str(int(time.time()))
        size = self.settings.queue.chunk_size
        with self.app.producer_or_acquire() as producer:
            for j, records in by_job.items():
                meta = self.index.meta(j)
                queued = [ImageRecord(id=r.id, job=j, ref=r.ref, status=ImageStatus.queued) for r in records]
                self.index.record(queued, mode="force")
                items = [Item(id=r.id, ref=r.ref) for r in records]
                for start in range(0, len(items), size):
                    part = items[start:start + size]
                    chunk = Chunk(job=j, task=meta.get("task", "text"), params=meta.get("params", {}), items=part)
                    self.app.send_task(
                        OCR_CHUNK_TASK, args=[chunk.to_message()],
                        task_id=keys.chunk_id(j, part[0].id, len(part)) + "-r" + stamp,
                        queue=meta.get("queue") or self.settings.queue.name, priority=meta.get("priority"),
                        producer=producer,
                    )
                n += len(items)
        return n

    def job(self, name: str) -> Job:
        return Job(self, name)

    def close(self) -> None:
        self.redis.close()


class Job:
    def __init__(self, client: Client, name: str, published: int = 0) -> None:
        self.client = client
        self.name = name
        #: images published by the submit that returned this handle (0 for an existing job)
        self.published = published

    def status(self) -> dict[str, int]:
        """Counts per status plus ``total`` and ``cached`` (exact, from the job index)."""
        return self.client.index.counts(self.name)

    def finished(self) -> bool:
        c = self.status()
        return c["done"] + c["failed"] >= c["total"]

    def wait(self, timeout: float | None = None, poll: float = 0.5,
             on_progress: Callable[[dict[str, int]], None] | None = None) -> dict[str, int]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            counts = self.status()
            if on_progress:
                on_progress(counts)
            if counts["done"] + counts["failed"] >= counts["total"]:
                return counts
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {self.name}: {counts}")
            time.sleep(poll)

    def records(self) -> Iterator[ImageRecord]:
        return self.client.index.scan(self.name)

    def results(self, batch: int = 512) -> Iterator[ImageResult]:
        """Every image of the job: finished ones with their stored document, others as records.
        Documents are read ``batch`` at a time (one store ``get_many``)."""
        store = self.client.store
        records = self.records()
        while part := list(islice(records, batch)):
            paths = {rec.id: keys.result_object(rec.job, rec.id) for rec in part if rec.status.final}
            docs = store.get_many(paths.values(), raw=True) if paths else {}
            for rec in part:
                raw = docs.get(paths[rec.id]) if rec.id in paths else None
                yield ImageResult.model_validate_json(raw) if raw is not None else ImageResult(record=rec)

"""The producer API: submit references, follow a job, read its results.

    client = Client(settings)
    job = client.submit(["s3://bucket/scans/", "manifest.jsonl"], job="invoices-2026-11")
    job.wait()
    for result in job.results(): ...

Submitting first plans the intake (``ocrq.intake``): every file found is accepted, skipped (by the
documented rule) or refused, and a submission with any refused ref publishes nothing. Then it
reads the accepted refs (spooled on disk: millions are fine) twice: it records each image as
``queued`` in the job index, then publishes chunks of ``queue.chunk_size`` refs per message. Image ids derive
from (job, ref), and chunk task ids from their contents, so submitting the same job again only
re-publishes images that are not finished; finished ones are left alone.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import redis

from ocrq import keys
from ocrq.errors import RefusedRef, TooLarge
from ocrq.export import invalidate, request_export
from ocrq.export import results as export_results
from ocrq.intake import IntakePlan, plan_intake
from ocrq.jobs import JobIndex
from ocrq.messages import (
    FINISH_JOB_TASK,
    OCR_CHUNK_TASK,
    Chunk,
    Item,
    check_task,
    checked_message,
    chunk_argsrepr,
    message_bytes,
)
from ocrq.queue import make_celery
from ocrq.redact import redact_text, redact_url
from ocrq.results import ImageRecord, ImageResult, ImageStatus
from ocrq.settings import Settings
from ocrq.storage import ResultStore, make_s3_client, make_store

JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
#: refs expanded and recorded per round trip while submitting
_WINDOW = 4096
#: skipped files listed in the job's meta (all are counted)
_SKIPPED_IN_META = 100


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
            store = self.settings.store
            if store.kind == "local" and "path" not in store.model_fields_set:
                # no local store path of our own (the relative default would resolve against this
                # directory): read where the live workers write, when they agree on one
                paths = {s["store"] for s in self.worker_states() if str(s.get("store", "")).startswith("/")}
                if len(paths) == 1:
                    store = store.model_copy(update={"path": Path(paths.pop())})
            self._store = make_store(store, self.s3 if store.kind == "s3" else None)
        return self._store

    def worker_states(self) -> list[dict[str, Any]]:
        """The states live workers publish each second (ocrq.keys.worker_state)."""
        found = list(self.redis.scan_iter(keys.worker_state("*"), count=200))
        states = []
        for raw in self.redis.mget(found) if found else []:
            try:
                state = json.loads(raw) if raw else None
            except ValueError:
                continue
            if isinstance(state, dict):
                states.append(state)
        return states

    def worker_roots(self) -> list[Path]:
        """The allowed roots live workers report (empty when none is running)."""
        roots = {str(root): None for state in self.worker_states() for root in state.get("allowed_roots") or []}
        return [Path(r) for r in roots]

    def plan(self, refs: Iterable[str]) -> IntakePlan:
        """Expand and check the refs without publishing anything (``IntakePlan.summary()``).

        The producer's roots are ``limits.allowed_roots``; when those are not set, the roots the
        live workers report, else the current directory. Local refs must also lie inside a live
        worker's roots, so the producer never publishes what every worker would refuse."""
        limits = self.settings.limits
        workers = self.worker_roots()
        if not limits.allowed_roots and workers:
            limits = limits.model_copy(update={"allowed_roots": workers})
        return plan_intake(refs, limits, s3_client=self.s3, worker_roots=workers)

    def submit(self, refs: Iterable[str] | IntakePlan, *, job: str, task: str = "text",
               params: dict[str, Any] | None = None, priority: int | None = None,
               queue: str | None = None, parquet: bool = False) -> Job:
        """Publish every accepted ref as job ``job``. Refs (or a ``plan`` of them) with any refused
        entry raise ``SubmissionRefused`` and publish nothing. ``parquet``: the job's export at
        completion also has a Parquet file (ocrq.export)."""
        if not JOB_NAME.match(job):
            raise ValueError(f"job name {job!r}: use letters, digits, '.', '_', '-' (≤128)")
        check_task(task)
        params = params or {}
        params_size = message_bytes(params)
        if params_size > self.settings.queue.max_message_bytes // 4:
            raise TooLarge(f"task params of {params_size} bytes exceed a quarter of queue.max_message_bytes"
                           f" ({self.settings.queue.max_message_bytes}): pass large inputs by reference")
        plan = refs if isinstance(refs, IntakePlan) else self.plan(refs)
        try:
            if plan.refused:
                raise SubmissionRefused(plan)
            return self._publish(plan, job, task, params, priority, queue or self.settings.queue.name,
                                 parquet)
        finally:
            plan.close()

    def _publish(self, plan: IntakePlan, job: str, task: str, params: dict[str, Any], priority: int | None,
                 queue: str, parquet: bool) -> Job:
        skipped = [redact_text(f"{e.value}: {e.reason}") for e in plan.skipped_sample[:_SKIPPED_IN_META]]
        # queue and priority are kept so `ocrq reprocess` re-publishes where the job ran
        self.index.create(job, {"task": task, "params": params, "queue": queue, "priority": priority,
                                "exports": ["jsonl"] + (["parquet"] * parquet),
                                "skipped": plan.skipped, "skipped_sample": skipped})
        # Two passes over the spool: every image is recorded before the first chunk is published,
        # so workers can never see a job "finished" (and export it) while its refs are still
        # being recorded.
        need = bytearray()
        for window in _windows(plan.entries()):
            queued = [ImageRecord(id=keys.image_id(job, ref, row), job=job, ref=redact_url(ref),
                                  status=ImageStatus.queued, row=row) for ref, row in window]
            need += bytes(self.index.record(queued, mode="submit"))
        if any(need):  # new work: the job's export (if any) no longer describes it
            invalidate(self.redis, self.store, job)
        size = self.settings.queue.chunk_size
        published = 0
        offset = 0
        with self.app.producer_or_acquire() as producer:
            for window in _windows(plan.entries()):
                todo = [Item(id=keys.image_id(job, ref, row), ref=ref, row=row)
                        for n, (ref, row) in enumerate(window, offset) if need[n]]
                offset += len(window)
                for start in range(0, len(todo), size):
                    part = todo[start:start + size]
                    chunk = Chunk(job=job, task=task, params=params, items=part, priority=priority or 0)
                    message = checked_message(chunk, self.settings.queue.max_message_bytes)
                    self.app.send_task(
                        OCR_CHUNK_TASK, args=[message], argsrepr=chunk_argsrepr(message),
                        task_id=keys.chunk_id(job, part[0].id, len(part)),
                        queue=queue, priority=priority, producer=producer,
                    )
                    published += len(part)
        # nothing left to run (no accepted file, or all already final): export now
        self.request_export(job, queue)
        return Job(self, job, published=published, plan=plan)

    def request_export(self, job: str, queue: str | None = None, force: bool = False) -> bool:
        """Publish the job's export if it is finished and not exported yet (``force``: again)."""
        if force:
            self.redis.delete(keys.job_finishing(job))

        # on the job's own queue (kept in its meta), where its workers listen
        queue = queue or self.index.meta(job).get("queue") or self.settings.queue.name

        def send(task_id: str) -> None:
            self.app.send_task(FINISH_JOB_TASK, args=[job], task_id=task_id, queue=queue)

        return request_export(self.redis, self.index, job, send, self.settings.redis.job_ttl)

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
                invalidate(self.redis, self.store, j)  # new work: the job's export no longer describes it
                queued = [ImageRecord(id=r.id, job=j, ref=r.ref, status=ImageStatus.queued, row=r.row)
                          for r in records]
                self.index.record(queued, mode="force")
                items = [Item(id=r.id, ref=r.ref, row=r.row) for r in records]
                for start in range(0, len(items), size):
                    part = items[start:start + size]
                    chunk = Chunk(job=j, task=meta.get("task", "text"), params=meta.get("params", {}), items=part,
                                  priority=meta.get("priority") or 0)
                    message = chunk.to_message()
                    self.app.send_task(
                        OCR_CHUNK_TASK, args=[message], argsrepr=chunk_argsrepr(message),
                        task_id=keys.chunk_id(j, part[0].id, len(part)) + "-r" + stamp,
                        queue=meta.get("queue") or self.settings.queue.name, priority=meta.get("priority"),
                        producer=producer,
                    )
                n += len(items)
        return n

    def job(self, name: str) -> Job:
        """A handle on an existing job (``UnknownJob`` if there is none by that name)."""
        if not self.index.exists(name):
            raise UnknownJob(name)
        return Job(self, name)

    def close(self) -> None:
        self.redis.close()


def _windows(entries: Iterator[tuple[str, dict[str, Any] | None]]) -> Iterator[list[tuple[str, dict[str, Any] | None]]]:
    while window := list(islice(entries, _WINDOW)):
        yield window


class SubmissionRefused(RefusedRef):
    """Some refs were refused at submit; nothing was published. ``plan`` lists them."""

    def __init__(self, plan: IntakePlan) -> None:
        first = plan.refused_sample[0] if plan.refused_sample else None
        super().__init__(f"{plan.refused} refs refused, nothing published"
                         + (f"; first: {redact_text(first.reason)}" if first else ""))
        self.plan = plan


class UnknownJob(LookupError):
    def __init__(self, name: str) -> None:
        super().__init__(f"no such job: {name!r}")
        self.name = name


class Job:
    def __init__(self, client: Client, name: str, published: int = 0, plan: IntakePlan | None = None) -> None:
        self.client = client
        self.name = name
        #: images published by the submit that returned this handle (0 for an existing job)
        self.published = published
        #: what the submit accepted, skipped and refused (None for an existing job)
        self.plan = plan

    def export_marker(self) -> dict[str, Any] | None:
        """The job's ``_SUCCESS`` marker (files, lines, counts) once its export is written."""
        doc = self.client.store.get_json(keys.export_object(self.name, keys.EXPORT_SUCCESS))
        return doc if isinstance(doc, dict) else None

    def wait_export(self, timeout: float | None = None, poll: float = 0.5) -> dict[str, Any]:
        """Wait until every image is final and the export's ``_SUCCESS`` marker is written."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (marker := self.export_marker()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {self.name}: no {keys.EXPORT_SUCCESS} yet")
            time.sleep(poll)
        return marker

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
        return export_results(self.client.index, self.client.store, self.name, batch)

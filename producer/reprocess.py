"""Running a job's images again: the failed ones (``ocrq reprocess``), and, for a job named, the
ones its cancel stopped before they ran; and cancelling a job.

Reprocess records each image queued again (a fresh attempt budget) and publishes it on the job's
own queue and priority, with the task and params it was submitted with (its own, an OpenAI Batch
line's, or the job's). A failed image's failed-registry mirror is deleted before it is published
(a failure again writes a new one); a cancelled image's job is no longer cancelled.

Cancel (``cancel``): the job's meta says ``cancelled``, and from then on none of its images that
has not started runs (the record script turns it "x" when a worker meets it, the feed script
when its shard comes up, ``JobIndex.cancel_pending`` at once for the rest); the images running
finish and are kept. When the last of them is final, the job's export is written with what
finished, and its ``_SUCCESS`` says ``cancelled``; the cancelled images get documents there
(``ocrq.output.export``), so a cancelled job archived reads whole and can be reprocessed.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from ocrq import keys
from ocrq.broker import publish
from ocrq.jobs.failed import FailedImage, registered
from ocrq.jobs.feed import WINDOW
from ocrq.jobs.index import JobIndex, finished
from ocrq.messages import Item
from ocrq.output.export import invalidate
from ocrq.output.export import results as export_results
from ocrq.results import ImageRecord, ImageResult, ImageStatus
from ocrq.settings import Settings
from ocrq.store.storage import ResultStore
from producer.errors import UnknownJob


class Client(Protocol):
    """What reprocess and cancel work through (``producer.client.Client``)."""

    settings: Settings
    redis: Any
    index: JobIndex

    @property
    def store(self) -> ResultStore: ...

    @property
    def app(self) -> Any: ...

    @property
    def feed(self) -> Any: ...

    def request_export(self, job: str, queue: str | None = None, force: bool = False) -> bool: ...


def cancel(client: Client, job: str) -> dict[str, int]:
    """Cancel ``job`` (see the module's docstring); a job already final is left as it is (it is
    not "cancelled" then). Returns its counts."""
    index = client.index
    if not index.exists(job):
        raise UnknownJob(job)
    counts = index.counts(job)
    if finished(counts) and index.cancelled_at(job) is None:
        return counts
    index.cancel(job)
    index.cancel_pending(job)
    client.feed.top_up(job)  # its cursors move on; nothing is published for a cancelled job
    client.request_export(job)  # nothing running: it is final now
    return index.counts(job)


def reprocess(client: Client, job: str | None = None, *, error: str | None = None, dry_run: bool = False) -> int:
    """Re-publish failed images (all jobs, or one; ``error``: of that type only) and, when
    ``job`` is named without ``error``, its cancelled images; returns how many (would be, with
    ``dry_run``)."""
    by_job: dict[str, list[FailedImage]] = {}
    for f in registered(client.index, client.store, job, error):
        by_job.setdefault(f.record.job, []).append(f)
    cancelled = job is not None and error is None and client.index.counts(job).get("cancelled", 0) > 0
    if dry_run:
        unrun = sum(1 for _ in _cancelled(client, job)) if cancelled and job is not None else 0
        return sum(len(recs) for recs in by_job.values()) + unrun
    stamp = str(int(time.time()))
    n = 0
    for j, failed in by_job.items():
        meta = client.index.meta(j)
        invalidate(client.redis, client.store, j)  # new work: the job's export no longer describes it
        # an archived job's failed images have no record left: "reopen" counts them back
        _record_queued(client, j, [f.record for f in failed], "reopen" if client.index.archived(j) else "force")
        client.store.delete_many(keys.failed_object(j, f.record.id) for f in failed)
        n += _publish(client, j, meta, [Item(id=f.record.id, ref=f.record.ref, row=f.record.row, **f.own_spec(meta))
                                        for f in failed], stamp)
    if cancelled and job is not None:
        n += _rerun_cancelled(client, job, stamp)
    return n


def _rerun_cancelled(client: Client, job: str, stamp: str) -> int:
    """The job's cancelled images again, a window at a time (a job of millions is never held
    whole); the job is no longer cancelled."""
    index = client.index
    meta = index.meta(job)
    archived = index.archived(job)
    index.uncancel(job)
    invalidate(client.redis, client.store, job)
    n = 0
    window: list[ImageResult] = []
    for result in _cancelled(client, job):
        window.append(result)
        if len(window) >= WINDOW:
            n += _rerun(client, job, meta, window, archived, stamp)
            window = []
    if window:
        n += _rerun(client, job, meta, window, archived, stamp)
    return n


def _cancelled(client: Client, job: str | None) -> Iterator[ImageResult]:
    assert job is not None
    return (r for r in export_results(client.index, client.store, job) if r.record.status is ImageStatus.cancelled)


def _rerun(client: Client, job: str, meta: dict[str, Any], window: list[ImageResult], archived: bool,
           stamp: str) -> int:
    _record_queued(client, job, [r.record for r in window], "reopen-cancelled" if archived else "force")
    items = [Item(id=r.record.id, ref=r.record.ref, row=r.record.row, **_own(r.spec, meta)) for r in window]
    return _publish(client, job, meta, items, stamp)


def _own(spec: dict[str, Any] | None, meta: dict[str, Any]) -> dict[str, Any]:
    """An image's own task and params where they differ from its job's (``Item`` fields)."""
    out: dict[str, Any] = {}
    if spec and spec.get("task") not in (None, meta.get("task", "text")):
        out["task"] = spec["task"]
    if spec and spec.get("params") is not None and spec["params"] != meta.get("params", {}):
        out["params"] = spec["params"]
    return out


def _record_queued(client: Client, job: str, records: Iterable[ImageRecord], mode: str) -> None:
    client.index.record([ImageRecord(id=r.id, job=job, ref=r.ref, status=ImageStatus.queued, row=r.row)
                         for r in records], mode=mode)


def _publish(client: Client, job: str, meta: dict[str, Any], items: list[Item], stamp: str) -> int:
    """``items`` as chunk messages on the job's queue and priority (chunks capped by count and by
    ``queue.max_message_bytes``, as the feed makes them)."""
    q = client.settings.queue
    publish.chunks(client.app, job, items, task=meta.get("task", "text"), params=meta.get("params", {}),
                   queue=meta.get("queue") or q.name, priority=meta.get("priority"), chunk_size=q.chunk_size,
                   max_message_bytes=q.max_message_bytes, id_suffix="-r" + stamp)
    return len(items)

"""The job index Lua script against a real Redis server: exact counts under redelivery."""

from __future__ import annotations

import pytest

from ocrq import keys
from ocrq.jobs import JobIndex
from ocrq.results import ErrorInfo, ImageRecord, ImageStatus

pytestmark = pytest.mark.integration


def rec(i: int, status: ImageStatus, cached: bool = False, **kw) -> ImageRecord:
    return ImageRecord(id=f"id{i}", job="j", ref=f"/r{i}", status=status, cached=cached, **kw)


def test_counts_stay_exact_under_repeats(redis_client):
    index = JobIndex(redis_client, ttl=60)
    index.create("j", {"task": "text"})
    assert index.record([rec(i, ImageStatus.queued) for i in range(5)], mode="submit") == [True] * 5
    # a resubmission publishes only unfinished images and never resets records
    index.record([rec(0, ImageStatus.done, cached=True), rec(1, ImageStatus.done)])
    index.record([rec(2, ImageStatus.failed, error=ErrorInfo(type="BadImage", message="x"))])
    again = index.record([rec(i, ImageStatus.queued) for i in range(5)], mode="submit")
    assert again == [False, False, False, True, True]
    # a redelivered chunk writes the same final records again: counts do not move
    index.record([rec(0, ImageStatus.done, cached=True), rec(1, ImageStatus.done)])
    # a stale "running" after "done" is ignored
    index.record([rec(1, ImageStatus.running)])
    c = index.counts("j")
    assert c == {**c, "total": 5, "done": 2, "cached": 1, "failed": 1, "queued": 2, "running": 0}
    assert index.failed("j") == [("j", "id2")]
    # reprocess: force back to queued, leaves the failed registry
    index.record([rec(2, ImageStatus.queued)], mode="force")
    assert index.failed("j") == [] and index.counts("j")["failed"] == 0
    assert redis_client.ttl(keys.job_images("j")) > 0


def test_a_jobs_results_come_back_batch_by_batch_each_with_its_own_document(redis_client, tmp_path):
    """ocrq.export.results over a real Redis index and SQLite store, in batches of 2: every image
    once, a finished one with its stored document, an unfinished one (or one whose document is
    missing) as its record."""
    from ocrq.export import results
    from ocrq.results import ImageResult, OcrOutput
    from ocrq.sqlite_store import SqliteStore

    index = JobIndex(redis_client, ttl=60)
    index.create("j", {"task": "text"})
    store = SqliteStore(tmp_path / "store")
    done = [rec(i, ImageStatus.done, pages=1) for i in range(5)]
    index.record(done + [rec(5, ImageStatus.running), rec(6, ImageStatus.done)])
    store.put_many([(keys.result_object("j", r.id), ImageResult(
        record=r, outputs=[OcrOutput(text=f"text {r.id}", engine="e", model="m")]).model_dump_json().encode())
        for r in done])  # id6 is final without a document
    got = {r.record.id: r for r in results(index, store, "j", batch=2)}
    assert sorted(got) == [f"id{i}" for i in range(7)]
    assert all(got[f"id{i}"].text == f"text id{i}" for i in range(5))
    assert got["id5"].outputs == [] and got["id5"].record.status is ImageStatus.running
    assert got["id6"].outputs == [] and got["id6"].record.status is ImageStatus.done

"""The job index Lua script against a real Redis server: exact counts under redelivery."""

from __future__ import annotations

import pytest

from ocrq import keys
from ocrq.feed import Feed, shard_bytes
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
    assert [i for i, _ in index.failed("j")] == ["id2"]
    # reprocess: force back to queued, leaves the failed registry
    index.record([rec(2, ImageStatus.queued)], mode="force")
    assert index.failed("j") == [] and index.counts("j")["failed"] == 0
    assert redis_client.ttl(keys.job_images("j")) > 0


def test_a_finished_job_leaves_redis_but_keeps_its_counts_and_cost(redis_client):
    """archive: once finished and its export asked for, the per-image keys go; counts and meta
    stay; later updates (a late redelivery) are ignored; reopen (reprocess) counts back."""
    index = JobIndex(redis_client, ttl=60)
    index.create("j", {"task": "text"})
    index.record([rec(i, ImageStatus.queued) for i in range(3)], mode="submit")
    index.record([rec(0, ImageStatus.done, engine_s=0.5, batch_size=2),
                  rec(1, ImageStatus.done, engine_s=0.5, batch_size=2), rec(2, ImageStatus.running)])
    assert not index.archive("j")  # not finished
    index.record([rec(2, ImageStatus.failed, error=ErrorInfo(type="BadImage", message="x"))])
    assert not index.archive("j")  # finished, but no export asked for
    redis_client.set(keys.job_finishing("j"), "1")
    assert index.archive("j") and index.archived("j")
    assert not redis_client.exists(keys.job_images("j"), keys.job_failed("j"))
    c = index.counts("j")
    assert c == {**c, "total": 3, "done": 2, "failed": 1, "running": 0}
    assert index.cost("j")["engine_s"] == 1.0 and index.cost("j")["batches"] == 1.0
    # a late redelivery of an archived job's chunk moves nothing
    assert index.record([rec(0, ImageStatus.running), rec(1, ImageStatus.done)]) == [False, False]
    assert index.counts("j") == c
    # reprocess of the archived job's failure: reopen counts it back from failed
    assert index.record([rec(2, ImageStatus.queued)], mode="reopen") == [True]
    c = index.counts("j")
    assert c == {**c, "total": 3, "done": 2, "failed": 0, "queued": 1} and not index.archived("j")


def test_a_jobs_results_come_back_batch_by_batch_each_with_its_own_document(redis_client, tmp_path):
    """ocrq.export.results over a real Redis index and SQLite store, in batches of 2, while the job
    runs: every image once, a finished one with its stored document, an unfinished one (or one
    whose document is missing) as its record. Once finished: the store's documents alone."""
    from ocrq.export import results
    from ocrq.results import ImageResult, OcrOutput
    from ocrq.sqlite_store import SqliteStore

    index = JobIndex(redis_client, ttl=60)
    index.create("j", {"task": "text"})
    store = SqliteStore(tmp_path / "store")
    feed = Feed(redis_client, store, index, app=None, window=65536, chunk_size=4, max_message_bytes=2**20)
    sub, _ = feed.register("j", "s1", 1, "text", {}, "ocrq", None)
    assert index.record_queued("j", [f"id{i}" for i in range(7)], sub.ordinal) == [True] * 7
    store.put_many([(keys.refs_shard("j", "s1", 0), shard_bytes((f"id{i}", f"/r{i}", None) for i in range(8)))])
    feed.written("j", sub, 1)  # (id7 is in the shard without a record: listed as queued)
    done = [rec(i, ImageStatus.done, pages=1) for i in range(5)]
    index.record(done + [rec(5, ImageStatus.running), rec(6, ImageStatus.done)])
    store.put_many([(keys.result_object("j", r.id), ImageResult(
        record=r, outputs=[OcrOutput(text=f"text {r.id}", engine="e", model="m")]).model_dump_json().encode())
        for r in done])  # id6 is final without a document
    got = {r.record.id: r for r in results(index, store, "j", batch=2)}
    assert sorted(got) == [f"id{i}" for i in range(8)]
    assert got["id7"].record.status is ImageStatus.queued and got["id7"].record.ref == "/r7"
    assert all(got[f"id{i}"].text == f"text id{i}" for i in range(5))
    assert got["id5"].outputs == [] and got["id5"].record.status is ImageStatus.running
    assert got["id6"].outputs == [] and got["id6"].record.status is ImageStatus.done
    index.record([rec(5, ImageStatus.done)])  # finished: read from the store, Redis or not
    redis_client.delete(keys.job_images("j"))
    assert sorted(r.record.id for r in results(index, store, "j", batch=2)) == [f"id{i}" for i in range(5)]

"""The job index Lua script against a real Redis server: exact counts under redelivery."""

from __future__ import annotations

import pytest

from ocrq import keys
from ocrq.jobs.index import JobIndex
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
    assert index.archive("j", 3) == 0  # not finished
    index.record([rec(2, ImageStatus.failed, error=ErrorInfo(type="BadImage", message="x"))])
    assert index.archive("j", 3) == 0  # finished, but no export asked for
    redis_client.set(keys.job_finishing("j"), "1")
    # an export that began when the job had 2 images covers 2: stale, the records stay
    assert index.archive("j", 2) == -1 and not index.archived("j")
    assert index.archive("j", 3) == 1 and index.archived("j")
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

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

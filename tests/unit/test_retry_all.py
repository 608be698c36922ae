"""A chunk that failed as a whole (worker.chunk.whole.retry_all): an outage of ocrq's own store or Redis
does not spend its images' attempts (for up to ``queue.outage_retry_s``); past that, final
failures that cannot be stored are handed back, never acked as "running". The context is a fake
(``FakeContext``) whose store is down or up; the retry policy is the real one."""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from ocrq.errors import StorageUnavailable, TooLarge
from ocrq.messages import Chunk, Item
from ocrq.results import ImageRecord, ImageStatus
from ocrq.settings import Settings
from worker.chunk.retry import outage_wait
from worker.chunk.whole import retry_all


class FakeStore:
    def __init__(self, down: bool) -> None:
        self.down = down
        self.written: list[str] = []

    def put_many(self, items: list[tuple[str, Any]], *, new: Collection[str] = ()) -> None:
        if self.down:
            raise StorageUnavailable("S3 unavailable (put)")
        self.written += [path for path, _ in items]


@dataclass
class FakeIndex:
    recorded: list[ImageRecord] = field(default_factory=list)

    parts: int = 0
    part_of: dict[str, int | None] = field(default_factory=dict)

    def record(self, records: list[ImageRecord], part: int | None = None) -> None:
        self.recorded += records
        self.part_of.update((r.id, part) for r in records)

    def new_part(self, job: str) -> tuple[str, int]:
        self.parts += 1
        return "e0", self.parts


class FakeMetrics:
    def observe_records(self, *_: Any) -> None:
        pass


@dataclass
class FakeContext:
    store: FakeStore
    settings: Settings = field(default_factory=Settings)
    index: FakeIndex = field(default_factory=FakeIndex)
    metrics: FakeMetrics = field(default_factory=FakeMetrics)
    hostname: str = "w@h"


def _chunk(outage_since: float | None = None) -> Chunk:
    # a: last attempt (its failure is final); b: still has attempts left
    return Chunk(job="j", items=[Item(id="a", ref="/x/a.png", attempt=4), Item(id="b", ref="/x/b.png", attempt=1)],
                 outage_since=outage_since)


def _long_ago() -> float:
    return time.time() - Settings().queue.outage_retry_s - 1


def test_an_outage_of_the_store_does_not_spend_the_images_attempts() -> None:
    """A 10 s S3 outage used to exhaust the four attempts of some images (RetriesExhausted in the
    chaos suite's `s3` scenario): the store was down, not the images."""
    ctx = FakeContext(FakeStore(down=True))
    t0 = time.time()
    report = retry_all(ctx, _chunk(), StorageUnavailable("S3 unavailable"))  # type: ignore[arg-type]
    assert report.failed == 0 and ctx.store.written == []
    assert sorted((it.id, it.attempt) for it in report.retry) == [("a", 4), ("b", 1)]
    assert report.outage_since is not None and report.outage_since >= t0
    q = Settings().queue
    assert q.backoff_base * 0.5 <= report.countdown <= q.backoff_base  # the outage just began
    assert {r.id: r.status for r in ctx.index.recorded} == {"a": ImageStatus.retrying, "b": ImageStatus.retrying}
    # an outage of 100 s: the next try waits about as long, and the outage keeps its start
    later = retry_all(ctx, _chunk(time.time() - 100), StorageUnavailable("S3 unavailable"))  # type: ignore[arg-type]
    assert 50 <= later.countdown <= 100 and later.outage_since is not None and later.outage_since < t0


def test_final_failures_that_cannot_be_stored_are_handed_back_not_acked() -> None:
    ctx = FakeContext(FakeStore(down=True))
    report = retry_all(ctx, _chunk(_long_ago()), StorageUnavailable("S3 unavailable"))  # type: ignore[arg-type]
    assert report.failed == 0 and report.failures == ()
    # both go back; the one on its last attempt keeps it (the store failed, not the image)
    assert sorted((it.id, it.attempt) for it in report.retry) == [("a", 4), ("b", 2)]
    assert report.countdown > 0
    assert {r.id: r.status for r in ctx.index.recorded} == {"a": ImageStatus.retrying, "b": ImageStatus.retrying}


def test_final_failures_are_recorded_when_the_store_is_up() -> None:
    ctx = FakeContext(FakeStore(down=False))
    report = retry_all(ctx, _chunk(_long_ago()), StorageUnavailable("redis went away"))  # type: ignore[arg-type]
    assert report.failed == 1 and [it.id for it in report.retry] == ["b"]
    # the failure's document goes into a result part, which its record names; and the mirror
    assert ctx.store.written == ["results/j/parts/e0-00000001.jsonl", "failed/j/a.json"]
    assert {r.id: r.status for r in ctx.index.recorded} == {"a": ImageStatus.failed, "b": ImageStatus.retrying}
    assert ctx.index.part_of == {"a": 1, "b": 1}


def test_the_outage_wait_grows_with_the_outage_and_ends_after_outage_retry_s() -> None:
    """The same rule serves a chunk and the job's export (finish_job): in the full chaos run a
    30 s S3 outage outlasted the export's four attempts and the finished job never got its
    ``_SUCCESS`` marker."""
    ctx = FakeContext(FakeStore(down=True))
    q = Settings().queue
    down = StorageUnavailable("S3 unavailable")
    first = outage_wait(ctx.settings.queue, down, None)
    assert first is not None and q.backoff_base * 0.5 <= first <= q.backoff_base
    later = outage_wait(ctx.settings.queue, down, time.time() - 100)
    assert later is not None and 50 <= later <= 100
    longest = outage_wait(ctx.settings.queue, down, time.time() - q.outage_retry_s + 5)
    assert longest is not None and longest <= q.backoff_max
    assert outage_wait(ctx.settings.queue, down, _long_ago()) is None  # type: ignore[arg-type]
    assert outage_wait(ctx.settings.queue, TooLarge("not an outage"), None) is None  # type: ignore[arg-type]

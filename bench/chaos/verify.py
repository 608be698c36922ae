"""The end-of-scenario check: every accepted image has exactly one final record (done, or failed
with a permanent error), the counters equal the records, each result document is whole and
agrees with its record, the job's export (``_SUCCESS``) covers every image, and nothing is left
queued or unacked."""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ocrq import keys
from ocrq.jobs.index import JobIndex
from ocrq.output.export import results
from ocrq.store.storage import ResultStore


@dataclass
class Outcome:
    images: int
    done: int = 0
    failed: Counter[str] = field(default_factory=Counter)
    lost: int = 0
    duplicated: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and self.lost == 0 and self.duplicated == 0


def verify(redis: Any, index: JobIndex, store: ResultStore, job: str, ids: set[str], queue: str) -> Outcome:
    out = Outcome(images=len(ids))
    listed_results = list(results(index, store, job))
    listed = [r.record for r in listed_results]
    records = {r.id: r for r in listed}
    extra = set(records) - ids
    if extra:
        out.problems.append(f"{len(extra)} records for images never submitted")
    for image_id in ids:
        rec = records.get(image_id)
        if rec is None or rec.status.value not in ("done", "failed"):
            out.lost += 1
            continue
        if rec.status.value == "done":
            out.done += 1
        elif rec.error is None or rec.error.retryable:
            out.problems.append(f"{image_id}: failed without a permanent error: {rec.error}")
        else:
            out.failed[rec.error.type] += 1
    counts = index.counts(job)
    tally = Counter(r.status.value for r in records.values())
    for status in ("done", "failed", "queued", "running", "retrying"):
        if counts.get(status, 0) != tally.get(status, 0):
            out.problems.append(f"count {status}={counts.get(status, 0)} but {tally.get(status, 0)} records")
    # each document is whole: the archived job is read through its results index from its parts
    # (every line parsed: a torn part fails here); an image listed twice counts as duplicated
    out.duplicated = len(listed) - len(records) + _export_duplicates(store, job)
    for result in listed_results:
        if result.record.status.value == "done" and not result.outputs:
            out.problems.append(f"{result.record.id}: done without outputs")
    out.problems += _export_problems(store, job, len(ids))
    out.problems += _left_behind(redis, index, job, queue)
    return out


def _left_behind(redis: Any, index: JobIndex, job: str, queue: str) -> list[str]:
    """A finished job is archived (no per-image state in Redis), and no message is left."""
    problems = []
    if not index.archived(job):
        problems.append("the finished, exported job was not archived (its records are still in Redis)")
    unacked, queued = in_flight(redis, queue)
    if unacked or queued:
        problems.append(f"left behind: {unacked} unacked, {queued} queued messages")
    return problems


def wait_drained(redis: Any, queue: str, timeout_s: float) -> float:
    """Wait until no message is queued or unacked (a worker killed just before the faults
    stopped leaves its message in ``unacked`` until the reaper gives it back and a worker acks
    it), at most ``timeout_s``; the seconds waited. What is still there then, ``verify`` reports."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            if in_flight(redis, queue) == (0, 0):
                break
        except Exception:  # noqa: BLE001 - Redis restarting: the next poll sees it
            pass
        time.sleep(0.5)
    return time.monotonic() - t0


def in_flight(redis: Any, queue: str) -> tuple[int, int]:
    """(messages unacked, messages queued) on the broker."""
    return int(redis.hlen(keys.CELERY_UNACKED)), sum(int(redis.llen(k)) for k in queue_lists(redis, queue))


def queue_lists(redis: Any, queue: str) -> list[bytes]:
    """The broker's lists for ``queue`` (one per priority level), not ocrq's own ``ocrq:`` keys
    (the queue's wake-up tokens, ``keys.queue_ring``, are a list too)."""
    return [k for k in redis.scan_iter(match=f"{queue}*", _type="list") if not k.startswith(keys.PREFIX.encode())]


def _export_duplicates(store: ResultStore, job: str) -> int:
    """Lines of the job's export whose image id an earlier line had."""
    data = store.get_many([keys.export_object(job, keys.EXPORT_JSONL)], raw=True).get(
        keys.export_object(job, keys.EXPORT_JSONL))
    if data is None:
        return 0
    ids = Counter(json.loads(line)["id"] for line in data.splitlines() if line.strip())
    return sum(n - 1 for n in ids.values())


def _export_problems(store: ResultStore, job: str, images: int) -> list[str]:
    """The finished job's export (ocrq.output.export): its ``_SUCCESS`` marker covers every image."""
    marker = store.get_json(keys.export_object(job, keys.EXPORT_SUCCESS))
    if marker is None:
        return ["finished job without an export _SUCCESS marker"]
    if marker.get("lines") != images:
        return [f"export has {marker.get('lines')} lines for {images} images"]
    return []

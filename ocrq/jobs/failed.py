"""The failed registry, read and pruned: each running job's ZSET in Redis (``keys.job_failed``,
scored by failure time) and the durable mirror in the store (``keys.failed_object``), which the
worker writes beside each failed image's result so losing Redis does not lose the list of what
failed. Once a job is archived (finished and exported: ``ocrq.jobs.index``), the mirror is its
registry: Redis keeps nothing per image of a finished job.

A reprocess deletes the mirror entries of the images it re-publishes (before publishing them:
an image that fails again gets a new one), so the mirror lists what is failed now.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ocrq import keys
from ocrq.jobs.index import JobIndex
from ocrq.results import ImageRecord, ImageStatus
from ocrq.store.storage import ResultStore

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhdw])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


@dataclass
class FailedImage:
    record: ImageRecord
    #: epoch seconds it entered the registry
    failed_at: float
    task: str | None = None
    params: dict[str, Any] | None = None

    def line(self) -> dict[str, Any]:
        return {**self.record.model_dump(mode="json", exclude_none=True), "failed_at": self.failed_at}

    def own_spec(self, meta: dict[str, Any]) -> dict[str, Any]:
        """The task and params it ran with, as ``Item`` fields, where they differ from its job's
        (``meta``): an OpenAI Batch line's own, which ``ocrq reprocess`` runs it with again."""
        out: dict[str, Any] = {}
        if self.task is not None and self.task != meta.get("task", "text"):
            out["task"] = self.task
        if self.params is not None and self.params != meta.get("params", {}):
            out["params"] = self.params
        return out

    def why(self, width: int = 300) -> str:
        """The error in one line: ``Type: message`` (cut at ``width``)."""
        error = self.record.error
        return (f"{error.type}: {error.message}" if error else "failed")[:width]


def parse_since(text: str, now: float | None = None) -> float:
    """``30m``, ``2h``, ``7d`` (ago) or an ISO-8601 time → epoch seconds."""
    now = time.time() if now is None else now
    m = _DURATION.match(text.strip().lower())
    if m:
        return now - float(m.group(1)) * _UNIT_S[m.group(2)]
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError as exc:
        raise ValueError(f"--since {text!r}: use 30m, 2h, 7d or an ISO time (2026-11-30T08:00)") from exc
    return moment.timestamp()


def _matches(rec: ImageRecord, error: str | None) -> bool:
    return error is None or (rec.error is not None and rec.error.type == error)


def registered(index: JobIndex, store: ResultStore, job: str | None = None, error: str | None = None,
               since: float | None = None, limit: int | None = None) -> Iterator[FailedImage]:
    """Oldest first, over one job or every known job. A running job's failures are its registry in
    Redis, their records read from the store's mirror (one ``get_many`` per job: Redis keeps no
    record of a final image); an archived job's are the mirror alone. ``limit`` (without
    ``error``): at most that many."""
    found: list[FailedImage] = []
    cap = limit if error is None else None  # with an error filter, records decide what counts
    for j in [job] if job is not None else index.jobs():
        if index.archived(j):
            found += from_store(store, j, error, since)
            continue
        entries = index.failed(j, since, cap)
        docs = store.get_many([keys.failed_object(j, i) for i, _ in entries])
        for image_id, score in entries:
            doc = docs.get(keys.failed_object(j, image_id))
            if not isinstance(doc, dict):
                continue
            rec = ImageRecord.model_validate(doc["record"])
            if rec.status == ImageStatus.failed and _matches(rec, error):
                found.append(FailedImage(rec, score, doc.get("task"), doc.get("params")))
    found.sort(key=lambda f: f.failed_at)
    yield from found if cap is None else found[:cap]


def from_store(store: ResultStore, job: str | None = None, error: str | None = None,
               since: float | None = None) -> Iterator[FailedImage]:
    """The durable mirror (no Redis needed)."""
    prefix = keys.FAILED_OBJECTS + (f"{job}/" if job else "")
    for path in store.list(prefix):
        doc = store.get_json(path)
        if not doc:
            continue
        rec = ImageRecord.model_validate(doc["record"])
        failed_at = float(doc.get("failed_at") or rec.updated)
        if not _matches(rec, error) or (since is not None and failed_at < since):
            continue
        yield FailedImage(rec, failed_at, doc.get("task"), doc.get("params"))


def find(index: JobIndex, image: str, store: ResultStore | None = None) -> tuple[str, str] | None:
    """``job/id`` or a bare image id (unique across jobs by construction) → (job, id): looked up
    in each known job's failed registry, or its store mirror once the job is archived."""
    if "/" in image:
        j, _, image_id = image.partition("/")
        return j, image_id
    for j in index.jobs():
        if index.archived(j):
            if store is not None and store.get_json(keys.failed_object(j, image)) is not None:
                return j, image
        elif index.redis.zscore(keys.job_failed(j), image) is not None:
            return j, image
    return None


def purge(index: JobIndex, store: ResultStore, job: str | None = None, error: str | None = None) -> int:
    """Forget failed images (from the registry and its mirror); their job records stay failed."""
    doomed = list(registered(index, store, job, error))
    stored = {(f.record.job, f.record.id) for f in from_store(store, job, error)}
    pairs = {(f.record.job, f.record.id) for f in doomed} | stored
    by_job: dict[str, list[str]] = {}
    for f in doomed:
        by_job.setdefault(f.record.job, []).append(f.record.id)
    for j, ids in by_job.items():
        index.redis.zrem(keys.job_failed(j), *ids)
    for j, image_id in pairs:
        store.delete(keys.failed_object(j, image_id))
    return len(pairs)

"""The job index in Redis: per-image records while a job runs, exact status counts, the job's
failed registry, and what its images cost.

All writes go through one Lua script so a batch of records is one round trip and the counts
stay exact under redelivery (a record only moves the counters when its status changes), and so
a final ``done`` is never overwritten by a stale redelivery. Keys: see ``ocrq.keys``.

A finished job leaves Redis (``archive``): once its export is written, its per-image records and
failed registry are deleted; its meta and counts stay (``job_ttl``). Every final image's document
is in the store (written before its record), so readers take a finished job from there
(``ocrq.output.export.results``, ``ocrq.jobs.failed``). Per image, a finished job then keeps nothing in Redis.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterable, Sequence
from typing import Any

from ocrq import keys, markers, names
from ocrq.broker import scripts
from ocrq.broker.scripts import PastMaxmemory
from ocrq.results import ImageRecord, ImageStatus

_BATCH = 500
#: image ids per call of the cancel script
_CANCEL_BATCH = 1000
_IN_WORK = (ImageStatus.running, ImageStatus.retrying)
#: counts fields that are not image statuses (what the job cost; see ``ocrq.jobs.cost``)
COST_FIELDS = ("engine_s", "engine_images", "batches", "last_done", "store_puts", "store_gets")
#: counts fields that are neither statuses nor cost: queued images in a message (the feed window)
WINDOW_FIELDS = ("published",)


def settled(counts: dict[str, int]) -> int:
    """Images of the job that are final: done, failed or cancelled."""
    return counts.get("done", 0) + counts.get("failed", 0) + counts.get("cancelled", 0)


def finished(counts: dict[str, int]) -> bool:
    """Whether every image of the job is final (done, failed or cancelled)."""
    return settled(counts) >= counts["total"]


def parse_counts(raw: dict[bytes, bytes], records: int = 0) -> dict[str, int]:
    """``JobIndex.counts`` from the counts hash as read (``records``: the images hash's length)."""
    fields = {k.decode(): v for k, v in raw.items()}
    counts = {s.value: 0 for s in ImageStatus}
    counts.update({k: int(v) for k, v in fields.items() if k not in COST_FIELDS})
    for field in WINDOW_FIELDS:
        counts.pop(field, None)
    counts["cached"] = counts.get("cached", 0)
    # jobs recorded before the total was counted: their records are all there
    counts["total"] = counts.get("total") or records
    return counts


def parse_cost(raw: dict[bytes, bytes]) -> dict[str, float]:
    """``JobIndex.cost`` from the counts hash as read."""
    return {k: float(raw.get(k.encode(), 0) or 0) for k in COST_FIELDS}


def parse_meta(raw: dict[bytes, bytes]) -> dict[str, Any]:
    """``JobIndex.meta`` from the meta hash as read."""
    return {k.decode(): json.loads(v) for k, v in raw.items()}


class JobIndex:
    def __init__(self, redis: Any, ttl: int) -> None:
        self.redis = redis
        self.ttl = ttl
        self._script = scripts.plain(redis, "index_record")
        # the workers' updates finish accepted work: they run past maxmemory (ocrq.broker.scripts)
        self._update = PastMaxmemory(redis, "index_record")
        # archiving frees a finished job's per-image keys: past maxmemory too
        self._archive = PastMaxmemory(redis, "index_archive")
        self._new_part = PastMaxmemory(redis, "index_new_part")
        # cancelling finishes accepted work (it only shrinks what is left): past maxmemory too
        self._cancel = PastMaxmemory(redis, "index_cancel")
        self._add_requests = PastMaxmemory(redis, "index_add_requests")

    # --- writes ----------------------------------------------------------------------------

    def create(self, job: str, meta: dict[str, Any]) -> None:
        now = time.time()
        tenant_jobs = keys.tenant_jobs(names.tenant_of(job))
        pipe = self.redis.pipeline()
        pipe.zadd(keys.JOBS, {job: now}, nx=True)
        pipe.zadd(tenant_jobs, {job: now}, nx=True)
        # the lists of jobs keep those whose keys can still be alive (job_ttl): they never grow forever
        pipe.zremrangebyscore(keys.JOBS, "-inf", now - self.ttl)
        pipe.zremrangebyscore(tenant_jobs, "-inf", now - self.ttl)
        pipe.hsetnx(keys.job(job), "created", now)
        pipe.hset(keys.job(job), mapping={k: json.dumps(v) for k, v in meta.items()})
        pipe.expire(keys.job(job), self.ttl)
        pipe.execute()

    def record(self, records: Sequence[ImageRecord], mode: str = "update", owner: int = 0,
               requests: tuple[int, int] = (0, 0), part: int | None = None) -> list[bool]:
        """Write records (all of one job per call is typical, but not required). ``owner``: the
        submission recording them (mode ``submit``; ocrq.jobs.feed). ``requests``: the store (puts,
        gets) their work made, added to the job's counts (one job per call then). ``part``: the
        result part (``new_part``) the final records' documents were written to."""
        flags: list[bool] = []
        by_job: dict[str, list[ImageRecord]] = {}
        for rec in records:
            by_job.setdefault(rec.job, []).append(rec)
        now = time.time()
        for job, recs in by_job.items():
            for start in range(0, len(recs), _BATCH):
                argv: list[Any] = [now, self.ttl, mode, owner, *(requests if start == 0 else (0, 0)),
                                   "" if part is None else part]
                for rec in recs[start:start + _BATCH]:
                    rec.updated = now
                    # only an image a worker is on keeps its record in Redis (others: a marker)
                    doc = rec.model_dump_json(exclude_none=True) if rec.status in _IN_WORK else ""
                    argv += [rec.id, rec.status.value, "1" if rec.cached else "0", doc,
                             "" if rec.engine_s is None else repr(float(rec.engine_s)), rec.batch_size or 0]
                script = self._update if mode == "update" else self._script
                res = script(keys=[keys.job_images(job), keys.job_counts(job), keys.job_failed(job), keys.job(job)],
                             args=argv)
                flags += [bool(x) for x in res]
        return flags

    def record_queued(self, job: str, ids: Sequence[str], owner: int) -> list[bool]:
        """Record new images of submission ``owner`` as queued (mode ``submit``, no record built:
        a marker is all Redis keeps); True where the submission's shard needs the image."""
        flags: list[bool] = []
        now = time.time()
        for start in range(0, len(ids), _BATCH):
            argv: list[Any] = [now, self.ttl, "submit", owner, 0, 0, ""]
            for image_id in ids[start:start + _BATCH]:
                argv += [image_id, "queued", "0", "", "", 0]
            res = self._script(keys=[keys.job_images(job), keys.job_counts(job), keys.job_failed(job), keys.job(job)],
                               args=argv)
            flags += [bool(x) for x in res]
        return flags

    def new_part(self, job: str) -> tuple[str, int]:
        """A fresh result part of the job: (the job's epoch, the part's number), for
        ``keys.result_part``. Numbers only grow while the job's meta lives; the epoch changes with
        a new meta, so a part's name is never reused (parts are written once, never replaced)."""
        epoch, n = self._new_part(keys=[keys.job(job)], args=[json.dumps(secrets.token_hex(4)), self.ttl])
        return json.loads(epoch), int(n)

    def add_requests(self, job: str, puts: int, gets: int) -> None:
        """Store requests made for the job outside its records (its export, its refs shards);
        past maxmemory too (an export's last step)."""
        self._add_requests(keys=[keys.job_counts(job)], args=[puts, gets])

    def archive(self, job: str, exported_total: int) -> int:
        """Move a finished, exported job out of Redis: its per-image records, failed registry and
        submissions are deleted (their documents are in the store; the caller deletes the refs
        shards), its meta and counts stay. ``exported_total``: the job's total when its export
        began. Returns 1 when archived; 0 when the job got new work since its export was asked
        for (it is archived after its next export); -1 when its total moved while the export ran
        (the export is stale: the caller asks for another)."""
        return int(self._archive(keys=[keys.job_images(job), keys.job_counts(job), keys.job_failed(job),
                                       keys.job(job), keys.job_finishing(job), keys.job_feed(job),
                                       keys.EVENTS, keys.EVENTS_DUE],
                                 args=[exported_total, job, time.time()]))

    def cancel(self, job: str) -> bool:
        """Mark the job cancelled (True the first time): from now on none of its images that has
        not started runs (the record script turns them "x"); ``cancel_pending`` counts the rest."""
        return bool(self.redis.hsetnx(keys.job(job), "cancelled", json.dumps(time.time())))

    def cancel_pending(self, job: str) -> int:
        """Turn every image of the cancelled ``job`` that has not started into "cancelled", a
        batch of ids per script call (HSCAN: bounded work per call, never the whole hash at
        once); returns how many."""
        n = 0
        batch: list[bytes] = []
        args = [keys.job_images(job), keys.job_counts(job), keys.job(job)]
        for key, value in self.redis.hscan_iter(keys.job_images(job), count=_CANCEL_BATCH):
            if markers.is_queued(value) or markers.is_record(value):
                batch.append(key)
            if len(batch) >= _CANCEL_BATCH:
                n += int(self._cancel(keys=args, args=batch))
                batch = []
        if batch:
            n += int(self._cancel(keys=args, args=batch))
        return n

    def uncancel(self, job: str) -> None:
        """The job runs again (a reprocess of its cancelled images)."""
        self.redis.hdel(keys.job(job), "cancelled")

    # --- reads -----------------------------------------------------------------------------

    def cancelled_at(self, job: str) -> float | None:
        raw = self.redis.hget(keys.job(job), "cancelled")
        return None if raw is None else float(json.loads(raw))

    def exists(self, job: str) -> bool:
        return bool(self.redis.exists(keys.job(job)))

    def meta(self, job: str) -> dict[str, Any]:
        return parse_meta(self.redis.hgetall(keys.job(job)))

    def archived(self, job: str) -> bool:
        """Whether the job's per-image state has left Redis (read it from the store)."""
        return self.redis.hget(keys.job(job), "archived") is not None

    def counts(self, job: str) -> dict[str, int]:
        """Images by status, plus ``total`` and ``cached`` (exact; what the job cost: ``cost``).
        Two plain reads, not a transaction: Redis refuses a MULTI past its maxmemory, and a job
        whose last image ended then must still be seen finished (its export asked for)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(keys.job_counts(job))
        pipe.hlen(keys.job_images(job))
        raw, records = pipe.execute()
        return parse_counts(raw, int(records))

    def cost(self, job: str) -> dict[str, float]:
        """The cost fields of the job's counts (engine seconds, images and batches, last done)."""
        raw = self.redis.hmget(keys.job_counts(job), COST_FIELDS)
        return {k: float(v) if v is not None else 0.0 for k, v in zip(COST_FIELDS, raw, strict=True)}

    def get(self, job: str, ids: Iterable[str]) -> list[ImageRecord | None]:
        """The records of images a worker is on (running, retrying); None for the others (a
        marker: ``raw``), and for images the job does not have."""
        return [ImageRecord.model_validate_json(r) if markers.is_record(r) else None for r in self.raw(job, ids)]

    def raw(self, job: str, ids: Iterable[str]) -> list[bytes | None]:
        """What Redis holds for each image: a marker (``ocrq.markers``: b"q3", b"p", b"d12", b"c12", b"f12", b"x"),
        a running or retrying image's ImageRecord JSON, or None."""
        ids = list(ids)
        return list(self.redis.hmget(keys.job_images(job), ids)) if ids else []

    def window(self, job: str) -> int:
        """Images of the job in flight: in a message, or a worker on them (ocrq.jobs.feed's window)."""
        raw = self.redis.hmget(keys.job_counts(job), ("published", "running", "retrying"))
        return sum(int(v) for v in raw if v is not None)

    def jobs(self) -> list[str]:
        return [j.decode() for j in self.redis.zrange(keys.JOBS, 0, -1)]

    def jobs_of(self, tenant: str, start: int = 0, count: int = 50, newest_first: bool = True
                ) -> list[tuple[str, float]]:
        """(job, created) of one tenant's jobs, a page of them (``start``: how many to pass)."""
        end = start + count - 1
        key = keys.tenant_jobs(tenant)
        pairs = (self.redis.zrevrange(key, start, end, withscores=True) if newest_first
                 else self.redis.zrange(key, start, end, withscores=True))
        return [(j.decode(), float(score)) for j, score in pairs]

    def jobs_count(self, tenant: str) -> int:
        return int(self.redis.zcard(keys.tenant_jobs(tenant)))

    def failed(self, job: str, since: float | None = None, limit: int | None = None) -> list[tuple[str, float]]:
        """(image id, failed at) in the job's failed registry, oldest first (empty once archived)."""
        start = since if since is not None else "-inf"
        if limit is None:
            pairs = self.redis.zrangebyscore(keys.job_failed(job), start, "+inf", withscores=True)
        else:
            pairs = self.redis.zrangebyscore(keys.job_failed(job), start, "+inf", start=0, num=limit,
                                             withscores=True)
        return [(member.decode(), float(score)) for member, score in pairs]

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

from ocrq import keys, names
from ocrq.broker.scripts import PastMaxmemory
from ocrq.results import ImageRecord, ImageStatus

# KEYS: images hash, counts hash, the job's failed zset, job meta hash
# ARGV: now, ttl, mode, owner (the submission's ordinal: ocrq.jobs.feed), the store requests (puts,
# gets) the call's work made, the result part holding the final images' documents (its number,
# or ""), then (id, status, cached, doc, engine_s, batch_size) per image.
# A record is a short marker unless a worker is on the image: "q{owner}" queued, no message yet
# (the submission's shard is its feed: ocrq.jobs.feed); "p" queued in a message; "d{part}"/"c{part}"
# done (engine / cache); "f{part}" failed; "x" cancelled (it never ran); running and retrying
# images hold their ImageRecord JSON (``doc``). A final image's full record is its document, in
# that part (ocrq.output.parts).
# A cancelled job (its meta has ``cancelled``): what has not started never runs. A worker's
# "running" (or "retrying", "queued") for an image that is not running turns it "x" and says 0
# (the worker skips it); a running image's outcome stands, but a retry becomes "x"; a submit
# records new images as "x" (no shard line).
# Modes: "submit" records new images (never resets one) and says which need its submission's
# shard: new ones, and those it recorded before without publishing them (a resumed submit);
# "update" (the workers) never rewrites a done image: the first done stands (a chunk run again
# after a redelivery or a Redis failover cannot replace its result), and leaves an archived job alone (its
# records left Redis: a stale redelivery is ignored); an image without a record in a job that is
# not archived (a message from elsewhere) is recorded; "force" (reprocess) writes
# whatever is there, queued ones as published; "reopen" (reprocess of an archived job) is force
# for images whose record left with the archive: they were failed ("reopen-cancelled": cancelled).
# Returns one flag per item: 1 = written (submit: needs a shard line), 0 = left alone.
_RECORD_LUA = """
local now, ttl, mode, owner = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
if tonumber(ARGV[5]) > 0 then redis.call('HINCRBY', KEYS[2], 'store_puts', ARGV[5]) end
if tonumber(ARGV[6]) > 0 then redis.call('HINCRBY', KEYS[2], 'store_gets', ARGV[6]) end
local marks = {d = 'done', c = 'done', f = 'failed', p = 'queued', q = 'queued', x = 'cancelled'}
local part = ARGV[7]
local out = {}
local opened = false
local archived = redis.call('HEXISTS', KEYS[4], 'archived') == 1
local cancelled = redis.call('HEXISTS', KEYS[4], 'cancelled') == 1
for i = 8, #ARGV, 6 do
  local id, st, cached, doc = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local engine_s, batch_size = ARGV[i + 4], tonumber(ARGV[i + 5])
  local old = redis.call('HGET', KEYS[1], id)
  local ost, ocached, opub = false, false, false
  if old then
    local head = string.sub(old, 1, 1)
    if head == '{' then
      local o = cjson.decode(old)
      ost = o['status']
      ocached = o['cached'] == true
    else
      ost = marks[head]
      ocached = head == 'c'
      opub = head == 'p'
    end
  elseif mode == 'reopen' then
    ost = 'failed'
  elseif mode == 'reopen-cancelled' then
    ost = 'cancelled'
  end
  local write = true
  if mode == 'submit' then
    write = (old == false)
    if cancelled then
      st = 'cancelled'
      out[#out + 1] = 0
    else
      out[#out + 1] = ((old == false) or (old == 'q' .. owner)) and 1 or 0
    end
  else
    local flag = nil
    if mode == 'update' and ((old == false and archived) or ost == 'done' or ost == 'cancelled') then
      write = false
    elseif mode == 'update' and cancelled and st ~= 'done' and st ~= 'failed' then
      -- not started (or a retry of one that ran): it never runs
      if ost ~= 'running' or st == 'retrying' then
        st = 'cancelled'
        flag = 0
      end
    end
    out[#out + 1] = flag or (write and 1 or 0)
  end
  if write then
    local value = doc
    if st == 'done' then value = ((cached == '1') and 'c' or 'd') .. part
    elseif st == 'failed' then value = 'f' .. part
    elseif st == 'cancelled' then value = 'x'
    elseif st == 'queued' then value = (mode == 'submit') and ('q' .. owner) or 'p' end
    redis.call('HSET', KEYS[1], id, value)
    if opub then redis.call('HINCRBY', KEYS[2], 'published', -1) end
    if st == 'queued' and mode ~= 'submit' then redis.call('HINCRBY', KEYS[2], 'published', 1) end
    if ost then redis.call('HINCRBY', KEYS[2], ost, -1) else redis.call('HINCRBY', KEYS[2], 'total', 1) end
    redis.call('HINCRBY', KEYS[2], st, 1)
    if ost == 'done' and ocached then redis.call('HINCRBY', KEYS[2], 'cached', -1) end
    if st == 'done' and cached == '1' then redis.call('HINCRBY', KEYS[2], 'cached', 1) end
    if st == 'done' and ost ~= 'done' then
      if engine_s ~= '' then
        redis.call('HINCRBYFLOAT', KEYS[2], 'engine_s', engine_s)
        redis.call('HINCRBY', KEYS[2], 'engine_images', 1)
        if batch_size and batch_size > 0 then redis.call('HINCRBYFLOAT', KEYS[2], 'batches', 1 / batch_size) end
      end
      local last = tonumber(redis.call('HGET', KEYS[2], 'last_done') or '0')
      if tonumber(now) > last then redis.call('HSET', KEYS[2], 'last_done', now) end
    end
    if st == 'failed' then redis.call('ZADD', KEYS[3], now, id)
    elseif ost == 'failed' then redis.call('ZREM', KEYS[3], id) end
    if mode ~= 'update' then opened = true end
  end
end
if opened then redis.call('HDEL', KEYS[4], 'archived') end
-- the part's number is taken: a counter that lost it (a failover) must not hand it out again
if part ~= '' and tonumber(part) > tonumber(redis.call('HGET', KEYS[4], 'parts') or '0') then
  redis.call('HSET', KEYS[4], 'parts', part)
end
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('EXPIRE', KEYS[2], ttl)
redis.call('EXPIRE', KEYS[4], ttl)
if redis.call('EXISTS', KEYS[3]) == 1 then redis.call('EXPIRE', KEYS[3], ttl) end
return out
"""

# KEYS: images hash, counts hash, failed zset, meta hash, finishing flag, feed hash, the events
# hash and their due zset (ocrq.jobs.events). ARGV: the job's total when its export began, the job's
# name, now. A job with a webhook (its meta's ``webhook``) archived for the first time since
# its last new work gets its terminal event (job.completed / job.failed: some images failed /
# job.cancelled; batch.completed / batch.cancelled) in the outbox.
# Archives the job when it is finished and its export was asked for since its last new work
# (submit and reprocess clear the flag), and the export covers every image: the per-image keys
# and its submissions go (UNLINK: freed off Redis's main thread),
# meta and counts stay. -1: images came in while the export ran without a submission (a chunk
# whose records Redis lost, redelivered): that export is stale.
_ARCHIVE_LUA = """
local c = redis.call('HMGET', KEYS[2], 'total', 'done', 'failed', 'cancelled')
local total, done, failed = tonumber(c[1] or '0'), tonumber(c[2] or '0'), tonumber(c[3] or '0')
local cancelled = tonumber(c[4] or '0')
if done + failed + cancelled < total or redis.call('EXISTS', KEYS[5]) == 0 then return 0 end
if total ~= tonumber(ARGV[1]) then return -1 end
local first = redis.call('HEXISTS', KEYS[4], 'archived') == 0
redis.call('HSET', KEYS[4], 'archived', '1')
redis.call('UNLINK', KEYS[1], KEYS[3], KEYS[6])
local url = redis.call('HGET', KEYS[4], 'webhook')
if first and url then
  -- the job's terminal event, in the outbox (ocrq.jobs.events) in the same step as its state
  local n = redis.call('HINCRBY', KEYS[4], 'terminal', 1)
  local kind = 'job'
  local object = redis.call('HGET', KEYS[4], 'object')
  if object and cjson.decode(object) == 'batch' then kind = 'batch' end
  local what = 'completed'
  if redis.call('HEXISTS', KEYS[4], 'cancelled') == 1 then what = 'cancelled'
  elseif failed > 0 and kind == 'job' then what = 'failed' end
  local id = ARGV[2] .. '#' .. n
  redis.call('HSET', KEYS[7], id, cjson.encode({id = id, type = kind .. '.' .. what, job = ARGV[2],
    url = cjson.decode(url), created = tonumber(ARGV[3]), attempts = 0}))
  redis.call('ZADD', KEYS[8], ARGV[3], id)
end
return 1
"""

# KEYS: counts hash. ARGV: store puts, gets.
_ADD_REQUESTS_LUA = """
redis.call('HINCRBY', KEYS[1], 'store_puts', ARGV[1])
redis.call('HINCRBY', KEYS[1], 'store_gets', ARGV[2])
return 1
"""

# KEYS: job meta hash. ARGV: a new epoch (JSON), ttl. The job's epoch (kept if set) and its next
# part number (ocrq.output.parts).
_NEW_PART_LUA = """
redis.call('HSETNX', KEYS[1], 'epoch', ARGV[1])
local n = redis.call('HINCRBY', KEYS[1], 'parts', 1)
if redis.call('TTL', KEYS[1]) < 0 then redis.call('EXPIRE', KEYS[1], ARGV[2]) end
return {redis.call('HGET', KEYS[1], 'epoch'), n}
"""

# KEYS: images hash, counts hash, meta hash. ARGV: image ids. A cancelled job's images that
# have not started become "x" (cancelled): queued ones (in a message or not) and retrying ones
# (their retry message is skipped when it comes); running and final ones are left as they are.
# Returns how many were cancelled.
_CANCEL_LUA = """
if redis.call('HEXISTS', KEYS[3], 'cancelled') == 0 then return 0 end
local n = 0
for i = 1, #ARGV do
  local v = redis.call('HGET', KEYS[1], ARGV[i])
  if v then
    local head = string.sub(v, 1, 1)
    local was = false
    if head == 'q' then was = 'queued'
    elseif head == 'p' then
      was = 'queued'
      redis.call('HINCRBY', KEYS[2], 'published', -1)
    elseif head == '{' then
      local st = cjson.decode(v)['status']
      if st == 'retrying' or st == 'queued' then was = st end
    end
    if was then
      redis.call('HSET', KEYS[1], ARGV[i], 'x')
      redis.call('HINCRBY', KEYS[2], was, -1)
      redis.call('HINCRBY', KEYS[2], 'cancelled', 1)
      n = n + 1
    end
  end
end
return n
"""

_BATCH = 500
#: image ids per call of the cancel script
_CANCEL_BATCH = 1000
_IN_WORK = (ImageStatus.running, ImageStatus.retrying)
#: what a marker says (the record Lua's ``marks``)
MARKS = {"d": ImageStatus.done, "c": ImageStatus.done, "f": ImageStatus.failed, "p": ImageStatus.queued,
         "q": ImageStatus.queued, "x": ImageStatus.cancelled}
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
        self._script = redis.register_script(_RECORD_LUA)
        # the workers' updates finish accepted work: they run past maxmemory (ocrq.broker.scripts)
        self._update = PastMaxmemory(redis, _RECORD_LUA)
        # archiving frees a finished job's per-image keys: past maxmemory too
        self._archive = PastMaxmemory(redis, _ARCHIVE_LUA)
        self._new_part = PastMaxmemory(redis, _NEW_PART_LUA)
        # cancelling finishes accepted work (it only shrinks what is left): past maxmemory too
        self._cancel = PastMaxmemory(redis, _CANCEL_LUA)
        self._add_requests = PastMaxmemory(redis, _ADD_REQUESTS_LUA)

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
            if value[:1] in (b"q", b"p", b"{"):
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
        return [ImageRecord.model_validate_json(r) if r and r[:1] == b"{" else None for r in self.raw(job, ids)]

    def raw(self, job: str, ids: Iterable[str]) -> list[bytes | None]:
        """What Redis holds for each image: a marker (``MARKS``: b"q3", b"p", b"d", b"c", b"f"),
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

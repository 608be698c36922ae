"""The job index in Redis: per-image records, exact status counts, the failed registry.

All writes go through one Lua script so a batch of records is one round trip and the counts
stay exact under redelivery (a record only moves the counters when its status changes), and so
a final ``done`` is never overwritten by a stale redelivery. Keys: see ``ocrq.keys``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from ocrq import keys
from ocrq.results import ImageRecord, ImageStatus

# KEYS: images hash, counts hash, failed zset, job meta hash
# ARGV: now, ttl, mode ("submit" | "update" | "force"), job, then (id, status, cached, doc) quads.
# Returns one flag per item: 1 = written (or, for submit, needs publishing), 0 = left alone.
_RECORD_LUA = """
local now, ttl, mode, job = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local out = {}
for i = 5, #ARGV, 4 do
  local id, st, cached, doc = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local old = redis.call('HGET', KEYS[1], id)
  local ost, ocached = false, false
  if old then
    local o = cjson.decode(old)
    ost = o['status']
    ocached = o['cached'] == true
  end
  local write = true
  if mode == 'submit' then
    -- a re-submission never resets an existing record; unfinished ones are re-published
    write = (old == false)
    out[#out + 1] = ((old == false) or (ost ~= 'done' and ost ~= 'failed')) and 1 or 0
  else
    if mode == 'update' and ost == 'done' and st ~= 'done' then write = false end
    out[#out + 1] = write and 1 or 0
  end
  if write then
    redis.call('HSET', KEYS[1], id, doc)
    if ost then redis.call('HINCRBY', KEYS[2], ost, -1) end
    redis.call('HINCRBY', KEYS[2], st, 1)
    if ost == 'done' and ocached then redis.call('HINCRBY', KEYS[2], 'cached', -1) end
    if st == 'done' and cached == '1' then redis.call('HINCRBY', KEYS[2], 'cached', 1) end
    local member = job .. '/' .. id
    if st == 'failed' then redis.call('ZADD', KEYS[3], now, member)
    elseif ost == 'failed' then redis.call('ZREM', KEYS[3], member) end
  end
end
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('EXPIRE', KEYS[2], ttl)
redis.call('EXPIRE', KEYS[4], ttl)
return out
"""

_BATCH = 500


class JobIndex:
    def __init__(self, redis: Any, ttl: int) -> None:
        self.redis = redis
        self.ttl = ttl
        self._script = redis.register_script(_RECORD_LUA)

    # --- writes ----------------------------------------------------------------------------

    def create(self, job: str, meta: dict[str, Any]) -> None:
        pipe = self.redis.pipeline()
        pipe.zadd(keys.JOBS, {job: time.time()}, nx=True)
        pipe.hsetnx(keys.job(job), "created", time.time())
        pipe.hset(keys.job(job), mapping={k: json.dumps(v) for k, v in meta.items()})
        pipe.expire(keys.job(job), self.ttl)
        pipe.execute()

    def record(self, records: Sequence[ImageRecord], mode: str = "update") -> list[bool]:
        """Write records (all of one job per call is typical, but not required)."""
        flags: list[bool] = []
        by_job: dict[str, list[ImageRecord]] = {}
        for rec in records:
            by_job.setdefault(rec.job, []).append(rec)
        now = time.time()
        for job, recs in by_job.items():
            for start in range(0, len(recs), _BATCH):
                argv: list[Any] = [now, self.ttl, mode, job]
                for rec in recs[start:start + _BATCH]:
                    rec.updated = now
                    argv += [rec.id, rec.status.value, "1" if rec.cached else "0",
                             rec.model_dump_json(exclude_none=True)]
                res = self._script(
                    keys=[keys.job_images(job), keys.job_counts(job), keys.FAILED, keys.job(job)],
                    args=argv,
                )
                flags += [bool(x) for x in res]
        return flags

    # --- reads -----------------------------------------------------------------------------

    def exists(self, job: str) -> bool:
        return bool(self.redis.exists(keys.job(job)))

    def meta(self, job: str) -> dict[str, Any]:
        raw = self.redis.hgetall(keys.job(job))
        return {k.decode(): json.loads(v) for k, v in raw.items()}

    def counts(self, job: str) -> dict[str, int]:
        pipe = self.redis.pipeline()
        pipe.hgetall(keys.job_counts(job))
        pipe.hlen(keys.job_images(job))
        raw, total = pipe.execute()
        counts = {s.value: 0 for s in ImageStatus}
        counts.update({k.decode(): int(v) for k, v in raw.items()})
        counts["cached"] = counts.get("cached", 0)
        counts["total"] = int(total)
        return counts

    def get(self, job: str, ids: Iterable[str]) -> list[ImageRecord | None]:
        ids = list(ids)
        if not ids:
            return []
        raw = self.redis.hmget(keys.job_images(job), ids)
        return [ImageRecord.model_validate_json(r) if r else None for r in raw]

    def scan(self, job: str, count: int = 1000) -> Iterator[ImageRecord]:
        for _, raw in self.redis.hscan_iter(keys.job_images(job), count=count):
            yield ImageRecord.model_validate_json(raw)

    def jobs(self) -> list[str]:
        return [j.decode() for j in self.redis.zrange(keys.JOBS, 0, -1)]

    def failed(self, job: str | None = None, limit: int = 100_000) -> list[tuple[str, str]]:
        """(job, image id) pairs in the failed registry, oldest first."""
        out = []
        for member in self.redis.zrange(keys.FAILED, 0, limit - 1):
            j, _, image = member.decode().partition("/")
            if job is None or j == job:
                out.append((j, image))
        return out

"""The webhook outbox: a job's terminal event is recorded where its state is, and delivery retries
from that record until a receiver acknowledges it.

A job with a webhook URL (its meta's ``webhook``, set by the API) gets its terminal event in the
same Lua step that archives it (``JobIndex.archive``): ``keys.EVENTS`` holds the event, and
``keys.EVENTS_DUE`` when its next attempt is due. A deliverer (every ``ocrq serve`` replica runs
one: ``api.webhooks``) claims due events by moving their next attempt a claim window ahead in one script, so two
replicas never send one event at once and a deliverer killed mid-attempt only delays the event
by that window: it is sent again (at least once; receivers dedupe on ``webhook-id``). Each attempt
is listed in the job's deliveries (``keys.job_deliveries``); a delivered event, or one whose
retries ran out, leaves the outbox.

Redis holds one event per job that finished and was not yet delivered (a few hundred bytes),
plus at most ``keys.DELIVERIES_KEPT`` attempts per job.
"""

from __future__ import annotations

import json
import time
from typing import Any

from ocrq import keys
from ocrq.broker.scripts import PastMaxmemory


class Outbox:
    """The pending webhook events, as deliverers see them."""

    def __init__(self, redis: Any, job_ttl: int) -> None:
        self.redis = redis
        self.job_ttl = job_ttl
        self._claim = PastMaxmemory(redis, "events_claim")

    def claim(self, hold_s: float, limit: int = 32, now: float | None = None) -> list[dict[str, Any]]:
        """Due events, each now held for ``hold_s`` (sent again after it, unless settled)."""
        raw = self._claim(keys=[keys.EVENTS, keys.EVENTS_DUE],
                          args=[time.time() if now is None else now, hold_s, limit])
        return [json.loads(raw[i + 1]) for i in range(0, len(raw), 2)]

    def add(self, job: str, kind: str, url: str, now: float | None = None) -> dict[str, Any]:
        """An event recorded by a caller rather than the archive (a batch that failed validation:
        it never ran, so nothing archives it)."""
        now = time.time() if now is None else now
        event = {"id": f"{job}#{kind}", "type": kind, "job": job, "url": url, "created": now, "attempts": 0}
        pipe = self.redis.pipeline()
        pipe.hsetnx(keys.EVENTS, event["id"], json.dumps(event, separators=(",", ":")))
        pipe.zadd(keys.EVENTS_DUE, {event["id"]: now}, nx=True)
        pipe.execute()
        return event

    def save(self, event: dict[str, Any]) -> None:
        """The event as it is now (its payload built, its attempts counted)."""
        self.redis.hset(keys.EVENTS, event["id"], json.dumps(event, separators=(",", ":")))

    def settle(self, event: dict[str, Any], next_at: float | None) -> None:
        """Delivered or given up (``next_at`` None): it leaves the outbox; else due again then."""
        pipe = self.redis.pipeline()
        if next_at is None:
            pipe.hdel(keys.EVENTS, event["id"])
            pipe.zrem(keys.EVENTS_DUE, event["id"])
        else:
            pipe.hset(keys.EVENTS, event["id"], json.dumps(event, separators=(",", ":")))
            pipe.zadd(keys.EVENTS_DUE, {event["id"]: next_at})
        pipe.execute()

    def record_attempt(self, job: str, attempt: dict[str, Any]) -> None:
        key = keys.job_deliveries(job)
        pipe = self.redis.pipeline()
        pipe.lpush(key, json.dumps(attempt, separators=(",", ":")))
        pipe.ltrim(key, 0, keys.DELIVERIES_KEPT - 1)
        pipe.expire(key, self.job_ttl)
        pipe.execute()

    def deliveries(self, job: str, limit: int = keys.DELIVERIES_KEPT) -> list[dict[str, Any]]:
        """The job's attempts, newest first."""
        return [json.loads(v) for v in self.redis.lrange(keys.job_deliveries(job), 0, limit - 1)]

    def pending(self, job: str | None = None) -> list[dict[str, Any]]:
        """Events not delivered yet (of one job, or all): for pages and tests, not a hot path."""
        found = [json.loads(v) for v in self.redis.hvals(keys.EVENTS)]
        return [e for e in found if job is None or e.get("job") == job]

    def due_at(self, event_id: str) -> float | None:
        score = self.redis.zscore(keys.EVENTS_DUE, event_id)
        return None if score is None else float(score)

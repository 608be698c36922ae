"""What one ``ocrq serve`` process holds: the settings, a producer client, the tenants, and the
per-request checks (who is asking, how fast, how much in flight). Nothing here is state another
replica lacks: every answer is read from Redis and the store, so any number of replicas behind a
load balancer give the same answers."""

from __future__ import annotations

import time
from typing import Any

from api.tenants import Tenant, Tenants
from ocrq import keys, names
from ocrq.jobs.index import settled
from ocrq.settings import Settings
from producer.client import Client
from producer.errors import RateLimited, UnknownJob

#: seconds a tenant over its images in flight is told to wait
IN_FLIGHT_RETRY_S = 30


class Service:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.client = Client(settings)
        self.tenants = Tenants(settings)

    @property
    def redis(self) -> Any:
        return self.client.redis

    def job_name(self, tenant: Tenant, name: str) -> str:
        """The tenant's job ``name`` as Redis and the store know it (``UnknownJob`` for a name no
        job of any tenant could have: another tenant's job is unknown too, never forbidden)."""
        if not names.job_ok(name):
            raise UnknownJob(name)
        return names.qualify(tenant.name, name)

    def existing(self, tenant: Tenant, name: str) -> str:
        job = self.job_name(tenant, name)
        if not self.client.index.exists(job):
            raise UnknownJob(name)
        return job

    def check_rate(self, tenant: Tenant) -> None:
        """One request of ``tenant`` counted in this second, across replicas (``RateLimited``
        past ``requests_per_s``: a fixed one-second window, a burst of at most one second's worth)."""
        pipe = self.redis.pipeline(transaction=False)
        self.count_request(pipe, tenant)
        self.rate_said(tenant, pipe.execute())

    def count_request(self, pipe: Any, tenant: Tenant) -> None:
        """Queue the request's count on ``pipe`` (a read the request makes anyway: one round trip)."""
        key = keys.rate(tenant.name, int(time.time()))
        pipe.incr(key)
        pipe.expire(key, 2)

    def rate_said(self, tenant: Tenant, answers: list[Any]) -> list[Any]:
        """The answers of a pipeline ``count_request`` began, less its two; ``RateLimited`` when
        the count is past the tenant's rate."""
        n = int(answers[0])
        if n > tenant.settings.requests_per_s:
            now = time.time()
            raise RateLimited(f"more than {tenant.settings.requests_per_s:g} requests a second for tenant "
                              f"{tenant.name}", retry_after=int(now) + 1 - now)
        return answers[2:]

    def check_in_flight(self, tenant: Tenant, adding: int) -> None:
        """``RateLimited`` when the tenant's images not yet final, plus ``adding``, exceed its
        ``max_in_flight`` (its jobs that are final leave the active set as they are met)."""
        cap = tenant.settings.max_in_flight
        active_key = keys.tenant_active(tenant.name)
        jobs = [j.decode() for j in self.redis.smembers(active_key)]
        pipe = self.redis.pipeline(transaction=False)
        for job in jobs:
            pipe.hmget(keys.job_counts(job), "total", "done", "failed", "cancelled")
        left = 0
        done_with: list[str] = []
        for job, raw in zip(jobs, pipe.execute(), strict=True):
            total, done, failed, cancelled = (int(v or 0) for v in raw)
            open_ = total - settled({"done": done, "failed": failed, "cancelled": cancelled})
            if open_ <= 0:
                done_with.append(job)
            left += max(open_, 0)
        if done_with:
            self.redis.srem(active_key, *done_with)
        if left + adding > cap:
            raise RateLimited(f"tenant {tenant.name} has {left:,} images in flight; {adding:,} more would pass its "
                              f"limit of {cap:,} (api.tenants.{tenant.name}.max_in_flight)",
                              retry_after=IN_FLIGHT_RETRY_S)

    def mark_active(self, tenant: Tenant, job: str) -> None:
        self.redis.sadd(keys.tenant_active(tenant.name), job)

    def close(self) -> None:
        self.client.close()

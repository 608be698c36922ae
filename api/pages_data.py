"""What the jobs pages show, read from Redis and the store: a page of a tenant's jobs, one job in
full (its progress over time, failures grouped by error type, export, webhook deliveries).

Cost per request, whatever the number of jobs: the list is one ``ZREVRANGE`` + ``ZCARD`` and one
pipeline of three commands per job shown (``api.views.read_raw``); a state filter reads at most
``SCAN`` jobs. One job is that pipeline for one, its ``_SUCCESS`` marker (one store read, once
exported), at most ``FAILURES_READ`` failure records (one batched store read) and its last
``DELIVERIES_SHOWN`` webhook attempts; what its page polls is the pipeline alone (``job_numbers``).
"""

from __future__ import annotations

import time
from itertools import islice
from typing import Any

from api import pages_format as fmt
from api.service import Service
from api.tenants import Tenant
from api.views import STATES, job_view, job_views, read_raw
from api.views import state as state_of
from ocrq import keys, names
from ocrq.broker import scripts
from ocrq.jobs.events import Outbox
from ocrq.jobs.failed import registered
from ocrq.jobs.index import parse_cost, parse_counts, parse_meta
from ocrq.jobs.progress import BUCKET_S, RawProgress
from ocrq.jobs.progress import parse as parse_progress
from ocrq.redact import redact_text, redact_url
from producer.errors import UnknownJob

#: jobs a page lists
PAGE_SIZE = 50
#: jobs a state filter reads at most per page (a page of them at a time)
SCAN = 2000
#: failure records read to group a job's failures by type (the count of each group is over these)
FAILURES_READ = 200
#: examples shown per error type
EXAMPLES = 3
#: webhook attempts shown
DELIVERIES_SHOWN = 20
#: points a plot draws at most (a longer series is thinned evenly, its ends kept)
MAX_POINTS = 240


def progress_points(svc: Service, job: str, created: float, last_done: float, finished: int, moving: bool,
                    now: float, raw: RawProgress | None = None) -> list[tuple[float, int]]:
    """(epoch second, images finished) of ``job``, oldest first: what its throughput and
    cumulative plots draw. The job's creation, then the end of each 5 s window of its progress
    series (``ocrq.jobs.progress``: the last 10 minutes, images finished per window, image by image),
    counted back from what is finished now; a job with no series (finished more than a day ago)
    has its last image done; and now, while it runs."""
    points = [(created, 0)]
    windows = sorted((raw.windows if raw is not None else {}).items())
    if windows:
        done_before = max(0, finished - sum(n for _, n in windows))
        start = windows[0][0] * BUCKET_S
        if start > created:
            points.append((start, done_before))
        running = done_before
        for window, n in windows:
            running += n
            points.append(((window + 1) * BUCKET_S, running))
    elif finished and last_done > created:
        points.append((last_done, finished))
    if moving and now > points[-1][0]:
        points.append((now, points[-1][1]))
    return points


def series(points: list[tuple[float, int]]) -> dict[str, Any]:
    """What the two plots draw from ``points``: the cumulative line (seconds since the first
    point, images), and the throughput bars (from, to, images a second) between points."""
    if len(points) > MAX_POINTS:
        step = (len(points) - 1) / (MAX_POINTS - 1)
        points = [points[round(i * step)] for i in range(MAX_POINTS)]
    t0 = points[0][0] if points else 0.0
    cumulative = [[round(t - t0, 3), n] for t, n in points]
    bars = []
    for (ta, na), (tb, nb) in zip(points, points[1:], strict=False):
        if tb > ta:
            bars.append([round(ta - t0, 3), round(tb - t0, 3), round(max(nb - na, 0) / (tb - ta), 3)])
    return {"start": t0, "cumulative": cumulative, "rate": bars}


def _start_of(svc: Service, tenant: Tenant, after: str | None) -> int:
    if after is None:
        return 0
    rank = svc.redis.zrevrank(keys.tenant_jobs(tenant.name), svc.job_name(tenant, after)) \
        if names.job_ok(after) else None
    if rank is None:
        raise UnknownJob(after)
    return int(rank) + 1


def jobs_page(svc: Service, tenant: Tenant, state: str | None = None, after: str | None = None,
              limit: int = PAGE_SIZE) -> dict[str, Any]:
    """A page of the tenant's jobs, newest first, from the one after ``after`` (a job id), of
    one ``state`` or any: {rows, total, first (the rank of the first row, 1-based), next (the
    ``after`` of the next page, or None), newer (the ``after`` of the page before: "" for the
    first page, None for none), looked (jobs read, with a filter)}."""
    if state is not None and state not in STATES:
        raise UnknownJob(state, "state")
    start = _start_of(svc, tenant, after)
    key = keys.tenant_jobs(tenant.name)
    pipe = svc.redis.pipeline(transaction=False)
    pipe.zcard(key)
    pipe.zrevrange(key, start, start + (limit if state is None else min(SCAN, 200) - 1))
    if state is None and start > limit:
        pipe.zrevrange(key, start - limit - 1, start - limit - 1)
    out = pipe.execute()
    total, batch = int(out[0]), [j.decode() for j in out[1]]
    newer: str | None = None
    if state is None and start:
        newer = names.split(out[2][0].decode())[1] if start > limit and out[2] else ""
    now = time.time()
    location = svc.client.store.location
    if state is None:
        views = _views(svc, batch[:limit], location)
        more = len(batch) > limit
        page = {"rows": [fmt.row(v, now) for v in views], "total": total, "first": start + 1, "newer": newer,
                "next": views[-1]["id"] if more and views else None, "looked": len(batch[:limit])}
        return {**page, "summary": fmt.jobs_summary(page, None)}
    found: list[str] = []
    looked, last = 0, ""
    while batch:
        for job, job_state in zip(batch, states_of(svc.redis, batch), strict=True):
            looked += 1
            last = job
            if job_state == state:
                found.append(job)
                if len(found) == limit:
                    break
        if len(found) >= limit or looked >= SCAN or start + looked >= total:
            break
        batch = [j.decode() for j in svc.redis.zrevrange(key, start + looked, start + looked + 199)]
    more = start + looked < total
    views = _views(svc, found, location)
    page = {"rows": [fmt.row(v, now) for v in views], "total": total, "first": start + 1, "newer": None,
            "next": names.split(last)[1] if more and looked else None, "looked": looked}
    return {**page, "summary": fmt.jobs_summary(page, state)}


#: the counts a job's state is made of (``api.views.state``)
_STATE_COUNTS = ("total", "done", "failed", "cancelled", "running", "retrying")


def states_of(redis: Any, jobs: list[str]) -> list[str | None]:
    """The state of each job (None for one gone): a state filter reads many jobs to fill a page,
    and shows only those that match."""
    if not jobs:
        return []
    keys_ = [k for job in jobs for k in (keys.job(job), keys.job_counts(job), keys.job_submitting(job))]
    found: list[str | None] = []
    for raw in scripts.plain(redis, "job_states")(keys=keys_):
        f = raw.decode().split(",")
        if f[2] == "0":  # no meta: expired, or never made
            found.append(None)
            continue
        counts = {k: int(v) for k, v in zip(_STATE_COUNTS, f[3:9], strict=True)}
        meta = {k: True for k, v in (("archived", f[0]), ("cancelled", f[1])) if v == "1"}
        found.append(state_of(counts, meta, f[9] == "1"))
    return found


def _views_or_none(svc: Service, jobs: list[str], location: str) -> list[dict[str, Any] | None]:
    return job_views(svc.redis, svc.settings, jobs, location)


def _views(svc: Service, jobs: list[str], location: str) -> list[dict[str, Any]]:
    return [v for v in _views_or_none(svc, jobs, location) if v is not None]


def job_numbers(svc: Service, tenant: Tenant, name: str, now: float | None = None) -> dict[str, Any]:
    """What a job's page polls: its view, its plots' series and the key of its other parts (one
    pipeline and an ``LLEN``: no store read), ``UnknownJob`` for another tenant's job too."""
    job = svc.job_name(tenant, name)
    ((raw_meta, raw_counts, submitting, raw_progress),) = read_raw(svc.redis, [job])
    if not raw_meta:
        raise UnknownJob(name)
    meta, counts, cost = parse_meta(raw_meta), parse_counts(raw_counts), parse_cost(raw_counts)
    now = time.time() if now is None else now
    progress = parse_progress(raw_progress)
    view = job_view(svc.settings, job, meta, counts, cost, submitting, svc.client.store.location, progress)
    moving = view["state"] in fmt.MOVING
    finished = round(view["progress"] * counts["total"]) - counts.get("cancelled", 0)
    points = progress_points(svc, job, float(meta.get("created") or 0), cost["last_done"], max(finished, 0),
                             moving, now, progress)
    return {"job": job, "meta": meta, "view": view, "row": fmt.row(view, now), "moving": moving,
            "series": series(points), "sections": sections_key(svc, job, view)}


def job_page(svc: Service, tenant: Tenant, name: str, now: float | None = None) -> dict[str, Any]:
    """One job of the tenant, as its page shows it: ``job_numbers`` and its failures by type,
    export marker and webhook deliveries."""
    page = job_numbers(svc, tenant, name, now)
    job, view = page["job"], page["view"]
    deliveries = Outbox(svc.redis, svc.settings.redis.job_ttl)
    page.update({
        "deliveries": deliveries.deliveries(job, DELIVERIES_SHOWN),
        # (an event's URL and body stay out: the attempts carry the URL redacted)
        "pending": [{k: e.get(k) for k in ("id", "type", "attempts", "created")} for e in deliveries.pending(job)]
        if page["meta"].get("webhook") else [],
        "marker": _marker(svc, job) if view["export"]["written"] else None,
        "failures": failure_groups(svc, job, view["counts"]["failed"]),
    })
    return page


def sections_key(svc: Service, job: str, view: dict[str, Any]) -> str:
    """Changes when the parts of a job's page that the live numbers do not carry change (its
    failures, export, webhook attempts, buttons): the page then fetches them again."""
    attempts = svc.redis.llen(keys.job_deliveries(job))
    c = view["counts"]
    return f"{view['state']}:{c['failed']}:{c['cancelled']}:{view['export']['written']}:{attempts}"


def _marker(svc: Service, job: str) -> dict[str, Any] | None:
    doc = svc.client.store.get_json(keys.export_object(job, keys.EXPORT_SUCCESS))
    return doc if isinstance(doc, dict) else None


def failure_groups(svc: Service, job: str, failed: int, read: int = FAILURES_READ) -> dict[str, Any]:
    """The job's failures by error type: {groups: [{type, count, retryable, examples}], read,
    total}. At most ``read`` records are read (oldest first): with more failures than that, the
    counts are over those."""
    if failed <= 0:
        return {"groups": [], "read": 0, "total": 0}
    index, store = svc.client.index, svc.client.store
    records: list[tuple[dict[str, Any], float]] = []
    if index.archived(job):  # the store's mirror is its registry: a batch of its first objects
        paths = list(islice(store.list(f"{keys.FAILED_OBJECTS}{job}/"), read))
        for doc in store.get_many(paths).values():
            if isinstance(doc, dict) and isinstance(doc.get("record"), dict):
                records.append((doc["record"], float(doc.get("failed_at") or 0)))
    else:
        for f in registered(index, store, job, limit=read):
            records.append((f.record.model_dump(mode="json"), f.failed_at))
    groups: dict[str, dict[str, Any]] = {}
    for rec, failed_at in sorted(records, key=lambda r: r[1]):
        error = rec.get("error") or {}
        kind = str(error.get("type") or "failed")
        group = groups.setdefault(kind, {"type": kind, "count": 0, "retryable": bool(error.get("retryable")),
                                         "examples": []})
        group["count"] += 1
        if len(group["examples"]) < EXAMPLES:
            group["examples"].append({
                "id": str(rec.get("id", "")), "ref": redact_url(str(rec.get("ref", "")))[:300],
                "message": redact_text(str(error.get("message") or ""))[:300],
                "attempts": int(rec.get("attempts") or 0), "failed_at": failed_at})
    ordered = sorted(groups.values(), key=lambda g: (-g["count"], g["type"]))
    return {"groups": ordered, "read": len(records), "total": failed}


def live_job(page: dict[str, Any]) -> dict[str, Any]:
    """The small JSON the job's page polls (from ``job_numbers``): its numbers, plots and the key
    of its other parts."""
    view = page["view"]
    counts = view["counts"]
    cells = {k: fmt.count(v) for k, v in counts.items()}
    cells.update(state=view["state"], rate=fmt.rate(view["images_per_second"]),
                 eta=fmt.duration(view["eta_seconds"]) if page["moving"] else "–",
                 usd=fmt.usd(view["cost"]["usd"]), engine_s=f"{view['cost']['engine_seconds']:,.1f} s",
                 usd_1000=fmt.usd(view["cost"]["usd_per_1000_images"]), age=fmt.age(view["created_at"]),
                 finished=fmt.clock(view["finished_at"]))
    return {"id": view["id"], "state": view["state"], "moving": page["moving"], "cells": cells,
            "progress": page["row"]["progress"], "series": page["series"], "sections": page["sections"]}

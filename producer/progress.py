"""How far a job is and how fast it goes: counts, images per second now, an ETA and the
throughput over the last minutes, for the command line, the HTTP API and a jobs page alike.

    p = job_progress(client.redis, client.index, "invoices")
    p.finished, p.total, p.img_per_s, p.eta_s, p.series    # p.as_dict(): the same as JSON

The counts are the job index's (exact, moving a chunk at a time); ``finished`` adds what the
workers' engines finished since their chunks were last recorded (``ocrq.jobs.progress``: display
only), so it moves image by image. The rate is over the last ``RATE_WINDOW_S`` seconds of the
series. Three round trips (counts, meta, progress), whatever the job's size.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ocrq.jobs.index import JobIndex, settled
from ocrq.jobs.progress import BUCKET_S, BUCKETS, RawProgress, read, window_of

#: the rate "now" is the images finished over about this many seconds
RATE_WINDOW_S = 10.0


@dataclass(frozen=True)
class JobProgress:
    job: str
    #: the job index's counts: images per status, ``total``, ``cached``
    counts: dict[str, int]
    #: images final, plus those the engine finished since their chunk was last recorded (≤ total)
    finished: int
    #: images finished per second over the last ``RATE_WINDOW_S`` (0 when none)
    img_per_s: float
    #: seconds until every image is final at that rate (0: finished; None: no rate yet)
    eta_s: float | None
    #: seconds since the job was created (to its last result once finished)
    elapsed_s: float
    #: images final per second over ``elapsed_s`` (the job's average; 0 before any)
    avg_img_per_s: float = 0.0
    #: (window start, epoch s; images per second in it), oldest first: the last ``BUCKETS``
    #: windows of ``BUCKET_S`` seconds up to the newest finished image
    series: list[tuple[float, float]] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.counts.get("total", 0)

    @property
    def final(self) -> int:
        return settled(self.counts)

    @property
    def complete(self) -> bool:
        return self.final >= self.total

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["series"] = [[start, round(rate, 3)] for start, rate in self.series]
        out["img_per_s"] = round(self.img_per_s, 3)
        out["eta_s"] = None if self.eta_s is None else round(self.eta_s, 1)
        out["elapsed_s"] = round(self.elapsed_s, 1)
        out["avg_img_per_s"] = round(self.avg_img_per_s, 3)
        return out


def job_progress(redis: Any, index: JobIndex, job: str, now: float | None = None) -> JobProgress:
    counts = index.counts(job)
    meta = index.meta(job)
    cost = index.cost(job)
    return summarise(job, counts, read(redis, job), float(meta.get("created") or 0.0),
                     int(cost.get("engine_images", 0)), cost.get("last_done") or None, now)


def summarise(job: str, counts: dict[str, int], raw: RawProgress, created: float, engine_recorded: int,
              last_done: float | None = None, now: float | None = None) -> JobProgress:
    """The progress of a job from its counts and its progress hash (pure: ``now`` given)."""
    now = time.time() if now is None else now
    total = counts.get("total", 0)
    final = settled(counts)
    # the engine's images not yet in a record: finished, their chunk not stored yet
    ahead = max(0, raw.engine - engine_recorded)
    finished = min(total, final + ahead) if final < total else total
    rate = rate_now(raw.windows, now, created)
    remaining = total - finished
    eta = 0.0 if remaining <= 0 else (remaining / rate if rate > 0 else None)
    end = (last_done or now) if final >= total and total else now
    elapsed = max(0.0, end - created) if created else 0.0
    return JobProgress(job, counts, finished, rate, eta, elapsed, final / elapsed if elapsed > 0 else 0.0,
                       series(raw.windows, now))


def rate_now(windows: dict[int, int], now: float, since: float = 0.0) -> float:
    """Images per second over the last ``RATE_WINDOW_S`` (the current window counted as far as
    it went), or since ``since`` when the job is younger than that."""
    current = window_of(now)
    first = current - int(RATE_WINDOW_S // BUCKET_S)
    images = sum(n for w, n in windows.items() if first <= w <= current)
    start = max(first * BUCKET_S, since) if since else first * BUCKET_S
    seconds = max(now - start, 1.0)
    return images / seconds


def series(windows: dict[int, int], now: float) -> list[tuple[float, float]]:
    """Images per second per window, oldest first, gaps as zeros, up to the newest window with
    images (at most ``BUCKETS`` windows back from now)."""
    if not windows:
        return []
    current = window_of(now)
    recent = [w for w in windows if current - BUCKETS < w <= current]
    if not recent:
        return []
    return [(float(w * BUCKET_S), windows.get(w, 0) / BUCKET_S) for w in range(min(recent), max(recent) + 1)]

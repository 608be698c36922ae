"""A job's progress between its chunk records: what workers bump, what readers get back.

A chunk's images are recorded together once its result part is stored (64 at a time, written
before the ack), so the job index's counts move in chunk-sized steps. For a person watching a
job, each worker also counts the images its engine finishes as they finish, and the cache hits
and failures as their chunk is recorded, into one small hash per job (``keys.job_progress``):

    engine   images the engine finished, every page of them (a retried image counts again)
    t{n}     images finished in the ``BUCKET_S``-second window n (epoch seconds // BUCKET_S)

Display only: the counts stay the job index's (exact, ``ocrq.jobs.index``); this hash says how far
the engine got since the last record, and how fast. The same script notes in the job's meta
which engine kinds ran the job and on what (``engine:{kind}`` → "cpu" | "gpu"), so its cost is
named by what was measured (``ocrq.jobs.cost``).

Bounds: at most ``BUCKETS`` windows (the last 10 minutes) plus one counter per job, a few KB;
the hash expires ``TTL_S`` after the job's last progress. A worker writes it at most twice a
second per job it has news for (``worker.progress``), never per image.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ocrq import keys
from ocrq.broker import scripts

#: seconds per window of the throughput series
BUCKET_S = 5
#: windows kept per job (the newest: BUCKET_S × BUCKETS seconds of history)
BUCKETS = 120
#: the hash outlives the job's last progress by this long
TTL_S = 24 * 3600


def window_of(epoch_s: float) -> int:
    return int(epoch_s // BUCKET_S)


def engine_field(kind: str) -> str:
    """The job meta field naming an engine kind that ran the job (its value: the device)."""
    return f"engine:{kind}"


class ProgressScript:
    """The bump, registered once per client."""

    def __init__(self, redis: Any) -> None:
        self._script = scripts.plain(redis, "progress_bump")

    def bump(self, job: str, epoch_s: float, engine: int, finished: int, kind: str, device: str,
             client: Any = None) -> None:
        self._script(keys=[keys.job_progress(job), keys.job(job)],
                     args=[window_of(epoch_s), engine, finished, BUCKETS, TTL_S, engine_field(kind),
                           json.dumps(device)], client=client)


@dataclass(frozen=True)
class RawProgress:
    """What the hash holds for one job."""

    engine: int = 0
    #: window number -> images finished in it
    windows: dict[int, int] = field(default_factory=dict)


def read(redis: Any, job: str) -> RawProgress:
    """One ``HGETALL``: the job's engine count and throughput windows."""
    return parse(redis.hgetall(keys.job_progress(job)))


def parse(raw: dict[Any, Any]) -> RawProgress:
    engine = 0
    windows: dict[int, int] = {}
    for k, v in raw.items():
        name = k.decode() if isinstance(k, bytes) else str(k)
        try:
            n = int(v)
            if name == "engine":
                engine = n
            elif name.startswith("t"):
                windows[int(name[1:])] = n
        except ValueError:
            continue  # not ours: ignored
    return RawProgress(engine, windows)


def engines(meta: dict[str, Any]) -> dict[str, str]:
    """The engine kinds that ran a job, with their device ("cpu" | "gpu"), from its meta."""
    return {k[len("engine:"):]: str(v) for k, v in meta.items() if k.startswith("engine:")}

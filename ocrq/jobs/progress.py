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

#: seconds per window of the throughput series
BUCKET_S = 5
#: windows kept per job (the newest: BUCKET_S × BUCKETS seconds of history)
BUCKETS = 120
#: the hash outlives the job's last progress by this long
TTL_S = 24 * 3600

# KEYS[1] progress hash, KEYS[2] job meta. ARGV: window, engine images, images finished (engine
# + recorded hits and failures), windows kept, ttl, meta field, meta value (JSON). Nothing for a
# job without meta (unknown, or its keys expired). A new window drops those older than the kept
# ones (and the oldest beyond the bound, should workers' clocks disagree).
_BUMP_LUA = """
if redis.call('EXISTS', KEYS[2]) == 0 then return 0 end
local window, engine, finished, kept = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if engine > 0 then redis.call('HINCRBY', KEYS[1], 'engine', engine) end
local field = 't' .. window
if finished > 0 then
  if redis.call('HEXISTS', KEYS[1], field) == 0 then
    local windows = {}
    for _, name in ipairs(redis.call('HKEYS', KEYS[1])) do
      local n = string.sub(name, 1, 1) == 't' and tonumber(string.sub(name, 2)) or nil
      if n then
        if n <= window - kept then redis.call('HDEL', KEYS[1], name) else table.insert(windows, n) end
      end
    end
    table.sort(windows)
    for i = 1, #windows - kept + 1 do redis.call('HDEL', KEYS[1], 't' .. windows[i]) end
  end
  redis.call('HINCRBY', KEYS[1], field, finished)
end
redis.call('EXPIRE', KEYS[1], ARGV[5])
redis.call('HSETNX', KEYS[2], ARGV[6], ARGV[7])
return 1
"""


def window_of(epoch_s: float) -> int:
    return int(epoch_s // BUCKET_S)


def engine_field(kind: str) -> str:
    """The job meta field naming an engine kind that ran the job (its value: the device)."""
    return f"engine:{kind}"


class ProgressScript:
    """The bump, registered once per client."""

    def __init__(self, redis: Any) -> None:
        self._script = redis.register_script(_BUMP_LUA)

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

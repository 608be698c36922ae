"""Every worker feeds: a thread that tops up the queue from the jobs' submission shards
(``ocrq.jobs.feed``) after each chunk this worker finishes (``poke``), and every few seconds for
every job in ``keys.FEEDING`` (a producer that stopped after writing its shards, a worker that
died mid-feed). Feeding a shard is one atomic script: any number of workers may feed at once."""

from __future__ import annotations

import logging
import threading

from ocrq import keys, names
from ocrq.jobs.feed import Feed

log = logging.getLogger("ocrq.feeder")

#: seconds between sweeps of every job being fed
SWEEP_S = 2.0


class Feeder(threading.Thread):
    def __init__(self, feed: Feed, sweep_s: float = SWEEP_S) -> None:
        super().__init__(name="ocrq-feeder", daemon=True)
        self.feed = feed
        self.sweep_s = sweep_s
        self._poked: set[str] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._halt = threading.Event()

    def poke(self, job: str) -> None:
        """A chunk of ``job`` finished here: room in its window, perhaps."""
        with self._lock:
            self._poked.add(job)
        self._wake.set()

    def run(self) -> None:
        while not self._halt.is_set():
            swept = not self._wake.wait(self.sweep_s)
            self._wake.clear()
            with self._lock:
                jobs, self._poked = self._poked, set()
            try:
                if swept or not jobs:
                    jobs |= self._feeding()
                for job in sorted(jobs):
                    self.feed.top_up(job)
            except Exception:  # Redis or the store away: the next sweep tries again
                log.warning("feeding failed", exc_info=True)
                self._halt.wait(1.0)

    def _feeding(self) -> set[str]:
        """The jobs being fed; a member that is no job name ocrq writes (not a producer's) is
        removed, never read (its shards' paths would be built from it)."""
        jobs = set()
        for raw in self.feed.redis.smembers(keys.FEEDING):
            job = raw.decode(errors="replace")
            if names.qualified_ok(job):
                jobs.add(job)
            else:
                log.warning("! %s in %s is no job name ocrq writes: removed", names.shown(job), keys.FEEDING)
                self.feed.redis.srem(keys.FEEDING, raw)
        return jobs

    def stop(self) -> None:
        self._halt.set()
        self._wake.set()
        self.join(10)

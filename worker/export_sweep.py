"""Finished jobs without their export, asked for again: a job that is final always gets its export
and its archive, however long Redis refused writes or stayed away when its last image ended.

The export is asked for by the chunk that finishes the job (``ocrq.output.export.request_export``). That
one request can fail (Redis away at that moment, the worker killed between its records and the
request), and no later chunk would ask again: an ETL sensor waiting for ``_SUCCESS`` would wait
forever. So every ``redis.export_sweep_s`` one worker of the fleet (``keys.EXPORT_SWEEP``, SET NX
past maxmemory) reads every job of ``keys.JOBS`` and, for each that is not archived, not being
submitted and finished (done + failed = total), asks for its export when nobody did
(no ``finishing`` flag) or when the request is ``redis.export_stale_s`` old (a finish message lost
with a killed worker, or one that gave up through a long outage). A job is archived once its
export is written (``JobIndex.archive``), so an exported job is never asked for again; a second
request for one being exported costs a second, identical export.

Cost per sweep: a pipeline of four reads per job in ``ocrq:jobs`` (those created within
``redis.job_ttl``), 1,000 jobs per round trip; the counts of the jobs not archived. Runs in its
own thread, never on the consumer's event loop; any error waits for the next sweep.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any

from ocrq import keys, names
from ocrq.broker.scripts import set_nx
from ocrq.jobs.index import JobIndex
from ocrq.output.export import finished, request_export

log = logging.getLogger("ocrq.export_sweep")

#: jobs read per round trip
_PAGE = 1000
#: what the warning says when a sweep asked for exports again (the chaos suite counts it)
SWEEP_LOG = "export asked for again"


class ExportSweep:
    """``send(job, task_id, queue)`` publishes a job's finish task."""

    def __init__(self, redis: Any, index: JobIndex, send: Callable[[str, str, str], None], *, interval_s: float,
                 stale_s: float, ttl: int, default_queue: str, owner: str) -> None:
        self.redis = redis
        self.index = index
        self.send = send
        self.interval_s = interval_s
        self.stale_s = stale_s
        self.ttl = ttl
        self.default_queue = default_queue
        self.owner = owner

    def sweep(self, now: float | None = None) -> list[str]:
        """One sweep, if no other worker holds this interval's; the jobs whose export it asked for."""
        now = time.time() if now is None else now
        if not set_nx(self.redis, keys.EXPORT_SWEEP, self.owner, max(1, int(self.interval_s))):
            return []
        asked = []
        for job, stale in self._candidates(now):
            counts = self.index.counts(job)
            if not counts["total"] or not finished(counts):
                continue
            if stale:  # asked for long ago and still not archived: ask again
                self.redis.delete(keys.job_finishing(job))
            queue = str(self.index.meta(job).get("queue") or self.default_queue)
            if request_export(self.redis, self.index, job, self._sender(job, queue), self.ttl):
                asked.append(job)
        if asked:
            log.warning("! %s: %d finished job(s) without it: %s", SWEEP_LOG, len(asked), ", ".join(asked[:20]))
        return asked

    def _sender(self, job: str, queue: str) -> Callable[[str], None]:
        return lambda task_id: self.send(job, task_id, queue)

    def _candidates(self, now: float) -> Iterator[tuple[str, bool]]:
        """(job, whether its request is stale) for the jobs not archived, not being submitted,
        and whose export nobody asked for, or asked for ``stale_s`` ago."""
        jobs = (raw.decode(errors="replace") for raw, _ in self.redis.zscan_iter(keys.JOBS, count=_PAGE))
        while page := [j for j in islice(jobs, _PAGE) if names.qualified_ok(j)]:
            pipe = self.redis.pipeline(transaction=False)
            for job in page:
                pipe.hexists(keys.job(job), "archived")
                pipe.exists(keys.job_submitting(job))
                pipe.get(keys.job_finishing(job))
                pipe.ttl(keys.job_finishing(job))
            answers = pipe.execute()
            for n, job in enumerate(page):
                archived, submitting, flag, flag_ttl = answers[4 * n:4 * n + 4]
                if archived or submitting:
                    continue
                if flag is None:
                    yield job, False
                elif now - _asked_at(flag, flag_ttl, self.ttl, now) >= self.stale_s:
                    yield job, True


def _asked_at(flag: bytes, flag_ttl: int, ttl: int, now: float) -> float:
    """When a job's export was asked for: the flag's value (epoch s), or, for a flag of an older
    version ("1"), from what is left of its TTL."""
    try:
        return float(flag)
    except ValueError:  # (a flag without a TTL: as old as the job's TTL)
        return now - max(0, ttl - int(flag_ttl)) if flag_ttl and flag_ttl > 0 else now - ttl


class ExportSweeper(threading.Thread):
    """``ExportSweep.sweep`` every ``interval_s`` in its own thread."""

    def __init__(self, sweep: ExportSweep) -> None:
        super().__init__(name="ocrq-export-sweep", daemon=True)
        self._sweep = sweep
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self._sweep.interval_s):
            try:
                self._sweep.sweep()
            except Exception:  # Redis away: the next sweep tries again
                log.warning("export sweep failed", exc_info=True)

    def stop(self) -> None:
        self._halt.set()
        self.join(10)

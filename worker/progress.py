"""A worker's per-job progress, counted in memory and flushed to Redis twice a second.

The engine loop finishes images one micro-batch at a time, but a chunk's images are recorded
together once the chunk is stored. For the people following a job (``producer.progress``), the
worker counts each image its engine finished (a done-callback on its pages' futures: a dict
update in the engine loop's thread, nothing more) and each cache hit and failure its chunks
record, and a thread of its own sends what it counted to the job's progress hash
(``ocrq.jobs.progress``): one script call per job with news, every ``interval`` seconds. Redis away:
the counts are dropped (display only), never retried into a backlog.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

from ocrq.jobs.progress import ProgressScript

log = logging.getLogger("ocrq.worker")


class ProgressCounter:
    def __init__(self, redis: Any, kind: str, device: str, interval: float = 0.5) -> None:
        self._redis = redis
        self._script = ProgressScript(redis)
        self._kind = kind
        self._device = device
        self._interval = interval
        self._lock = threading.Lock()
        #: job -> [engine images, images finished]
        self._news: dict[str, list[int]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def engine_done(self, job: str, n: int = 1) -> None:
        """``n`` images of ``job`` came out of the engine (all their pages)."""
        with self._lock:
            news = self._news.setdefault(job, [0, 0])
            news[0] += n
            news[1] += n

    def recorded(self, job: str, n: int) -> None:
        """``n`` images of ``job`` became final without the engine (cache hits, failures)."""
        if n > 0:
            with self._lock:
                self._news.setdefault(job, [0, 0])[1] += n

    def watch(self, job: str, images: Iterable[list[Future[Any]]]) -> None:
        """Count each image (its pages' futures) as the engine finishes all of its pages; an
        image with a page that failed is counted when its chunk records it."""
        for futures in images:
            if futures:
                _when_all(futures, lambda: self.engine_done(job))

    def flush(self) -> None:
        with self._lock:
            news, self._news = self._news, {}
        if not news:
            return
        now = time.time()
        try:
            pipe = self._redis.pipeline(transaction=False)
            for job, (engine, finished) in news.items():
                self._script.bump(job, now, engine, finished, self._kind, self._device, client=pipe)
            pipe.execute()
        except Exception:  # display only: the job index's counts are the record
            log.debug("progress flush failed", exc_info=True)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ocrq-progress", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.flush()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.flush()


def _when_all(futures: list[Future[Any]], then: Any) -> None:
    """Call ``then()`` once every future is done without an exception."""
    left = [len(futures)]
    lock = threading.Lock()

    def one(fut: Future[Any]) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last and all(not f.cancelled() and f.exception() is None for f in futures):
            then()

    for fut in futures:
        fut.add_done_callback(one)

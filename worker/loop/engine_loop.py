"""The engine loop: one thread per engine forms micro-batches from requests that many Celery task
threads submit concurrently, and completes one future per image.

Loop: wait for work → linger up to ``linger_s`` for more (or until the governor says the batch is
full) → ``governor.plan`` picks images by cost → ``engine.infer`` → per-image futures, and the
measured peak / KV pressure go back to the governor.

OOM: the governor shrinks, the batch is bisected and the halves run again, up to ``oom_retries``
levels; a lone image is retried, then downscaled (``worker.loop.oom``). Any other engine error fails
the batch's images with ``classify(exc)`` (retryable ``EngineCrashed``) so Celery retries them.
Every future completes, also on ``stop``.

Images a worker holds but is still fetching and decoding are announced (``expecting``): an idle
engine waits for them, up to ``intake_wait_s``, while the next batch has room for them. Otherwise
the first decoded chunk of a job would run alone and the rest a batch later (``worker.loop.intake``).

An engine that batches continuously (vLLM: ``concurrent_batches`` > 1) gets several micro-batches
in flight at once, each run on its own thread: the governor plans the next one from the room the
running ones leave (``inflight``), so admission, not the engine's queue, decides what runs.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ocrq.errors import EngineCrashed, OcrqError, classify
from ocrq.results import OcrOutput
from worker.engines.base import (
    ConcurrentBatches,
    Engine,
    ImageCost,
    MemorySample,
    OcrRequest,
    RendersAhead,
    ReportsStats,
)
from worker.governor.governor import Governor
from worker.loop.engine_time import EngineTime
from worker.loop.intake import Intake, QueuedImage, settle
from worker.loop.oom import OOM_LOG, OomRecovery, downscale_for_memory, is_oom
from worker.loop.pace import Pace
from worker.memory.costs import usable_free
from worker.memory.nvml import MemoryProbe, NullProbe

__all__ = ["OOM_LOG", "EngineLoop", "Intake", "downscale_for_memory", "is_oom"]


class EngineLoop(OomRecovery):
    def __init__(
        self,
        engine: Engine,
        governor: Governor,
        probe: MemoryProbe | None = None,
        *,
        linger_s: float = 0.02,
        intake_wait_s: float = 0.5,
        oom_retries: int = 3,
        logger: logging.Logger | None = None,
        oom_backoff_s: float = 0.02,
        on_batch: Callable[[int, float], None] | None = None,
    ) -> None:
        self.engine = engine
        self.governor = governor
        self.probe: MemoryProbe = probe if probe is not None else NullProbe()
        self.linger_s = max(0.0, linger_s)
        self.intake_wait_s = max(0.0, intake_wait_s)
        #: images announced (``expecting``) and not yet submitted: still being fetched/decoded
        self._incoming = 0
        #: engine rate and intake latency: the backlog that keeps a fast engine busy
        self.pace = Pace()
        self.oom_retries = max(0, oom_retries)
        self.oom_backoff_s = oom_backoff_s
        self.log = logger or logging.getLogger(__name__)
        self._cond = threading.Condition()
        self._pending: list[QueuedImage] = []
        self._inflight: list[QueuedImage] = []
        #: micro-batches the engine may run at once (1: one batch drains before the next starts)
        self._slots = max(1, int(engine.concurrent_batches or 1)) if isinstance(engine, ConcurrentBatches) else 1
        # the engine's capabilities, looked up once (a protocol check reads every member)
        self._renders: RendersAhead | None = engine if isinstance(engine, RendersAhead) else None
        self._reports: ReportsStats | None = engine if isinstance(engine, ReportsStats) else None
        governor.slots = self._slots
        self._running = 0
        self._time = EngineTime()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stop_deadline = 0.0
        self._paged = False
        self._stats = {"batches": 0, "images": 0, "oom_events": 0, "downscaled": 0,
                       "too_large": 0, "engine_errors": 0, "last_batch_size": 0}
        self._last_batch_s = 0.0
        #: (images, seconds) of every engine call that returned (worker.metrics)
        self._on_batch = on_batch
        # itertools.count is atomic under the GIL; a generator is not (batches run on several threads)
        self._batch_prefix, self._batch_seq = uuid.uuid4().hex[:8], itertools.count(1)

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        with self._cond:
            if self._thread is not None:
                return
            if self._stopping:
                raise RuntimeError("an EngineLoop cannot be restarted after stop()")
            self._thread = threading.Thread(target=self._main, name="ocrq-engine-loop", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop taking work; pending images keep running until ``timeout``, then every future
        still open fails with a retryable ``EngineCrashed`` (Celery retries it elsewhere)."""
        with self._cond:
            if not self._stopping:
                self._stopping = True
                self._stop_deadline = time.monotonic() + timeout
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout + 1.0)
        with self._cond:
            # also what a hung engine still holds: the loop ignores a late result
            leftover = self._pending + self._inflight
            self._pending = []
        for item in leftover:
            settle(item.future, EngineCrashed("engine loop stopped before this image ran"))

    # ---- intake -------------------------------------------------------------------------------

    def submit(self, request: OcrRequest) -> Future[OcrOutput]:
        return self.submit_many([request])[0]

    def submit_many(self, requests: Iterable[OcrRequest]) -> list[Future[OcrOutput]]:
        """Queue images for the engine; costs are computed here, on the caller's thread."""
        items: list[QueuedImage] = []
        futures: list[Future[OcrOutput]] = []
        now = time.monotonic()
        for request in requests:
            future: Future[OcrOutput] = Future()
            futures.append(future)
            try:
                items.append(QueuedImage(request, future, self.engine.cost(request), now))
            except Exception as exc:  # a cost that cannot be computed fails that image only
                settle(future, classify(exc))
        with self._cond:
            if self._stopping:
                for item in items:
                    settle(item.future, EngineCrashed("engine loop is stopping"))
                return futures
            self._pending.extend(items)
            # most urgent first, arrival order within a priority (a stable sort, linear when sorted)
            self._pending.sort(key=lambda it: it.request.priority)
            self._cond.notify_all()
        if self._renders is not None and items:  # CPU-side work ahead of the batch (vLLM: rendering)
            try:
                self._renders.prepare([it.request for it in items])
            except Exception:  # advisory: the batch prepares what is missing itself
                self.log.debug("engine.prepare() failed", exc_info=True)
        return futures

    def expecting(self, images: int) -> Intake:
        """Announce ``images`` the worker holds and is fetching and decoding; close the returned
        ``Intake`` once they are submitted (or turned out to be cache hits or bad)."""
        with self._cond:
            self._incoming += max(0, images)
        return Intake(self._arrived, max(0, images))

    def _arrived(self, images: int, seconds: float) -> None:
        self.pace.intake(seconds)
        with self._cond:
            self._incoming = max(0, self._incoming - images)
            self._cond.notify_all()

    def desired_backlog(self) -> int:
        """Images the worker should hold: the batch running now plus the governor's backlog of
        batches to come, or what must be in intake to keep the engine busy (``worker.loop.pace``:
        engine rate × intake seconds) when that is more. A chunk message stays unacknowledged
        until all its images are done, so the images in flight take up prefetch window too;
        without them, the next chunk arrives only after a batch finishes and the engine waits
        for its fetch and decode."""
        with self._cond:
            running = len(self._inflight)
        return running + max(self.governor.desired_backlog(), self.pace.backlog())

    def state(self) -> dict[str, Any]:
        with self._cond:
            loop: dict[str, Any] = {**self._stats, "pending": len(self._pending), "inflight": len(self._inflight),
                    "batches_in_flight": self._running, "last_batch_s": round(self._last_batch_s, 4),
                    "idle_s": round(self._time.idle_s, 3), "incoming": self._incoming, **self.pace.state()}
        if self._paged:  # vLLM's own gauges: what admission control steers by
            sample = self._memory()
            loop.update(kv_usage=sample.kv_usage, waiting=sample.waiting, preemptions=sample.preemptions)
        if self._reports is not None:
            try:
                loop["engine"] = dict(self._reports.stats())
            except Exception:
                self.log.debug("engine.stats() failed", exc_info=True)
        return {**self.governor.state(), "token_capacity": self.governor.token_capacity, **loop}

    # ---- the loop -----------------------------------------------------------------------------

    def _main(self) -> None:
        # slots + 1: the extra one is an urgent job's (``_full``)
        pool = ThreadPoolExecutor(self._slots + 1, thread_name_prefix="ocrq-batch") if self._slots > 1 else None
        try:
            while True:
                batch = self._next_batch()
                if batch is None:
                    return
                if pool is None:
                    self._run_batch(batch)
                else:
                    pool.submit(self._run_batch, batch)
        finally:
            if pool is not None:
                pool.shutdown(wait=False)  # stop() settles what a hung engine still holds
            with self._cond:
                self._stopping = True  # a dead loop takes no more work: submit fails fast
                leftover, self._pending = self._pending, []
            for item in leftover:
                settle(item.future, EngineCrashed("engine loop stopped before this image ran"))

    def _run_batch(self, batch: list[QueuedImage]) -> None:
        try:
            self._execute(batch, depth=0)
        except BaseException as exc:  # a bug here must not strand the batch's futures
            self.log.exception("engine loop failed a batch of %d", len(batch))
            for item in batch:
                settle(item.future, classify(exc))
            if not isinstance(exc, Exception):
                raise
        finally:
            done = {id(it) for it in batch}
            with self._cond:
                self._account()
                self._time.forget(it.request for it in batch)
                self._inflight = [it for it in self._inflight if id(it) not in done]
                self._running -= 1
                if self._running == 0:
                    self._time.stopped()
                self._cond.notify_all()

    def _full(self) -> bool:
        """No batch may start now (caller holds the lock). An engine that runs batches side by side
        gets one more slot for pending work more urgent than every batch in flight: a small urgent
        job does not wait for a bulk batch to finish (the most urgent pending image is first). And
        while more urgent images run, less urgent ones do not start: a step of vLLM's continuous
        batch that also prefills newly admitted bulk pages (the vision tower on every page) delays
        the urgent images' next token by the time of that prefill."""
        if self._slots > 1 and self._pending and self._inflight:
            head = self._pending[0].request.priority
            top = min(it.request.priority for it in self._inflight)
            if head > top:
                return True
            if head < top:
                return self._running > self._slots
        return self._running >= self._slots

    def _next_batch(self) -> list[QueuedImage] | None:
        with self._cond:
            while (not self._pending or self._full()) and not self._stopping:
                self._cond.wait()
        free = self._free_bytes()  # read once work is there: an idle wait makes it stale
        with self._cond:
            while True:
                if self._stopping and (not self._pending or time.monotonic() >= self._stop_deadline):
                    return None
                if not self._pending or self._full():
                    self._cond.wait(0.5 if self._stopping else None)
                    continue
                costs = [it.cost for it in self._pending]
                running = [it.cost for it in self._inflight]
                if running and not self.governor.admits(costs[0], inflight=running):
                    self._cond.wait()  # the batches in flight hold the room: wait for one to finish
                    continue
                if not self._stopping:
                    wait = self._linger(time.monotonic())
                    if wait > 0 and not self.governor.full(costs, free_bytes=free, inflight=running,
                                                           more_coming=self._awaiting_intake()):
                        self._cond.wait(wait)
                        continue
                return self._take(costs, free, running)

    def _linger(self, now: float) -> float:
        """Seconds to wait for more images before planning (caller holds the lock): ``linger_s``
        after the oldest arrived; an idle engine waits for announced images too, up to
        ``intake_wait_s`` after it became free or the oldest arrived, whichever is later."""
        oldest = self._pending[0].enqueued
        wait = oldest + self.linger_s - now
        if self._awaiting_intake():
            ready = max(oldest, self._time.idle_since or oldest)
            wait = max(wait, ready + self.intake_wait_s - now)
        return wait

    def _awaiting_intake(self) -> bool:
        """An idle engine with images announced and still being decoded (caller holds the lock)."""
        return bool(self._incoming) and not self._running

    def _take(self, costs: list[ImageCost], free: int | None, running: list[ImageCost]) -> list[QueuedImage]:
        """Move the planned images from pending to in-flight (caller holds the lock). The urgent
        job's extra slot (``_full``) takes its urgent images only: bulk ones riding along would
        hold its results until they finish too."""
        if self._running >= self._slots:
            top = min(it.request.priority for it in self._inflight)
            costs = costs[: sum(1 for it in self._pending if it.request.priority < top)]
        skips = [it.skips for it in self._pending[: len(costs)]]
        chosen = self.governor.plan(costs, free_bytes=free, skips=skips, inflight=running)
        picked = set(chosen)
        last = max(chosen)
        batch: list[QueuedImage] = []
        rest: list[QueuedImage] = []
        cancelled: list[OcrRequest] = []
        for i, item in enumerate(self._pending):
            if i in picked:
                # a future the caller cancelled while it waited is dropped here
                if item.future.set_running_or_notify_cancel():
                    batch.append(item)
                else:
                    cancelled.append(item.request)
            else:
                if i < last:
                    item.skips += 1
                rest.append(item)
        self._pending = rest
        self._account()
        self._inflight = self._inflight + batch
        if self._running == 0:
            self._time.started()
        self._running += 1
        if cancelled and self._renders is not None:
            self._renders.discard(cancelled)
        return batch

    def _free_bytes(self) -> int | None:
        """Device bytes this process could still use; None for paged engines (vLLM preallocates:
        NVML free says nothing about load)."""
        device = None if self._paged else self.probe.read()
        return None if device is None else usable_free(device.free, self._memory())

    def _memory(self) -> MemorySample:
        try:
            return self.engine.memory()
        except Exception:  # accounting is advisory; the batch result stands
            self.log.debug("engine.memory() failed", exc_info=True)
            return MemorySample()

    # ---- running a batch ----------------------------------------------------------------------

    def _infer(self, requests: Sequence[OcrRequest]) -> list[OcrOutput | OcrqError]:
        try:
            self.engine.reset_peak()
        except Exception:
            self.log.debug("engine.reset_peak() failed", exc_info=True)
        started = time.monotonic()
        outcomes = self.engine.infer(requests)
        seconds = self._last_batch_s = time.monotonic() - started
        self.pace.batch(len(requests), seconds, self._slots)
        if len(outcomes) != len(requests):
            raise EngineCrashed(f"engine returned {len(outcomes)} outcomes for {len(requests)} images")
        if self._on_batch is not None:
            self._on_batch(len(requests), seconds)
        # each image's share of the engine's time (worker.loop.engine_time)
        with self._cond:
            self._account()
            shares = [self._time.share(r, seconds / len(requests)) for r in requests]
        batch_id = f"{self._batch_prefix}-{next(self._batch_seq)}"
        for outcome, engine_s in zip(outcomes, shares, strict=True):
            if isinstance(outcome, OcrOutput):
                outcome.meta["batch"] = {"id": batch_id, "size": len(requests), "engine_s": round(engine_s, 6)}
        return outcomes

    def _account(self) -> None:
        """Before the in-flight set changes (caller holds the lock): ``worker.loop.engine_time``."""
        self._time.account([it.request for it in self._inflight])

    def _execute(self, items: list[QueuedImage], depth: int) -> None:
        if not items:
            return
        costs = [it.cost for it in items]
        try:
            outcomes = self._infer([it.request for it in items])
        except Exception as exc:
            if is_oom(exc):
                self._after_oom(items, depth, exc)
            else:
                self._stats["engine_errors"] += 1
                self.log.warning("engine failed a batch of %d: %s", len(items), exc)
                error = classify(exc)
                for item in items:
                    settle(item.future, error)
            return
        self._learn(costs, grow=depth == 0)
        with self._cond:
            self._stats["batches"] += 1
            self._stats["images"] += len(items)
            self._stats["last_batch_size"] = len(items)
        for item, outcome in zip(items, outcomes, strict=True):
            settle(item.future, outcome)

    def _learn(self, costs: list[ImageCost], *, grow: bool) -> None:
        sample = self._memory()
        if sample.peak:
            self.governor.observe(costs, sample.peak)
        # pressure first: a busy KV cache must hold back the growth a success would bring
        if sample.kv_usage is not None or sample.waiting is not None or sample.preemptions is not None:
            self._paged = self._paged or sample.kv_usage is not None
            with self._cond:
                in_flight = len(self._inflight)  # this batch's images included: it has not left yet
            self.governor.on_pressure(sample.kv_usage, sample.waiting, sample.preemptions, in_flight=in_flight)
        if grow:  # a bisected half succeeding is no reason to grow
            self.governor.on_success()

"""Pages rendered before their batch runs: CPU-side request preparation off the engine's path.

vLLM's renderer (chat template + the HF image processor, 48 ms for a 1024×768 page and 230 ms for
a 2048×1536 one on the H200 host) runs in the caller's thread. Rendered when a batch starts, a
batch holds its slot in the engine loop for its render time while the GPU waits for it. Here a few
threads render images as soon as the engine loop queues them (``prepare``), most urgent first, and
a batch picks the results up (``take``).

Bounded: at most ``ahead`` renders are done or running and not yet taken (a rendered 2048×1536 page
holds tens of MB of pixel patches), so a long backlog does not fill the host's memory. A batch's
own images are never bounded: ``take`` moves the ones not started to the front, so a batch never
waits behind renders queued for later batches. Only these threads render (``init`` runs in each
first): vLLM's renderer converts the pixel patches with torch, whose OpenMP team is per calling
thread, so every extra rendering thread may bring a team of one thread per core. In a worker's
first set on the H200 host (16 cores), with 4 render threads and up to 8 batch threads rendering
at once, a page took 3.75 s on average (0.19 s in its second set, 0.1 s alone).

Pure threading, no vLLM: the render function is given (``worker.engines.vllm.engine``).
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RenderAhead"]

#: heap priority of a render a batch is waiting for: before every render done ahead
_NOW = -(2**31)


@dataclass(order=True)
class _Job:
    rank: tuple[int, int]
    item: Any = field(compare=False)
    future: Future[Any] = field(compare=False, default_factory=Future)
    #: taken by a batch: runs regardless of the bound, and not counted in it once done
    wanted: bool = field(compare=False, default=False)
    #: counted in the bound (done or running ahead, not taken)
    counted: bool = field(compare=False, default=False)
    started: bool = field(compare=False, default=False)


class RenderAhead:
    """``render(item)`` on ``threads`` threads, ahead of ``take``; ``ahead`` 0 renders only on
    ``take`` (every image of a batch at once, the calling thread helping)."""

    def __init__(self, render: Callable[[Any], Any], *, threads: int, ahead: int,
                 init: Callable[[], None] | None = None) -> None:
        self._render = render
        self._init = init
        self.ahead = max(0, ahead)
        self._cond = threading.Condition()
        self._heap: list[_Job] = []
        self._jobs: dict[int, _Job] = {}  # id(item) → job; the job holds the item, so the id stays its own
        self._seq = itertools.count()
        self._held = 0  # renders done or running ahead and not taken: what ``ahead`` bounds
        self._closed = False
        #: seconds spent rendering (all threads) and batches spent waiting for renders
        self.render_s = 0.0
        self.wait_s = 0.0
        self.rendered = 0
        self._threads = [threading.Thread(target=self._work, name=f"render-{i}", daemon=True)
                         for i in range(max(1, threads))]
        for t in self._threads:
            t.start()

    def prepare(self, items: Sequence[Any], priorities: Sequence[int]) -> None:
        """Queue renders for items a batch will take later (lower priority first, then arrival)."""
        if self.ahead == 0:
            return
        with self._cond:
            if self._closed:
                return
            for item, priority in zip(items, priorities, strict=True):
                if id(item) in self._jobs:
                    continue
                job = _Job((int(priority), next(self._seq)), item)
                self._jobs[id(item)] = job
                heapq.heappush(self._heap, job)
            self._cond.notify_all()

    def take(self, items: Sequence[Any]) -> list[Future[Any]]:
        """The renders of a batch's ``items`` (futures, in order, all done), started now where
        they were not: they go before every render ahead."""
        t0 = time.perf_counter()
        with self._cond:
            jobs = []
            for item in items:
                job = self._jobs.pop(id(item), None)
                if job is None or job.item is not item:
                    job = _Job((_NOW, next(self._seq)), item)
                    heapq.heappush(self._heap, job)
                elif not job.started:
                    job.rank = (_NOW, job.rank[1])
                    heapq.heapify(self._heap)
                if job.counted:  # taken: the batch owns it now, the bound frees a place
                    job.counted = False
                    self._held -= 1
                job.wanted = True
                jobs.append(job)
            self._cond.notify_all()
        for job in jobs:
            job.future.exception()  # wait
        self.wait_s += time.perf_counter() - t0
        return [job.future for job in jobs]

    def drop(self, items: Sequence[Any]) -> None:
        """Forget renders no batch will take (cancelled images)."""
        with self._cond:
            for item in items:
                job = self._jobs.pop(id(item), None)
                if job is None:
                    continue
                if job.counted:
                    job.counted = False
                    self._held -= 1
                if not job.started:
                    job.started = True
                    self._heap.remove(job)
                    heapq.heapify(self._heap)
            self._cond.notify_all()

    def pending(self) -> int:
        with self._cond:
            return len(self._jobs)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._jobs.clear()
            self._cond.notify_all()
        for t in self._threads:
            t.join(5.0)

    def _work(self) -> None:
        if self._init is not None:
            self._init()
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    job = self._next()
                    if job is not None:
                        break
                    self._cond.wait()
                job.started = True
                if not job.wanted:
                    job.counted = True
                    self._held += 1
            self._run(job)
            with self._cond:
                self._cond.notify_all()

    def _next(self) -> _Job | None:
        """The most urgent job this thread may start (caller holds the lock): one a batch waits
        for always; one ahead of its batch while fewer than ``ahead`` are held."""
        while self._heap and self._heap[0].started:
            heapq.heappop(self._heap)
        if not self._heap:
            return None
        head = self._heap[0]
        if head.wanted or self._held < self.ahead:
            return heapq.heappop(self._heap)
        return None

    def _run(self, job: _Job) -> None:
        t0 = time.perf_counter()
        try:
            result = self._render(job.item)
        except BaseException as exc:  # the batch sees it for this image alone
            job.future.set_exception(exc)
        else:
            job.future.set_result(result)
        finally:
            with self._cond:
                self.render_s += time.perf_counter() - t0
                self.rendered += 1


def one_torch_thread() -> None:
    """A render thread's torch ops run on that thread alone (OpenMP's thread count is per calling
    thread; the render threads are the parallelism)."""
    import torch

    torch.set_num_threads(1)

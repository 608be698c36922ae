"""The renderer's warm-up, run while vLLM's engine core builds instead of after it.

A fresh engine's first render builds vLLM's HF processors (one per cache key) and their pools of
tokenizer copies: 14.5 s of the worker's start on the H100 (13.6 s on a 2-core CPU with the real
tokenizer's size), all of it after ``LLM()`` returned, while the engine core had long been ready.
None of it needs the core: only the renderer, which ``LLMEngine`` makes before it starts its core
process and then waits, GIL released, for the core's handshake (weights, profiling, compilation,
CUDA graphs: 45-60 s). ``compat.renderer_built`` hands the renderer over at that point and a thread
renders one page with it, so the processor caches (process-wide) and the pools are warm by the
time ``LLM()`` returns.

The thread starts rendering only once the core process exists: vLLM forks it by default, and a fork
taken while another thread is inside the tokenizer or an import can leave the child a held lock.
With the core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) no such process comes and the
render runs once the build is over, as before. A failed or skipped overlap falls back to rendering
after the build (``finish``), so the render threads never meet a cold renderer (the herd in
docs/gpu.md, note 7).
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)

#: how often the thread looks for the engine core process
POLL_S = 0.05
#: the name vLLM gives its engine core process (``EngineCore``, ``EngineCore_DP<n>``)
CORE_PREFIX = "EngineCore"


def core_started() -> bool:
    """Whether vLLM's engine core process runs as a child of this one."""
    return any(p.name.startswith(CORE_PREFIX) for p in multiprocessing.active_children())


class RendererWarmup:
    """``begin`` (the renderer hook) starts the thread; ``built`` says ``LLM()`` returned;
    ``finish`` waits for the render, or renders now when it did not happen."""

    def __init__(self, render: Callable[[Any, Any], Any], also: Callable[[], None] | None = None,
                 beside: Sequence[Callable[[], object]] = (), core_started: Callable[[], bool] = core_started) -> None:
        #: ``render(renderer, model_config)`` renders the warm-up page; ``also`` runs after it in
        #: the same thread (the answer tokenizer's load); ``beside`` after that, only while the core
        #: is still building (work of the worker's own that would otherwise follow the build)
        self._render = render
        self._also = also
        self._beside = list(beside)
        self._core_started = core_started
        self._built = threading.Event()
        self._cancelled = False
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        #: seconds the render took, and whether it ran while the core was still building
        self.render_s: float | None = None
        self.also_s: float | None = None
        self.beside_s: float | None = None
        self.overlapped = False

    def begin(self, renderer: Any, model_config: Any) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, args=(renderer, model_config),
                                        name="ocrq-renderer-warmup", daemon=True)
        self._thread.start()

    def built(self) -> None:
        self._built.set()

    def cancel(self) -> None:
        """The build failed: the thread renders nothing (a render under way ends on its own)."""
        self._cancelled = True
        self._built.set()

    def finish(self, render_now: Callable[[], Any]) -> float:
        """Wait for the thread; render with ``render_now`` (the built LLM) if the warm-up did not
        run or failed. Returns the seconds this call waited or rendered: the part on the build's
        critical path."""
        self._built.set()
        t0 = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
        if self.render_s is None:  # no hook, or the warm render failed: as before the overlap
            if self._error is not None:
                log.warning("renderer warm-up beside the build failed (%s); rendering now", self._error)
            t1 = time.perf_counter()
            render_now()
            self.render_s, self.overlapped = time.perf_counter() - t1, False
        if self._also is not None and self.also_s is None:
            t2 = time.perf_counter()
            self._also()
            self.also_s = time.perf_counter() - t2
        return time.perf_counter() - t0

    def _run(self, renderer: Any, model_config: Any) -> None:
        while not self._core_started() and not self._built.is_set():
            self._built.wait(POLL_S)
        overlapped = not self._built.is_set()
        if self._cancelled:
            return
        try:
            t0 = time.perf_counter()
            self._render(renderer, model_config)
            self.render_s, self.overlapped = time.perf_counter() - t0, overlapped
            if self._also is not None:
                t1 = time.perf_counter()
                self._also()
                self.also_s = time.perf_counter() - t1
            if self._beside and overlapped and not self._built.is_set():
                t2 = time.perf_counter()
                for work in self._beside:
                    work()
                self.beside_s = time.perf_counter() - t2
        except BaseException as exc:  # reported by finish, which renders again
            self._error = exc

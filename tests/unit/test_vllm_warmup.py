"""The renderer's warm-up beside vLLM's engine-core build (``worker.engines.vllm.warmup``): pure
threading, with the core process and the renders faked."""

from __future__ import annotations

import threading
import time

from worker.engines.vllm.warmup import RendererWarmup


class FakeCore:
    def __init__(self) -> None:
        self.up = threading.Event()

    def __call__(self) -> bool:
        return self.up.is_set()


def test_the_warm_up_waits_for_the_core_process_then_runs_beside_the_build() -> None:
    core, order = FakeCore(), []
    warm = RendererWarmup(lambda r, m: order.append(("render", r, m)), also=lambda: order.append("tokenizer"),
                          beside=[lambda: order.append("gc")], core_started=core)
    warm.begin("renderer", "config")
    time.sleep(0.15)
    assert order == []  # vLLM may still fork its core: nothing renders before it exists
    core.up.set()
    deadline = time.monotonic() + 5
    while len(order) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    warm.built()
    waited = warm.finish(lambda: order.append("late render"))
    assert order == [("render", "renderer", "config"), "tokenizer", "gc"]
    assert warm.overlapped and warm.render_s is not None and warm.beside_s is not None and waited < 1.0


def test_without_a_core_process_it_renders_once_the_build_is_over_and_skips_the_beside_work() -> None:
    order: list[object] = []
    warm = RendererWarmup(lambda r, m: order.append("render"), also=lambda: order.append("tokenizer"),
                          beside=[lambda: order.append("gc")], core_started=lambda: False)
    warm.begin("renderer", "config")  # the core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    warm.built()
    warm.finish(lambda: order.append("late render"))
    assert order == ["render", "tokenizer"] and not warm.overlapped and warm.beside_s is None


def test_a_failed_or_missing_warm_up_renders_after_the_build_and_a_failed_build_renders_nothing() -> None:
    order: list[object] = []

    def broken(renderer: object, config: object) -> None:
        raise RuntimeError("no processor")

    warm = RendererWarmup(broken, also=lambda: order.append("tokenizer"), core_started=lambda: True)
    warm.begin("renderer", "config")
    warm.finish(lambda: order.append("late render"))
    assert order == ["late render", "tokenizer"] and not warm.overlapped
    # no hook in this vLLM: the page renders after the build, as before the overlap
    order.clear()
    warm = RendererWarmup(lambda r, m: order.append("render"), also=lambda: order.append("tokenizer"))
    warm.finish(lambda: order.append("late render"))
    assert order == ["late render", "tokenizer"]
    # the build failed: the thread renders nothing
    order.clear()
    core = FakeCore()
    warm = RendererWarmup(lambda r, m: order.append("render"), core_started=core)
    warm.begin("renderer", "config")
    warm.cancel()
    time.sleep(0.15)
    assert order == []

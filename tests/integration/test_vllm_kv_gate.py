"""The KV gate against vLLM's real scheduler, on a KV cache far smaller than one batch needs (CPU
tiers, tiny random checkpoint, fp32): planned exactly (``kv_gate_overcommit`` 1) the gate holds
pages back and vLLM preempts none; over-committed (2), and with no gate at all, vLLM preempts and
recomputes, the gate does not tighten, and every page's per-step top-k logprobs are still the ones
it gets alone.

One engine for the module: each test puts its gate in the engine's place (a gate is vLLM's block
count times a factor, nothing else), so every run meets the same cache and the same scheduler.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from tests.integration.vllm_support import (
    TOL,
    K,
    compare,
    engine_settings,
    flask_proxies_bound,
    in_process_vllm_env,
    make_images,
    requests_for,
    tiny_checkpoint,
)

pytestmark = [pytest.mark.vllm, pytest.mark.integration, pytest.mark.slow]

#: decode steps per page: more than a block (128 tokens on the CPU backend) of growth each
STEPS = 160
#: the cache: 12 blocks (of 128 tokens on the CPU backend), 1,536 tokens, where the 12 pages need
#: ~4,600 together (prompt + 160 new tokens each) and the largest ~520
BLOCKS = 12


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from worker.engines.vllm.engine import VllmEngine

    with in_process_vllm_env(tmp_path_factory.mktemp("vllm-gate-env")):
        checkpoint = tiny_checkpoint(tmp_path_factory)
        # the exact plan (over-commit 1), not the engine's default: the tests swap in the others
        extra = {"vllm": {"num_gpu_blocks_override": BLOCKS}, "kv_gate_overcommit": 1}
        eng = VllmEngine(engine_settings(checkpoint, "vllm", max_model_len=1024, extra=extra))
        with flask_proxies_bound():
            eng.start()
        yield eng
        eng.close()


@pytest.fixture(scope="module")
def alone(engine: Any) -> list[Any]:
    return [engine.topk_logprobs([r], K, STEPS)[0] for r in _pages()]


def _pages() -> list[Any]:
    return requests_for(make_images(0) + make_images(1))


@contextmanager
def _gated(engine: Any, overcommit: float | None) -> Iterator[None]:
    """A gate planning with ``overcommit`` times vLLM's blocks (None: no gate) in the engine's
    place while the block runs; the engine's own gate back after it."""
    from worker.engines.vllm.kv_gate import KvGate

    old = engine._gate
    engine._gate = engine._stepper.gate = (
        None if overcommit is None else KvGate(*_blocks(engine), overcommit=overcommit)
    )
    try:
        yield
    finally:
        engine._gate = engine._stepper.gate = old


def _blocks(engine: Any) -> tuple[int, int]:
    from worker.engines.vllm.gauges import kv_blocks

    sized = kv_blocks(engine._llm)
    assert sized is not None
    return sized


def _run_batch(engine: Any, alone: list[Any]) -> tuple[int, dict[str, Any]]:
    """Preemptions vLLM made during one batch of the 12 pages, and the stepper's stats after it;
    asserts each page's logprobs equal its own alone."""
    before = engine.memory().preemptions or 0
    batched = engine.topk_logprobs(_pages(), K, STEPS)
    for i, (a, b) in enumerate(zip(alone, batched, strict=True)):
        d, missing = compare(a, b)
        assert missing == 0 and d <= TOL, (i, d, missing)
    return (engine.memory().preemptions or 0) - before, engine.stats()


def test_the_cache_holds_a_few_pages_of_the_batch(engine: Any) -> None:
    blocks, size = _blocks(engine)
    assert blocks == BLOCKS and blocks * size < 2048, (blocks, size)  # far below the pages' ~4,600 tokens
    assert engine.kv_gated and engine._gate.overcommit == 1.0


def test_the_exact_gate_holds_pages_back_and_vllm_preempts_none(engine: Any, alone: list[Any]) -> None:
    preempted, stats = _run_batch(engine, alone)
    assert preempted == 0, stats
    assert stats["gate_tightened"] == 0 and stats["held_steps"] > 0, stats


def test_an_overcommitted_gate_lets_vllm_preempt_without_changing_a_page(engine: Any, alone: list[Any]) -> None:
    with _gated(engine, 2.0):
        preempted, stats = _run_batch(engine, alone)
    print(f"\nover-committed 2x: {preempted} preemption(s), {stats}")
    assert preempted > 0, stats
    assert stats["gate_overcommit"] == 2.0 and stats["gate_tightened"] == 0, stats


def test_without_the_gate_vllm_preempts_on_the_same_batch(engine: Any, alone: list[Any]) -> None:
    """What the exact gate saves: every page handed to vLLM's scheduler at once."""
    with _gated(engine, None):
        preempted, stats = _run_batch(engine, alone)
    print(f"\nungated: {preempted} preemption(s)")
    assert preempted > 0, stats

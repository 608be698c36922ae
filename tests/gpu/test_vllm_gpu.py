"""The in-process vLLM engine on a real GPU (an H200; never in CI): the full-size random
HunyuanOCR-1.5 checkpoint in bf16 with CUDA graphs, inside a 24 GiB budget the worker derives
from ``memory_cap_bytes``; a mixed batch; two batches in flight; a killed engine core is a typed,
retryable failure and the engine rebuilds. (The exact fp32 invariance checks are the `vllm` tier's
tests, which run unchanged on the GPU too.)"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from ocrq.engine_settings import VllmSettings
from ocrq.errors import EngineCrashed
from ocrq.results import OcrOutput
from worker.engines.base import OcrRequest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GIB = 2**30
SIZES = [(1024, 768), (2048, 1536), (600, 400), (1024, 768)]


@pytest.fixture(scope="module")
def engine(full_checkpoint: Path) -> Any:
    from worker.engines.vllm.engine import VllmEngine

    eng = VllmEngine(VllmSettings(kind="vllm", model_dir=full_checkpoint, max_new_tokens=32, repetition_stop=0,
                                    max_model_len=4096, max_num_seqs=64, memory_cap_bytes=24 * GIB,
                                    extra={"ignore_eos": True}))
    eng.start()
    print(f"\nvLLM full-size build {eng.start_seconds:.1f}s, KV {eng.kv_capacity_tokens} tokens, "
          f"capacity {eng.capacity_bytes / GIB:.2f} GiB")
    yield eng
    eng.close()


def _requests(seed: int = 0) -> list[OcrRequest]:
    rng = np.random.default_rng(seed)
    return [OcrRequest(key=f"p{i}", image=Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)))
            for i, (w, h) in enumerate(SIZES)]


def first_step_alone_vs_batch(engine: Any, seed: int = 3) -> float:
    """Worst |Δ| of a page's top-5 first-step logprobs, alone against in a mixed batch."""
    reqs = _requests(seed)
    alone = [engine.topk_logprobs([r], 5, 1)[0] for r in reqs]
    batched = engine.topk_logprobs(reqs, 5, 1)
    first = 0.0
    for a, b in zip(alone, batched, strict=True):
        da, db = dict(a[0]), dict(b[0])
        first = max([first] + [abs(lp - db[t]) for t, lp in da.items() if t in db])
    return first


def test_builds_inside_the_budget_with_cuda_graphs(engine: Any) -> None:
    total = torch.cuda.get_device_properties(0).total_memory
    assert engine.capacity_bytes <= 24 * GIB
    assert abs(engine.capacity_bytes - 24 * GIB) < 0.01 * total  # the budget, not the card
    assert engine.engine_args()["enforce_eager"] is False
    assert engine.kv_capacity_tokens and engine.kv_capacity_tokens > 100_000


def test_a_mixed_batch_runs_full_length(engine: Any) -> None:
    t0 = time.perf_counter()
    outs = engine.infer(_requests())
    print(f"\nmixed batch of {len(SIZES)}: {time.perf_counter() - t0:.2f}s")
    assert all(isinstance(o, OcrOutput) for o in outs), outs
    assert [o.meta["generated_tokens"] for o in outs] == [32] * len(SIZES)


def test_batches_in_flight_together_finish(engine: Any) -> None:
    reqs = _requests(1) + _requests(2)
    got: dict[int, Any] = {}

    def run(part: int) -> None:
        got[part] = engine.infer(reqs[4 * part: 4 * part + 4])

    threads = [threading.Thread(target=run, args=(p,)) for p in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert all(isinstance(o, OcrOutput) for p in (0, 1) for o in got[p])


def test_bf16_batch_invariance_measured(engine: Any) -> None:
    """bf16 on the GPU: the first step (prefill) agrees alone and in a batch, but vLLM's decode
    kernels change with the batch shape, so later steps drift and a greedy path on random weights
    (near-uniform logits) can flip (H200: 0.0000 at step 0, 1 of 4 paths diverged, docs/gpu.md).
    The exact check is the fp32 tier, which also passes on the H200."""
    reqs = _requests(3)
    alone = [engine.topk_logprobs([r], 5, 8)[0] for r in reqs]
    batched = engine.topk_logprobs(reqs, 5, 8)
    worst = 0.0
    first = 0.0
    diverged = 0
    for a, b in zip(alone, batched, strict=True):
        for k, (sa, sb) in enumerate(zip(a, b, strict=True)):
            da, db = dict(sa), dict(sb)
            d = max([0.0] + [abs(lp - db[t]) for t, lp in da.items() if t in db])
            worst = max(worst, d)
            first = max(first, d) if k == 0 else first
            if sa[0][0] != sb[0][0]:
                diverged += 1
                break
    print(f"\nbf16 alone vs batch (VLLM_BATCH_INVARIANT={os.environ.get('VLLM_BATCH_INVARIANT', '0')}): "
          f"max |Δ top-5 logprob| {worst:.4f}, first step {first:.4f}, greedy paths diverged {diverged}/{len(reqs)}")
    assert first < 0.02


def test_a_real_cuda_oom_is_typed_retryable_and_the_engine_rebuilds(engine: Any) -> None:
    """A real CUDA OOM inside vLLM's engine core: another allocation takes the card's free memory,
    then more large pages at once than any step before need new activation memory for the vision
    tower. (Its first form sent 2048×2048 pages: 4,162 vision tokens, over ``max_model_len`` 4096,
    so vLLM refused them before any GPU work and nothing failed on the H200.) The batch
    fails with a typed, retryable error (vLLM's core dies with the OOM: ``EngineCrashed``, or
    ``EngineOOM`` where the OOM's text reaches the worker), and once the memory is back the next
    call rebuilds the engine and runs."""
    from ocrq.errors import EngineOOM, Retryable

    builds = engine.builds
    free, _ = torch.cuda.mem_get_info()
    filler = torch.empty(max(0, free - 64 * 2**20), dtype=torch.uint8, device="cuda")
    rng = np.random.default_rng(7)
    big = [OcrRequest(key=f"o{i}", image=Image.fromarray(rng.integers(0, 255, (1536, 2048, 3), dtype=np.uint8)))
           for i in range(8)]
    failure: Exception | None = None
    try:
        outs = engine.infer(big)
    except (EngineOOM, EngineCrashed) as exc:
        failure = exc
    finally:
        del filler
        torch.cuda.empty_cache()
    assert failure is not None, f"no OOM with the card full: {[type(o).__name__ for o in outs]}"
    print(f"\nreal CUDA OOM: {type(failure).__name__}: {str(failure)[:160]}")
    assert isinstance(failure, Retryable)
    outs = engine.infer(_requests()[:2])
    assert all(isinstance(o, OcrOutput) for o in outs)
    assert engine.builds == builds + 1
    print(f"rebuild after the OOM: {engine.start_seconds:.1f}s")


def test_a_killed_engine_core_is_retryable_and_the_engine_rebuilds(engine: Any) -> None:
    import psutil

    cores = [p for p in psutil.Process().children(recursive=True)
             if "EngineCore" in " ".join(p.cmdline()) or "EngineCore" in p.name()]
    if not cores:
        pytest.skip("engine core runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    builds = engine.builds
    for proc in cores:
        os.kill(proc.pid, signal.SIGKILL)
    with pytest.raises(EngineCrashed):
        engine.infer(_requests()[:2])
    outs = engine.infer(_requests()[:2])  # rebuilt on the next call
    assert all(isinstance(o, OcrOutput) for o in outs)
    assert engine.builds == builds + 1
    print(f"\nrebuild after a killed core: {engine.start_seconds:.1f}s")

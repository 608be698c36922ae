"""The opt-in grouped vision tower (``engine.vision_group_patches``, worker/engines/vllm/vision.py)
on the H200: full-size bf16 engine with CUDA graphs, its own build (~2 min), so ``bash
bench/h200_vllm.sh all-tests`` leaves this file out and the ``groups`` step runs it (H200,
2026-12-02, commit c859c01: 2 passed).

What it must show before the setting's default changes: a mixed batch runs full length, and bf16
alone vs batch agrees at the first step as closely as vLLM's page-by-page tower does there
(0.0000 on the H200, docs/gpu.md): a group's GEMMs may round differently than a page's alone."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from ocrq.engine_settings import VllmSettings
from ocrq.results import OcrOutput
from tests.gpu.test_vllm_gpu import GIB, SIZES, _requests, first_step_alone_vs_batch

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def grouped(full_checkpoint: Path) -> Any:
    from worker.engines.vllm import vision
    from worker.engines.vllm.engine import VllmEngine

    # lets collective_rpc carry a function to vLLM's core process (the grouped-forward count below)
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    eng = VllmEngine(VllmSettings(kind="vllm", model_dir=full_checkpoint, max_new_tokens=32, repetition_stop=0,
                                    max_model_len=4096, max_num_seqs=64, memory_cap_bytes=24 * GIB,
                                    vision_group_patches=16384, extra={"ignore_eos": True}))
    eng.start()
    assert vision.group_patches() == 16384  # what vLLM's core process inherited
    print(f"\ngrouped-tower build {eng.start_seconds:.1f}s, KV {eng.kv_capacity_tokens} tokens")
    yield eng
    eng.close()


def _grouped_forwards(worker: Any) -> int:
    """In vLLM's core process: tower forwards that took the grouped path there."""
    from worker.engines.vllm import vision

    return vision.stats["grouped"]


def test_a_mixed_batch_runs_full_length_with_the_grouped_tower(grouped: Any) -> None:
    before = grouped._llm.collective_rpc(_grouped_forwards)[0]
    outs = grouped.infer(_requests())
    assert all(isinstance(o, OcrOutput) for o in outs), outs
    assert [o.meta["generated_tokens"] for o in outs] == [32] * len(SIZES)
    assert grouped._llm.collective_rpc(_grouped_forwards)[0] > before  # the core ran the grouped tower


def test_bf16_first_step_alone_vs_batch_with_the_grouped_tower(grouped: Any) -> None:
    first = first_step_alone_vs_batch(grouped)
    print(f"\ngrouped tower, bf16 first step alone vs batch: max |Δ top-5 logprob| {first:.4f}")
    assert first < 0.02

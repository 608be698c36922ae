"""``engine.vision_cuda_graphs`` on the H200 (worker/engines/vllm/encoder_graphs.py): the full-size
bf16 engine with vLLM's encoder CUDA graphs over the HunyuanVL protocol the plugin installs, its
own build, so ``bash bench/h200_vllm.sh all-tests`` leaves this file out and the ``graphs`` step
runs it.

What it must show: the engine captures the tower's graphs inside the 24 GiB budget and a mixed
batch runs full length through them; the real captured graphs give each page what vLLM's eager
tower gives (bf16: padding a page to its budget's rows may change a GEMM's rounding, so this is a
closeness bound, printed); and a page's first step is the same alone and in a batch (a page's
graph follows from its own size)."""

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

#: patch grids of a 1024×768, a 2048×1536 and a small page, as the processor makes them
GRIDS = [[1, 48, 64], [1, 96, 128], [1, 26, 38]]


@pytest.fixture(scope="module")
def graphed(full_checkpoint: Path) -> Any:
    from worker.engines.vllm.engine import VllmEngine

    # lets collective_rpc carry a function to vLLM's core process (the checks below run there)
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    eng = VllmEngine(VllmSettings(kind="vllm", model_dir=full_checkpoint, max_new_tokens=32, repetition_stop=0,
                                    max_model_len=4096, max_num_seqs=64, memory_cap_bytes=24 * GIB,
                                    vision_cuda_graphs=True, extra={"ignore_eos": True}))
    eng.start()
    print(f"\nencoder-graphs build {eng.start_seconds:.1f}s, KV {eng.kv_capacity_tokens} tokens, "
          f"capacity {eng.capacity_bytes / GIB:.2f} GiB")
    yield eng
    eng.close()


def _graph_pages(worker: Any) -> dict[str, Any]:
    """In vLLM's core process: the manager's counts and pages the protocol post-processed."""
    from worker.engines.vllm import encoder_graphs

    m = worker.model_runner.encoder_cudagraph_manager
    return {"manager": m is not None, "hits": m.graph_hits if m else 0, "misses": m.graph_misses if m else 0,
            "budgets": m.token_budgets if m else [], "pages": encoder_graphs.stats["pages"]}


def _graphs_vs_eager(worker: Any) -> list[dict[str, float]]:
    """In vLLM's core process: the same random pixels through the captured graphs and through
    vLLM's eager tower, per page: worst |Δ|, the outputs' scale and their cosine."""
    model = worker.model_runner.model
    tower = model.visual
    e = tower.embeddings
    x = torch.randn(sum(h * w for _, h, w in GRIDS), e.num_channels * e.patch_size**2,
                    generator=torch.Generator().manual_seed(0)).to(tower.device, tower.dtype)
    with torch.inference_mode():
        graphed = worker.model_runner.encoder_cudagraph_manager.execute(
            {"pixel_values": x, "image_grid_thw": torch.tensor(GRIDS)})
        eager = tower(x, GRIDS)
    out = []
    for g, r in zip(graphed, eager, strict=True):
        g, r = g.float(), r.float()
        out.append({"max_abs": float((g - r).abs().max()), "scale": float(r.abs().max()),
                    "cosine": float(torch.nn.functional.cosine_similarity(g.flatten(), r.flatten(), dim=0))})
    return out


def test_a_mixed_batch_runs_full_length_through_the_graphs(graphed: Any) -> None:
    before = graphed._llm.collective_rpc(_graph_pages)[0]
    assert before["manager"] and before["budgets"], before
    outs = graphed.infer(_requests())
    after = graphed._llm.collective_rpc(_graph_pages)[0]
    print(f"\nbudgets {after['budgets']}; graph hits {after['hits']}, misses {after['misses']}")
    assert all(isinstance(o, OcrOutput) for o in outs), outs
    assert [o.meta["generated_tokens"] for o in outs] == [32] * len(SIZES)
    assert after["pages"] - before["pages"] == len(SIZES)  # every page went through a graph
    assert after["misses"] == before["misses"]


def test_the_captured_graphs_give_each_page_what_the_eager_tower_gives(graphed: Any) -> None:
    pages = graphed._llm.collective_rpc(_graphs_vs_eager)[0]
    for grid, p in zip(GRIDS, pages, strict=True):
        print(f"\ngrid {grid[1]}x{grid[2]}: max |Δ| {p['max_abs']:.4f} of {p['scale']:.2f}, cosine {p['cosine']:.6f}")
    assert all(p["cosine"] > 0.999 for p in pages), pages


def test_bf16_first_step_alone_vs_batch_with_the_graphs(graphed: Any) -> None:
    first = first_step_alone_vs_batch(graphed)
    print(f"\nencoder graphs, bf16 first step alone vs batch: max |Δ top-5 logprob| {first:.4f}")
    assert first <= 1e-4

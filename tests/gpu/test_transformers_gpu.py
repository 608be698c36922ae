"""The transformers engine on a real GPU (an H200; never in CI): a full-size random
HunyuanOCR-1.5 checkpoint loads in bf16, a mixed batch runs, OOM under a small memory fraction
surfaces as EngineOOM (and the engine recovers), and the graph decode step is fast."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ocrq.engine_settings import TransformersSettings
from ocrq.errors import EngineOOM
from worker.engines.base import OcrRequest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def engine(full_checkpoint: Path):
    from worker.engines.transformers.engine import TransformersEngine

    eng = TransformersEngine(TransformersSettings(kind="transformers", model_dir=full_checkpoint, max_new_tokens=32,
                                            repetition_stop=0, extra={"ignore_eos": True}))
    eng.start()
    yield eng
    eng.close()


def _req(key: str, w: int, h: int, tokens: int = 32) -> OcrRequest:
    rng = np.random.default_rng(abs(hash(key)) % 2**32)
    img = Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
    return OcrRequest(key=key, image=img, params={"max_new_tokens": tokens})


def test_full_checkpoint_loads_in_bf16(engine) -> None:
    params = sum(p.numel() for p in engine.model.parameters())
    assert 0.99e9 < params < 1.0e9
    assert engine.model.dtype == torch.bfloat16
    assert engine.decode_mode == "graph"
    mem = engine.memory()
    assert mem.allocated is not None and 1.8 * 2**30 < mem.allocated < 3 * 2**30


def test_mixed_batch_generates(engine) -> None:
    reqs = [_req("a", 1024, 768), _req("b", 2048, 1536), _req("c", 600, 400)]
    outs = engine.infer(reqs)
    assert [o.meta["generated_tokens"] for o in outs] == [32, 32, 32]
    assert engine.memory().peak > engine.memory().allocated


def test_oom_raises_engine_oom_and_recovers(engine) -> None:
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(4 * 2**30 / total)
    try:
        with pytest.raises(EngineOOM):
            engine.infer([_req(f"big{i}", 2048, 1536, 256) for i in range(16)])
        outs = engine.infer([_req("small", 600, 400, 8)])  # the engine survives the OOM
        assert outs[0].meta["generated_tokens"] == 8
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def test_other_errors_are_not_oom(engine) -> None:
    outs = engine.infer([OcrRequest(key="x", image=Image.new("RGB", (640, 480)), task="extract")])
    assert type(outs[0]).__name__ == "BadRequest"


def test_graph_decode_step_is_fast(engine) -> None:
    reqs = [_req(f"s{i}", 1024, 768) for i in range(64)]
    texts = [engine._prompt_text(r) for r in reqs]
    engine._generate(reqs, texts, max_new=8, stops=False, decode="graph")
    _, graph = engine._generate(reqs, texts, max_new=65, stops=False, decode="graph")
    _, hf = engine._generate(reqs, texts, max_new=17, stops=False, decode="hf")
    graph_ms, hf_ms = graph["decode_s"] / 64 * 1e3, hf["decode_s"] / 16 * 1e3
    print(f"decode step at batch 64: graph {graph_ms:.2f} ms, hf {hf_ms:.2f} ms")
    assert graph_ms < 10.0
    assert graph_ms < hf_ms


def test_lean_step_arithmetic_on_cuda() -> None:
    """The decode step's RMSNorm (torch's fused kernel on a bf16 input) is HF's RMSNorm module to
    within one bf16 rounding (its reduction order differs on CUDA: measured, not bit for bit), and
    its additive mask gives exactly what a bool mask gives."""
    from torch.nn import functional as F
    from transformers.models.hunyuan_vl.modeling_hunyuan_vl import HunYuanVLRMSNorm

    from worker.engines.transformers.static_decode import _norm

    gen = torch.Generator(device="cuda").manual_seed(0)
    for width in (128, 1024):
        norm = HunYuanVLRMSNorm(width, eps=1e-5).to("cuda", torch.bfloat16)
        norm.weight.data = torch.randn(width, device="cuda", generator=gen).bfloat16()
        for scale in (0.01, 1.0, 30.0):
            x = (torch.randn(64, 24, width, device="cuda", generator=gen) * scale).bfloat16()
            ref, ours = norm(x).float(), _norm(x, norm.weight, 1e-5).float()
            # one bf16 ulp of the normalised value, carried through the bf16 × weight product
            assert torch.allclose(ours, ref, rtol=2**-6, atol=0)
            assert (ours != ref).float().mean() < 0.05
    q = torch.randn(16, 8, 2, 128, device="cuda", generator=gen).bfloat16()
    k, v = (torch.randn(16, 8, 1088, 128, device="cuda", generator=gen).bfloat16() for _ in range(2))
    valid = torch.rand(16, 1088, device="cuda", generator=gen) > 0.3
    additive = torch.zeros(16, 1088, device="cuda", dtype=torch.bfloat16).masked_fill(~valid, float("-inf"))
    assert torch.equal(F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :]),
                       F.scaled_dot_product_attention(q, k, v, attn_mask=additive[:, None, None, :]))

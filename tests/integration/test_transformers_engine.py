"""The transformers engine on the CPU with a tiny random-weight HunyuanOCR-1.5 checkpoint, built by
``make_random_checkpoint`` and loaded through the same code path a real checkpoint uses.

Batch invariance (fp32): an image's per-step top-5 logprobs over 8 greedy steps agree whether it
runs alone or left-padded into a micro-batch of 4 different sizes. Measured on this CPU: max
|Δ logprob| ≈ 1e-6 (9.5e-7) for both the HF-forward and the static-cache decode paths; asserted
at 1e-4."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ocrq.engine_settings import TransformersSettings
from ocrq.errors import BadRequest
from ocrq.results import OcrOutput
from worker.engines.base import Engine, OcrRequest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytestmark = pytest.mark.integration

SIZES = [(640, 480), (1024, 768), (600, 400), (800, 1100)]
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from worker.checkpoint import make_random_checkpoint

    return make_random_checkpoint(tmp_path_factory.mktemp("tiny"), "tiny", seed=0)


@pytest.fixture(scope="module")
def engine(checkpoint: Path):
    from worker.engines.transformers.engine import TransformersEngine

    eng = TransformersEngine(TransformersSettings(kind="transformers", model_dir=checkpoint, max_new_tokens=24))
    eng.start()
    yield eng
    eng.close()


def _image(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def requests_() -> list[OcrRequest]:
    return [OcrRequest(key=f"i{i}", image=_image(w, h, i)) for i, (w, h) in enumerate(SIZES)]


def test_engine_protocol_and_revision(engine, checkpoint: Path) -> None:
    as_protocol: object = engine
    assert isinstance(as_protocol, Engine)
    assert engine.name == "transformers"
    assert engine.decode_mode == "hf" and engine.model.dtype == torch.float32
    assert engine.revision.startswith("hunyuanocr-1.5-")
    from worker.checkpoint import make_random_checkpoint
    from worker.engines.weights import weights_revision

    other = make_random_checkpoint(checkpoint.parent / "seed1", "tiny", seed=1)
    assert weights_revision(other, "1.5") != engine.revision


def test_device_preprocessing_equals_processor(engine, requests_) -> None:
    from worker.engines.transformers.inputs import encode_batch

    texts = [engine._prompt_text(r) for r in requests_]
    ours = encode_batch(engine.processor, texts, [r.image for r in requests_], engine.device)
    ref = engine.processor(text=texts, images=[r.image for r in requests_], padding=True,
                           padding_side="left", return_tensors="pt")
    for key in ("input_ids", "attention_mask", "mm_token_type_ids", "image_grid_thw"):
        assert torch.equal(ours[key], ref[key]), key
    assert torch.allclose(ours["pixel_values"], ref["pixel_values"], atol=1e-6, rtol=0)


def test_mixed_batch_generates(engine, requests_) -> None:
    reqs = [*requests_, OcrRequest(key="bad", image=_image(64, 64, 9), task="extract")]
    outs = engine.infer(reqs)
    assert isinstance(outs[-1], BadRequest)  # a bad request fails alone
    for req, out in zip(reqs[:-1], outs[:-1], strict=True):
        assert isinstance(out, OcrOutput)
        assert (out.width, out.height) == req.image.size and out.model == engine.revision
        assert out.meta["stop_reason"] in ("eos", "length", "repetition")
        assert 0 < out.meta["generated_tokens"] <= 24
        # random weights loop on one token: the repetition stop must catch it
        assert out.meta["stop_reason"] == "repetition" and out.meta["repetition"]["unit"] == 1


@pytest.mark.parametrize("decode", ["hf", "static"])
def test_batch_invariance(engine, requests_, decode: str) -> None:
    alone = [engine.topk_logprobs([r], k=5, steps=8, decode=decode)[0] for r in requests_]
    batched = engine.topk_logprobs(requests_, k=5, steps=8, decode=decode)
    worst = 0.0
    for a, b in zip(alone, batched, strict=True):
        for step_a, step_b in zip(a, b, strict=True):
            assert [t for t, _ in step_a] == [t for t, _ in step_b]
            worst = max(worst, *(abs(x[1] - y[1]) for x, y in zip(step_a, step_b, strict=True)))
    assert worst < TOLERANCE, worst


@pytest.mark.parametrize("decode", ["hf", "static"])
def test_chunked_prefill_equals_one_pass(engine, requests_, decode: str) -> None:
    """A prefill split into one chunk per row (its KV copied into the batch's cache at the row's
    own offset) gives the same logprobs as the batch prefilled in one pass."""
    from worker.engines.transformers.prefill import prefill_chunks

    lengths = [900] * len(requests_)
    assert len(prefill_chunks(lengths, engine.settings.max_num_batched_tokens)) == 1
    one_pass = engine.topk_logprobs(requests_, k=5, steps=8, decode=decode)
    saved = engine.settings
    engine.settings = saved.model_copy(update={"max_num_batched_tokens": 1})
    try:
        chunked = engine.topk_logprobs(requests_, k=5, steps=8, decode=decode)
    finally:
        engine.settings = saved
    for a, b in zip(one_pass, chunked, strict=True):
        for step_a, step_b in zip(a, b, strict=True):
            assert [t for t, _ in step_a] == [t for t, _ in step_b]
            assert max(abs(x[1] - y[1]) for x, y in zip(step_a, step_b, strict=True)) < TOLERANCE


def test_static_decode_matches_hf_forward(engine, requests_) -> None:
    hf = engine.topk_logprobs(requests_[:2], k=5, steps=8, decode="hf")
    static = engine.topk_logprobs(requests_[:2], k=5, steps=8, decode="static")
    for a, b in zip(hf, static, strict=True):
        for step_a, step_b in zip(a, b, strict=True):
            assert [t for t, _ in step_a] == [t for t, _ in step_b]
            assert max(abs(x[1] - y[1]) for x, y in zip(step_a, step_b, strict=True)) < TOLERANCE


def test_fused_projections_share_the_hf_weights(engine) -> None:
    """The decode step's q/k/v and gate/up GEMMs read the same memory as the HF modules (views of
    one buffer each), so fusing costs no memory and the prefill sees the same weights."""
    from worker.engines.transformers.static_decode import fuse_projections

    layer = engine.model.model.language_model.layers[0]
    qkv, _ = layer.self_attn.ocrq_qkv
    gate_up, _ = layer.mlp.ocrq_gate_up
    q, k, v = layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight
    assert q.data_ptr() == qkv.data_ptr() and layer.mlp.gate_proj.weight.data_ptr() == gate_up.data_ptr()
    assert torch.equal(torch.cat([q, k, v]), qkv)
    assert torch.equal(torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]), gate_up)
    fuse_projections(engine.model)  # idempotent: the buffers stay
    assert layer.self_attn.ocrq_qkv[0] is qkv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_step_arithmetic_equals_hf(dtype: torch.dtype) -> None:
    """On the CPU the lean step's RMSNorm and roll-based RoPE are HF's arithmetic bit for bit,
    bf16 too (on CUDA the fused norm rounds apart: tests/gpu)."""
    from transformers.models.hunyuan_vl.modeling_hunyuan_vl import HunYuanVLRMSNorm, rotate_half

    from worker.engines.transformers.static_decode import _norm

    gen = torch.Generator().manual_seed(0)
    norm = HunYuanVLRMSNorm(256, eps=1e-5).to(dtype)
    norm.weight.data = torch.randn(256, generator=gen).to(dtype)
    x = (torch.randn(16, 256, generator=gen) * 3).to(dtype)
    assert torch.equal(norm(x), _norm(x, norm.weight, 1e-5))
    q, cos, sin = (torch.randn(shape, generator=gen) for shape in ((4, 24, 128), (4, 1, 128), (4, 1, 128)))
    signed = torch.cat((-sin[..., :64], sin[..., 64:]), dim=-1)
    assert torch.equal(q * cos + rotate_half(q) * sin, q * cos + q.roll(64, dims=-1) * signed)


def test_memory_on_cpu_is_empty(engine) -> None:
    sample = engine.memory()
    assert sample.peak is None and sample.allocated is None
    engine.reset_peak()

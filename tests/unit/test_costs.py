"""worker.memory.costs: HunyuanOCR's image → token rule and the model byte profile."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.memory.costs import (
    MAX_PIXELS,
    MIN_PIXELS,
    MemorySample,
    ModelProfile,
    estimate_parameters,
    hunyuan_resize,
    hunyuan_vision_tokens,
    usable_free,
)

# Golden values from transformers 5.19 ``hunyuan_vl.image_processing_pil_hunyuan_vl.smart_resize``
# (factor 32, 512²..2048²) and the processor's ``patch_h * (patch_w + 1) + 2`` expansion,
# recorded once: importing transformers takes ~10 s, too slow for a unit test.
GOLDEN = [
    # (width, height) -> (resized width, resized height, vision tokens)
    ((1024, 768), (1024, 768, 794)),
    ((2048, 1536), (2048, 1536, 3122)),
    ((100, 100), (512, 512, 274)),
    ((4000, 3000), (2336, 1760, 4072)),
    ((5100, 6600), (1792, 2304, 4106)),
    ((640, 480), (640, 480, 317)),
    ((1, 150), (64, 6272, 590)),
    ((3000, 20), (6272, 64, 396)),
    ((2481, 3508), (1696, 2432, 4106)),
    ((800, 600), (800, 608, 496)),
    ((513, 511), (512, 512, 274)),
]

# HunyuanOCR-1.5 as transformers nests it (the text model of the checkpoint's config.json)
TEXT_15: dict[str, int] = {
    "hidden_size": 1024, "intermediate_size": 3584, "num_hidden_layers": 24,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 120818,
}
HUNYUAN_15: dict[str, object] = {
    "model_type": "hunyuan_vl",
    "tie_word_embeddings": True,
    "text_config": TEXT_15,
    "vision_config": {
        "hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
        "num_attention_heads": 16, "patch_size": 16, "spatial_merge_size": 2, "out_hidden_size": 1024,
    },
}


@pytest.mark.parametrize(("size", "expected"), GOLDEN)
def test_matches_transformers_golden_values(size: tuple[int, int], expected: tuple[int, int, int]) -> None:
    w, h = size
    assert hunyuan_resize(w, h) == expected[:2]
    assert hunyuan_vision_tokens(w, h) == expected[2]


def test_reference_page_is_about_795_tokens() -> None:
    # the reference's anchor: 1024×768 → ~795 (the "+2" wrappers included)
    assert abs(hunyuan_vision_tokens(1024, 768) - 795) <= 2
    assert 3000 <= hunyuan_vision_tokens(2048, 1536) <= 3200


@settings(max_examples=150, deadline=None)
@given(st.integers(16, 9000), st.integers(16, 9000))
def test_resize_respects_bounds_and_aspect(width: int, height: int) -> None:
    if max(width, height) / min(width, height) > 50:
        return  # very elongated pages are clamped to one patch row; covered by the golden table
    w, h = hunyuan_resize(width, height)
    assert w % 32 == 0 and h % 32 == 0
    assert MIN_PIXELS <= w * h <= MAX_PIXELS
    # aspect kept up to rounding each side to a multiple of 32 (a narrow side can gain a patch)
    if width >= height:  # scale by the long side, whose rounding matters least
        assert abs(h - height * w / width) <= 64
    else:
        assert abs(w - width * h / height) <= 64


def test_tokens_grow_with_area_between_the_bounds() -> None:
    sizes = [(512, 512), (768, 576), (1024, 768), (1536, 1152), (2048, 1536)]
    tokens = [hunyuan_vision_tokens(w, h) for w, h in sizes]
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)
    # beyond the pixel cap the model resizes down: more raw pixels cost nothing more
    assert hunyuan_vision_tokens(8000, 6000) == hunyuan_vision_tokens(4000, 3000)


def test_pixel_bounds_are_parameters() -> None:
    assert hunyuan_vision_tokens(1024, 768, max_pixels=512 * 512) < hunyuan_vision_tokens(1024, 768)
    assert hunyuan_vision_tokens(64, 64, min_pixels=32 * 32) == 2 * 3 + 2


def test_rejects_empty_images() -> None:
    with pytest.raises(ValueError):
        hunyuan_vision_tokens(0, 10)


def test_profile_from_nested_hf_config() -> None:
    profile = ModelProfile.from_hf_config(HUNYUAN_15)
    assert profile.kv_bytes_per_token == 24 * 8 * 128 * 2 * 2 == 98_304
    assert profile.act_bytes_per_token == pytest.approx(0.25 * 98_304)
    assert profile.name == "hunyuan_vl"
    # ~996M parameters in bf16 ≈ 2 GB of weights
    assert 0.9e9 < estimate_parameters(HUNYUAN_15) < 1.1e9
    assert 1.8e9 < profile.weight_bytes < 2.2e9


def test_profile_tolerates_flat_and_wrapped_layouts() -> None:
    flat = {**TEXT_15}  # Tencent's own config.json is flat
    wrapped = {"config": {"llm_config": TEXT_15}}
    fp32 = ModelProfile.from_hf_config(flat, dtype_bytes=4, weight_bytes=123)
    assert fp32.kv_bytes_per_token == 2 * 98_304
    assert fp32.weight_bytes == 123
    assert ModelProfile.from_hf_config(wrapped).kv_bytes_per_token == 98_304
    # no head_dim / kv heads: derived from hidden size and attention heads
    mha = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256}
    assert ModelProfile.from_hf_config(mha).kv_bytes_per_token == 2 * 4 * 64 * 2 * 2


def test_profile_rejects_a_config_without_a_text_model() -> None:
    with pytest.raises(ValueError, match="num_hidden_layers"):
        ModelProfile.from_hf_config({"vision_config": {"hidden_size": 8}})


def test_cpu_profile_is_tiny() -> None:
    cpu = ModelProfile.cpu_default()
    assert cpu.weight_bytes == 0 and 0 < cpu.bytes_per_token <= 16


def test_usable_free_counts_what_torch_caches_unused() -> None:
    assert usable_free(100, MemorySample(allocated=30, reserved=50)) == 120
    assert usable_free(100, MemorySample(allocated=50, reserved=30)) == 100  # never below NVML's figure
    assert usable_free(100, MemorySample(allocated=None, reserved=50)) == 100

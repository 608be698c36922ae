"""What work costs: HunyuanOCR's image → vision-token rule, a model's token → byte profile, and
the value types engines report and the governor plans with (``ImageCost``, ``MemorySample``), and
the device bytes it plans against.

The governor sizes batches by tokens, not by image count, so the token rule must agree with the
model's own processor (transformers ``HunYuanVLImageProcessor.smart_resize`` and the processor's
``patch_h * (patch_w + 1) + 2`` expansion); ``tests/unit/test_costs.py`` pins golden values taken
from transformers 5.19.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: patch 16 × spatial merge 2: both resized sides are multiples of this
FACTOR = 32
#: HunyuanOCR's defaults (``size.shortest_edge`` / ``size.longest_edge`` are pixel counts)
MIN_PIXELS = 512 * 512
MAX_PIXELS = 2048 * 2048
#: the processor rejects images more elongated than this; validation belongs to the engine
MAX_ASPECT = 200
#: image_start / image_end tokens wrapped around every image span
_EXTRA_TOKENS = 2


def hunyuan_resize(
    width: int, height: int, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS
) -> tuple[int, int]:
    """(width, height) the model actually sees: aspect kept, sides multiples of 32, area within
    [min_pixels, max_pixels]. Mirrors transformers' ``smart_resize`` (which takes height first)."""
    if width < 1 or height < 1:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    h_bar = round(height / FACTOR) * FACTOR
    w_bar = round(width / FACTOR) * FACTOR
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(FACTOR, math.floor(height / beta / FACTOR) * FACTOR)
        w_bar = max(FACTOR, math.floor(width / beta / FACTOR) * FACTOR)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / FACTOR) * FACTOR
        w_bar = math.ceil(width * beta / FACTOR) * FACTOR
    # only reachable with min_pixels ~0 and a side under 16 px: the model still sees one patch row
    return max(FACTOR, w_bar), max(FACTOR, h_bar)


def hunyuan_vision_tokens(
    width: int, height: int, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS
) -> int:
    """Vision tokens of one image: (H/32)·(W/32 + 1) + 2 after the resize (one newline token per
    row of merged patches). 1024×768 → 794, 2048×1536 → 3122."""
    w_bar, h_bar = hunyuan_resize(width, height, min_pixels, max_pixels)
    return (h_bar // FACTOR) * (w_bar // FACTOR + 1) + _EXTRA_TOKENS


@dataclass(frozen=True)
class ImageCost:
    """What one image costs an engine, in tokens; the governor turns it into bytes."""

    vision_tokens: int
    prompt_tokens: int
    output_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.vision_tokens + self.prompt_tokens + self.output_tokens


@dataclass(frozen=True)
class MemorySample:
    """The engine's own accounting of device memory, in bytes (None where it has none)."""

    allocated: int | None = None
    reserved: int | None = None
    #: peak allocated since the last ``reset_peak`` (what the governor calibrates against)
    peak: int | None = None
    #: for paged-KV engines (vLLM): fraction of the KV cache in use, requests waiting/preempted
    kv_usage: float | None = None
    waiting: int | None = None
    preemptions: int | None = None


def resolve_capacity(
    device_total: int | None, engine_capacity: int | None = None, cap: int | None = None
) -> int | None:
    """Bytes the governor may plan against: what the engine says it may use (vLLM:
    gpu_memory_utilization × total) else the device total (NVML), optionally capped."""
    base = engine_capacity if engine_capacity is not None else device_total
    if base is None:
        return cap
    return min(base, cap) if cap is not None else base


def usable_free(device_free: int, sample: MemorySample) -> int:
    """Device bytes this process could still use: NVML's free plus what torch caches unused."""
    slack = 0
    if sample.reserved is not None and sample.allocated is not None:
        slack = max(0, sample.reserved - sample.allocated)
    return device_free + slack


#: CUDA context, cuBLAS/cuDNN workspaces: device memory that torch's peak counters never see
CUDA_OVERHEAD_BYTES = 768 * 2**20
#: activation bytes per token as a fraction of KV bytes per token, before calibration. HunyuanOCR
#: on an H200 measured ~0.18 (123 MB per 1024×768 image at ~1065 tokens, KV 98 KB/token); the
#: prior errs high so the first batches stay small
ACT_FRACTION = 0.25

_TEXT_KEYS = ("text_config", "llm_config", "language_config", "text_model")
_VISION_KEYS = ("vision_config", "visual", "vision_model")


@dataclass(frozen=True)
class ModelProfile:
    """A model's device-memory costs. ``act_bytes_per_token`` is only a prior: the governor
    recalibrates the per-token coefficient from measured peaks."""

    name: str
    weight_bytes: int
    kv_bytes_per_token: int
    act_bytes_per_token: float
    #: memory the engine's peak counter does not report (CUDA context, workspaces)
    overhead_bytes: int = 0
    #: engine pads a batch to its longest sequence (HF generate): cost = n · max, not Σ
    padded: bool = False

    @property
    def bytes_per_token(self) -> float:
        return self.kv_bytes_per_token + self.act_bytes_per_token

    @classmethod
    def from_hf_config(
        cls,
        cfg: Mapping[str, Any],
        dtype_bytes: int = 2,
        *,
        weight_bytes: int | None = None,
        act_fraction: float = ACT_FRACTION,
        overhead_bytes: int = CUDA_OVERHEAD_BYTES,
        padded: bool = False,
    ) -> ModelProfile:
        """Profile from a HF ``config.json`` dict (or ``config.to_dict()``); the text backbone is
        found under text_config/llm_config/... at any depth, or at the top level.
        ``weight_bytes``: the engine's measured figure; else estimated from the config."""
        text = _text_section(cfg)
        layers, _heads, _hidden, kv_heads, head_dim = _attention_dims(text)
        kv = layers * kv_heads * head_dim * 2 * dtype_bytes  # K and V
        if weight_bytes is None:
            weight_bytes = estimate_parameters(cfg) * dtype_bytes
        name = str(cfg.get("model_type") or text.get("model_type") or "hf")
        return cls(name, weight_bytes, kv, act_fraction * kv, overhead_bytes, padded)

    @classmethod
    def cpu_default(cls) -> ModelProfile:
        """CPU engines (RapidOCR): no device to fill; tiny nominal costs so the governor can run
        in count mode with the same code path."""
        return cls(name="rapidocr", weight_bytes=0, kv_bytes_per_token=0, act_bytes_per_token=1.0)


def estimate_parameters(cfg: Mapping[str, Any]) -> int:
    """Rough parameter count (text decoder with gated MLP + ViT encoder + patch merger), for a
    weight-bytes prior when the engine has not measured its weights. HunyuanOCR-1.5: ~0.98 B."""
    text = _text_section(cfg)
    layers, heads, hidden, kv_heads, head_dim = _attention_dims(text)
    inter = _get(text, "intermediate_size", "ffn_dim") or 4 * hidden
    vocab = _get(text, "vocab_size") or 0
    tied = bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    attn = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    total = vocab * hidden * (1 if tied else 2) + layers * (attn + 3 * hidden * inter)
    vision = _first_section(cfg, _VISION_KEYS)
    if vision is not None:
        vh = _get(vision, "hidden_size") or 0
        vi = _get(vision, "intermediate_size") or 4 * vh
        patch = _get(vision, "patch_size") or 14
        out = _get(vision, "out_hidden_size") or hidden
        total += (_get(vision, "num_hidden_layers", "depth") or 0) * (4 * vh * vh + 2 * vh * vi)
        total += 3 * patch * patch * vh + 16 * vh * vh + 4 * vh * out  # patch embed + merger
    return int(total)


def _attention_dims(text: Mapping[str, Any]) -> tuple[int, int, int, int, int]:
    """(layers, heads, hidden, kv_heads, head_dim) of a text backbone's config section."""
    layers = _need(text, "num_hidden_layers", "num_layers", "n_layer")
    heads = _need(text, "num_attention_heads", "n_head")
    hidden = _need(text, "hidden_size", "d_model", "n_embd")
    kv_heads = _get(text, "num_key_value_heads", "num_kv_heads") or heads
    head_dim = _get(text, "head_dim", "attention_head_dim") or hidden // heads
    return layers, heads, hidden, kv_heads, head_dim


def _get(section: Mapping[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = section.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _need(section: Mapping[str, Any], *keys: str) -> int:
    value = _get(section, *keys)
    if value is None:
        raise ValueError(f"model config lacks a positive {' / '.join(keys)}")
    return value


def _first_section(cfg: Mapping[str, Any], keys: tuple[str, ...]) -> Mapping[str, Any] | None:
    """Breadth-first search for the first nested mapping stored under one of ``keys``."""
    queue: deque[Mapping[str, Any]] = deque([cfg])
    while queue:
        node = queue.popleft()
        for key in keys:
            if isinstance(node.get(key), Mapping):
                return node[key]
        queue.extend(v for v in node.values() if isinstance(v, Mapping))
    return None


def _text_section(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    found = _first_section(cfg, _TEXT_KEYS)
    if found is not None:
        return found
    if _get(cfg, "num_hidden_layers", "num_layers", "n_layer"):
        return cfg
    for value in cfg.values():  # e.g. {"config": {...}} wrappers
        if isinstance(value, Mapping) and not any(k in value for k in _VISION_KEYS):
            return _text_section(value)
    return cfg

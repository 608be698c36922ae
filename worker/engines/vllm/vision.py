"""Opt-in: HunyuanOCR's vision tower on groups of pages, not page by page (vLLM 0.26's native model).

vLLM 0.26's ``HunYuanVisionTransformer.forward`` runs each of its 27 layers on each page of a
step separately, in eager mode. On the H200 its engine core was CPU-bound (main thread 94-99 %
of a core, the GPU busy ~75 % of the time) and 30 % of that thread was launching the tower's
kernels, page by page (docs/bench/gpu-vllm.md, "Where the warm set's time goes"). A 1024×768 page is 3,072
patches: ~0.7 ms of GPU work per layer, about what launching the layer costs on the CPU.

With ``engine.vision_group_patches`` = N > 0 the tower runs pages together, in groups of at most
N patches (a page larger than N runs alone), every layer once per group, and the attention gets
the pages' boundaries (``cu_seqlens``: FlashAttention's varlen kernel on CUDA, one SDPA per page
on the CPU). Per page the math is the same; the token-wise GEMMs see a group's pages at once, so
in bf16 their rounding may depend on the group (the batch-invariance tests measure it). N bounds
the activations to those of one N-patch page; 16384 is a little more than a 2048×1536 page
(12,288), the largest of the benchmark. It also drops the tower's one GPU sync (page lengths come
from the grid, on the host).

Measured on the H200 (docs/bench/gpu-vllm.md, 2026-12-02, 16384 patches): each page's first step
in bf16 0.0157 alone vs batch, warm img/s 1.11× and 1.02× vLLM's loop in two A/B pairs, the
tower's share of the engine core's main thread 35 % → 25 %; a small gain, so it stays opt-in.

The worker passes N to every vLLM process as ``OCRQ_VLLM_VISION_GROUP_PATCHES``; the patched
forward reads it per call (0 or unset: vLLM's own loop), so a test can switch it on a live engine.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from itertools import accumulate
from typing import Any

ENV = "OCRQ_VLLM_VISION_GROUP_PATCHES"
_PATCHED_ATTR = "__ocrq_patched__"

#: tower forwards by vLLM's loop and grouped, groups run, most pages in one (tests read these)
stats = {"plain": 0, "grouped": 0, "groups": 0, "largest_group": 0}


def group_patches() -> int:
    try:
        return max(0, int(os.environ.get(ENV, "0") or 0))
    except ValueError:
        return 0


def groups(lengths: Sequence[int], limit: int) -> list[range]:
    """Consecutive pages, each group at most ``limit`` patches (a larger page alone), in order."""
    out: list[range] = []
    start, total = 0, 0
    for i, n in enumerate(lengths):
        if i > start and total + n > limit:
            out.append(range(start, i))
            start, total = i, 0
        total += n
    if lengths:
        out.append(range(start, len(lengths)))
    return out


def install() -> bool:
    """Wrap the native tower's forward (idempotent); the wrapper runs vLLM's own unless N > 0.
    Applied where ``compat`` lists it: releases with the native model (0.26), whose
    ``HunYuanVisionTransformer.forward`` this mirrors."""
    from worker.engines.vllm import compat

    tower = compat.hunyuan_vision().HunYuanVisionTransformer
    if getattr(tower.forward, _PATCHED_ATTR, False):
        return True
    original = tower.forward

    def forward(self: Any, x: Any, grid_thw: list[list[int]]) -> Any:
        limit = group_patches()
        if limit <= 0:
            stats["plain"] += 1
            return original(self, x, grid_thw)
        return _grouped(self, x, grid_thw, limit)

    setattr(forward, _PATCHED_ATTR, True)
    tower.forward = forward
    return True


def _grouped(tower: Any, x: Any, grid_thw: list[list[int]], limit: int) -> list[Any]:
    import torch

    lengths = [int(h) * int(w) for _, h, w in grid_thw]
    hidden = tower.embeddings(x.to(device=tower.device, dtype=tower.dtype), grid_thw)
    hidden = hidden.reshape(x.size(0), -1).unsqueeze(0)  # (1, all patches, D), as vLLM's loop
    parts = hidden.split(lengths, dim=1)
    embeds: list[Any] = []
    stats["grouped"] += 1
    for group in groups(lengths, limit):
        sizes = [lengths[i] for i in group]
        cu = torch.tensor(list(accumulate(sizes, initial=0)), dtype=torch.int32).to(tower.device, non_blocking=True)
        longest = torch.tensor(max(sizes), dtype=torch.int32)  # host: FA's wrapper calls .item() on it
        h = torch.cat([parts[i] for i in group], dim=1) if len(group) > 1 else parts[group[0]]
        for layer in tower.layers:
            h = _block(layer, h, cu, longest)
        for i, page in zip(group, h.split(sizes, dim=1), strict=True):
            embeds.append(tower.perceive(page.contiguous(), size=grid_thw[i][1:]).squeeze(0))
        stats["groups"] += 1
        stats["largest_group"] = max(stats["largest_group"], len(group))
    return embeds


def _block(layer: Any, x: Any, cu: Any, longest: Any) -> Any:
    """``HunYuanVisionBlock.forward`` with the pages' boundaries passed to its attention."""
    attn = layer.self_attn
    qkv, _ = attn.qkv(layer.input_layernorm(x))
    q, k, v = qkv.chunk(3, dim=-1)
    out, _ = attn.o_proj(attn.attn(q, k, v, cu_seqlens=cu, max_seqlen=longest))
    x = x + out
    return x + layer.mlp(layer.post_attention_layernorm(x))

"""Chunked prefill for HunyuanOCR micro-batches (transformers engine).

A micro-batch's prompts (vision tower + text) run in chunks of consecutive rows of at most
``engine.max_num_batched_tokens`` padded prompt tokens, so the activation peak is one chunk's
whatever the batch size, and a batch is bounded by its KV cache alone. Each chunk is cut to its
own longest row; its KV goes straight into the batch's static cache (``StaticDecoder.load_rows``)
or, for the HF decode path, is joined into one DynamicCache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: one chunk's rows, the slot its prompts start at (left padding), and its DynamicCache
Part = tuple[int, int, int, Any]


def prefill_chunks(lengths: Sequence[int], max_tokens: int) -> list[tuple[int, int]]:
    """Consecutive row ranges ``[a, b)`` whose padded size (rows × longest row) stays within
    ``max_tokens``; a row longer than that is a chunk of its own."""
    chunks: list[tuple[int, int]] = []
    a, longest = 0, 0
    for i, n in enumerate(lengths):
        if i > a and (i - a + 1) * max(longest, n) > max_tokens:
            chunks.append((a, i))
            a, longest = i, 0
        longest = max(longest, n)
    if lengths:
        chunks.append((a, len(lengths)))
    return chunks


def prefill(model: Any, enc: dict[str, Any], max_tokens: int, dec: Any = None) -> tuple[Any, list[Part]]:
    """Prefill ``enc`` (the engine's left-padded batch inputs) chunk by chunk. Returns the
    last-position fp32 logits of every row and, without ``dec``, the chunks' caches for
    ``join_caches``; with ``dec`` (a ``StaticDecoder``) each chunk's KV is loaded into it."""
    import torch
    from transformers import DynamicCache

    ids, mask, pos = enc["input_ids"], enc["attention_mask"], enc["position_ids"]
    bsz, plen = ids.shape
    first_patch = [0]
    for n in enc["image_grid_thw"].prod(dim=-1).tolist():
        first_patch.append(first_patch[-1] + int(n))
    logits = torch.empty(bsz, model.lm_head.weight.shape[0], dtype=torch.float32, device=ids.device)
    parts: list[Part] = []
    lengths = mask.sum(dim=1).tolist()
    for a, b in prefill_chunks(lengths, max_tokens):
        start = plen - int(max(lengths[a:b]))
        cache: Any = DynamicCache(config=model.config.text_config)
        out = model(
            input_ids=ids[a:b, start:], attention_mask=mask[a:b, start:], position_ids=pos[:, a:b, start:],
            pixel_values=enc["pixel_values"][first_patch[a]:first_patch[b]],
            image_grid_thw=enc["image_grid_thw"][a:b], mm_token_type_ids=enc["mm_token_type_ids"][a:b, start:],
            past_key_values=cache, use_cache=True, logits_to_keep=1,
        )
        logits[a:b] = out.logits[:, -1].float()
        del out
        if dec is None:
            parts.append((a, b, start, cache))
        else:
            dec.load_rows(cache, slice(a, b), start, mask[a:b, start:])
    return logits, parts


def join_caches(model: Any, parts: list[Part], plen: int) -> Any:
    """One DynamicCache for the whole batch from the chunks' caches (left-padded with zeros to
    ``plen``; the attention mask hides those slots), freeing each chunk layer as it goes."""
    import torch
    from transformers import DynamicCache

    if len(parts) == 1 and parts[0][2] == 0:
        return parts[0][3]
    joined: Any = DynamicCache(config=model.config.text_config)
    for layer_idx in range(len(parts[0][3].layers)):
        keys, values = [], []
        for _a, _b, start, cache in parts:
            layer = cache.layers[layer_idx]
            pad = (0, 0, start, 0)  # head_dim untouched; ``start`` slots on the left
            keys.append(torch.nn.functional.pad(layer.keys, pad))
            values.append(torch.nn.functional.pad(layer.values, pad))
            layer.keys, layer.values = None, None
        joined.update(torch.cat(keys), torch.cat(values), layer_idx)
        del keys, values
    return joined

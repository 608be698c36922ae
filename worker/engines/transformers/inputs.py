"""Model inputs for a HunyuanOCR micro-batch without the processor's numpy pixel path.

The HF processor rescales, normalises and patchifies each image in numpy on one CPU core
(~45 ms per 1024×768 image here), which dominated a batch's prefill on the H200. Here only the
resize stays on the CPU (PIL bicubic, as the processor does); the uint8 pixels go to the device
and are normalised and patchified there with the same fp32 arithmetic, and the prompt's single
image token is spliced into ``n`` placeholder ids instead of tokenizing an expanded string.
``tests/integration/test_transformers_engine.py`` checks the result equals the processor's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def encode_batch(processor: Any, texts: Sequence[str], images: Sequence[Any], device: Any) -> dict[str, Any]:
    """input_ids / attention_mask / mm_token_type_ids (left-padded), pixel_values (fp32, on
    ``device``) and image_grid_thw, as ``processor(text=..., images=..., padding_side="left")``."""
    import numpy as np
    import torch
    from PIL import Image
    from transformers.models.hunyuan_vl.image_processing_pil_hunyuan_vl import smart_resize

    ip, tok = processor.image_processor, processor.tokenizer
    patch, merge = int(ip.patch_size), int(ip.merge_size)
    factor = patch * merge
    mean = torch.tensor(ip.image_mean, dtype=torch.float32, device=device)[:, None, None]
    std = torch.tensor(ip.image_std, dtype=torch.float32, device=device)[:, None, None]
    rescale = float(ip.rescale_factor)
    size = dict(ip.size)
    pixels, grids, rows = [], [], []
    image_id, pad_id = int(processor.image_token_id), int(tok.pad_token_id)
    for text, image in zip(texts, images, strict=True):
        image = image if image.mode == "RGB" else image.convert("RGB")
        h, w = smart_resize(image.height, image.width, factor, size["shortest_edge"], size["longest_edge"])
        if (w, h) != image.size:
            image = image.resize((w, h), Image.Resampling.BICUBIC)
        arr = torch.from_numpy(np.array(image, dtype=np.uint8)).to(device, non_blocking=True)
        x = (arr.permute(2, 0, 1).to(torch.float32) * rescale - mean) / std
        gh, gw = h // patch, w // patch
        x = x.reshape(3, gh // merge, merge, patch, gw // merge, merge, patch)
        pixels.append(x.permute(1, 2, 4, 5, 0, 3, 6).reshape(gh * gw, 3 * patch * patch))
        grids.append([1, gh, gw])
        n_image = (gh // merge) * (gw // merge + 1) + (2 if processor.cat_extra_token else 0)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        at = ids.index(image_id)  # one image per prompt: its placeholder becomes n_image ids
        rows.append(ids[:at] + [image_id] * n_image + ids[at + 1:])
    length = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for b, r in enumerate(rows):
        input_ids[b, length - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[b, length - len(r):] = 1
    input_ids, mask = input_ids.to(device), mask.to(device)
    return {
        "input_ids": input_ids,
        "attention_mask": mask,
        "mm_token_type_ids": (input_ids == image_id).long(),
        "pixel_values": torch.cat(pixels, dim=0),
        "image_grid_thw": torch.tensor(grids, dtype=torch.long, device=device),
    }

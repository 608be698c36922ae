"""Device out-of-memory: shrinking an image that does not fit alone (the engine loop's last
resort before ``TooLargeForDevice``). Recognising an OOM is ``ocrq.errors.is_oom``, re-exported."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from PIL import Image

from ocrq.errors import is_oom
from ocrq.results import OcrOutput
from worker.engines.base import ImageCost, OcrRequest

__all__ = ["downscale_for_memory", "is_oom", "restore_scale"]


def downscale_for_memory(
    request: OcrRequest, cost: Callable[[OcrRequest], ImageCost]
) -> OcrRequest | None:
    """The request with its image shrunk (aspect kept) until it costs at most half the vision
    tokens; None when shrinking lowers nothing (the model upsamples to its minimum anyway).

    Tokens, not raw pixels: an image above the model's pixel cap is resized down by the model
    anyway, so halving its raw pixels alone would change nothing. Candidate sizes are priced on
    a 1-bit stand-in image; only the chosen size is resampled."""
    width, height = request.image.size
    before = cost(request).vision_tokens
    best: tuple[int, int] | None = None
    for step in range(1, 13):
        scale = 0.5 ** (step / 2)
        size = (max(1, round(width * scale)), max(1, round(height * scale)))
        tokens = cost(replace(request, image=Image.new("1", size))).vision_tokens
        if tokens < before and best is None:
            best = size
        if tokens <= before / 2:
            best = size
            break
        if size == (1, 1):
            break
    if best is None:
        return None
    return replace(request, image=request.image.resize(best, Image.Resampling.BICUBIC))


def restore_scale(output: OcrOutput, original: tuple[int, int], small: tuple[int, int]) -> OcrOutput:
    """Boxes back in the original image's pixels; the downscale recorded in meta."""
    fx, fy = original[0] / small[0], original[1] / small[1]
    lines = [
        ln.model_copy(update={"box": [[p[0] * fx, p[1] * fy] for p in ln.box]}) if ln.box else ln
        for ln in output.lines
    ]
    meta = {**output.meta, "downscaled_for_memory": {"from": list(original), "to": list(small)}}
    return output.model_copy(
        update={"lines": lines, "width": original[0], "height": original[1], "meta": meta}
    )

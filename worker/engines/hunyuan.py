"""HunyuanOCR facts shared by every engine that hosts it (transformers, vLLM in-process, vLLM server).

Prompts per task and version (the table is ``ocrq.prompts``, shared with producers), sampling
defaults, chat messages, output parsers (spotting boxes, extraction JSON), the repetition
early-stop rule, the token cost of an image and the memory numbers of a checkpoint. Pure Python:
torch/transformers are imported only inside the helpers that load a processor.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ocrq.engine_settings import HunyuanSettings
from ocrq.prompts import Version, prompt
from ocrq.results import OcrLine, OcrOutput
from worker.engines.base import ImageCost, OcrRequest
from worker.memory.costs import hunyuan_vision_tokens


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float
    max_tokens: int = 32768


#: model-card defaults; all are greedy (temperature 0): top_k 1 (1.0) or -1 "off" (1.5)
SAMPLING: dict[Version, Sampling] = {
    "1.0": Sampling(temperature=0.0, top_p=1.0, top_k=1, repetition_penalty=1.0),
    "1.5": Sampling(temperature=0.0, top_p=1.0, top_k=-1, repetition_penalty=1.08),
}


def version_of(settings: HunyuanSettings) -> Version:
    v = str(settings.extra.get("hunyuan_version", "1.5"))
    if v == "1.0":
        return "1.0"
    if v == "1.5":
        return "1.5"
    raise ValueError(f"hunyuan_version must be '1.0' or '1.5', not {v!r}")


def build_messages(
    task: str, params: Mapping[str, Any] | None = None, version: Version = "1.5"
) -> list[dict[str, Any]]:
    """OpenAI/HF chat messages as the model was trained: empty system message, user [image, text]."""
    return [
        {"role": "system", "content": ""},
        {"role": "user",
         "content": [{"type": "image"}, {"type": "text", "text": prompt(task, params, version)}]},
    ]


# ---------------------------------------------------------------------------------------------
# output parsing
# ---------------------------------------------------------------------------------------------

_NUM = r"\s*(-?\d+(?:\.\d+)?)\s*"
_LEGACY = re.compile(rf"(?P<text>.*?)\({_NUM},{_NUM}\)\s*,\s*\({_NUM},{_NUM}\)", re.S)
_TAGS = re.compile(r"</?(?:ref|quad|box)>")


def _to_pixels(coords: Sequence[float], width: int, height: int) -> list[list[float]]:
    """0..1000 normalised [x1,y1,x2,y2] (rectangle) or 4 points (quad) → pixel polygon."""
    sx, sy = width / 1000.0, height / 1000.0

    def pt(x: float, y: float) -> list[float]:
        return [round(min(max(x * sx, 0.0), width), 1), round(min(max(y * sy, 0.0), height), 1)]

    if len(coords) == 8:
        return [pt(coords[i], coords[i + 1]) for i in range(0, 8, 2)]
    x1, y1, x2, y2 = coords
    return [pt(x1, y1), pt(x2, y1), pt(x2, y2), pt(x1, y2)]


def parse_spotting_legacy(text: str, width: int, height: int) -> list[OcrLine]:
    """1.0 format: ``text(x1,y1),(x2,y2)`` repeated (``<ref>``/``<quad>`` tags tolerated)."""
    lines = []
    for m in _LEGACY.finditer(_TAGS.sub("", text)):
        content = m.group("text").strip()
        if content:
            coords = [float(m.group(i)) for i in range(2, 6)]
            lines.append(OcrLine(text=content, box=_to_pixels(coords, width, height)))
    return lines


def parse_spotting_json(text: str, width: int, height: int) -> list[OcrLine]:
    """1.5 format: ``[{"box": [xmin, ymin, xmax, ymax], "text": ...}, ...]`` (fences tolerated)."""
    data = parse_json_output(text)
    if isinstance(data, dict):
        data = data.get("items") or data.get("results") or [data]
    lines = []
    for item in data if isinstance(data, list) else []:
        if not isinstance(item, dict) or "text" not in item:
            continue
        raw = item.get("box") or item.get("bbox") or item.get("quad")
        flat: list[float] = []
        for v in raw if isinstance(raw, list) else []:
            flat.extend(v if isinstance(v, list) else [v])
        try:
            coords = [float(v) for v in flat]
        except (TypeError, ValueError):
            coords = []
        box = _to_pixels(coords, width, height) if len(coords) in (4, 8) else None
        lines.append(OcrLine(text=str(item["text"]), box=box))
    return lines


def parse_spotting(text: str, width: int, height: int) -> list[OcrLine]:
    """Either spotting format, whichever the output is in."""
    stripped = _strip_fence(text)
    if stripped.startswith(("[", "{")) or '"box"' in stripped:
        lines = parse_spotting_json(stripped, width, height)
        if lines:
            return lines
    return parse_spotting_legacy(text, width, height)


_FENCE = re.compile(r"```(?:json|JSON)?\s*(.*?)\s*```", re.S)


def _strip_fence(text: str) -> str:
    m = _FENCE.search(text)
    body = m.group(1) if m else text
    body = body.strip()
    if body.lower().startswith("json") and body[4:5] in ("\n", " ", "{", "["):
        body = body[4:].strip()
    return body


def parse_json_output(text: str) -> Any | None:
    """The JSON value in a model answer (```json fences, a leading "json" and chatter tolerated);
    None when there is none."""
    body = _strip_fence(text)
    try:
        return json.loads(body)
    except ValueError:
        pass
    decoder = json.JSONDecoder()
    for i, ch in enumerate(body):
        if ch in "{[":
            try:
                return decoder.raw_decode(body[i:])[0]
            except ValueError:
                continue
    return None


# ---------------------------------------------------------------------------------------------
# repetition early stop
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Repetition:
    #: length of the repeating unit (tokens or characters) and how often it repeats at the tail
    unit: int
    repeats: int

    @property
    def span(self) -> int:
        return self.unit * self.repeats


def detect_repetition(
    seq: Sequence[int] | str, min_repeats: int, max_unit: int = 64, min_span: int = 24
) -> Repetition | None:
    """A short unit (≤ ``max_unit``) repeating ≥ ``min_repeats`` times back to back at the tail,
    covering ≥ ``min_span`` elements (so a legit "......" leader of a few tokens is not a loop).
    The shortest such unit wins. ``min_repeats`` ≤ 1 disables the check."""
    n = len(seq)
    if min_repeats <= 1 or n < max(min_repeats, min_span):
        return None
    for unit in range(1, min(max_unit, n // min_repeats) + 1):
        tail = seq[n - unit:]
        repeats = 1
        pos = n - 2 * unit
        while pos >= 0 and seq[pos:pos + unit] == tail:
            repeats += 1
            pos -= unit
        if repeats >= min_repeats and unit * repeats >= min_span:
            return Repetition(unit=unit, repeats=repeats)
    return None


# ---------------------------------------------------------------------------------------------
# costs and memory numbers
# ---------------------------------------------------------------------------------------------


def vision_tokens(width: int, height: int, min_pixels: int = 512 * 512, max_pixels: int = 2048 * 2048) -> int:
    """Tokens one image occupies in the prompt: (H/32)·(W/32 + 1) + 2 after the model's resize
    (the image start/end wrapper tokens come on top); the formula lives in ``worker.memory.costs``."""
    return int(hunyuan_vision_tokens(width, height, min_pixels, max_pixels))


#: chat-template tokens besides the vision span and the instruction: bos, system separator,
#: image start, image end, user marker (counted on the rendered template)
_TEMPLATE_TOKENS = 5


def prompt_tokens(task: str, params: Mapping[str, Any] | None = None, version: Version = "1.5") -> int:
    """Prompt tokens besides the vision span, estimated without a tokenizer: template tokens +
    ≈ 1 per CJK char + 1 per 3 other bytes (generous for the real Hunyuan tokenizer, the safe
    side for a memory budget; the random checkpoints' byte tokenizer uses 3 per CJK char)."""
    text = prompt(task, params, version)
    cjk = sum(1 for ch in text if ord(ch) > 0x2E80)
    other = len(text.encode("utf-8")) - 3 * cjk
    return _TEMPLATE_TOKENS + cjk + math.ceil(max(other, 0) / 3)


def cost(request: OcrRequest, settings: HunyuanSettings) -> ImageCost:
    width, height = request.image.size
    max_new = int(request.params.get("max_new_tokens", settings.max_new_tokens))
    return ImageCost(
        vision_tokens=vision_tokens(width, height, settings.min_pixels, settings.max_pixels),
        prompt_tokens=prompt_tokens(request.task, request.params, version_of(settings)),
        output_tokens=max_new,
    )


# ---------------------------------------------------------------------------------------------
# processor loading (torchvision-free)
# ---------------------------------------------------------------------------------------------


def ensure_pil_processor() -> None:
    """Register the PIL image processor for HunYuanVLConfig. transformers hands out a dummy for it
    when torchvision is missing (the class is marked as needing torchvision but does not use it);
    registering the real class makes ``AutoProcessor`` pick it. Idempotent."""
    from transformers import AutoImageProcessor, HunYuanVLConfig
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        return
    from transformers.models.hunyuan_vl.image_processing_pil_hunyuan_vl import HunYuanVLImageProcessorPil

    # the torchvision slot holds a placeholder that fails registration's class check: clear it
    AutoImageProcessor.register(
        HunYuanVLConfig,
        image_processor_classes={"pil": HunYuanVLImageProcessorPil, "torchvision": None},  # type: ignore[dict-item]
        exist_ok=True,
    )


def load_processor(
    model_dir: Path | str, min_pixels: int | None = None, max_pixels: int | None = None
) -> Any:
    """The checkpoint's processor with the PIL image backend (same resize on every host, with or
    without torchvision), optionally with other pixel bounds."""
    from transformers import AutoProcessor

    ensure_pil_processor()
    processor = AutoProcessor.from_pretrained(str(model_dir), backend="pil")
    if min_pixels is not None or max_pixels is not None:
        size = dict(processor.image_processor.size)
        if min_pixels is not None:
            size["shortest_edge"] = min_pixels
        if max_pixels is not None:
            size["longest_edge"] = max_pixels
        processor.image_processor.size = size
    return processor


def build_output(
    request: OcrRequest, text: str, *, engine: str, revision: str, settings: HunyuanSettings,
    meta: dict[str, Any],
) -> OcrOutput:
    """An engine answer as ``OcrOutput`` (spotting → pixel boxes, extract → parsed JSON), with the
    same meta keys the transformers engine writes. Shared by both vLLM engines."""
    width, height = request.image.size
    text = text.strip()
    meta = {
        "task": request.task,
        "vision_tokens": vision_tokens(width, height, settings.min_pixels, settings.max_pixels),
        **meta,
    }
    lines = []
    if request.task == "spotting":
        lines = parse_spotting(text, width, height)
        meta["raw"] = text
        text = "\n".join(line.text for line in lines) if lines else text
    elif request.task == "extract":
        meta["fields"] = parse_json_output(text)
    return OcrOutput(text=text, lines=lines, engine=engine, model=revision, width=width, height=height,
                     meta=json.loads(json.dumps(meta, default=str)))

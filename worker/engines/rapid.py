"""RapidOCR (PP-OCR det + cls + rec on ONNX Runtime): the CPU engine of the embedded default.

RapidOCR reads one image per call (no real batching), so ``infer`` loops; one engine-loop thread
calls it, so the RapidOCR object needs no lock. Models are the ones shipped inside the rapidocr
wheel: ``start`` pins their paths explicitly, so RapidOCR's downloader is never reached and a
missing model fails at start-up instead of fetching from the network mid-job.

Outputs are deterministic (no timings in ``meta``): the same image gives byte-identical JSON
alone or in any batch, which keeps cache/store writes idempotent.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from ocrq.errors import BadImage, EngineCrashed, EngineOOM, OcrqError, classify
from ocrq.results import OcrLine, OcrOutput
from ocrq.settings import EngineSettings
from worker.engines.base import ImageCost, MemorySample, OcrRequest

#: Global.max_side_len RapidOCR applies before detection (its default; kept explicit so
#: ``cost`` and the engine agree)
_MAX_SIDE = 2000
#: pixels per "vision token" in ``cost`` (a 32×32 patch): only relative weights matter on CPU
_PIXELS_PER_TOKEN = 1024
#: two boxes share a text row when their vertical overlap is at least this share of the
#: shorter box's height (tolerates the slight skew of photographed receipts)
_ROW_OVERLAP = 0.5


class RapidOcrEngine:
    """``Engine`` backed by RapidOCR 3.x; construct with the ``engine`` section of the settings."""

    name = "rapidocr"

    def __init__(self, settings: EngineSettings) -> None:
        self._settings = settings
        self._ocr: Any = None
        self._revision: str | None = None
        self._models: dict[str, tuple[Path, str]] | None = None

    # --- identity -------------------------------------------------------------------------

    @property
    def revision(self) -> str:
        """``rapidocr-<ver>:<det>@<sha8>,<cls>@<sha8>,<rec>@<sha8>:p<params digest>``.

        Model file names carry the PP-OCR generation and size; the sha prefixes come from the
        wheel's own model table, so an upgrade that swaps weights under the same name still
        changes the key. Tuning parameters change outputs too, hence the params digest.
        """
        if self._revision is None:
            models = ",".join(f"{path.stem}@{sha[:8]}" for path, sha in self._model_files().values())
            tuned = json.dumps(self.params, sort_keys=True, default=str)
            digest = hashlib.sha256(tuned.encode()).hexdigest()[:8]
            self._revision = f"rapidocr-{package_version('rapidocr')}:{models}:p{digest}"
        return self._revision

    @property
    def params(self) -> dict[str, Any]:
        """RapidOCR params that shape the output (model paths are added in ``start``)."""
        s = self._settings
        params: dict[str, Any] = {
            # "max" caps the long side instead of RapidOCR's default "min 736", which upscales
            # small crops (a 300×40 single line becomes 5520×736) and blurs strokes into
            # merged or missed boxes; capping keeps small images at native resolution.
            "Det.limit_type": s.rapid_limit_type,
            "Det.limit_side_len": int(s.rapid_limit_side_len),
            "Global.max_side_len": _MAX_SIDE,
            "Global.log_level": "warning",
        }
        # operator overrides, e.g. extra: {rapidocr: {"Det.unclip_ratio": 1.8}}
        params.update(dict(s.extra.get("rapidocr", {})))
        return params

    def _model_files(self) -> dict[str, tuple[Path, str]]:
        """Section -> (wheel-local model path, expected sha256), resolved by RapidOCR's own table."""
        if self._models is None:
            from rapidocr.inference_engine.base import FileInfo, InferSession
            from rapidocr.main import DEFAULT_CFG_PATH, root_dir
            from rapidocr.utils.parse_parameters import ParseParams

            cfg = ParseParams.load(DEFAULT_CFG_PATH)
            cfg = ParseParams.update_batch(cfg, self.params)
            models: dict[str, tuple[Path, str]] = {}
            for section in ("Det", "Cls", "Rec"):
                sec = cfg[section]
                info = InferSession.get_model_url(FileInfo(
                    engine_type=sec.engine_type, ocr_version=sec.ocr_version,
                    task_type=sec.task_type, lang_type=sec.lang_type, model_type=sec.model_type,
                ))
                path = Path(root_dir) / "models" / Path(str(info["model_dir"])).name
                models[section] = (path, str(info["SHA256"]))
            self._models = models
        return self._models

    # --- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        from rapidocr import RapidOCR

        params = self.params
        for section, (path, _sha) in self._model_files().items():
            if not path.is_file():
                raise EngineCrashed(f"RapidOCR {section} model missing from the wheel: {path}")
            # an explicit model_path skips RapidOCR's download-if-absent branch entirely
            params[f"{section}.model_path"] = str(path)
        ocr = RapidOCR(params=params)
        # RapidOCR loads its three sessions lazily on first use; load them now so a broken
        # install fails here and the first image does not pay the load time.
        for loader in ("_load_det_model", "_load_cls_model", "_load_rec_model"):
            load = getattr(ocr, loader, None)
            if callable(load):
                load()
        self._ocr = ocr

    def close(self) -> None:
        self._ocr = None

    def memory(self) -> MemorySample:
        return MemorySample()

    def reset_peak(self) -> None:
        return None

    # --- cost ---------------------------------------------------------------------------------

    def cost(self, request: OcrRequest) -> ImageCost:
        """Pixels the detector actually sees, in 32×32 patches (recognition adds work per line
        found, which cannot be known up front)."""
        w, h = _det_size(request.image.size, self._settings)
        tokens = max(1, math.ceil(w * h / _PIXELS_PER_TOKEN))
        return ImageCost(vision_tokens=tokens, prompt_tokens=0, output_tokens=0)

    # --- inference ------------------------------------------------------------------------------

    def infer(self, batch: Sequence[OcrRequest]) -> list[OcrOutput | OcrqError]:
        if self._ocr is None:
            raise EngineCrashed("RapidOcrEngine.infer called before start()")
        return [self._infer_one(request) for request in batch]

    def _infer_one(self, request: OcrRequest) -> OcrOutput | OcrqError:
        try:
            pixels = _to_bgr(request.image)
        except OcrqError as exc:
            return exc
        except Exception as exc:  # a truncated/odd image fails while its pixels are read
            return BadImage(f"{type(exc).__name__}: {exc}")
        height, width = pixels.shape[:2]
        try:
            result = self._ocr(pixels)
        except MemoryError as exc:
            return EngineOOM(f"RapidOCR ran out of memory on a {width}x{height} image: {exc}")
        except Exception as exc:
            return classify(exc)
        rows = _rows(_lines(result))
        return OcrOutput(
            # one output line per text row, the boxes of a row joined by a space
            text="\n".join(" ".join(line.text for line in row) for row in rows),
            lines=[line for row in rows for line in row],
            engine=self.name,
            model=self.revision,
            width=width,
            height=height,
        )


# --- helpers (pure) --------------------------------------------------------------------------


def _det_size(size: tuple[int, int], settings: EngineSettings) -> tuple[int, int]:
    """The image size after RapidOCR's long-side cap and the detector's limit rule."""
    w, h = size
    scale = min(1.0, _MAX_SIDE / max(w, h, 1))
    side = settings.rapid_limit_side_len
    if settings.rapid_limit_type == "max":
        scale *= min(1.0, side / max(w * scale, h * scale, 1))
    else:
        scale *= max(1.0, side / max(min(w * scale, h * scale), 1))
    return max(32, round(w * scale / 32) * 32), max(32, round(h * scale / 32) * 32)


def _to_bgr(image: Image.Image) -> np.ndarray:
    """PIL image of any mode -> contiguous uint8 BGR array (what RapidOCR's ndarray path
    expects). Transparent pixels are composited on white so dark text stays readable."""
    w, h = image.size
    if w < 1 or h < 1:
        raise BadImage(f"image has no pixels ({w}x{h})")
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        canvas = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        image = Image.alpha_composite(canvas, rgba)
    if image.mode != "RGB":
        image = image.convert("RGB")
    rgb = np.asarray(image, dtype=np.uint8)
    return np.ascontiguousarray(rgb[:, :, ::-1])


def _lines(result: Any) -> list[OcrLine]:
    """RapidOCROutput -> OcrLine list (empty text dropped; order as detected)."""
    boxes = getattr(result, "boxes", None)
    txts = getattr(result, "txts", None)
    scores = getattr(result, "scores", None)
    if boxes is None or txts is None or len(txts) == 0:
        return []
    lines = [
        OcrLine(
            text=str(text).strip(),
            box=[[round(float(x), 1), round(float(y), 1)] for x, y in np.asarray(box).reshape(-1, 2)],
            confidence=round(float(score), 4) if score is not None else None,
        )
        for box, text, score in zip(boxes, txts, scores or [None] * len(txts), strict=True)
        if str(text).strip()
    ]
    return lines


def _span(line: OcrLine) -> tuple[float, float, float]:
    """(top, bottom, left) of a line's box."""
    pts = line.box or [[0.0, 0.0]]
    ys = [p[1] for p in pts]
    return min(ys), max(ys), min(p[0] for p in pts)


def _rows(lines: list[OcrLine]) -> list[list[OcrLine]]:
    """Group lines into text rows: a line joins the row whose vertical band it overlaps most
    (by at least ``_ROW_OVERLAP`` of the shorter height); rows sorted top-down, lines left-right."""
    rows: list[tuple[float, float, list[OcrLine]]] = []
    for line in sorted(lines, key=lambda ln: (sum(_span(ln)[:2]) / 2, _span(ln)[2])):
        top, bottom, _ = _span(line)
        best, best_overlap = -1, 0.0
        for i, (r_top, r_bottom, _members) in enumerate(rows):
            overlap = min(bottom, r_bottom) - max(top, r_top)
            shorter = max(min(bottom - top, r_bottom - r_top), 1e-6)
            if overlap / shorter >= _ROW_OVERLAP and overlap / shorter > best_overlap:
                best, best_overlap = i, overlap / shorter
        if best < 0:
            rows.append((top, bottom, [line]))
        else:
            r_top, r_bottom, members = rows[best]
            members.append(line)
            # the row band is the members' median band, so one tall box cannot swallow the page
            tops = sorted(_span(m)[0] for m in members)
            bottoms = sorted(_span(m)[1] for m in members)
            rows[best] = (tops[len(tops) // 2], bottoms[len(bottoms) // 2], members)
    rows.sort(key=lambda r: (r[0] + r[1]) / 2)
    return [sorted(members, key=lambda ln: _span(ln)[2]) for _t, _b, members in rows]

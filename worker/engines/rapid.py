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

from ocrq.engine_settings import RapidOcrSettings
from ocrq.errors import BadImage, EngineCrashed, EngineOOM, OcrqError, classify
from ocrq.results import OcrLine, OcrOutput
from worker.engines.base import ImageCost, MemorySample, OcrRequest
from worker.engines.reading_order import reading_order

#: Global.max_side_len RapidOCR applies before detection (its default; kept explicit so
#: ``cost`` and the engine agree)
_MAX_SIDE = 2000
#: pixels per "vision token" in ``cost`` (a 32×32 patch): only relative weights matter on CPU
_PIXELS_PER_TOKEN = 1024


class RapidOcrEngine:
    """``Engine`` backed by RapidOCR 3.x; construct with the ``engine`` section of the settings."""

    name = "rapidocr"

    def __init__(self, settings: RapidOcrSettings) -> None:
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
            # small images until the short side is 736 (a 520×64 text line becomes 5980×736):
            # 26x slower on that line (5.7 s vs 0.22 s here) and no more accurate on the
            # samples or the corpus (mean CER within 0.01 for max 960/1280/1536 and min 736).
            "Det.limit_type": s.rapid_limit_type,
            "Det.limit_side_len": int(s.rapid_limit_side_len),
            "Global.max_side_len": _MAX_SIDE,
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

        # "error": an image without text is normal, not worth RapidOCR's per-image warning
        params = {**self.params, "Global.log_level": "error"}
        for section, (path, _sha) in self._model_files().items():
            if not path.is_file():
                raise EngineCrashed(f"RapidOCR {section} model missing from the wheel: {path}")
            # an explicit model_path skips RapidOCR's download-if-absent branch entirely
            params[f"{section}.model_path"] = str(path)
        ocr = RapidOCR(params=params)
        # RapidOCR loads its three onnxruntime InferenceSessions lazily on first use; load them now so a broken
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
        """Pixels RapidOCR works on (after its 2000 px long-side cap), in 32×32 patches.

        Detection is capped at ``rapid_limit_side_len`` and costs about the same for any page;
        recognition runs once per text line and dominates on dense pages (a 2364×1820 page of
        print: ~9 s, a receipt: 1-3 s), and a page's line count grows with its pixels."""
        w, h = request.image.size
        scale = min(1.0, _MAX_SIDE / max(w, h, 1))
        tokens = math.ceil(w * scale * h * scale / _PIXELS_PER_TOKEN)
        return ImageCost(vision_tokens=max(1, tokens), prompt_tokens=0, output_tokens=0)

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
        rows = reading_order(_lines(result))
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

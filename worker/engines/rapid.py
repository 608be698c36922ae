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
from dataclasses import dataclass
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
#: text-column test of the reading order (see ``_column_split``): lines per side, a side's
#: share of the region width, median line width over the side's width, median characters/line
_MIN_COLUMN_LINES = 3
_MIN_COLUMN_SHARE = 0.25
_COLUMN_FILL = 0.5
_MIN_COLUMN_CHARS = 10
#: share of a region's lines that may cross a column gutter (headings, pull quotes)
_MAX_CROSSING = 0.15
#: recursion bound of the XY-cut (a leaf beyond it is grouped into rows as a whole)
_MAX_DEPTH = 64


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
        rows = _reading_order(_lines(result))
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


# --- reading order ----------------------------------------------------------------------------
# A recursive XY-cut: a region splits at a column gutter when one qualifies, else at its widest
# horizontal gap, and a leaf is grouped into text rows. Without a gutter this equals plain row
# grouping (top-down, left-right); with one, a two-column page reads column by column instead of
# interleaving the columns line by line (measured on the UNLV pages of the corpus).


@dataclass(frozen=True)
class _Item:
    x0: float
    y0: float
    x1: float
    y1: float
    line: OcrLine


def _skew(lines: Sequence[OcrLine]) -> float:
    """Median slope (radians) of the boxes' top edges: a photographed page is often tilted a
    few degrees, enough for neighbouring rows to overlap vertically."""
    slopes = sorted(
        math.atan2(b[1][1] - b[0][1], b[1][0] - b[0][0])
        for b in (ln.box for ln in lines) if b and len(b) >= 2 and b[1][0] > b[0][0]
    )
    return slopes[len(slopes) // 2] if slopes else 0.0


def _reading_order(lines: Sequence[OcrLine]) -> list[list[OcrLine]]:
    """Lines -> text rows in reading order (rows top-down, lines left-right within a row),
    computed in a frame turned by the page's skew."""
    angle = _skew(lines)
    cos, sin = math.cos(-angle), math.sin(-angle)
    items = []
    for line in lines:
        pts = line.box or [[0.0, 0.0]]
        xs = [x * cos - y * sin for x, y in pts]
        ys = [x * sin + y * cos for x, y in pts]
        items.append(_Item(min(xs), min(ys), max(xs), max(ys), line))
    return _xycut(items, depth=0)


def _xycut(items: list[_Item], depth: int) -> list[list[OcrLine]]:
    if len(items) < 2 * _MIN_COLUMN_LINES or depth > _MAX_DEPTH:
        return _rows(items)
    split = _column_split(items)
    if split is not None:
        left, right, crossing = split
        # a heading across the columns reads first; captions and pull quotes after them
        top = min(it.y0 for it in left + right)
        head = [it for it in crossing if it.y1 <= top]
        tail = [it for it in crossing if it.y1 > top]
        return _rows(head) + _xycut(left, depth + 1) + _xycut(right, depth + 1) + _rows(tail)
    gap = _widest_gap([(it.y0, it.y1) for it in items])
    if gap is None:
        return _rows(items)
    above = [it for it in items if it.y1 <= gap]
    below = [it for it in items if it.y1 > gap]
    return _xycut(above, depth + 1) + _xycut(below, depth + 1)


def _widest_gap(spans: list[tuple[float, float]]) -> float | None:
    """Start of the widest empty interval between the union of ``spans`` (None: no gap)."""
    spans = sorted(spans)
    reach, best, best_width = spans[0][1], None, 0.0
    for start, end in spans[1:]:
        if start - reach > best_width:
            best, best_width = reach, start - reach
        reach = max(reach, end)
    return best


def _column_split(items: list[_Item]) -> tuple[list[_Item], list[_Item], list[_Item]] | None:
    """(left, right, crossing) when a vertical gutter splits ``items`` into two text columns.

    The gutter may be crossed by a few lines (a heading, a pull quote): at most
    ``_MAX_CROSSING`` of them. A receipt's name | price layout also has a full-height gap; what
    tells columns of running text apart is that both sides hold several long lines that fill
    most of their side's width, and neither side is a narrow strip (``_is_text_column``)."""
    left_edge = min(it.x0 for it in items)
    width = max(it.x1 for it in items) - left_edge
    heights = sorted(it.y1 - it.y0 for it in items)
    min_gap = 0.5 * heights[len(heights) // 2]
    allowed = int(_MAX_CROSSING * len(items))
    # x-coverage histogram (bins of >= 1 px): how many lines cover each x
    scale = max(1.0, width / 4000)
    bins = int(width / scale) + 2
    diff = np.zeros(bins + 1, dtype=np.int64)
    for it in items:
        diff[int((it.x0 - left_edge) / scale)] += 1
        diff[int((it.x1 - left_edge) / scale) + 1] -= 1
    cover = np.cumsum(diff)[:bins]
    runs: list[tuple[float, float]] = []
    for lo, hi in _true_runs(cover <= allowed):
        # the gutter proper is where the fewest lines cross, inside the low stretch
        floor = cover[lo:hi].min()
        for a, b in _true_runs(cover[lo:hi] == floor):
            a, b = lo + a, lo + b
            if a > 0 and b < bins and (b - a) * scale >= min_gap:  # margins are not gutters
                runs.append((left_edge + a * scale, left_edge + b * scale))
    for x0, x1 in sorted(runs, key=lambda r: r[0] - r[1]):  # widest first
        left = [it for it in items if it.x1 <= x0]
        right = [it for it in items if it.x0 >= x1]
        crossing = [it for it in items if it.x1 > x0 and it.x0 < x1]
        if len(crossing) <= allowed and all(_is_text_column(side, width) for side in (left, right)):
            return left, right, crossing
    return None


def _true_runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) index pairs of the True stretches of a boolean array."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], mask.astype(np.int8), [0]))))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def _is_text_column(side: list[_Item], region_width: float) -> bool:
    if len(side) < _MIN_COLUMN_LINES:
        return False
    extent = max(it.x1 for it in side) - min(it.x0 for it in side)
    widths = sorted(it.x1 - it.x0 for it in side)
    chars = sorted(len(it.line.text) for it in side)
    return (
        extent >= _MIN_COLUMN_SHARE * region_width
        and widths[len(widths) // 2] >= _COLUMN_FILL * extent
        and chars[len(chars) // 2] >= _MIN_COLUMN_CHARS
    )


def _rows(items: list[_Item]) -> list[list[OcrLine]]:
    """Group items into text rows: an item joins the row whose vertical band it overlaps most
    (by at least ``_ROW_OVERLAP`` of the shorter height); rows top-down, items left-right."""
    rows: list[tuple[float, float, list[_Item]]] = []
    for it in sorted(items, key=lambda i: ((i.y0 + i.y1) / 2, i.x0)):
        best, best_overlap = -1, 0.0
        for n, (top, bottom, _members) in enumerate(rows):
            shorter = max(min(it.y1 - it.y0, bottom - top), 1e-6)
            overlap = (min(it.y1, bottom) - max(it.y0, top)) / shorter
            if overlap >= _ROW_OVERLAP and overlap > best_overlap:
                best, best_overlap = n, overlap
        if best < 0:
            rows.append((it.y0, it.y1, [it]))
            continue
        members = rows[best][2] + [it]
        # the band is the members' median band, so one tall box cannot swallow the page
        tops, bottoms = sorted(m.y0 for m in members), sorted(m.y1 for m in members)
        rows[best] = (tops[len(tops) // 2], bottoms[len(bottoms) // 2], members)
    rows.sort(key=lambda r: (r[0] + r[1]) / 2)
    return [[m.line for m in sorted(members, key=lambda m: m.x0)] for _t, _b, members in rows]

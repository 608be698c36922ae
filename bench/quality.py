"""OCR quality of the CPU engine: on the shared research corpus, or on your own images.

``python -m bench quality`` scores every English image of the corpus with ground truth and writes
docs/quality.md (the baseline); tests/integration/test_quality_corpus.py checks the same scores
against thresholds and writes nothing. The corpus lives next to the repository (research-only
licence: read here, never copied into it), so a clone does not have it.

``python -m bench quality --images DIR [--out FILE]`` scores your own: every image in DIR that
has its ground truth beside it as a text file of the same stem (``invoice.png`` + ``invoice.txt``),
and writes the same report to FILE (default ``quality-DIR.md`` here), never docs/quality.md.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import math
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageOps

from bench.cer import bag_error, cer, normalise, normalise_loose
from bench.provenance import header
from ocrq.engine_settings import RapidOcrSettings
from ocrq.results import OcrOutput
from ocrq.settings import LimitSettings
from worker.engines.base import OcrRequest
from worker.engines.rapid import RapidOcrEngine

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "corpus" / "docs"
REPORT = Path(__file__).resolve().parents[1] / "docs" / "quality.md"


@dataclass(frozen=True)
class Score:
    name: str
    kind: str
    chars: int
    cer: float
    loose: float
    bag: float
    seconds: float


def english_images() -> list[dict[str, str]]:
    with (CORPUS / "manifest.tsv").open(encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh, delimiter="\t"))
    return [r for r in rows if r["language"] == "en" and r["ground_truth_file"] != "-"]


def decode(path: Path, max_pixels: int) -> Image.Image:
    """What the worker's intake does: EXIF-upright, RGB, downscaled to the pixel cap."""
    with Image.open(path) as img:
        rgb = ImageOps.exif_transpose(img).convert("RGB")
    if rgb.width * rgb.height > max_pixels:
        scale = math.sqrt(max_pixels / (rgb.width * rgb.height))
        size = (max(1, int(rgb.width * scale)), max(1, int(rgb.height * scale)))
        rgb = rgb.resize(size, Image.Resampling.LANCZOS)
    return rgb


#: how to score your own images, in the report (docs/quality.md) too
OWN_IMAGES = [
    "## On your own images",
    "",
    "A clone has no corpus; score RapidOCR on your own images instead. Put each image in one",
    "folder with its ground truth beside it, a UTF-8 text file of the same stem (`invoice.png` and",
    "`invoice.txt`: the text as a person reads it, lines in reading order), then:",
    "",
    "```bash",
    "python -m bench quality --images /path/to/folder --out my-quality.md",
    "```",
    "",
    "It decodes each image as the worker does, scores it with the measures below and writes the",
    "same table to `my-quality.md` (never to this page). Images without a `.txt` are listed and",
    "skipped. The engine settings are RapidOCR's defaults (`engine.rapid_limit_side_len` and the",
    "rest of `RapidOcrSettings` in `ocrq/engine_settings.py`).",
    "",
]


def own_images(folder: Path) -> tuple[list[tuple[Path, Path]], list[Path]]:
    """(image, ground truth) pairs of ``folder``, and the files with no truth beside them."""
    pairs, missing = [], []
    for path in sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() != ".txt"
                       and not p.name.startswith(".")):
        truth = path.with_suffix(".txt")
        (pairs.append((path, truth)) if truth.is_file() else missing.append(path))
    return pairs, missing


def write_report(scores: list[Score], engine: RapidOcrEngine, out: Path = REPORT, source: str = "",
                 command: str = "python -m bench quality") -> None:
    n = len(scores)
    mean = {k: sum(getattr(s, k) for s in scores) / n for k in ("cer", "loose", "bag", "seconds")}
    lines = [
        "# OCR quality: RapidOCR on " + ("the research corpus" if not source else "your images"),
        "",
        "How closely RapidOCR's text matches the " + ("corpus's " if not source else "")
        + "ground truth, image by image.",
        "",
        header(f"{platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}",
               command, date=dt.date.today().isoformat()).rstrip("\n"),
        "",
        *(["Written by the command in the table (run it to refresh; the test checks thresholds). Images:",
           "the English images of `shared/corpus/docs` that have ground truth (its README lists the",
           "sources; research-only licence, so the images are read in place, never copied here),",
           "decoded like the worker does (EXIF transpose, RGB, downscaled to"
           f" {LimitSettings().max_pixels:,} pixels).", ""] if not source else
          [f"Images: {source}, each scored against the `.txt` of the same stem beside it, decoded like the",
           f"worker does (EXIF transpose, RGB, downscaled to {LimitSettings().max_pixels:,} pixels).", ""]),
        f"- engine: `{engine.name}`, revision `{engine.revision}`",
        f"- params: `{engine.params}`",
        "",
        "Scores (all are edit or multiset distances divided by the reference length; lower is",
        "better):",
        "",
        "- **CER**: Levenshtein over characters after collapsing every whitespace run (newlines",
        "  included) to one space and trimming. Case-sensitive and order-sensitive.",
        "- **loose CER**: the same after case-folding and removing all whitespace. SROIE labels",
        "  are upper-case and WildReceipt labels have their spaces removed, so this is the fairer",
        "  number for them.",
        "- **bag**: order-insensitive (multiset of characters, loose normalisation): SROIE, FUNSD,",
        "  ICDAR2015 and WildReceipt list one item per annotated box in annotation order, not",
        "  reading order, so part of their CER is order, not recognition. FUNSD forms and",
        "  ICDAR2015 scene photos also label only some of the text the engine reads.",
        "",
        "| image | kind | chars | CER | loose CER | bag | seconds |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for s in scores:
        lines.append(f"| {s.name} | {s.kind} | {s.chars} | {s.cer:.3f} | {s.loose:.3f} | {s.bag:.3f}"
                     f" | {s.seconds:.2f} |")
    lines.append(f"| **mean of {n}** | | {sum(s.chars for s in scores)} | **{mean['cer']:.3f}** |"
                 f" **{mean['loose']:.3f}** | **{mean['bag']:.3f}** | {mean['seconds']:.2f} |")
    weighted = sum(s.cer * s.chars for s in scores) / max(1, sum(s.chars for s in scores))
    lines += ["", f"Character-weighted CER (total edits / total reference characters): {weighted:.3f}."]
    lines.append("")
    if not source:
        lines += OWN_IMAGES
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines), encoding="utf-8")


def score_corpus(verbose: bool = True) -> tuple[list[Score], RapidOcrEngine]:
    """Score RapidOCR (default settings, the worker's decode) on every English image with truth."""
    rows = [(row, CORPUS / row["filename"], CORPUS / row["ground_truth_file"]) for row in english_images()]
    return score_images(rows, RapidOcrSettings(), verbose)


def score_images(rows: list[tuple[dict[str, str], Path, Path]], settings: RapidOcrSettings,
                 verbose: bool = True) -> tuple[list[Score], RapidOcrEngine]:
    """Score RapidOCR on (row, image, truth) triples, each decoded as the worker decodes."""
    engine = RapidOcrEngine(settings)
    engine.start()
    max_pixels = LimitSettings().max_pixels
    scores: list[Score] = []
    try:
        for row, path, truth_path in rows:
            image = decode(path, max_pixels)
            started = time.perf_counter()
            [outcome] = engine.infer([OcrRequest(key=row["filename"], image=image)])
            seconds = time.perf_counter() - started
            if not isinstance(outcome, OcrOutput):
                raise RuntimeError(f"{row['filename']}: {outcome!r}")
            truth = truth_path.read_text(encoding="utf-8")
            scores.append(score(row, truth, outcome.text, seconds))
            if verbose:
                s = scores[-1]
                print(f"{s.name:28s} chars={s.chars:5d} cer={s.cer:.3f} loose={s.loose:.3f} "
                      f"bag={s.bag:.3f} {seconds:.2f}s")
    finally:
        engine.close()
    return scores, engine


def score(row: dict[str, str], truth: str, text: str, seconds: float = 0.0) -> Score:
    ref, ref_loose = normalise(truth), normalise_loose(truth)
    hyp_loose = normalise_loose(text)
    return Score(
        name=row["filename"], kind=row["image_type"], chars=len(ref), cer=cer(ref, normalise(text)),
        loose=cer(ref_loose, hyp_loose), bag=bag_error(ref_loose, hyp_loose), seconds=seconds,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench quality", description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=Path, help="your own folder: each image with a .txt of the same stem")
    ap.add_argument("--out", type=Path, help="where the report goes (default: docs/quality.md for the corpus, "
                                             "quality-<folder>.md here for --images)")
    args = ap.parse_args(argv)
    if args.images is None:
        found, used = score_corpus()
        out = args.out or REPORT
        write_report(found, used, out)
        print(f"wrote {out}")
        return 0
    from ocrq.settings import load_settings

    pairs, missing = own_images(args.images)
    for path in missing:
        print(f"skipped {path}: no {path.with_suffix('.txt').name} beside it")
    if not pairs:
        print(f"no image with its ground truth in {args.images}", file=sys.stderr)
        return 2
    rows = [({"filename": p.name, "image_type": "own"}, p, t) for p, t in pairs]
    found, used = score_images(rows, load_settings().engine)
    out = args.out or Path(f"quality-{args.images.resolve().name}.md")
    write_report(found, used, out, source=f"`{args.images}` ({len(pairs)} with ground truth)",
                 command=f"python -m bench quality --images {args.images}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

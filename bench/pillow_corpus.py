"""Pillow's own hostile test files through the worker's decoder: every file must end typed — its
pages, or a permanent error (``BadImage``, ``UnsupportedFormat``, ``TooLarge``) — never a decoder
crash or hang (``DecoderCrashed``) nor an untyped exception, with the decode limits at their
defaults (``limits.decode_memory_bytes``, ``decode_cpu_s``, ``max_document_pixels``).

The files are Pillow's regression inputs for fuzzer finds and malformed images, from a checkout
of https://github.com/python-pillow/Pillow (``Tests/images``; not shipped here):

    crash-*, oom-*, timeout-*, ossfuzz-*   files that crashed, exhausted memory or hung a decoder
    fli_oob/*                              out-of-bounds FLI frames
    bmp/b/*, bmp/q/*                       the BMP suite's bad and questionable files
    *truncated*, *broken*, *invalid*, *negative*, *zero_*   truncated and malformed images

    .venv/bin/python -m bench.pillow_corpus --pillow PATH/TO/Pillow [--json F]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

from ocrq.errors import DecoderCrashed, OcrqError
from ocrq.settings import LimitSettings
from worker.decoding.decode import IsolatedDecoder

_PATTERNS = ("crash-*", "oom-*", "timeout-*", "ossfuzz-*", "fli_oob/**/*", "bmp/b/*", "bmp/q/*",
             "*truncated*", "*broken*", "*invalid*", "*negative*", "zero_*")
#: text files and palettes among them, which no one submits as an image
_NOT_IMAGES = frozenset({".txt", ".gpl", ".html", ".md"})


def corpus(pillow: Path) -> list[Path]:
    images = pillow / "Tests" / "images"
    found = {p for pattern in _PATTERNS for p in images.glob(pattern) if p.is_file()}
    return sorted(p for p in found if p.suffix.lower() not in _NOT_IMAGES)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pillow_corpus")
    parser.add_argument("--pillow", type=Path, required=True, help="a checkout of python-pillow/Pillow")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    files = corpus(args.pillow)
    limits = LimitSettings(decode_processes=1)
    decoder = IsolatedDecoder(limits)
    outcomes: dict[str, str] = {}
    untyped: list[str] = []
    t0 = time.monotonic()
    try:
        for path in files:
            got = decoder.decode_many([path.read_bytes()])[0]
            name = str(path.relative_to(args.pillow / "Tests" / "images"))
            if isinstance(got, list):
                outcomes[name] = "pages"
            else:
                outcomes[name] = type(got).__name__
                if isinstance(got, DecoderCrashed) or not isinstance(got, OcrqError) or got.retryable:
                    untyped.append(f"{name}: {type(got).__name__}: {got}")
    finally:
        decoder.close()
    tally = Counter(outcomes.values())
    kinds = ", ".join(f"{k} {v}" for k, v in tally.most_common())
    replaced = decoder.crashes + getattr(decoder, "retired", 0)  # (an older checkout has no retired)
    print(f"{len(files)} files in {time.monotonic() - t0:.1f} s: {kinds}; children replaced {replaced}")
    for line in untyped:
        print(f"  NOT TYPED {line}")
    if args.json:
        args.json.write_text(json.dumps({"files": len(files), "tally": tally, "untyped": untyped,
                                         "outcomes": outcomes}, indent=2))
    return 1 if untyped else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Content hashing (sha256 vs BLAKE3) and result serialisation (JSON vs msgpack) costs.

    .venv/bin/python -m bench.hashing [--out docs/bench/hashing.md] [--budget 0.3]

``--out`` rewrites only the part of the file between the ``measured`` markers.

Numbers are best-of-N wall times on one thread (a worker hashes on its fetch threads, one image
per thread). Optional libraries are measured only when installed; the report says when not.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import platform
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from bench.provenance import header
from ocrq.results import ImageRecord, ImageResult, ImageStatus, OcrLine, OcrOutput

SIZES = {"100 KB": 100 * 1024, "1 MB": 1024 * 1024, "5 MB": 5 * 1024 * 1024}


def best_seconds(fn: Callable[[], object], budget: float) -> float:
    """Best single-call time, repeating for about ``budget`` seconds (at least 5 calls)."""
    best = float("inf")
    deadline = time.perf_counter() + budget
    calls = 0
    while calls < 5 or time.perf_counter() < deadline:
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
        calls += 1
    return best


def optional(module: str) -> Any | None:
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def hash_rows(budget: float) -> tuple[list[list[str]], str | None]:
    blake3 = optional("blake3")
    rows = []
    for label, size in SIZES.items():
        data = os.urandom(size)
        sha = best_seconds(partial(hashlib.sha256, data), budget)  # the constructor hashes
        row = [label, f"{sha * 1e3:.3f}", f"{size / sha / 1e9:.2f}"]
        if blake3 is not None:
            b3 = best_seconds(partial(blake3.blake3, data), budget)
            row += [f"{b3 * 1e3:.3f}", f"{size / b3 / 1e9:.2f}", f"{sha / b3:.1f}x"]
        rows.append(row)
    version = getattr(blake3, "__version__", "installed") if blake3 is not None else None
    return rows, version


def decode_row(budget: float) -> list[str]:
    """The decode the same fetch thread does anyway, for scale: a 2000x1500 photo-like JPEG."""
    import io

    from PIL import Image

    from ocrq.settings import LimitSettings
    from worker.decoding.images import decode

    buf = io.BytesIO()
    Image.effect_noise((2000, 1500), 40).convert("RGB").save(buf, "JPEG", quality=85)
    data = buf.getvalue()
    seconds = best_seconds(partial(decode, data, LimitSettings()), budget)
    sha = best_seconds(partial(hashlib.sha256, data), budget)
    return [f"{len(data) / 1e6:.2f} MB JPEG, 3 MP", f"{seconds * 1e3:.1f}", f"{sha * 1e3:.3f}"]


def typical_result() -> ImageResult:
    """One page of a scanned letter: 40 lines with quadrilateral boxes (~2.5 KB of text)."""
    lines = [
        OcrLine(text=f"Line {i}: the quick brown fox jumps over the lazy dog, invoice 00{i}",
                box=[[12.0, 30.0 * i], [980.5, 30.0 * i], [980.5, 30.0 * i + 24], [12.0, 30.0 * i + 24]],
                confidence=0.97)
        for i in range(40)
    ]
    output = OcrOutput(text="\n".join(ln.text for ln in lines), lines=lines, engine="rapidocr",
                       model="rapidocr-3.4/ppocrv5", width=1024, height=1400,
                       meta={"elapsed_ms": 412.5, "det_ms": 120.1})
    record = ImageRecord(id="0" * 32, job="bench", ref="s3://bucket/scans/0001.png",
                         status=ImageStatus.done, attempts=1, cache_key="c" * 90,
                         sha256="a" * 64, pages=1, updated=1.7e9)
    return ImageResult(record=record, outputs=[output])


def serial_rows(budget: float) -> tuple[list[list[str]], str | None]:
    result = typical_result()
    doc: dict[str, Any] = result.model_dump(mode="json")
    as_json = json.dumps(doc, separators=(",", ":")).encode()
    as_model = result.model_dump_json().encode()

    def row(name: str, size: int, enc: Callable[[], object], dec: Callable[[], object]) -> list[str]:
        return [name, str(size), f"{best_seconds(enc, budget) * 1e6:.1f}",
                f"{best_seconds(dec, budget) * 1e6:.1f}"]

    rows = [
        row("json (stdlib, compact)", len(as_json),
            lambda: json.dumps(doc, separators=(",", ":")), lambda: json.loads(as_json)),
        row("pydantic model_dump_json / model_validate_json", len(as_model),
            result.model_dump_json, lambda: ImageResult.model_validate_json(as_model)),
    ]
    msgpack = optional("msgpack")
    if msgpack is None:
        return rows, None
    packed = msgpack.packb(doc)
    rows.append(row("msgpack", len(packed), lambda: msgpack.packb(doc),
                    lambda: msgpack.unpackb(packed)))
    return rows, str(getattr(msgpack, "version", "installed"))


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, help="write the markdown report here")
    parser.add_argument("--budget", type=float, default=0.3, help="seconds per measurement")
    args = parser.parse_args()

    hashes, blake3_version = hash_rows(args.budget)
    head = ["payload", "sha256 ms", "sha256 GB/s"]
    if blake3_version:
        head += ["BLAKE3 ms", "BLAKE3 GB/s", "BLAKE3 speed-up"]
    serial, msgpack_version = serial_rows(args.budget)
    env = (f"Python {platform.python_version()}, {platform.machine()}, "
           f"{os.cpu_count()} CPUs (shared with other jobs), OpenSSL sha256; "
           f"blake3: {blake3_version or 'not installed'}; msgpack: {msgpack_version or 'not installed'}")
    report = "\n\n".join([
        header(f"{platform.machine()}, {os.cpu_count()} CPUs (shared with other jobs)",
               "python -m bench hashing").rstrip("\n"),
        "### Content hash (one thread, best of N)", table(head, hashes),
        "### For scale: decoding the same kind of payload (worker.decoding.images.decode, one thread)",
        table(["payload", "decode ms", "sha256 ms"], [decode_row(args.budget)]),
        "### One ImageResult (1 page, 40 lines with boxes)",
        table(["codec", "bytes", "encode µs", "decode µs"], serial),
        f"Environment: {env}.",
    ])
    print(report)
    if args.out:
        write_report(args.out, report)


def write_report(path: Path, report: str) -> None:
    """Replace only the measured section, so the hand-written recommendation around it stays."""
    start, end = "<!-- measured:start -->", "<!-- measured:end -->"
    text = path.read_text() if path.exists() else ""
    if start in text and end in text:
        head, _, rest = text.partition(start)
        tail = rest.partition(end)[2]
        text = f"{head}{start}\n{report}\n{end}{tail}"
    else:
        text = f"{start}\n{report}\n{end}\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


if __name__ == "__main__":
    main()

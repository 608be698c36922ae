"""What the queue costs: the same images OCRed by RapidOCR directly (engine.infer in batches of
4 in this process) and through the whole system (producer → real redis-server → `ocrq worker`
subprocess → local store → results), measured side by side in one run.

    .venv/bin/python -m bench.pipeline_overhead --images 40 --out docs/bench/pipeline.md
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from bench.provenance import header
from bench.services import free_port, start_redis, start_worker, stop
from ocrq.engine_settings import RapidOcrSettings
from ocrq.settings import Settings
from producer.client import Client

WORDS = ["invoice", "total", "receipt", "coffee", "market", "harbor", "window", "garden", "silver",
         "rocket", "planet", "ticket", "orange", "yellow", "basket", "station", "number", "amount"]


def render(folder: Path, n: int) -> list[Path]:
    rng = random.Random(0)
    font = ImageFont.load_default(size=40)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        img = Image.new("RGB", (1000, 400), "white")
        draw = ImageDraw.Draw(img)
        for row in range(4):
            draw.text((40, 30 + 85 * row), " ".join(rng.sample(WORDS, 3)) + f" {i:03d}", fill="black", font=font)
        path = folder / f"page_{i:03d}.png"
        img.save(path)
        paths.append(path)
    return paths


def direct(paths: list[Path]) -> float:
    from worker.decoding.images import decode
    from worker.engines.base import OcrRequest
    from worker.engines.rapid import RapidOcrEngine

    engine = RapidOcrEngine(RapidOcrSettings())
    engine.start()
    t0 = time.perf_counter()
    reqs = [OcrRequest(p.name, decode(p.read_bytes(), Settings().limits)[0].image) for p in paths]
    for i in range(0, len(reqs), 4):
        engine.infer(reqs[i:i + 4])
    return time.perf_counter() - t0


def through_queue(paths: list[Path], root: Path) -> float:
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    server = start_redis(port, root)
    env = {**os.environ, "OCRQ_REDIS__URL": url, "OCRQ_STORE__PATH": str(root / "store"),
           "OCRQ_LIMITS__ALLOWED_ROOTS": json.dumps([str(root)])}
    worker = start_worker(env, "bench", root / "worker.log", url, timeout=120, concurrency=2)
    try:
        producer = Client(Settings(redis={"url": url}, store={"path": root / "store"},
                                   limits={"allowed_roots": [root]}))
        t0 = time.perf_counter()
        job = producer.submit([str(p) for p in paths], job="bench")
        counts = job.wait(timeout=900, poll=0.05)
        results = list(job.results())
        elapsed = time.perf_counter() - t0
        assert counts["done"] == len(paths) and len(results) == len(paths), counts
        return elapsed
    finally:
        stop(worker)
        server.terminate()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=40)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        paths = render(root / "in", args.images)
        t_direct = direct(paths)
        t_queue = through_queue(paths, root)
    n = args.images
    table = ("| path | images | seconds | img/s |\n|---|---|---|---|\n"
             f"| RapidOCR directly (decode + infer, batches of 4) | {n} | {t_direct:.2f} | {n / t_direct:.2f} |\n"
             f"| ocrq: submit → Redis → worker → store → results read back | {n} | {t_queue:.2f} | "
             f"{n / t_queue:.2f} |\n")
    overhead = (t_queue / t_direct - 1) * 100
    print(table + f"\nqueue overhead: {overhead:+.1f}%")
    if args.out:
        args.out.write_text(
            "# Pipeline overhead (CPU, RapidOCR)\n\n"
            "What the queue adds over calling the engine directly, on CPU.\n\n"
            + header(f"{os.cpu_count()}-core VM", f"python -m bench pipeline --images {n}") + "\n"
            f"{n} distinct rendered 1000×400 pages, no cache hits "
            "(fresh Redis and store). The direct row is the engine alone in this process; the ocrq row "
            "times from `submit` to every result read back, with a real redis-server and one "
            "`ocrq worker` process (threads pool, 2 chunk threads, one engine loop) started beforehand.\n\n"
            + table + f"\nOverhead of the queue, index, cache and store: {overhead:+.1f}%.\n"
        )


if __name__ == "__main__":
    main()

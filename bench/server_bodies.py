"""The vllm-server engine's request bodies and the worker's GIL (docs/bench/gpu-vllm.md,
2026-12-02): threads build bodies for noisy pages, as a worker's request pool does, while the main
thread times a fetch-like step (read 8 files, hash them, a little Python), the way a small job's
fetch waited behind them on the H200. Two ways side by side, alternately, in one run:

- ``json``: the body as the 2026-12-02 H200 rows (commit c859c01) sent it (PPM pixels, the standard
  library's base64, httpx ``json=``, which walks the base64 in ``json.dumps`` holding the GIL);
- ``splice``: the engine's way now (pybase64, ``worker.engines.vllm.chat.encode_body``).

    .venv/bin/python -m bench.server_bodies [--seconds 6] [--threads 8]

Last line: ``{"json": {...}, "splice": {...}}`` (bodies/s, the fetch step's p50/p95 ms; best pass).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from PIL import Image

from ocrq.engine_settings import VllmServerSettings
from worker.engines import hunyuan
from worker.engines.base import OcrRequest
from worker.engines.vllm.chat import encode_body, request_body

URL = "http://127.0.0.1/v1/chat/completions"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=6.0, help="per pass")
    ap.add_argument("--threads", type=int, default=8, help="threads building bodies")
    ap.add_argument("--passes", type=int, default=2, help="passes of each way, alternating")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    pages = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
             for w, h in [(2048, 1536), (1024, 768), (1024, 768)]]
    settings = VllmServerSettings(kind="vllm-server")
    version = hunyuan.version_of(settings)
    sampling = hunyuan.SAMPLING[version]

    def body(image: Image.Image) -> dict[str, Any]:
        return request_body(OcrRequest(key="k", image=image), model="m", version=version, sampling=sampling,
                            settings=settings)

    tiny = Image.new("RGB", (1, 1))

    def as_json(image: Image.Image) -> None:  # the rows' way: a tiny body, then the page's URL in it
        buf = io.BytesIO()
        image.save(buf, format="PPM")
        b = body(tiny)
        b["messages"][1]["content"][0]["image_url"]["url"] = (
            "data:image/x-portable-pixmap;base64," + base64.b64encode(buf.getvalue()).decode("ascii"))
        httpx.Request("POST", URL, json=b)

    def spliced(image: Image.Image) -> None:
        httpx.Request("POST", URL, content=encode_body(body(image)), headers={"content-type": "application/json"})

    with tempfile.TemporaryDirectory() as tmp:
        files = [Path(tmp) / f"f{i}.bin" for i in range(8)]
        for f in files:
            f.write_bytes(os.urandom(200_000))

        def fetch_step() -> float:
            t0 = time.perf_counter()
            for f in files:
                digest = hashlib.sha256(f.read_bytes()).hexdigest()
                _ = {"id": digest, "path": str(f), "n": list(range(200))}
            return time.perf_counter() - t0

        alone = min(fetch_step() for _ in range(20))
        print(f"fetch step alone: {alone * 1000:.2f} ms", flush=True)
        results: dict[str, list[dict[str, float]]] = {"json": [], "splice": []}
        ways: dict[str, Callable[[Image.Image], None]] = {"json": as_json, "splice": spliced}
        for _ in range(args.passes):
            for name, fn in ways.items():
                r = _pass(fn, pages, fetch_step, args.threads, args.seconds)
                print(name, json.dumps(r), flush=True)
                results[name].append(r)
    best = {name: max(rs, key=lambda r: r["bodies_per_s"]) for name, rs in results.items()}
    print(json.dumps({**best, "fetch_alone_ms": round(alone * 1000, 2)}))


def _pass(fn: Callable[[Image.Image], None], pages: list[Image.Image], fetch_step: Callable[[], float],
          threads: int, seconds: float) -> dict[str, float]:
    stop = threading.Event()
    built = [0] * threads

    def build(slot: int) -> None:
        i = slot
        while not stop.is_set():
            fn(pages[i % len(pages)])
            i += 1
            built[slot] += 1

    workers = [threading.Thread(target=build, args=(n,)) for n in range(threads)]
    for w in workers:
        w.start()
    lat: list[float] = []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        lat.append(fetch_step())
        time.sleep(0.05)
    stop.set()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - t0
    lat.sort()
    return {"bodies_per_s": round(sum(built) / elapsed, 1), "fetch_p50_ms": round(statistics.median(lat) * 1000, 1),
            "fetch_p95_ms": round(lat[min(len(lat) - 1, int(0.95 * len(lat)))] * 1000, 1), "samples": len(lat)}


if __name__ == "__main__":
    main()

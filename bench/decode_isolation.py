"""What decoding in supervised child processes (``limits.decode_isolation``, worker.decoding.decode)
costs on the hot path, measured two ways in one run:

1. decode only: the same images decoded by 8 threads in this process (``InProcessDecoder``) and
   through ``IsolatedDecoder`` (bytes piped to a child, pages pickled back), per image kind;
2. end to end: submit → real redis-server → one ``ocrq worker`` (simulated engine, no engine
   latency, so decoding and the queue are all there is) → local store, isolation on and off.

    .venv/bin/python -m bench.decode_isolation --images 1000 --out docs/bench/decode-isolation.md
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import random
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from PIL import Image

from bench.services import free_port, start_redis, start_worker, stop
from ocrq.settings import LimitSettings, Settings
from producer.client import Client
from tests.fixtures.images import word_images
from worker.decoding.decode import Decoder, InProcessDecoder, IsolatedDecoder


def photos(folder: Path, n: int) -> list[Path]:
    """n distinct 2,000×1,500 JPEG 'scans' (3 MP, noisy so they do not compress to nothing)."""
    rng = random.Random(1)
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(n):
        img = Image.effect_noise((2000, 1500), 40 + rng.random() * 20).convert("RGB")
        buf = io.BytesIO()
        img.save(buf, "JPEG", quality=85)
        (path := folder / f"photo_{i:03d}.jpg").write_bytes(buf.getvalue())
        out.append(path)
    return out


def decode_rate(decoder: Decoder, blobs: list[bytes], threads: int = 8) -> float:
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(decoder.decode, blobs[:threads]))  # warm
        t0 = time.perf_counter()
        list(pool.map(decoder.decode, blobs))
        return len(blobs) / (time.perf_counter() - t0)


def end_to_end(paths: list[Path], root: Path, isolation: bool) -> float:
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    data = root / f"redis-{isolation}"
    data.mkdir()
    server = start_redis(port, data)
    env = {**os.environ, "OCRQ_REDIS__URL": url, "OCRQ_STORE__PATH": str(data / "store"),
           "OCRQ_LIMITS__ALLOWED_ROOTS": json.dumps([str(root)]), "OCRQ_ENGINE__KIND": "simulated",
           "OCRQ_BATCH__MODE": "auto", "OCRQ_QUEUE__CHUNK_SIZE": "16", "OCRQ_LOG_LEVEL": "WARNING",
           "OCRQ_LIMITS__DECODE_ISOLATION": json.dumps(isolation), "OCRQ_METRICS_PORT": "0"}
    env.pop("OCRQ_CONFIG", None)
    worker = start_worker(env, f"iso{int(isolation)}", data / "worker.log", url, timeout=120, concurrency=4)
    try:
        client = Client(Settings(redis={"url": url}, store={"path": data / "store"},
                                 limits={"allowed_roots": [root]}, queue={"chunk_size": 16}))
        t0 = time.perf_counter()
        job = client.submit([str(p) for p in paths], job=f"iso-{isolation}")
        counts = job.wait(timeout=900, poll=0.1)
        elapsed = time.perf_counter() - t0
        assert counts["done"] == len(paths), counts
        client.close()
        return len(paths) / elapsed
    finally:
        stop(worker)
        server.terminate()
        server.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=1000)
    ap.add_argument("--photos", type=int, default=64)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    limits = LimitSettings(decode_processes=min(8, os.cpu_count() or 1))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        words = sorted(word_images(root / "words", args.images))
        kinds = {"rendered word PNGs (chaos suite's)": [p.read_bytes() for p in words],
                 "3 MP noisy JPEGs": [p.read_bytes()
                                                                   for p in photos(root / "photos", args.photos)]}
        iso = IsolatedDecoder(limits)
        try:
            for kind, blobs in kinds.items():
                a, b = decode_rate(InProcessDecoder(limits), blobs), decode_rate(iso, blobs)
                print(kind, f"{a:.1f} vs {b:.1f} img/s", flush=True)
                rows.append(f"| decode only, 8 threads: {kind} | {len(blobs)} | {a:.1f} | {b:.1f} |"
                            f" {(b / a - 1) * 100:+.1f}% |")
        finally:
            iso.close()
        off = end_to_end(words, root, False)
        print(f"end to end, in-process: {off:.1f} img/s", flush=True)
        on = end_to_end(words, root, True)
        rows.append(f"| end to end, 1 worker, simulated engine: word PNGs | {len(words)} | {off:.1f} | {on:.1f} |"
                    f" {(on / off - 1) * 100:+.1f}% |")
    table = ("| measured | images | in-process img/s | isolated img/s | change |\n|---|---:|---:|---:|---:|\n"
             + "\n".join(rows) + "\n")
    print(table)
    if args.out:
        args.out.write_text(
            "# Decode isolation: the cost of decoding in child processes\n\n"
            f"`python -m bench decode-isolation --images {args.images} --photos {args.photos}` on "
            f"{platform.node()} ({os.cpu_count()} cores, shared with other work), {time.strftime('%Y-%m-%d')};"
            f" {limits.decode_processes} decoding children. The end-to-end rows time submit → every image"
            " `done` with one `ocrq worker` (simulated engine without latency, chunks of 16, 4 chunk threads).\n\n"
            + table)


if __name__ == "__main__":
    main()

"""Submission throughput: refs per second from `Client.submit` into a real Redis broker, with one
ref per message vs chunks of refs per message, measured side by side in one run.

    .venv/bin/python -m bench.submit_throughput --refs 20000 --out docs/bench/submit.md

Starts its own redis-server on a free port (no worker: this measures the producer + broker,
including the intake plan: a stat per local file and the on-disk spool of accepted refs).
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

import redis

from bench.provenance import header
from bench.services import start_redis
from ocrq.settings import Settings
from producer.client import Client


def run(refs: int, chunk_sizes: list[int], port: int, root: Path) -> list[dict[str, float]]:
    url = f"redis://127.0.0.1:{port}/0"
    names = [str(root / f"img_{i:07d}.png") for i in range(refs)]
    for name in names:  # the producer refuses local files that do not exist (producer.intake)
        Path(name).touch()
    rows = []
    for size in chunk_sizes:
        redis.Redis.from_url(url).flushdb()
        client = Client(Settings(redis={"url": url}, queue={"chunk_size": size}, limits={"allowed_roots": [root]}))
        n = refs if size > 1 else min(refs, 5000)  # single-ref messages are slow: a shorter run
        t0 = time.perf_counter()
        job = client.submit(names[:n], job=f"bench-{size}")
        elapsed = time.perf_counter() - t0
        depth = redis.Redis.from_url(url).llen("ocrq")
        rows.append({"chunk_size": size, "refs": n, "seconds": elapsed, "refs_per_s": n / elapsed,
                     "messages": depth, "published": job.published})
        client.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--refs", type=int, default=20000)
    ap.add_argument("--chunks", default="1,16,64,256")
    ap.add_argument("--port", type=int, default=6399)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        proc = start_redis(args.port, Path(tmp))
        try:
            rows = run(args.refs, [int(c) for c in args.chunks.split(",")], args.port, Path(tmp))
        finally:
            proc.terminate()
    base = rows[0]["refs_per_s"]
    lines = ["| refs per message | refs | messages | seconds | refs/s | × one-per-message |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['chunk_size']} | {r['refs']} | {r['messages']} | {r['seconds']:.2f} | "
                     f"{r['refs_per_s']:,.0f} | {r['refs_per_s'] / base:.1f} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(
            "# Submission throughput\n\n"
            "How fast a producer records and publishes a job, by refs per message.\n\n"
            + header(f"{os.cpu_count()}-core {platform.processor() or platform.machine()} VM",
                     f"python -m bench submit --refs {args.refs}") + "\n"
            "Producer → real redis-server (loopback), no worker. Each submit first plans the intake "
            "(expands the refs, stats each local file, spools the accepted ones to disk: producer/intake.py), "
            "then records every image as `queued` in the job index (Lua, 500 per call) and publishes "
            "the chunk messages.\n\n"
            + table + "\n\nOne message per image is bounded by a broker round trip per image; chunks "
            "amortise it, which is why bulk jobs are published as chunks (docs/ARCHITECTURE.md).\n"
        )


if __name__ == "__main__":
    main()

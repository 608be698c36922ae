"""The queue's own cost per image: ocrq vs plain Celery with a null engine, in one run.

    .venv/bin/python -m bench.overhead --images 20000            # (make bench-overhead)
    .venv/bin/python -m bench.overhead --images 20000 --profile docs/bench/profiles

Three passes over the same N distinct small PNGs (64×32), each against its own fresh
redis-server on a free port and one worker process started (engine ready) before the clock:

1. ocrq, first pass: ``Client.submit`` → Redis → ``ocrq worker`` (simulated engine, no latency)
   fetch → hash → cache check → decode → engine → store → index → ack, then every result read
   back with ``Job.results()``. Timed from submit to the last result read.
2. ocrq, cache-hit pass: the same files as a new job (every image a cache hit), same clock.
3. plain Celery (bench/plain_celery.py): one task per image, results through Celery's Redis
   backend, the default prefork worker; timed from the first ``delay`` to the last ``get``.

Every pass checks its outcome (N results, all done, the cached pass all cached, one record per
image). ``--profile DIR`` records py-spy flame graphs of the worker and this process (the
producer) during pass 1 and 2 (needs ``pip install py-spy``). The last line printed is JSON:
``{"ocrq_img_s": x, "plain_celery_img_s": y, "ratio": x/y, "cached_img_s": z}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from PIL import Image

from bench.services import Spy, free_port, start_redis, start_worker, stop
from ocrq.settings import Settings
from producer.client import Client


def render(folder: Path, n: int) -> list[str]:
    """N distinct 64×32 PNGs (the index is drawn into the pixels)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        pixels = bytearray(b"\xff" * (64 * 32))
        pixels[64 * 12:64 * 12 + 8] = i.to_bytes(8, "big")  # a band of pixels that encodes i
        img = Image.frombytes("L", (64, 32), bytes(pixels))
        path = folder / f"img_{i:06d}.png"
        img.save(path)
        paths.append(str(path))
    return paths


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds so far of each process, by role (a worker's pool children
    included; this process, the producer, alone). The ocrq worker's children (its decoders and
    their forkserver; plain Celery's prefork children) are also reported apart, as ``(children)``."""
    out = {}
    for role, pid in pids.items():
        procs = [psutil.Process(pid)]
        if pid != os.getpid():
            procs += procs[0].children(recursive=True)
        out[role] = sum(sum(p.cpu_times()[:2]) for p in procs)
        if role == "worker":
            out["(children)"] = sum(sum(p.cpu_times()[:2]) for p in procs[1:])
    return out


def cpu_line(before: dict[str, float], after: dict[str, float], n: int) -> str:
    """CPU ms per 1,000 images by process: unlike img/s, barely moved by other load on the box."""
    return ", ".join(f"{role} {1e6 * (after[role] - before.get(role, 0.0)) / n:,.0f}" for role in after)


def ocrq_passes(paths: list[str], root: Path, profile: Path | None) -> tuple[float, float]:
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    server = start_redis(port, root)
    store = root / "store"
    env = {**os.environ, "OCRQ_REDIS__URL": url, "OCRQ_STORE__PATH": str(store),
           "OCRQ_ENGINE__KIND": "simulated", "OCRQ_LIMITS__ALLOWED_ROOTS": json.dumps([str(root)]),
           "OCRQ_METRICS_PORT": "0", "OCRQ_LOG_LEVEL": "WARNING"}
    worker = start_worker(env, "overhead", root / "worker.log", url, timeout=120,
                          concurrency=Settings().queue.concurrency)
    try:
        client = Client(Settings(redis={"url": url}, store={"path": store}, limits={"allowed_roots": [root]}))
        rates = []
        pids = {"worker": worker.pid, "redis": server.pid, "producer": os.getpid()}
        for name, cached in (("first", False), ("cached", True)):
            spy = {f"{name}-worker": (worker.pid, ["--gil"]), f"{name}-producer": (os.getpid(), ["--gil"])}
            with Spy(profile, spy):
                cpu0 = cpu_seconds(pids)
                t0 = time.perf_counter()
                job = client.submit(paths, job=f"overhead-{name}")
                t_submit = time.perf_counter() - t0
                counts = job.wait(timeout=1800, poll=0.02)
                t_done = time.perf_counter() - t0
                results = list(job.results())
                elapsed = time.perf_counter() - t0
                cpu1 = cpu_seconds(pids)
            assert counts["total"] == len(paths) and counts["done"] == len(paths), counts
            assert len(results) == len(paths) and all(r.record.status == "done" for r in results)
            assert len({r.record.id for r in results}) == len(paths)
            assert counts["cached"] == (len(paths) if cached else 0), counts
            assert all(r.text.startswith("sim:") for r in results)
            rates.append(len(paths) / elapsed)
            print(f"ocrq {name} pass: {len(paths)} images in {elapsed:.2f}s = {rates[-1]:,.0f} img/s "
                  f"(submitted at {t_submit:.2f}s, all done at {t_done:.2f}s, read back in "
                  f"{elapsed - t_done:.2f}s); CPU ms per 1,000 images: {cpu_line(cpu0, cpu1, len(paths))}; "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
        client.close()
        return rates[0], rates[1]
    finally:
        stop(worker)
        server.terminate()
        server.wait(10)


def plain_celery_pass(paths: list[str], root: Path) -> float:
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    server = start_redis(port, root)
    env = {**os.environ, "OVERHEAD_REDIS_URL": url}
    os.environ["OVERHEAD_REDIS_URL"] = url
    log = (root / "plain.log").open("wb")
    worker = subprocess.Popen([sys.executable, "-m", "celery", "-A", "bench.plain_celery", "worker",
                               "--loglevel=WARNING", "--without-gossip", "--without-mingle"],
                              env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        from bench import plain_celery

        app = plain_celery.app
        app.conf.broker_url = app.conf.result_backend = url
        deadline = time.monotonic() + 120
        while not app.control.ping(timeout=0.5):
            if time.monotonic() > deadline or worker.poll() is not None:
                raise RuntimeError("plain Celery worker did not start: " + (root / "plain.log").read_text()[-2000:])
        pids = {"worker": worker.pid, "redis": server.pid, "producer": os.getpid()}
        cpu0 = cpu_seconds(pids)
        t0 = time.perf_counter()
        pending = [plain_celery.ocr_image.delay(p) for p in paths]
        results = [r.get(timeout=600) for r in pending]
        elapsed = time.perf_counter() - t0
        cpu1 = cpu_seconds(pids)
        assert len(results) == len(paths) and all(r["outputs"][0]["text"].startswith("sim:") for r in results)
        rate = len(paths) / elapsed
        print(f"plain Celery: {len(paths)} images in {elapsed:.2f}s = {rate:,.0f} img/s; CPU ms per 1,000 "
              f"images: {cpu_line(cpu0, cpu1, len(paths))}; load {os.getloadavg()[0]:.2f}", flush=True)
        return rate
    finally:
        stop(worker)
        server.terminate()
        server.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=20000)
    ap.add_argument("--profile", type=Path, help="write py-spy profiles of passes 1 and 2 here")
    ap.add_argument("--skip-plain", action="store_true", help="ocrq passes only (profiling runs)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ocrq-overhead-") as tmp:
        root = Path(tmp)
        t = time.perf_counter()
        paths = render(root / "in", args.images)
        print(f"rendered {len(paths)} PNGs in {time.perf_counter() - t:.1f}s; load {os.getloadavg()[0]:.2f}",
              flush=True)
        first, cached = ocrq_passes(paths, root, args.profile)
        plain = float("nan") if args.skip_plain else plain_celery_pass(paths, root)
    print(json.dumps({"ocrq_img_s": round(first, 1), "plain_celery_img_s": round(plain, 1),
                      "ratio": round(first / plain, 2), "cached_img_s": round(cached, 1)}))


if __name__ == "__main__":
    main()

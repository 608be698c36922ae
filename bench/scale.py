"""Redis over the life of a large job: what one job of N images costs Redis at its peak and once
it is finished, and how fast a large job is submitted, followed and read back.

    .venv/bin/python -m bench.scale --images 1000000        # (make bench-scale)
    .venv/bin/python -m bench.scale --images 20000 --no-write

N distinct small PNGs (64×32, bench.overhead's), one `ocrq worker` (simulated engine, no latency),
the broker's Redis and a cache-only Redis (``redis.cache_url``, as docker-compose.yml runs them),
each a fresh redis-server on a free port, the local store. A thread samples both servers'
``used_memory`` every 0.5 s. Measured, from the submit to the job's export and archive:

- Redis bytes per image: the broker's peak over its baseline (the worker started, nothing
  submitted), and what stays once the job is finished, exported and archived;
- the hot cache's bytes (its own server) against ``redis.cache_max_bytes``;
- submit seconds; ``ocrq status`` latency (counts and cost) on the finished job;
- ``Job.results()`` read-back rate (from the store) and the export's rate (lines / the export
  task's seconds, from the job's last image to its ``_SUCCESS``);
- img/s from the submit to the job's last image.

Writes ``docs/bench/scale.{json,md,png}`` (``--no-write``: prints only). The last line printed is
the JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import redis

from bench.overhead import render
from bench.services import free_port, start_redis, start_worker, stop
from ocrq.jobcost import job_cost
from ocrq.settings import Settings
from producer.client import Client

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "bench"


class Sampler(threading.Thread):
    """``used_memory`` of each server every ``every`` seconds: (t, {name: bytes})."""

    def __init__(self, servers: dict[str, redis.Redis], every: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.servers = servers
        self.every = every
        self.samples: list[tuple[float, dict[str, int]]] = []
        self.t0 = time.monotonic()
        self._halt = threading.Event()

    def read(self) -> dict[str, int]:
        return {name: int(r.info("memory")["used_memory"]) for name, r in self.servers.items()}

    def run(self) -> None:
        while not self._halt.is_set():
            self.samples.append((time.monotonic() - self.t0, self.read()))
            self._halt.wait(self.every)

    def stop(self) -> None:
        self._halt.set()
        self.join(5)

    def peak(self, name: str) -> int:
        return max(s[name] for _, s in self.samples)


def settled(client: redis.Redis, wait_s: float = 5.0) -> int:
    """used_memory once lazy frees (UNLINK) have run: the lowest of a few reads."""
    lowest = int(client.info("memory")["used_memory"])
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(0.5)
        lowest = min(lowest, int(client.info("memory")["used_memory"]))
    return lowest


def key_families(client: redis.Redis) -> dict[str, dict[str, int]]:
    """Every key left, grouped by family (ids and names replaced by ``*``): count and the bytes
    ``MEMORY USAGE`` reports for them."""
    import re

    out: dict[str, dict[str, int]] = {}
    for key in client.scan_iter(count=1000):
        name = key.decode(errors="replace")
        family = re.sub(r"[0-9a-f]{16,}|(?<=job:)[^:]+", "*", name)
        entry = out.setdefault(family, {"keys": 0, "bytes": 0})
        entry["keys"] += 1
        entry["bytes"] += int(client.memory_usage(key) or 0)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["bytes"]))


def run(n: int, root: Path, images: Path, cache_max_bytes: int) -> dict[str, Any]:
    broker_port, cache_port = free_port(), free_port()
    broker_url, cache_url = f"redis://127.0.0.1:{broker_port}/0", f"redis://127.0.0.1:{cache_port}/0"
    servers = [start_redis(broker_port, root), start_redis(cache_port, root)]
    store = root / "store"
    env = {**os.environ, "OCRQ_REDIS__URL": broker_url, "OCRQ_REDIS__CACHE_URL": cache_url,
           "OCRQ_REDIS__CACHE_MAX_BYTES": str(cache_max_bytes), "OCRQ_STORE__PATH": str(store),
           "OCRQ_ENGINE__KIND": "simulated", "OCRQ_LIMITS__ALLOWED_ROOTS": json.dumps([str(images)]),
           "OCRQ_METRICS_PORT": "0", "OCRQ_LOG_LEVEL": "WARNING"}
    env.pop("OCRQ_CONFIG", None)
    worker = start_worker(env, "scale", root / "worker.log", broker_url, timeout=120,
                          concurrency=Settings().queue.concurrency)
    broker, cache = redis.Redis.from_url(broker_url), redis.Redis.from_url(cache_url)
    try:
        settings = Settings(redis={"url": broker_url, "cache_url": cache_url, "cache_max_bytes": cache_max_bytes},
                            store={"path": store}, limits={"allowed_roots": [images]})
        client = Client(settings)
        baseline = settled(broker, 1.0)
        baseline_stats = {k: v for k, v in broker.memory_stats().items() if isinstance(v, int)}
        sampler = Sampler({"broker": broker, "cache": cache})
        sampler.start()
        t0 = time.perf_counter()
        job = client.submit([str(images)], job="scale")
        t_submit = time.perf_counter() - t0
        counts = job.wait(timeout=24 * 3600, poll=1.0)
        t_final = time.perf_counter() - t0
        marker = job.wait_export(timeout=3600, poll=0.5)
        t_export = time.perf_counter() - t0
        sampler.stop()
        assert counts["done"] == n and counts["total"] == n, counts
        t = time.perf_counter()
        status_counts = client.job("scale").status()
        cost = job_cost(client.index, "scale", settings.gpu_hour_usd)
        status_ms = (time.perf_counter() - t) * 1000
        assert status_counts["done"] == n and cost.done == n
        after = settled(broker)
        families = key_families(broker)
        stats = {k: v for k, v in broker.memory_stats().items() if isinstance(v, int)}
        t = time.perf_counter()
        read = sum(1 for _ in job.results())
        read_s = time.perf_counter() - t
        assert read == n, read
        archived = client.index.archived("scale")
        client.close()
        # the export's own time, from the worker's clocks: the last image recorded done → _SUCCESS
        export_s = max(float(marker["written"]) - client.index.cost("scale")["last_done"], 1e-3)
        return {
            "images": n, "submit_s": round(t_submit, 2), "final_s": round(t_final, 2),
            "img_per_s": round(n / t_final, 1), "export_s": round(export_s, 2),
            "export_lines_per_s": round(marker["lines"] / export_s, 1), "export_seen_s": round(t_export, 2),
            "status_ms": round(status_ms, 2), "results_per_s": round(read / read_s, 1),
            "archived": archived,
            "broker_baseline_bytes": baseline, "broker_peak_bytes": sampler.peak("broker"),
            "broker_after_bytes": after,
            "peak_bytes_per_image": round((sampler.peak("broker") - baseline) / n, 1),
            "after_bytes_per_image": round((after - baseline) / n, 2),
            "cache_peak_bytes": sampler.peak("cache"), "cache_max_bytes": cache_max_bytes,
            "after_keys": families, "after_memory_stats": stats, "baseline_memory_stats": baseline_stats,
            "samples": [[round(ts, 1), s["broker"], s["cache"]] for ts, s in sampler.samples],
        }
    finally:
        stop(worker)
        for server in servers:
            server.terminate()
            server.wait(10)


def table(r: dict[str, Any]) -> str:
    mib = 2 ** 20
    rows = [
        ("images", f"{r['images']:,}"),
        ("Redis (broker) peak over baseline", f"{(r['broker_peak_bytes'] - r['broker_baseline_bytes']) / mib:,.1f} MiB"
                                              f" = **{r['peak_bytes_per_image']:,} B per image**"),
        ("Redis (broker) after the job (exported, archived)",
         f"{(r['broker_after_bytes'] - r['broker_baseline_bytes']) / mib:,.2f} MiB"
         f" = **{r['after_bytes_per_image']:,} B per image**"),
        ("hot cache (its own Redis) peak", f"{r['cache_peak_bytes'] / mib:,.1f} MiB"
                                           f" (budget {r['cache_max_bytes'] / mib:,.0f} MiB)"),
        ("submit", f"{r['submit_s']:,} s"),
        ("submit → last image final", f"{r['final_s']:,} s = {r['img_per_s']:,} img/s"),
        ("export (last image → `_SUCCESS`)", f"{r['export_s']:,} s = {r['export_lines_per_s']:,} lines/s"),
        ("`ocrq status` (counts + cost) on the finished job", f"{r['status_ms']:,} ms"),
        ("`Job.results()` read-back (from the store)", f"{r['results_per_s']:,} img/s"),
    ]
    return "\n".join(["| measure | value |", "|---|---:|", *(f"| {k} | {v} |" for k, v in rows)])


def plot(r: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ts = [s[0] for s in r["samples"]]
    mib = 2 ** 20
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot(ts, [s[1] / mib for s in r["samples"]], label="broker Redis used_memory")
    ax.plot(ts, [s[2] / mib for s in r["samples"]], label="cache Redis used_memory")
    ax.axhline(r["cache_max_bytes"] / mib, color="C1", ls=":", label="hot cache budget")
    ax.axvline(r["final_s"], color="k", ls="--", lw=0.8, label="last image final")
    ax.set_xlabel("seconds since submit")
    ax.set_ylabel("MiB")
    ax.set_title(f"one job of {r['images']:,} images (simulated engine, one worker)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale")
    parser.add_argument("--images", type=int, default=1_000_000)
    parser.add_argument("--cache-max-bytes", type=int, default=Settings().redis.cache_max_bytes)
    parser.add_argument("--no-write", action="store_true", help="print only; docs/bench/ stays as it is")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ocrq-scale-") as tmp:
        root = Path(tmp)
        t = time.perf_counter()
        render(root / "images", args.images)
        print(f"rendered {args.images:,} images in {time.perf_counter() - t:.0f} s", flush=True)
        result = run(args.images, root, root / "images", args.cache_max_bytes)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    result["run"] = {"date": time.strftime("%Y-%m-%d"), "commit": commit, "host": platform.node(),
                     "cpus": os.cpu_count(), "command": f"python -m bench.scale --images {args.images}"}
    print(table(result))
    print("left in the broker's Redis:", json.dumps(result["after_keys"]))
    print("MEMORY STATS before → after:", json.dumps({k: [result["baseline_memory_stats"].get(k), v]
                                                      for k, v in result["after_memory_stats"].items()
                                                      if v != result["baseline_memory_stats"].get(k)}))
    if not args.no_write:
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "scale.json").write_text(json.dumps(result, indent=1) + "\n")
        plot(result, OUT / "scale.png")
    summary = {k: v for k, v in result.items() if k != "samples"}
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

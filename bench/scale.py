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
- img/s from the submit to the job's last image;
- store requests per image (``--s3-images``, 2,000 by default) against moto's S3 server, which
  counts what it serves: a first pass and a cached pass, each to its export and archive, and
  the read-back of each.

Writes ``docs/bench/scale.{json,md,png}`` (``--no-write``: prints only). The last line printed is
the JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import redis

from bench import provenance
from bench.overhead import ocrq_passes, render
from bench.report_tables import wrap
from bench.services import free_port, start_redis, start_worker, stop
from ocrq.jobs.cost import job_cost
from ocrq.settings import Settings
from producer.client import Client

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "bench"


def host_cpu() -> dict[str, int]:
    """/proc/stat's first line, in ticks: busy (user, nice, system, irq, softirq), iowait, idle."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    except (OSError, ValueError):
        return {"busy": 0, "iowait": 0, "idle": 0}
    user, nice, system, idle, iowait, irq, softirq = fields
    return {"busy": user + nice + system + irq + softirq, "iowait": iowait, "idle": idle}


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
        self.cpu_start = host_cpu()
        while not self._halt.is_set():
            self.samples.append((time.monotonic() - self.t0, self.read()))
            self._halt.wait(self.every)
        self.cpu_end = host_cpu()

    def cpu(self) -> dict[str, float]:
        """The host's CPU time over the sampling, as shares: busy (user + system), iowait, idle
        (what bounds a run on this machine: its 2 cores, or its disk)."""
        spent = {k: self.cpu_end[k] - self.cpu_start[k] for k in self.cpu_start}
        total = sum(spent.values()) or 1
        return {k: round(v / total, 3) for k, v in spent.items()}

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
            "host_cpu_during_job": sampler.cpu(),
            "after_keys": families, "after_memory_stats": stats, "baseline_memory_stats": baseline_stats,
            "samples": [[round(ts, 1), s["broker"], s["cache"]] for ts, s in sampler.samples],
        }
    finally:
        stop(worker)
        for server in servers:
            server.terminate()
            server.wait(10)


class CountingMoto:
    """moto's S3 server on a free port, counting the requests it serves by kind (GET, PUT, LIST,
    DELETE, HEAD, POST): what S3 would bill."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        from bench.services import free_port

        self.port = free_port()
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()
        meter = self

        class Server(ThreadedMotoServer):
            def _server_entry(self) -> None:
                from moto.server import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
                from werkzeug.serving import make_server

                app = DomainDispatcherApplication(create_backend_app)

                def counted(environ: dict[str, Any], start_response: Any) -> Any:
                    method = environ["REQUEST_METHOD"]
                    if method == "GET" and "list-type" in environ.get("QUERY_STRING", ""):
                        method = "LIST"
                    with meter._lock:
                        meter.counts[method] = meter.counts.get(method, 0) + 1
                    return app(environ, start_response)

                self._server = make_server(self._ip_address, self._port, counted, True,
                                           request_handler=MotoRequestHandler)
                self._server_ready_event.set()
                self._server.serve_forever()

        self.server = Server(ip_address="127.0.0.1", port=self.port, verbose=False)

    def take(self) -> dict[str, int]:
        """The counts since the last take."""
        with self._lock:
            out, self.counts = self.counts, {}
        return out


def s3_requests(n: int, root: Path, images: Path) -> dict[str, Any]:
    """Store requests per image against moto's S3: a first pass (n new images), a pass over the
    same bytes as another job (every image a cache hit), each to its export and archive, then the
    read-back of each (``Job.results()``)."""
    import boto3

    moto = CountingMoto()
    moto.server.start()
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    server = start_redis(port, root)
    store = {"kind": "s3", "bucket": "scale", "endpoint_url": f"http://127.0.0.1:{moto.port}",
             "access_key_id": "testing", "secret_access_key": "testing"}
    boto3.client("s3", endpoint_url=store["endpoint_url"], region_name="us-east-1", aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_bucket(Bucket="scale")
    refs = [str(images / f"img_{i:06d}.png") for i in range(n)]
    env = {**os.environ, "OCRQ_REDIS__URL": url, "OCRQ_STORE__KIND": "s3", "OCRQ_STORE__BUCKET": "scale",
           "OCRQ_STORE__ENDPOINT_URL": store["endpoint_url"], "OCRQ_STORE__ACCESS_KEY_ID": "testing",
           "OCRQ_STORE__SECRET_ACCESS_KEY": "testing", "OCRQ_ENGINE__KIND": "simulated",
           "OCRQ_LIMITS__ALLOWED_ROOTS": json.dumps([str(images)]), "OCRQ_METRICS_PORT": "0",
           "OCRQ_LOG_LEVEL": "WARNING"}
    env.pop("OCRQ_CONFIG", None)
    worker = start_worker(env, "scale-s3", root / "worker-s3.log", url, timeout=120)
    out: dict[str, Any] = {"images": n}
    try:
        client = Client(Settings(redis={"url": url}, store=store, limits={"allowed_roots": [images]}))
        for name in ("first", "cached"):
            moto.take()
            job = client.submit(refs, job=f"s3-{name}")
            job.wait(timeout=3600, poll=0.5)
            job.wait_export(timeout=600, poll=0.5)
            time.sleep(1.0)  # the archive's deletes after the marker
            run = moto.take()
            assert sum(1 for _ in job.results()) == n
            read = moto.take()
            counted = client.index.cost(job.name)  # what `ocrq status` shows, next to what moto served
            out[name] = {"requests": run, "per_image": {k: round(v / n, 3) for k, v in sorted(run.items())},
                         "read_back_per_image": {k: round(v / n, 3) for k, v in sorted(read.items())},
                         "ocrq_counted_per_image": {"PUT+LIST": round(counted["store_puts"] / n, 3),
                                                    "GET": round(counted["store_gets"] / n, 3)}}
        client.close()
    finally:
        stop(worker)
        server.terminate()
        server.wait(10)
        moto.server.stop()
    return out


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
    cpu = r.get("host_cpu_during_job")
    if cpu:
        rows.append(("host CPU, submit → export (all processes)",
                     f"busy {cpu['busy']:.0%}, iowait {cpu['iowait']:.0%}, idle {cpu['idle']:.0%}"))
    ref = r.get("reference")
    if ref:
        rows.append((f"throughput, submit → last result read back, against `make bench-overhead`'s first pass "
                     f"({ref['images']:,} images) in the same run",
                     f"{ref['this_job_img_s']:,} vs {ref['overhead_first_img_s']:,} img/s = **{ref['ratio']}×**"))
        if ref.get("host_cpu"):
            c = ref["host_cpu"]
            rows.append(("host CPU during the reference's two passes",
                         f"busy {c['busy']:.0%}, iowait {c['iowait']:.0%}, idle {c['idle']:.0%}"))
    s3 = r.get("s3")
    if s3:
        for name in ("first", "cached"):
            per = s3[name]["per_image"]
            rows.append((f"S3 requests per image, {name} pass ({s3['images']:,} images, to export and archive)",
                         ", ".join(f"{k} {v}" for k, v in per.items())))
            rows.append((f"… as `ocrq status` counts them ({name} pass)",
                         ", ".join(f"{k} {v}" for k, v in s3[name]["ocrq_counted_per_image"].items())))
            rows.append((f"S3 requests per image, reading the {name} pass back",
                         ", ".join(f"{k} {v}" for k, v in s3[name]["read_back_per_image"].items())))
    return "\n".join(["| measure | value |", "|---|---:|", *(f"| {k} | {v} |" for k, v in rows)])


def report(r: dict[str, Any], plotted: bool) -> str:
    run_ = r["run"]
    left = "\n".join(f"| `{fam}` | {v['keys']:,} | {v['bytes']:,} |" for fam, v in r["after_keys"].items())
    return f"""# Redis over the life of a large job

What a job of {r['images']:,} images costs the broker's Redis, and what it leaves behind.

| measured | code | machine | reproduce |
|---|---|---|---|
| {run_['date']} | commit `{run_['commit']}` | {run_['cpus']}-core host | `{run_['command']}` |

`{run_['command']}` is `python -m bench scale` (`make bench-scale`): one job of {r['images']:,} distinct
small PNGs through one `ocrq worker` (simulated engine, no latency), the local store, the broker's
Redis and a cache-only Redis (`redis.cache_url`) as docker-compose.yml runs them. Bytes are
`used_memory` over the broker's baseline (the worker started, nothing submitted); the job is
followed to its export and archive.

{table(r)}

What stays in the broker's Redis once the job is finished, exported and archived (`MEMORY USAGE`
by key family; the rest of `used_memory` over the baseline is connection buffers and allocator
state, the same for any job size):

| keys | count | bytes |
|---|---:|---:|
{left}

{"![Redis memory over the job](scale.png)" if plotted else ""}

Where the bytes go: while a job runs, Redis holds one marker per image (a hash entry of ~90
bytes: `ocrq/jobs/index.py`), the messages of at most `queue.window` (65,536) of its images
(`ocrq/jobs/feed.py`: the rest of the refs wait in the store), and the records of the images the
workers are on. Once its export is written the job is archived: the markers go, its meta and
counts stay (`ocrq/keys.py` gives every key's bound). The store requests are per image on S3
(moto's server counts what it serves): a first pass writes a cache entry per image and one
result part per chunk of 64 (`ocrq/output/parts.py`), reads the store once per image for the cache
(a miss), and the export and the read-back read the parts (one GET per chunk).
"""


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
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log
    parser = argparse.ArgumentParser(prog="python -m bench.scale")
    parser.add_argument("--images", type=int, default=1_000_000)
    parser.add_argument("--cache-max-bytes", type=int, default=Settings().redis.cache_max_bytes)
    parser.add_argument("--reference", type=int, default=20_000,
                        help="images of the `make bench-overhead` first pass run beside it (0: skip)")
    parser.add_argument("--s3-images", type=int, default=2000,
                        help="images of the S3 request count (moto's server; 0: skip it)")
    parser.add_argument("--no-write", action="store_true", help="print only; docs/bench/ stays as it is")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ocrq-scale-") as tmp:
        root = Path(tmp)
        t = time.perf_counter()
        render(root / "images", args.images)
        print(f"rendered {args.images:,} images in {time.perf_counter() - t:.0f} s", flush=True)
        if args.reference:
            # `make bench-overhead`'s first pass, on this host in this run: the throughput reference
            ref_root = root / "reference"
            ref_paths = render(ref_root / "in", args.reference)
            cpu0 = host_cpu()
            first, _ = ocrq_passes(ref_paths, ref_root, None)
            cpu1 = host_cpu()
            ref_total = sum(cpu1[k] - cpu0[k] for k in cpu0) or 1
            ref_cpu = {k: round((cpu1[k] - cpu0[k]) / ref_total, 3) for k in cpu0}
            shutil.rmtree(ref_root, ignore_errors=True)
        result = run(args.images, root, root / "images", args.cache_max_bytes)
        if args.reference:
            # the same measure as the reference: from the submit to the last result read back
            big = result["images"] / (result["final_s"] + result["images"] / result["results_per_s"])
            result["reference"] = {"images": args.reference, "overhead_first_img_s": round(first, 1),
                                   "this_job_img_s": round(big, 1), "ratio": round(big / first, 3),
                                   "host_cpu": ref_cpu}
        if args.s3_images:
            result["s3"] = s3_requests(min(args.s3_images, args.images), root, root / "images")
    result["run"] = {"date": time.strftime("%Y-%m-%d"), "commit": provenance.commit(), "host": platform.node(),
                     "cpus": os.cpu_count(), "command": f"python -m bench.scale --images {args.images}"}
    print(table(result))
    print("left in the broker's Redis:", json.dumps(result["after_keys"]))
    print("MEMORY STATS before → after:", json.dumps({k: [result["baseline_memory_stats"].get(k), v]
                                                      for k, v in result["after_memory_stats"].items()
                                                      if v != result["baseline_memory_stats"].get(k)}))
    if not args.no_write:
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "scale.json").write_text(json.dumps(result, indent=1) + "\n")
        plotted = plot(result, OUT / "scale.png")
        # between bench/report.py's markers, so `python -m bench report --check` sees it match scale.json
        (OUT / "scale.md").write_text(wrap("scale", "scale.json", report(result, plotted)))
    summary = {k: v for k, v in result.items() if k != "samples"}
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

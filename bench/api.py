"""The HTTP API's own cost, side by side in one run (docs/bench/api.md):

1. **submit**: a manifest of ``--refs`` lines (1,000,000 by default) submitted through
   ``Client.submit`` (the Python producer reading it from disk), then uploaded to ``ocrq serve``
   (multipart, ``POST /v1/jobs``) as a new job: refs/s of each, their ratio, and the API
   process's peak RSS (VmHWM). Refs are ``s3://`` keys (the intake checks them without a request
   each, as for any S3 ref); no worker runs, so each job fills its feed window and waits.
2. **get**: ``GET /v1/jobs/{id}`` of the million-image job under 50 concurrent connections
   (wrk, a C load generator, so the client takes little of the machine's two cores): p50 and p99
   latency and requests a second.
3. **results**: a job of ``--results-images`` images run by a worker (simulated engine, no
   latency), read back whole by ``ocrq results JOB --out F`` and by ``curl`` from
   ``GET /v1/jobs/{id}/results``: lines a second of each and their ratio.

4. **pages**: the jobs pages' own cost (``GET /`` and ``/jobs/{id}`` with 10,000 jobs in the
   index): ``bench.pages``, run by the same command, writes docs/bench/pages.md.

    python -m bench api [--refs 1000000] [--results-images 20000] [--out docs/bench/api.md] [--no-pages]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from api.tenants import create_token
from bench.overhead import render
from bench.provenance import header
from bench.services import free_port, start_redis, start_worker, stop
from ocrq.settings import Settings
from producer.client import Client


def _rss_peak_mb(pid: int) -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", text).group(1)) / 1024  # type: ignore[union-attr]


def _manifest(path: Path, n: int) -> None:
    with path.open("w") as fh:
        for i in range(n):
            fh.write(f'{{"ref": "s3://bench-images/scans/{i:08d}.png", "id": "{i}"}}\n')


def _serve(env: dict[str, str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ocrq_cli", "serve", "--port", str(port)], env=env,
                            stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError(f"ocrq serve did not start: {log.read_text()[-2000:]}")


def submit_rows(client: Client, url: str, token: str, manifest: Path, api_pid: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    job = client.submit([str(manifest)], job="bench-client")
    direct_s = time.perf_counter() - t0
    n = job.status()["total"]
    t0 = time.perf_counter()
    with manifest.open("rb") as fh:
        answer = httpx.post(f"{url}/v1/jobs", headers={"Authorization": f"Bearer {token}"}, timeout=3600,
                            files={"manifest": ("manifest.jsonl", fh, "application/jsonl")},
                            data={"options": json.dumps({"name": "bench-api"})})
    api_s = time.perf_counter() - t0
    assert answer.status_code == 201, answer.text[:2000]
    assert answer.json()["counts"]["total"] == n, answer.text[:500]
    return {"refs": n, "client_s": round(direct_s, 2), "client_refs_per_s": round(n / direct_s),
            "api_s": round(api_s, 2), "api_refs_per_s": round(n / api_s), "ratio": round(direct_s / api_s, 3),
            "api_rss_peak_mb": round(_rss_peak_mb(api_pid), 1)}


def get_latency(url: str, token: str, root: Path, seconds: int = 15, connections: int = 50,
                every_ms: int = 0) -> dict[str, Any]:
    """wrk's latency of ``GET /v1/jobs/{id}``: ``connections`` clients, each sending its next
    request as soon as the last is answered (``every_ms`` 0: the server's capacity), or that many
    milliseconds after (a poller's pace)."""
    wrk = shutil.which("wrk")
    if wrk is None:
        raise SystemExit("bench api needs wrk (a C HTTP load generator): apt-get install wrk")
    script = root / "delay.lua"
    # each client waits a random time around ``every_ms`` (0 to twice it): pollers out of step, as
    # real ones are (a fixed delay keeps all 50 in step, arriving together each time)
    script.write_text(f"function delay()\n  return {every_ms} > 0 and math.random(0, {2 * every_ms}) or 0\nend\n")
    out = subprocess.run([wrk, "-t2", f"-c{connections}", f"-d{seconds}s", "--latency", "-s", str(script), "-H",
                          f"Authorization: Bearer {token}", f"{url}/v1/jobs/bench-api"],
                         capture_output=True, text=True, check=True).stdout
    lat = dict(re.findall(r"^\s+(50|99)%\s+([\d.]+\w+)$", out, flags=re.MULTILINE))
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {"connections": connections, "every_ms": every_ms, "seconds": seconds, "p50_ms": _ms(lat["50"]),
            "p99_ms": _ms(lat["99"]),
            "requests_per_s": round(rps), "non_2xx": int(errors.group(1)) if errors else 0}


def _ms(text: str) -> float:
    value, unit = re.match(r"([\d.]+)(\w+)", text).groups()  # type: ignore[union-attr]
    return round(float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit], 2)


def results_rows(env: dict[str, str], root: Path, url: str, token: str, n: int, redis_url: str,
                 client: Client) -> dict[str, Any]:
    paths = render(root / "images", n)
    worker = start_worker({**env, "OCRQ_ENGINE__KIND": "simulated"}, "bench-api", root / "worker.log", redis_url, 300)
    try:
        client.submit(paths, job="bench-results").wait(timeout=3600)
    finally:
        stop(worker)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "ocrq_cli", "results", "bench-results", "--out", str(root / "cli.jsonl")],
                   env=env, check=True, capture_output=True)
    cli_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    subprocess.run(["curl", "-sf", "-H", f"Authorization: Bearer {token}", "-o", str(root / "api.jsonl"),
                    f"{url}/v1/jobs/bench-results/results"], check=True)
    api_s = time.perf_counter() - t0
    lines = sum(1 for _ in (root / "api.jsonl").open())
    assert lines == sum(1 for _ in (root / "cli.jsonl").open()) == n
    return {"images": n, "cli_s": round(cli_s, 2), "cli_lines_per_s": round(n / cli_s), "api_s": round(api_s, 2),
            "api_lines_per_s": round(n / api_s), "ratio": round(cli_s / api_s, 3)}


def report(out: dict[str, Any], args: argparse.Namespace) -> str:
    s, g, c, r = out["submit"], out["get"], out["get_capacity"], out["results"]
    command = "python -m bench api" + ("" if args.refs == 1_000_000 else f" --refs {args.refs}")
    return (
        "# The HTTP API's own cost\n\n"
        + header("2-core VM (this repository's CI size), the load generator and the server on it", command)
        + "\n| measured | ocrq over HTTP | the Python producer | ratio | target |\n|---|---:|---:|---:|---|\n"
        f"| a {s['refs']:,}-line manifest submitted, refs/s | {s['api_refs_per_s']:,} ({s['api_s']} s) | "
        f"{s['client_refs_per_s']:,} ({s['client_s']} s) | {s['ratio']}× | ≥ 0.8× |\n"
        f"| the API process's peak RSS during it | {s['api_rss_peak_mb']} MB | | | ≤ 300 MB |\n"
        f"| a {r['images']:,}-image job's results read whole, lines/s | {r['api_lines_per_s']:,} ({r['api_s']} s, "
        f"curl) | {r['cli_lines_per_s']:,} ({r['cli_s']} s, `ocrq results --out`) | {r['ratio']}× | ≥ 0.8× |\n\n"
        f"`GET /v1/jobs/{{id}}` of the {s['refs']:,}-image job (wrk, {g['seconds']} s a row; target p99 ≤ 20 ms):\n\n"
        "| clients | each sends | p50 ms | p99 ms | requests/s | not 2xx |\n|---:|---|---:|---:|---:|---:|\n"
        f"| {g['connections']} | its next request 0-{2 * g['every_ms']} ms after an answer (pollers) | {g['p50_ms']} | "
        f"{g['p99_ms']} | {g['requests_per_s']:,} | {g['non_2xx']} |\n"
        f"| {c['connections']} | its next request at once (the server's capacity) | {c['p50_ms']} | {c['p99_ms']} | "
        f"{c['requests_per_s']:,} | {c['non_2xx']} |\n\n"
        "How it runs: a redis-server on a free port, a local store, one `ocrq serve` process (uvicorn, one "
        "worker process) and the load generator on the same two cores. The manifest's refs are `s3://` keys "
        "(checked by the intake without a request each); no worker runs during the submit rows, so each job "
        "fills its feed window (65,536 images in messages) and waits. The results rows run a worker on the "
        "simulated engine first, then read the finished job through the store; both readers are timed as "
        "commands, as a user runs them (`ocrq results` with its interpreter's start). The capacity row is "
        "closed-loop (each client sends again the moment it is answered), so its latency is mostly waiting "
        "in line: 50 clients over the requests a second the server answers. On a machine busy with other "
        "work the tails grow with the load (a run at load average 7 gave p99 48 ms for the pollers).\n\n"
        "The jobs pages' own cost (`GET /` and `/jobs/{id}` with 10,000 jobs in the index), measured by the "
        "same command: [pages.md](pages.md).\n\n"
        f"```json\n{json.dumps(out, indent=1)}\n```\n")


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench api", description=__doc__.split("\n\n")[0])
    ap.add_argument("--refs", type=int, default=1_000_000)
    ap.add_argument("--results-images", type=int, default=20_000)
    ap.add_argument("--out", type=Path, default=Path("docs/bench/api.md"))
    ap.add_argument("--no-pages", action="store_true", help="leave out the jobs pages' rows (bench.pages)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ocrq-bench-api-") as tmp:
        root = Path(tmp)
        port = free_port()
        redis_proc = start_redis(port, root)
        redis_url = f"redis://127.0.0.1:{port}/0"
        tenants = root / "tenants.json"
        token, _ = create_token(tenants, "default", "bench")
        env = {**os.environ, "OCRQ_REDIS__URL": redis_url, "OCRQ_STORE__PATH": str(root / "store"),
               "OCRQ_VAR_DIR": str(root / "var"), "OCRQ_API__TENANTS_FILE": str(tenants),
               "OCRQ_API__TENANTS": json.dumps({"default": {"requests_per_s": 1_000_000,
                                                            "max_in_flight": 10_000_000}}),
               "OCRQ_LIMITS__ALLOWED_ROOTS": json.dumps([str(root)]), "OCRQ_METRICS_PORT": "0"}
        env.pop("OCRQ_CONFIG", None)
        settings = Settings(redis={"url": redis_url}, store={"kind": "local", "path": root / "store"},
                            limits={"allowed_roots": [root]})
        client = Client(settings)
        api, url = _serve(env, root / "api.log")
        try:
            manifest = root / "manifest.jsonl"
            _manifest(manifest, args.refs)
            out = {"submit": submit_rows(client, url, token, manifest, api.pid)}
            print(json.dumps(out["submit"]), flush=True)
            out["get"] = get_latency(url, token, root, every_ms=100)
            out["get_capacity"] = get_latency(url, token, root)
            print(json.dumps(out["get"]), json.dumps(out["get_capacity"]), flush=True)
            out["results"] = results_rows(env, root, url, token, args.results_images, redis_url, client)
            print(json.dumps(out["results"]), flush=True)
        finally:
            stop(api)
            redis_proc.terminate()
    args.out.write_text(report(out, args))
    print(f"wrote {args.out}")
    if not args.no_pages:  # the jobs pages: GET / and /jobs/{id} with 10,000 jobs (docs/bench/pages.md)
        subprocess.run([sys.executable, "-m", "bench.pages", "--jobs", "10000",
                        "--out", str(args.out.with_name("pages.md"))], check=True)


if __name__ == "__main__":
    main()
